"""Naming a straggler: a rank whose compute or data time per step stays at least
`launch.straggler.factor` times the median of the other ranks' for `launch.straggler.window`
logged windows in a row. In synchronous training the slowest rank sets every rank's pace, and
nothing else says which one it is.

Collective at each logged window: every rank's medians (`launcher.worker.pace`) are gathered
once, within the process's group and, where replica groups wait for each other every step
(`ReplicaEngine.paces_together`), across the groups, so that every process judges every rank
of the run alike. The rank 0 of the straggler's group (which knows its host) says and records
what is found (the run folder's `stragglers.jsonl`; summary.json's `stragglers`). The waits in
collectives are never compared: every rank but the straggler waits for it.
"""

from __future__ import annotations

import socket
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from launcher.config.straggler import StragglerSection
from launcher.errors import RunError
from launcher.parallel.base import Strategy
from launcher.rundir.fault_events import record
from launcher.rundir.layout import RunLayout
from launcher.worker.pace import FIGURES, PARTS, IdlePace, Pace

# A gap smaller than this share of the median step is noise, whatever its ratio: a loader
# that takes 2 ms where the others take 1 ms slows no one.
MIN_SHARE = 0.05
STEP = (*PARTS, "wait")  # the figures that add up to a step (the optimizer's is compute's)

Figures = dict[int, dict[str, float]]  # each rank's seconds per step in FIGURES, by run rank


@dataclass
class Slowness:
    """One rank's part, compared window by window."""

    rank: int  # the run's
    part: str
    slow_windows: int = 0  # in a row
    fast_windows: int = 0  # in a row, once found
    steps: int = 0  # the steps of the slow windows in a row
    ratios: list[float] = field(default_factory=list)
    found_at: int | None = None  # the step it was named at; None: not a straggler now

    def absent(self) -> None:
        """Its group was outside the quorum (lost, or healing): a new start once back."""
        self.slow_windows = self.fast_windows = self.steps = 0
        self.ratios = []

    def seen(self, slow: bool, ratio: float, steps: int) -> None:
        if slow:
            self.slow_windows, self.fast_windows = self.slow_windows + 1, 0
            self.steps += steps
            self.ratios.append(ratio)
        else:
            self.slow_windows = self.steps = 0
            self.ratios = []
            self.fast_windows += 1


