"""Nothing a run starts outlives it, however it ends; and a stop asked for while it starts
ends it at once, quietly, without a step or a checkpoint."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from launcher.rundir.layout import RunLayout
from tests.conftest import (
    FORK_SERVER_NAME,
    finish_train,
    start_train,
    training_processes,
    wait_for_step,
    write_spec,
)
from tests.forked_train import fork_train
from tests.tiny_recipes import write_recipe

pytestmark = pytest.mark.timeout(300)

# build_model starts two `sleep 1000`: one in the worker's process group, one in a session of
# its own (as a daemon would); and forks a child that leaves for a session of its own and
# closes every descriptor, as a daemonised `multiprocessing` child would (no program started:
# its environment in /proc is its worker's at its start). It writes their pids to
# sleep-RANK.pids. STOP_FILE: it also asks for a stop; BUILD_SLEEP: it then takes that many
# seconds more. Hooks on the tiny recipe.
HOOKS = """
import os, subprocess, time


def build_model():
    sleeps = [subprocess.Popen(["sleep", "1000"]),
              subprocess.Popen(["sleep", "1000"], start_new_session=True)]
    forked = os.fork()
    if forked == 0:
        os.setsid()
        os.closerange(0, 1 << 16)
        time.sleep(1000)
        os._exit(0)
    name = f"sleep-{os.environ['RANK']}.pids"
    with open(name + ".tmp", "w") as f:
        f.write(" ".join(str(pid) for pid in [*(s.pid for s in sleeps), forked]))
    os.replace(name + ".tmp", name)
    if os.environ.get("STOP_FILE"):
        open(os.environ["STOP_FILE"], "w").close()
    time.sleep(float(os.environ.get("BUILD_SLEEP", "0")))
    return tiny.build_model()


def loss(model, batch):
    time.sleep(0.05)
    return tiny.loss(model, batch)
"""


def _start(tmp_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    write_recipe(tmp_path, HOOKS, "sleepy.py")
    spec = write_spec(
        tmp_path / "run.yaml",
        recipe={"source": "sleepy.py", "dataset": {}},
        train={"max_steps": 500, "log_every": 5},
    )
    args = ["--config", str(spec), "--run-dir", str(tmp_path / "run")]
    return start_train(args, tmp_path, env)


def _sleeps(tmp_path: Path, proc: subprocess.Popen[str]) -> list[psutil.Process]:
    """Both ranks' sleeps, once both have started them."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        files = [tmp_path / f"sleep-{rank}.pids" for rank in (0, 1)]
        if all(f.exists() for f in files):
            return [psutil.Process(int(pid)) for f in files for pid in f.read_text().split()]
        assert proc.poll() is None, f"train ended early: {proc.communicate()}"
        time.sleep(0.05)
    pytest.fail("the recipe's sleeps did not start")


def _started_sleeps(tmp_path: Path) -> list[psutil.Process]:
    found = []
    for pid in " ".join(f.read_text() for f in tmp_path.glob("sleep-*.pids")).split():
        with contextlib.suppress(psutil.NoSuchProcess):
            found.append(psutil.Process(int(pid)))
    return found


