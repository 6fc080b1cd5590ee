"""Shared helpers: run `train` as a user does, as a subprocess, and leave nothing behind."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from launcher.config.spec import RunSpec
from launcher.worker.fork_server import NAME as FORK_SERVER_NAME
from launcher.worker.loader_workers import fork_may_hang
from tests.tiny_recipes import FAULTY_RECIPE  # noqa: F401  (the tests take it from here)

REPO = Path(__file__).resolve().parent.parent

TRAIN = Path(sys.executable).parent / "train"

# Forked DataLoader workers of a process that runs collectives: a path this CPython can hang
# (gh-112275, fixed in 3.10.15 and 3.11.10), which the launcher's own warning names. A test
# never runs it there.
FORKED_LOADER_WORKERS_MAY_HANG = pytest.mark.skipif(
    fork_may_hang(),
    reason="this CPython can hang a forked loader worker as it starts (gh-112275, fixed in "
    "3.10.15 and 3.11.10): the path the launcher's own warning names, never run here",
)


def run_train(
    args: list[str], cwd: Path, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`train ARGS` as its own process, in its own session, killed with everything it started
    if it outlives `timeout`; its exit code and output, with nothing of it left behind.

    The `train` process is a fork of a warm process that imported torch and the launcher once
    (`tests.forked_train`): the launcher's own 1.5-2 CPU-seconds of imports, saved on each of
    the suite's hundreds of runs. Its workers are started by the launcher as a user's are.
    A test that signals a running launcher forks it as well (`forked_train.fork_train`); a test
    of how `train` itself starts (a signal during its imports, its command line, a wrapper)
    starts the real command (`start_train`); so does a run whose environment changes how an
    interpreter starts."""
    from tests.forked_train import needs_the_real_command, train_in_fork

    if needs_the_real_command(env):
        return finish_train(start_train(args, cwd, env), cwd, timeout)
    return train_in_fork(args, cwd, env, timeout)


def start_train(
    args: list[str],
    cwd: Path,
    env: dict[str, str] | None = None,
    wrapper: tuple[str, ...] = (),
    **popen: object,
) -> subprocess.Popen[str]:
    """`train ARGS` started and left running (finish it with finish_train); `wrapper`: the
    command that starts it (`("nohup",)`)."""
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    return subprocess.Popen(  # type: ignore[call-overload]
        [*wrapper, str(TRAIN), *args],
        cwd=cwd,
        text=True,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        start_new_session=True,
        **{**streams, **popen},
    )


def finish_train(
    proc: subprocess.Popen[str], cwd: Path, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Waits for `train`, kills its group if it outlives `timeout`, and checks that no
    process of it is left behind."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        hung = _where_they_hang(proc.pid, cwd)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(
            f"train {' '.join(map(str, proc.args))} timed out after {timeout}s\n{out}\n{err}"
            f"\n{hung}"
        )
    finally:
        _assert_no_leftovers(proc.pid, marker=str(cwd))
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _where_they_hang(pid: int, cwd: Path) -> str:
    """What a timed-out run's processes were doing: each one's state and kernel wait, and
    each rank's Python stacks (faulthandler writes them into its log on SIGUSR2)."""
    lines = []
    try:
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return ""
    for p in tree:
        try:
            wchan = Path(f"/proc/{p.pid}/wchan").read_text()
            lines.append(
                f"pid {p.pid} ({p.status()}, {p.num_threads()} threads, in {wchan}): "
                + " ".join(p.cmdline())[:160]
            )
        except (psutil.Error, OSError):
            continue
    for rank in training_processes(pid):  # not a DataLoader worker: a signal could end it
        with contextlib.suppress(psutil.Error, OSError):
            os.kill(rank.pid, signal.SIGUSR2)
    time.sleep(1)
    for log in sorted(cwd.rglob("logs/rank-*.log")):
        lines += [f"--- the end of {log}", log.read_text(errors="replace")[-6000:]]
    return "\n".join(lines)


def training_processes(launcher_pid: int) -> list[psutil.Process]:
    """The launcher's training processes (ranks): its children that run
    `launcher.worker.main`, or the children of its fork servers (`launch.worker_start`: one
    forked from the launcher, named so, or one started as `launcher.worker.fork_server`)."""
    found = []
    for child in psutil.Process(launcher_pid).children():
        try:
            command = " ".join(child.cmdline())
            if "launcher.worker.main" in command:
                found.append(child)
            elif child.name() == FORK_SERVER_NAME or "launcher.worker.fork_server" in command:
                found += child.children()
        except psutil.Error:
            continue  # ended meanwhile
    return found


