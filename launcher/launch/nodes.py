"""Which nodes a run spans: `--nnodes`, `--node-rank`, `--rdzv-endpoint` and `--rdzv-id`, or
the same four from a SLURM allocation. Plain values, checked here, before anything starts."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from launcher.errors import UsageError
from launcher.launch import slurm

_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


@dataclass(frozen=True)
class Nodes:
    min: int = 1
    max: int = 1
    node_rank: int | None = None  # None: c10d's order (an elastic run, or no --node-rank)
    endpoint: str | None = None  # HOST:PORT of the rendezvous, on node 0
    job_id: str | None = None  # the rendezvous id; it also names the run folder
    source: str = ""  # "SLURM job 123" when the values came from an allocation

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
) -> Nodes:
    """The flags, with a SLURM allocation's values where a flag is not given."""
    allocation = slurm.from_environment(env or {})
    source = ""
    if allocation is not None:
        slurm.check_one_task_per_node(env or {})
    if allocation is not None and allocation.nnodes == 1:
        # One node needs nothing from SLURM, and its runs (a sweep in one job, say) keep
        # folders of their own; the batch script passes --rdzv-id itself.
        allocation = None
    if allocation is not None:
        source = f"SLURM job {allocation.job_id}"
        nnodes = nnodes or str(allocation.nnodes)
        node_rank = node_rank if node_rank is not None else str(allocation.node_rank)
        endpoint = endpoint or allocation.endpoint
        job_id = job_id or allocation.job_id
    low, high = _parse_nnodes(nnodes or "1")
    if high == 1 and not allocation and node_rank not in (None, "0"):
        raise UsageError(f"--node-rank {node_rank}: a run of one node has only node 0")
    rank = _parse_node_rank(node_rank, high) if node_rank is not None else None
    if job_id is not None and not _JOB_ID.match(job_id):
        raise UsageError(
            f"--rdzv-id {job_id!r}: it names the run folder, so use letters, digits, '.', '_' "
            "and '-' (at most 100)"
        )
    if high == 1:
        if not allocation and endpoint:
            raise UsageError("--rdzv-endpoint: only used with --nnodes above 1")
        # One node keeps its rendezvous on loopback; a job id still names its run folder.
        return Nodes(job_id=job_id, source=source)
    if not endpoint:
        raise UsageError(
            f"--rdzv-endpoint: needed with --nnodes {nnodes}: HOST:PORT of node 0, the same "
            "on every node",
            hint="e.g. --rdzv-endpoint node01:29500 (any free port on node 0).",
        )
    _check_endpoint(endpoint)
    if job_id is None:
        raise UsageError(
            f"--rdzv-id: needed with --nnodes {nnodes}: a name for this job, the same on every "
            "node (a job id, say); the run folder is named after it",
            hint="e.g. --rdzv-id exp42",
        )
    return Nodes(low, high, None if low != high else rank, endpoint, job_id, source)


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
    if not text.isdigit() or int(text) >= nnodes:
        raise UsageError(
            f"--node-rank {text}: expected 0 to {nnodes - 1}, this node's place among "
            f"{nnodes} nodes (node 0 hosts the rendezvous)"
        )
    return int(text)


def _check_endpoint(endpoint: str) -> None:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(
            f"--rdzv-endpoint {endpoint}: expected HOST:PORT, e.g. node01:29500 (node 0's "
            "address and a free port there)"
        )
