"""`train.profile`: each rank writes a Chrome trace of exactly the profiled steps into the run
folder; a window past the end says so; profiling never fails the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.spec import ProfileSection
from launcher.train.profiling import profiled_steps
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


def test_a_window_past_the_end_says_nothing_was_profiled(tmp_path: Path) -> None:
    spec = write_spec(
        tmp_path / "run.yaml",
        launch={"devices": 1},
        train={"max_steps": 3, "profile": {"start_step": 5}},
    )
    result = run_train(["--config", str(spec)], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the run ended at step 3, before start_step 5: nothing was profiled" in result.stdout
    assert not (only_run_dir(tmp_path / "runs") / "profile").exists()


def test_the_window() -> None:
    assert list(profiled_steps(ProfileSection(start_step=20, steps=5))) == [20, 21, 22, 23, 24]
    assert list(profiled_steps(None)) == []
