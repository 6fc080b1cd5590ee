"""From a validated spec and the command line to a `LaunchPlan`: plain, resolved values.

Nothing here starts a process or writes a file, so every decision can be unit-tested.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.checkpoint.resume_decision import ResumeDecision, decide_resume
from launcher.checkpoint.store import Store, store_at
from launcher.checkpoint.weights_source import KEY, check_weights
from launcher.clusters.kubernetes import NPROC_PER_NODE
from launcher.clusters.nodes import Nodes
from launcher.clusters.tpu_pod import host_index
from launcher.config.fault_tolerance import FT_SECRET_VARIABLE, restart_warnings
from launcher.config.loader import SpecLayers
from launcher.config.sources import changed_keys
from launcher.config.spec import RunSpec
from launcher.errors import UsageError
from launcher.launch.devices import Devices, resolve_accelerator, resolve_devices, xla_device_type
from launcher.launch.display.lines import parse_ranks
from launcher.launch.interfaces import address_towards, is_loopback, socket_interface_env
from launcher.launch.rendezvous import LOOPBACK
from launcher.metrics.trackers import check_trackers_usable
from launcher.parallel import float8
from launcher.parallel.dims import resolve_dims
from launcher.parallel.registry import strategy_info, worker_env
from launcher.plain_number import plain_number
from launcher.replicas.registry import coordinator_function
from launcher.rundir.layout import RunLayout
from launcher.rundir.worker_plan import ReplicaGroup, WorkerPlan
from launcher.storage_url import location


@dataclass(frozen=True)
class LaunchPlan:
    spec: RunSpec
    run_dir: Path
    accelerator: str  # "cpu", "gpu" or "tpu": never "auto"
    devices: Devices  # this node's devices, processes and replicas
    resume_from: Path | None  # the complete checkpoint the run's first attempt starts from
    show_ranks: frozenset[int] | None  # --ranks display filter; None shows every rank
    omp_threads: int
    debug: bool = False
    notes: tuple[str, ...] = ()  # warnings for the user, printed before the run starts
    # GPU runs: the layout's memory per device, estimated before start (bytes by part)
    memory_estimate: dict[str, int] | None = None
    # The installed libraries' modules the recipe imports (`cli/recipe_check.py`): the
    # workers' fork server imports them once for every worker (`launch.worker_start`).
    recipe_libraries: tuple[str, ...] = ()
    host_index: int = 0  # a TPU pod's host: its processes' ranks come after the hosts before it
    nodes: Nodes = field(default_factory=Nodes)  # the run's nodes; this plan is one node's
    # {dotted key: where its value came from}: spec.yaml's comments (launcher.config.sources)
    sources: dict[str, str] = field(default_factory=dict)
    changes: tuple[str, ...] = ()  # a resume's changes to the run's spec, said before it starts
    # The YAML file as this launch read it: each checkpoint records it, so that the next resume
    # tells the keys edited since from those that were not (launcher.config.resume).
    config_file: dict[str, Any] | None = None
    run_dir_given: bool = False  # by --run-dir: errors about the folder name the flag
    # The one address this node's servers listen on (`launcher.launch.interfaces`): loopback
    # on one machine, the rendezvous network's for replica groups across machines; "": the
    # libraries' choice (a run of several machines without replica groups).
    listen: str = LOOPBACK
    # fault_tolerance: the run's secret, which its replica groups' servers ask of a request
    # (`ReplicaGroup.token`); every node of a run has the same.
    replica_token: str = ""
    # Where checkpoints go, resolved once with the resume (`resume_decision`); None: the run
    # folder's `checkpoints/` (`store`).
    checkpoint_store: Store | None = None

    @property
    def store(self) -> Store:
        """Where the run's checkpoints go: `checkpoint.dir`'s store, or the run folder's."""
        return self.checkpoint_store or store_at(self.layout.checkpoints)

    @property
    def folder_label(self) -> str:
        """How errors name the run folder: by the flag that gave it, where one did."""
        return f"{'--run-dir' if self.run_dir_given else 'run folder'} {self.run_dir}"

    @property
    def nproc(self) -> int:
        """Worker processes the elastic agent starts on this node."""
        return self.devices.processes

    @property
    def replica_groups(self) -> int:
        """Replica groups on this machine, each under an agent of its own (`fault_tolerance`);
        0 without fault tolerance."""
        ft = self.spec.fault_tolerance
        return ft.replica_groups if ft.enabled else 0

    @property
    def group_size(self) -> int:
        """Processes of one replica group."""
        return self.nproc // max(1, self.replica_groups)

    def replica_group(self, local: int, lighthouse: str) -> ReplicaGroup:
        """This machine's replica group `local` (from 0), its Lighthouse at `lighthouse`."""
        return ReplicaGroup.on_node(
            self.nodes.node_rank or 0,
            local,
            per_node=self.replica_groups,
            nodes=self.nodes.max,
            lighthouse=lighthouse,
            host=self.group_host,
            size=self.group_size,
            events=str(self.layout.fault_events.absolute()),
            listen=self.listen,
            token=self.replica_token,
        )

    @property
    def forks_workers(self) -> bool:
        """`launch.worker_start`, resolved: whether the workers are forked by the fork server
        (`launcher.launch.fork_server`) rather than started as new interpreters."""
        return workers_forked(self.spec, self.accelerator)

    @property
    def group_host(self) -> str:
        """The address the other groups reach this machine's groups at (their stores,
        Managers and state servers), which they listen on alone."""
        return self.listen

    def worker_env(self) -> dict[str, str]:
        """Settings of the libraries in the workers' processes (OpenMP's threads, glibc's
        allocator, XLA's device count, MLflow's logging), on top of the launcher's environment,
        which wins for the defaults so a user's setting is kept. Never read by the worker's own
        code: that reads its plan (`worker_plan`)."""
        env = {
            "OMP_NUM_THREADS": str(self.omp_threads),
            **worker_env(self.spec.launch.strategy, self.accelerator),
            # MLflow's INFO lines (its database's set-up, ...) would fill the live stream;
            # --debug brings them back, as it does the elastic agent's. MLflow reads it as
            # it is imported, by the tracker's sink or by the recipe.
            **({} if self.debug else {"MLFLOW_LOGGING_LEVEL": "WARNING"}),
        }
        env |= self._socket_interfaces()
        env = {k: os.environ.get(k, v) for k, v in env.items()}
        return env | self.devices.env  # the device count is the plan's, not a leftover's

    def _socket_interfaces(self) -> dict[str, str]:
        """gloo and NCCL listen on the host name's interface unless told: on one machine,
        loopback; across machines, the replica groups' gloo on the rendezvous network. NCCL
        across machines, and a run's own gloo there, pick as torch does."""
        if is_loopback(self.listen):
            return socket_interface_env(self.listen, nccl=True)
        return socket_interface_env(self.listen, nccl=False) if self.replica_groups else {}

    def worker_plan(self, group: ReplicaGroup | None = None) -> WorkerPlan:
        """What this node's workers are told (the only thing they are told); `group`: those of
        one replica group."""
        spawn = strategy_info(self.spec.launch.strategy).processes == "xla_spawn"
        return WorkerPlan(
            run_dir=self.run_dir,
            spec=self.spec.model_dump(mode="json", by_alias=True),
            accelerator=self.accelerator,
            xla_spawn=("all" if self.devices.spawn_all else "1") if spawn else None,
            # A replica group's agent numbers its processes from 0, as a TPU host's does.
            rank_offset=self.rank_offset + (group.ranks.start if group else 0),
            resume_from=self.resume_from,
            # The run folder's own `checkpoints/` goes without saying: the worker finds it
            # from `run_dir`, wherever the folder is (a copied plan's too).
            store=self.store.describe() if self.store.remote else None,
            nodes_may_join=self.nodes.multi,
            compile_cache=self._compile_cache(),
            config_file=self.config_file,
            memory_estimate=self.memory_estimate,
            replica_group=group,
            launcher_pid=os.getpid(),
        )

    def _compile_cache(self) -> Path | None:
        """XLA's persistent compile cache: the run folder's, or the user's own
        XLA_PERSISTENT_CACHE_PATH. TPUs only: XLA's CPU client cannot load the executables
        it serialises. Under `train.compile`, inductor's cache: the run folder's, or the
        user's own TORCHINDUCTOR_CACHE_DIR."""
        if self.spec.train.compile:
            return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or self.layout.compile_cache)
        on_tpu = self.accelerator == "tpu" and xla_device_type() == "TPU"
        if not (on_tpu and self.spec.xla.compile_cache):
            return None
        return Path(os.environ.get("XLA_PERSISTENT_CACHE_PATH") or self.layout.xla_cache)

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.run_dir)

    @property
    def node_dir(self) -> Path:
        """This node's own files (spec copy, worker plan, agent logs) when the run folder is
        shared by several nodes or TPU hosts; the run folder itself for a run of one machine."""
        if self.nodes.multi:
            return self.layout.node(self.nodes.node_rank, elastic=True)
        return self.layout.node(tpu_host=self.host_index)

    @property
    def writes_shared_files(self) -> bool:
        """Whether this node writes the run's own files (spec.yaml): node 0 only."""
        if self.nodes.multi:
            return self.nodes.node_rank == 0
        return self.host_index == 0

    @property
    def rank_offset(self) -> int:
        """The global rank of this host's first log on a TPU pod (torch_xla numbers hosts'
        devices one host after the other); 0 elsewhere."""
        return self.host_index * self.devices.replica_logs


