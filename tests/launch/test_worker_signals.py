"""SIGTERM to a worker. From outside the launcher (SLURM preemption and scancel: slurmstepd
signals every process of the job step) it asks for the same graceful stop as a signal to the
launcher: every rank finishes its step and saves. From the launcher (its elastic agent stops
the workers when a peer failed) it still ends the worker at once, by signal 15."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from launcher.rundir.layout import RunLayout
from tests.conftest import (
    FAULTY_RECIPE,
    FORKED_LOADER_WORKERS_MAY_HANG,
    REPO,
    finish_train,
    run_train,
    start_train,
    training_processes,
    wait_for_step,
    write_spec,
)
from tests.tiny_recipes import write_recipe

pytestmark = pytest.mark.timeout(300)

# Takes SIGTERM the way a worker does, with the test as its launcher (its parent); with
# "fork", also forks a child (a DataLoader worker's place); with "loader", starts a
# DataLoader worker by forkserver (data.worker_start: auto), from a recipe file's dataset.
# Then obeys commands on stdin.
CHILD = """
import os, signal, sys, time
from pathlib import Path
import launcher.worker.sigterm
from launcher.worker.sigterm import stop_on_outside_sigterm

launcher.worker.sigterm.REPEAT_WINDOW_S = 3.0
stop_on_outside_sigterm(Path(sys.argv[1]), os.getppid())
forked = 0
if sys.argv[2] == "fork":
    forked = os.fork()
    if forked == 0:
        time.sleep(120)
        os._exit(0)
import torch  # threads of its own, started after the mask is set, as in a worker

torch.ones(1000, 1000) @ torch.ones(1000, 1000)
if sys.argv[2] == "loader":
    from torch.utils.data import DataLoader
    from launcher.config.spec import DataSection
    from launcher.worker.loader_workers import worker_options
    from launcher.worker.recipe import load_recipe

    data = DataSection(num_workers=1)
    dataset = load_recipe(sys.argv[3]).build_dataset("train")
    batches = iter(DataLoader(dataset, num_workers=1, **worker_options(data, {})))
    forked = int(next(batches))  # the worker's pid; it then sleeps on the next sample
print("ready", forked, flush=True)
for line in sys.stdin:
    what, pid = line.split()
    if what == "kill":
        os.kill(int(pid), signal.SIGTERM)
    elif what == "wait" and sys.argv[2] == "loader":
        (worker,) = batches._workers
        worker.join()
        print(worker.exitcode, flush=True)
    elif what == "wait":
        print(os.waitstatus_to_exitcode(os.waitpid(int(pid), 0)[1]), flush=True)
"""
# The dataset of the "loader" child: a class of a recipe file, which the worker imports (its
# model and loss, the tiny recipe's, are never called).
PID_HOOKS = """
import os, time
from torch.utils.data import Dataset

class Pids(Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        if i:
            time.sleep(120)
        return os.getpid()

def build_dataset(split):
    return Pids()
"""


def _start_child(tmp_path: Path, kind: str = "-") -> tuple[subprocess.Popen[str], int]:
    recipe = write_recipe(tmp_path, PID_HOOKS, "pids_recipe.py")
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path), kind, str(recipe)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        start_new_session=True,
    )
    assert proc.stdout is not None
    ready, forked = proc.stdout.readline().split()
    assert ready == "ready"
    return proc, int(forked)


def _end_child(proc: subprocess.Popen[str]) -> str:
    """Whatever the child printed; it and its own child are gone afterwards."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=10)
    return out


def _sigterm_from_a_third_process(pid: int) -> int:
    """Sends SIGTERM to `pid` from a process that is neither its parent nor the test;
    returns the sender's pid."""
    sender = subprocess.Popen(
        [sys.executable, "-c", f"import os, signal; os.kill({pid}, signal.SIGTERM)"]
    )
    assert sender.wait(timeout=30) == 0
    return sender.pid


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + 10
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(60)
def test_sigterm_from_the_launcher_ends_the_worker_at_once(tmp_path: Path) -> None:
    proc, _ = _start_child(tmp_path)
    try:
        started = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=10) == -signal.SIGTERM
        assert time.monotonic() - started < 2
        assert not RunLayout(tmp_path).stop_request.exists()
    finally:
        out = _end_child(proc)
    assert "SIGTERM from" not in out


