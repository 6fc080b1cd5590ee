"""A worker's start, with Python's cyclic garbage collector paused until training begins.

Importing torch, and torch._dynamo (the optimizer's first use imports it), creates about half a
million objects; each time the heap has grown by a quarter, a full collection walks all of it.
That was a quarter of a worker's start-up CPU time (issue 41), for almost no garbage: modules,
classes and functions live as long as the process. So the collector is paused from the
worker's first import (`launcher.worker.main` imports this module first) until the run is
built (`over`, as the first step is about to run); then what the start built is frozen (the
collector never walks it again) and collection goes on as usual.
"""

from __future__ import annotations

import gc

# Paused here only if it ran: a recipe or a test that turned it off keeps it off.
_paused = gc.isenabled()
gc.disable()


def over() -> None:
    """The start is over: freeze what it built and resume collecting (once; idempotent)."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()
