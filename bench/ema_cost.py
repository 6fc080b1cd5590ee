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
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "bench/gpt_bench.yaml"


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def in_process(repeats: int = 40) -> dict[str, float]:
    from launcher.worker.ema import WeightAverage
    from launcher.worker.recipe import load_recipe

    torch.set_num_threads(1)
    spec = yaml.safe_load(CONFIG.read_text())
    recipe = load_recipe(str(REPO / "recipes/gpt.py"))
    model = recipe.build_model(**spec["recipe"]["model"])
    data = recipe.build_dataset("train", **{**spec["recipe"]["dataset"], "max_bytes": 200_000})
    batch = torch.utils.data.default_collate([data[i] for i in range(spec["data"]["batch_size"])])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    average = WeightAverage(model, decay=0.999)

    def step() -> None:
        loss, _ = recipe.loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(5):  # warm-up: allocator, optimizer state
        step()
        average.update()
    step_ms, update_ms = _median_ms(step, repeats), _median_ms(average.update, repeats)
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
    out = REPO / "bench/results/ema_cost.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
