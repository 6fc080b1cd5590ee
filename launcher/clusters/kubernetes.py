"""Kubernetes and SkyPilot: where a run's nodes come from inside a pod the cluster started.

Every pod (or SkyPilot node) runs the same `train --config x.yaml`; the node count, this node's
rank, the rendezvous host and the job's name come from what the operator put into the pod's
environment, as SLURM's come from srun's (`slurm.py`):

- Kubeflow PyTorchJob and TrainJob: torchrun's `PET_NNODES`, `PET_NODE_RANK`,
  `PET_MASTER_ADDR`, `PET_MASTER_PORT`, else PyTorchJob v1's `MASTER_ADDR`, `MASTER_PORT`,
  `WORLD_SIZE` and `RANK`, which count nodes, not processes.
- A JobSet or an Indexed Job: `JOB_COMPLETION_INDEX`, and pod 0's stable name under the
  headless service.
- SkyPilot: `SKYPILOT_NODE_RANK`, `SKYPILOT_NUM_NODES`, `SKYPILOT_NODE_IPS`.

The job's name names the run folder, so a pod started again (same name, same variables) finds
its run and `--resume latest` continues it.

torchrun's `PET_NPROC_PER_NODE` (the processes per node) is read on its own, job or no job
(`processes_per_node`), as torchrun reads it: a PyTorchJob sets it without the other
variables on a single pod, and a user coming from torchrun sets it alone.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from launcher.clusters.node_values import parse_node_count, parse_port
from launcher.config.yaml_file import echo
from launcher.errors import UsageError
from launcher.plain_number import plain_number

DEFAULT_PORT = 29500  # JobSets and SkyPilot give no port: torchrun's usual one
NPROC_PER_NODE = "PET_NPROC_PER_NODE"  # torchrun's processes per node, where a job sets it
# PyTorchJob pods are `<job>-master-0` and `<job>-worker-N`; MASTER_ADDR is `<job>-master-0`.
_PYTORCHJOB_POD = re.compile(r"^(?P<job>[a-z0-9][a-z0-9-]*)-(master|worker)-\d+$")
# TrainJob's PET_MASTER_ADDR is `<job>-node-0-0.<job>` (`<job>-trainer-node-0-0` before v2.0).
_TRAINJOB_MASTER = re.compile(r"^(?P<job>[a-z0-9-]+)-(trainer-)?node-0-0\.(?P=job)(\.|$)")
_INDEXED_POD = re.compile(r"^(?P<job>[a-z0-9][a-z0-9-]*)-(?P<index>\d+)$")
_NOT_IN_JOB_ID = re.compile(r"[^A-Za-z0-9._-]+")
_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,252}[A-Za-z0-9])?")  # or an IPv4 address
# torchrun's --nproc-per-node words: leave the count to `--devices`.
_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")


@dataclass(frozen=True)
class JobNodes:
    """What a pod's environment says about the run's nodes; None where it says nothing."""

    nnodes: str | None  # N, or MIN:MAX; None: an Indexed Job, which does not say
    nnodes_from: str  # the variable that gave it: errors name it
    # As set: `nodes.py` checks it against the node count, which a flag may give instead.
    node_rank: str | None
    node_rank_from: str
    endpoint: str | None  # HOST:PORT of the rendezvous, on node 0
    job_id: str | None  # names the run folder; None: no name found (--rdzv-id must give one)
    source: str  # "Kubeflow PyTorchJob my-job": where the values came from
    # Kubernetes restarts a pod whose process failed and takes one that exits 0 for done (an
    # Indexed Job never runs that index again): a node that another node's SIGTERM stopped
    # must not exit 0. SLURM's batch script requeues the whole job itself.
    restarted_by_exit_code: bool = True


def from_environment(
    env: Mapping[str, str], fqdn: Callable[[], str] = socket.getfqdn
) -> JobNodes | None:
    """The nodes of the job this pod belongs to, or None outside one. `fqdn`: this host's
    fully qualified name (a JobSet's pods find pod 0 by theirs)."""
    return _kubeflow(env) or _indexed_job(env, fqdn) or _skypilot(env)


# torchrun's variables (a TrainJob, a PyTorchJob with nprocPerNode) first, where WORLD_SIZE
# may count processes; else PyTorchJob v1's, which count pods, one node each. Only all four
# together: a MASTER_ADDR left in a shell does not make a cluster.
_KUBEFLOW_KEYS = (
    ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"),
    ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"),
)


def _kubeflow(env: Mapping[str, str]) -> JobNodes | None:
    for nnodes, rank, master, port in _KUBEFLOW_KEYS:
        if all(env.get(key) for key in (nnodes, rank, master, port)):
            kind, job = _kubeflow_job(env[master], env.get("HOSTNAME", ""))
            return JobNodes(
                nnodes=_node_count(env, nnodes, elastic=nnodes == "PET_NNODES"),
                nnodes_from=nnodes,
                node_rank=env[rank],
                node_rank_from=rank,
                endpoint=f"{_host(master, env[master])}:{_port(env, port)}",
                job_id=job,
                source=f"Kubeflow {kind} {job}" if job else f"{master}, {nnodes} and {rank}",
            )
    return None


def _kubeflow_job(master: str, hostname: str) -> tuple[str, str | None]:
    """The kind and name of the Kubeflow job, from the master's address (the same on every
    pod) or else this pod's own name."""
    trainjob = _TRAINJOB_MASTER.match(master)
    if trainjob:
        return "TrainJob", trainjob["job"]
    for name in (master.partition(".")[0], hostname):
        pod = _PYTORCHJOB_POD.match(name)
        if pod:
            return "PyTorchJob", pod["job"]
    return "PyTorchJob", None


def _indexed_job(env: Mapping[str, str], fqdn: Callable[[], str]) -> JobNodes | None:
    index = env.get("JOB_COMPLETION_INDEX")
    if not index:
        return None
    host, dot, domain = fqdn().partition(".")
    pod = _INDEXED_POD.match(host)
    if pod is None:
        raise UsageError(
            f"JOB_COMPLETION_INDEX={index}, but this pod's name {host!r} is not an Indexed "
            "Job's `<job>-<index>`: pod 0's address cannot be told from it",
            hint="Give the rendezvous yourself: --rdzv-endpoint HOST:PORT --rdzv-id NAME.",
        )
    # Pod 0's stable name under the same headless service: `<job>-0.<subdomain>...`.
    port = _port(env, "MASTER_PORT")
    jobset = env.get("JOBSET_NAME")
    return JobNodes(
        nnodes=_node_count(env, "PET_NNODES", elastic=True) if env.get("PET_NNODES") else None,
        nnodes_from="PET_NNODES",
        node_rank=index,
        node_rank_from="JOB_COMPLETION_INDEX",
        endpoint=f"{pod['job']}-0{dot}{domain}:{port}",
        job_id=jobset or pod["job"],
        source=f"JobSet {jobset}" if jobset else f"Indexed Job {pod['job']}",
    )


def _skypilot(env: Mapping[str, str]) -> JobNodes | None:
    keys = ("SKYPILOT_NODE_RANK", "SKYPILOT_NUM_NODES", "SKYPILOT_NODE_IPS")
    if not all(env.get(key) for key in keys):
        return None
    # One IP a line; the first is the head node.
    head = _host("SKYPILOT_NODE_IPS", env["SKYPILOT_NODE_IPS"], first_line=True)
    # A managed job keeps its task id across recoveries: it names the run folder.
    task = _NOT_IN_JOB_ID.sub("-", env.get("SKYPILOT_TASK_ID", "")).strip("-._")[:100] or None
    return JobNodes(
        nnodes=_node_count(env, "SKYPILOT_NUM_NODES", elastic=False),
        nnodes_from="SKYPILOT_NUM_NODES",
        node_rank=env["SKYPILOT_NODE_RANK"],
        node_rank_from="SKYPILOT_NODE_RANK",
        endpoint=f"{head}:{_port(env, 'MASTER_PORT')}",
        job_id=task,
        source=f"SkyPilot task {task}" if task else "SkyPilot",
    )


# The operators set these; a value that is not what they set (a typo in a pod's env, a
# variable left blank) is refused by its name, never left to crash or to pass for a flag's.
# Only torchrun's PET_NNODES may be MIN:MAX: WORLD_SIZE and SKYPILOT_NUM_NODES count pods.


def _node_count(env: Mapping[str, str], key: str, *, elastic: bool) -> str:
    parse_node_count(env[key], key, elastic=elastic)
    return env[key]


def _port(env: Mapping[str, str], key: str) -> int:
    return parse_port(env.get(key) or str(DEFAULT_PORT), key)


def _host(key: str, value: str, first_line: bool = False) -> str:
    """The rendezvous host variable `key` gives (SKYPILOT_NODE_IPS: on its first line)."""
    host = (value.split() or [""])[0] if first_line else value
    if not (_HOST_NAME.fullmatch(host) or _is_ip(host)):
        where = "on its first line, " if first_line else ""
        raise UsageError(
            f"{key}={echo(value)}: expected {where}the rendezvous node's address (a host name "
            "or an IP address)"
        )
    return host


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def processes_per_node(env: Mapping[str, str]) -> int | None:
    """PET_NPROC_PER_NODE as a count, with or without a job's other variables, as torchrun
    reads it; None where it is not set, or is one of torchrun's words (`auto`, `gpu`, `cpu`,
    `xpu`), which leave the count to `--devices` and `launch.devices`."""
    text = env.get(NPROC_PER_NODE, "")
    if not text or text in _NPROC_WORDS:
        return None
    count = plain_number(text)
    if not count:  # None, or 0
        raise UsageError(
            f"{NPROC_PER_NODE}={echo(text)}: expected the processes per node, 1 or more, or "
            f"one of {', '.join(_NPROC_WORDS)}"
        )
    return count
