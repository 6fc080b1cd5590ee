"""The replica groups' losses and heals (`fault_tolerance`), as lines of JSON in the run folder
(`RunLayout.fault_events`), appended by whoever saw each one:

- the launcher: `lost` (a group's processes failed and its agent restarts them) and `gave_up`
  (a group failed `launch.max_restarts + 1` times: the others go on without it);
- each group's rank 0: `quorum` (a new quorum: `groups` of `of` train from `step`),
  `healed` (the group copied a live group's state: `heal_s` seconds, at `step`), and
  `stranger` (a quorum held a `replica` that is not one of the run's groups: the launcher
  stops the run).

`summarize` turns them into what outcome.json, summary.json and `train runs` show.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def record(path: Path, event: str, **fields: Any) -> None:
    """Appends one event; a line of a few hundred bytes is one write, whole, also when
    several processes append at once."""
    line = json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read(path: Path) -> list[dict[str, Any]]:
    """The events recorded so far, oldest first (a torn last line left out)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    return _parsed(lines)


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
    """The events appended since the last call (the launcher follows the file as the groups
    write it)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0

    def __call__(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        whole = data[: data.rfind(b"\n") + 1]  # a line still being written waits
        self.offset += len(whole)
        return _parsed(whole.decode(errors="replace").splitlines())


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
