"""Pure decisions: which checkpoint to resume, which folder a run writes to, how many processes."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

from launcher.checkpoint.catalog import latest_complete
from launcher.checkpoint.selection import ResumeRequest, resume_point
from launcher.clusters.nodes import Nodes
from launcher.errors import UsageError
from launcher.launch.plan import make_plan
from launcher.rundir.layout import CheckpointFiles
from tests.conftest import bare_spec


def _checkpoint(run: Path, step: int, complete: bool = True) -> Path:
    path = run / "checkpoints" / f"step-{step:08d}"
    path.mkdir(parents=True)
    if complete:
        files = CheckpointFiles(path)
        files.marker.write_text("")
        # Whole, if empty: the plan checks a checkpoint it resumes before anything starts.
        (path / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={})))
        files.meta.write_text(json.dumps({"world_size": 1}))
        torch.save({}, files.rank_state(0))
    return path


def test_latest_complete_ignores_partial_and_foreign_folders(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _checkpoint(run, 100)
    _checkpoint(run, 300, complete=False)  # a save that was interrupted
    (run / "checkpoints" / ".step-00000400.partial").mkdir()
    (run / "checkpoints" / "notes").mkdir()
    assert latest_complete(run) == run / "checkpoints" / "step-00000100"
    _checkpoint(run, 1000)  # numeric, not lexicographic, order
    assert latest_complete(run) == run / "checkpoints" / "step-00001000"


def test_resume_latest_picks_the_newest_run_with_a_complete_checkpoint(tmp_path: Path) -> None:
    runs = tmp_path / "runs" / "exp"
    old = _checkpoint(runs / "20260101-000000", 5)
    newer_without = runs / "20260102-000000"
    newer_without.mkdir(parents=True)
    os.utime(old.parent.parent, (1, 1))
    assert resume_point(ResumeRequest("latest", tmp_path / "runs", "exp")) == old
    assert (
        resume_point(ResumeRequest(str(runs / "20260101-000000"), tmp_path / "runs", "exp")) == old
    )
    assert resume_point(ResumeRequest(str(old), tmp_path / "runs", "exp")) == old
    with pytest.raises(UsageError, match="neither a checkpoint nor a run folder"):
        resume_point(ResumeRequest(str(newer_without), tmp_path / "runs", "exp"))


def test_resume_continues_in_the_checkpoints_run_but_never_over_newer_ones(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "exp" / "20260101-000000"
    first, _ = _checkpoint(run, 5), _checkpoint(run, 10)
    plan = make_plan(bare_spec(tmp_path), resume="latest")
    assert plan.run_dir == run and plan.resume_from == run / "checkpoints" / "step-00000010"
    with pytest.raises(UsageError, match="already has a newer checkpoint"):
        make_plan(bare_spec(tmp_path), resume=str(first))
    branch = make_plan(bare_spec(tmp_path), resume=str(first), run_dir=tmp_path / "branch")
    assert branch.run_dir == tmp_path / "branch" and branch.resume_from == first
    # Branching again into a branch that has moved on would overwrite its checkpoints.
    _checkpoint(tmp_path / "branch", 30)
    with pytest.raises(UsageError, match="already holds a run; it is never overwritten"):
        make_plan(bare_spec(tmp_path), resume=str(first), run_dir=tmp_path / "branch")
    # ... but continuing that branch from its own newest checkpoint is fine.
    again = make_plan(
        bare_spec(tmp_path), resume=str(tmp_path / "branch"), run_dir=tmp_path / "branch"
    )
    assert again.resume_from == tmp_path / "branch" / "checkpoints" / "step-00000030"


def test_new_runs_get_new_folders_and_cpu_threads_are_shared(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    plan = make_plan(bare_spec(tmp_path, devices=2))
    assert plan.run_dir.parent == tmp_path / "runs" / "exp" and not plan.run_dir.exists()
    assert plan.nproc == 2 and plan.accelerator == "cpu"
    assert plan.omp_threads == max(1, (os.cpu_count() or 1) // 2)
    assert make_plan(bare_spec(tmp_path, devices="auto")).nproc == 1


def test_a_jobs_nodes_share_a_folder_named_after_it_and_resume_only_when_asked(
    tmp_path: Path,
) -> None:
    job = Nodes(2, 2, 1, "node01:29500", "exp42")
    folder = tmp_path / "runs" / "exp" / "exp42"
    # The first node to start creates it; the others join it while it has no checkpoint.
    plan = make_plan(bare_spec(tmp_path), nodes=job)
    assert plan.run_dir == folder and plan.resume_from is None
    (folder / "logs").mkdir(parents=True)
    assert make_plan(bare_spec(tmp_path), nodes=job).run_dir == folder
    # A requeued job stopped before its first save: --resume latest starts it over, there.
    assert make_plan(bare_spec(tmp_path), nodes=job, resume="latest").resume_from is None
    # Once it has a checkpoint, starting it over would overwrite it: resume, or a new id.
    newest = _checkpoint(folder, 40)
    with pytest.raises(UsageError, match=r"\(job exp42\) already has checkpoints"):
        make_plan(bare_spec(tmp_path), nodes=job)
    resumed = make_plan(bare_spec(tmp_path), nodes=job, resume="latest")
    assert (resumed.run_dir, resumed.resume_from) == (folder, newest)
    # `latest` is this job's own: another run of the same name is not it.
    _checkpoint(tmp_path / "runs" / "exp" / "other", 99)
    os.utime(tmp_path / "runs" / "exp" / "other", (2e9, 2e9))
    assert make_plan(bare_spec(tmp_path), nodes=job, resume="latest").resume_from == newest


def test_a_finished_job_is_refused_before_its_resume_argument_is_read(tmp_path: Path) -> None:
    job = Nodes(2, 2, 0, "node01:29500", "done7")
    folder = tmp_path / "runs" / "exp" / "done7"
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text("{}")  # finished, checkpoints off
    for resume in (None, "latest", str(tmp_path / "nowhere")):
        with pytest.raises(UsageError, match=r"\(job done7\) holds a finished run"):
            make_plan(bare_spec(tmp_path), nodes=job, resume=resume)


@pytest.mark.parametrize("value", ["²", "0", "-1", "9" * 5000, "four"])
def test_a_thread_count_that_is_no_ascii_number_is_refused_naming_the_variable(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from launcher.launch.plan import _omp_threads

    monkeypatch.setenv("OMP_NUM_THREADS", value)
    with pytest.raises(UsageError, match="OMP_NUM_THREADS"):
        _omp_threads("cpu", 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert _omp_threads("cpu", 2) == 3
