"""SLURM: where a run's nodes come from inside an allocation, and a ready `sbatch` script.

Inside `srun` (one task per node), the node count, this node's rank and the rendezvous host
come from SLURM's environment, so `srun train --config x.yaml` needs no flags.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass

from launcher.clusters.node_values import parse_node_count, parse_node_rank, parse_port
from launcher.config.spec import RUN_NAME_PATTERN
from launcher.config.yaml_file import echo
from launcher.errors import UsageError
from launcher.plain_number import plain_number

DEFAULT_PORT = 29500
_BRACKET = re.compile(r"\[([^\]]+)\]")
_MOST_HOSTS = 100_000  # a range past this is a typo, not a cluster


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compressed host lists: `node[01-04,07],gpu3` -> node01..node04, node07, gpu3.
    Several bracket groups in one name (`rack[1-2]-n[1-2]`) expand as a product."""
    hosts: list[str] = []
    for name in _split_top_level(hostlist):
        hosts += _expand_one(name)
    return hosts


def _split_top_level(hostlist: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in hostlist:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise ValueError(f"unbalanced brackets in host list {hostlist!r}")
    return [p for p in [*parts, current] if p]


def _expand_one(name: str) -> list[str]:
    match = _BRACKET.search(name)
    if match is None:
        return [name]
    head, tail = name[: match.start()], name[match.end() :]
    out = []
    for item in match[1].split(","):
        low, _, high = item.partition("-")
        numbers = _numbered(item, low, high) if high else [low]
        for number in numbers:
            out += _expand_one(head + number + tail)
    return out


def _numbered(item: str, low: str, high: str) -> list[str]:
    """`01-04` -> 01, 02, 03, 04: zero-padded as its first number is."""
    first, last = plain_number(low, digits=12), plain_number(high, digits=12)
    if first is None or last is None:
        raise ValueError(f"not a range of numbers: {item!r} in host list")
    if last < first:
        raise ValueError(f"descending range {item!r} in host list")
    if last - first >= _MOST_HOSTS:
        raise ValueError(f"range {item!r} in host list: more than {_MOST_HOSTS} hosts")
    return [str(n).zfill(len(low)) for n in range(first, last + 1)]


def check_one_task_per_node(env: Mapping[str, str]) -> None:
    """`train` starts a process per device itself: several SLURM tasks on one node would each
    start them all, on the same devices."""
    layout = env.get("SLURM_STEP_TASKS_PER_NODE") or ""
    # `2(x3),1`: each part's count, its leading digits.
    leading = (re.match(r"[0-9]{1,9}", part) for part in layout.split(","))
    counts = [int(match[0]) for match in leading if match]
    if any(count > 1 for count in counts):
        raise UsageError(
            f"SLURM runs {max(counts)} tasks on a node (SLURM_STEP_TASKS_PER_NODE={layout}); "
            "train starts one process per device itself, so it needs one task per node",
            hint="srun --ntasks-per-node=1 train --config ...",
        )


@dataclass(frozen=True)
class SlurmNodes:
    nnodes: int
    node_rank: int
    master: str  # the first node of the allocation hosts the rendezvous
    port: int
    job_id: str
    nnodes_from: str = "SLURM_STEP_NUM_NODES"  # the variable that gave the count

    @property
    def endpoint(self) -> str:
        return f"{self.master}:{self.port}"


def from_environment(env: Mapping[str, str]) -> SlurmNodes | None:
    """The job step this process is a task of (started by `srun`), or None: outside SLURM,
    and in a batch script itself, whose shell is no task of a step."""
    job = env.get("SLURM_JOB_ID")
    nodelist = env.get("SLURM_STEP_NODELIST")
    if not job or not nodelist or "SLURM_STEP_ID" not in env or "SLURM_NODEID" not in env:
        return None
    hosts = _hosts(nodelist)
    # The step's nodes, not the allocation's: `srun -N2` may run in a 4-node allocation.
    if env.get("SLURM_STEP_NUM_NODES"):
        count_from = "SLURM_STEP_NUM_NODES"
        nnodes = parse_node_count(env[count_from], count_from, elastic=False)[1]
        count = f"{count_from}={nnodes}"
    else:
        count_from, nnodes = "SLURM_STEP_NODELIST", len(hosts)
        count = f"the {nnodes} hosts of SLURM_STEP_NODELIST"
    rank = parse_node_rank(env["SLURM_NODEID"], nnodes, "SLURM_NODEID", count)
    # A fixed port per job: every node computes the same one, and two jobs sharing a first
    # node do not collide. MASTER_PORT, when set, wins.
    port = DEFAULT_PORT + _job_number(job) % 1000
    if env.get("MASTER_PORT"):
        port = parse_port(env["MASTER_PORT"], "MASTER_PORT")
    return SlurmNodes(nnodes, rank, hosts[0], port, job, count_from)


def _hosts(nodelist: str) -> list[str]:
    try:
        hosts = expand_hostlist(nodelist)
    except ValueError as exc:
        raise UsageError(f"SLURM_STEP_NODELIST={echo(nodelist)}: {exc}") from None
    if not hosts:  # `,`: no node to host the rendezvous
        raise UsageError(f"SLURM_STEP_NODELIST={echo(nodelist)}: expected the step's hosts")
    return hosts


def _job_number(job: str) -> int:
    # SLURM's job ids are 32-bit: up to 10 digits.
    number = plain_number(job, digits=10)
    if number is None:
        raise UsageError(f"SLURM_JOB_ID={echo(job)}: expected a number, as SLURM sets it")
    return number


# CPU cores the script asks for per GPU, unless told otherwise: the GPU's process and its
# DataLoader workers (a node of 8 GPUs: 64 cores, of a DGX H100's 112 or a DGX A100's 128).
# Without a request SLURM gives a task one core, where the node's 8 processes and all their
# workers would then run.
CPUS_PER_GPU = 8

_SCRIPT = """#!/bin/bash
{header}

# One `train` per node, each starting a process per GPU; the node count, node rank and
# rendezvous (on the first node) come from SLURM. Submit from the folder the config's paths
# are relative to, with `train` on the PATH (sbatch passes your environment on).
#
# The run folder is <run.output_dir>/<run.name>/<job id>, on storage every node sees.
# --resume latest continues it from its newest checkpoint when it has one (a requeued job
# keeps its id, and so its folder), and starts it when it has none.
#
# 120 s before the time limit (and on preemption) SLURM sends SIGTERM: every rank finishes
# its step and saves a checkpoint, train exits with 143, and the job requeues itself.
{cpus}trap 'echo "$(date): SIGTERM: train is saving a checkpoint"' TERM
srun --kill-on-bad-exit=1 {train} &
srun_pid=$!
while kill -0 "$srun_pid" 2>/dev/null; do
  wait "$srun_pid"  # a trapped SIGTERM ends a wait early; srun goes on saving
done
wait "$srun_pid"
code=$?
if [ "$code" -eq 143 ]; then
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$code"
"""


# sbatch reads its `#SBATCH` lines itself, without a shell, so no quoting makes a value safe
# there: a newline in one would end the directives and run the rest as a command.
_NAMES = re.compile(r"[A-Za-z0-9_.,+-]+")  # partitions and accounts, comma lists of them
_TIME = re.compile(r"[0-9:-]+|UNLIMITED|INFINITE|unlimited|infinite")
_RUN_NAME = re.compile(RUN_NAME_PATTERN)
_AS_SLURM_NAMES_IT = "Give {flag} as SLURM names it, e.g. from `sinfo` or `sacctmgr show assoc`."


def _check_directive(
    flag: str, value: str | None, allowed: re.Pattern[str], form: str, hint: str = ""
) -> None:
    if value is not None and not allowed.fullmatch(value):
        raise UsageError(
            f"{flag} {echo(value)}: not a value an #SBATCH line can hold ({form})",
            hint=hint or _AS_SLURM_NAMES_IT.format(flag=flag),
        )


def _check_values(
    config: str,
    name: str,
    partition: str | None,
    time: str | None,
    account: str | None,
    extra_args: list[str],
) -> None:
    """Every value the script holds that comes from the user, by the flag or key it came from."""
    _check_command_line(config, extra_args)
    # The spec refuses any other run.name too; here it becomes the job's name.
    form = "letters, digits and _ . - only"
    _check_directive("run.name", name, _RUN_NAME, form, hint="Rename the run.")
    _check_directive("--partition", partition, _NAMES, "letters, digits and _ . - , only")
    _check_directive("--account", account, _NAMES, "letters, digits and _ . - , only")
    _check_directive("--time", time, _TIME, "e.g. 24:00:00, 2-00:00:00 or UNLIMITED")


def _check_command_line(config: str, extra_args: list[str]) -> None:
    """Every argument is shell-quoted, which keeps it one word, but a line break inside the
    quotes would still split the script's command over lines (and anything reading the
    script by lines, sbatch included, would see a line of its own): refused."""
    for label, value in [("--config", config), *(("override", arg) for arg in extra_args)]:
        if not value.isprintable():
            raise UsageError(
                f"{label} {echo(value)}: a newline or control character cannot be written into "
                "the batch script's command line",
                hint="Rename the file, or write the value on one line of printable characters.",
            )


def sbatch_script(
    config: str,
    nodes: int,
    gpus_per_node: int,
    name: str,
    *,
    partition: str | None = None,
    time: str | None = None,
    account: str | None = None,
    cpus_per_task: int | None = None,
    extra_args: list[str] | None = None,
) -> str:
    """A batch script that runs `train` on `nodes` nodes and survives preemption and the time
    limit: SLURM's SIGTERM makes every rank save a checkpoint (train exits 143), the job
    requeues itself, and the requeued job (same job id, same run folder) resumes there.
    `cpus_per_task`: the node's one task's CPU cores; None: `CPUS_PER_GPU` for each GPU; 0:
    none asked for (the cluster's default, often one core)."""
    if cpus_per_task is None:
        cpus_per_task = CPUS_PER_GPU * gpus_per_node
    _check_values(config, name, partition, time, account, extra_args or [])
    train = shlex.join(
        ["train", "--config", config, "--accelerator", "gpu", "--devices", str(gpus_per_node)]
    )
    # The job id names the run folder, so a requeued job (same id) finds its own again.
    train += ' --rdzv-id "$SLURM_JOB_ID" --resume latest'
    if extra_args:
        train += " " + shlex.join(extra_args)
    options = [  # numbers as numbers (`:d`): a string here would be a bug
        f"--job-name={name}",
        f"--nodes={nodes:d}",
        "--ntasks-per-node=1",
        f"--gpus-per-node={gpus_per_node:d}",
        *([f"--partition={partition}"] if partition else []),
        *([f"--account={account}"] if account else []),
        *([f"--time={time}"] if time else []),
        *([f"--cpus-per-task={cpus_per_task:d}"] if cpus_per_task else []),
        "--requeue",
        "--signal=TERM@120",
        "--open-mode=append",
        "--output=%x-%j.out",
    ]
    header = "\n".join(f"#SBATCH {option}" for option in options)
    # srun no longer passes --cpus-per-task on to its tasks by itself (SLURM 22.05+).
    cpus = "export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK\n" if cpus_per_task else ""
    return _SCRIPT.format(header=header, cpus=cpus, train=train)
