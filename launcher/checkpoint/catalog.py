"""The catalogue of a run's checkpoints: which are complete, the newest, the best, and which
the pruning rule lets go. Torch-free: the launcher, the workers and `train runs` all read it.

A run's checkpoints live in its run folder's `checkpoints/`, or in a store that
`checkpoint.dir` names (`s3://bucket/prefix/{run}`), which the run folder records
(`RunLayout.checkpoint_store`). Either way a checkpoint is a `step-NNNNNNNN` folder that counts
only once its `COMPLETE` marker is there: the marker is written last, and removed first.
"""

from __future__ import annotations

import json
import math
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.checkpoint.store_errors import unusable
from launcher.errors import UsageError
from launcher.rundir.layout import (
    CheckpointFiles,
    RunLayout,
    checkpoint_folder,
    checkpoint_step,
    is_cut_short,
    run_holding,
)
from launcher.rundir.reading import UnreadableJson, read_json
from launcher.storage_url import is_remote, location

# How often `best` looks for the newest checkpoint again when a live run prunes the one it
# found before its record is read: each look finds a newer one, so a few are plenty.
_LOOKS = 5

# The run folder of each store this process has listed through its run folder: a checkpoint
# in a store says nothing of the run folder that wrote it (`run_of`).
_RUN_OF_STORE: dict[str, Path] = {}
# The store of a run folder that does not record it yet: the launcher knows it from the spec
# before it creates the folder (`adopt_store`).
_STORE_OF_RUN: dict[Path, Any] = {}


@dataclass(frozen=True)
class Catalog:
    """The checkpoints under `root`: a local folder (Path) or a store's prefix (UPath)."""

    root: Any

    def checkpoint(self, step: int) -> Any:
        return checkpoint_folder(self.root, step)

    def complete(self) -> list[Any]:
        """Complete checkpoints, oldest first. A store that does not answer is a UsageError
        naming it."""
        if not is_remote(self.root):
            return self._complete()
        try:
            return self._complete()
        except Exception as exc:  # each store's client raises its own types
            raise unusable(self.root, exc, "checkpoints in") from None

    def _complete(self) -> list[Any]:
        try:
            entries = list(self.root.iterdir()) if self.root.is_dir() else []
        except (FileNotFoundError, NotADirectoryError):
            # A store's prefix exists while objects do: another node's probe file, its only
            # object, was removed between the two calls (two launchers starting at once).
            entries = []
        found = [
            p
            for p in entries
            if checkpoint_step(p.name) is not None and CheckpointFiles(p).is_complete
        ]
        return sorted(found, key=lambda p: step_of(p) or 0)

    def complete_steps(self) -> set[int]:
        return {step_of(p) or 0 for p in self.complete()}

    def latest(self) -> Any | None:
        done = self.complete()
        return done[-1] if done else None

    def cut_short_deletions(self) -> list[Path]:
        """The pruned checkpoints that their launcher, stopped mid-delete, left unpublished
        (`CheckpointFiles.unpublished`): folders, never a link. A store has none: it
        unpublishes by removing the marker."""
        if is_remote(self.root) or not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if is_cut_short(p.name) and _is_folder(p))

    def prunable(self, keep_last: int | None, protected: Iterable[int] = ()) -> list[Any]:
        """The pruning rule: complete checkpoints other than the newest `keep_last` and the
        `protected` steps (the best ones, the one the run resumed from). None: keep all."""
        if not keep_last:
            return []
        keep = set(protected)
        return [p for p in self.complete()[:-keep_last] if step_of(p) not in keep]

    def best(self) -> Best | None:
        """The best complete checkpoint by `checkpoint.monitor`, as the newest checkpoint's
        record of scores says (the record survives resumes; pruned ones are passed over).
        UnreadableJson where the newest one's meta.json is missing or malformed."""
        newest = self._newest_meta()
        if newest is None:
            return None
        meta, record = newest
        monitor, kept = _best_record(record, meta)
        for step, score in kept:
            path = self.checkpoint(step)
            if CheckpointFiles(path).is_complete:
                return Best(path, step, score, monitor)
        return None

    def _newest_meta(self) -> tuple[Any, Any] | None:
        """The newest complete checkpoint's meta.json and what it holds; None without one."""
        for look in range(1, _LOOKS + 1):
            newest = self.latest()
            if newest is None:
                return None
            meta = CheckpointFiles(newest).meta
            try:
                return meta, read_json(meta, "checkpoint meta")
            except FileNotFoundError:
                # A live run that keeps few checkpoints prunes its newest one once a newer
                # one is published, maybe while this reads it: the newer one's is read then.
                # One still published without its meta.json is damaged.
                if look == _LOOKS or CheckpointFiles(newest).is_complete:
                    raise UnreadableJson(meta, "missing") from None
        raise AssertionError("unreachable: the last look returns or raises")


