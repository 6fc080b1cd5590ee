"""The launcher against hand-written loops and Lightning on one GPU (issue 17's targets).

    python bench/gpu_bench.py                 # on a GPU machine: every row (about 9 minutes)
    python bench/gpu_bench.py --only compiled  # rows whose name holds a word
    python bench/gpu_bench.py --smoke         # here, on CPU: every row tiny, to see it works

Rows, on the GPT recipe at 86M parameters (12 x 768, block 1024) in bf16, batches 16 and 32:
hand-written torchrun DDP (eager), the best hand-written loop (no DDP, fused AdamW,
torch.compile), ours eager and ours `train.compile: true`, Lightning (skipped where it is not
installed); fsdp: ours against hand-written `fully_shard`, both gathering bf16 parameters; and
the tiny GPT (0.9M) at batch 64: hand-written DDP, no DDP, Lightning and ours. Each row: median
ms/step after the warm-up steps, tokens/s, MFU (FLOPs counted with the launcher's
`count_flops`, peak from its table) and peak GPU memory. Prints a markdown table and the
target ratios; writes the JSON to $OUT (the device machine's) or bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from launcher.train.flops import count_flops, peak_flops  # noqa: E402
from launcher.train.recipe import load_recipe  # noqa: E402

BIG = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024}
TINY = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128}
SMOKE = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}


def rows(smoke: bool) -> list[dict]:
    """(name, kind, model, batch, options) of every row."""
    big, tiny = (SMOKE, SMOKE) if smoke else (BIG, TINY)
    out = []
    for batch in (16, 32):
        out += [
            {"name": f"hand-written DDP, batch {batch}", "kind": "hand", "args": []},
            {"name": f"hand-written best (no DDP, fused, compiled), batch {batch}",
             "kind": "hand", "args": ["--no-ddp", "--fused", "--compile"]},
            {"name": f"ours, batch {batch}", "kind": "ours", "train": {}},
            {"name": f"ours compiled, batch {batch}", "kind": "ours", "train": {"compile": True}},
            {"name": f"Lightning, batch {batch}", "kind": "lightning"},
        ]  # fmt: skip
        for row in out[-5:]:
            row.update(model=big, batch=batch)
    out += [
        {"name": "hand-written fully_shard, batch 16", "kind": "hand",
         "args": ["--fsdp", "--param-dtype", "bf16"], "model": big, "batch": 16},
        {"name": "ours fsdp, batch 16", "kind": "ours", "model": big, "batch": 16,
         "strategy": "fsdp", "fsdp": {"param_dtype": "bf16"}},
    ]  # fmt: skip
    for name, kind, extra in (
        ("hand-written DDP", "hand", {"args": []}),
        ("hand-written no DDP", "hand", {"args": ["--no-ddp"]}),
        ("Lightning single device", "lightning", {}),
        ("ours", "ours", {"train": {}}),
    ):
        out.append({"name": f"tiny GPT: {name}, batch 64", "kind": kind, "model": tiny,
                    "batch": 64, **extra})  # fmt: skip
    return out


def model_args(model: dict) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in model.items()]


def run_hand(row: dict, steps: int, device: str, folder: Path) -> dict:
    out = folder / "summary.json"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    argv += [str(REPO / "bench" / "handwritten_ddp.py"), f"--steps={steps}", f"--device={device}"]
    argv += [f"--batch-size={row['batch']}", *model_args(row["model"]), *row["args"]]
    argv += ["--precision=bf16" if device == "cuda" else "--precision=fp32", f"--out={out}"]
    subprocess.run(argv, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.read_text())


def run_lightning(row: dict, steps: int, device: str, folder: Path) -> dict:
    out = folder / "summary.json"
    argv = [sys.executable, str(REPO / "bench" / "lightning_gpt.py"), f"--steps={steps}"]
    argv += [f"--batch-size={row['batch']}", *model_args(row["model"]), f"--device={device}"]
    subprocess.run([*argv, f"--out={out}"], check=True)
    return json.loads(out.read_text())


def run_ours(row: dict, steps: int, device: str, folder: Path) -> dict:
    spec = {
        "run": {"name": "gpu_bench", "output_dir": str(folder)},
        "launch": {"accelerator": "gpu" if device == "cuda" else "cpu", "devices": 1,
                   "strategy": row.get("strategy", "ddp")},
        "recipe": {"source": str(REPO / "recipes" / "gpt.py"), "model": row["model"],
                   "dataset": {"block_size": row["model"]["block_size"]}},
        "data": {"batch_size": row["batch"], "shuffle": True},
        "optim": {"name": "AdamW", "lr": 1e-3, "kwargs": {"weight_decay": 0.0}},
        "train": {"max_steps": steps, "log_every": steps,
                  "precision": "bf16" if device == "cuda" else "fp32", **row.get("train", {})},
        "checkpoint": {"enabled": False},
        **({"fsdp": row["fsdp"]} if "fsdp" in row else {}),
    }  # fmt: skip
    (folder / "run.yaml").write_text(yaml.safe_dump(spec))
    train = shutil.which("train") or str(Path(sys.executable).parent / "train")
    run_dir = folder / "run"
    subprocess.run([train, "--config", str(folder / "run.yaml"), "--run-dir", str(run_dir)],
                   check=True)  # fmt: skip
    return json.loads((run_dir / "summary.json").read_text())


RUNNERS = {"hand": run_hand, "ours": run_ours, "lightning": run_lightning}


def lightning_installed() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(m) for m in ("lightning", "pytorch_lightning"))


def measure(row: dict, steps: int, warmup: int, device: str) -> dict | None:
    if row["kind"] == "lightning" and not lightning_installed():
        return None
    with tempfile.TemporaryDirectory() as folder:
        summary = RUNNERS[row["kind"]](row, steps, device, Path(folder))
    steady = summary["step_times_s"][warmup:]
    seconds = statistics.median(steady)
    tokens = row["batch"] * row["model"]["block_size"]
    return {
        "ms_per_step": 1000 * seconds,
        "tokens_per_s": tokens / seconds,
        "flops_per_step": flops(row["model"], row["batch"]),
        "max_memory_allocated_gib": summary.get("max_memory_allocated_gib"),
    }


def flops(model: dict, batch: int) -> int:
    recipe = load_recipe(str(REPO / "recipes" / "gpt.py"))
    tokens = torch.zeros(batch, model["block_size"], dtype=torch.long)
    return count_flops(recipe, model, (tokens, tokens))


def table(results: dict[str, dict | None], peak: float | None) -> str:
    lines = ["| setup | ms/step | tokens/s | MFU | peak memory GiB |", "|---|---:|---:|---:|---:|"]
    for name, r in results.items():
        if r is None:
            lines.append(f"| {name} | skipped: not installed | | | |")
            continue
        mfu = (
            f"{100 * r['flops_per_step'] / (r['ms_per_step'] / 1000) / peak:.1f}%" if peak else "-"
        )
        memory = r["max_memory_allocated_gib"]
        memory_text = f"{memory:.1f}" if memory is not None else "-"
        lines.append(
            f"| {name} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | {mfu} | {memory_text} |"
        )
    return "\n".join(lines)


def ratios(results: dict[str, dict | None]) -> dict[str, float]:
    """The issue's targets: compiled ours against the best hand-written loop at batch 32
    (>= 0.98), ours fsdp against fully_shard (>= 0.95), ours against Lightning on the tiny GPT
    (>= 1.0); each a ratio of tokens/s."""

    def rate(name: str) -> float | None:
        r = results.get(name)
        return r["tokens_per_s"] if r else None

    pairs = {
        "compiled_vs_best_handwritten_b32": (
            "ours compiled, batch 32", "hand-written best (no DDP, fused, compiled), batch 32"),
        "fsdp_vs_fully_shard_b16": ("ours fsdp, batch 16", "hand-written fully_shard, batch 16"),
        "tiny_ours_vs_lightning": (
            "tiny GPT: ours, batch 64", "tiny GPT: Lightning single device, batch 64"),
    }  # fmt: skip
    out = {}
    for key, (ours, theirs) in pairs.items():
        a, b = rate(ours), rate(theirs)
        if a and b:
            out[key] = round(a / b, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny rows on CPU")
    parser.add_argument("--only", default="", help="rows whose name holds this text")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    steps = args.steps or (4 if args.smoke else 60)
    warmup = 1 if args.smoke else 15
    chosen = [r for r in rows(args.smoke) if args.only in r["name"]]
    if args.smoke:  # compiling on 2 CPU cores takes minutes: the smoke run skips it
        chosen = [r for r in chosen if "compile" not in r["name"]]
    results = {}
    for row in chosen:
        print(f"== {row['name']}", flush=True)
        results[row["name"]] = measure(row, steps, warmup, device)
    name = torch.cuda.get_device_name() if device == "cuda" else None
    peak = peak_flops(name, "bf16", True)
    print(f"\n{name or 'CPU'}, torch {torch.__version__}, {steps} steps (median after {warmup})")
    print(table(results, peak))
    found = ratios(results)
    print("\n" + "\n".join(f"{k}: x{v}" for k, v in found.items()))
    out = Path(os.environ.get("OUT") or REPO / "bench" / "results") / "gpu_bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"device": name, "torch": torch.__version__, "results": results, "ratios": found}
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
