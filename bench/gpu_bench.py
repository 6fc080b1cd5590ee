"""The launcher against hand-written loops and Lightning on one GPU (issues 17, 32 and 45).

    bash bench/gpu_run.sh                      # on a lent GPU machine (BENCHMARKS.md): every row
    python bench/gpu_bench.py --only "fsdp|tiny GPT"  # rows whose name holds either text
    python bench/gpu_bench.py --diagnose       # the fsdp gap one difference at a time
    python bench/gpu_bench.py --repeat 5 --repeat-only "fully_shard|ours fsdp"
                                               # those rows 5 times, round-robin; the median run
    python bench/gpu_bench.py --smoke          # here, on CPU: every row tiny, to see it works

Rows, on the GPT recipe at 86M parameters (12 x 768, block 1024) in bf16, batches 16 and 32:
hand-written torchrun DDP (eager), ours eager, Lightning (skipped where it is not installed);
at batch 32 also the best hand-written loop (no DDP, fused AdamW, torch.compile) and ours
`train.compile: true`, and both again on GPT-2 small's shape (vocab 50304: 124M with tied
embeddings; the recipe does not tie them), with ours once more with the recipe's cross entropy
left eager (bench/gpt_eager_loss.py); `train.float8` against bf16, compiled, 200 steps, with
the loss every 10 steps; fsdp at batch 16: ours against hand-written `fully_shard`, both
gathering bf16 parameters, without and with clipping at 1.0, and ours at batch 32; the tiny
GPT (0.9M) at batch 64: hand-written DDP, no DDP, Lightning and ours; async against sync
checkpoint saves (bench/checkpoint_blocking.py --gpu); and a batch that does not fit the GPU:
the launcher's warning before the start, then the batch it names, trained.

Each row runs in its own processes; it gives the median ms/step after the warm-up steps,
tokens/s, TFLOP/s, MFU (FLOPs counted once per model and batch with the launcher's
`count_flops`, the same count for every row; the peak from its table) and peak GPU memory
allocated, and for ours the memory the launcher estimated before the start. The rows the
targets compare trace their last steps in their first run (ours with `train.profile`, the
hand-written loop with the same profiler settings), which every row's timing leaves out; the
traces (gzipped), memory snapshots and each run's output go to traces.tar. Prints a markdown
table and the target ratios; writes the JSON to $OUT (the device machine's) or bench/results/,
after every run. A row that fails, or that the time budget (--budget-s) leaves no room for, is
recorded as such and the others go on (the rows the targets compare first), so that one
10-minute device call ends with a table.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import importlib.util
import json
import math
import os
import re
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
import yaml
from compare import CommandFailed, run_command

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from launcher.metrics.step_times import read_sample  # noqa: E402
from launcher.rundir.layout import RunLayout  # noqa: E402
from launcher.worker.flops import count_flops, peak_flops  # noqa: E402
from launcher.worker.recipe import load_recipe  # noqa: E402

RECIPE = REPO / "recipes" / "gpt.py"
BIG = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024}
GPT2_SMALL = {**BIG, "vocab_size": 50304}
TINY = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128}
SMOKE = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}
BEST = "hand-written best (no DDP, fused, compiled)"
# The targets, each a ratio of tokens/s: (ours, theirs, at least).
TARGETS = {
    "compiled_vs_best_handwritten_b32": ("ours compiled, batch 32", f"{BEST}, batch 32", 0.98),
    "fsdp_vs_fully_shard_b16": ("ours fsdp, batch 16", "hand-written fully_shard, batch 16", 0.95),
    "fsdp_clipped_vs_fully_shard_clipped_b16": (
        "ours fsdp, clip 1.0, batch 16", "hand-written fully_shard, clip 1.0, batch 16", 0.95),
    "tiny_ours_vs_lightning": (
        "tiny GPT: ours, batch 64", "tiny GPT: Lightning single device, batch 64", 1.0),
    "gpt2_small_compiled_vs_best_handwritten_b32": (
        "GPT-2 small: ours compiled, batch 32", f"GPT-2 small: {BEST}, batch 32", 0.98),
    "gpt2_small_fused_vs_eager_cross_entropy": (
        "GPT-2 small: ours compiled, batch 32",
        "GPT-2 small: ours compiled, the cross entropy eager, batch 32", 1.0),
    "float8_vs_bf16_compiled_b32": ("float8: ours compiled float8, batch 32, 200 steps",
                                    "float8: ours compiled bf16, batch 32, 200 steps", 1.0),
}  # fmt: skip
TINY_PLAIN = "tiny GPT: hand-written no DDP, batch 64"
EAGER_LOSS = TARGETS["gpt2_small_fused_vs_eager_cross_entropy"][1]
MFU_TARGET = ("GPT-2 small: ours compiled, batch 32", 0.45)
CHECKPOINTS = "checkpoints: async against sync saves, 86M"
FIT = "memory: a batch that does not fit, then the one its warning names"
PROFILED_STEPS = 2  # the last steps of a traced row, left out of its timing
TAR_LIMIT = 15 * 2**20  # the device tool brings back files of up to 16 MiB
# What ours reports of itself (summary.json), kept beside the bench's own figures.
LAUNCHER_KEYS = ("flops_per_step", "tflops_per_device", "mfu", "max_memory_reserved_gib",
                 "dynamo_compilations", "dynamo_compilations_after_warmup",
                 "memory")  # fmt: skip
MEMORY_KEYS = ("max_memory_allocated_gib", "max_memory_reserved_gib")
FSDP_BF16 = {"fsdp": {"param_dtype": "bf16"}, "strategy": "fsdp"}
HAND_FSDP = ["--fsdp", "--param-dtype", "bf16"]
ROW_LIMIT_S = 300  # a hung row is stopped (a compiled row takes about a minute on an H100)


def rows(smoke: bool) -> list[dict]:
    """Every row, in the table's order: name, kind (a runner) and the runner's options."""
    big, tiny = (SMOKE, SMOKE) if smoke else (BIG, TINY)
    gpt2 = {**SMOKE, "vocab_size": 50304} if smoke else GPT2_SMALL
    best = {"name": BEST, "kind": "hand", "args": ["--no-ddp", "--fused", "--compile"]}
    compiled = {"name": "ours compiled", "kind": "ours", "train": {"compile": True}}
    out = []
    for batch in (16, 32):
        for row in (
            {"name": "hand-written DDP", "kind": "hand", "args": []},
            *([best] if batch == 32 else []),
            {"name": "ours", "kind": "ours"},
            *([compiled] if batch == 32 else []),
            {"name": "Lightning", "kind": "lightning"},
        ):
            out.append(
                {**row, "name": f"{row['name']}, batch {batch}", "model": big, "batch": batch}
            )
    for row in (best, compiled):
        out.append({**row, "name": f"GPT-2 small: {row['name']}, batch 32", "model": gpt2,
                    "batch": 32})  # fmt: skip
    # The recipe's fused (compiled) cross entropy against the eager one it replaced (MFU).
    out.append({**compiled, "name": EAGER_LOSS, "model": gpt2, "batch": 32,
                "recipe": REPO / "bench" / "gpt_eager_loss.py"})  # fmt: skip
    # train.float8 against bf16, both compiled: step time and the loss every 10 steps.
    for name, extra in (("bf16", {}), ("float8", {"float8": True})):
        out.append({"name": f"float8: ours compiled {name}, batch 32, 200 steps", "kind": "ours",
                    "model": big, "batch": 32, "steps": 20 if smoke else 200,
                    "train": {"compile": True, "log_every": 10, **extra}})  # fmt: skip
    for name, clip in (("", {}), (", clip 1.0", {"grad_clip_norm": 1.0})):
        clip_args = ["--clip", "1.0"] if clip else []
        out += [
            {"name": f"hand-written fully_shard{name}, batch 16", "kind": "hand",
             "args": HAND_FSDP + clip_args, "model": big, "batch": 16},
            {"name": f"ours fsdp{name}, batch 16", "kind": "ours", "model": big, "batch": 16,
             "train": clip, **FSDP_BF16},
        ]  # fmt: skip
    for name, kind, extra in (
        ("hand-written DDP", "hand", {"args": []}),
        ("hand-written no DDP", "hand", {"args": ["--no-ddp"]}),
        ("Lightning single device", "lightning", {}),
        ("ours", "ours", {}),
    ):
        out.append({"name": f"tiny GPT: {name}, batch 64", "kind": kind, "model": tiny,
                    "batch": 64, **extra})  # fmt: skip
    out.append({"name": CHECKPOINTS, "kind": "checkpoints", "model": big, "batch": 16})
    # The memory estimate against the measured peak: ddp and fsdp at batches 16 and 32 (the
    # others are rows above), and a batch that does not fit, whose warning names one that does.
    out.append({"name": "ours fsdp, batch 32", "kind": "ours", "model": big, "batch": 32,
                **FSDP_BF16})  # fmt: skip
    out.append({"name": FIT, "kind": "fit", "model": big, "batch": 8 if smoke else 384})
    # A diagnosis, not a target: the optimizer's share of the fsdp gap (ours fuses by default).
    out.append({"name": "ours fsdp, optim.fused false, batch 16", "kind": "ours", "model": big,
                "batch": 16, "optim": {"fused": False}, **FSDP_BF16})  # fmt: skip
    compared = {name for ours, theirs, _ in TARGETS.values() for name in (ours, theirs)}
    compared.add(TINY_PLAIN)  # Lightning's rows have no trace: this loop stands in for it
    for row in out:
        row["compared"] = row["name"] in compared
        row["profile"] = row["compared"] and row["kind"] in ("hand", "ours")
    return out


def diagnosis_rows(smoke: bool) -> list[dict]:
    """`--diagnose`: the async checkpoint row, then the fsdp gap taken apart: the hand-written
    `fully_shard` loop with one of the launcher's differences at a time, and ours."""
    big = SMOKE if smoke else BIG
    out = [{"name": CHECKPOINTS, "kind": "checkpoints"}]
    for name, extra in (("", []), (" + fused AdamW", ["--fused"]), (" + meta init", ["--meta-init"]),
                        (" + the launcher's grad norm", ["--launcher-norm"])):  # fmt: skip
        out.append({"name": f"diagnose: hand-written fully_shard{name}, batch 16", "kind": "hand",
                    "args": HAND_FSDP + extra})  # fmt: skip
    out.append({"name": "diagnose: ours fsdp, batch 16", "kind": "ours", **FSDP_BF16})
    return [{**row, "model": big, "batch": 16, "compared": False, "profile": False} for row in out]


