"""Every rank must see the same run folder: checked once per attempt, before training.

A checkpoint is written into one folder by every rank of every node together, and read back
the same way. Nodes whose run folders are their own (no shared file system, or a `--run-dir`
on a local disk) would train normally and then all fail at the first save, losing the run.
Rank 0 leaves a random token in its run folder and every rank must read it back from its own.

Always checked, not only with checkpoints on: besides checkpoints, a resumed or restarted
attempt reads rank 0's choice of checkpoint on every node, and the run's own record (spec,
metrics, summary: node 0's; each rank's log: its own node's) would otherwise be split across
machines. The cost is one tiny file and two small collectives.
"""

from __future__ import annotations

import secrets
import socket
import time
from pathlib import Path

from launcher.errors import UsageError
from launcher.parallel.base import Strategy
from launcher.rundir.atomic import write_atomic
from launcher.rundir.layout import RunLayout

# A new file may take a moment to appear on another node (attribute caches of NFS, FUSE).
_PATIENCE_S = 3.0


def check_shared_run_dir(strategy: Strategy, run_dir: Path) -> None:
    """Collective: refuses (UsageError, on every rank) when some rank cannot read what rank 0
    wrote into its run folder."""
    if strategy.world_size == 1:
        return
    token = strategy.control.from_main(_leave_token(run_dir) if strategy.is_main else None)
    seen = strategy.control.gather((_sees(run_dir, token), socket.gethostname(), str(run_dir)))
    if strategy.is_main:  # after the gather: every rank has looked
        _probe(run_dir, token).unlink(missing_ok=True)
    blind = {rank: (host, folder) for rank, (sees, host, folder) in enumerate(seen) if not sees}
    if blind:
        raise _not_shared(seen[0][1], seen[0][2], blind)


def _probe(run_dir: Path, token: str) -> Path:
    return RunLayout(run_dir).shared_probe(token)


def _leave_token(run_dir: Path) -> str:
    token = secrets.token_hex(8)
    write_atomic(_probe(run_dir, token), token)  # never seen half written
    return token


def _sees(run_dir: Path, token: str) -> bool:
    deadline = time.monotonic() + _PATIENCE_S
    while True:
        try:
            return _probe(run_dir, token).read_text() == token
        except OSError:
            if time.monotonic() > deadline:
                return False
        time.sleep(0.1)


def _not_shared(host: str, folder: str, blind: dict[int, tuple[str, str]]) -> UsageError:
    where: dict[tuple[str, str], list[int]] = {}
    for rank, place in sorted(blind.items()):
        where.setdefault(place, []).append(rank)
    return UsageError(
        f"the nodes do not share the run folder: rank 0 (on {host}) wrote into {folder}, "
        f"and {len(blind)} rank(s) cannot see it",
        details=[
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} on {h} looked in {f}"
            for (h, f), ranks in where.items()
        ],
        hint="Every rank of every node writes each checkpoint into one folder: put the run "
        "folder on storage every node sees (NFS, Lustre, a cloud file system), at the same "
        "path on every node: --run-dir, or run.output_dir with the same --rdzv-id.",
    )
