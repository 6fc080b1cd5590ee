"""`train.profile`: each rank writes a Chrome trace of exactly the profiled steps into the run
folder; a run that ends inside the window writes what it recorded, one that ends before it
says so; profiling never fails the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from launcher.config.spec import ProfileSection
from launcher.rundir.layout import RunLayout
from launcher.worker.profiling import StepProfiler, profiled_steps
from tests.conftest import only_run_dir, run_train, write_spec

pytestmark = pytest.mark.timeout(180)


def _step_ranges(trace: Path) -> set[str]:
    events = json.loads(trace.read_text())["traceEvents"]
    return {e["name"] for e in events if e.get("name", "").startswith("step ")}


def test_each_rank_traces_exactly_the_profiled_steps(tmp_path: Path) -> None:
    spec = write_spec(
        tmp_path / "run.yaml", train={"max_steps": 6, "profile": {"start_step": 2, "steps": 2}}
    )
    result = run_train(["--config", str(spec)], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run = only_run_dir(tmp_path / "runs")
    profile = run / "profile"
    assert f"profile: steps 2-3 traced to {profile}" in result.stdout
    for rank in (0, 1):
        trace = profile / f"rank-{rank}.pt.trace.json"
        assert _step_ranges(trace) == {"step 2", "step 3"}, rank
        events = json.loads(trace.read_text())["traceEvents"]
        assert any("addmm" in e.get("name", "") for e in events)  # the model's matmuls
    assert not list(profile.glob("*.pickle"))  # memory snapshots are CUDA's


def _run(root: Path, steps: range, start_step: int, rank: int = 0) -> RunLayout:
    """The loop's calls, in this process, with a matmul for a step."""
    layout = RunLayout(root)
    options = ProfileSection(start_step=start_step, steps=3)
    profiler = StepProfiler(options, layout, rank, torch.device("cpu"))
    for step in steps:
        profiler.before_step(step)
        torch.ones(8, 8) @ torch.ones(8, 8)
        profiler.after_step(step)
    profiler.close()
    return layout


def test_a_run_that_ends_inside_the_window_writes_what_it_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    layout = _run(tmp_path, range(1, 4), start_step=2)  # the window is 2-4
    assert _step_ranges(layout.profile_trace(0)) == {"step 2", "step 3"}
    assert f"profile: steps 2-3 traced to {layout.profile_dir}" in capsys.readouterr().out


def test_outside_the_window_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    resumed_after = _run(tmp_path / "after", range(6, 8), start_step=2)
    assert not resumed_after.profile_dir.exists()
    assert capsys.readouterr().out == ""
    ended_before = _run(tmp_path / "before", range(1, 4), start_step=5)
    assert not ended_before.profile_dir.exists()
    out = capsys.readouterr().out
    assert (
        out.strip()
        == "train.profile: the run ended at step 3, before start_step 5: nothing was profiled"
    )


def test_a_trace_that_cannot_be_written_is_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    not_a_folder = tmp_path / "run"
    not_a_folder.write_text("")
    _run(not_a_folder, range(1, 6), start_step=2)
    out, err = capsys.readouterr()
    assert "WARNING: train.profile: could not write the trace" in err
    assert "training goes on" in err
    assert "traced to" not in out


def test_the_window() -> None:
    assert list(profiled_steps(ProfileSection(start_step=20, steps=5))) == [20, 21, 22, 23, 24]
    assert list(profiled_steps(None)) == []
