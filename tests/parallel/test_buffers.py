"""Buffers (BatchNorm's running statistics) agree across ranks under fsdp, as under ddp: every
rank evaluates, saves and exports rank 0's, so a resumed run evaluates as one that never
stopped, and an export scores what the run reported. SyncBatchNorm on CPU is refused in one
line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.conftest import metrics_of, only_run_dir, run_train, write_spec
from tests.forked_train import train_in_fork
from tests.tiny_recipes import write_recipe

pytestmark = pytest.mark.timeout(300)

# The tiny recipe's loss on a BatchNorm model and off-centre inputs.
BN_HOOKS = """
import os

import torch
from torch import nn
from torch.utils.data import TensorDataset


def build_model(sync=False):
    norm = nn.BatchNorm1d(4)
    model = nn.Sequential(norm, nn.Linear(4, 1))
    return nn.SyncBatchNorm.convert_sync_batchnorm(model) if sync else model


def build_dataset(split):
    # Each rank's batches differ, so would each rank's running statistics.
    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    x = torch.randn(256, 4, generator=g) * 3 + 1
    return TensorDataset(x, x.sum(1, keepdim=True))


def evaluate(model, batch):
    with open(os.environ["BN_OUT"] + "-" + os.environ["RANK"], "a") as f:
        norm = getattr(model, "module", model)[0]  # ddp wraps the model
        f.write(repr(float(norm.running_mean.sum())) + "\\n")
    return {"loss": tiny.loss(model, batch)}
"""


def _spec(tmp_path: Path, strategy: str = "fsdp", **train: object) -> Path:
    write_recipe(tmp_path, BN_HOOKS, "bn.py")
    return write_spec(
        tmp_path / "run.yaml",
        launch={"strategy": strategy},
        recipe={"source": str(tmp_path / "bn.py"), "dataset": {}},
        optim={"name": "SGD", "lr": 0.01},
        train={"max_steps": 8, "log_every": 4, **train},
        eval={"every_n_steps": 4},
        checkpoint={"every_n_steps": 4},
    )


def _val_losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["val/loss"] for r in metrics_of(run) if "val/loss" in r}


def _whole_run(folder: Path, strategy: str) -> Path:
    """A run of 8 steps in `folder`; each rank's running means at each evaluation are in
    folder/bn-<rank>."""
    env = {"BN_OUT": str(folder / "bn")}
    result = run_train(["--config", str(_spec(folder, strategy))], cwd=folder, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return folder


@pytest.fixture(scope="module")
def whole_fsdp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _whole_run(tmp_path_factory.mktemp("whole"), "fsdp")


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_every_rank_evaluates_rank_0s_running_statistics(
    tmp_path: Path, strategy: str, request: pytest.FixtureRequest
) -> None:
    if strategy == "fsdp":  # the run the resumed one below is compared with
        folder = request.getfixturevalue("whole_fsdp")
    else:
        folder = _whole_run(tmp_path, strategy)
    seen = [(folder / f"bn-{rank}").read_text().split() for rank in (0, 1)]
    assert seen[0] == seen[1] and len(seen[0]) >= 2


def test_a_resumed_fsdp_run_evaluates_as_one_that_never_stopped(
    tmp_path: Path, whole_fsdp: Path
) -> None:
    env = {"BN_OUT": str(tmp_path / "bn")}
    parts = tmp_path / "parts"
    parts.mkdir()
    spec = _spec(parts)
    first = run_train(["--config", str(spec), "train.max_steps=4"], cwd=parts, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    resumed = ["--config", str(spec), "--resume", "latest", "train.max_steps=8"]
    second = run_train(resumed, cwd=parts, env=env)
    assert second.returncode == 0, second.stdout + second.stderr
    expected = _val_losses(only_run_dir(whole_fsdp / "runs"))
    assert _val_losses(only_run_dir(parts / "runs")) == expected  # bitwise
    # The export holds those statistics: it scores what the run reported at its end.
    run = only_run_dir(parts / "runs")
    exported = tmp_path / "model.pt"
    result = train_in_fork(["export", str(run), "--out", str(exported)], cwd=parts)
    assert result.returncode == 0, result.stdout + result.stderr
    model = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 1))
    model.load_state_dict(torch.load(exported, weights_only=True))
    model.eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 4, generator=g) * 3 + 1
    with torch.no_grad():
        score = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).item()
    assert score == pytest.approx(expected[8], rel=1e-5)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps_run"] == 4  # the second attempt trained steps 5 to 8


def test_syncbatchnorm_on_cpu_is_refused_in_one_line(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "ddp")
    result = run_train(
        ["--config", str(spec), "recipe.model={sync: true}"],
        cwd=tmp_path,
        env={"BN_OUT": str(tmp_path / "bn")},
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "SyncBatchNorm layers, which torch runs on CUDA only" in output
    assert "Traceback" not in output
