"""Recompilations after warm-up, for any compiler that can count its graphs (XLA's, and
`torch.compile`'s under `train.compile`).

A compiled step that compiles again after warm-up is almost always a bug (a changing shape or
Python value) and costs a full compile each time, so the guard says so loudly, naming the
step, or stops the run when asked to (`strict`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from launcher.errors import RunError


class CompileGuard:
    """Counts compilations and flags those after warm-up, naming the step."""

    def __init__(
        self,
        count: Callable[[], int],  # graphs compiled by this process so far
        warmup_steps: int | None,
        strict: bool = False,
        compiler: str = "XLA",
        strict_hint: str = "Or drop --strict-compile / xla.strict_compile.",
    ) -> None:
        self.count = count
        self.warmup_steps = warmup_steps
        self.strict = strict
        self.compiler = compiler
        self.strict_hint = strict_hint
        self.steps_run = 0  # by this process: a resumed run warms up again
        self.reads: list[int] = []  # steps run when the loop read metrics, the first two
        self.seen = 0
        self.after_warmup = 0
        self.by_phase: dict[str, list[int]] = {}  # phase: compilations at its first run, later
        self.expect_until = 0  # a phase's first run changes the graph of the step after it

    def reading(self) -> None:
        if len(self.reads) < 2:
            self.reads.append(self.steps_run)

    def warming_up(self) -> bool:
        if self.warmup_steps is not None:
            return self.steps_run <= self.warmup_steps
        # The first step, the first logged metrics and the step after them (whose metrics
        # window starts anew) each trace a graph of their own (XLA); so does the step after
        # the second log line in a resumed run, whose first window was restored from disk.
        return len(self.reads) < 2 or self.steps_run <= self.reads[1] + 1

    def after_step(self, step: int) -> None:
        self.steps_run += 1
        now = self.count()
        new, self.seen = now - self.seen, now
        if new and not self.warming_up() and self.steps_run > self.expect_until:
            self._unexpected(new, f"step {step}", "in the step")

    def absorb(self) -> None:
        """Counts what compiled since the last check as expected."""
        self.seen = self.count()

    def after_phase(self, name: str, step: int) -> None:
        """After an evaluation or a save: its graphs are compiled the first time it runs."""
        now = self.count()
        new, self.seen = now - self.seen, now
        counts = self.by_phase.get(name)
        if counts is None:
            self.by_phase[name] = [new, 0]
            self.expect_until = self.steps_run + 1
        elif new:
            counts[1] += new
            self._unexpected(new, f"{name} at step {step}", f"in the {name}")

    def _unexpected(self, new: int, where: str, inside: str) -> None:
        self.after_warmup += new
        message = (
            f"{where}: {self.compiler} compiled {new} new graph{'s' if new > 1 else ''} after "
            f"warm-up. A shape or a Python value {inside} changed, and each change costs a "
            "full compile (docs/tpus.md, 'Recompilations')."
        )
        if self.strict:
            raise RunError(message, hint=self.strict_hint)
        print(f"WARNING: {message}", file=sys.stderr, flush=True)

    def summary(self, prefix: str) -> dict[str, Any]:
        return {
            f"{prefix}_compilations": self.count(),
            f"{prefix}_compilations_after_warmup": self.after_warmup,
            # Not shown on the last line (it names only numbers): summary.json alone.
            f"{prefix}_phase_compilations": self.by_phase,
        }