def run_order(chosen: list[dict]) -> list[dict]:
    """The rows the targets compare first, then the checkpoints, so that a budget cut leaves
    the others out."""
    return sorted(chosen, key=lambda row: (not row["compared"], row["kind"] != "checkpoints",
                                           "optim" not in row))  # fmt: skip


def model_args(model: dict) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in model.items()]


def run_hand(row: dict, steps: int, device: str, folder: Path, timeout: float) -> dict:
    out = folder / "summary.json"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    argv += [str(REPO / "bench" / "handwritten_ddp.py"), f"--steps={steps}", f"--device={device}"]
    argv += [f"--batch-size={row['batch']}", *model_args(row["model"]), *row["args"]]
    argv += ["--precision=bf16" if device == "cuda" else "--precision=fp32", f"--out={out}"]
    if row["profile"]:
        argv += [f"--profile-steps={PROFILED_STEPS}", f"--trace={folder / 'trace.json'}"]
    _, wall = run_command(
        argv, {**os.environ, "OMP_NUM_THREADS": "1"}, timeout, folder / "output.log"
    )
    return {**json.loads(out.read_text()), "wall_s": wall}


def run_lightning(row: dict, steps: int, device: str, folder: Path, timeout: float) -> dict:
    out = folder / "summary.json"
    argv = [sys.executable, str(REPO / "bench" / "lightning_gpt.py"), f"--steps={steps}"]
    argv += [f"--batch-size={row['batch']}", *model_args(row["model"]), f"--device={device}"]
    _, wall = run_command([*argv, f"--out={out}"], dict(os.environ), timeout, folder / "output.log")
    return {**json.loads(out.read_text()), "wall_s": wall}


