"""The workers' fork server (`launch.worker_start`, `launcher.launch.fork_server`,
`launcher.worker.fork_server`): workers forked by a warm process train as new interpreters
do and see what a new interpreter sees, a forked process answers the agent as a `Popen`
does, and a server that does not start leaves the workers to start as new interpreters."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from launcher.launch.fork_server import ForkedHandler, ForkServer, warm_server
from launcher.launch.plan import make_plan
from tests.conftest import (
    FAULTY_RECIPE,
    REPO,
    bare_spec,
    finish_train,
    run_train,
    start_train,
    training_processes,
    wait_for_step,
    write_spec,
)
from tests.tiny_recipes import write_recipe

CHILD = ["-u", "-m", "tests.launch.fork_child"]


@pytest.mark.skipif(sys.platform != "linux", reason="`auto` forks on Linux alone")
@pytest.mark.parametrize(
    ("launch", "forks"),
    [
        ({"devices": 2}, True),  # the server is a fork of the launcher: every start is a fork
        ({"devices": 2, "max_restarts": 1}, True),
        ({"devices": 1, "max_restarts": 1}, True),
        ({"devices": 2, "max_restarts": 1, "worker_start": "spawn"}, False),
        ({"devices": 2, "worker_start": "forkserver"}, True),
    ],
)
def test_auto_forks_the_workers_on_linux_cpus(tmp_path: Path, launch: dict, forks: bool) -> None:
    spec = bare_spec(tmp_path, **launch)
    assert make_plan(spec).forks_workers is forks


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


def test_forked_workers_train_bit_for_bit_as_new_interpreters_do(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "run.yaml", train={"max_steps": 6, "log_every": 1})
    losses = {}
    for start in ("forkserver", "spawn"):
        run_dir = tmp_path / start
        result = run_train(
            ["--config", str(spec), "--run-dir", str(run_dir), f"launch.worker_start={start}"],
            tmp_path,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        losses[start] = _losses(run_dir)
    assert len(losses["spawn"]) == 6
    assert losses["forkserver"] == losses["spawn"]


@pytest.mark.parametrize("start", ["forkserver", "spawn"])
def test_the_workers_start_as_the_spec_says(tmp_path: Path, start: str) -> None:
    """`forkserver`: every rank a child of one fork server of this run, forked from the
    launcher (named `fork-server`, its ranks named as the interpreter is); `spawn`: each rank
    a new `python -m launcher.worker.main`."""
    (tmp_path / "faulty.py").write_text(FAULTY_RECIPE)
    spec = write_spec(
        tmp_path / "run.yaml",
        recipe={"source": "faulty.py", "dataset": {}},
        train={"max_steps": 100_000, "log_every": 50},
        checkpoint={"enabled": False},
    )
    run_dir = tmp_path / "run"
    args = ["--config", str(spec), "--run-dir", str(run_dir), f"launch.worker_start={start}"]
    proc = start_train(args, tmp_path, {"FAULT": "slow"})
    try:
        wait_for_step(run_dir, 1, 2, proc)
        ranks = training_processes(proc.pid)
        assert len(ranks) == 2, ranks
        parents = {rank.ppid() for rank in ranks}
        if start == "forkserver":
            (server,) = (psutil.Process(pid) for pid in parents)
            assert server.name() == "fork-server"
            assert server.ppid() == proc.pid
            assert server.cmdline() == psutil.Process(proc.pid).cmdline()  # a fork of it
            assert {rank.name() for rank in ranks} == {Path(sys.executable).name[:15]}
        else:
            assert parents == {proc.pid}
            assert all("launcher.worker.main" in rank.cmdline() for rank in ranks)
        # Each rank is the leader of a session of its own, as the agent starts workers.
        assert all(os.getsid(rank.pid) == rank.pid for rank in ranks)
    finally:
        proc.send_signal(signal.SIGINT)  # a graceful stop
        result = finish_train(proc, tmp_path)
    assert "stopped" in result.stdout + result.stderr, result.stdout + result.stderr


# What a recipe can see of the interpreter it runs in, written by each rank as it is imported.
_REPORTS_ITS_INTERPRETER = """
import gc, json, logging, os, signal, sys, warnings
import torch

def _handler(sig):
    handler = signal.getsignal(sig)
    return getattr(handler, "__name__", str(handler))

_SEEN = {
    "gc": gc.isenabled(),
    "path0": sys.path[0],
    "threads": torch.get_num_threads(),
    "signals": {s.name: _handler(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP,
                                              signal.SIGUSR1, signal.SIGCHLD, signal.SIGPIPE)},
    "warnings": sorted(str(f) for f in warnings.filters),
    "logging": {n: logging.getLogger(n).level for n in ("", "torch.distributed.elastic")},
    "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_")},
    "argv": [a.replace(os.environ["START"], "START") for a in sys.argv[1:]],
}
if "RANK" in os.environ:  # a rank's, not the launcher's as it checks the recipe
    with open(f"seen-{os.environ['RANK']}-{os.environ['START']}.json", "w") as _out:
        json.dump(_SEEN, _out)
