"""Start-up and memory, ours against torchrun (issue 41).

Side by side, alternating, REPEATS times each (medians):

1. A trivial run: `train --config bench/gpt_bench.yaml` cut to 2 steps and no checkpoint (2 CPU
   processes, DDP) against `torchrun --standalone --nproc-per-node 2 bench/handwritten_ddp.py
   --steps 2` (the same recipe, batch, optimizer and steps by hand): the whole command's
   seconds, the peak resident memory of its largest process (the kernel's count for the
   whole process tree, `wait4`) and of each kind of process (sampled VmHWM), and our phases:
   the launcher's checks (until its `starting` line), the workers' start, their imports and
   spec, the process group, the model, the first step, the rest, the exit (the workers'
   `startup-trace` lines, `LAUNCHER_TRACE_STARTUP=1`, `launcher/startup_trace.py`).
2. The log flood of bench/log_flood.py (2 ranks print LINES lines each, then train 2 steps),
   stdout to a file, against `torchrun --tee 3` running the same by hand.

`--base DIR` adds a third contender: the `launcher` package in DIR (a copy of the tree before
a change), run the same way, so that before and after are measured in the same minutes.

Usage: python bench/startup.py [--repeats 7] [--lines 200000] [--base /tmp/before]
Writes bench/results/startup.json; BENCHMARKS.md records the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "bench")]

import log_flood  # noqa: E402

TRIVIAL = [
    "--config",
    str(REPO / "bench" / "gpt_bench.yaml"),
    "train.max_steps=2",
    "train.log_every=1",
    "checkpoint.enabled=false",
]
BY_HAND = [
    *("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
    str(REPO / "bench" / "handwritten_ddp.py"),
    *("--steps", "2", "--batch-size", "8", "--max-bytes", "8000000"),
]
ENV = {"OMP_NUM_THREADS": "1", "LAUNCHER_TRACE_STARTUP": "1", "COLUMNS": "200"}
MIB = 2**20


class _Peaks(threading.Thread):
    """Samples the peak resident memory (VmHWM) of every process of a tree, by kind."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.root, self.done = pid, threading.Event()
        self.by_pid: dict[int, tuple[str, int]] = {}

    def run(self) -> None:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.root)
            while not self.done.wait(0.05):
                with contextlib.suppress(psutil.Error):
                    for proc in [root, *root.children(recursive=True)]:
                        self._read(proc)

    def _read(self, proc: psutil.Process) -> None:
        with contextlib.suppress(psutil.Error, OSError, StopIteration):
            with open(f"/proc/{proc.pid}/status") as status:
                kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))
            known = self.by_pid.get(proc.pid)
            kind = known[0] if known else "launcher" if proc.pid == self.root else _kind(proc)
            self.by_pid[proc.pid] = (kind, kib * 1024)

    def by_kind(self) -> dict[str, float]:
        """The largest peak of each kind of process, MiB."""
        peaks: dict[str, float] = {}
        for kind, peak in self.by_pid.values():
            peaks[kind] = max(peaks.get(kind, 0.0), peak / MIB)
        return peaks


def _kind(proc: psutil.Process) -> str:
    """A process below the command's own (`train`, or torchrun's agent)."""
    argv = " ".join(proc.cmdline())
    if "launcher.worker.fork_server" in argv:  # the fork server, or a worker it forked
        parent = " ".join(proc.parent().cmdline()) if proc.parent() else ""
        return "worker" if "launcher.worker.fork_server" in parent else "fork server"
    return "worker" if "launcher.worker.main" in argv or "handwritten_ddp.py" in argv else "helper"


def timed(argv: list[str], env: dict[str, str], cwd: Path = REPO) -> dict:
    """Runs `argv` to its end: seconds, when it printed its `starting` line, the largest
    process's peak memory, the peaks by kind; raises on a failure."""
    started = time.time()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    peaks = _Peaks(proc.pid)
    peaks.start()
    seen: dict[str, float] = {}
    assert proc.stdout is not None
    output = []
    for line in proc.stdout:  # ends when every writer has closed it: the tree has ended
        output.append(line)
        if line.startswith((b"starting ", b"resuming ")) and "starting" not in seen:
            seen["starting"] = time.time()
    # wait4: the kernel's peak resident memory of the largest process of the whole tree.
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    ended = time.time()
    peaks.done.set()
    peaks.join()
    if proc.returncode != 0:
        tail = b"".join(output[-30:]).decode(errors="replace")
        raise RuntimeError(f"exit code {proc.returncode}: {' '.join(argv)}\n{tail}")
    return {"started": started, "ended": ended, "seconds": ended - started, **seen,
            "cpu_s": usage.ru_utime + usage.ru_stime,  # the whole tree's, every process reaped
            "max_rss_mib": usage.ru_maxrss / 1024, "peaks": peaks.by_kind()}  # fmt: skip


def ours(tmp: Path, base: Path | None, *overrides: str) -> dict:
    run_dir = tmp / f"run-{len(list(tmp.iterdir()))}"
    env = {**os.environ, **ENV}
    argv, cwd = [str(Path(sys.executable).parent / "train")], REPO
    if base is not None:
        # The package in `base`, ahead of the installed one, in the workers too: they start
        # with `-m` from the launcher's folder, which would come first on their path.
        env["PYTHONPATH"], cwd = str(base), tmp
        argv = [sys.executable, "-m", "launcher.cli.app"]
    result = timed([*argv, *TRIVIAL, *overrides, "--run-dir", str(run_dir)], env, cwd)
    result["phases"] = phases(result, run_dir)
    return result


