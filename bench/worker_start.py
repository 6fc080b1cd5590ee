"""Workers forked by the fork server against workers started as new interpreters (issue 54).

`launch.worker_start: forkserver` (the default on Linux CPUs) against `spawn` (as torchrun
starts them), side by side, alternating, REPEATS times each (medians):

1. A run of 2 CPU processes (`bench/gpt_bench.yaml`, 2 steps, no checkpoint): the whole
   command's seconds and CPU seconds (every process of the tree, `wait4`).
2. A run with a restart: rank 1 fails once, at its 6th loss (`bench/restart_recipe.py`,
   `recipes/mlp.py`'s model, 10 steps), and `--max-restarts 1` starts both ranks again: the
   whole command's seconds and CPU seconds, whose difference is what the restart costs.

Usage: python bench/worker_start.py [--repeats 5]
Writes bench/results/worker_start.json; BENCHMARKS.md records the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "bench")]

from startup import ENV, TRIVIAL, timed  # noqa: E402

TRAIN = str(Path(sys.executable).parent / "train")
RESTART = [
    *("--config", str(REPO / "configs" / "quickstart.yaml")),
    f"recipe.source={REPO / 'bench' / 'restart_recipe.py'}",
    *("--devices", "2", "--max-restarts", "1"),
    *("train.max_steps=10", "train.log_every=1", "checkpoint.enabled=false"),
    "checkpoint.monitor=null",
]


def one(tmp: Path, args: list[str], start: str) -> dict:
    run_dir = tmp / f"run-{len(list(tmp.iterdir()))}"
    argv = [TRAIN, *args, f"launch.worker_start={start}", "--run-dir", str(run_dir)]
    result = timed(argv, {**os.environ, **ENV})
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    return {"seconds": result["seconds"], "cpu_s": result["cpu_s"], "steps": len(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/worker_start.json")
    args = parser.parse_args()
    cases = {"2 processes": TRIVIAL, "2 processes, a restart": RESTART}
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):  # alternating, so that drift hits all alike
            for case, case_args in cases.items():
                for start in ("spawn", "forkserver"):
                    row = one(Path(tmp), case_args, start)
                    runs.setdefault(f"{case}: {start}", []).append(row)
                    print(f"{case}, {start}: {row['seconds']:.2f} s, {row['cpu_s']:.2f} CPU s",
                          flush=True)  # fmt: skip
    medians = {name: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
               for name, rows in runs.items()}  # fmt: skip
    print("\n| (median) | whole command, s | x spawn | CPU, s | x spawn |")
    print("|---|---:|---:|---:|---:|")
    for name, row in medians.items():
        base = medians[name.replace("forkserver", "spawn")]
        print(f"| {name} | {row['seconds']:.2f} | {row['seconds'] / base['seconds']:.2f} | "
              f"{row['cpu_s']:.2f} | {row['cpu_s'] / base['cpu_s']:.2f} |")  # fmt: skip
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "load_average": os.getloadavg(), "repeats": args.repeats}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**meta, "medians": medians, "runs": runs}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