"""


def test_a_forked_worker_sees_what_a_new_interpreter_sees(tmp_path: Path) -> None:
    """Forked from a server that is itself a fork of the launcher, a rank still finds what a
    new interpreter would: the collector as the worker sets it, its working directory first
    on sys.path, its command line,
    Python's own signal handlers (not the launcher's), the launcher's thread count for
    OpenMP (`OMP_NUM_THREADS`, read by a new interpreter as it starts), the same warning
    filters and log levels (the launcher quiets the elastic agent's, for itself alone).
    Under `nohup`, whose SIGHUP the server inherited ignored as it was forked and the
    launcher handles by the time a worker starts, as an exec would (SIG_DFL): it was kept
    ignored before."""
    write_recipe(tmp_path, hooks=_REPORTS_ITS_INTERPRETER)
    spec = write_spec(
        tmp_path / "run.yaml",
        recipe={"source": "recipe.py", "dataset": {}},
        train={"max_steps": 1},
        checkpoint={"enabled": False},
        launch={"strategy": "fsdp"},  # its allocator setting too (MALLOC_MMAP_THRESHOLD_)
    )
    for start in ("forkserver", "spawn"):
        args = ["--config", str(spec), "--run-dir", str(tmp_path / start)]
        args.append(f"launch.worker_start={start}")
        proc = start_train(args, tmp_path, {"START": start}, wrapper=("nohup",))
        result = finish_train(proc, tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
    for rank in (0, 1):
        forked, spawned = (
            json.loads((tmp_path / f"seen-{rank}-{start}.json").read_text())
            for start in ("forkserver", "spawn")
        )
        assert forked == spawned
        assert forked["path0"] == str(tmp_path)
        assert forked["env"]["OMP_NUM_THREADS"] == str(forked["threads"])


def test_a_launcher_running_a_thread_forks_no_server(tmp_path: Path) -> None:
    """A fork of a process that runs a thread may inherit a lock that thread held (CPython
    gh-112275): the workers' server is then started as a new interpreter instead."""
    spec = bare_spec(tmp_path, devices=2)
    release = threading.Event()
    running = threading.Thread(target=release.wait)
    running.start()
    try:
        with warm_server(spec) as server:
            assert server is None
    finally:
        release.set()
        running.join()


# A library nothing of the launcher imports: whether a worker found it imported already.
_IMPORTS_A_LIBRARY = """
PRELOADED = "jsonschema" in sys.modules
import jsonschema  # noqa: E402,F401
print(f"jsonschema was imported already: {PRELOADED}", flush=True)
"""


@pytest.mark.parametrize(("start", "preloaded"), [("forkserver", True), ("spawn", False)])
def test_the_libraries_a_recipe_imports_are_imported_once_by_the_server(
    tmp_path: Path, start: str, preloaded: bool
) -> None:
    """The launcher finds the installed libraries a recipe imports as it checks it; the
    server imports them (never the recipe's own file) before it forks the workers."""
    pytest.importorskip("jsonschema")
    write_recipe(tmp_path, hooks=_IMPORTS_A_LIBRARY)
    spec = write_spec(
        tmp_path / "run.yaml",
        recipe={"source": "recipe.py", "dataset": {}},
        train={"max_steps": 2},
        checkpoint={"enabled": False},
    )
    run_dir = tmp_path / "run"
    args = ["--config", str(spec), "--run-dir", str(run_dir), f"launch.worker_start={start}"]
    result = run_train(args, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        assert f"jsonschema was imported already: {preloaded}" in log, log


@pytest.fixture
def server(tmp_path: Path):
    # Its children run in their own working directories: `tests` is found on PYTHONPATH.
    server = ForkServer.start(tmp_path, {"ADDED_BY_THE_AGENT": "7", "PYTHONPATH": str(REPO)})
    assert server.ready()
    yield server
    server.close()


def test_a_forked_process_answers_as_a_popen_does(
    server: ForkServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "ONE_WORKER": "yes"}
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        child = server.fork([*CHILD, "report", "report.json"], env, [0, out.fileno(), err.fileno()])
        assert child.wait(timeout=60) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["cwd"] == str(tmp_path)
    assert report["env"]["ONE_WORKER"] == "yes"
    assert report["main"] == "__main__"  # run as `python -m` runs it
    assert report["argv"][1:] == ["report", "report.json"]
    assert (tmp_path / "out").read_text() == "to stdout\n"
    assert (tmp_path / "err").read_text() == "to stderr\n"

    assert server.fork([*CHILD, "exit", "3"], env, [0, 1, 2]).wait(timeout=60) == 3
    sleeper = server.fork([*CHILD, "sleep", "60"], env, [0, 1, 2])
    assert sleeper.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(timeout=0.2)
    # Read from its start, as tools read it: the server's environment, with what it added.
    environ = psutil.Process(sleeper.pid).environ()
    assert environ["ADDED_BY_THE_AGENT"] == "7"
    assert os.getsid(sleeper.pid) == sleeper.pid
    os.killpg(sleeper.pid, signal.SIGKILL)
    assert sleeper.wait(timeout=30) == -signal.SIGKILL


def test_the_agents_handler_signals_the_workers_process_group(
    server: ForkServer, tmp_path: Path
) -> None:
    env = dict(os.environ)
    handler = ForkedHandler(server, [*CHILD, "sleep", "60"], env, None, None, local_rank_id=0)
    assert handler.proc.poll() is None
    handler.close(signal.SIGTERM)
    assert handler.proc.wait(timeout=30) == -signal.SIGTERM


def test_a_server_that_does_not_start_leaves_the_workers_to_new_interpreters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = ForkServer.start(tmp_path, {}, ready_timeout_s=0.0)  # still importing torch
    try:
        assert not server.ready()
        assert not server.ready()  # said once
    finally:
        server.close()
    err = capsys.readouterr().err
    assert err.count("the workers' fork server cannot fork them") == 1
    assert "launch.worker_start: spawn" in err
    assert sys.platform != "linux" or server._proc.returncode is not None
