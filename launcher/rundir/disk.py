"""How much disk a run folder's files take (a checkpoint, a save that did not finish, an
export), and how that is said: one count and one unit for every message that names a size."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def disk_bytes(path: Path) -> int:
    """The bytes of a file, or of the regular files under a folder (links not followed); 0
    where it is gone, and a file removed meanwhile counts nothing."""
    try:
        if not path.is_dir():
            return path.stat().st_size
    except OSError:
        return 0
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                info = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            total += info.st_size if stat.S_ISREG(info.st_mode) else 0
    return total


def megabytes(size: int) -> str:
    return f"{size / 2**20:,.1f} MB"
