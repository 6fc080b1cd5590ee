"""Several nodes, played by several `train` processes on 127.0.0.1 through the real c10d
rendezvous: ranks, the shared run folder, a lost node, and a node started again."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import (
    finish_train,
    metrics_of,
    usage_error,
    wait_for_step,
    write_spec,
)
from tests.forked_train import fork_train, train_in_fork

pytestmark = pytest.mark.timeout(240)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node_args(spec: Path, node_rank: int, port: int, job: str, *extra: str) -> list[str]:
    return [
        "--config",
        str(spec),
        "--devices",
        "1",
        "--nnodes",
        "2",
        "--node-rank",
        str(node_rank),
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        job,
        *extra,
    ]


def start_nodes(spec: Path, job: str, *extra: str) -> tuple[list[subprocess.Popen[str]], int]:
    port = free_port()
    # Node 1 first: it waits for node 0, which hosts the rendezvous.
    return [
        fork_train(node_args(spec, rank, port, job, *extra), cwd=spec.parent) for rank in (1, 0)
    ][::-1], port


def finish_nodes(
    procs: list[subprocess.Popen[str]], cwd: Path, timeout: float = 150
) -> list[subprocess.CompletedProcess[str]]:
    # Every node's processes carry `cwd` in their command lines: check for leftovers only
    # once all have ended, or the first check would take the other node's for leftovers.
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
    return [finish_train(proc, cwd, timeout=5) for proc in procs]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in metrics_of(run_dir)]


def test_two_nodes_make_one_run_that_matches_one_node_with_two_processes(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "run.yaml", train={"max_steps": 12, "log_every": 3})
    procs, _ = start_nodes(spec, "job1")
    node0, node1 = finish_nodes(procs, tmp_path)
    assert node0.returncode == 0 and node1.returncode == 0, node0.stdout + node1.stdout
    run_dir = tmp_path / "runs" / "t" / "job1"  # named after the job: the same on every node
    # Each node shows its own ranks, under their global numbers.
    assert "node 0 of 2" in node0.stdout and "ranks 0 of 2" in node0.stdout
    assert "node 1 of 2" in node1.stdout and "ranks 1 of 2" in node1.stdout
    assert "[rank 0] step 12/12" in node0.stdout and "[rank 1]" not in node0.stdout
    assert "[rank 1]" in node1.stdout and "[rank 0]" not in node1.stdout
    assert "ddp on 2 x cpu" in node1.stdout  # one world of 2

    single = write_spec(tmp_path / "single.yaml", train={"max_steps": 12, "log_every": 3})
    one = finish_train(
        fork_train(["--config", str(single), "--run-dir", str(tmp_path / "one")], cwd=tmp_path),
        tmp_path,
    )
    assert one.returncode == 0, one.stdout + one.stderr
    assert losses(run_dir) == losses(tmp_path / "one") and len(losses(run_dir)) == 4

    # The shared folder: every rank its own log; each node its own spec and agent logs;
    # the run's own files (spec.yaml, metrics, checkpoints) written once, by node 0.
    assert {p.name for p in (run_dir / "logs").iterdir()} == {"rank-0.log", "rank-1.log"}
    assert {p.name for p in (run_dir / "nodes").iterdir()} == {"node-0", "node-1"}
    for node in ("node-0", "node-1"):
        assert (run_dir / "nodes" / node / "spec.yaml").is_file()
    assert (run_dir / "spec.yaml").is_file() and not list(run_dir.glob("spec.resume-*"))
    assert (run_dir / "checkpoints" / "step-00000012" / "COMPLETE").is_file()


def _kill_node(proc: subprocess.Popen[str]) -> None:
    """SIGKILL a whole node: its launcher and its workers (as a lost machine would be)."""
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in tree:
        p.send_signal(signal.SIGKILL)
    psutil.wait_procs(tree, timeout=10)


def test_a_lost_node_stops_the_other_with_a_clear_message(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "run.yaml", train={"max_steps": 100000, "log_every": 50})
    procs, _ = start_nodes(spec, "lost")
    run_dir = tmp_path / "runs" / "t" / "lost"
    wait_for_step(run_dir, 1, 5, procs[1])
    _kill_node(procs[1])
    node0, _ = finish_nodes(procs, tmp_path, timeout=60)
    assert node0.returncode == 1, node0.stdout + node0.stderr
    assert "lost another node: rank 0 on this node lost its connection" in node0.stdout
    assert "rank 0 failed on" in node0.stdout


def test_a_node_started_again_rejoins_and_the_run_recovers(tmp_path: Path) -> None:
    spec = write_spec(
        tmp_path / "run.yaml",
        # Still mid-run when node 1 is killed, a few steps past step 30.
        train={"max_steps": 100, "log_every": 50},
        checkpoint={"every_n_steps": 20},
    )
    procs, port = start_nodes(spec, "again", "--max-restarts", "1")
    run_dir = tmp_path / "runs" / "t" / "again"
    wait_for_step(run_dir, 1, 30, procs[1])  # past a checkpoint
    _kill_node(procs[1])
    # The same command again, continuing the job: node 0 waits for it in the rendezvous.
    again = fork_train(
        node_args(spec, 1, port, "again", "--max-restarts", "1", "--resume", "latest"), cwd=tmp_path
    )
    node0, _, node1 = finish_nodes([procs[0], procs[1], again], tmp_path)
    assert node0.returncode == 0, node0.stdout + node0.stderr
    assert node1.returncode == 0, node1.stdout + node1.stderr
    assert "attempt 2 of 2: restarted after a failure; resuming from" in node0.stdout
    # Both nodes resumed from the same checkpoint: rank 0's choice.
    resumed = [
        line
        for line in node0.stdout.splitlines() + node1.stdout.splitlines()
        if "resumed at step" in line
    ]
    assert len(resumed) == 2 and len({line.split("resumed at step")[1] for line in resumed}) == 1
    assert "[rank 0] step 100/100" in node0.stdout
    assert (run_dir / "checkpoints" / "step-00000100" / "COMPLETE").is_file()


def test_node_0_names_the_endpoint_it_cannot_host(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "run.yaml")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = finish_train(
            fork_train(node_args(spec, 0, port, "busy"), cwd=tmp_path), tmp_path, timeout=90
        )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert f"--rdzv-endpoint 127.0.0.1:{port}: node 0 cannot host the rendezvous" in output
    assert "Traceback" not in output


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--nnodes", "0"], "--nnodes 0: expected a node count"),
        (["--nnodes", "4:2"], "--nnodes 4:2: expected a node count"),
        (["--nnodes", "2", "--rdzv-id", "x"], "--rdzv-endpoint: needed with --nnodes 2"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:1"], "--rdzv-id: needed with --nnodes 2"),
        (
            ["--nnodes", "2", "--rdzv-endpoint", "h", "--rdzv-id", "x"],
            "--rdzv-endpoint h: expected HOST:PORT",
        ),
        (
            ["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1", "--rdzv-id", "x"],
            "--node-rank 2: expected 0 to 1",
        ),
        (
            ["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-id", "a/b"],
            "--rdzv-id 'a/b': it names the run folder",
        ),
        (["--rdzv-endpoint", "h:1"], "--rdzv-endpoint: only used with --nnodes above 1"),
        (["--node-rank", "1"], "--node-rank 1: a run of one node has only node 0"),
        (
            ["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-id", "x", "--accelerator", "tpu"],
            "TPU hosts do not rendezvous",
        ),
    ],
)
@pytest.mark.launcher_only
def test_bad_node_flags_are_named(tmp_path: Path, flags: list[str], expected: str) -> None:
    spec = write_spec(tmp_path / "run.yaml")
    result = train_in_fork(
        ["--config", str(spec), *flags], tmp_path, env={"PJRT_DEVICE": "TPU"}, timeout=60
    )
    usage_error(result, expected)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("node1_extra", "expected"),
    [
        (["--devices", "2"], "every node must run the same --devices"),
        (["optim.lr=0.5"], "the nodes were given different specs"),
    ],
)
def test_nodes_that_do_not_make_one_run_are_named(
    tmp_path: Path, node1_extra: list[str], expected: str
) -> None:
    spec = write_spec(tmp_path / "run.yaml")
    port = free_port()
    procs = [
        fork_train([*node_args(spec, 1, port, "uneven"), *node1_extra], cwd=tmp_path),
        fork_train(node_args(spec, 0, port, "uneven"), cwd=tmp_path),
    ]
    for result in finish_nodes(procs, tmp_path, timeout=90):
        usage_error(result, "the nodes of job uneven do not match", expected)