def run_ours(row: dict, steps: int, device: str, folder: Path, timeout: float) -> dict:
    steps = row.get("steps", steps)
    train = {
        "max_steps": steps,
        "log_every": steps,
        "precision": "bf16" if device == "cuda" else "fp32",
        **row.get("train", {}),
    }
    if row["profile"]:
        train["profile"] = {"start_step": steps - PROFILED_STEPS + 1, "steps": PROFILED_STEPS}
    spec = {
        "run": {"name": "gpu_bench", "output_dir": str(folder)},
        "launch": {"accelerator": "gpu" if device == "cuda" else "cpu", "devices": 1,
                   "strategy": row.get("strategy", "ddp")},
        "recipe": {"source": str(row.get("recipe", RECIPE)), "model": row["model"],
                   "dataset": {"block_size": row["model"]["block_size"]}},
        "data": {"batch_size": row["batch"], "shuffle": True},
        "optim": {"name": "AdamW", "lr": 1e-3, "kwargs": {"weight_decay": 0.0},
                  **row.get("optim", {})},
        "train": train,
        "checkpoint": {"enabled": False},
        **({"fsdp": row["fsdp"]} if "fsdp" in row else {}),
    }  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run.yaml").write_text(yaml.safe_dump(spec))
    run_dir = folder / "run"
    argv = [TRAIN, "--config", str(folder / "run.yaml"), "--run-dir", str(run_dir)]
    _, wall = run_command(argv, dict(os.environ), timeout, folder / "output.log")
    for found in (run_dir / "profile").glob("*"):
        found.rename(folder / ("trace.json" if found.suffix == ".json" else found.name))
    layout = RunLayout(run_dir)
    summary = json.loads(layout.summary.read_text())
    logged = [json.loads(line) for line in layout.metrics.read_text().splitlines() if line]
    losses = {record["step"]: round(record["loss"], 4) for record in logged if "loss" in record}
    # Every step's time (a sample of them past 1,024 steps), as the Lightning rows list them.
    return {**summary, "step_times_s": read_sample(layout.step_times), "wall_s": wall,
            "losses": losses}  # fmt: skip


