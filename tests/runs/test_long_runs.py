"""Long runs and many runs, in process on small files written here (the scaling itself is
bench/runs_scale.py's): `train runs` reads a run's progress.json and not its metrics file,
falls back to the metrics file's end without one, and survives a damaged one; the step times
take a fixed amount of memory and summary.json keeps one size; `train plot`'s downsampling
keeps a one-step spike and a NaN."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import numpy as np
import pytest

from launcher.metrics.progress import Progress, ProgressSink
from launcher.metrics.step_times import StepTimes
from launcher.metrics.telemetry import Telemetry
from launcher.rundir.layout import RunLayout
from launcher.runs.catalog import FALLBACK_METRICS_BYTES, describe_run
from launcher.runs.metrics_file import read_records, series
from launcher.runs.metrics_scan import curves, downsample
from launcher.runs.plot import Panel, draw_in_terminal, load_panels, save_figure
from tests.runs.test_metrics_file import _resumed_run

pytestmark = pytest.mark.launcher_only


def _run(run_dir: Path, records: list[dict]) -> RunLayout:
    layout = RunLayout(run_dir)
    run_dir.mkdir(parents=True)
    layout.lock.touch()  # a launcher made it
    layout.metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    return layout


def _progress_of(layout: RunLayout, records: list[dict]) -> None:
    """progress.json as rank 0's background writer leaves it."""
    sink = ProgressSink(layout.root)
    for record in records:
        sink.write(record)
    sink.close()


def test_train_runs_reads_progress_json_and_not_the_metrics_file(tmp_path: Path) -> None:
    records = [{"step": s, "loss": 10.0 - s, "time": 1.0 * s} for s in range(1, 6)]
    records.append({"step": 5, "val/loss": 3.5, "time": 6.0})
    layout = _run(tmp_path / "runs" / "a" / "r1", records)
    _progress_of(layout, records[-1:])  # in the file already: counted twice, changes nothing
    progress = json.loads(layout.progress.read_text())
    assert progress["step"] == 5 and progress["metrics"]["loss"] == [5.0, 5.0, 5, 9.0, 1]
    # A metrics file that says otherwise: the row is progress.json's, read without it.
    layout.metrics.write_text('{"step": 99, "loss": -1.0}\n' + "x" * 100_000)
    row = describe_run(layout.root)
    assert (row.step, row.last_loss, row.best_loss) == (5, 5.0, 5.0)
    assert (row.best_val_metric, row.best_val, row.best_val_step) == ("val/loss", 3.5, 5)


@pytest.mark.parametrize("damage", ["garbage", "cut", "folder", "wrong types"])
def test_a_damaged_progress_json_falls_back_to_the_metrics_file(
    tmp_path: Path, damage: str
) -> None:
    layout = _run(tmp_path / "run", [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}])
    if damage == "folder":
        layout.progress.mkdir()
    else:
        text = {"garbage": "\x00\xff{", "cut": '{"step": 2, "metr', "wrong types": "[1, 2]"}
        layout.progress.write_text(text[damage])
    row = describe_run(layout.root)
    assert row.status != "unreadable"
    assert (row.step, row.last_loss, row.best_loss) == (2, 1.5, 1.5)


def test_the_fallback_reads_the_end_of_the_metrics_file_only(tmp_path: Path) -> None:
    layout = _run(tmp_path / "run", [{"step": 1, "loss": 0.5}])
    with layout.metrics.open("a") as f:  # more than the fallback reads, then the newest
        f.write(json.dumps({"step": 2, "loss": 9.0, "pad": "x" * FALLBACK_METRICS_BYTES}) + "\n")
        f.write(json.dumps({"step": 3, "loss": 2.0}) + "\n")
        f.write(json.dumps({"step": 3, "val/loss": 1.25}) + "\n")
    row = describe_run(layout.root)
    assert (row.step, row.last_loss, row.best_loss) == (3, 2.0, 2.0)
    assert (row.best_val_metric, row.best_val, row.best_val_step) == ("val/loss", 1.25, 3)


