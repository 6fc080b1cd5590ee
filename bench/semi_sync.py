"""Semi-synchronous replica groups (`fault_tolerance.sync`) against per-step syncing, on the GPT
of bench/gpt_bench.yaml, 2 replica groups of 1 CPU process each.

    python bench/semi_sync.py [--train ".venv/bin/train"] [--steps 1000] [--rate-steps 200]

1. Convergence: the val loss after `--steps` steps (the whole val split's mean, one evaluation
   at the end) of per-step syncing, DiLoCo at H = 10, 50 and 100 (its outer optimizer the
   paper's: Nesterov SGD, lr 0.7, momentum 0.9), streaming DiLoCo (4 fragments, H = 48: a
   fragment every 12 steps) and LocalSGD at H = 50.
2. A slow link between the groups: each all-reduce between groups is held back by its bytes
   over the link's bandwidth (10 and 100 MB/s; a bench recipe wraps torchft's
   `Manager.allreduce`, the one door between groups), and the step rate of per-step syncing
   and DiLoCo at H = 50 is measured with and without it, over `--rate-steps` steps.

Writes bench/results/semi_sync.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent

# The GPT recipe; with LINK_MBPS set, every all-reduce between replica groups takes as long
# more as its bytes need on a link of that many MB/s (after the real one: both count).
RECIPE = """
import os, sys, time
sys.path.insert(0, {recipes!r})
from gpt import build_dataset, build_model, loss  # noqa: F401
sys.path.pop(0)

if os.environ.get("LINK_MBPS"):
    import torchft.manager

    _allreduce = torchft.manager.Manager.allreduce
    _bytes_per_s = float(os.environ["LINK_MBPS"]) * 1e6

    def _over_a_slow_link(self, tensor, *args, **kwargs):
        work = _allreduce(self, tensor, *args, **kwargs)
        time.sleep(tensor.numel() * tensor.element_size() / _bytes_per_s)
        return work

    torchft.manager.Manager.allreduce = _over_a_slow_link
"""

DILOCO = {"name": "SGD", "lr": 0.7, "momentum": 0.9, "nesterov": True}
CONVERGENCE = {
    "every_step": {"method": "every_step"},
    "diloco_h10": {"method": "diloco", "every": 10, "outer_optim": DILOCO},
    "diloco_h50": {"method": "diloco", "every": 50, "outer_optim": DILOCO},
    "diloco_h100": {"method": "diloco", "every": 100, "outer_optim": DILOCO},
    "diloco_h50_fragments4": {
        "method": "diloco",
        "every": 48,
        "fragments": 4,
        "outer_optim": DILOCO,
    },
    "local_sgd_h50": {"method": "local_sgd", "every": 50},
}


def _run(
    train: list[str], folder: Path, sync: dict, steps: int, link_mbps: float | None
) -> dict[str, Any]:
    folder.mkdir(parents=True)
    spec = yaml.safe_load((REPO / "bench/gpt_bench.yaml").read_text())
    recipe = folder / "recipe.py"
    recipe.write_text(RECIPE.format(recipes=str(REPO / "recipes")))
    spec["recipe"]["source"] = str(recipe)
    spec["run"]["output_dir"] = str(folder / "runs")
    spec["train"] = {"max_steps": steps, "log_every": 10}
    spec["eval"] = {"every_n_steps": steps}  # once, at the end: the whole val split
    spec["checkpoint"] = {"enabled": False}
    spec["fault_tolerance"] = {"enabled": True, "replica_groups": 2, "sync": sync}
    config = folder / "run.yaml"
    config.write_text(yaml.safe_dump(spec))
    env = {"LINK_MBPS": str(link_mbps)} if link_mbps else {}
    started = time.time()
    done = subprocess.run(
        [*train, "--config", str(config)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run_dir,) = (folder / "runs").glob("*/*")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    timed = [r for r in records if "loss" in r]
    first, last = timed[0], timed[-1]  # from the first logged step: start-up left out
    sent = json.loads((run_dir / "summary.json").read_text())["fault_tolerance"]
    return {
        "val_loss": next(r["val/loss"] for r in records if "val/loss" in r),
        "steps_per_s": round((last["step"] - first["step"]) / (last["time"] - first["time"]), 2),
        "bytes_per_step": sent["sent_to_other_groups"]["per_step"],
        "wall_s": round(time.time() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", default=str(REPO / ".venv/bin/train"))
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rate-steps", type=int, default=200)
    parser.add_argument("--part", choices=["convergence", "slow_link"], action="append")
    args = parser.parse_args()
    train = shlex.split(args.train)
    parts = args.part or ["convergence", "slow_link"]
    out = REPO / "bench/results/semi_sync.json"
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        if "convergence" in parts:
            results["convergence"] = {}
            for name, sync in CONVERGENCE.items():
                run = _run(train, Path(tmp) / name, sync, args.steps, None)
                results["convergence"][name] = run
                print(name, run, flush=True)
        if "slow_link" in parts:
            results["slow_link"] = _slow_link(train, Path(tmp), args.rate_steps)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


def _slow_link(train: list[str], tmp: Path, steps: int) -> dict[str, Any]:
    """Per-step syncing and DiLoCo at H = 50, unslowed and over a 100 and a 10 MB/s link, in
    ABAB order (a drift of the machine's speed falls on both alike)."""
    runs: dict[str, Any] = {}
    for mbps in (None, 100.0, 10.0):
        for name in ("every_step", "diloco_h50"):
            label = f"{name}@{mbps or 'unslowed'}"
            folder = tmp / label.replace("@", "-")
            runs[label] = _run(train, folder, CONVERGENCE[name], steps, mbps)
            print(label, runs[label], flush=True)
    for name in ("every_step", "diloco_h50"):
        unslowed = runs[f"{name}@unslowed"]["steps_per_s"]
        for mbps in (100.0, 10.0):
            run = runs[f"{name}@{mbps}"]
            run["of_unslowed_rate"] = round(run["steps_per_s"] / unslowed, 3)
    return runs


if __name__ == "__main__":
    main()