@pytest.mark.timeout(60)
def test_sigterm_from_outside_asks_for_a_stop_and_a_second_one_ends_the_worker(
    tmp_path: Path,
) -> None:
    proc, _ = _start_child(tmp_path)
    try:
        sender = _sigterm_from_a_third_process(proc.pid)
        _wait_for(RunLayout(tmp_path).stop_request)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == (
            f"SIGTERM from pid {sender} (not the launcher): "
            "finishing this step, saving and stopping"
        )
        taken = time.monotonic()  # its repeat window started before it said so
        # At once again: the same request delivered twice (SLURM's preemption can), ignored.
        # REPEAT_WINDOW_S is 3 s in CHILD: a loaded machine can take a second to start the
        # process that sends it.
        _sigterm_from_a_third_process(proc.pid)
        time.sleep(0.5)
        assert proc.poll() is None
        time.sleep(max(0.0, taken + 3.0 - time.monotonic()))  # past it: now it means "at once"
        _sigterm_from_a_third_process(proc.pid)
        assert proc.wait(timeout=10) == -signal.SIGTERM
    finally:
        _end_child(proc)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fork", "loader"])
@pytest.mark.parametrize("sender", ["launcher", "parent"])
def test_a_forked_child_ends_at_once_on_sigterm_from_the_launcher_or_its_parent(
    tmp_path: Path, sender: str, kind: str
) -> None:
    """What a DataLoader worker gets when the agent signals the worker's process group, or
    when its loader terminates it; a loader worker started by a fork server too, whose
    parent is that server, not its training process."""
    proc, forked = _start_child(tmp_path, kind)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        if sender == "launcher":
            os.kill(forked, signal.SIGTERM)
        else:
            proc.stdin.write(f"kill {forked}\n")
        proc.stdin.write(f"wait {forked}\n")
        proc.stdin.flush()
        assert int(proc.stdout.readline()) == -signal.SIGTERM
        assert not RunLayout(tmp_path).stop_request.exists()
    finally:
        _end_child(proc)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fork", "loader"])
def test_a_forked_child_asks_for_a_stop_quietly_on_sigterm_from_outside(
    tmp_path: Path, kind: str
) -> None:
    """Under SLURM a DataLoader worker gets the SIGTERM too: dying would fail its training
    process's loader before the checkpoint is saved."""
    proc, forked = _start_child(tmp_path, kind)
    try:
        _sigterm_from_a_third_process(forked)
        _wait_for(RunLayout(tmp_path).stop_request)
        time.sleep(0.5)
        assert _alive(forked) and proc.poll() is None
    finally:
        out = _end_child(proc)
    assert "SIGTERM from" not in out  # its training process says it


def _spec(tmp_path: Path, **data: object) -> Path:
    """Checkpoints only at the end: a checkpoint before max_steps comes from the stop."""
    (tmp_path / "faulty.py").write_text(FAULTY_RECIPE)
    return write_spec(
        tmp_path / "run.yaml",
        recipe={"source": "faulty.py", "dataset": {}},
        data={"batch_size": 8, **data},
        train={"max_steps": 200, "log_every": 5},
    )


def _only_checkpoint(run_dir: Path) -> int:
    saved = sorted((run_dir / "checkpoints").iterdir())
    assert len(saved) == 1, saved
    assert (saved[0] / "COMPLETE").is_file(), saved
    return int(saved[0].name.split("-")[1])


def _workers(launcher_pid: int) -> list[psutil.Process]:
    return training_processes(launcher_pid)