def run_checkpoints(row: dict, steps: int, device: str, folder: Path, timeout: float) -> dict:
    out = folder / "checkpoint_blocking.json"
    argv = [sys.executable, str(REPO / "bench" / "checkpoint_blocking.py"), f"--out={out}"]
    argv += ["--gpu"] if device == "cuda" else ["--smoke"]
    run_command(argv, dict(os.environ), timeout, log=folder / "output.log")
    return json.loads(out.read_text())


def run_fit(row: dict, steps: int, device: str, folder: Path, timeout: float) -> dict:
    """A launch whose batch does not fit the GPU: its warning before the start, and the
    layout the warning names, trained for a few steps, with its estimate and its peak."""
    too_big = {**row, "kind": "ours", "profile": False}
    try:
        run_ours(too_big, 3, device, folder / "too_big", timeout)
        first = {"finished": True}  # the estimate was wrong: it fit
    except CommandFailed as err:
        first = {"failed": failure_reason(str(err))}
    output = (folder / "too_big" / "output.log").read_text()
    warning = next((line.strip() for line in output.splitlines() if "memory: " in line), None)
    named = re.search(r"data\.batch_size: (\d+)", warning or "")
    out = {"batch": row["batch"], "warning": warning, "first_run": first}
    if named:
        fits = {**too_big, "batch": int(named.group(1))}
        summary = run_ours(fits, 6, device, folder / "named", timeout)
        out["named_batch"] = fits["batch"]
        out["named_run"] = {key: summary.get(key) for key in ("memory", *MEMORY_KEYS)}
    return out


