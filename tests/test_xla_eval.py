"""Evaluation on the torch_xla strategies, on XLA's CPU devices: the exact mean over a split
whose last batch does not divide over the devices, compiled at the first evaluation only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recipes import mlp
from tests.test_xla import _spec, _summary, _train, needs_xla

pytestmark = pytest.mark.timeout(400)
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
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
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
