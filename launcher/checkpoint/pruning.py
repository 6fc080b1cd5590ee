"""Finishing a pruning that was cut short (`checkpoint.keep_last` in the run folder).

A pruned local checkpoint is first unpublished, renamed atomically to a hidden
`.step-N.deleting` folder (`LocalStore.remove`, `launcher.checkpoint.stores.local_folder`),
then deleted: a crash mid-delete never leaves a half checkpoint that still looks complete. A
launcher killed between the two leaves that hidden folder behind, as large as a checkpoint; the
next launcher of the run folder removes it once it holds the folder's lock, which says that no
other live launcher prunes there. Torch-free: the launcher calls it before it starts a worker.
"""

from __future__ import annotations

import shutil

from launcher.checkpoint.store import store_at
from launcher.rundir.disk import disk_bytes, megabytes
from launcher.rundir.layout import RunLayout
from launcher.rundir.lock import RunLock


def finish_cut_short(layout: RunLayout, lock: RunLock) -> str | None:
    """Removes the `.step-N.deleting` folders a pruning left (and nothing else), when `lock`
    is held; returns the line that says what it freed, if anything."""
    if not lock.held:  # no flock here: another launcher may be deleting them right now
        return None
    freed, removed = 0, []
    for folder in store_at(layout.checkpoints).cut_short_deletions():
        size = disk_bytes(folder)
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            freed, removed = freed + size, [*removed, folder.name]
    if not freed:
        return None
    return (
        f"removed {', '.join(removed)} from {layout.checkpoints}: old checkpoints whose "
        f"pruning was cut short ({megabytes(freed)} freed)"
    )