RUNNERS = {
    "hand": run_hand, "ours": run_ours, "lightning": run_lightning, "checkpoints": run_checkpoints,
    "fit": run_fit,
}  # fmt: skip
TRAIN = shutil.which("train") or str(Path(sys.executable).parent / "train")


def lightning_version() -> str | None:
    for module in ("lightning", "pytorch_lightning"):
        if importlib.util.find_spec(module):
            return f"{module} {__import__(module).__version__}"
    return None


@functools.cache
def flops_per_step(model: tuple[tuple[str, int], ...], batch: int) -> int:
    """One forward and backward of the recipe's model at this batch, counted on meta."""
    tokens = torch.zeros(batch, dict(model)["block_size"], dtype=torch.long)
    recipe = load_recipe(str(RECIPE))
    with torch.device("meta"):
        meta_model = recipe.build_model(**dict(model))
    return count_flops(recipe, meta_model, (tokens, tokens))


def figures(row: dict, summary: dict, warmup: int, peak: float | None) -> dict:
    if row["kind"] in ("checkpoints", "fit"):
        return summary
    timed = summary["step_times_s"][warmup:-PROFILED_STEPS]  # every row alike, traced or not
    seconds = statistics.median(timed)
    flops = flops_per_step(tuple(row["model"].items()), row["batch"])
    out = {
        "ms_per_step": round(1000 * seconds, 3),
        "tokens_per_s": round(row["batch"] * row["model"]["block_size"] / seconds),
        "tflops": round(flops / seconds / 1e12, 4),
        "mfu": round(flops / seconds / peak, 4) if peak else None,
        "flops_per_step": flops,
        "max_memory_allocated_gib": summary.get("max_memory_allocated_gib"),
        "steps_timed": len(timed),
        "wall_s": round(summary["wall_s"], 1),  # the whole command: start-up, compile, traces
    }
    reported = {key: summary[key] for key in LAUNCHER_KEYS if summary.get(key) is not None}
    if len(summary.get("losses", {})) > 1:  # a loss curve: the rows that log every 10 steps
        out["losses"] = summary["losses"]
    return {**out, **({"launcher_reported": reported} if reported else {})}


def measure(row: dict, args: argparse.Namespace, timeout: float, *, peak: float | None) -> dict:
    """The row's figures, or why it has none ({"skipped": ...} or {"failed": ...})."""
    if row["kind"] == "lightning" and not lightning_version():
        return {"skipped": "Lightning not installed"}
    try:
        with tempfile.TemporaryDirectory(prefix="gpu-bench-") as folder:
            runner = RUNNERS[row["kind"]]
            try:
                summary = runner(row, args.steps, args.device, Path(folder), timeout)
            finally:
                found = keep_artifacts(
                    Path(folder), args.traces, slug(row["name"]), args.out.parent / "traces.tar"
                )
    except CommandFailed as err:
        print(err, flush=True)
        return {"failed": failure_reason(str(err)), "artifacts": found}
    return {**figures(row, summary, args.warmup, peak), "artifacts": found}


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


