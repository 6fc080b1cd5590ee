"""The workers' fork server (`launch.worker_start`, `launcher.launch.agent.ForkServer`,
`launcher.worker.fork_server`): workers forked by a warm process train as new interpreters
do, a forked process answers the agent as a `Popen` does, and a server that does not start
leaves the workers to start as new interpreters."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from launcher.launch.agent import ForkedHandler, ForkServer
from launcher.launch.plan import make_plan
from tests.conftest import (
    FAULTY_RECIPE,
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
        ({"devices": 2}, False),  # a first start costs about the same either way
        ({"devices": 2, "max_restarts": 1}, True),  # a restart is a fork
        ({"devices": 1, "max_restarts": 1}, True),
        ({"devices": 2, "max_restarts": 1, "worker_start": "spawn"}, False),
        ({"devices": 2, "worker_start": "forkserver"}, True),
    ],
)
def test_auto_forks_the_workers_where_a_server_pays_for_itself(
    tmp_path: Path, launch: dict, forks: bool
) -> None:
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
    """`forkserver`: every rank a child of one fork server of this run, which started
    with the run's environment (the reaper finds its processes by it); `spawn`: each rank a
    new `python -m launcher.worker.main`."""
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
            assert "launcher.worker.fork_server" in " ".join(server.cmdline())
            assert str(run_dir) in server.cmdline()
            assert server.ppid() == proc.pid
            assert "LAUNCHER_RUN_COOKIE" in server.environ()
        else:
            assert parents == {proc.pid}
            assert all("launcher.worker.main" in rank.cmdline() for rank in ranks)
        # Each rank is the leader of a session of its own, as the agent starts workers.
        assert all(os.getsid(rank.pid) == rank.pid for rank in ranks)
    finally:
        proc.send_signal(signal.SIGINT)  # a graceful stop
        result = finish_train(proc, tmp_path)
    assert "stopped" in result.stdout + result.stderr, result.stdout + result.stderr


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
    server = ForkServer(tmp_path, {"ADDED_BY_THE_AGENT": "7"})
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
    server = ForkServer(tmp_path, {}, ready_timeout_s=0.0)  # still importing torch
    try:
        assert not server.ready()
        assert not server.ready()  # said once
    finally:
        server.close()
    err = capsys.readouterr().err
    assert err.count("the workers' fork server cannot fork them") == 1
    assert "launch.worker_start: spawn" in err
    assert sys.platform != "linux" or server._proc.returncode is not None
