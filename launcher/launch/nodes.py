"""Which nodes a run spans: `--nnodes`, `--node-rank`, `--rdzv-endpoint` and `--rdzv-id`, or
the same four from a SLURM allocation or a Kubernetes pod (`launcher.launch.kubernetes`). Plain
values, checked here, before anything starts."""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from launcher.errors import UsageError
from launcher.launch import kubernetes, slurm
from launcher.launch.kubernetes import JobNodes

_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_NUMBER = re.compile(r"[0-9]{1,9}")  # ASCII digits, few enough for int() ("²" is a digit too)


@dataclass(frozen=True)
class Nodes:
    min: int = 1
    max: int = 1
    node_rank: int | None = None  # None: c10d's order (an elastic run, or no --node-rank)
    endpoint: str | None = None  # HOST:PORT of the rendezvous, on node 0
    job_id: str | None = None  # the rendezvous id; it also names the run folder
    source: str = ""  # "SLURM job 123", "Kubeflow PyTorchJob x": where the values came from
    devices: int | None = None  # processes per node the job's operator asks for (Kubeflow)
    restarted_by_exit_code: bool = False  # see JobNodes: a stop request then exits 143

    @property
    def multi(self) -> bool:
        return self.max > 1

    @property
    def elastic(self) -> bool:
        return self.min != self.max

    @property
    def host(self) -> str:
        return (self.endpoint or "").rpartition(":")[0]

    @property
    def is_local(self) -> bool:
        """All nodes on this machine (a test, or a try-out): everything stays on loopback."""
        return self.host in {"127.0.0.1", "localhost"}

    def describe(self) -> str:
        count = f"{self.min} to {self.max}" if self.elastic else str(self.max)
        via = f", from {self.source}" if self.source else ""
        return (
            f"waiting for {count} nodes at {self.endpoint} (job {self.job_id}{via}); "
            "every node runs this same command"
        )


def resolve_nodes(
    nnodes: str | None = None,
    node_rank: str | None = None,
    endpoint: str | None = None,
    job_id: str | None = None,
    env: Mapping[str, str] | None = None,
    fqdn: Callable[[], str] = socket.getfqdn,
) -> Nodes:
    """The flags, with a SLURM allocation's or a Kubernetes pod's values where a flag is not
    given. `fqdn`: this host's full name (a JobSet's pods find pod 0 by it)."""
    found = _job_nodes(env or {}, fqdn)
    if found is not None:
        nnodes = nnodes or _node_count(found)
        if node_rank is None and found.node_rank is not None:
            node_rank = str(found.node_rank)
        endpoint = endpoint or found.endpoint
        job_id = job_id or found.job_id
    low, high = _parse_nnodes(nnodes or "1")
    if high == 1 and not found and node_rank not in (None, "0"):
        raise UsageError(f"--node-rank {node_rank}: a run of one node has only node 0")
    rank = _parse_node_rank(node_rank, high) if node_rank is not None else None
    if job_id is not None and not _JOB_ID.match(job_id):
        raise UsageError(
            f"--rdzv-id {job_id!r}: it names the run folder, so use letters, digits, '.', '_' "
            "and '-' (at most 100)"
        )
    if high == 1:
        if not found and endpoint:
            raise UsageError("--rdzv-endpoint: only used with --nnodes above 1")
        # One node keeps its rendezvous on loopback; a job id still names its run folder.
        return _with_job(Nodes(job_id=job_id), found)
    if not endpoint:
        raise UsageError(
            f"--rdzv-endpoint: needed with --nnodes {nnodes}: HOST:PORT of node 0, the same "
            "on every node",
            hint="e.g. --rdzv-endpoint node01:29500 (any free port on node 0).",
        )
    _check_endpoint(endpoint)
    if job_id is None:
        within = f" ({found.source} gives no job name)" if found else ""
        raise UsageError(
            f"--rdzv-id: needed with --nnodes {nnodes}{within}: a name for this job, the same "
            "on every node (a job id, say); the run folder is named after it",
            hint="e.g. --rdzv-id exp42",
        )
    return _with_job(Nodes(low, high, None if low != high else rank, endpoint, job_id), found)


def _with_job(nodes: Nodes, found: JobNodes | None) -> Nodes:
    if found is None:
        return nodes
    return replace(
        nodes,
        source=found.source,
        devices=found.devices,
        restarted_by_exit_code=found.restarted_by_exit_code,
    )


def _node_count(found: JobNodes) -> str:
    if found.nnodes is None:
        raise UsageError(
            f"--nnodes: needed in {found.source}: its pods are numbered "
            "(JOB_COMPLETION_INDEX), but nothing says how many nodes the run has",
            hint="Pass --nnodes N, or set PET_NNODES=N in the pod's env (train k8s --kind "
            "jobset does).",
        )
    return found.nnodes


def _job_nodes(env: Mapping[str, str], fqdn: Callable[[], str]) -> JobNodes | None:
    """What the cluster's environment says: SLURM's srun, else a Kubernetes pod's operator."""
    allocation = slurm.from_environment(env)
    if allocation is None:
        return kubernetes.from_environment(env, fqdn)
    slurm.check_one_task_per_node(env)
    if allocation.nnodes == 1:
        # One node needs nothing from SLURM, and its runs (a sweep in one job, say) keep
        # folders of their own; the batch script passes --rdzv-id itself.
        return None
    return JobNodes(
        nnodes=str(allocation.nnodes),
        node_rank=allocation.node_rank,
        endpoint=allocation.endpoint,
        job_id=allocation.job_id,
        source=f"SLURM job {allocation.job_id}",
        restarted_by_exit_code=False,
    )


def _parse_nnodes(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    try:
        bounds = (int(low), int(high)) if sep else (int(text), int(text))
    except ValueError:
        bounds = (0, 0)
    if not 1 <= bounds[0] <= bounds[1]:
        raise UsageError(
            f"--nnodes {text}: expected a node count such as 4, or MIN:MAX such as 2:4 for an "
            "elastic run"
        )
    return bounds


def _parse_node_rank(text: str, nnodes: int) -> int:
    if not _NUMBER.fullmatch(text) or int(text) >= nnodes:
        raise UsageError(
            f"--node-rank {text}: expected 0 to {nnodes - 1}, this node's place among "
            f"{nnodes} nodes (node 0 hosts the rendezvous)"
        )
    return int(text)


def _check_endpoint(endpoint: str) -> None:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not _NUMBER.fullmatch(port) or not 0 < int(port) < 65536:
        raise UsageError(
            f"--rdzv-endpoint {endpoint}: expected HOST:PORT, e.g. node01:29500 (node 0's "
            "address and a free port there)"
        )
