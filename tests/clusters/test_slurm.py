"""SLURM: compressed host lists, the allocation's environment, and the sbatch script."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from launcher.clusters.nodes import Nodes, resolve_nodes
from launcher.clusters.slurm import (
    check_one_task_per_node,
    expand_hostlist,
    from_environment,
    sbatch_script,
)
from launcher.errors import UsageError
from tests.conftest import REPO, finish_train, usage_error, write_spec
from tests.forked_train import fork_train, train_in_fork


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node07", ["node07"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("gpu[9-11]", ["gpu9", "gpu10", "gpu11"]),
        ("a[1-2],b3,c[08-09]", ["a1", "a2", "b3", "c08", "c09"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("ib-node[001-002].cluster", ["ib-node001.cluster", "ib-node002.cluster"]),
    ],
)
def test_hostlists_expand_as_slurm_does(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["node[01-04", "node[4-1]"])
def test_malformed_hostlists_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        expand_hostlist(bad)


# What `srun` sets for the third task of a 4-node job (values as seen on a real cluster).
SRUN_ENV = {
    "SLURM_JOB_ID": "4242117",
    "SLURM_JOB_NAME": "gpt",
    "SLURM_JOB_NODELIST": "gpu-a100-[017-018,020],gpu-a100-031",
    "SLURM_NODELIST": "gpu-a100-[017-018,020],gpu-a100-031",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_NNODES": "4",
    "SLURM_NODEID": "2",
    "SLURM_PROCID": "2",
    "SLURM_LOCALID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_TASKS_PER_NODE": "1(x4)",
    "SLURMD_NODENAME": "gpu-a100-020",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "gpu-a100-[017-018,020],gpu-a100-031",
    "SLURM_STEP_NUM_NODES": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_TASKS_PER_NODE": "1(x4)",
}


def test_the_allocation_gives_nodes_rank_and_rendezvous() -> None:
    nodes = from_environment(SRUN_ENV)
    assert nodes is not None
    assert (nodes.nnodes, nodes.node_rank, nodes.job_id) == (4, 2, "4242117")
    assert nodes.endpoint == "gpu-a100-017:29617"  # the first node; 29500 + job id % 1000
    assert from_environment({**SRUN_ENV, "MASTER_PORT": "31000"}).endpoint == "gpu-a100-017:31000"  # type: ignore[union-attr]


def test_outside_srun_there_is_no_allocation() -> None:
    assert from_environment({}) is None
    # sbatch's own shell has a job (and a SLURM_NODEID) but is no task of a step: the
    # script's srun starts the tasks.
    batch_shell = {k: v for k, v in SRUN_ENV.items() if not k.startswith("SLURM_STEP_")}
    assert from_environment({**batch_shell, "SLURM_NODEID": "0"}) is None
    # A step on 2 nodes of a 4-node allocation waits for 2, not 4.
    step = {**SRUN_ENV, "SLURM_STEP_NODELIST": "gpu-a100-[017-018]", "SLURM_STEP_NUM_NODES": "2"}
    assert from_environment({**step, "SLURM_NODEID": "1"}).nnodes == 2  # type: ignore[union-attr]


def test_the_allocation_is_what_train_uses_unless_a_flag_says_otherwise() -> None:
    nodes = resolve_nodes(env=SRUN_ENV)
    assert (nodes.min, nodes.max, nodes.node_rank) == (4, 4, 2)
    assert (nodes.endpoint, nodes.job_id, nodes.source) == (
        "gpu-a100-017:29617",
        "4242117",
        "SLURM job 4242117",
    )
    assert resolve_nodes(job_id="mine", env=SRUN_ENV).job_id == "mine"
    # A step on one node is a plain run (a sweep in one job gets a folder per run); the
    # batch script names the job's folder itself, with --rdzv-id.
    one = {**SRUN_ENV, "SLURM_STEP_NODELIST": "gpu7", "SLURM_STEP_NUM_NODES": "1"}
    assert resolve_nodes(env={**one, "SLURM_NODEID": "0"}) == Nodes()


@pytest.mark.parametrize("layout", ["8(x4)", "1(x3),2"])
def test_several_tasks_on_a_node_are_refused(layout: str) -> None:
    with pytest.raises(UsageError, match="one task per node"):
        resolve_nodes(env={**SRUN_ENV, "SLURM_STEP_TASKS_PER_NODE": layout})
    check_one_task_per_node({"SLURM_STEP_TASKS_PER_NODE": "1(x4)"})  # one each: fine


def test_sbatch_script_is_exactly_this_and_valid_bash(tmp_path: Path) -> None:
    script = sbatch_script("configs/gpt_ddp.yaml", nodes=4, gpus_per_node=8, name="gpt_ddp")
    assert script == (REPO / "tests" / "data" / "gpt_ddp.sbatch").read_text()
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)


@pytest.mark.parametrize(
    ("given", "requested"),
    [(None, "64"), (12, "12"), (0, None)],  # 8 GPUs: 8 cores each unless told
)
def test_cpus_are_requested_per_gpu_unless_told(given: int | None, requested: str | None) -> None:
    """Without a request SLURM gives the node's one task one core, for 8 processes and their
    DataLoader workers; srun passes the request on to the task only if told to."""
    script = sbatch_script("x.yaml", nodes=2, gpus_per_node=8, name="x", cpus_per_task=given)
    cpus = [line for line in script.splitlines() if "--cpus-per-task" in line]
    passed_on = "export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK" in script
    if requested is None:
        assert cpus == [] and not passed_on
    else:
        assert cpus == [f"#SBATCH --cpus-per-task={requested}"] and passed_on


# Stand-ins for SLURM's commands: srun records its arguments and, like a train that got
# SIGTERM and saved, exits 143 on SIGTERM (0 if left alone); scontrol records its own.
FAKE_SRUN = """#!/bin/bash
echo "$@" > "$FAKE_LOG/srun"
trap 'kill $!; sleep 0.5; exit 143' TERM
sleep 30 & wait
"""
FAKE_SCONTROL = """#!/bin/bash
echo "$@" > "$FAKE_LOG/scontrol"
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signal_batch_shell", [False, True])
def test_the_job_requeues_itself_when_train_stops_on_sigterm(
    tmp_path: Path, signal_batch_shell: bool
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(sbatch_script("x.yaml", nodes=2, gpus_per_node=8, name="x"))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(tmp_path)}
    job = subprocess.Popen(
        ["bash", str(script)], env={**env, "SLURM_JOB_ID": "77"}, text=True, stdout=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "srun").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        srun = next(
            p for p in psutil.Process(job.pid).children() if "srun" in " ".join(p.cmdline())
        )
        # SLURM's --signal=TERM goes to the job steps; on preemption the batch shell gets it too.
        if signal_batch_shell:
            job.send_signal(signal.SIGTERM)
        srun.send_signal(signal.SIGTERM)
        out, _ = job.communicate(timeout=20)
    finally:
        for p in psutil.Process(job.pid).children(recursive=True) if job.poll() is None else []:
            p.kill()
        job.kill()
    assert job.returncode == 143, out
    assert (tmp_path / "srun").read_text().split()[-4:] == ["--rdzv-id", "77", "--resume", "latest"]
    assert (tmp_path / "scontrol").read_text().split() == ["requeue", "77"]


