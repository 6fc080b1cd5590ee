"""What `train.ema` costs per optimizer step, on the GPT recipe of bench/gpt_bench.yaml.

    python bench/ema_cost.py [--train ".venv/bin/train"] [--pairs 3] [--steps 120]

Two measurements, both against a peer measured in the same run:
- in one process (1 thread, as each CPU worker has): the median time of the average's update
  (`launcher.worker.ema.WeightAverage.update`) against the median time of a whole training
  step (forward, backward, AdamW) of the same model and batch;
- whole runs: the launcher on 2 processes with and without `train.ema`, ddp and fsdp, in
  alternating pairs, each run's median step (summary.json).
Writes bench/results/ema_cost.json.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import tempfile
from pathlib import Path

from gpt_step import CONFIG, REPO, gpt_step, median_ms, write_result


def in_process(repeats: int = 40) -> dict[str, float]:
    from launcher.worker.ema import WeightAverage

    model, step = gpt_step()
    average = WeightAverage(model, decay=0.999)
    average.update()  # warm-up
    step_ms, update_ms = median_ms(step, repeats), median_ms(average.update, repeats)
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, "step_ms": step_ms, "ema_update_ms": update_ms,
            "ratio": update_ms / step_ms}  # fmt: skip


def one_run(train: str, strategy: str, steps: int, ema: bool) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        argv = [
            *shlex.split(train), "--config", str(CONFIG), "--run-dir", str(run),
            "checkpoint.enabled=false", f"launch.strategy={strategy}",
            f"train.max_steps={steps}", f"train.log_every={steps}",
            *(["train.ema={decay: 0.999}"] if ema else []),
        ]  # fmt: skip
        subprocess.run(argv, cwd=REPO, check=True, capture_output=True, timeout=1200)
        return 1000 * json.loads((run / "summary.json").read_text())["median_step_s"]


def whole_runs(train: str, pairs: int, steps: int) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for strategy in ("ddp", "fsdp"):
        without, with_ema = [], []
        for _ in range(pairs):  # alternating, so that drift hits both alike
            without.append(one_run(train, strategy, steps, ema=False))
            with_ema.append(one_run(train, strategy, steps, ema=True))
        base, ours = statistics.median(without), statistics.median(with_ema)
        out[strategy] = {"without_ms": without, "with_ema_ms": with_ema,
                         "median_without_ms": base, "median_with_ema_ms": ours,
                         "ratio": ours / base}  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", default=str(REPO / ".venv/bin/train"))
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--in-process-only", action="store_true")
    args = parser.parse_args()
    results: dict[str, object] = {"in_process": in_process()}
    print(json.dumps(results["in_process"]))
    if not args.in_process_only:
        results["whole_runs"] = whole_runs(args.train, args.pairs, args.steps)
    write_result("ema_cost.json", results)


if __name__ == "__main__":
    main()
