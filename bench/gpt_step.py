"""A training step of bench/gpt_bench.yaml's GPT in this process, on 1 thread (as each CPU
worker of its 2-process runs has), for the benchmarks that weigh a per-step cost against a
whole step (`ema_cost.py`, `straggler_cost.py`)."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "bench/gpt_bench.yaml"


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def gpt_step() -> tuple[torch.nn.Module, Callable[[], None]]:
    """The model and one whole step of it (forward, backward, AdamW), warmed up."""
    from launcher.worker.recipe import load_recipe

    torch.set_num_threads(1)
    spec = yaml.safe_load(CONFIG.read_text())
    recipe = load_recipe(str(REPO / "recipes/gpt.py"))
    model = recipe.build_model(**spec["recipe"]["model"])
    data = recipe.build_dataset("train", **{**spec["recipe"]["dataset"], "max_bytes": 200_000})
    batch = torch.utils.data.default_collate([data[i] for i in range(spec["data"]["batch_size"])])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        loss, _ = recipe.loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(5):  # warm-up: allocator, optimizer state
        step()
    return model, step


def write_result(name: str, results: dict[str, object]) -> None:
    """`results` into bench/results/`name`, and shown."""
    out = REPO / "bench/results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