def _alive(process: psutil.Process) -> bool:
    """Not gone, not a zombie; the same process (a pid can be reused)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    return False


def _wait_gone(processes: list[psutil.Process], timeout_s: float = 10) -> list[int]:
    """The pids still alive after `timeout_s` (killed then, so that none is left behind)."""
    deadline = time.monotonic() + timeout_s
    while any(map(_alive, processes)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in processes if _alive(p)]
    for p in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    return [p.pid for p in left]


def _sigterm_blocked(process: psutil.Process) -> bool:
    with open(f"/proc/{process.pid}/status") as status:
        mask = next(line for line in status if line.startswith("SigBlk:")).split()[1]
    return bool(int(mask, 16) & (1 << (signal.SIGTERM - 1)))


def _workers(proc: subprocess.Popen[str]) -> list[psutil.Process]:
    return training_processes(proc.pid)


def _launcher_killed(proc: subprocess.Popen[str], run_dir: Path) -> int:
    """SIGKILL to the launcher: what it started (its reaper too) ends without it."""
    everyone = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert not _wait_gone(everyone), "the launcher's own processes outlived it"
    return -signal.SIGKILL


def _launcher_killed_while_its_fork_server_is_stopped(
    proc: subprocess.Popen[str], run_dir: Path
) -> int:
    """As `_launcher_killed`, with the workers' fork server stopped first, as a loaded machine
    may leave it unscheduled: the kernel ends it and its workers with the launcher, at once,
    not the server once it runs again and reads the end of its socket (by then a worker could
    have finished a checkpoint without the launcher)."""
    servers = [p for p in psutil.Process(proc.pid).children() if p.name() == FORK_SERVER_NAME]
    assert servers, "the run's workers have no fork server"
    workers = _workers(proc)
    for server in servers:
        server.suspend()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's group: a scheduler's kill
        assert proc.wait(timeout=30) == -signal.SIGKILL
        assert not _wait_gone(workers), "a worker outlived its launcher"
    finally:
        for server in servers:
            with contextlib.suppress(psutil.NoSuchProcess):
                server.kill()
    return -signal.SIGKILL


def _rank_killed(proc: subprocess.Popen[str], run_dir: Path) -> int:
    os.kill(wait_for_step(run_dir, 1, 1, proc), signal.SIGKILL)
    return 137


def _signal(sig: signal.Signals) -> Callable[[subprocess.Popen[str], Path], int]:
    def send(proc: subprocess.Popen[str], run_dir: Path) -> int:
        os.kill(proc.pid, sig)
        return 128 + sig

    return send


@pytest.mark.parametrize(
    "end",
    [
        _signal(signal.SIGINT),
        _signal(signal.SIGTERM),
        _rank_killed,
        _launcher_killed,
        _launcher_killed_while_its_fork_server_is_stopped,
    ],
    ids=["ctrl-c", "sigterm", "rank-sigkilled", "launcher-sigkilled", "server-stopped"],
)
def test_nothing_a_recipe_starts_outlives_the_run(
    tmp_path: Path, end: Callable[[subprocess.Popen[str], Path], int]
) -> None:
    proc = _start(tmp_path)
    try:
        sleeps = _sleeps(tmp_path, proc)
        wait_for_step(tmp_path / "run", 0, 1, proc)
        programs = [p for p in sleeps if p.name() == "sleep"]  # not the forked child
        blocked = [p.pid for p in programs if _sigterm_blocked(p)]
        code = end(proc, tmp_path / "run")
    finally:
        result = finish_train(proc, tmp_path)
    left = _wait_gone(sleeps)
    output = result.stdout + result.stderr
    assert result.returncode == code, output
    assert not left, f"the recipe's sleeps outlived the run\n{output}"
    assert not blocked, "a program the worker started inherited SIGTERM blocked"


def _quick_quiet_stop(
    proc: subprocess.Popen[str], tmp_path: Path, seconds: float
) -> subprocess.CompletedProcess[str]:
    sent = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)
    result = finish_train(proc, tmp_path)
    took = time.monotonic() - sent
    output = result.stdout + result.stderr
    assert result.returncode == 130, output
    assert "Traceback" not in output, output
    assert took < seconds, f"{took:.1f} s to stop\n{output}"
    assert not list((tmp_path / "run").glob("checkpoints/*")), output
    return result


def _importing_torch(proc: subprocess.Popen[str], tmp_path: Path) -> bool:
    """`train` is importing torch: its own code runs (earlier is the interpreter's start)."""
    with contextlib.suppress(OSError):
        return "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text()
    return False


def _starting_workers(proc: subprocess.Popen[str], tmp_path: Path) -> bool:
    return bool(_workers(proc))


@pytest.mark.parametrize("moment", [_importing_torch, _starting_workers], ids=lambda f: f.__name__)
def test_ctrl_c_while_train_starts_is_quiet(
    tmp_path: Path, moment: Callable[[subprocess.Popen[str], Path], bool]
) -> None:
    proc = _start(tmp_path)
    deadline = time.monotonic() + 60
    while not moment(proc, tmp_path):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.005)
    try:
        result = _quick_quiet_stop(proc, tmp_path, seconds=10)
    finally:
        left = _wait_gone(_started_sleeps(tmp_path))
    assert "interrupted" in result.stderr or "before the first step" in result.stdout
    assert not left


def test_ctrl_c_before_the_first_step_stops_at_once_with_nothing_saved(tmp_path: Path) -> None:
    proc = _start(tmp_path, {"BUILD_SLEEP": "60"})  # the ranks are still building
    sleeps = _sleeps(tmp_path, proc)
    try:
        result = _quick_quiet_stop(proc, tmp_path, seconds=10)
    finally:
        left = _wait_gone(sleeps)
    assert "stopped by SIGINT before the first step: nothing to save" in result.stdout
    assert not left


def test_a_stop_requested_while_the_ranks_start_ends_them_before_a_step(tmp_path: Path) -> None:
    """As a SIGTERM to a worker from outside (a preemption), or another node's Ctrl-C, asks."""
    stop = RunLayout(tmp_path / "run").stop_request
    try:
        result = finish_train(_start(tmp_path, {"STOP_FILE": str(stop)}), tmp_path)
    finally:
        left = _wait_gone(_started_sleeps(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "stop requested: stopping before step 1" in output
    assert "stopped on request before the first step: nothing to save" in output
    assert not list((tmp_path / "run").glob("checkpoints/*")), output
    assert not left, output


# Starts a daemon when imported (a session of its own, as a server would) and forks a child,
# in every process that imports it: the launcher, to check it, and each worker. Then it is
# the tiny recipe.
IMPORT_STARTS = """
import os, subprocess, time

daemon = subprocess.Popen(
    ["sleep", "1000"], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
)
forked = os.fork()  # as multiprocessing does: no exec, so it keeps its parent's environment
if forked == 0:
    os.setsid()
    os.closerange(0, 1024)
    time.sleep(1000)
    os._exit(0)
with open(f"daemon-{os.getpid()}.pid", "w") as f:
    f.write(f"{daemon.pid} {forked}")
"""


@pytest.mark.parametrize("command", ["train", "validate"])
def test_a_process_a_recipe_starts_when_imported_ends_with_the_command(
    tmp_path: Path, command: str
) -> None:
    write_recipe(tmp_path, IMPORT_STARTS, "server.py")
    spec = write_spec(
        tmp_path / "run.yaml", recipe={"source": "server.py", "dataset": {}}, train={"max_steps": 2}
    )
    args = ["--config", str(spec)] if command == "train" else ["validate", "--config", str(spec)]
    result = finish_train(fork_train(args, tmp_path), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    files = list(tmp_path.glob("daemon-*.pid"))
    assert len(files) == (3 if command == "train" else 1)  # the launcher's, and each worker's
    daemons = [int(pid) for f in files for pid in f.read_text().split()]
    alive = [pid for pid in daemons if psutil.pid_exists(pid) and _running(pid)]
    assert not alive, f"outlived `train {command}`: {alive}"


def _running(pid: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    return False
