"""What the straggler watch (`launch.straggler`) costs per step, on the GPT recipe of
bench/gpt_bench.yaml.

    python bench/straggler_cost.py [--train ".venv/bin/train"] [--pairs 3] [--steps 120]

Two measurements, both against a peer measured in the same run:
- in one process: the median time of one step's timing (the marks a DDP step takes: a fetch,
  the backward's own end, its return, the optimizer's update, the step's end, and the
  window's reading at its share)
  against the median time of a whole training step (forward, backward, AdamW), 1 thread;
- whole runs: the launcher on 2 processes with `launch.straggler.action` warn and off, in
  alternating pairs, each run's median step (summary.json).
Writes bench/results/straggler_cost.json.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch
from gpt_step import CONFIG, REPO, gpt_step, median_ms, write_result


def in_process(repeats: int = 40, log_every: int = 10) -> dict[str, float]:
    from launcher.worker.pace import Pace

    model, step = gpt_step()
    pace = Pace(model, torch.device("cpu"))

    def timing() -> None:  # what a step of a timed run adds, the window's reading included
        pace.step_started()
        with pace.fetching():
            pass
        pace.wait_started()
        pace.backward_returned()
        with pace.updating():
            pass
        pace.step_done()
        if len(pace._done) == log_every:
            pace.window()

    step_ms, timing_ms = median_ms(step, repeats), median_ms(timing, repeats * 25)
    return {"step_ms": step_ms, "timing_ms": timing_ms, "ratio": timing_ms / step_ms}


def one_run(train: str, steps: int, action: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        argv = [
            *shlex.split(train), "--config", str(CONFIG), "--run-dir", str(run),
            "checkpoint.enabled=false", f"train.max_steps={steps}", "train.log_every=10",
            f"launch.straggler.action={action}",
        ]  # fmt: skip
        subprocess.run(argv, cwd=REPO, check=True, capture_output=True, timeout=1200)
        return 1000 * json.loads((run / "summary.json").read_text())["median_step_s"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", default=str(REPO / ".venv/bin/train"))
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args()
    result: dict[str, object] = {"in_process": in_process()}
    runs: dict[str, list[float]] = {"off": [], "warn": []}
    for _ in range(args.pairs):
        for action in ("off", "warn"):
            runs[action].append(one_run(args.train, args.steps, action))
    medians = {action: statistics.median(times) for action, times in runs.items()}
    result["ddp_2_processes_ms"] = {"runs": runs, "medians": medians,
                                    "ratio": medians["warn"] / medians["off"]}  # fmt: skip
    write_result("straggler_cost.json", result)


if __name__ == "__main__":
    main()
