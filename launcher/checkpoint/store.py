"""Where a run's checkpoints are: one object that writes them, reads them, lists them and says
whether it is remote.

The launcher resolves `checkpoint.dir` (with the run folder) into a store once
(`launcher.checkpoint.resume_decision`) and hands the workers its description
(`Store.describe`, in their plan), from which each builds the same store
(`store_described`). `checkpoint-store.json` records it in the run folder for those that
find a run by its folder alone (`train runs`, `train export`, a resume of a finished run:
`store_of_run`).

A kind of store is a subclass of `Store` in a module of `launcher/checkpoint/stores/`: its
`schemes` say which locations it takes ("" a folder of this machine; "*" any fsspec URL that
no other kind takes). `kind_for` picks a location's kind, so a new kind is one new module
there (docs/architecture.md, "A checkpoint store"); nothing else asks what kind a location is.

Either kind holds a checkpoint as a `step-NNNNNNNN` folder that counts only once its
`COMPLETE` marker is there: written last, removed first. Torch-free: the launcher and `train
runs` list stores; what needs torch (DCP's writers and reader) is imported inside the methods
that hand it out.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import pkgutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

from launcher.rundir.layout import CheckpointFiles, RunLayout, checkpoint_folder, checkpoint_step
from launcher.rundir.reading import UnreadableJson, read_json
from launcher.storage_url import is_remote, location, storage_options

# How often `best` looks for the newest checkpoint again when a live run prunes the one it
# found before its record is read: each look finds a newer one, so a few are plenty.
_LOOKS = 5

# The run folder of each store this process has resolved for a run: a checkpoint in a store
# says nothing of the run folder that wrote it (`Store.run_of`).
_RUN_OF_STORE: dict[str, Path] = {}

# {file name: (size, the storage's own fingerprint of its contents, or None)}
Files = dict[str, tuple[int, str | None]]


@dataclass(frozen=True)
class Listing:
    """A store's checkpoints as one listing found them."""

    complete: tuple[Any, ...] = ()  # complete checkpoints, oldest first
    unpublished: tuple[Any, ...] = ()  # step folders without their marker: a save cut short
    # {checkpoint: its files} where the listing gave them (a store's one recursive listing):
    # the check before a resume takes them rather than listing the checkpoint again.
    files: dict[str, Files] | None = None

    @property
    def newest(self) -> Any | None:
        return self.complete[-1] if self.complete else None

    def files_of(self, checkpoint: Any) -> Files | None:
        return (self.files or {}).get(str(checkpoint))


@dataclass(frozen=True)
class Store:
    """The checkpoints under `root`: a folder of this machine (Path) or a store's prefix
    (UPath). A kind says how its storage lists, reads and publishes."""

    root: Any

    schemes: ClassVar[tuple[str, ...]] = ()
    remote: ClassVar[bool] = False  # whether every node reaches it (no folder to share)
    prepares: ClassVar[bool] = False  # whether rank 0 makes a save's folder before it starts

    # --- what it is

    def describe(self) -> dict[str, Any]:
        """What a worker's plan and the run folder's record hold of it (never a secret: those
        come from the environment, and `checkpoint.storage_options` refuses them)."""
        return {"dir": str(self.root.absolute()), "storage_options": storage_options(self.root)}

    def with_options(self, options: dict[str, Any]) -> Store:
        """The same place, read with these storage options."""
        return store_at(location(str(self.root), options, "checkpoint.dir"))

    # --- listing: which checkpoints are complete, the newest, the best, the prunable

    def listing(self) -> Listing:
        """One listing of the checkpoints (on S3, one LIST request per 1000 objects)."""
        raise NotImplementedError

    def checkpoint(self, step: int) -> Any:
        return checkpoint_folder(self.root, step)

    def complete(self) -> list[Any]:
        """Complete checkpoints, oldest first."""
        return list(self.listing().complete)

    def complete_steps(self) -> set[int]:
        return {step_of(p) or 0 for p in self.complete()}

    def latest(self) -> Any | None:
        return self.listing().newest

    def cut_short_deletions(self) -> list[Path]:
        """Pruned checkpoints that a launcher stopped mid-delete left unpublished."""
        return []

    def prunable(self, keep_last: int | None, protected: Iterable[int] = ()) -> list[Any]:
        """The pruning rule: complete checkpoints other than the newest `keep_last` and the
        `protected` steps (the best ones, the one the run resumed from). None: keep all."""
        if not keep_last:
            return []
        keep = set(protected)
        return [p for p in self.complete()[:-keep_last] if step_of(p) not in keep]

    def best(self, newest: Any | None = None) -> Best | None:
        """The best complete checkpoint by `checkpoint.monitor`, as the newest checkpoint's
        record of scores says (the record survives resumes; pruned ones are passed over).
        UnreadableJson where the newest one's meta.json is missing or malformed. `newest`:
        the newest complete checkpoint where a listing of the launch gave it (not listed
        again)."""
        newest = self._newest_meta(newest)
        if newest is None:
            return None
        meta, record = newest
        monitor, kept = _best_record(record, meta)
        for step, score in kept:
            path = self.checkpoint(step)
            if CheckpointFiles(path).is_complete:
                return Best(path, step, score, monitor)
        return None

    def _newest_meta(self, listed: Any | None = None) -> tuple[Any, Any] | None:
        """The newest complete checkpoint's meta.json and what it holds; None without one.
        `listed`: the newest, as a listing already gave it: read without listing first."""
        for look in range(1, _LOOKS + 1):
            newest = listed if look == 1 and listed is not None else self.latest()
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

    # --- reading: asked of the kind of a checkpoint's location, whichever store listed it

    @classmethod
    def reader(cls, checkpoint: Any) -> Any:
        """DCP's reader for a checkpoint: None (DCP picks its own) for a folder."""
        return None

    @classmethod
    @contextlib.contextmanager
    def reading(cls, file: Any) -> Iterator[None]:
        """Around a read of `file`: a store's failure becomes `checksums.Unreadable` naming
        the file (the checkpoint may well be intact); a disk's error stays as it is."""
        yield

    @classmethod
    def files_in(cls, folder: Any) -> Files:
        """The files directly in `folder`, from one listing of what the storage holds now."""
        raise NotImplementedError

    @classmethod
    def exists(cls, place: Any, what: str) -> bool:
        """Whether `place` exists; a store that cannot say is a UsageError naming `what` (the
        flag or command) and the URL."""
        return bool(place.exists())

    @classmethod
    def named(cls, folder: Any) -> Store:
        """The store a folder given by the user stands for: a run folder's own (its
        `checkpoints/`, or the store it records), or a store's prefix itself."""
        return store_of_run(folder)

    @classmethod
    def run_of(cls, checkpoint: Any) -> Path | None:
        """The run folder a checkpoint belongs to, where this process can tell."""
        return None

    # --- writing: each method is called by the ranks the Checkpointer says; none is collective

    def where(self, step: int) -> Any:
        """Where the save of `step` writes its files."""
        raise NotImplementedError

    def prepare(self, where: Any) -> None:
        """Rank 0, before any rank writes, where `prepares`."""

    def start_attempt(self, strategy: Any, run_dir: Path) -> None:
        """Collective, as an attempt starts: what a save cut short left is cleared."""
        raise NotImplementedError

    def writer(self, where: Any, own_file: Any, data: bytes) -> Any:
        """DCP's writer into `where`, which writes this rank's `own_file` (`data`) first."""
        raise NotImplementedError

    def write_file(self, path: Any, data: bytes) -> None:
        raise NotImplementedError

    def publish(self, where: Any, step: int, meta: str, writer: Any) -> Any:
        """Rank 0, once every rank's files are written: the checkpoint, complete and in place.
        `writer`: the save's, which recorded every file it wrote (the marker lists them)."""
        raise NotImplementedError

    def remove(self, checkpoint: Any) -> None:
        """A pruned checkpoint: unpublished first, then deleted."""
        raise NotImplementedError

    def discard(self, where: Any) -> None:
        """What a failed save left."""
        raise NotImplementedError


