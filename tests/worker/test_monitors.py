"""The pure rules behind evaluations: which checkpoints are the best, when a run stops
improving, which checkpoints pruning removes, `--resume best`, and the spec's checks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from launcher.checkpoint.selection import ResumeRequest, resume_point
from launcher.checkpoint.store import store_at
from launcher.config.spec import CheckpointSection, EarlyStopSection
from launcher.errors import RunError, UsageError
from launcher.rundir.layout import CheckpointFiles, RunLayout
from launcher.worker.monitors import BestCheckpoints, EarlyStopping, improves
from tests.conftest import usage_error, write_spec
from tests.forked_train import train_in_fork

pytestmark = pytest.mark.launcher_only


def test_improves_by_mode_and_min_delta() -> None:
    assert improves(1.0, None, "min") and improves(1.0, 2.0, "min")
    assert not improves(2.0, 1.0, "min") and improves(2.0, 1.0, "max")
    assert not improves(1.95, 2.0, "min", min_delta=0.1) and improves(1.85, 2.0, "min", 0.1)
    assert not improves(math.nan, None, "min") and not improves(math.nan, 1.0, "max")


def test_best_checkpoints_keep_the_best_k_best_first() -> None:
    best = BestCheckpoints(CheckpointSection(monitor="val/acc", mode="max", keep_best=2))
    offers = [(1, 0.5), (2, 0.7), (3, 0.6), (4, math.nan), (5, 0.7), (6, 0.9)]
    taken = [best.offer(step, {"val/acc": score}) for step, score in offers]
    assert taken == [True, True, True, False, True, True]
    assert best.kept == [(6, 0.9), (2, 0.7)]  # a tie keeps the earlier step
    again = BestCheckpoints(CheckpointSection(monitor="val/acc", mode="max", keep_best=2))
    again.load_state_dict(json.loads(json.dumps(best.state_dict())))
    assert again.kept == best.kept
    other = BestCheckpoints(CheckpointSection(monitor="val/loss", keep_best=2))
    other.load_state_dict(best.state_dict())  # another metric's scores rank nothing
    assert other.kept == []
    with pytest.raises(RunError, match="gives no 'val/acc'; it gives val/loss"):
        best.offer(7, {"val/loss": 1.0})


def test_early_stopping_counts_evaluations_without_improvement() -> None:
    early = EarlyStopping(EarlyStopSection(monitor="val/loss", patience=2, min_delta=0.1))
    for step, score in [(10, 1.0), (20, 0.95), (30, 0.8), (40, 0.75)]:
        early.update(step, {"val/loss": score})
        assert not early.should_stop
    early.update(50, {"val/loss": math.nan})
    assert early.should_stop
    assert early.message() == (
        "early stop: val/loss did not improve for 2 evaluations (best 0.8 at step 30)"
    )
    restored = EarlyStopping(EarlyStopSection(monitor="val/loss", patience=2, min_delta=0.1))
    restored.load_state_dict(early.state_dict())
    assert restored.should_stop and restored.best_step == 30


def _checkpoints(run: Path, steps: list[int], best: list[list[float]]) -> RunLayout:
    layout = RunLayout(run)
    for step in steps:
        files = CheckpointFiles(layout.checkpoint(step))
        files.path.mkdir(parents=True)
        record = {"monitor": "val/loss", "mode": "min", "kept": best}
        files.meta.write_text(json.dumps({"best": record, "world_size": 1}))
        files.marker.touch()
    return layout


def test_pruning_keeps_the_newest_and_the_best(tmp_path: Path) -> None:
    layout = _checkpoints(tmp_path, [10, 20, 30, 40], best=[[20, 0.1], [10, 0.2]])
    catalog = store_at(layout.checkpoints)
    assert catalog.prunable(None, {20}) == []
    assert catalog.prunable(1, {20}) == [layout.checkpoint(10), layout.checkpoint(30)]
    assert catalog.prunable(2, {10, 20}) == []


def test_best_is_read_from_the_newest_checkpoint_and_skips_pruned_ones(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    layout = _checkpoints(runs / "t" / "a", [10, 30], best=[[20, 0.1], [10, 0.2]])
    best = store_at(layout.checkpoints).best()
    assert best is not None and (best.step, best.score) == (10, 0.2)  # 20 was pruned
    assert resume_point(ResumeRequest("best", runs, "t")) == layout.checkpoint(10)
    _checkpoints(runs / "t" / "b", [5], best=[])  # the newest run: no best checkpoint
    with pytest.raises(UsageError, match="--resume best: the newest run of 't'"):
        resume_point(ResumeRequest("best", runs, "t"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["checkpoint.monitor=val/loss"], "checkpoint.monitor: needs evaluations; set eval"),
        (["eval.every_n_steps=5", "early_stop.monitor=loss"], "early_stop.monitor: expected an"),
        (["eval.every_n_steps=5", "checkpoint.monitor=val/loss", "checkpoint.enabled=false"],
         "checkpoint.monitor: needs checkpoint.enabled: true"),
        (["train.on_nonfinite=ignore"], "train.on_nonfinite"),
    ],
)  # fmt: skip
def test_monitors_without_evaluations_are_refused(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    spec = write_spec(tmp_path / "run.yaml")
    usage_error(train_in_fork(["validate", "--config", str(spec), *overrides], tmp_path), message)
