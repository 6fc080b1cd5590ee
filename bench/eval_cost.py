"""What an evaluation costs against a training step, on the GPT recipe of bench/gpt_bench.yaml.

    python bench/eval_cost.py [--train ".venv/bin/train"] [--repeats 3]

Runs the same job with evaluations every 50 steps (`eval.max_batches` batches per process), and
reports per repeat the median training step (summary.json) and the median evaluation batch
(each evaluation's `eval_s` over its batches, from metrics.jsonl): both measured in the same
run, on the same processes. Writes bench/results/eval_cost.json.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def one_run(train: str, batches: int, overrides: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        argv = [
            *shlex.split(train),
            "--config",
            str(REPO / "bench/gpt_bench.yaml"),
            "--run-dir",
            str(run),
            "checkpoint.enabled=false",
            "eval.every_n_steps=50",
            f"eval.max_batches={batches}",
            *overrides,
        ]
        subprocess.run(argv, cwd=REPO, check=True, capture_output=True, timeout=1200)
        summary = json.loads((run / "summary.json").read_text())
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # The first evaluation pays for building its DataLoader iterator and, on XLA, compiling.
    evals = [r["eval_s"] for r in records if "eval_s" in r][1:]
    step = summary["median_step_s"]
    per_batch = statistics.median(evals) / batches
    return {
        "train_step_ms": 1000 * step,
        "eval_batch_ms": 1000 * per_batch,
        "ratio": per_batch / step,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", default=str(REPO / ".venv/bin/train"))
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="spec overrides, e.g. launch.devices=1")
    args = parser.parse_args()
    runs = [one_run(args.train, args.batches, args.overrides) for _ in range(args.repeats)]
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out = REPO / "bench/results/eval_cost.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"runs": runs, "median": median}, indent=1))
    print("| training step (ms) | evaluation batch (ms) | evaluation batch / training step |")
    print("|---|---|---|")
    print(
        f"| {median['train_step_ms']:.1f} | {median['eval_batch_ms']:.1f} | {median['ratio']:.2f} |"
    )


if __name__ == "__main__":
    main()