class StragglerWatch:
    def __init__(
        self,
        settings: StragglerSection,
        strategy: Strategy,
        layout: RunLayout,
        say: Callable[[str], None],
    ) -> None:
        self.settings, self.layout, self.say = settings, layout, say
        self.control, self.engine = strategy.control, strategy.engine
        self.is_main, self.world_size = strategy.is_main, strategy.world_size
        # This group's processes, by the run's rank, and where each runs (gathered with the
        # figures, not at the start: a collective there would hold the ranks in step).
        self.own = {self.engine.run_rank(rank) for rank in range(strategy.world_size)}
        self.place = (socket.gethostname(), str(strategy.device))
        self.places: dict[int, tuple[str, str]] = {}
        self.slowness: dict[tuple[int, str], Slowness] = {}
        self.episodes: list[dict[str, Any]] = []

    def gather(self, figures: dict[str, float]) -> Figures:
        """Collective: every rank's window `figures` (`Pace.window`), by the run's rank; the
        ranks of a replica group outside the step's quorum are left out."""
        gathered = self.control.gather((self.place, figures))
        self.places = {self.engine.run_rank(r): place for r, (place, _) in enumerate(gathered)}
        rows = [[own[name] for name in FIGURES] for _, own in gathered]
        table = self.engine.figures_across_groups(rows)
        return {rank: dict(zip(FIGURES, row, strict=True)) for rank, row in table.items()}

    def judge(self, ranks: Figures, step: int, steps: int) -> Slowness | None:
        """Compares the ranks' figures of the window of `steps` steps that ended at `step`;
        says what changed. Returns a straggler found in this window, if any."""
        for slowness in self.slowness.values():
            if slowness.rank not in ranks:
                slowness.absent()
        if len(ranks) < 2:  # every other group outside the quorum: none to compare with
            return None
        step_s = statistics.median(sum(r[name] for name in STEP) for r in ranks.values())
        newly: Slowness | None = None
        for rank in sorted(ranks):
            for part in PARTS:
                slowness = self.slowness.setdefault((rank, part), Slowness(rank, part))
                own = ranks[rank][part]
                others = statistics.median(r[part] for q, r in ranks.items() if q != rank)
                slow = own >= self.settings.factor * others and own - others >= MIN_SHARE * step_s
                slowness.seen(slow, own / max(others, 1e-6), steps)
                if slow and slowness.found_at is None and slowness.slow_windows >= self.window:
                    slowness.found_at = step
                    self._found(slowness, step)
                    newly = newly or slowness
                elif slowness.found_at is not None and slowness.fast_windows >= self.window:
                    self._recovered(slowness, step)
                    slowness.found_at = None
        return newly

    @property
    def window(self) -> int:
        return self.settings.window

    def ours(self, slowness: Slowness) -> bool:
        """Whether the straggler is a process of this one's replica group."""
        return slowness.rank in self.own

    def describe(self, slowness: Slowness) -> str:
        if slowness.rank not in self.places:
            return f"rank {slowness.rank}"
        host, device = self.places[slowness.rank]
        return f"rank {slowness.rank} (host {host}, {device})"

    def ratio(self, slowness: Slowness) -> float:
        return round(statistics.median(slowness.ratios), 2) if slowness.ratios else 0.0

    def _found(self, slowness: Slowness, step: int) -> None:
        ratio = self.ratio(slowness)
        then = "the job runs at its pace"
        if self.settings.action == "restart":
            then = "its replica group restarts and heals"
        self._say_ours(
            slowness,
            f"{self.describe(slowness)} is {ratio:g}x slower than the median in "
            f"{slowness.part} for {slowness.steps} steps; {then}",
        )
        episode = {"rank": slowness.rank, "part": slowness.part, "ratio": ratio, "found_at": step}
        if slowness.rank in self.places:
            episode["host"], episode["device"] = self.places[slowness.rank]
        self.episodes.append(episode)
        self._record(slowness, "found", **episode)

    def _recovered(self, slowness: Slowness, step: int) -> None:
        self._say_ours(
            slowness, f"{self.describe(slowness)} is back at the median's pace in {slowness.part}"
        )
        for episode in reversed(self.episodes):
            if (episode["rank"], episode["part"]) == (slowness.rank, slowness.part):
                episode["recovered_at"] = step
                break
        self._record(slowness, "recovered", rank=slowness.rank, part=slowness.part, step=step)

    def _say_ours(self, slowness: Slowness, text: str) -> None:
        """Said by the rank 0 of the straggler's group, which knows its host: once a run."""
        if self.ours(slowness):
            self.say(text)

    def _record(self, slowness: Slowness, event: str, **fields: Any) -> None:
        if self.ours(slowness) and self.is_main:
            record(self.layout.stragglers, event, **fields)

    def stop_error(self, slowness: Slowness, step: int, saved: Any) -> RunError:
        """`launch.straggler.action: stop`: the error that ends the run, after its save."""
        self._record(slowness, "stopping", rank=slowness.rank, part=slowness.part, step=step)
        then = (
            f"saved {saved}; replace its node and continue with: train --resume {saved}"
            if saved
            else "nothing saved (checkpoint.enabled: false)"
        )
        return RunError(
            f"{self._straggler(slowness)}. Stopped at step {step}; {then}",
            hint="launch.straggler.action: warn names a straggler and trains on at its pace.",
        )

    def restart_error(self, slowness: Slowness, step: int) -> RunError:
        """`launch.straggler.action: restart`: the error that ends the processes of the
        straggler's replica group, which its agent restarts and a live group heals."""
        self._record(slowness, "restarting", rank=slowness.rank, part=slowness.part, step=step)
        return RunError(
            f"{self._straggler(slowness)}. Its replica group {self.engine.group_index} "
            f"restarts at step {step} and heals from a live group",
            hint="launch.straggler.action: warn names a straggler and trains on at its pace.",
        )

    def _straggler(self, slowness: Slowness) -> str:
        return (
            f"{self.describe(slowness)} is a straggler: {self.ratio(slowness):g}x slower than "
            f"the median in {slowness.part} for {slowness.steps} steps"
        )

    def summary(self) -> dict[str, Any]:
        """summary.json's entry: every straggler found, and when it recovered."""
        return {"stragglers": self.episodes} if self.episodes else {}


def by_rank(ranks: Figures) -> dict[str, list[float | None]]:
    """The figures as metrics.jsonl keeps them: `rank_<figure>_s`, a list by the run's rank
    (None for a rank outside the step's quorum)."""
    count = max(ranks, default=-1) + 1
    return {
        f"rank_{name}_s": [
            round(ranks[rank][name], 5) if rank in ranks else None for rank in range(count)
        ]
        for name in (FIGURES if ranks else ())
    }


def watch_pace(
    settings: StragglerSection,
    strategy: Strategy,
    model: nn.Module,
    layout: RunLayout,
    say: Callable[[str], None],
) -> tuple[Pace, StragglerWatch | None]:
    """This rank's pace, and the watch that compares it with the others'. No timing where
    there is nothing to compare: one process, pipeline stages (different work by design), or
    XLA's lazy tensors (the host traces a step; the device runs it later, unseen)."""
    off = settings.action == "off" or strategy.layout.pp > 1 or strategy.device.type == "xla"
    if off or _alone(strategy):
        return IdlePace(), None
    watch = StragglerWatch(settings, strategy, layout, say)
    return Pace(model, strategy.device), watch


def _alone(strategy: Strategy) -> bool:
    """One process in the run, or in a group that waits for no other."""
    engine = strategy.engine
    return strategy.world_size == 1 and not (engine.paces_together and engine.group_count > 1)
