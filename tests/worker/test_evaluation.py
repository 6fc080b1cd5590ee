"""Evaluation, best checkpoints and early stopping, through `train` as a user runs it.

The val mean is exact over the split on any number of processes; the best checkpoints survive
`keep_last` pruning and resumes; early stopping stops every rank at the same evaluation; and
evaluations never move the training's random streams, so such a run resumes bitwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recipes import mlp
from tests.conftest import metrics_of, only_run_dir, run_train, tiny_gpt, write_spec
from tests.forked_train import train_in_fork
from tests.tiny_recipes import tiny_recipe, write_recipe

pytestmark = [pytest.mark.timeout(300), pytest.mark.launcher_only]

# Scores from a script, one per evaluation (max_batches: 1), the count kept in checkpoints:
# hooks on the tiny recipe (64 samples).
SCRIPTED = """
import torch

SCORES = [5.0, 1.0, 4.0, 2.0, 6.0, 0.5, 3.0, 7.0]
evals = 0


def evaluate(model, batch):
    global evals
    evals += 1
    return {"score": torch.tensor(SCORES[evals - 1]), "loss": loss(model, batch)}


def state_dict():
    return {"evals": evals}


def load_state_dict(state):
    global evals
    evals = state["evals"]
"""


def _records(run: Path) -> list[dict]:
    return metrics_of(run)


def _evals(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in _records(run) if "eval_s" in r}


def _steps(run: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*"))


@pytest.mark.parametrize(
    ("strategy", "devices", "n", "batch"),
    [
        ("ddp", 1, 203, 8),
        ("ddp", 2, 203, 8),
        ("ddp", 3, 203, 8),
        # 7 samples over 3 ranks in batches of 2: ranks 1 and 2 have a second batch of
        # padding alone, which must run (FSDP gathers parameters in it) and weigh nothing.
        ("fsdp", 3, 7, 2),
    ],
)
def test_val_loss_is_the_exact_mean_over_the_split(
    tmp_path: Path, strategy: str, devices: int, n: int, batch: int
) -> None:
    """203 samples in batches of 8: not a multiple of 2 or 3 processes, nor of the batch. With
    lr 0 the model is the one it was built as, so the mean can be computed here."""
    spec = write_spec(
        tmp_path / "run.yaml",
        launch={"devices": devices, "strategy": strategy},
        data={"batch_size": batch},
        recipe={"dataset": {"n_samples": n}},
        optim={"name": "SGD", "lr": 0.0},
        train={"max_steps": 1},
        eval={"every_n_steps": 1},
        checkpoint={"enabled": False},
    )
    result = run_train(["--config", str(spec)], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "eval at step 1 | val/loss" in result.stdout
    got = _evals(only_run_dir(tmp_path / "runs"))[1]

    torch.manual_seed(0)  # what every rank does before building the model
    model = mlp.build_model()
    x, y = mlp.build_dataset("val", n_samples=n).tensors
    with torch.no_grad():
        pred = model(x)
    assert got["val/loss"] == pytest.approx(((pred - y) ** 2).mean().item(), rel=1e-6)
    assert got["val/mae"] == pytest.approx((pred - y).abs().mean().item(), rel=1e-6)


def test_early_stop_when_the_metric_plateaus(tmp_path: Path) -> None:
    """lr 0: val/loss never improves after the first evaluation, so with patience 2 the run
    stops at the third (step 6 of 20), on both ranks, with a checkpoint there."""
    spec = write_spec(
        tmp_path / "run.yaml",
        optim={"name": "SGD", "lr": 0.0},
        train={"max_steps": 20, "log_every": 2},
        eval={"every_n_steps": 2},
        early_stop={"monitor": "val/loss", "patience": 2},
    )
    result = run_train(["--config", str(spec)], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run = only_run_dir(tmp_path / "runs")
    assert "early stop: val/loss did not improve for 2 evaluations (best " in result.stdout
    assert "at step 2)" in result.stdout
    assert sorted(_evals(run)) == [2, 4, 6]
    assert _steps(run) == [6]
    for rank in (0, 1):  # each rank's heartbeat: its last finished step
        assert (run / "telemetry" / f"rank-{rank}.beat").read_text().split()[0] == "6"
    meta = json.loads((run / "checkpoints" / "step-00000006" / "meta.json").read_text())
    assert meta["early_stop"]["waited"] == 2


def test_best_checkpoints_survive_pruning_and_resume(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, SCRIPTED, "scripted.py")
    spec = write_spec(
        tmp_path / "run.yaml",
        recipe=tiny_recipe(recipe, n_samples=64),
        train={"max_steps": 8, "log_every": 2},
        eval={"every_n_steps": 2, "max_batches": 1},
        checkpoint={"keep_last": 1, "monitor": "val/score", "keep_best": 2},
    )
    # Scores 5, 1, 4, 2 at steps 2, 4, 6, 8: the best two are 4 (1.0) and 8 (2.0).
    first = run_train(["--config", str(spec)], cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    run = only_run_dir(tmp_path / "runs")
    assert _steps(run) == [4, 8]
    # Then 6, 0.5, 3 at steps 10, 12, 14. Had the resume forgotten the scores, step 10 would
    # have been a best one and step 4 pruned.
    second = run_train(
        ["--config", str(spec), "--resume", "latest", "train.max_steps=14"], cwd=tmp_path
    )
    assert second.returncode == 0, second.stdout + second.stderr
    # 8 is kept too: the checkpoint an attempt resumed from is never pruned by it.
    assert _steps(run) == [4, 8, 12, 14]
    best = run / "checkpoints" / "step-00000012"
    assert f"best checkpoint {best} (val/score 0.5 at step 12)" in second.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["best_checkpoint"], summary["best_score"]) == (str(best), 0.5)

    exported = train_in_fork(["export", str(run), "--best", "--out", "best.pt"], tmp_path)
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert str(best) in exported.stdout + exported.stderr

    # The best is not the newest: the run branches off into a folder of its own.
    third = run_train(
        ["--config", str(spec), "--resume", "best", "train.max_steps=14"], cwd=tmp_path
    )
    assert third.returncode == 0, third.stdout + third.stderr
    assert "resumed at step 12" in third.stdout
    assert _steps(run) == [4, 8, 12, 14]
    (branch,) = [p for p in (tmp_path / "runs" / "t").iterdir() if p != run]
    assert _steps(branch) == [14]


def _gpt(folder: Path, **sections: dict) -> Path:
    """A tiny GPT with dropout (so the random streams matter) and shuffled data."""
    folder.mkdir(parents=True, exist_ok=True)
    return write_spec(
        folder / "run.yaml",
        recipe=tiny_gpt(max_bytes=6000),
        data={"batch_size": 4, "shuffle": True},
        optim={"name": "AdamW", "lr": 3e-3},
        train={"max_steps": 12, "log_every": 1},
        checkpoint={"every_n_steps": 1},
        **sections,
    )


@pytest.mark.smoke
def test_a_run_with_evaluations_trains_and_resumes_exactly_as_one_without(tmp_path: Path) -> None:
    evaluated = {"eval": {"every_n_steps": 4, "max_batches": 2}}
    plain = run_train(["--config", str(_gpt(tmp_path / "plain"))], cwd=tmp_path)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    full = run_train(["--config", str(_gpt(tmp_path / "full", **evaluated))], cwd=tmp_path)
    assert full.returncode == 0, full.stdout + full.stderr
    # Stopped at step 6, between the evaluations at 4 and 8, and resumed.
    reference = only_run_dir(tmp_path / "full" / "runs")
    resumed = run_train(
        [
            "--config",
            str(_gpt(tmp_path / "resumed", **evaluated)),
            "--resume",
            str(reference / "checkpoints" / "step-00000006"),
            "--run-dir",
            str(tmp_path / "resumed" / "run"),
        ],
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr

    def losses(run: Path) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in _records(run) if "loss" in r}

    without = losses(only_run_dir(tmp_path / "plain" / "runs"))
    assert losses(reference) == without  # evaluations never move the training's streams
    assert losses(tmp_path / "resumed" / "run") == {s: v for s, v in without.items() if s > 6}
    assert sorted(_evals(reference)) == [4, 8, 12]
    for step in (8, 12):
        ours, theirs = _evals(tmp_path / "resumed" / "run")[step], _evals(reference)[step]
        assert ours["val/loss"] == theirs["val/loss"]
