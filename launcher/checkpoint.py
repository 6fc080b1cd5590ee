"""Checkpoints: torch.distributed.checkpoint (DCP) folders, published atomically.

Layout: RUN_DIR/checkpoints/step-00000100/ holds DCP's files, `meta.json` (progress and the
spec, as JSON) and a `COMPLETE` marker. A checkpoint is written under a hidden temporary name
and renamed into place only once every rank has finished writing, so a crash mid-save never
leaves a folder that looks complete. Old checkpoints are pruned only after a new one is
complete.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

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


def save(
    strategy: Strategy,
    run_dir: Path,
    step: int,
    state: dict[str, Any],
    meta: dict[str, Any],
    keep_last: int | None,
) -> Path:
    """Collective: every rank calls it with its own shard of `state`."""
    final = checkpoint_dir(run_dir, step)
    staging = final.with_name(f".{final.name}.partial")
    if strategy.is_main:
        shutil.rmtree(staging, ignore_errors=True)  # left by a crash; never a published one
        staging.mkdir(parents=True)
    strategy.barrier()
    import torch.distributed.checkpoint as dcp  # 0.5 s of imports: not on the way to step 1

    dcp.save(state, checkpoint_id=staging)
    strategy.barrier()
    if strategy.is_main:
        _write_synced(staging / META, json.dumps({**meta, "step": step, "time": time.time()}))
        _write_synced(staging / MARKER, "")
        if final.exists():  # never replace a published checkpoint (the plan prevents this)
            raise RunError(f"{final} already exists; not overwriting it")
        os.replace(staging, final)
        _fsync_dir(final.parent)
        if keep_last:
            for old in complete_checkpoints(run_dir)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    strategy.barrier()
    return final


def load(path: Path, state: dict[str, Any]) -> None:
    """Collective: fills `state` in place from a checkpoint, never unpickling arbitrary code."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, checkpoint_id=path, planner=_weights_only_planner())


def resolve_resume(arg: str, output_dir: Path, name: str) -> Path:
    """`--resume` accepts a checkpoint folder, a run folder, or `latest` (newest run of `name`)."""
    if arg == "latest":
        runs = sorted((output_dir / name).glob("*/"), key=lambda p: p.stat().st_mtime)
        with_ckpt = [(r, latest_complete(r)) for r in runs]
        with_ckpt = [(r, c) for r, c in with_ckpt if c is not None]
        if not with_ckpt:
            raise UsageError(
                f"--resume latest: no run named {name!r} under {output_dir} has a complete checkpoint",
                hint="Pass a run or checkpoint folder to --resume, or start without it.",
            )
        return with_ckpt[-1][1]  # type: ignore[return-value]
    path = Path(arg)
    if not path.exists():
        raise UsageError(f"--resume {arg}: no such folder")
    if (path / MARKER).is_file():
        return path
    if (path / META).is_file() or path.name.endswith(".partial"):
        raise UsageError(
            f"--resume {arg}: this checkpoint is incomplete (the save was interrupted)"
        )
    latest = latest_complete(path)
    if latest is None:
        raise UsageError(
            f"--resume {arg}: neither a checkpoint nor a run folder with a complete checkpoint",
            hint="A checkpoint folder holds a COMPLETE file; a run folder holds checkpoints/.",
        )
    return latest


def _weights_only_planner():  # type: ignore[no-untyped-def]
    """DCP's default planner unpickles non-tensor values with weights_only=False."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:  # type: ignore[no-untyped-def]
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                fqn = self.mappings[read_item.dest_index.fqn]
                set_element(self.original_state_dict, fqn, obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return WeightsOnlyLoadPlanner()


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
