"""Checkpoints: torch.distributed.checkpoint (DCP) folders, published whole or not at all.

Layout: RUN_DIR/checkpoints/step-00000100/ (or `checkpoint.dir`'s store) holds DCP's files
(model, optimizer, precision state, each rank writing its own part), `rank-N.pt` (each rank's
RNG and loop state), `meta.json` (progress, scheduler and the spec, as JSON) and a `COMPLETE`
marker.

Rank 0 publishes a checkpoint only once every rank has finished writing (how, on a disk and on
an object store: `launcher.checkpoint.store`), so a crash at any moment of a save never leaves
a folder that looks complete. Old checkpoints are pruned only after a new one is published.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from launcher.checkpoint.checksums import Unreadable
from launcher.checkpoint.format import (
    check_matches,
    loaded_keys,
    read_meta,
    saved_with,
    weights_only_planner,
)
from launcher.checkpoint.save_failure import causes, failing_save
from launcher.checkpoint.state import LoopState, ModelState
from launcher.checkpoint.store import Store, kind_for, step_of, store_of_run
from launcher.errors import RunError
from launcher.parallel.base import Strategy, local_shard
from launcher.parallel.dims import ParallelDims
from launcher.rundir.layout import CheckpointFiles
from launcher.rundir.reading import open_file

# A background save still writing when the next one starts, for longer than this, is worth
# a warning: shorter waits are noise next to a step.
SLOW_WRITE_S = 0.05


@dataclass
class _Pending:
    step: int
    staging: Any
    meta: dict[str, Any]
    future: Any
    started: float  # perf_counter() when the save began
    writer: Any  # DCP's writer, which records every file it writes


class Checkpointer:
    """Saves checkpoints; every method is collective (all ranks call it at the same step).

    With `use_async`, `save` returns at once: DCP copies the state to memory in a background
    thread while the next forward and backward run (`before_update` waits for the copy before
    the optimizer changes the state), then writes the files in another background thread over
    a process group of its own, so that its collectives never interleave with training's. The
    checkpoint is published when the write has finished (`poll`, once per step) and before the
    next save starts.
    """

    def __init__(
        self,
        strategy: Strategy,
        run_dir: Path,
        model: ModelState,
        train: LoopState,
        *,
        keep_last: int | None = None,
        use_async: bool = False,
        store: Store | None = None,
    ) -> None:
        # Where checkpoints go: the worker plan's store (else the one the run folder records).
        self.store = store or store_of_run(run_dir)
        self.store.start_attempt(strategy, run_dir)  # before the first save, not at it
        self.strategy = strategy
        self.run_dir = run_dir
        self.protected: set[int] = set()  # steps never pruned: the one this attempt resumed from
        # Each save's seconds from its start to its publication (rank 0): the write itself,
        # in the background for async saves (summary.json's `checkpoint_written_s`).
        self.write_times: list[float] = []
        self.model = model  # DCP: each rank writes its shards
        self.train = train  # meta.json (rank 0) and rank-N.pt (each rank)
        self.keep_last = keep_last
        self.use_async = use_async
        self._pending: _Pending | None = None
        # The newest checkpoint this attempt saved or resumed from in its store: what a bucket
        # deleted mid-run takes along (`save_failure.failing_save`), which no listing can say.
        self._newest: Any = None
        self._said_slow = False  # the warning that saves outpace the storage, once a run
        self._staging: Any = None  # the background copy of the state, while it runs
        # Background writes (torch.distributed's strategies alone: the registry's
        # `async_checkpoints`) need a CPU (gloo) group for DCP's async writer, one of their own
        # so that its collectives never interleave with the training step's.
        self._group = torch.distributed.new_group(backend="gloo") if use_async else None
        self._stager = _background_stager(strategy.device.type) if use_async else None

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp  # 0.5 s of imports: not on the way to step 1

        # The state as it is now, before the waits below: on XLA a barrier cuts the graph,
        # which advances the random seed this rank's state records.
        rank_state = self.train.rank_state_dict()
        meta = {**self.train.state_dict(), "step": step, "time": time.time()}
        state = self.model.state_dict()
        self._wait_for_previous(step)
        started = time.perf_counter()
        staging = self.store.where(step)
        with failing_save(self.store, step, self.run_dir, self._newest):
            if self.store.prepares:  # a folder made before any rank writes into it
                if self.strategy.is_main:
                    self.store.prepare(staging)
                self.strategy.barrier()
            rank_file = CheckpointFiles(staging).rank_state(self.strategy.rank)
            # The store's own writer, and no checkpoint_id: DCP would build a writer anew
            # from it, without the store's options. It writes this rank's own file with its
            # shards, in the background for an async save, so that DCP's gather of every
            # rank's results covers it.
            writer = self.store.writer(staging, rank_file, torch_bytes(rank_state))
            if self.use_async:
                module = getattr(self.model, "model", None)
                state = {**state, "model": snapshot_buffers(state.get("model", {}), module)}
                response = dcp.async_save(
                    state,
                    storage_writer=writer,
                    process_group=self._group,
                    **({"async_stager": self._stager} if self._stager else {}),
                )
                future = getattr(response, "upload_completion", response)
                self._staging = getattr(response, "staging_completion", None)
                self._pending = _Pending(step, staging, meta, future, started, writer)
                return
            with _quiet_dcp():
                dcp.save(
                    state,
                    storage_writer=writer,
                    planner=self.strategy.planners().save,
                )
            self._publish(staging, step, meta, started, writer)
        self.strategy.barrier()

    def _wait_for_previous(self, step: int) -> None:
        """`wait`, saying once when a background save was still writing: saves that come
        faster than the storage writes them block training as sync saves would."""
        pending = self._pending
        started = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - started
        if pending is None or waited < SLOW_WRITE_S or self._said_slow or not self.strategy.is_main:
            return
        self._said_slow = True
        print(
            f"WARNING: checkpoint: the save at step {step} waited {waited:.1f} s for the one at "
            f"step {pending.step} to finish writing: saves come faster than the storage takes "
            "them, so training waits as it would for a sync save. Raise "
            "checkpoint.every_n_steps (or use faster storage).",
            flush=True,
        )

    def load(self, path: Any) -> bool:
        """Collective: restores every state from the checkpoint at `path` (a folder or a URL).
        Returns whether this rank's own streams continue (False: saved with another world
        size). A checkpoint of this run's own store is never pruned by this attempt."""
        if path in self.store.complete():
            self.protected.add(step_of(path) or 0)
            self._newest = path
        state = self.model.state_dict()
        for key in ("ema", "engine"):  # train.ema or DiLoCo is new: it starts from the weights
            if key in state and not saved_with(path, f"{key}."):
                del state[key]
        try:
            own = load(path, state, self.strategy)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            unreadable = next((c for c in causes(exc) if isinstance(c, Unreadable)), None)
            if unreadable is None:
                raise
            raise RunError(
                f"checkpoint {path} could not be loaded: {unreadable}",
                hint="The store did not serve the whole file: check the store and the network, "
                "then run again.",
            ) from exc
        self.model.load_state_dict(state)
        self.train.load_state_dict(read_meta(path), own)
        return own is not None

    def before_update(self) -> float:
        """Waits for a background copy of the state (before the optimizer changes it);
        returns the seconds waited."""
        if self._staging is None:
            return 0.0
        started = time.perf_counter()
        self._staging.result()
        self._staging = None
        return time.perf_counter() - started

    def close(self) -> None:
        self.wait()
        if self._stager is not None:
            self._stager.close()
            _release_buffers(self._stager)

    def poll(self) -> None:
        """Publishes a finished background save; never blocks."""
        if self._pending is not None and self._pending.future.done():
            self._finish()

    def wait(self) -> None:
        """Blocks until the pending save, if any, is written and published. Collective."""
        if self._pending is not None:
            self._finish()
        if self.use_async:
            # Unconditional: `poll` may have finished the save on some ranks and not on others,
            # and every rank must call the same barriers.
            self.strategy.barrier()

    def _finish(self) -> None:
        pending, self._pending = self._pending, None
        assert pending is not None
        with failing_save(self.store, pending.step, self.run_dir, self._newest):
            pending.future.result()  # a failed write raises here, on the training thread
            # Rank 0's write ends with DCP gathering every rank's results, so all are written.
            self._publish(
                pending.staging, pending.step, pending.meta, pending.started, pending.writer
            )

    def _publish(
        self, staging: Any, step: int, meta: dict[str, Any], started: float, writer: Any
    ) -> None:
        self._newest = self.store.checkpoint(step)
        if not self.strategy.is_main:
            return
        self.store.publish(staging, step, json.dumps(meta), writer)
        self.write_times.append(time.perf_counter() - started)
        # The best checkpoints as of this one are kept whatever their age.
        best = [step for step, _ in (meta.get("best") or {}).get("kept", [])]
        for old in self.store.prunable(self.keep_last, protected={*best, *self.protected}):
            self.store.remove(old)


