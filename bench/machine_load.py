"""How much of this machine other programs used while a benchmark ran (Linux: /proc/stat).

On a shared 2-core machine another session's tests move a run's step time by tens of
percent, and the load average cannot tell them from the benchmark's own processes. The
machine's busy CPU time over a run, less what the run's own processes used (the children
this process has waited for), is what the others took: a run can then say how clean it was,
and a benchmark can wait for a quiet machine before it starts one.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CORES = os.cpu_count() or 1


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (every core, every process)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = fields[3] + fields[4]  # idle and iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """CPU seconds of this process's children that have ended and been waited for (and
    theirs: torchrun's and the launcher's workers)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


@contextmanager
def others_share() -> Iterator[dict[str, float]]:
    """Yields a dict that gets, when the block ends, `others_cpu_share`: the share of the
    machine's cores that processes other than this one's children kept busy meanwhile (0
    to 1). This process's own time counts as others', which is small for a benchmark that
    waits for its commands."""
    found: dict[str, float] = {}
    busy, own, start = busy_cpu_seconds(), children_cpu_seconds(), time.monotonic()
    try:
        yield found
    finally:
        others = (busy_cpu_seconds() - busy) - (children_cpu_seconds() - own)
        found["others_cpu_share"] = max(0.0, others) / (CORES * (time.monotonic() - start))


def wait_until_quiet(below: float, max_wait_s: float, sample_s: float = 5.0) -> float:
    """Waits until other processes keep less than `below` of the cores busy over `sample_s`
    seconds, or `max_wait_s` has passed; the share last seen."""
    deadline = time.monotonic() + max_wait_s
    while True:
        with others_share() as found:
            time.sleep(sample_s)
        share = found["others_cpu_share"]
        if share < below or time.monotonic() >= deadline:
            return share