def store_root(run_dir: Path) -> Any:
    """Where the run in `run_dir` keeps its checkpoints: its `checkpoints/`, or the store its
    `checkpoint-store.json` names."""
    if run_dir in _STORE_OF_RUN:
        return _STORE_OF_RUN[run_dir]
    layout = RunLayout(run_dir)
    if not layout.checkpoint_store.is_file():  # also where run_dir is no folder at all
        return layout.checkpoints
    try:
        record = read_json(layout.checkpoint_store, "record")
    except FileNotFoundError:
        return layout.checkpoints
    if not isinstance(record, dict) or not isinstance(record.get("dir"), str):
        raise UnreadableJson(layout.checkpoint_store, "names no checkpoint store (`dir`)")
    root = location(record["dir"], record.get("storage_options") or {}, "checkpoint.dir")
    _RUN_OF_STORE[str(root)] = run_dir
    return root


def adopt_store(run_dir: Path, root: Any) -> None:
    """Takes `root` as the store of `run_dir` in this process, before the folder records it."""
    _STORE_OF_RUN[run_dir] = root
    _RUN_OF_STORE[str(root)] = run_dir


def record_store(run_dir: Path, root: Any) -> None:
    """Records in the run folder the store its checkpoints go to (no secret: those come from
    the environment, and `checkpoint.storage_options` refuses them)."""
    from launcher.rundir.atomic import write_atomic
    from launcher.storage_url import storage_options

    record = {"dir": str(root), "storage_options": storage_options(root)}
    write_atomic(RunLayout(run_dir).checkpoint_store, json.dumps(record, indent=1))
    _RUN_OF_STORE[str(root)] = run_dir


def catalog_of(run_dir: Path) -> Catalog:
    return Catalog(store_root(run_dir))


def latest_complete(run_dir: Path) -> Any | None:
    """The newest complete checkpoint of a run folder."""
    return catalog_of(run_dir).latest()


@dataclass(frozen=True)
class Best:
    path: Any
    step: int
    score: float
    monitor: str

    def describe(self) -> str:
        return f"{self.path} ({self.monitor} {self.score:.6g} at step {self.step})"


def _best_record(meta: Any, where: Any) -> tuple[str, list[tuple[int, float]]]:
    """The monitor and the (step, score) pairs, best first, of a checkpoint's meta.json (its
    `best` entry, which `launcher.worker.monitors` writes); UnreadableJson where malformed."""
    record = meta.get("best") if isinstance(meta, dict) else None
    if not record:
        return "", []
    try:
        monitor, pairs = record["monitor"], [(step, score) for step, score in record["kept"]]
    except (TypeError, KeyError, ValueError):  # not a mapping, not a list of pairs
        monitor, pairs = None, []
    if not isinstance(monitor, str) or not all(map(_is_step_and_score, pairs)):
        raise UnreadableJson(where, "its record of the best checkpoints is malformed")
    return monitor, pairs


def _is_step_and_score(pair: tuple[Any, Any]) -> bool:
    step, score = pair
    numbers = all(isinstance(n, int | float) and not isinstance(n, bool) for n in pair)
    # A step of 400 digits would make a file name too long to look up.
    return numbers and isinstance(step, int) and 0 <= step < 10**15 and not math.isnan(score)


def _is_folder(path: Path) -> bool:
    """A folder itself, not a link to one."""
    try:
        return stat.S_ISDIR(path.lstat().st_mode)
    except OSError:
        return False


def step_of(checkpoint: Any) -> int | None:
    """The step a published checkpoint folder holds."""
    return checkpoint_step(checkpoint.name)


def checkpoint_in(path: Any, what: str) -> Any:
    """The checkpoint a folder names: itself (a complete checkpoint folder), or a run
    folder's newest complete one, or a store prefix's. `what` names the flag or command."""
    files = CheckpointFiles(path)
    if files.is_complete:
        return path
    if files.looks_interrupted:
        raise UsageError(f"{what} {path}: this checkpoint is incomplete (its save was interrupted)")
    newest = Catalog(path).latest() if is_remote(path) else latest_complete(path)
    if newest is None:
        raise UsageError(
            f"{what} {path}: neither a checkpoint nor a run folder with a complete checkpoint",
            hint="A checkpoint folder holds a COMPLETE file; a run folder holds checkpoints/.",
        )
    return newest


def run_of(checkpoint: Any) -> Path | None:
    """The run folder a checkpoint belongs to: the folder above its `checkpoints/`, or for a
    store's checkpoint the run folder that records that store, where this process has read it."""
    if is_remote(checkpoint):
        return _RUN_OF_STORE.get(str(checkpoint.parent))
    return run_holding(checkpoint)
