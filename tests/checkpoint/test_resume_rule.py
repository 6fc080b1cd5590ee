"""The one resume rule (`launcher.checkpoint.selection.resume_point`): every case through that
function, a check that no other module decides a resume point, and real runs in which the
launcher and its workers start from the same checkpoint."""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

import pytest

from launcher.checkpoint import store
from launcher.checkpoint.selection import ResumeRequest, resume_point
from launcher.checkpoint.store import store_of_run
from launcher.errors import UsageError
from launcher.rundir.layout import RunLayout
from launcher.rundir.reading import UnreadableJson
from tests.conftest import FAULTY_RECIPE, REPO, run_train, write_spec


def _checkpoint(run_dir: Path, step: int, best: list[int] | None = None) -> Path:
    path = RunLayout(run_dir).checkpoint(step)
    path.mkdir(parents=True)
    (path / "COMPLETE").touch()
    (path / ".metadata").touch()
    kept = [[s, 0.1 * s] for s in best or []]
    meta = {
        "step": step,
        "world_size": 1,
        "best": {"monitor": "val/loss", "mode": "min", "kept": kept},
    }
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def _age(run_dir: Path, mtime: float) -> None:
    os.utime(run_dir, (mtime, mtime))


def test_latest_is_never_a_link_in_the_runs_folder(tmp_path: Path) -> None:
    """A link in runs/NAME/ may lead anywhere (another user's run): `--resume latest` would
    write there. It is no run of this name, however new."""
    runs = tmp_path / "runs"
    own = _checkpoint(runs / "t" / "a", 2).parent.parent
    elsewhere = _checkpoint(tmp_path / "theirs", 9).parent.parent
    (runs / "t" / "b-link").symlink_to(elsewhere)
    _age(own, 1_000)
    assert resume_point(ResumeRequest("latest", runs, "t")) == RunLayout(own).checkpoint(2)


def test_nothing_asked_and_no_checkpoint_starts_anew(tmp_path: Path) -> None:
    assert resume_point(None) is None
    assert resume_point(None, tmp_path / "new-run") is None


def test_a_first_attempt_starts_where_the_plan_chose(tmp_path: Path) -> None:
    chosen = _checkpoint(tmp_path / "runs" / "exp" / "a", 4)
    assert resume_point(chosen, tmp_path / "branch") == chosen  # a fresh folder: the choice


