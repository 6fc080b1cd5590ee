"""Which nodes a run spans: `--nnodes`, `--node-rank`, `--rdzv-endpoint` and `--rdzv-id`, or
the same four from a SLURM allocation (`slurm.py`) or a Kubernetes pod (`kubernetes.py`). Plain
values, checked here, before anything starts: the launch plan takes the `Nodes` this returns."""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from launcher.clusters import kubernetes, slurm
from launcher.clusters.kubernetes import JobNodes
from launcher.clusters.node_values import parse_node_count, parse_node_rank, port_number
from launcher.errors import UsageError

_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


@dataclass(frozen=True)
class Nodes:
    min: int = 1
    max: int = 1
    node_rank: int | None = None  # None: c10d's order (an elastic run, or no --node-rank)
    endpoint: str | None = None  # HOST:PORT of the rendezvous, on node 0
    job_id: str | None = None  # the rendezvous id; it also names the run folder
    source: str = ""  # "SLURM job 123", "Kubeflow PyTorchJob x": where the values came from
    devices: int | None = None  # processes per node PET_NPROC_PER_NODE asks for (torchrun's)
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
    given. `fqdn`: this host's full name (a JobSet's pods find pod 0 by it). Each value is
    refused by the name of the flag or the variable it came from."""
    found = _job_nodes(env or {}, fqdn)
    if nnodes or found is None:
        low, high = parse_node_count(nnodes or "1")
        count = f"--nnodes {nnodes}"
    else:
        nnodes = _node_count(found)
        low, high = parse_node_count(nnodes, found.nnodes_from)
        count = f"{found.nnodes_from}={nnodes}"
    rank = _node_rank(node_rank, found, high, count)
    given_endpoint = endpoint
    if found is not None:
        endpoint = endpoint or found.endpoint
        job_id = job_id or found.job_id
    _check_job_id(job_id)
    devices = kubernetes.processes_per_node(env or {})
    if high == 1:
        if not found and endpoint:
            raise UsageError("--rdzv-endpoint: only used with --nnodes above 1")
        # One node keeps its rendezvous on loopback; a job id still names its run folder.
        return _with_job(Nodes(job_id=job_id, devices=devices), found)
    if not endpoint:
        raise UsageError(
            f"--rdzv-endpoint: needed with --nnodes {nnodes}: HOST:PORT of node 0, the same "
            "on every node",
            hint="e.g. --rdzv-endpoint node01:29500 (any free port on node 0).",
        )
    if given_endpoint:  # a cluster's was checked where it was read, by its variables' names
        _check_endpoint(given_endpoint)
    if job_id is None:
        within = f" ({found.source} gives no job name)" if found else ""
        raise UsageError(
            f"--rdzv-id: needed with --nnodes {nnodes}{within}: a name for this job, the same "
            "on every node (a job id, say); the run folder is named after it",
            hint="e.g. --rdzv-id exp42",
        )
    known_rank = None if low != high else rank
    return _with_job(Nodes(low, high, known_rank, endpoint, job_id, devices=devices), found)


def _node_rank(flag: str | None, found: JobNodes | None, nnodes: int, count: str) -> int | None:
    """--node-rank, else the cluster's variable; None where neither says. `count`: the node
    count as an error names it (`PET_NNODES=4`, `--nnodes 4`)."""
    if flag is not None:
        if nnodes == 1 and found is None and flag != "0":
            raise UsageError(f"--node-rank {flag}: a run of one node has only node 0")
        return parse_node_rank(flag, nnodes)
    if found is None or found.node_rank is None:
        return None
    return parse_node_rank(found.node_rank, nnodes, found.node_rank_from, count)


def _check_job_id(job_id: str | None) -> None:
    if job_id is not None and not _JOB_ID.match(job_id):
        raise UsageError(
            f"--rdzv-id {job_id!r}: it names the run folder, so use letters, digits, '.', '_' "
            "and '-' (at most 100)"
        )


def _with_job(nodes: Nodes, found: JobNodes | None) -> Nodes:
    if found is None:
        return nodes
    return replace(nodes, source=found.source, restarted_by_exit_code=found.restarted_by_exit_code)


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
        nnodes_from=allocation.nnodes_from,
        node_rank=str(allocation.node_rank),
        node_rank_from="SLURM_NODEID",
        endpoint=allocation.endpoint,
        job_id=allocation.job_id,
        source=f"SLURM job {allocation.job_id}",
        restarted_by_exit_code=False,
    )


def _check_endpoint(endpoint: str) -> None:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or port_number(port) is None:
        raise UsageError(
            f"--rdzv-endpoint {endpoint}: expected HOST:PORT, e.g. node01:29500 (node 0's "
            "address and a free port there)"
        )
