"""Checkpoints: torch.distributed.checkpoint (DCP) folders, published atomically.

Layout: RUN_DIR/checkpoints/step-00000100/ holds DCP's files (model, optimizer, precision
state, each rank writing its own part), `rank-N.pt` (each rank's RNG and loop state),
`meta.json` (progress, scheduler and the spec, as JSON) and a `COMPLETE` marker.

A checkpoint is written under a hidden `.step-N.partial` name and renamed into place by rank 0
only once every rank has finished writing, so a crash at any moment of a save never leaves a
folder that looks complete. Old checkpoints are pruned only after a new one is published.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from launcher.checkpoint_format import check_matches
from launcher.errors import RunError, UsageError
from launcher.strategies.base import Strategy

MARKER = "COMPLETE"
META = "meta.json"
_NAME = re.compile(r"^step-(\d{8,})$")


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:08d}"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name)[1]))  # type: ignore[index]


def latest_complete(run_dir: Path) -> Path | None:
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((path / META).read_text())


@dataclass
class _Pending:
    step: int
    staging: Path
    meta: dict[str, Any]
    future: Any


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
        keep_last: int | None,
        use_async: bool,
        model: torch.nn.Module | None = None,
    ) -> None:
        self.strategy = strategy
        self.model = model  # async saves copy its buffers at once (see snapshot_buffers)
        self.run_dir = run_dir
        self.keep_last = keep_last
        self.use_async = use_async
        self._pending: _Pending | None = None
        self._staging: Any = None  # the background copy of the state, while it runs
        self._group = strategy.checkpoint_group() if use_async else None
        self._stager = _background_stager() if use_async else None

    def save(
        self, step: int, state: dict[str, Any], meta: dict[str, Any], rank_state: dict[str, Any]
    ) -> None:
        import torch.distributed.checkpoint as dcp  # 0.5 s of imports: not on the way to step 1

        self.wait()
        final = checkpoint_dir(self.run_dir, step)
        staging = final.with_name(f".{final.name}.partial")
        if self.strategy.is_main:
            shutil.rmtree(staging, ignore_errors=True)  # left by a crash; never a published one
            staging.mkdir(parents=True)
        self.strategy.barrier()
        _save_synced(rank_state, staging / f"rank-{self.strategy.rank}.pt")
        meta = {**meta, "step": step, "time": time.time()}
        if self.use_async:
            state = {**state, "model": snapshot_buffers(state.get("model", {}), self.model)}
            response = dcp.async_save(
                state,
                checkpoint_id=staging,
                process_group=self._group,
                **({"async_stager": self._stager} if self._stager else {}),
            )
            future = getattr(response, "upload_completion", response)
            self._staging = getattr(response, "staging_completion", None)
            self._pending = _Pending(step, staging, meta, future)
        else:
            with _quiet_dcp():
                dcp.save(state, checkpoint_id=staging, planner=self.strategy.save_planner())
            self._publish(staging, final, meta)
            self.strategy.barrier()

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
        pending.future.result()  # a failed write raises here, on the training thread
        # Rank 0's write ends with DCP gathering every rank's results, so all are on disk.
        final = checkpoint_dir(self.run_dir, pending.step)
        self._publish(pending.staging, final, pending.meta)

    def _publish(self, staging: Path, final: Path, meta: dict[str, Any]) -> None:
        if not self.strategy.is_main:
            return
        _write_synced(staging / META, json.dumps(meta))
        _write_synced(staging / MARKER, "")
        if final.exists():  # never replace a published checkpoint (the plan prevents this)
            raise RunError(f"{final} already exists; not overwriting it")
        os.replace(staging, final)
        _fsync_dir(final.parent)
        if self.keep_last:
            for old in complete_checkpoints(self.run_dir)[: -self.keep_last]:
                # Unpublish first (atomic), so a crash mid-delete leaves no half checkpoint
                # that still looks complete.
                doomed = old.with_name(f".{old.name}.deleting")
                os.replace(old, doomed)
                shutil.rmtree(doomed, ignore_errors=True)


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
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.data_ptr()


def load(path: Path, state: dict[str, Any], strategy: Strategy) -> dict[str, Any] | None:
    """Collective: fills `state` in place, never unpickling arbitrary code.

    Returns this rank's own saved state (RNG, loop), or None when the checkpoint was saved
    with another world size, where per-rank streams cannot continue exactly.
    """
    import torch.distributed.checkpoint as dcp

    check_matches(path, state)
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint._traverse import set_element

    # Loaded as `{"model.a.weight": ..., "optim.param_groups.0.lr": ...}`, the keys DCP's
    # default planner writes, so that planners that flatten less (XLA's SPMD ones) find them.
    flat, mapping = flatten_state_dict(state)
    with _quiet_dcp():
        dcp.load(flat, checkpoint_id=path, planner=strategy.load_planner())
    for key, value in flat.items():  # tensors were filled in place; plain values replaced
        set_element(state, mapping[key], value)
    if read_meta(path).get("world_size") != strategy.world_size:
        return None
    return torch.load(path / f"rank-{strategy.rank}.pt", weights_only=True)


def resolve_resume(arg: str, output_dir: Path, name: str) -> Path:
    """`--resume` accepts a checkpoint folder, a run folder, or `latest` (newest run of `name`)."""
    if arg == "latest":
        runs = sorted((output_dir / name).glob("*/"), key=lambda p: p.stat().st_mtime)
        found = [c for c in map(latest_complete, runs) if c is not None]
        if not found:
            raise UsageError(
                f"--resume latest: no run named {name!r} under {output_dir} has a complete "
                "checkpoint",
                hint="Pass a run or checkpoint folder to --resume, or start without it.",
            )
        return found[-1]
    path = Path(arg)
    if not path.exists():
        raise UsageError(f"--resume {arg}: no such folder")
    if (path / MARKER).is_file():
        return path
    if path.name.endswith(".partial") or (path / ".metadata").is_file():
        raise UsageError(
            f"--resume {arg}: this checkpoint is incomplete (its save was interrupted)"
        )
    latest = latest_complete(path)
    if latest is None:
        raise UsageError(
            f"--resume {arg}: neither a checkpoint nor a run folder with a complete checkpoint",
            hint="A checkpoint folder holds a COMPLETE file; a run folder holds checkpoints/.",
        )
    return latest


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


def _background_stager() -> Any:
    """A stager that copies the state to memory in a thread of its own, reusing its buffers
    from one save to the next; None where this torch has none (the copy then blocks)."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        return None
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=False,
        )
    )


def _save_synced(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
