"""`train runs`' output: a table for people, or JSON for scripts."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from launcher.runs.catalog import RunRow
from launcher.safe_text import clean

_STYLES = {
    "running": "bold cyan",
    "finished": "green",
    "failed": "bold red",
    "stopped": "yellow",
    "interrupted": "magenta",
}


def runs_json(rows: list[RunRow]) -> str:
    return json.dumps([asdict(row) for row in rows], indent=1)


def runs_table(rows: list[RunRow]) -> Table:
    # The evaluation metric is named in its header when every run has the same one.
    shown = {row.best_val_metric for row in rows if row.best_val_metric}
    one_metric = shown.pop() if len(shown) == 1 else None
    columns: dict[str, list[str | Text]] = {
        # Text, never markup: a folder named `[red]x` is shown as it is named.
        "run": [_shown(row.name) for row in rows],
        "folder": [_shown(Path(row.folder).name) for row in rows],
        "status": [status_text(row) for row in rows],
        "steps": [_steps(row) for row in rows],
        "loss": [_number(row.last_loss) for row in rows],
        "best loss": [_number(row.best_loss) for row in rows],
        f"best {one_metric or 'val'}": [_best_val(row, one_metric is None) for row in rows],
        "checkpoint": [_checkpoint(row) for row in rows],
        "started": [_when(row.started) for row in rows],
        "duration": [duration(row.duration_s) for row in rows],
    }
    if any(row.groups_lost is not None for row in rows):  # fault_tolerance: groups lost
        columns["faults"] = [_number(row.groups_lost) for row in rows]
    if any(row.sync for row in rows):  # fault_tolerance.sync: LocalSGD, DiLoCo
        columns["sync"] = [_sync(row.sync) for row in rows]
    if any(row.stragglers for row in rows):  # launch.straggler named a slow rank
        columns["stragglers"] = [", ".join(row.stragglers or []) for row in rows]
    # One line a run, whatever the width: a narrow terminal cuts the names, folders, times and
    # evaluations short (…), and keeps the status and the numbers whole.
    table = Table(box=None, header_style="bold", pad_edge=False)
    cut = ("run", "folder", "started", f"best {one_metric or 'val'}")
    for header, cells in columns.items():
        whole = header not in cut
        table.add_column(
            header,
            no_wrap=True,
            overflow="ellipsis",
            justify="right" if header in ("steps", "checkpoint", "duration", "faults") else "left",
            min_width=max(len(c) for c in [header, *cells]) if whole else None,
        )
    for row in zip(*columns.values(), strict=True):
        table.add_row(*row)
    return table


def unlisted_stores(rows: list[RunRow]) -> list[Text]:
    """Under the table, why a run's checkpoint is `?`: its store could not be listed. One line
    a reason (the runs of one unreachable store share it), naming the first such store."""
    stores: dict[str, list[str]] = {}
    for row in rows:
        if row.checkpoint_store_error is not None:
            stores.setdefault(row.checkpoint_store_error, []).append(row.checkpoint_store or "")
    lines = []
    for reason, named in stores.items():
        more = f" (and {len(named) - 1} more)" if len(named) > 1 else ""
        line = f"? checkpoints in {named[0]}{more} could not be listed: {reason}"
        lines.append(Text(clean(line), style="yellow"))
    return lines


def _checkpoint(row: RunRow) -> str:
    # `?`: unknown (its store did not answer), explained under the table; `-`: none yet.
    return "?" if row.checkpoint_store_error is not None else _number(row.checkpoint_step)


def status_text(row: RunRow) -> Text:
    words = row.status
    if row.status == "failed" and row.exit_code is not None:
        words += f" (exit {row.exit_code})"
    elif row.status == "stopped" and row.reason:
        words += f" ({row.reason})"
    return Text(clean(words), style=_STYLES.get(row.status, ""))


def _shown(name: str) -> Text:
    """A name from the run folder (anyone who can write there chose it), as plain text."""
    return Text(clean(name))


def _steps(row: RunRow) -> str:
    if row.step is None:
        return "-"
    return f"{row.step}/{row.total_steps if row.total_steps is not None else '?'}"


def _number(found: float | None) -> str:
    return "-" if found is None else f"{found:.4g}"


def _best_val(row: RunRow, named: bool) -> str | Text:
    if row.best_val is None:
        return "-"
    at = f" @{row.best_val_step}" if row.best_val_step is not None else ""
    return _shown(f"{row.best_val_metric} " * named + f"{row.best_val:.4g}{at}")


def _when(unix: float | None) -> str:
    return "-" if unix is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(unix))


def duration(seconds: float | None) -> str:
    """`42s`, `3m05s`, `2h07m`, `3d04h`."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _sync(sync: dict[str, Any] | None) -> str:
    """`diloco/50, 98% fewer bytes`: the method, its `every`, and what it saved."""
    if not sync:
        return "-"
    saved = sync.get("bytes_saved")
    said = f", {saved:.0%} fewer bytes" if isinstance(saved, int | float) else ""
    return f"{sync.get('method')}/{sync.get('every')}{said}"
