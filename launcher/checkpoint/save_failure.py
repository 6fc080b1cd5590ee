"""A checkpoint save that failed on its file system: said in the user's terms, cleaned up.

A full disk comes in many guises. A plain write raises OSError(ENOSPC), but torch.save's zip
writer (DCP's files, `rank-N.pt`) loses the errno: `RuntimeError: ... unexpected pos 704`. So
the rank whose write fails decides at once, while the disk is as the write left it: an errno
that names a file-system limit, else a file system with (almost) no space left. DCP hands that
rank's exception to every rank (a CheckpointException), so all of them say the same; deciding
later, on each rank, would race with the ranks that are already freeing the space.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from launcher.checkpoint.bucket import bucket_is_gone, bucket_of
from launcher.errors import RunError
from launcher.rundir.layout import CheckpointFiles
from launcher.safe_text import clean

# A write that fails with less than this free is taken for a full disk.
NEARLY_FULL_BYTES = 16 * 2**20

_KEEP_FEWER = "or keep fewer checkpoints (checkpoint.keep_last)"
_LIMITS = {
    errno.ENOSPC: ("disk full", f"Free space on that disk, {_KEEP_FEWER}"),
    errno.EDQUOT: ("disk quota exceeded", f"Free space within your quota, {_KEEP_FEWER}"),
    errno.EFBIG: (
        "a file too large for the file system or for the file-size limit (ulimit -f)",
        "Raise the file-size limit, or put the run folder on a file system that takes larger files",
    ),
}


def limit_hit(exc: BaseException) -> OSError | None:
    """The OSError of a file-system limit behind `exc` (`causes`)."""
    found = (c for c in causes(exc) if isinstance(c, OSError) and c.errno in _LIMITS)
    return next(found, None)


def causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and what is behind it: its chain, and the ranks' failures a CheckpointException
    gathered (each a `(exception, stack)` pair, or bare)."""
    todo, seen = [exc], set()
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                failure = failure[0] if isinstance(failure, tuple) else failure
                if isinstance(failure, BaseException):
                    todo.append(failure)
        todo += [e for e in (current.__cause__, current.__context__) if e is not None]


@contextlib.contextmanager
def explained_writes(where: Path) -> Iterator[None]:
    """Around a write, on the rank that makes it: a failure that hit a file-system limit leaves
    as that limit's own OSError (from the original). DCP sends a rank's exception to the others
    pickled, which keeps no `__context__`: torch.save's RuntimeError would lose the OSError
    of the write that failed under it."""
    try:
        yield
    except (OSError, RuntimeError) as exc:  # RuntimeError: torch.save's own
        limit = limit_hit(exc)
        code = limit.errno if limit is not None else errno.ENOSPC
        if limit is exc or (limit is None and free_bytes(where) >= NEARLY_FULL_BYTES):
            raise
        raise OSError(code, os.strerror(code), str(where)) from exc


def free_bytes(where: Path) -> int:
    """Space left for this user on the file system of `where` (or of its nearest existing
    parent); a large number when it cannot be told."""
    for path in (where, *where.parents):
        with contextlib.suppress(OSError):
            return shutil.disk_usage(path).free
    return 2**63


@contextlib.contextmanager
def failing_save(store: Any, step: int, run_dir: Path, newest: Any = None) -> Iterator[None]:
    """Around a save, on every rank. A save that fails leaves nothing unpublished behind: every
    rank that sees it fail removes what it wrote (on a full disk, that makes room for the
    rank's own message), and a file-system limit or a store's failure is re-raised as a
    RunError that says what to do. `store`: the run's `launcher.checkpoint.store`; `newest`:
    the newest checkpoint this attempt saved or resumed from, which a bucket gone takes along."""
    try:
        yield
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        where = store.where(step)
        left = _remove_unpublished(store, where)
        limit = limit_hit(exc)
        if limit is not None:
            raise _explained(limit, store, step, run_dir, removed=not where.exists()) from exc
        if not store.remote or isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        if bucket_is_gone(store.root):
            raise _bucket_gone(store, step, newest) from exc
        raise _upload_failed(exc, store, step, run_dir, left) from exc


def _remove_unpublished(store: Any, where: Any) -> str | None:
    """Removes what a failed save wrote, unless it was published (then pruning failed: kept);
    None when done, else why it could not be (a store that fails every request there)."""
    try:
        if not CheckpointFiles(where).is_complete:
            store.discard(where)
    except Exception as exc:  # each store's client raises its own types
        if not store.remote:
            raise
        return first_cause(exc)
    return None


def first_cause(exc: BaseException) -> str:
    """The first underlying error, in one line: DCP wraps each failure with its traceback."""
    failures = getattr(exc, "failures", None)
    if failures:
        first = next(iter(failures.values()))
        exc = first[0] if isinstance(first, tuple) else first
    text = clean(str(exc)).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _upload_failed(
    exc: BaseException, store: Any, step: int, run_dir: Path, left: str | None
) -> RunError:
    """A save to a store that failed after its client's own retries. `left`: why what was
    written of it could not be removed, if it could not."""
    try:
        newest = store.latest()
        kept = (
            f"earlier checkpoints are intact (newest: {newest.name})"
            if newest
            else "no earlier checkpoint was saved"
        )
    except Exception:  # a listing that fails too: say nothing of the others
        newest, kept = None, "earlier checkpoints could not be listed"
    where = store.checkpoint(step)
    removed = (
        "what was written of it was removed"
        if left is None
        else f"what was written of it could not be removed ({left}): delete {where} (without "
        "its COMPLETE marker no resume takes it)"
    )
    then = f"continue with --resume {run_dir}" if newest else "run again"
    return RunError(
        f"checkpoint {where.name} could not be written to {store.root} "
        f"({first_cause(exc)}); {kept}, and {removed}",
        hint=f"Check the store, its credentials and checkpoint.storage_options, then {then}.",
    )


def _bucket_gone(store: Any, step: int, newest: Any) -> RunError:
    """A save into a bucket deleted since the run started: the launcher never creates one
    (`launcher.checkpoint.bucket`), and what the bucket held went with it."""
    root = store.root
    lost = (
        f"{newest.name}, the newest checkpoint, may be lost with it"
        if newest is not None
        else "no checkpoint of this run was saved yet"
    )
    return RunError(
        f"checkpoint {store.checkpoint(step).name} could not be written: the bucket "
        f"{bucket_of(root)} of {root} no longer exists; {lost}",
        hint="The launcher never creates a bucket (a new one would take the store's default "
        "region, encryption and policies). Restore the bucket (and its checkpoints, if kept "
        "elsewhere) and resume, or set checkpoint.dir to a bucket that exists and start anew.",
    )


def _explained(limit: OSError, store: Any, step: int, run_dir: Path, removed: bool) -> RunError:
    what, fix = _LIMITS[limit.errno or errno.ENOSPC]
    newest = store.latest()
    kept = (
        f"earlier checkpoints are intact (newest: {newest.name})"
        if newest
        else "no earlier checkpoint was saved"
    )
    left = (
        "the incomplete one was removed"
        if removed
        else f"delete the incomplete {store.where(step)}"
    )
    then = f"continue with --resume {run_dir}" if newest else "run again"
    return RunError(
        f"{what} while writing checkpoint {store.checkpoint(step).name} to "
        f"{store.root}; {kept}, and {left}",
        hint=f"{fix}, then {then}.",
    )