def workers_forked(spec: RunSpec, accelerator: str) -> bool:
    """`launch.worker_start` resolved for `accelerator`: `auto` forks on Linux CPUs, where
    the server is forked from the launcher itself and every start, the first too, is a fork
    of it (bench/worker_start.py). GPUs too, once a GPU session has measured it (issue 58).
    The xla strategies start their replicas themselves (torch_xla's spawn, or one process
    driving every device)."""
    start = spec.launch.worker_start
    if start != "auto":
        return start == "forkserver"
    per_device = strategy_info(spec.launch.strategy).processes == "per_device"
    return sys.platform == "linux" and accelerator == "cpu" and per_device


def make_plan(
    spec: RunSpec,
    *,
    run_dir: Path | None = None,
    resume: str | None = None,
    ranks: str | None = None,
    debug: bool = False,
    nodes: Nodes | None = None,
    sources: dict[str, str] | None = None,
    layers: SpecLayers | None = None,  # what the user gave: a resume merges it onto the run's
    resume_decided: ResumeDecision | None = None,  # already decided (a resume without --config)
) -> LaunchPlan:
    nodes = nodes or Nodes()
    decision = resume_decided or decide_resume(
        spec, resume=resume, run_dir=run_dir, job_id=nodes.job_id, layers=layers, sources=sources
    )
    spec, sources, resume_from = decision.spec, decision.sources, decision.checkpoint
    _check_no_tpu_nodes(spec, nodes)
    accelerator = resolve_accelerator(spec.launch.accelerator, spec.launch.strategy)
    _check_options(spec, accelerator)
    devices = _checked_devices(spec, accelerator, nodes, sources)
    listen = _listen_address(nodes, spec.fault_tolerance.enabled)
    check_groups = coordinator_function(spec.fault_tolerance, "check")
    if check_groups is not None:  # replica groups (fault_tolerance): their engine's checks
        check_groups(spec, devices.processes, nodes, listen)
        per_group = devices.processes // spec.fault_tolerance.replica_groups
        resolve_dims(spec.parallel, spec.launch.strategy, per_group, per_group)  # its own mesh
    resolved, notes = _resolved(_weights_found(spec, resume_from), accelerator, devices)
    sources = _with_resolved(sources, spec, resolved)
    spec = resolved
    on_tpu = accelerator == "tpu" and xla_device_type() == "TPU"
    try:
        show = parse_ranks(ranks) if ranks else None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return LaunchPlan(
        spec=spec,
        run_dir=decision.run_dir,
        accelerator=accelerator,
        devices=devices,
        resume_from=resume_from,
        show_ranks=show,
        omp_threads=_omp_threads(accelerator, devices.processes),
        debug=debug,
        notes=notes,
        host_index=host_index(os.environ) if on_tpu else 0,
        nodes=nodes,
        sources=sources,
        changes=decision.said,
        config_file=decision.config_file,
        run_dir_given=run_dir is not None,
        listen=listen,
        replica_token=_replica_token(nodes) if spec.fault_tolerance.enabled else "",
        checkpoint_store=decision.store,
    )