def kind_for(place: Any) -> type[Store]:
    """The kind of store that holds `place` (a Path, or a UPath for a URL), by its scheme."""
    kinds = _kinds()
    if not is_remote(place):
        return kinds[""]
    return kinds.get(str(getattr(place, "protocol", ""))) or kinds["*"]


@cache
def _kinds() -> dict[str, type[Store]]:
    """{scheme: kind} from every module of `launcher/checkpoint/stores/`."""
    from launcher.checkpoint import stores

    found: dict[str, type[Store]] = {}
    for module in pkgutil.iter_modules(stores.__path__):
        imported = importlib.import_module(f"{stores.__name__}.{module.name}")
        for kind in vars(imported).values():
            own = isinstance(kind, type) and kind.__module__ == imported.__name__
            own = own and issubclass(kind, Store)
            # The schemes a kind names itself: a subclass takes none of its base's.
            for scheme in vars(kind).get("schemes", ()) if own else ():
                if scheme in found:
                    raise TypeError(f"{kind} and {found[scheme]} both take {scheme!r}")
                found[scheme] = kind
    return found


def store_at(root: Any) -> Store:
    """The store whose checkpoints are under `root`."""
    return kind_for(root)(root)


def store_described(record: dict[str, Any], what: str = "checkpoint.dir") -> Store:
    """The store a description (`Store.describe`: a plan's, a run folder's record) names."""
    return store_at(location(record["dir"], record.get("storage_options") or {}, what))


def store_of_run(run_dir: Path) -> Store:
    """Where the run in `run_dir` keeps its checkpoints: its `checkpoints/`, or the store its
    `checkpoint-store.json` names (UnreadableJson where that names none)."""
    layout = RunLayout(run_dir)
    if not layout.checkpoint_store.is_file():  # also where run_dir is no folder at all
        return store_at(layout.checkpoints)
    try:
        record = read_json(layout.checkpoint_store, "record")
    except FileNotFoundError:
        return store_at(layout.checkpoints)
    if not isinstance(record, dict) or not isinstance(record.get("dir"), str):
        raise UnreadableJson(layout.checkpoint_store, "names no checkpoint store (`dir`)")
    store = store_described(record)
    _RUN_OF_STORE[str(store.root)] = run_dir
    return store


def record_store(run_dir: Path, root: Any) -> None:
    """Records in the run folder the store its checkpoints go to (`root`, where the launcher
    resolved it), for the readers that find a run by its folder alone."""
    from launcher.rundir.atomic import write_atomic

    record = store_at(root).describe()
    write_atomic(RunLayout(run_dir).checkpoint_store, json.dumps(record, indent=1))
    _RUN_OF_STORE[str(root)] = run_dir


def recorded_run(root: Any) -> Path | None:
    """The run folder of the store at `root`, where this process has resolved it for one."""
    return _RUN_OF_STORE.get(str(root))


def step_of(checkpoint: Any) -> int | None:
    """The step a published checkpoint folder holds."""
    return checkpoint_step(checkpoint.name)


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
