"""A run folder has one writer at a time: a second launcher is refused (exit 2) naming the
launcher that holds it, and the lock ends with its holder, however it ends. A `--run-dir` that
is not a folder, or that holds a run, is refused with a way on that works."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from launcher.clusters.nodes import Nodes
from launcher.errors import UsageError
from launcher.launch.plan import make_plan
from launcher.launch.run_folder import prepare_run_dir
from launcher.rundir.layout import RunLayout
from tests.conftest import (
    bare_spec,
    finish_train,
    run_train,
    usage_error,
    wait_for_step,
    write_spec,
)
from tests.forked_train import fork_train, train_in_fork

pytestmark = pytest.mark.timeout(300)

# Resumed to run for long, and to save nothing until it ends: a second launcher then plans
# against the same newest checkpoint.
LONG = ["--resume", "latest", "train.max_steps=1000000", "checkpoint.every_n_steps=1000000"]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_second_launcher_is_refused_until_the_first_ends(tmp_path: Path) -> None:
    # One worker: the lock is the launcher's alone.
    spec = write_spec(tmp_path / "run.yaml", launch={"devices": 1}, train={"max_steps": 2})
    config = ["--config", str(spec)]
    run = tmp_path / "runs" / "t" / "a"
    assert run_train([*config, "--run-dir", str(run)], cwd=tmp_path).returncode == 0
    first = fork_train([*config, *LONG], cwd=tmp_path)
    try:
        wait_for_step(run, 0, 3, first)
        plan_file = _digest(run / "worker-plan.json")
        # From another folder: the leftovers check at its end looks for its folder's name.
        (tmp_path / "elsewhere").mkdir()
        second = run_train([*config, *LONG], cwd=tmp_path / "elsewhere", timeout=60)
        usage_error(second, f"run folder {run}", f"pid {first.pid} on host", "another launcher")
        # It wrote nothing: no spec of its own, the workers' plan as the first wrote it.
        assert [p.name for p in run.glob("spec.resume-*.yaml")] == ["spec.resume-1.yaml"]
        assert _digest(run / "worker-plan.json") == plan_file
        _kill_launcher(first)
    finally:
        finish_train(first, tmp_path, timeout=60)
    # The kernel released the killed launcher's lock: the next one resumes.
    third = run_train([*config, "--resume", "latest", "train.max_steps=4"], cwd=tmp_path)
    assert third.returncode == 0, third.stdout + third.stderr
    assert (run / "checkpoints" / "step-00000004" / "COMPLETE").exists()


def _kill_launcher(proc: subprocess.Popen[str]) -> None:
    """SIGKILL to the launcher alone, as a lost launcher would end; its workers follow it."""
    everyone = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    _, alive = psutil.wait_procs(everyone, timeout=30)
    assert not alive, f"outlived their launcher: {alive}"


def test_of_several_nodes_only_node_0_holds_the_lock(tmp_path: Path) -> None:
    node_0, node_1 = (Nodes(2, 2, rank, "node01:29500", "job7") for rank in (0, 1))
    with prepare_run_dir(make_plan(bare_spec(tmp_path), nodes=node_0)):
        with pytest.raises(UsageError, match=f"pid {os.getpid()} on host"):
            prepare_run_dir(make_plan(bare_spec(tmp_path), nodes=node_0))
        prepare_run_dir(make_plan(bare_spec(tmp_path), nodes=node_1)).release()  # joins, unlocked
    prepare_run_dir(make_plan(bare_spec(tmp_path), nodes=node_0)).release()  # free again


@pytest.mark.launcher_only
def test_a_run_dir_that_is_a_file_is_refused_as_such(tmp_path: Path) -> None:
    write_spec(tmp_path / "run.yaml")
    (tmp_path / "notes").write_text("a user's file")
    result = train_in_fork(["--config", "run.yaml", "--run-dir", "notes"], tmp_path, timeout=60)
    usage_error(result, "--run-dir notes: is a file")
    assert "appeared while starting" not in result.stdout + result.stderr
    assert (tmp_path / "notes").read_text() == "a user's file"
    assert not (tmp_path / "runs").exists()


def test_a_folder_that_trained_is_refused_and_one_that_never_did_is_taken_over(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "trained"
    (folder / "logs").mkdir(parents=True)
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    with pytest.raises(UsageError, match="already holds a run") as refused:
        make_plan(bare_spec(tmp_path), run_dir=folder)
    assert "no checkpoint for --resume" in refused.value.render()
    # What a launcher writes before the first step, and no more, is no run: it is taken over.
    (folder / "metrics.jsonl").write_text("")
    (folder / "spec.yaml").write_text("{}")
    with pytest.raises(UsageError, match="already holds a run"):
        make_plan(bare_spec(tmp_path), run_dir=folder)  # no lock file: a user's own spec.yaml
    RunLayout(folder).lock.write_text("")
    assert make_plan(bare_spec(tmp_path), run_dir=folder).run_dir == folder