def _check_no_tpu_nodes(spec: RunSpec, nodes: Nodes) -> None:
    """Before the accelerator is resolved (which fails without torch_xla): `auto` means a TPU
    exactly for the strategies that run on nothing else."""
    tpu_only = strategy_info(spec.launch.strategy).accelerators == ("tpu",)
    if nodes.multi and (spec.launch.accelerator == "tpu" or tpu_only):
        raise UsageError(
            f"--nnodes {nodes.max}: TPU hosts do not rendezvous through the launcher; run the "
            "same train command, without --nnodes, on every host of the pod",
            hint="gcloud compute tpus tpu-vm ssh NAME --worker=all --command='train ...' "
            "(docs/tpus.md, 'Multi-host TPU pods').",
        )


def _listen_address(nodes: Nodes, replica_groups: bool) -> str:
    """Loopback for a run of one machine; across machines, the rendezvous network's address
    for the replica groups' servers, and none for a run without them (torch's rendezvous
    and process groups pick their own)."""
    if not nodes.multi or nodes.is_local:
        return LOOPBACK
    return address_towards(nodes.host) if replica_groups else ""


def _replica_token(nodes: Nodes) -> str:
    """The run's secret for its replica groups: a new one for a run of one machine. Every
    node of a run must have the same: LAUNCHER_FT_SECRET where the user sets one on each,
    else one derived from the job's name and rendezvous (docs/fault-tolerance.md: then the
    network's fence is what keeps strangers out)."""
    if not nodes.multi:
        return secrets.token_hex(16)
    given = os.environ.get(FT_SECRET_VARIABLE)
    if given:
        return given
    return hashlib.sha256(f"{nodes.job_id}|{nodes.endpoint}".encode()).hexdigest()[:32]