def test_a_restarted_attempt_continues_from_its_own_newest_save(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "exp" / "a"
    chosen = _checkpoint(run_dir, 4)
    assert resume_point(chosen, run_dir) == chosen
    newer = _checkpoint(run_dir, 8)  # saved by the attempt that then failed
    assert resume_point(chosen, run_dir) == newer
    assert resume_point(None, run_dir) == newer  # a run started from scratch, restarted


def test_latest_is_the_newest_run_with_a_complete_checkpoint(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    old = _checkpoint(runs / "exp" / "a", 4)
    _age(runs / "exp" / "a", 1e9)
    (runs / "exp" / "b").mkdir()  # newer, but never saved
    assert resume_point(ResumeRequest("latest", runs, "exp")) == old
    newest = _checkpoint(runs / "exp" / "c", 2)
    _age(runs / "exp" / "c", 2e9)
    assert resume_point(ResumeRequest("latest", runs, "exp")) == newest
    with pytest.raises(UsageError, match="no run named 'other'"):
        resume_point(ResumeRequest("latest", runs, "other"))


def test_best_is_the_best_checkpoint_of_the_newest_run(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    run_dir = runs / "exp" / "a"
    best = _checkpoint(run_dir, 2)
    _checkpoint(run_dir, 4, best=[2])
    assert resume_point(ResumeRequest("best", runs, "exp")) == best
    _checkpoint(run_dir, 6, best=[])
    with pytest.raises(UsageError, match="has no best checkpoint"):
        resume_point(ResumeRequest("best", runs, "exp"))


def test_best_looks_again_when_a_live_run_prunes_the_newest_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`train export RUN --best` on a live run: the newest checkpoint may be pruned (a newer
    one published) between finding it and reading its record; that was a traceback."""
    run_dir = tmp_path / "run"
    best = _checkpoint(run_dir, 2)
    pruned = _checkpoint(run_dir, 4, best=[2])
    read_json = store.read_json

    def read_as_the_run_prunes(path: Path, kind: str) -> object:
        if path.parent == pruned and pruned.exists():
            _checkpoint(run_dir, 6, best=[2])
            pruned.rename(pruned.with_name(f".{pruned.name}.deleting"))  # as pruning does
        return read_json(path, kind)

    monkeypatch.setattr(store, "read_json", read_as_the_run_prunes)
    found = store_of_run(run_dir).best()
    assert found is not None and (found.path, found.step) == (best, 2)
    # Still published without its meta.json, the newest checkpoint is damaged, not pruned.
    (RunLayout(run_dir).checkpoint(6) / "meta.json").unlink()
    with pytest.raises(UnreadableJson, match=r"step-00000006/meta.json: missing"):
        store_of_run(run_dir).best()


def test_a_path_names_a_checkpoint_or_a_run_folder(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "exp" / "a"
    first, newest = _checkpoint(run_dir, 2), _checkpoint(run_dir, 4)
    assert resume_point(ResumeRequest(str(first), tmp_path, "exp")) == first
    assert resume_point(ResumeRequest(str(run_dir), tmp_path, "exp")) == newest
    with pytest.raises(UsageError, match="no such folder"):
        resume_point(ResumeRequest(str(tmp_path / "nowhere"), tmp_path, "exp"))


def test_a_jobs_latest_is_its_own_folder(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    other = _checkpoint(runs / "exp" / "other-job", 9)
    job_dir = runs / "exp" / "job42"
    asked = ResumeRequest("latest", runs, "exp", job=True)
    assert resume_point(asked) is None  # not another run's newest: `other` is not this job
    assert resume_point(resume_point(asked), job_dir) is None  # nothing saved yet: start over
    own = _checkpoint(job_dir, 3)
    assert resume_point(resume_point(asked), job_dir) == own != other


# The modules that ask for a resume point, and what they ask: the launcher's decision, once,
# and a worker's restarted attempt. None of them may work one out itself. (The launcher's
# supervisor needs none: each heartbeat says the step its process started from.)
ASKERS = {"checkpoint/resume_decision.py": "resume_point", "worker/loop.py": "attempt_start"}


def _decides_a_resume_point(tree: ast.AST) -> list[int]:
    """Lines that pick a checkpoint by hand: `latest_complete(...) or ...` (the restart rule),
    or the `--resume` words compared in code."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            first = node.values[0]
            name = getattr(getattr(first, "func", None), "attr", None) or getattr(
                getattr(first, "func", None), "id", None
            )
            if name == "latest_complete":
                found.append(node.lineno)
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "resolve_resume":
            found.append(node.lineno)
    return found


def test_no_other_module_decides_a_resume_point() -> None:
    package = REPO / "launcher"
    offenders = {
        str(path.relative_to(package)): lines
        for path in package.rglob("*.py")
        if path != package / "checkpoint" / "selection.py"
        and (lines := _decides_a_resume_point(ast.parse(path.read_text())))
    }
    assert not offenders, offenders
    for asker, asked in ASKERS.items():
        assert asked in (package / asker).read_text(), f"{asker} restates the rule"


def test_the_check_finds_a_rule_restated() -> None:
    tree = ast.parse("start = layout.latest_complete() or plan.resume_from\n")
    assert _decides_a_resume_point(tree) == [1]


def _launcher_choice(output: str) -> str:
    found = re.search(r"resuming t from (\S+):", output)
    assert found, output
    return found.group(1)


@pytest.mark.timeout(240)
def test_the_launcher_and_its_workers_start_from_the_same_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "faulty.py").write_text(FAULTY_RECIPE)
    spec = write_spec(
        tmp_path / "run.yaml",
        recipe={"source": str(tmp_path / "faulty.py"), "dataset": {}},
        train={"max_steps": 4},
        checkpoint={"every_n_steps": 2},
    )
    first = run_train(["--config", str(spec)], cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    runs = tmp_path / "runs"
    expected = resume_point(ResumeRequest("latest", runs, "t"))
    assert expected is not None and expected.name.endswith("4")
    # `--resume latest`, then a rank fails at its 4th step after the resume (step 8, past the
    # save at step 6), and the restarted attempt continues from that newer save (and ends at
    # step 9, before the recipe's fault comes round again).
    resumed = run_train(
        ["--config", str(spec), "--resume", "latest", "--max-restarts", "1",
         "train.max_steps=9"],
        cwd=tmp_path,
        env={"FAULT": "raise", "FAULT_AT": "4"},
        timeout=180,
    )  # fmt: skip
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output
    assert Path(_launcher_choice(output)) == expected  # the plan's choice
    assert "resumed at step 4" in output  # what the workers started from
    restart = re.search(r"restarted after a failure; resuming from (\S+)", output)
    assert restart, output
    # The restarted attempt's choice is the rule's, given the run folder as it was then.
    assert Path(restart.group(1)) == RunLayout(expected.parent.parent).checkpoint(6)


def test_the_rule_imports_no_torch() -> None:
    import subprocess
    import sys

    check = "import sys, launcher.checkpoint.selection; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stdout + result.stderr
