"""A loss that turns NaN (`train.on_nonfinite`): `stop` ends the run with exit 1 and names the
step, the rank and the newest finite checkpoint, which `keep_last` never prunes; `skip` drops
the bad updates and stops only after 10 in a row."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.conftest import metrics_of, only_run_dir, run_train, write_spec
from tests.tiny_recipes import tiny_recipe, write_recipe

pytestmark = [pytest.mark.timeout(300), pytest.mark.launcher_only]

# Hooks on the tiny recipe: the loss of rank `bad_rank` is NaN at its optimizer steps
# `first`..`last` (1 micro-step each).
NAN_HOOKS = """
import os

calls = 0
WINDOW = {}


def build_model(first, last, bad_rank=1):
    WINDOW.update(first=first, last=last, here=int(os.environ["RANK"]) == bad_rank)
    return tiny.build_model()


def loss(model, batch):
    global calls
    calls += 1
    value = tiny.loss(model, batch)
    if WINDOW["here"] and WINDOW["first"] <= calls <= WINDOW["last"]:
        value = value * float("nan")
    return value
"""


def _spec(folder: Path, policy: str, last: int) -> Path:
    recipe = write_recipe(folder, NAN_HOOKS, "nan_recipe.py")
    return write_spec(
        folder / "run.yaml",
        recipe=tiny_recipe(recipe, model={"first": 30, "last": last}, n_samples=4096),
        train={"max_steps": 60, "log_every": 5, "on_nonfinite": policy},
        checkpoint={"every_n_steps": 10, "keep_last": 1},
    )


def _checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def _finite_weights(checkpoint: Path, scratch: Path) -> bool:
    dcp_to_torch_save(checkpoint, scratch)
    model = torch.load(scratch, weights_only=True)["model"]
    return all(torch.isfinite(t).all() for t in model.values())


@pytest.mark.smoke
def test_stop_names_the_step_the_rank_and_the_last_finite_checkpoint(tmp_path: Path) -> None:
    result = run_train(["--config", str(_spec(tmp_path, "stop", last=10**9))], cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    run = only_run_dir(tmp_path / "runs")
    finite = run / "checkpoints" / "step-00000020"
    assert "non-finite values: step 30: the loss on rank 1 and the gradient norm are" in output
    assert f"newest finite checkpoint at a lower learning rate: train --resume {finite}" in output
    assert "Traceback" not in output
    # No checkpoint after the bad step was written; keep_last: 1 left the finite one.
    assert _checkpoints(run) == ["step-00000020"]
    assert _finite_weights(finite, tmp_path / "w.pt")


def test_skip_drops_the_bad_updates_and_goes_on(tmp_path: Path) -> None:
    result = run_train(["--config", str(_spec(tmp_path, "skip", last=32))], cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    for step in (30, 31, 32):
        bad = f"step {step}: the loss on rank 1 and the gradient norm are not finite"
        assert f"{bad}; update skipped" in output
    assert "done: 60 steps, 3 updates skipped (non-finite)" in output
    run = only_run_dir(tmp_path / "runs")
    assert json.loads((run / "summary.json").read_text())["skipped_updates"] == 3
    losses = [r["loss"] for r in metrics_of(run)]
    assert all(loss == loss for loss in losses)  # no NaN in any logged mean
    assert _finite_weights(run / "checkpoints" / "step-00000060", tmp_path / "w.pt")


def test_skip_stops_after_ten_skips_in_a_row(tmp_path: Path) -> None:
    result = run_train(["--config", str(_spec(tmp_path, "skip", last=10**9))], cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "10 updates in a row skipped, the last at step 39: the loss on rank 1" in output
    run = only_run_dir(tmp_path / "runs")
    # Step 30's own update was dropped, so its weights (saved) are finite; 40 is never reached.
    assert _checkpoints(run) == ["step-00000030"]
    assert f"train --resume {run / 'checkpoints' / 'step-00000030'} optim.lr=" in output


@pytest.mark.timeout(300)
def test_the_advice_after_a_stop_is_a_command_that_trains_on(tmp_path: Path) -> None:
    # Inputs and targets of scale 0.1, no bias: SGD is stable below lr 100, and at lr 400 the
    # loss grows 49-fold a step, to infinity near step 23.
    spec = write_spec(
        tmp_path / "run.yaml",
        recipe=tiny_recipe(model={"bias": False}, scale=0.1),
        optim={"name": "SGD", "lr": 400},
        train={"max_steps": 40, "log_every": 1},
        checkpoint={"every_n_steps": 5},
    )
    stopped = run_train(["--config", str(spec)], cwd=tmp_path)
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 1, output
    command = re.search(r"train --resume \S+ optim\.lr=\S+", output)
    assert command, output
    assert command.group(0).endswith("optim.lr=40")  # a tenth of the rate
    resumed = run_train(command.group(0).split()[1:], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "changed on resume: optim.lr 400.0 -> 40.0" in resumed.stdout
    losses = [r["loss"] for r in metrics_of(only_run_dir(tmp_path / "runs"))]
    assert len(losses) == 40 and all(math.isfinite(loss) for loss in losses)