def phases(result: dict, run_dir: Path) -> dict[str, float]:
    """Seconds in each phase of our run, on its slowest rank (the one the run waits for)."""
    marks: dict[str, list[float]] = {}
    for log in sorted((run_dir / "logs").glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("startup-trace "):
                _, phase, when = line.split()
                marks.setdefault(phase, []).append(float(when))
    if "process-start" not in marks:  # a tree from before the marks: the whole command only
        return {}
    summary = json.loads((run_dir / "summary.json").read_text())
    points = [
        ("launcher checks, until `starting`", result["starting"]),
        ("until a worker process starts", min(marks["process-start"])),
        ("worker imports and spec", max(marks["imports-and-spec"])),
        ("process group (rendezvous)", max(marks["process-group"])),
        ("model built and wrapped", max(marks["model-built"])),
        ("first step ends (rank 0)", summary["first_step_end_unix"]),
        ("the other step, teardown", max(marks["teardown"])),
        ("exit", result["ended"]),
    ]
    out, before = {}, result["started"]
    for name, at in points:
        out[name], before = at - before, at
    return out


def torch_tried(run: Callable[[], dict], name: str, tries: int = 3) -> dict:
    """`run()`, tried again where torchrun's script fails at its exit (a rank's SIGABRT in
    torch's C++ teardown of a process group whose peer has gone; the launcher's workers skip
    that teardown). Each try is said, so that none goes unnoticed."""
    for tried in range(1, tries + 1):
        try:
            return run()
        except RuntimeError as failed:
            if tried == tries:
                raise
            print(f"{name}: failed, tried again ({str(failed).splitlines()[0][:120]})")
    raise AssertionError("unreachable")


def by_hand(tmp: Path) -> dict:
    out = tmp / f"by-hand-{len(list(tmp.iterdir()))}.json"
    argv = [sys.executable, *BY_HAND, "--out", str(out)]
    result = torch_tried(lambda: timed(argv, {**os.environ, **ENV}), "torchrun, by hand")
    first = json.loads(out.read_text())["first_step_end_unix"]
    result["phases"] = {
        "to the end of the first step": first - result["started"],
        "the other step, to exit": result["ended"] - first,
    }
    return result


def flood(name: str, lines: int) -> dict:
    argv = log_flood.commands(lines)[name]
    result = torch_tried(lambda: log_flood.end_to_end(argv, lines, terminal=False), name)
    if result["lost"]:
        raise RuntimeError(f"{name} lost {result['lost']} of the flood's lines")
    return {"seconds": result["seconds"]}


def _median(runs: list[dict]) -> dict:
    """Medians of the numbers (and of each number of the dicts) of `runs`."""
    out: dict = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = _median([run[key] for run in runs])
        elif isinstance(value, int | float) and key not in ("started", "ended", "starting"):
            out[key] = statistics.median(run[key] for run in runs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--lines", type=int, default=200_000, help="flood lines per rank")
    parser.add_argument("--base", type=Path, help="a folder holding the `launcher` before")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/startup.json")
    args = parser.parse_args()
    contenders = {
        "torchrun, by hand": by_hand,
        "ours": lambda tmp: ours(tmp, None),
        # Workers as new interpreters, as torchrun starts them (before issue 54, ours too).
        "ours, workers spawned": lambda tmp: ours(tmp, None, "launch.worker_start=spawn"),
        **({f"ours at {args.base}": lambda tmp: ours(tmp, args.base)} if args.base else {}),
        "flood: torchrun --tee 3": lambda tmp: flood("torchrun --tee 3", args.lines),
        "flood: ours": lambda tmp: flood("ours", args.lines),
    }
    runs: dict[str, list[dict]] = {name: [] for name in contenders}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):  # alternating, so that drift hits all alike
            for name, run in contenders.items():
                runs[name].append(run(Path(tmp)))
                print(f"{name}: {runs[name][-1]['seconds']:.2f} s", flush=True)
    results = {name: _median(rows) for name, rows in runs.items()}
    report(results)
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "load_average": os.getloadavg(), "repeats": args.repeats}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**meta, "medians": results, "runs": runs}, indent=1))
    print(f"wrote {args.out}")


def report(results: dict) -> None:
    base = results["torchrun, by hand"]
    print("\n| (median) | whole command, s | x torchrun | CPU, s | x torchrun "
          "| largest process, MiB | x torchrun |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, row in results.items():
        if name.startswith("flood"):
            continue
        print(f"| {name} | {row['seconds']:.2f} | {row['seconds'] / base['seconds']:.2f} | "
              f"{row['cpu_s']:.2f} | {row['cpu_s'] / base['cpu_s']:.2f} | "
              f"{row['max_rss_mib']:.0f} | {row['max_rss_mib'] / base['max_rss_mib']:.2f} |")  # fmt: skip
    flood_base = results["flood: torchrun --tee 3"]["seconds"]
    print(f"| flood: torchrun --tee 3 | {flood_base:.2f} | 1.00 | | | | |")
    ours_flood = results["flood: ours"]["seconds"]
    print(f"| flood: ours | {ours_flood:.2f} | {ours_flood / flood_base:.2f} | | | | |")
    for name, row in results.items():
        if "phases" in row:
            print(f"\n{name}: peaks by kind (MiB) {_rounded(row['peaks'])}")
            for phase, seconds in row["phases"].items():
                print(f"  {phase}: {seconds:.3f} s")


def _rounded(values: dict[str, float]) -> dict[str, int]:
    return {key: round(value) for key, value in values.items()}


if __name__ == "__main__":
    main()