def keep_artifacts(folder: Path, traces: Path, name: str, tar_path: Path) -> dict[str, int]:
    """The row's output, trace (gzipped) and CUDA memory snapshot, into traces.tar beside the
    JSON (the device tool brings back a few files of at most 16 MiB, not folders); their
    names and sizes, as the run wrote them."""
    kept = traces / name
    kept.mkdir(parents=True, exist_ok=True)
    found = {}
    for path in sorted(folder.glob("*")):
        if path.name == "trace.json":
            with path.open("rb") as src, gzip.open(kept / "trace.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
        elif path.name == "output.log" or path.suffix == ".pickle":
            shutil.copy(path, kept / path.name)
        else:
            continue
        found[path.name] = path.stat().st_size
    if sum(f.stat().st_size for f in traces.rglob("*") if f.is_file()) > TAR_LIMIT:
        for big in (kept / "trace.json.gz", *kept.glob("*.pickle")):
            big.unlink(missing_ok=True)  # over what comes back: the figures and logs matter more
    with tarfile.open(tar_path, "w") as tar:
        tar.add(traces, arcname=traces.name)
    return found


def failure_reason(message: str) -> str:
    """'exit code 1' or 'timed out after N s', and the last error line of the output's tail."""
    lines = message.splitlines()
    errors = [
        line.strip(" │")  # rich's traceback box
        for line in lines[1:]
        if re.search(r"\w(Error|Exception)\b", line) and "ChildFailedError" not in line
    ]
    how = lines[0].split(": ", 1)[0]
    return f"{how}; {errors[-1]}"[:160] if errors else how


def table(names: list[str], results: dict[str, dict]) -> str:
    lines = [
        "| setup | ms/step | tokens/s | TFLOP/s | MFU | peak memory GiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        r = results[name]
        if "ms_per_step" not in r:
            reason = f"skipped: {r['skipped']}" if "skipped" in r else f"failed: {r['failed']}"
            lines.append(f"| {name} | {reason} | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        memory = r["max_memory_allocated_gib"]
        lines.append(
            f"| {name} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,} | {r['tflops']:.3g} | "
            f"{mfu} | {'-' if memory is None else f'{memory:.2f}'} |"
        )
    return "\n".join(lines)


def ratios(results: dict[str, dict]) -> dict[str, dict]:
    """Each target's ratio of tokens/s, where both of its rows ran."""
    out = {}
    for key, (ours, theirs, target) in TARGETS.items():
        a, b = (results.get(name, {}).get("tokens_per_s") for name in (ours, theirs))
        if a and b:
            out[key] = {"ratio": round(a / b, 3), "target": target, "met": a / b >= target}
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny rows on CPU, 4 steps each")
    parser.add_argument("--only", default="", help="rows whose name holds this text (a|b: either)")
    parser.add_argument("--diagnose", action="store_true", help="the fsdp gap taken apart")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each row, round-robin")
    parser.add_argument("--repeat-only", default="", help="repeat only rows holding this (a|b)")
    parser.add_argument("--steps", type=int, help="steps per row (50; 4 with --smoke)")
    parser.add_argument("--warmup", type=int, help="first steps left out (10; 1 with --smoke)")
    parser.add_argument("--budget-s", type=float, help="start no row after this (520 on GPU)")
    parser.add_argument("--out", type=Path, help="the JSON (default $OUT or bench/results/)")
    args = parser.parse_args()
    args.device = "cpu" if args.smoke else "cuda"
    args.steps = args.steps or (4 if args.smoke else 50)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 10)
    args.budget_s = args.budget_s or (math.inf if args.smoke else 520.0)
    args.out = args.out or Path(os.environ.get("OUT") or REPO / "bench/results") / "gpu_bench.json"
    args.traces = Path(tempfile.mkdtemp(prefix="gpu-bench-kept-")) / "traces"
    if args.steps <= args.warmup + PROFILED_STEPS:
        parser.error(f"--steps ({args.steps}) must exceed --warmup + {PROFILED_STEPS}")
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device here: --smoke runs every row tiny on CPU")
    return args


def main() -> None:
    args = parse_args()
    name = torch.cuda.get_device_name() if args.device == "cuda" else None
    peak = peak_flops(name, "bf16" if name else "fp32", True)
    every = diagnosis_rows(args.smoke) if args.diagnose else rows(args.smoke)
    chosen = [row for row in every if named(row, args.only)]
    record = {
        "device": name or "CPU", "peak_flops": peak, "torch": torch.__version__,
        "lightning": lightning_version(), "steps": args.steps, "warmup": args.warmup,
        "repeat": args.repeat,
        "models": {"big": SMOKE if args.smoke else BIG, "tiny": SMOKE if args.smoke else TINY},
        "results": {}, "ratios": {},
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    run_rows(run_order(chosen), args, record)
    report([row["name"] for row in chosen], record, args)


def named(row: dict, alternatives: str) -> bool:
    """Whether the row's name holds one of `a|b|...` (every row for "")."""
    return any(text in row["name"] for text in alternatives.split("|"))


def run_rows(order: list[dict], args: argparse.Namespace, record: dict) -> None:
    """Each row `--repeat` times (those `--repeat-only` names), round-robin (a host-bound
    row's step time moves by 15% between two processes of the same loop); a row's figures
    are those of its median run. Only the first round traces. The JSON is rewritten after
    every run."""
    started = time.monotonic()
    results, runs = record["results"], {row["name"]: [] for row in order}
    for round_ in range(args.repeat):
        for row in order:
            if round_ and not named(row, args.repeat_only):
                continue
            row = {**row, "profile": row["profile"] and not round_}
            left = args.budget_s - (time.monotonic() - started)
            print(f"== {row['name']} ({time.monotonic() - started:.0f} s in)", flush=True)
            if left < 20:
                runs[row["name"]].append({"skipped": f"out of the {args.budget_s:.0f} s budget"})
            else:
                measured = measure(row, args, min(left, ROW_LIMIT_S), peak=record["peak_flops"])
                runs[row["name"]].append(measured)
            results[row["name"]] = median_run(runs[row["name"]])
            record["ratios"] = ratios(results)
            args.out.write_text(json.dumps(record, indent=1))


def median_run(runs: list[dict]) -> dict:
    """The run with the median step time, with every run's; else the first run's failure."""
    timed = sorted((r for r in runs if "ms_per_step" in r), key=lambda r: r["ms_per_step"])
    if not timed:
        return runs[0]
    middle = timed[(len(timed) - 1) // 2]
    return {**middle, "ms_per_step_runs": [r.get("ms_per_step") for r in runs]}


def memory_lines(results: dict[str, dict]) -> list[str]:
    """The launcher's estimate of each row's peak against the peak its run measured, and the
    fit check's warning and the run of the layout it named."""
    lines = []
    for name, r in results.items():
        memory = r.get("launcher_reported", {}).get("memory") or {}
        measured = r.get("max_memory_allocated_gib")
        if "estimated_peak" in memory and measured:
            estimate = memory["estimated_peak"] / 2**30
            lines.append(f"{name}: estimated peak {estimate:.2f} GiB, measured (allocated) "
                         f"{measured:.2f} GiB: x{estimate / measured:.3f}")  # fmt: skip
    if FIT in results:
        lines.append(f"{FIT}: {json.dumps(results[FIT])}")
    return lines


def report(names: list[str], record: dict, args: argparse.Namespace) -> None:
    results, peak = record["results"], record["peak_flops"]
    print(f"\n{record['device']}, torch {record['torch']}, {record['lightning'] or 'no Lightning'}")
    print(f"{args.steps} steps per row, median after the first {args.warmup}; peak {peak or '-'}")
    print(table([n for n in names if n in results and n not in (CHECKPOINTS, FIT)], results))
    for key, r in record["ratios"].items():
        print(f"{key}: x{r['ratio']} (target >= {r['target']}: {'met' if r['met'] else 'MISSED'})")
    name, target = MFU_TARGET
    if results.get(name, {}).get("mfu") is not None:
        mfu = results[name]["mfu"]
        print(f"{name}: MFU {100 * mfu:.1f}% (target >= {100 * target:.0f}%: "
              f"{'met' if mfu >= target else 'MISSED'})")  # fmt: skip
    if "async_over_sync" in results.get(CHECKPOINTS, {}):
        saves = results[CHECKPOINTS]
        print(f"{CHECKPOINTS}: async blocks {100 * saves['async_over_sync']:.1f}% of a sync save "
              f"(sync {saves['sync']['blocked_ms_median']:.0f} ms, async "
              f"{saves['async']['blocked_ms_median']:.0f} ms; target < 10%)")  # fmt: skip
    elif CHECKPOINTS in results:
        print(f"{CHECKPOINTS}: {results[CHECKPOINTS]}")
    for line in memory_lines(results):
        print(line)
    if args.smoke:
        print("(smoke: tiny rows, a few CPU steps; the figures show it runs, not how fast)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
