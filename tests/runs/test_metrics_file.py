"""metrics.jsonl of a run killed after a save and resumed: the steps it did again after its
checkpoint are in the file twice, around the marker of the resume; every reader sees each step
once, with the newer values, and never the marker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.metrics.telemetry import Telemetry
from launcher.rundir.layout import RunLayout
from launcher.runs.catalog import describe_run
from launcher.runs.metrics_file import metric_names, read_records, series, tail_records

pytestmark = pytest.mark.launcher_only

STEPS = list(range(1, 15))
# The newer values of the steps done twice (11 and 12) win.
LOSSES = [float(step) for step in range(1, 11)] + [111.0, 112.0, 113.0, 114.0]


def _resumed_run(run_dir: Path) -> Path:
    """Steps 1-12, killed after the save at 10; resumed from it: 11-14."""
    layout = RunLayout(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    layout.lock.touch()  # a launcher made it
    # Its first values of steps 11 and 12 are the lowest: a reader that kept them would say so.
    first = [
        {"step": s, "loss": s if s <= 10 else s / 1000, "time": 1000.0 + s} for s in STEPS[:12]
    ]
    marker = {"resumed_at": 10, "time": 2000.0}
    second = [{"step": s, "loss": 100.0 + s, "time": 2000.0 + s} for s in STEPS[10:]]
    layout.metrics.write_text("".join(json.dumps(r) + "\n" for r in [*first, marker, *second]))
    return run_dir


@pytest.mark.parametrize("read", [read_records, tail_records], ids=["read", "tail"])
def test_readers_see_each_step_once_with_the_replayed_values(tmp_path: Path, read) -> None:
    records = read(RunLayout(_resumed_run(tmp_path / "run")).metrics)
    assert [r["step"] for r in records] == STEPS
    assert [r["loss"] for r in records] == LOSSES
    assert all("resumed_at" not in r for r in records)


def test_metric_names_and_curves_leave_the_replays_and_the_marker_out(tmp_path: Path) -> None:
    text = RunLayout(_resumed_run(tmp_path / "run")).metrics.read_text()
    raw = [json.loads(line) for line in text.splitlines()]  # as a script might hand them
    assert metric_names(raw) == ["loss"]
    assert series(raw, "loss") == ([float(s) for s in STEPS], LOSSES)
    xs, ys = series(raw, "loss", x="time")
    assert ys == LOSSES and xs == sorted(xs)


def test_train_runs_counts_the_replayed_steps_once(tmp_path: Path) -> None:
    row = describe_run(_resumed_run(tmp_path / "run"))
    assert (row.step, row.last_loss, row.best_loss) == (14, 114.0, 1.0)


def test_a_second_resume_to_an_earlier_step_drops_what_came_after_it(tmp_path: Path) -> None:
    metrics = RunLayout(_resumed_run(tmp_path / "run")).metrics
    with metrics.open("a") as f:  # resumed once more, from step 5's checkpoint (say, `best`)
        f.write(json.dumps({"resumed_at": 5, "time": 3000.0}) + "\n")
        f.write(json.dumps({"step": 6, "loss": 6.5, "time": 3001.0}) + "\n")
    records = read_records(metrics)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[-1]["loss"] == 6.5


def test_mark_resumed_writes_one_marker_from_rank_0_only(tmp_path: Path) -> None:
    main, other = (Telemetry(tmp_path, rank=rank, is_main=rank == 0) for rank in (0, 1))
    main.metrics(step=11, loss=1.0)
    for telemetry in (main, other):
        telemetry.mark_resumed(10)
        telemetry.close()
    lines = [json.loads(line) for line in RunLayout(tmp_path).metrics.read_text().splitlines()]
    assert [sorted(line) for line in lines] == [["loss", "step", "time"], ["resumed_at", "time"]]
    assert lines[1]["resumed_at"] == 10
    assert [r["step"] for r in read_records(RunLayout(tmp_path).metrics)] == []