def test_sigterm_to_one_worker_from_outside_stops_every_rank_with_a_checkpoint(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    proc = start_train(
        ["--config", str(_spec(tmp_path)), "--run-dir", str(run_dir)],
        tmp_path,
        {"FAULT": "slow"},
    )
    rank1 = wait_for_step(run_dir, 1, 5, proc)
    assert rank1 in {p.pid for p in _workers(proc.pid)}
    os.kill(rank1, signal.SIGTERM)  # from the test: not the worker's parent
    result = finish_train(proc, tmp_path)
    output = result.stdout + result.stderr
    # The workers stopped gracefully (exit 0); the launcher, which got no signal, finds the
    # stop request and says so.
    assert result.returncode == 0, output
    step = _only_checkpoint(run_dir)
    assert 5 <= step < 200
    assert f"stopped on request; saved {run_dir / 'checkpoints' / f'step-{step:08d}'}" in output
    log = (run_dir / "logs" / "rank-1.log").read_text()
    assert (
        f"SIGTERM from pid {os.getpid()} (not the launcher): "
        "finishing this step, saving and stopping"
    ) in log
    assert f"stop requested: stopping after step {step}" in output


def _loader_workers(launcher_pid: int, start: str) -> list[psutil.Process]:
    """The DataLoader workers of every rank: its children, or its fork server's."""
    ranks = _workers(launcher_pid)
    if start == "fork":
        return [p for rank in ranks for p in rank.children()]
    servers = [
        p for rank in ranks for p in rank.children() if "forkserver" in " ".join(p.cmdline())
    ]
    assert len(servers) == len(ranks), servers
    return [p for server in servers for p in server.children()]


@pytest.mark.parametrize(
    "start", ["auto", pytest.param("fork", marks=FORKED_LOADER_WORKERS_MAY_HANG)]
)
def test_slurm_style_sigterm_to_every_process_saves_even_with_loader_workers(
    tmp_path: Path, start: str
) -> None:
    """slurmstepd signals the launcher, the workers and the workers' DataLoader workers,
    forked or started by a fork server (data.worker_start: auto), and that server."""
    run_dir = tmp_path / "run"
    spec = _spec(tmp_path, num_workers=2, worker_start=start)
    proc = start_train(
        ["--config", str(spec), "--run-dir", str(run_dir)], tmp_path, {"FAULT": "slow"}
    )
    wait_for_step(run_dir, 1, 5, proc)
    launcher = psutil.Process(proc.pid)
    everyone = [launcher, *launcher.children(recursive=True)]
    loader_workers = _loader_workers(proc.pid, start)
    assert len(loader_workers) == 4, loader_workers  # 2 ranks x num_workers=2
    for p in everyone:
        p.send_signal(signal.SIGTERM)
    result = finish_train(proc, tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 143, output
    step = _only_checkpoint(run_dir)
    assert f"stopped by SIGTERM; saved {run_dir / 'checkpoints' / f'step-{step:08d}'}" in output
    assert "DataLoader worker" not in output  # none died: its loader would fail the rank
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        assert log.count(f"SIGTERM from pid {os.getpid()} (not the launcher)") == 1, log


def test_the_agents_sigterm_still_stops_a_worker_and_its_loader_workers_at_once(
    tmp_path: Path,
) -> None:
    """The agent signals each worker's process group from the launcher: rank 0 and every
    DataLoader worker end at once (finish_train checks that none is left), no stop request."""
    spec = _spec(tmp_path, num_workers=2)
    # Rank 1 fails at its 4th micro-step while rank 0 sleeps in it, outside any collective:
    # only the agent's SIGTERM can stop rank 0 (on gloo it would otherwise fail by itself, on
    # the closed connection, before the agent signals it).
    result = run_train(
        ["--config", str(spec)], cwd=tmp_path, env={"FAULT": "raise", "FAULT_OTHERS": "sleep"}
    )
    ended = time.time()
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "rank 1 failed on" in output
    # Rank 0 sleeps for an hour: only the agent's SIGTERM ends it this soon (one it took for
    # a stop request would leave it to the agent's SIGKILL, 30 s later).
    assert ended - float((tmp_path / "crashed_at").read_text()) < 10
    assert "SIGTERM from" not in output
    assert not list((tmp_path / "runs").glob(f"*/*/{RunLayout(Path()).stop_request.name}"))


@pytest.mark.xla
@pytest.mark.skipif(
    importlib.util.find_spec("torch_xla") is None, reason="torch_xla is not installed here"
)
def test_an_xla_worker_takes_sigterm_from_outside_as_a_stop_request(tmp_path: Path) -> None:
    """The worker runs its replica through torch_xla's spawn (in its own process here)."""
    run_dir = tmp_path / "run"
    spec = _spec(tmp_path)
    spec = write_spec(
        spec,
        launch={"accelerator": "tpu", "devices": 1, "strategy": "xla"},
        recipe={"source": "faulty.py", "dataset": {}},
        train={"max_steps": 200, "log_every": 5},
    )
    proc = start_train(
        ["--config", str(spec), "--run-dir", str(run_dir)],
        tmp_path,
        {"FAULT": "slow", "PJRT_DEVICE": "CPU"},
    )
    os.kill(wait_for_step(run_dir, 0, 5, proc), signal.SIGTERM)
    result = finish_train(proc, tmp_path, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert 5 <= _only_checkpoint(run_dir) < 200
    assert f"SIGTERM from pid {os.getpid()} (not the launcher)" in output
