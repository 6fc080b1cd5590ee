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

from launcher.errors import RunError
from launcher.rundir.layout import CheckpointFiles
from launcher.safe_text import clean
from launcher.storage_url import is_remote

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
    """The OSError of a file-system limit behind `exc`: in its chain, or among the ranks'
    failures a CheckpointException gathered (each a `(exception, stack)` pair, or bare)."""
    todo, seen = [exc], set()
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _LIMITS:
            return current
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                failure = failure[0] if isinstance(failure, tuple) else failure
                if isinstance(failure, BaseException):
                    todo.append(failure)
        todo += [e for e in (current.__cause__, current.__context__) if e is not None]
    return None


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


def file_writer(path: Path) -> Any:
    """DCP's own file writer (as `checkpoint_id=path` would pick it), whose failed writes say
    which file-system limit they hit."""
    from torch.distributed.checkpoint import FileSystemWriter

    class ExplainedWriter(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            with explained_writes(path):
                return super().write_data(plan, planner)

        def finish(self, metadata: Any, results: Any) -> None:
            with explained_writes(path):
                super().finish(metadata, results)

    return ExplainedWriter(path)


@contextlib.contextmanager
def failing_save(store: Any, step: int, run_dir: Path) -> Iterator[None]:
    """Around a save, on every rank. A save that fails leaves nothing unpublished behind: every
    rank that sees it fail removes what it wrote (on a full disk, that makes room for the
    rank's own message), and a file-system limit is re-raised as a RunError that says what
    to do. `store`: the run's `launcher.checkpoint.store`."""
    try:
        yield
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        where = store.where(step)
        if not CheckpointFiles(where).is_complete:  # published, then pruning failed: kept
            store.discard(where)
        limit = limit_hit(exc)
        if limit is not None:
            raise _explained(limit, store, step, run_dir, removed=not where.exists()) from exc
        if not is_remote(where) or isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise _upload_failed(exc, store, step, run_dir) from exc


def first_cause(exc: BaseException) -> str:
    """The first underlying error, in one line: DCP wraps each failure with its traceback."""
    failures = getattr(exc, "failures", None)
    if failures:
        first = next(iter(failures.values()))
        exc = first[0] if isinstance(first, tuple) else first
    text = clean(str(exc)).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _upload_failed(exc: BaseException, store: Any, step: int, run_dir: Path) -> RunError:
    """A save to a store that failed after its client's own retries."""
    newest = store.catalog.latest()
    kept = (
        f"earlier checkpoints are intact (newest: {newest.name})"
        if newest
        else "no earlier checkpoint was saved"
    )
    then = f"continue with --resume {run_dir}" if newest else "run again"
    return RunError(
        f"checkpoint {store.catalog.checkpoint(step).name} could not be written to "
        f"{store.catalog.root} ({first_cause(exc)}); {kept}, and what was written of it was removed",
        hint=f"Check the store, its credentials and checkpoint.storage_options, then {then}.",
    )


def _explained(limit: OSError, store: Any, step: int, run_dir: Path, removed: bool) -> RunError:
    what, fix = _LIMITS[limit.errno or errno.ENOSPC]
    newest = store.catalog.latest()
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
        f"{what} while writing checkpoint {store.catalog.checkpoint(step).name} to "
        f"{store.catalog.root}; {kept}, and {left}",
        hint=f"{fix}, then {then}.",
    )
