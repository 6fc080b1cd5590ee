"""Numerical equivalence: what DDP computes over N processes is what 1 process computes on the
same global batches. This proves gradient averaging and sampler sharding are right."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.conftest import metrics_of, only_run_dir, run_train, write_spec

pytestmark = pytest.mark.timeout(240)


def _train(tmp_path: Path, name: str, devices: int, batch: int, accum: int) -> tuple[list, dict]:
    folder = tmp_path / name
    folder.mkdir()
    spec = write_spec(
        folder / "run.yaml",
        launch={"devices": devices},
        data={"batch_size": batch, "shuffle": True},
        optim={"name": "AdamW", "lr": 1e-2},
        train={"max_steps": 12, "grad_accum_steps": accum, "grad_clip_norm": 1.0},
    )
    result = run_train(["--config", str(spec)], cwd=folder)
    assert result.returncode == 0, result.stderr + result.stdout
    run = only_run_dir(folder / "runs")
    losses = [r["loss"] for r in metrics_of(run)]
    dcp_to_torch_save(run / "checkpoints" / "step-00000012", folder / "final.pt")
    weights = torch.load(folder / "final.pt", weights_only=True)["model"]
    return losses, weights


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list, dict]:
    """One process, global batch 16, no accumulation."""
    return _train(tmp_path_factory.mktemp("ref"), "one", devices=1, batch=16, accum=1)


def _assert_same(run: tuple[list, dict], reference: tuple[list, dict]) -> None:
    losses, weights = run
    ref_losses, ref_weights = reference
    assert len(losses) == len(ref_losses) == 12
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    assert weights.keys() == ref_weights.keys()
    for key in weights:
        torch.testing.assert_close(weights[key], ref_weights[key], rtol=1e-5, atol=1e-5)


def test_ddp_two_processes_equals_one_process(tmp_path: Path, reference) -> None:
    _assert_same(_train(tmp_path, "ddp", devices=2, batch=8, accum=1), reference)


def test_grad_accumulation_equals_the_larger_batch(tmp_path: Path, reference) -> None:
    _assert_same(_train(tmp_path, "accum", devices=1, batch=8, accum=2), reference)


def test_ddp_with_accumulation_skips_sync_and_still_matches(tmp_path: Path, reference) -> None:
    _assert_same(_train(tmp_path, "both", devices=2, batch=4, accum=2), reference)


def test_a_different_batch_really_differs(tmp_path: Path, reference) -> None:
    """Guards the tests above against comparing things that cannot differ."""
    losses, _ = _train(tmp_path, "other", devices=1, batch=8, accum=1)
    assert not torch.allclose(torch.tensor(losses), torch.tensor(reference[0]), atol=1e-4)