@pytest.mark.timeout(60)
def test_a_job_that_finishes_is_not_requeued(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/bash\nexit 0\n")
    (bin_dir / "srun").chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(sbatch_script("x.yaml", nodes=2, gpus_per_node=8, name="x"))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77"}
    result = subprocess.run(["bash", str(script)], env=env, timeout=30, capture_output=True)
    assert result.returncode == 0 and not (tmp_path / "scontrol").exists()


def test_train_slurm_prints_the_script(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "run.yaml", run={"name": "gpt_ddp"})
    result = train_in_fork(
        [
            "slurm",
            "--config",
            str(spec),
            "--nodes",
            "4",
            "--gpus-per-node",
            "8",
            "--time",
            "2:00:00",
            # Punctuation is fine (a line break or a second option is not: the test below).
            "--partition",
            "gpu-a100,gpu_h100",
            "--account",
            "ml.lab",
            "optim.lr=0.1",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == sbatch_script(
        str(spec),
        4,
        8,
        "gpt_ddp",
        time="2:00:00",
        partition="gpu-a100,gpu_h100",
        account="ml.lab",
        extra_args=["optim.lr=0.1"],
    )
    directives = [line for line in result.stdout.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --time=2:00:00" in directives
    assert "#SBATCH --partition=gpu-a100,gpu_h100" in directives
    assert "#SBATCH --requeue" in directives and "#SBATCH --signal=TERM@120" in directives
    assert "#SBATCH --cpus-per-task=64" in directives  # 8 per GPU, unasked


@pytest.mark.timeout(180)
def test_srun_train_needs_no_flags(tmp_path: Path) -> None:
    """Two `train` processes with what srun sets for two tasks on two nodes (both nodes are
    this machine) make one run of world size 2, in a folder named after the job."""
    spec = write_spec(tmp_path / "run.yaml", train={"max_steps": 6, "log_every": 3})
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        "SLURM_JOB_ID": "5150",
        "SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.1",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "127.0.0.1,127.0.0.1",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "MASTER_PORT": str(port),
    }
    procs = [
        fork_train(
            ["--config", str(spec), "--devices", "1"],
            cwd=tmp_path,
            env={**env, "SLURM_NODEID": str(rank), "SLURM_PROCID": str(rank)},
        )
        for rank in (1, 0)
    ]
    for proc in procs:
        proc.wait(150)
    node1, node0 = (finish_train(proc, tmp_path, timeout=5) for proc in procs)
    assert node0.returncode == 0 and node1.returncode == 0, node0.stdout + node1.stdout
    assert "from SLURM job 5150" in node0.stdout
    assert "node 1 of 2" in node1.stdout and "ddp on 2 x cpu" in node0.stdout
    assert (
        tmp_path / "runs" / "t" / "5150" / "checkpoints" / "step-00000006" / "COMPLETE"
    ).is_file()


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--partition", "gpu\ntouch pwned"),
        ("--account", "lab\ntouch pwned"),
        ("--time", "1:00:00\ntouch pwned"),
        ("--partition", "gpu --requeue=no"),
    ],
)
def test_a_value_that_would_break_out_of_its_sbatch_line_is_refused(
    tmp_path: Path, flag: str, value: str
) -> None:
    """sbatch parses #SBATCH lines without a shell: a newline in a value would end them (so
    --requeue and --signal were dropped) and run the rest of the line as a command."""
    spec = write_spec(tmp_path / "run.yaml")
    args = ["slurm", "--config", str(spec), "--nodes", "2", "--gpus-per-node", "1"]
    result = train_in_fork([*args, flag, value], cwd=tmp_path)
    usage_error(result, flag, "#SBATCH")
    assert "touch pwned\n" not in result.stdout


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("SLURM_NODEID", "x"),
        ("SLURM_JOB_ID", "4242117_3"),
        ("SLURM_STEP_NUM_NODES", "²"),
        ("MASTER_PORT", "9" * 5000),
        ("MASTER_PORT", "70000"),  # was "--rdzv-endpoint gpu-a100-017:70000", a flag never typed
        ("SLURM_NODEID", "5"),  # past the 4 nodes: was "--node-rank 5"
        ("SLURM_STEP_NODELIST", ","),  # no host at all: was an IndexError
        ("SLURM_STEP_NODELIST", "gpu[01-0x]"),
        ("SLURM_STEP_NODELIST", "gpu[1-99999999]"),  # a typo, not 10**8 host names in memory
    ],
)
def test_a_malformed_slurm_variable_is_refused_by_its_name(key: str, value: str) -> None:
    with pytest.raises(UsageError) as refused:
        resolve_nodes(env={**SRUN_ENV, key: value})
    assert refused.value.message.startswith(f"{key}="), refused.value.message


def test_a_slurm_rank_past_the_count_names_both_variables() -> None:
    with pytest.raises(UsageError) as refused:
        resolve_nodes(env={**SRUN_ENV, "SLURM_NODEID": "5"})
    assert refused.value.message == (
        "SLURM_NODEID='5': expected this node's rank: 0 or more and below SLURM_STEP_NUM_NODES=4"
    )
    # A --nnodes flag wins over SLURM's count; the rank is still SLURM's, and named so.
    with pytest.raises(UsageError) as refused:
        resolve_nodes(nnodes="2", env=SRUN_ENV)
    assert refused.value.message.startswith("SLURM_NODEID='2': expected this node's rank: 0 or")
    assert refused.value.message.endswith("below --nnodes 2")
