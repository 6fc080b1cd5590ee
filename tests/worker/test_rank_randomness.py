"""Each data-parallel rank draws its own random numbers (dropout, augmentation), the processes
of a tensor-parallel group the same ones, and a resume continues every rank's streams."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.parallel.dims import ParallelDims
from launcher.parallel.rng import rank_seed
from tests.conftest import only_run_dir, run_train, write_spec
from tests.tiny_recipes import tiny_recipe, write_recipe

# Hooks on the tiny recipe with a hidden layer (a model tensor parallelism can split): its loss
# records what each process's torch, numpy and `random` draw at each step (counted in the
# recipe's own state, which a resume restores).
HOOKS = """
import json, os, random
import numpy as np
import torch

steps = 0

def parallelize(model, mesh):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, parallelize_module,
    )
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

def loss(model, batch):
    global steps
    steps += 1
    drawn = [torch.rand(()).item(), float(np.random.rand()), random.random()]
    path = os.path.join(os.environ["DRAWS"], f"rank-{os.environ['RANK']}.jsonl")
    with open(path, "a") as out:
        out.write(json.dumps({"step": steps, "drawn": drawn}) + "\\n")
    return tiny.loss(model, batch)

def state_dict():
    return {"steps": steps}

def load_state_dict(state):
    global steps
    steps = state["steps"]
"""


def _draws(folder: Path) -> dict[int, dict[int, list[float]]]:
    """By rank, by step: the torch, numpy and `random` draws of that step."""
    found = {}
    for rank in (0, 1):
        lines = (folder / f"rank-{rank}.jsonl").read_text().splitlines()
        found[rank] = {r["step"]: r["drawn"] for r in map(json.loads, lines)}
    return found


def _train(folder: Path, spec: Path, name: str, *args: str) -> dict[int, dict[int, list[float]]]:
    draws = folder / name
    draws.mkdir()
    result = run_train(["--config", str(spec), *args], cwd=folder, env={"DRAWS": str(draws)})
    assert result.returncode == 0, result.stdout + result.stderr
    return _draws(draws)


@pytest.mark.timeout(300)
def test_data_parallel_ranks_draw_apart_and_tensor_parallel_partners_alike(
    tmp_path: Path,
) -> None:
    recipe = write_recipe(tmp_path, HOOKS, "draws.py")
    spec = write_spec(
        tmp_path / "run.yaml",
        recipe=tiny_recipe(recipe, model={"hidden": 8}, n_samples=128, target="sum"),
        train={"max_steps": 4, "log_every": 1},
        checkpoint={"every_n_steps": 2},
    )
    ddp = _train(tmp_path, spec, "ddp")
    assert sorted(ddp[0]) == sorted(ddp[1]) == [1, 2, 3, 4]
    generators = ("torch", "numpy", "random")
    for step in range(1, 5):
        for generator, mine, theirs in zip(generators, ddp[0][step], ddp[1][step], strict=True):
            assert mine != theirs, f"step {step}: ranks 0 and 1 drew the same {generator} number"
    # Resumed at step 2, every rank goes on drawing what it drew.
    run = only_run_dir(tmp_path / "runs")
    resumed = _train(
        tmp_path, spec, "resumed", "--resume", str(run / "checkpoints" / "step-00000002"),
        "--run-dir", str(tmp_path / "branch"),
    )  # fmt: skip
    for rank in (0, 1):
        assert resumed[rank] == {step: ddp[rank][step] for step in (3, 4)}, rank
    # tp 2 on 2 processes: one data-parallel rank, whose two processes share a batch.
    tp = _train(
        tmp_path, spec, "tp", "launch.strategy=fsdp", "parallel.tp=2", "--run-dir",
        str(tmp_path / "tp"),
    )  # fmt: skip
    assert tp[0] == tp[1] == ddp[0]  # data-parallel rank 0's, whatever the layout


def test_the_seed_of_a_rank_is_its_data_parallel_ranks() -> None:
    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=2)
    seeds = [rank_seed(7, dims.dp_rank(rank)) for rank in range(dims.world)]
    assert seeds[0] == seeds[1] != seeds[2] == seeds[3]
    assert len({rank_seed(seed, rank) for seed in range(4) for rank in range(4)}) == 16
    assert rank_seed(-1, 0) != rank_seed(1, 0)