def wait_for_step(run_dir: Path, rank: int, step: int, proc: subprocess.Popen[str]) -> int:
    """Blocks until `rank` has finished `step` (its heartbeat file says so); returns its pid."""
    beat = run_dir / "telemetry" / f"rank-{rank}.beat"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"train ended early: {proc.communicate()}"
        parts = beat.read_text().split() if beat.exists() else []
        if len(parts) == 5 and int(parts[0]) >= step:
            return int(parts[2])
        time.sleep(0.05)
    pytest.fail(f"rank {rank} did not reach step {step}")


def _assert_no_leftovers(pgid: int, marker: str) -> None:
    """Workers run in sessions of their own (the elastic agent starts them so), so look for
    them by the test's own folder, in their command line or as their working directory (a
    fork of the launcher keeps its command line), as well as by process group."""
    left = []
    for p in psutil.process_iter(["pid", "cmdline", "cwd"]):
        try:
            mine = os.getpgid(p.pid) == pgid or any(marker in a for a in p.info["cmdline"] or [])
            mine = mine or (p.info["cwd"] or "").startswith(marker)
        except (ProcessLookupError, psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if mine and p.pid != os.getpid():
            left.append(p)
    # What ends them once the launcher has (the reaper, the workers' fork server) gets a
    # moment: a SIGKILLed launcher's run ends just after it, not with it.
    _, left = psutil.wait_procs(left, timeout=5)
    for p in left:
        p.kill()
    assert not left, f"processes left behind: {[p.pid for p in left]}"


def usage_error(result: subprocess.CompletedProcess[str], *expected: str) -> None:
    """Exit code 2, no traceback, and every expected text in the output."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output
    for text in expected:
        assert text in output, output


def write_spec(path: Path, *defaults: dict[str, dict], **sections: dict) -> Path:
    """A spec for the mlp recipe with small, fast defaults. `defaults` (a test module's own
    sections, e.g. `{"train": {"max_steps": 30}}`), then `sections`, override them key by key
    within each section; a `recipe` section of `tests.tiny_recipes.tiny_recipe()` replaces
    the mlp's."""
    spec = {
        "run": {"name": "t", "output_dir": str(path.parent / "runs")},
        "launch": {"accelerator": "cpu", "devices": 2, "strategy": "ddp"},
        "recipe": {"source": str(REPO / "recipes" / "mlp.py"), "dataset": {"n_samples": 512}},
        "data": {"batch_size": 8},
        "optim": {"name": "SGD", "lr": 0.05},
        "train": {"max_steps": 10, "log_every": 1},
    }
    for layer in (*defaults, sections):
        for name, values in layer.items():
            spec.setdefault(name, {}).update(values)
    path.write_text(yaml.safe_dump(spec))
    return path


def tiny_gpt(max_bytes: int) -> dict:
    """The GPT recipe at its smallest, with dropout (so the random streams matter)."""
    return {
        "source": str(REPO / "recipes" / "gpt.py"),
        "model": {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16, "dropout": 0.1},
        "dataset": {"block_size": 16, "max_bytes": max_bytes},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def end_without_teardown() -> None:
    """Ends a spawned gloo test worker that succeeded, as launcher/worker/main.py ends a
    worker: torch keeps the destroyed group (DTensor's sharding caches hold its mesh, DDP and
    functional collectives their own references), so gloo's threads still run at interpreter
    exit, where its C++ destructors can abort the process (SIGABRT, "terminate called without
    an active exception"). A failure still raises: torch's spawn records it first."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def only_run_dir(runs: Path) -> Path:
    found = [p for p in runs.glob("*/*") if p.is_dir()]
    assert len(found) == 1, found
    return found[0]


def metrics_of(run_dir: Path) -> list[dict]:
    """A run's metrics.jsonl as its readers see it (`train runs`, `train plot`): each step once,
    the records of steps a resume replayed replaced by the replay's."""
    from launcher.runs.metrics_file import read_records

    return read_records(run_dir / "metrics.jsonl")


def bare_spec(tmp_path: Path, **launch: object) -> RunSpec:
    """A resolved spec named `exp` under tmp_path/runs, for the launcher's plan alone: its
    recipe is never loaded."""
    return RunSpec.model_validate(
        {
            "run": {"name": "exp", "output_dir": str(tmp_path / "runs")},
            "launch": {"accelerator": "cpu", **launch},
            "recipe": {"source": "r.py"},
            "train": {"max_steps": 1},
        }
    )
