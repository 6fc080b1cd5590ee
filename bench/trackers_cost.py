"""What the experiment trackers cost a step: `log.trackers: [tensorboard, wandb, mlflow, csv]`
against `[tensorboard]` alone (the default), on bench/gpt_bench.yaml (2 processes, ddp).

    python bench/trackers_cost.py [--train .venv/bin/train] [--pairs 5] [--steps 150]

Runs alternate (ABBA), so that drift hits both alike, at two logging rates: the default
(`train.log_every=10`) and every step (`train.log_every=1`, a record for each tracker at each
of the ~12 steps a second). W&B runs offline (`WANDB_MODE=offline`: no network here), MLflow
against a real `mlflow server` on loopback with a SQLite store, started for the benchmark: on
this machine the server's CPU is taken from the same cores as training's, which a team's
server elsewhere is not. The figure is each run's median step (summary.json) and its mean
step. Writes bench/results/trackers_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.metrics.mlflow_server import mlflow_server  # noqa: E402

CONFIG = REPO / "bench/gpt_bench.yaml"
SIDES = {
    "tensorboard": "[tensorboard]",
    "all four": "[tensorboard, wandb, mlflow, csv]",
}


def one_run(
    train: str, trackers: str, steps: int, log_every: int, env: dict[str, str]
) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        argv = [
            *shlex.split(train), "--config", str(CONFIG), "--run-dir", str(run),
            "checkpoint.enabled=false", f"train.max_steps={steps}", f"train.log_every={log_every}",
            f"log.trackers={trackers}", "log.mlflow.experiment=trackers-cost",
        ]  # fmt: skip
        subprocess.run(argv, cwd=tmp, env=env, check=True, capture_output=True, timeout=1200)
        summary = json.loads((run / "summary.json").read_text())
        times = summary["step_time_s"]
        return {"median_ms": 1000 * times["p50"], "mean_ms": 1000 * times["mean"],
                "wall_s": summary["wall_s"]}  # fmt: skip


def measure(
    train: str, pairs: int, steps: int, log_every: int, env: dict[str, str]
) -> dict[str, list]:
    runs: dict[str, list] = {side: [] for side in SIDES}
    order = list(SIDES)
    for pair in range(pairs):
        for side in order if pair % 2 == 0 else order[::-1]:  # ABBA
            runs[side].append(one_run(train, SIDES[side], steps, log_every, env))
            print(f"log_every {log_every}", side, runs[side][-1], flush=True)
    return runs


def summarize(runs: dict[str, list]) -> dict[str, object]:
    """Each pair's ratio (all four over TensorBoard alone) of its median and of its mean step:
    their median and range. Pairs, not medians of each side: the machine drifts."""
    out: dict[str, object] = {}
    for stat in ("median_ms", "mean_ms"):
        pairs = zip(runs["all four"], runs["tensorboard"], strict=True)
        ratios = [ours[stat] / base[stat] for ours, base in pairs]
        out[f"ratios_{stat}"] = ratios
        out[f"ratio_{stat}"] = statistics.median(ratios)
        for side in SIDES:
            out[f"{side}_{stat}"] = statistics.median(r[stat] for r in runs[side])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", default=str(REPO / ".venv/bin/train"))
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    results: dict[str, object] = {"steps": args.steps, "pairs": args.pairs}
    with tempfile.TemporaryDirectory() as tmp, mlflow_server(Path(tmp)) as url:
        env = {**os.environ, "MLFLOW_TRACKING_URI": url, "WANDB_MODE": "offline"}
        for log_every in (10, 1):
            runs = measure(args.train, args.pairs, args.steps, log_every, env)
            results[f"log_every_{log_every}"] = {"runs": runs, **summarize(runs)}
    out = REPO / "bench/results/trackers_cost.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    for key, value in results.items():
        shown = (
            {k: v for k, v in value.items() if k != "runs"} if isinstance(value, dict) else value
        )
        print(key, json.dumps(shown))


if __name__ == "__main__":
    main()