def _weights_found(spec: RunSpec, resume_from: Path | None) -> RunSpec:
    """The spec with `load.weights` as the workers will read it (a run folder's newest
    complete checkpoint); weights that are missing, damaged or of no known format are refused
    before anything starts. A resume never reads them: they may be gone."""
    if spec.load.weights is None or resume_from is not None:
        return spec
    source = check_weights(location(spec.load.weights, what=KEY))
    load = spec.load.model_copy(update={"weights": str(source.path)})
    return spec.model_copy(update={"load": load})


def _check_options(spec: RunSpec, accelerator: str) -> None:
    """Options that the resolved accelerator, the strategy or this environment cannot
    honour."""
    check_trackers_usable(spec.log.trackers)
    if spec.launch.strategy == "fsdp" and spec.fsdp.cpu_offload and accelerator != "gpu":
        raise UsageError(
            "fsdp.cpu_offload: moves shards from GPU memory to CPU memory, so it needs "
            f"--accelerator gpu (this run is on {accelerator}, where they already are)"
        )
    info = strategy_info(spec.launch.strategy)
    if spec.checkpoint.async_ and not info.async_checkpoints:
        raise UsageError(
            f"checkpoint.async: not available with strategy {spec.launch.strategy}; its "
            "checkpoints are written synchronously",
            hint="Set checkpoint.async=false.",
        )
    if spec.train.float8:
        float8.check(accelerator, spec.parallel.tp, _gpu_capability(accelerator))
    if accelerator == "tpu" and spec.train.precision == "fp16":
        raise UsageError(
            "train.precision: fp16 is not supported on TPU",
            hint="Use bf16: TPUs compute in it natively, and it needs no loss scaling.",
        )


