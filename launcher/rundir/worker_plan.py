"""The one channel from the launcher to its workers: a resolved plan, written as JSON into the
node's folder before the workers start (`RunLayout.worker_plan`).

A worker reads this file and the environment torch.distributed defines (RANK, WORLD_SIZE,
TORCHELASTIC_RESTART_COUNT, ...), and nothing else of the launcher's. The few variables the
launcher sets for libraries (OMP_NUM_THREADS, glibc's and XLA's) are settings of those
libraries, not a channel: the worker's own code never reads them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.rundir.atomic import write_atomic
from launcher.rundir.reading import read_json
from launcher.storage_url import location

if TYPE_CHECKING:
    from launcher.config.spec import RunSpec


@dataclass(frozen=True)
class ReplicaGroup:
    """A replica group of a fault-tolerant run (`fault_tolerance`): its place in the run, and
    its processes'. The one place that says which ranks, devices and names a group has: the
    plan, the launcher's coordinator and the workers' engine all ask it."""

    index: int  # REPLICA_GROUP_ID: node K's groups come after those of the nodes before it
    count: int  # groups in the run
    lighthouse: str  # torchft's Lighthouse, http://HOST:PORT
    host: str  # the address the other groups reach this group's Manager at
    size: int = 1  # processes of each group
    per_node: int = 1  # groups on each machine (`fault_tolerance.replica_groups`)
    events: str = ""  # the run's fault-tolerance events folder (`launcher.rundir.fault_events`)
    listen: str = "127.0.0.1"  # the one address the group's servers listen on
    # The run's secret: a state server answers only a request that carries it, and the
    # groups' names carry a tag derived from it (`member_name`), which tells them from a
    # stranger's. Never shown: the Lighthouse's status page shows the names.
    token: str = ""

    @classmethod
    def on_node(
        cls,
        node_rank: int,
        local: int,
        *,
        per_node: int,
        nodes: int,
        size: int,
        lighthouse: str,
        host: str,
        events: str,
        listen: str,
        token: str,
    ) -> ReplicaGroup:
        """Group `local` (from 0) of node `node_rank`'s `per_node` groups, in a run of `nodes`
        machines, each group of `size` processes."""
        return cls(
            index=node_rank * per_node + local,
            count=per_node * nodes,
            lighthouse=lighthouse,
            host=host,
            size=size,
            per_node=per_node,
            events=events,
            listen=listen,
            token=token,
        )

    @property
    def local_index(self) -> int:
        """The group's index among this machine's groups."""
        return self.index % self.per_node

    @property
    def ranks(self) -> range:
        """The run's ranks of the group's processes (their logs' and heartbeats'): each group
        counts its own from 0, the run from group 0's first."""
        return range(self.index * self.size, (self.index + 1) * self.size)

    def global_rank(self, rank: int) -> int:
        """The run's rank of the group's process of rank `rank` (its rank in the group)."""
        return self.ranks[rank]

    @property
    def first_device(self) -> int:
        """This machine's device of the group's local rank 0: the machine's groups share its
        devices in order."""
        return self.local_index * self.size

    def member_name(self, index: int) -> str:
        """Group `index`'s name in the quorum (torchft's replica id; it reads the group's
        index from the trailing digits)."""
        tag = hashlib.sha256(self.token.encode()).hexdigest()[:12]
        return f"launcher_{tag}_group_{index}"

    def stranger(self, replica_ids: list[str]) -> str | None:
        """The first member of a quorum that is not one of the run's groups: a name that is
        not the run's, or a second member under one group's name. None: all are the run's."""
        names = {self.member_name(i): i for i in range(self.count)}
        seen: set[str] = set()
        for replica_id in replica_ids:
            name = replica_id.split(":", 1)[0]  # torchft appends ":<uuid>" per incarnation
            if name not in names or name in seen:
                return replica_id
            seen.add(name)
        return None


@dataclass(frozen=True)
class WorkerPlan:
    run_dir: Path
    # The resolved spec, as JSON (`launch.accelerator` and `launch.devices` are never `auto`).
    # Validated by `run_spec()`: reading the plan must not import torch, which starts threads
    # before the worker has set its signal mask.
    spec: dict[str, Any]
    accelerator: str  # "cpu", "gpu" or "tpu"
    # xla: torch_xla's spawn starts the replicas from one worker, one per device ("all") or
    # just one ("1"); None: the worker is the replica.
    xla_spawn: str | None = None
    rank_offset: int = 0  # a TPU pod host's first global rank: its agent numbers from 0
    # The checkpoint the run's first attempt starts from, as the launcher decided it once
    # (`launcher.checkpoint.resume_decision`); a restarted attempt asks the rule again
    # (`launcher.checkpoint.selection.attempt_start`).
    resume_from: Any = None  # a Path, or a UPath in a store (launcher.storage_url)
    # Where checkpoints go, as the launcher resolved `checkpoint.dir` once: the store's
    # description (`launcher.checkpoint.store.Store.describe`: its location and storage
    # options), from which each worker builds it. None: the run folder's `checkpoints/`.
    store: dict[str, Any] | None = None
    # Whether nodes may join the run (several nodes): torch's agent then restarts a healthy
    # attempt to take one in, and a first attempt must look for a newer checkpoint than
    # `resume_from`; a run of one machine's never does, and lists nothing to start.
    nodes_may_join: bool = True
    compile_cache: Path | None = None  # XLA's (TPUs only) or inductor's (train.compile)
    # The YAML file as this launch read it: every checkpoint records it for the next resume.
    config_file: dict[str, Any] | None = None
    # GPU runs: the layout's memory per device as estimated before start, in bytes by part;
    # summary.json gives it beside the measured peak.
    memory_estimate: dict[str, int] | None = None
    replica_group: ReplicaGroup | None = None  # fault_tolerance's: this group's place
    # The launcher that wrote the plan, whose elastic agent signals the workers: their
    # parent, unless the fork server (`launch.worker_start`) is. None: the parent.
    launcher_pid: int | None = None

    def run_spec(self) -> RunSpec:
        from launcher.config.spec import RunSpec

        return RunSpec.model_validate(self.spec)

    def write(self, path: Path) -> None:
        record: dict[str, Any] = asdict(self)
        # Absolute, as seen from the launch folder: a recipe may os.chdir() in a worker.
        record["run_dir"] = str(self.run_dir.absolute())
        for key in ("resume_from", "compile_cache"):
            record[key] = _absolute(record[key])
        # Private: a fault-tolerant run's token is in it (`ReplicaGroup.token`).
        write_atomic(path, json.dumps(record, indent=1) + "\n", private=True)

    @classmethod
    def read(cls, path: Path) -> WorkerPlan:
        record = read_json(path, "worker plan")
        record["run_dir"] = Path(record["run_dir"])
        # A checkpoint in a store is read with the run's storage options.
        options = ((record.get("spec") or {}).get("checkpoint") or {}).get("storage_options")
        resume_from = record["resume_from"]
        record["resume_from"] = None if resume_from is None else location(resume_from, options)
        record["compile_cache"] = Path(record["compile_cache"]) if record["compile_cache"] else None
        group = record.get("replica_group")
        record["replica_group"] = ReplicaGroup(**group) if group else None
        return cls(**record)


def _absolute(place: Any) -> str | None:
    """A folder as seen from the launch folder (a recipe may os.chdir() in a worker); a URL
    as it is."""
    if place is None:
        return None
    return str(place.absolute())  # a UPath's is itself