def test_the_scan_reads_what_json_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`train plot`'s numpy scan against the records json.loads reads, on lines that look like
    a key or a number without being one, read a few bytes at a time (lines across reads)."""
    lines = [
        {"step": 1, "loss": 1.5, "note": 'lossy: 5, "loss": 7'},  # `"loss":` in a string
        {"step": 2, "xloss": 9.0, "losss": 8.0, "loss": -2.5e-07},
        {"step": 3, "loss": -1.2345678901234567e-300, "pad": "x" * 300},  # longer than a read
        {"step": 4, "loss": 10**40},  # longer than the bytes read at once of a value
        {"step": 5, "loss": "1.0"},
        {"step": 6, "loss": True},
        {"step": 7, "loss": 3},
        {"loss": 4.0},  # no step: not on the curve
    ]
    layout = _run(tmp_path / "run", lines)
    with layout.metrics.open("a") as f:
        f.write(
            '{"step": 8, "loss": 5.0\n{"step": 9, "loss": 6.0}'
        )  # half-written, then a last line
    monkeypatch.setattr("launcher.runs.metrics_scan._CHUNK", 64)
    xs, ys = curves(layout.metrics, ["loss"])["loss"]
    assert (list(xs), list(ys)) == series(read_records(layout.metrics), "loss")
    assert list(xs) == [1, 2, 3, 4, 7, 9] and ys[2] == -1.2345678901234567e-300


def test_a_resumed_run_s_progress_counts_each_step_once(tmp_path: Path) -> None:
    layout = RunLayout(_resumed_run(tmp_path / "run"))
    # The sink starts from the file (which holds the replayed steps 11 and 12 twice).
    _progress_of(layout, [{"step": 15, "loss": 115.0}])
    progress = Progress.from_record(json.loads(layout.progress.read_text()))
    assert progress.step == 15 and progress.last("loss") == 115.0
    assert progress.best("loss") == (1.0, 1) and progress.best("loss", "max") == (115.0, 15)
    row = describe_run(layout.root)
    assert (row.step, row.last_loss, row.best_loss) == (15, 115.0, 1.0)


def test_step_times_take_a_fixed_sample_with_the_right_percentiles() -> None:
    short = StepTimes(capacity=64)
    for seconds in (0.3, 0.1, 0.2, 0.5):
        short.add(seconds)
    assert short.median == statistics.median([0.3, 0.1, 0.2, 0.5])  # every step: exact
    assert short.sample_in_order() == [[0, 0.3], [1, 0.1], [2, 0.2], [3, 0.5]]
    times = StepTimes(capacity=1024)
    for step in range(100_000):  # 0 .. 99,999 ms, in an order unlike their size
        times.add((step * 7919 % 100_000) / 1000)
    assert len(times.sample) == 1024 and times.count == 100_000
    summary = times.summary()
    assert (summary["min"], summary["max"]) == (0.0, 99.999)
    assert summary["mean"] == pytest.approx(49.9995)
    for q in (10, 50, 90, 99):  # a uniform sample of a uniform spread: within 5 points
        assert summary[f"p{q}"] == pytest.approx(q, abs=5.0)
    assert len({index for index, _ in times.sample}) == 1024


def test_summary_json_is_the_same_size_at_any_run_length(tmp_path: Path) -> None:
    sizes = {}
    for steps in (100, 100_000):
        run_dir = tmp_path / str(steps)
        run_dir.mkdir()
        telemetry = Telemetry(run_dir, rank=0, is_main=True)
        for step in range(steps):
            telemetry.step_done(0.1 + (step % 7) / 100)
        telemetry.write_summary(final_loss=0.5)
        telemetry.close()
        summary = json.loads(RunLayout(run_dir).summary.read_text())
        assert summary["steps_run"] == steps and summary["step_time_s"]["count"] == steps
        assert summary["median_step_s"] == pytest.approx(0.13, abs=0.011)
        # Its clock readings (how long this loop took, and when) vary in digits between runs.
        del summary["wall_s"], summary["first_step_end_unix"]
        sizes[steps] = len(json.dumps(summary))
    # Only digits differ: the counts' (100 and 100000, twice), and the figures' (each to the
    # microsecond: 0.1295 and 0.129999). Every step's time would be a megabyte.
    assert sizes[100_000] <= sizes[100] + 12, sizes


def _spiky_run(tmp_path: Path) -> Path:
    """50,000 steps of a smooth loss, but for a spike at step 31,337 and a NaN at 40,000."""
    records = []
    for step in range(1, 50_001):
        loss = 1000.0 if step == 31_337 else float("nan") if step == 40_000 else 2 - step / 50_000
        records.append({"step": step, "loss": loss, "time": 100.0 + step})
    return _run(tmp_path / "runs" / "spiky" / "r1", records).root


def test_the_plot_s_downsampling_keeps_a_spike_and_a_nan(tmp_path: Path) -> None:
    run = _spiky_run(tmp_path)
    xs, ys = curves(RunLayout(run).metrics, ["loss"])["loss"]
    assert len(xs) == 50_000 and np.isnan(ys[39_999]) and ys[31_336] == 1000.0
    kept_xs, kept_ys, not_finite = downsample(xs, ys, 800)
    assert len(kept_xs) <= 4 * 800 and list(not_finite) == [40_000.0]
    assert 1000.0 in kept_ys and kept_xs[list(kept_ys).index(1000.0)] == 31_337
    assert kept_ys.min() == pytest.approx(2 - 50_000 / 50_000)  # the lowest, too
    for x in ("step", "time"):
        (panel,) = load_panels([run], [], x, width=100)
        (curve,) = panel.curves
        assert len(curve.xs) <= 400 and max(curve.ys) == 1000.0
        assert curve.not_finite == [40_000.0 if x == "step" else 40_000.0 - 1]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="no matplotlib")
def test_a_downsampled_plot_is_drawn(tmp_path: Path) -> None:
    panels: list[Panel] = load_panels([_spiky_run(tmp_path)], ["loss"], "step")
    png = tmp_path / "loss.png"
    save_figure(panels, png, "step")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(importlib.util.find_spec("plotext") is None, reason="no plotext")
def test_the_terminal_plot_names_where_a_value_was_not_finite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    draw_in_terminal(load_panels([_spiky_run(tmp_path)], ["loss"], "step", width=80), "step")
    assert (
        "loss: not finite (NaN, infinite or beyond ±1e300) at step 40000" in capsys.readouterr().out
    )
