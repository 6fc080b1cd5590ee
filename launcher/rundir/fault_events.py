"""The replica groups' losses and heals (`fault_tolerance`), as lines of JSON in the run
folder's `RunLayout.fault_events` folder: one file per process that records any, so no file
has two writers at once (a restarted process appends to its predecessor's):

- each node's launcher (`RunLayout.launcher_events`): `lost` (a group's processes failed
  and its agent restarts them) and `gave_up` (a group failed `launch.max_restarts + 1`
  times: the others go on without it);
- each group's rank 0 (`RunLayout.rank_events`): `quorum` (a new quorum: `groups` of `of`
  train from `step`), `healed` (the group copied a live group's state: `heal_s` seconds, at
  `step`), and `stranger` (a quorum held a `replica` that is not one of the run's groups:
  the launcher stops the run); and every process, at the end: `finished` (its `step` and a
  `digest` of its parameters).

`read` merges the files by time; `summarize` turns them into what outcome.json,
summary.json and `train runs` show.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from launcher.rundir.layout import RunLayout


def record(path: Path, event: str, **fields: Any) -> None:
    """Appends one event to `path`, a file of one process's."""
    line = json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read(events: Path) -> list[dict[str, Any]]:
    """The events recorded so far in the folder `events`, every file's, oldest first (a
    torn last line left out)."""
    found: list[dict[str, Any]] = []
    for path in RunLayout.event_files(events):
        try:
            found += _parsed(path.read_text().splitlines())
        except OSError:
            continue
    return sorted(found, key=lambda event: event.get("time", 0))


def read_file(path: Path) -> list[dict[str, Any]]:
    """The events of one file (`RunLayout.stragglers`), oldest first; none where it is absent
    (a torn last line left out)."""
    try:
        return _parsed(path.read_text().splitlines())
    except OSError:
        return []


def kept(events: Path) -> bool:
    """Whether the run keeps fault-tolerance events in the folder `events` (a run with replica
    groups), also before any is recorded."""
    return events.is_dir() or bool(RunLayout.event_files(events))


def start_over(events: Path, own: Iterable[Path], others: Iterable[Path] | None = None) -> None:
    """An earlier attempt's events are not this one's: removes the files of this launcher's
    writers (`own`: its own, its groups' processes'); with `others` (the files of every other
    writer of the run: node 0's launcher says them), also any file of a writer the run no
    longer has (fewer nodes or processes than before)."""
    events.mkdir(parents=True, exist_ok=True)
    doomed = set(own)
    if others is not None:
        kept = doomed | set(others)
        doomed |= {path for path in RunLayout.event_files(events) if path not in kept}
    for path in doomed:
        path.unlink(missing_ok=True)


def _parsed(lines: list[str]) -> list[dict[str, Any]]:
    events = []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


class NewEvents:
    """The events recorded since the last call, in every file of the folder `events` (the
    launcher follows them as the groups write them)."""

    def __init__(self, events: Path) -> None:
        self.events = events
        self.offsets: dict[Path, int] = {}  # each file's bytes read so far

    def __call__(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        for path in RunLayout.event_files(self.events):
            offset = self.offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except OSError:
                continue
            whole = data[: data.rfind(b"\n") + 1]  # a line still being written waits
            self.offsets[path] = offset + len(whole)
            found += _parsed(whole.decode(errors="replace").splitlines())
        return sorted(found, key=lambda event: event.get("time", 0))


def summarize(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per loss of a group: when it happened, seconds until the survivors' next
    step, until the group took part again and its copy of the state, and the steps trained
    without it (0 where it was back before the survivors' next step; None where it never
    came back)."""
    losses = [e for e in events if e["event"] == "lost"]
    return [_loss(lost, events, _next_loss(lost, losses)) for lost in losses]


def summary(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What summary.json says of the run's losses, by the same count as each loss's own:
    the steps trained with fewer groups are the sum over the losses, and every group's
    heals."""
    losses = summarize(events)
    heals = [
        {"group": e["group"], "step": e.get("step"), "heal_s": e.get("heal_s")}
        for e in events
        if e["event"] == "healed"
    ]
    fewer = sum(loss["steps_with_fewer_groups"] or 0 for loss in losses)
    return {"losses": losses, "steps_with_fewer_groups": fewer, "heals": heals}


def _next_loss(lost: dict[str, Any], losses: list[dict[str, Any]]) -> float:
    """When the same group was lost next: what follows belongs to that loss."""
    later = [e["time"] for e in losses if e["group"] == lost["group"] and e["time"] > lost["time"]]
    return min(later, default=float("inf"))


def _loss(lost: dict[str, Any], events: list[dict[str, Any]], until: float) -> dict[str, Any]:
    group, at = lost["group"], lost["time"]
    within = [e for e in events if at <= e["time"] < until]
    quorums = [e for e in within if e["event"] == "quorum" and e["group"] != group]
    short = next((e for e in quorums if e["groups"] < e["of"]), None)
    # The group back: the first whole quorum after the survivors stepped without it (a
    # group lost before the first quorum is back in the first one, never short).
    after = short["time"] if short is not None else at
    full = next((e for e in quorums if e["groups"] == e["of"] and e["time"] >= after), None)
    own = [e for e in within if e.get("group") == group]
    healed = next((e for e in own if e["event"] == "healed"), None)
    gave_up = any(e["event"] == "gave_up" for e in own)
    fewer = None
    if full is not None:
        fewer = max(0, full["step"] - short["step"]) if short is not None else 0
    return {
        "group": group,
        "lost_at": at,
        "next_step_after_s": _since(quorums[0] if quorums else None, at),
        "back_after_s": None if gave_up else _since(healed or full, at),
        "heal_s": healed["heal_s"] if healed else None,
        "steps_with_fewer_groups": fewer,
        "gave_up": gave_up,
    }


def groups_agree(events: list[dict[str, Any]]) -> bool | None:
    """Whether every group ended with the same parameters, rank by rank (None: fewer than
    two groups finished)."""
    ends: dict[int, dict[int, str]] = {}
    for event in events:
        if event["event"] == "finished":
            ends.setdefault(event["rank"], {})[event["group"]] = event["digest"]
    if not ends or all(len(groups) < 2 for groups in ends.values()):
        return None
    return all(len(set(groups.values())) == 1 for groups in ends.values())


def _since(event: dict[str, Any] | None, at: float) -> float | None:
    return None if event is None else round(event["time"] - at, 3)
