"""The resume, decided once in the launcher (`launcher.checkpoint.resume_decision`): the run folder,
the checkpoint, the spec and its changes, in one value that the plan carries to the workers. A
worker's first attempt starts from it as it is; only a restarted attempt asks the rule again
(`launcher.checkpoint.selection.attempt_start`)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

from launcher.checkpoint import selection
from launcher.checkpoint.resume_decision import decide_resume
from launcher.checkpoint.selection import attempt_start
from launcher.config.loader import cli_layers
from launcher.config.spec import RunSpec
from launcher.errors import UsageError
from launcher.launch import plan as plan_module
from launcher.launch.plan import make_plan
from launcher.rundir.layout import CheckpointFiles, RunLayout
from launcher.rundir.worker_plan import WorkerPlan
from tests.conftest import bare_spec


def _recorded(tmp_path: Path) -> RunSpec:
    """The spec a run trained with, as its checkpoints record it."""
    spec = bare_spec(tmp_path)
    return spec.model_copy(update={"train": spec.train.model_copy(update={"max_steps": 10})})


def _checkpoint(run_dir: Path, step: int, spec: RunSpec) -> Path:
    """A whole checkpoint (empty, as the launcher reads it) that recorded `spec`."""
    path = RunLayout(run_dir).checkpoint(step)
    path.mkdir(parents=True)
    files = CheckpointFiles(path)
    files.dcp_metadata.write_bytes(pickle.dumps(Metadata(state_dict_metadata={})))
    torch.save({}, files.rank_state(0))
    recorded = spec.model_dump(mode="json", by_alias=True)
    files.meta.write_text(json.dumps({"step": step, "world_size": 1, "spec": recorded}))
    files.marker.touch()
    return path


def _refuse(*_: object) -> None:
    raise AssertionError("decided again")


def test_the_decision_holds_the_folder_the_checkpoint_the_spec_and_its_changes(
    tmp_path: Path,
) -> None:
    run = tmp_path / "runs" / "exp" / "a"
    chosen = _checkpoint(run, 4, _recorded(tmp_path))
    layers = cli_layers(None, ["optim.lr=0.5"])
    decision = decide_resume(bare_spec(tmp_path), resume="latest", layers=layers)
    assert (decision.run_dir, decision.checkpoint) == (run, chosen)
    # The checkpoint's own spec (10 steps, not the 1 given), changed where the user asks now.
    assert (decision.spec.train.max_steps, decision.spec.optim.lr) == (10, 0.5)
    assert [change.key for change in decision.changes] == ["optim.lr"]
    assert decision.said[0].startswith("changed on resume: optim.lr ")
    # Without --config, the same decision from the run's folder, with the run's own spec.
    again = decide_resume(None, resume=str(run), layers=layers)
    assert (again.run_dir, again.checkpoint, again.spec) == (run, chosen, decision.spec)


def test_a_damaged_checkpoint_is_refused_when_the_resume_is_decided(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "exp" / "a"
    chosen = _checkpoint(run, 4, _recorded(tmp_path))
    CheckpointFiles(chosen).rank_state(0).write_bytes(b"torn")
    branch = tmp_path / "branch"
    with pytest.raises(UsageError, match=r"rank-0\.pt does not load"):
        decide_resume(None, resume=str(chosen), run_dir=branch, layers=cli_layers(None))
    assert not branch.exists()


def test_the_plan_carries_the_decision_to_the_workers_without_deciding_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "runs" / "exp" / "a"
    chosen = _checkpoint(run, 4, _recorded(tmp_path))
    layers = cli_layers(None, ["optim.lr=0.5"])
    decision = decide_resume(None, resume=str(run), layers=layers)
    monkeypatch.setattr(plan_module, "decide_resume", _refuse)
    plan = make_plan(decision.spec, resume=str(run), layers=layers, resume_decided=decision)
    assert (plan.run_dir, plan.resume_from, plan.changes) == (run, chosen, decision.said)
    plan.worker_plan().write(tmp_path / "worker-plan.json")
    told = WorkerPlan.read(tmp_path / "worker-plan.json")
    assert told.resume_from == chosen.absolute() and told.run_spec().optim.lr == 0.5


def test_a_first_attempt_starts_from_the_decision_without_asking_the_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, every attempt of every worker asked `resume_point` again."""
    run = tmp_path / "runs" / "exp" / "a"
    chosen = _checkpoint(run, 4, _recorded(tmp_path))
    monkeypatch.setattr(selection, "resume_point", _refuse)
    assert attempt_start(chosen, run, attempt=0) == chosen  # continuing in place
    assert attempt_start(chosen, tmp_path / "branch", attempt=0) == chosen  # branching off
    assert attempt_start(None, tmp_path / "new", attempt=0) is None  # a new run


def test_a_restarted_attempt_asks_the_rule_for_its_folder_s_newest(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "exp" / "a"
    chosen = _checkpoint(run, 4, _recorded(tmp_path))
    newer = _checkpoint(run, 8, _recorded(tmp_path))  # saved by the attempt that failed
    assert attempt_start(chosen, run, attempt=1) == newer
    assert attempt_start(None, run, attempt=1) == newer  # a new run, restarted
    # torch's agent restarts a healthy group to take in a joining node, without counting an
    # attempt: the folder has moved past the decision, so the rule is asked all the same.
    assert attempt_start(chosen, run, attempt=0) == newer