def _gpu_capability(accelerator: str) -> tuple[int, int] | None:
    """The first GPU's compute capability; None off GPUs, or where none is visible."""
    if accelerator != "gpu":
        return None
    import torch

    return torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None


def _checked_devices(
    spec: RunSpec, accelerator: str, nodes: Nodes, sources: dict[str, str]
) -> Devices:
    """This node's devices, with the `parallel` degrees checked against every world the run
    may have (an elastic run's least and most nodes) before anything starts; the workers
    resolve them again on the world they get."""
    named = _devices_named(spec.launch.devices, sources.get("launch.devices"))
    devices = resolve_devices(spec.launch.devices, accelerator, spec.launch.strategy, named)
    for count in sorted({nodes.min, nodes.max}):
        per_node = devices.processes
        resolve_dims(spec.parallel, spec.launch.strategy, per_node * count, per_node)
    return devices


def _devices_named(devices: int | str, source: str | None) -> str:
    """How an error names `launch.devices`, by what set it: the flag, Kubeflow's
    PET_NPROC_PER_NODE, or the key (in the YAML file, or an override)."""
    source = (source or "").split(" (over ")[0]  # what set it, not what it overrode
    if not source or source == "--devices":
        return f"--devices {devices}"
    if source.startswith(NPROC_PER_NODE):  # "PET_NPROC_PER_NODE (Kubeflow PyTorchJob x)"
        return f"{NPROC_PER_NODE}={devices}{source.removeprefix(NPROC_PER_NODE)}"
    return f"launch.devices: {devices} ({source})"


def _resolved(spec: RunSpec, accelerator: str, devices: Devices) -> tuple[RunSpec, tuple[str, ...]]:
    """The spec as this run runs it (spec.yaml and the worker plan say the same): no `auto`
    left, and what the accelerator forces; with a warning for each forced value."""
    launch = {"accelerator": accelerator, "devices": devices.count}
    update: dict[str, object] = {"launch": spec.launch.model_copy(update=launch)}
    notes = restart_warnings(spec.fault_tolerance.enabled, spec.launch.max_restarts)
    if accelerator == "tpu" and not spec.data.drop_last:
        # A short last batch is a new input shape, and every new shape is a new XLA compile.
        update["data"] = spec.data.model_copy(update={"drop_last": True})
        notes.append(
            "data.drop_last=false is ignored on TPU: a short last batch would be a new shape, "
            "and XLA would compile the whole step again for it"
        )
    return spec.model_copy(update=update), tuple(notes)


def _with_resolved(sources: dict[str, str], given: RunSpec, resolved: RunSpec) -> dict[str, str]:
    """`sources`, and "resolved at launch" for each key `_resolved` changed."""
    out = dict(sources)
    for key, was in changed_keys(given, resolved).items():
        given_by = f" from {out[key]}" if key in out else ""
        out[key] = f"resolved at launch (was {was!r}{given_by})"
    return out


def _omp_threads(accelerator: str, nproc: int) -> int:
    if "OMP_NUM_THREADS" in os.environ:
        value = os.environ["OMP_NUM_THREADS"]
        threads = plain_number(value, digits=6)
        if not threads:  # None, or 0
            raise UsageError(f"OMP_NUM_THREADS={value!r}: expected a positive number, or unset it")
        return threads
    if accelerator == "cpu":
        # Oversubscribed cores make every replica slower than fewer threads would.
        return max(1, (os.cpu_count() or 1) // nproc)
    return 1