def snapshot_buffers(model_state: dict[str, Any], model: torch.nn.Module | None) -> dict[str, Any]:
    """Copies the model's non-parameter tensors (buffers) now. An async save copies the state
    in the background while the next forward runs, and a forward may update buffers in place
    (BatchNorm statistics, DDP's buffer broadcast); parameters only change in the optimizer
    step, which waits for the copy."""
    params = {_address(p) for p in model.parameters()} if model is not None else set()
    return {
        k: v.clone() if isinstance(v, torch.Tensor) and _address(v) not in params else v
        for k, v in model_state.items()
    }


def _address(tensor: torch.Tensor) -> int:
    return local_shard(tensor).data_ptr()


def load(path: Any, state: dict[str, Any], strategy: Strategy) -> dict[str, Any] | None:
    """Collective: fills `state` in place, never unpickling arbitrary code.

    Returns this rank's own saved state (RNG, loop), or None when the checkpoint was saved
    with another world size or tensor-parallel degree, where per-rank streams cannot continue
    exactly.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    check_matches(path, state, held_elsewhere=_held_elsewhere(state, strategy))
    from torch.distributed.checkpoint._traverse import set_element

    # Loaded as `{"model.a.weight": ..., "optim.param_groups.0.lr": ...}`, the keys DCP's
    # default planner writes, so that planners that flatten less (XLA's SPMD ones) find them.
    flat, mapping = flatten_state_dict(state)
    flat = loaded_keys(flat)
    with _quiet_dcp():
        planner = strategy.planners().load or weights_only_planner()
        source = kind_for(path).reader(path)  # a store's; DCP picks its own for a folder
        dcp.load(
            flat, checkpoint_id=None if source else path, storage_reader=source, planner=planner
        )
    for key, value in flat.items():  # tensors were filled in place; plain values replaced
        set_element(state, mapping[key], value)
    if not same_data_ranks(read_meta(path), strategy):
        return None
    with open_file(CheckpointFiles(path).rank_state(strategy.rank)) as file:
        return torch.load(io.BytesIO(file.read()), weights_only=True)


def torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _held_elsewhere(state: dict[str, Any], strategy: Strategy) -> frozenset[str]:
    """Collective where the layout has a pipeline: the state keys other processes hold and
    this one does not (the other stages'); none elsewhere, where every process holds every
    key."""
    if strategy.layout.pp == 1:
        return frozenset()
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    mine = set(flatten_state_dict(state)[0])
    everyone = set().union(*(set(keys) for keys in strategy.control.gather(sorted(mine))))
    return frozenset(everyone - mine)


def same_data_ranks(meta: dict[str, Any], strategy: Strategy) -> bool:
    """Whether each rank of this run takes the data the same rank of the checkpoint's took:
    the same world, and every rank at the same data-parallel rank (the layout's, read from
    the checkpoint's meta: `ParallelDims.from_record`)."""
    world = strategy.world_size
    if meta.get("world_size") != world:
        return False
    saved = saved_layout(meta)
    return all(saved.dp_rank(r) == strategy.layout.dp_rank(r) for r in range(world))


def saved_layout(meta: dict[str, Any]) -> ParallelDims:
    """The dimensions of the run that wrote a checkpoint, from its meta.json."""
    return ParallelDims.from_record(meta.get("layout"), meta["world_size"], meta.get("tp", 1))


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    # Warnings DCP gives on every save of a single process (XLA SPMD, one XLA device) and on
    # torch 2.9, which say nothing the user can act on.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        # torch_xla 2.9's SPMD planners, on their own deprecated calls:
        warnings.filterwarnings("ignore", message="Using a non-tuple sequence")
        yield


def _background_stager(device_type: str) -> Any:
    """A stager that copies the state to memory in a thread of its own, into the same buffers
    from one save to the next (from a GPU: pinned, non-blocking copies, at the link's full
    speed); None where this torch has none (the copy then blocks)."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        return None
    cuda = device_type == "cuda"
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=cuda,
        )
    )
    _keep_buffers(stager, pin_memory=cuda)
    return stager


def _keep_buffers(stager: Any, pin_memory: bool) -> None:
    """torch 2.11's DefaultStager closes its inner StateDictStager after every staging, which
    drops the host copies it keeps for the next save: each save then allocated and pinned
    the whole state again (on an H200, a 1 GB state's async save blocked training 12.6% as
    long as a sync save). Its replacement here closes only with the checkpointer
    (`_release_buffers`). The buffers are safe to reuse: a save starts only once the previous
    one has written them (`Checkpointer.wait`)."""
    try:
        from torch.distributed.checkpoint._state_dict_stager import StateDictStager
    except ImportError:  # another torch: its own stager's behaviour stands
        return
    if not isinstance(getattr(stager, "_state_dict_stager", None), StateDictStager):
        return

    class KeptBuffers(StateDictStager):
        def close(self) -> None:  # what DefaultStager calls after each staging (torch 2.11)
            pass

        def release(self) -> None:
            super().close()

    stager._state_dict_stager = KeptBuffers(pin_memory=pin_memory, share_memory=False)


def _release_buffers(stager: Any) -> None:
    release = getattr(getattr(stager, "_state_dict_stager", None), "release", None)
    if release is not None:
        release()
