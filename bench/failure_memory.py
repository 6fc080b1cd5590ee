"""The launcher's peak memory when a rank floods its log and then fails, ours against
`torchrun --nproc-per-node 2` running the same script by hand (issue 28).

Rank 1 writes MB mebibytes of log lines to stderr, then raises; rank 0 waits. Each command's
own process (the launcher, or torchrun's agent) is sampled every 10 ms for its resident
memory until it exits; stdout and stderr go to a file, as a batch job's do. The launcher also
reports the failure (root-cause panel, traceback): it reads the end of the log, not all of it.

Usage: python bench/failure_memory.py [--mb 500] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import FAULTY_RECIPE, write_spec  # noqa: E402

# The same fault, by hand: what a torchrun user's script does.
BY_HAND = """
import os, sys, time
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    for _ in range(int(os.environ["FLOOD_MB"]) * 1024):
        sys.stderr.write("x" * 1023 + "\\n")
    raise RuntimeError("boom on rank 1 after a flood")
time.sleep(3600)
"""


def peak_rss_mib(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, float, int]:
    """The command's own peak resident memory (MiB), its seconds, and its exit code."""
    with open(cwd / "output.txt", "w") as out:
        started = time.perf_counter()
        proc = subprocess.Popen(command, cwd=cwd, env={**os.environ, **env}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        watched, peak = psutil.Process(proc.pid), 0.0
        while proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                peak = max(peak, watched.memory_info().rss / 2**20)
            time.sleep(0.01)
        return peak, time.perf_counter() - started, proc.returncode


def ours(folder: Path, mb: int) -> tuple[float, float, int]:
    (folder / "faulty.py").write_text(FAULTY_RECIPE)
    spec = write_spec(folder / "run.yaml", recipe={"source": "faulty.py", "dataset": {}},
                      train={"max_steps": 30})  # fmt: skip
    train = str(Path(sys.executable).parent / "train")
    env = {"FAULT": "flood", "FLOOD_MB": str(mb)}
    return peak_rss_mib([train, "--config", str(spec)], folder, env)


def torchrun(folder: Path, mb: int) -> tuple[float, float, int]:
    (folder / "by_hand.py").write_text(BY_HAND)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--tee", "3", "by_hand.py"]  # fmt: skip
    return peak_rss_mib(command, folder, {"FLOOD_MB": str(mb)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float, int]]] = {"torchrun": [], "ours": []}
    for _ in range(args.repeats):
        for name, run in (("torchrun", torchrun), ("ours", ours)):
            with tempfile.TemporaryDirectory() as folder:
                results[name].append(run(Path(folder), args.mb))
    base = statistics.median(r[0] for r in results["torchrun"])
    print(f"rank 1 writes {args.mb} MiB of log, then fails; medians of {args.repeats}")
    print("| | peak RSS of the command's process, MiB | whole command, s | exit code |")
    print("|---|---:|---:|---:|")
    for name, rows in results.items():
        peak = statistics.median(r[0] for r in rows)
        seconds = statistics.median(r[1] for r in rows)
        print(f"| {name} | {peak:.0f} (x{peak / base:.2f}) | {seconds:.1f} | {rows[0][2]} |")


if __name__ == "__main__":
    main()
