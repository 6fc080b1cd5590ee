"""Evaluation on the torch_xla strategies, on XLA's CPU devices: the exact mean over a split
whose last batch does not divide over the devices, compiled at the first evaluation only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recipes import mlp
from tests.conftest import metrics_of
from tests.parallel.test_xla import _spec, _summary, _train, needs_xla
from tests.tiny_recipes import tiny_recipe, write_recipe
from tests.worker.test_nonfinite import NAN_HOOKS

pytestmark = [pytest.mark.timeout(400), pytest.mark.xla]
N = 501  # batches of 8 per device: the last one holds 21 samples


@needs_xla
@pytest.mark.parametrize(("strategy", "devices"), [("xla", 1), ("xla_spmd", 4), ("xla_fsdp", 4)])
def test_xla_evaluates_the_exact_mean_and_compiles_it_once(
    tmp_path: Path, strategy: str, devices: int
) -> None:
    spec = _spec(
        tmp_path,
        strategy,
        devices,
        recipe={"dataset": {"n_samples": N}},
        data={"batch_size": 8},
        optim={"name": "SGD", "lr": 0.0},  # the model stays as built: the mean is known here
        train={"max_steps": 12, "log_every": 2},
        eval={"every_n_steps": 3},
    )
    result = _train(tmp_path, spec, "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "XLA compiled" not in result.stdout + result.stderr
    records = metrics_of(tmp_path / "run")
    evals = {r["step"]: r["val/loss"] for r in records if "eval_s" in r}
    assert sorted(evals) == [3, 6, 9, 12]

    torch.manual_seed(0)
    model = mlp.build_model()
    x, y = mlp.build_dataset("val", n_samples=N).tensors
    with torch.no_grad():
        expected = ((model(x) - y) ** 2).mean().item()
    for value in evals.values():
        assert value == pytest.approx(expected, rel=1e-5)

    summary = _summary(tmp_path / "run")
    first, later = summary["xla_phase_compilations"]["eval"]
    assert first > 0 and later == 0  # compiled at the first evaluation, never again
    assert summary["xla_compilations_after_warmup"] == 0


@needs_xla
@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_nan_loss_on_xla(tmp_path: Path, policy: str) -> None:
    """The checks run inside XLA's step graph: `skip` drops steps 30-32 and goes on without a
    recompilation warning; `stop` ends the run, naming step 30 and the last finite save."""
    recipe = write_recipe(tmp_path, NAN_HOOKS, "nan_recipe.py")
    spec = _spec(
        tmp_path,
        "xla",
        1,
        recipe=tiny_recipe(recipe, model={"first": 30, "last": 32, "bad_rank": 0}, n_samples=4096),
        train={"max_steps": 40, "log_every": 5, "on_nonfinite": policy},
        checkpoint={"every_n_steps": 10, "keep_last": 1},
    )
    result = _train(tmp_path, spec, "--run-dir", str(tmp_path / "run"))
    output = result.stdout + result.stderr
    if policy == "skip":
        assert result.returncode == 0, output
        assert "done: 40 steps, 3 updates skipped (non-finite)" in output
        assert "XLA compiled" not in output
    else:
        assert result.returncode == 1, output
        assert "non-finite values: step 30: the loss on rank 0" in output
        assert f"train --resume {tmp_path / 'run' / 'checkpoints' / 'step-00000020'}" in output
