"""The launcher's peak memory while it refuses metadata that would fill the machine if read
whole (issue 39): a checkpoint whose meta.json is a link to /dev/zero (`--resume`), and a
Hugging Face folder whose model.safetensors.index.json is a 3 GiB sparse file
(`--load-weights`). A refusal of a checkpoint that does not exist, which reads nothing, is the
floor.

Each `train` runs to its end (exit 2) with stdout and stderr to a file; its peak is the
kernel's count for the process tree (`wait4`'s ru_maxrss: the largest resident set of the
command and of every process it waited for), exact however short the peak.

Usage: python bench/bounded_reads.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import write_spec  # noqa: E402

TRAIN = str(Path(sys.executable).parent / "train")
CHECKPOINT = "runs/t/a/checkpoints/step-00000002"
INDEX_BYTES = 3 << 30


def peak_rss_mib(args: list[str], cwd: Path) -> tuple[float, float, int]:
    """`train ARGS`: the peak resident memory of its process tree (MiB), its seconds, its exit
    code."""
    with open(cwd / "output.txt", "w") as out:
        started = time.perf_counter()
        proc = subprocess.Popen([TRAIN, *args], cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    return usage.ru_maxrss / 1024, seconds, proc.returncode


def nothing_to_read(folder: Path) -> list[str]:
    return ["--config", "run.yaml", "--resume", "nowhere"]


def meta_from_dev_zero(folder: Path) -> list[str]:
    """A checkpoint whole but for its meta.json, a link to /dev/zero."""
    import torch
    import torch.distributed.checkpoint as dcp

    checkpoint = folder / CHECKPOINT
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group, on purpose
        dcp.save({"model": {"w": torch.ones(3)}}, checkpoint_id=checkpoint, no_dist=True)
    (checkpoint / "COMPLETE").write_text("")
    (checkpoint / "meta.json").symlink_to("/dev/zero")
    return ["--config", "run.yaml", "--resume", CHECKPOINT]


def sparse_index(folder: Path) -> list[str]:
    """A Hugging Face folder whose index is 3 GiB of holes (no disk used)."""
    model = folder / "hf"
    model.mkdir()
    with open(model / "model.safetensors.index.json", "wb") as index:
        index.truncate(INDEX_BYTES)
    return ["--config", "run.yaml", "--load-weights", str(model)]


CASES: dict[str, Callable[[Path], list[str]]] = {
    "`--resume` of a checkpoint that does not exist (reads nothing)": nothing_to_read,
    "`--resume` of a checkpoint whose meta.json links to /dev/zero": meta_from_dev_zero,
    "`--load-weights` of a folder with a 3 GiB sparse index": sparse_index,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"medians of {args.repeats}; each refusal ends with exit code 2")
    print("| `train` refuses | peak RSS of its process tree, MiB | seconds | exit code |")
    print("|---|---:|---:|---:|")
    for name, make in CASES.items():
        rows = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                folder = Path(tmp)
                write_spec(folder / "run.yaml")
                rows.append(peak_rss_mib(make(folder), folder))
        peak = statistics.median(r[0] for r in rows)
        seconds = statistics.median(r[1] for r in rows)
        codes = sorted({r[2] for r in rows})
        print(f"| {name} | {peak:.0f} | {seconds:.1f} | {', '.join(map(str, codes))} |")


if __name__ == "__main__":
    main()
