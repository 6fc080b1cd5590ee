"""`LAUNCHER_TRACE_STARTUP=1`: each worker prints `startup-trace PHASE UNIX_TIME` into its log as
it passes a phase of its start (the process group joined, the model built, the end), so that
`bench/startup.py` can say where the seconds before the first step go. Unset (every real run):
one dictionary lookup per phase, and nothing printed.

A loose module because both the worker and the strategies (`launcher.parallel`) mark phases,
and neither may import the other."""

from __future__ import annotations

import os
import time

TRACE_ENV = "LAUNCHER_TRACE_STARTUP"
_started = False


def mark(phase: str) -> None:
    """Prints when this process reached `phase`; the first mark also prints when the process
    itself started (the interpreter's start, before any import)."""
    global _started
    if not os.environ.get(TRACE_ENV):
        return
    if not _started:
        _started = True
        print(f"startup-trace process-start {_process_start():.6f}", flush=True)
    print(f"startup-trace {phase} {time.time():.6f}", flush=True)


def _process_start() -> float:
    """The process's start as a Unix time, to 10 ms, from /proc (Linux; 0 elsewhere): its age
    (the system's uptime less its start tick) before now."""
    try:
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as uptime:
            up = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return time.time() - (up - ticks / os.sysconf("SC_CLK_TCK"))
