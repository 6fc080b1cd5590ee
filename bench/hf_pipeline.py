"""Pipeline parallelism on a stock Hugging Face model (issue 53): ours against `transformers`'
own pipeline split with torch's schedule by hand, on 2 CPU processes (gloo). `make bench`
runs it.

    python bench/hf_pipeline.py [--train .venv/bin/train] [--repeats 4] [--quiet 0.1]

Ours is `train --config bench/hf_pp_bench.yaml` (recipes/hf_causal_lm.py's Llama, `parallel.pp:
2`, GPipe, 2 micro-batches); the peer bench/handwritten_hf_pipeline.py, whose arguments are
read from that YAML: the same model, initial weights, batches, AdamW, clipping and steps, each
rank's model pruned by `apply_pipeline_parallelism` and run by `PipelineStage` and
`ScheduleGPipe`. The two alternate (ABBA: `--repeats` pairs); a pair's ratio is ours over the
peer's steady-state ms/step (bench/compare.py's `measure`: the median after the warm-up steps),
and the table shows the median and range of the pairs' ratios. The launcher's own step time
leaves out what it does between steps, so a second row compares step to step (ours: the
times of its per-step log lines). Both log every step's loss: they must agree to float32
rounding over the first steps (`LOSS_TOLERANCE`), or the two ran different work.

Another program on this 2-core machine moves a step by tens of percent, so each pair waits
(up to `--max-wait` seconds) until others use less than `--quiet` of the cores, and each run
records the share they used meanwhile (bench/machine_load.py); the table repeats its rows for
the clean pairs.

Prints one table and writes bench/results/hf_pp_vs_transformers.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from compare import CommandFailed, measure, run_command  # noqa: E402
from machine_load import others_share, wait_until_quiet  # noqa: E402

from launcher.config.loader import load_cli_spec  # noqa: E402
from launcher.rundir.layout import RunLayout  # noqa: E402

CONFIG = REPO / "bench/hf_pp_bench.yaml"
RESULTS = REPO / "bench/results"
# Same weights and batches agree to float32 rounding (a few 1e-7) for the first steps; a
# different initial weight or batch moves the first loss by 1e-2 or more. Later steps drift
# apart as the rounding of two sums of the gradient norm feeds AdamW.
LOSS_TOLERANCE = 1e-5
COMPARED_STEPS = 10


def peer_args(config: Path) -> list[str]:
    """bench/handwritten_hf_pipeline.py's arguments for the run `config` describes, read
    through the launcher's own spec loader as `train` reads it."""
    spec = load_cli_spec(config)
    model, dataset = spec.recipe.model, spec.recipe.dataset
    # The hand-written loop hard-codes these; a YAML that strays from them is another run.
    fixed = {
        "optim.name": (spec.optim.name, "AdamW"),
        "optim.kwargs": (spec.optim.kwargs, {"weight_decay": 0.0}),
        "parallel.pp": (spec.parallel.pp, 2),
        "parallel.pp_schedule": (spec.parallel.pp_schedule, "GPipe"),
        "launch.devices": (spec.launch.devices, 2),
        "recipe.model.family": (model.get("family"), "llama"),
        "recipe.dataset": (sorted(dataset), ["seq_len", "vocab_size"]),
        "recipe.dataset.vocab_size": (dataset["vocab_size"], model["vocab_size"]),
        "optim.schedule": (spec.optim.schedule, "constant"),
        "data.shuffle": (spec.data.shuffle, True),
        "train.log_every": (spec.train.log_every, 1),
    }
    for key, (value, expected) in fixed.items():
        if value != expected:
            sys.exit(f"{config}: {key} is {value!r}; the hand-written loop runs {expected!r}")
    values = {
        "--steps": spec.train.max_steps,
        "--batch-size": spec.data.batch_size,
        "--microbatches": spec.parallel.pp_microbatches or spec.parallel.pp,
        "--lr": spec.optim.lr,
        "--clip": spec.train.grad_clip_norm,
        "--seed": spec.run.seed,
        "--vocab-size": model["vocab_size"],
        "--hidden": model["hidden"],
        "--layers": model["layers"],
        "--heads": model["heads"],
        "--kv-heads": model["kv_heads"],
        "--seq-len": dataset["seq_len"],
    }
    return [str(x) for pair in values.items() for x in pair]


def run_ours(train: str, run_dir: Path) -> dict:
    """One launcher run: its measure, and every step's loss from its metrics."""
    argv = [*shlex.split(train), "--config", str(CONFIG), "--run-dir", str(run_dir)]
    start, wall = run_command(argv, dict(os.environ), timeout=600)
    layout = RunLayout(run_dir)
    records = [json.loads(line) for line in layout.metrics.read_text().splitlines()]
    steps = [r for r in records if "loss" in r and "step" in r]
    measured = measure(layout.summary, start, wall)
    # The launcher's step time leaves out what follows a step (its log line, the stop
    # check's all-reduce); the times its lines were logged at, one a step, keep it.
    times = [r["time"] for r in steps]
    periods = [later - earlier for earlier, later in itertools.pairwise(times)]
    measured["period_ms_per_step"] = steady_ms(periods)
    return {**measured, "losses": [r["loss"] for r in steps]}


def run_peer(args: list[str], run_dir: Path) -> dict:
    """One hand-written run (torchrun, OMP_NUM_THREADS=1 as torchrun's default)."""
    out = run_dir / "summary.json"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    argv += ["--nproc-per-node", "2", "bench/handwritten_hf_pipeline.py", *args]
    start, wall = run_command(
        [*argv, "--out", str(out)], {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600
    )
    measured = measure(out, start, wall)
    # Its timed step is the whole loop: nothing runs between two steps.
    summary = json.loads(out.read_text())
    measured["period_ms_per_step"] = steady_ms(summary["step_times_s"][1:])
    return {**measured, "losses": summary["losses"]}


def steady_ms(seconds: list[float]) -> float:
    """The median, in ms, of a step's seconds after the warm-up steps that bench/compare.py's
    `measure` leaves out; `seconds` from step 2 on (the period of step 1 is unknown)."""
    skip = max(5, (len(seconds) + 1) // 10)
    return 1000 * statistics.median(seconds[skip:])


def run_pairs(train: str, repeats: int, quiet: float, max_wait_s: float) -> dict[str, list[dict]]:
    """`repeats` runs of each side, alternating which goes first (ABBA); each pair after
    other programs have left the machine `quiet` (bench/machine_load.py), or `max_wait_s`."""
    args = peer_args(CONFIG)
    runners = {"peer": lambda d: run_peer(args, d), "ours": lambda d: run_ours(train, d)}
    runs: dict[str, list[dict]] = {name: [] for name in runners}
    for repeat in range(repeats):
        order = list(runners) if repeat % 2 == 0 else list(reversed(runners))
        before = wait_until_quiet(quiet, max_wait_s)
        for name in order:
            prefix = f"bench-hf-pp-{name}-"
            with tempfile.TemporaryDirectory(prefix=prefix) as run_dir, others_share() as load:
                measured = runners[name](Path(run_dir))
            runs[name].append({**measured, **load, "others_cpu_share_before": before})
            shown = {k: v for k, v in runs[name][-1].items() if k != "losses"}
            print(f"repeat {repeat + 1}/{repeats} {name}: {shown}", flush=True)
    return runs


def loss_gaps(runs: dict[str, list[dict]]) -> dict[str, float]:
    """The largest difference of a step's loss between the two sides, over every pair: over
    the first `COMPARED_STEPS` steps, and over every step."""
    pairs = list(zip(runs["ours"], runs["peer"], strict=True))
    diffs = [[abs(a - b) for a, b in zip(o["losses"], p["losses"], strict=True)] for o, p in pairs]
    return {
        f"max_abs_first_{COMPARED_STEPS}_steps": max(max(d[:COMPARED_STEPS]) for d in diffs),
        "max_abs_all_steps": max(max(d) for d in diffs),
    }


METRICS = ("steady_ms_per_step", "period_ms_per_step", "wall_s")
# A pair is clean where other programs kept less than this share of the cores busy during
# both of its runs: a few percent moves a step by about as much.
CLEAN_SHARE = 0.05


def summarise(runs: dict[str, list[dict]]) -> dict:
    """For every pair, and for the clean pairs alone: how many, each side's medians, and each
    pair's ratios, ours over the peer's, of the step time (`steady_ms_per_step`) and of the
    whole loop's period (`period_ms_per_step`)."""
    pairs = list(zip(runs["ours"], runs["peer"], strict=True))
    clean = [
        (ours, peer)
        for ours, peer in pairs
        if max(ours["others_cpu_share"], peer["others_cpu_share"]) < CLEAN_SHARE
    ]
    result = {name: of_pairs(chosen) for name, chosen in (("all", pairs), ("clean", clean))}
    return {**result, "loss_gaps": loss_gaps(runs)}


def of_pairs(pairs: list[tuple[dict, dict]]) -> dict:
    if not pairs:
        return {"pairs": 0}
    sides = {"ours": [ours for ours, _ in pairs], "peer": [peer for _, peer in pairs]}
    return {
        "pairs": len(pairs),
        "median": {
            side: {m: statistics.median(r[m] for r in rs) for m in METRICS}
            for side, rs in sides.items()
        },
        "pair_ratios": {
            metric: [ours[metric] / peer[metric] for ours, peer in pairs] for metric in METRICS[:2]
        },
    }


ROWS = {
    "steady_ms_per_step": "step time (the launcher's own measure)",
    "period_ms_per_step": "step to step (ours: its log lines' times)",
}


def markdown_table(result: dict) -> str:
    """A row for each measure of the step, over every pair and over the clean pairs; the
    losses' agreement below them."""
    rows = [
        "| Llama, pp 2, GPipe, 2 micro-batches, 2 processes | pairs | peer ms/step "
        "| ours ms/step | ours / peer: median of pairs (range) |",
        "|---|---:|---:|---:|---:|",
    ]
    for which, label_pairs in (("all", "every pair"), ("clean", "clean pairs")):
        chosen = result[which]
        for metric, label in ROWS.items() if chosen["pairs"] else ():
            ratios = chosen["pair_ratios"][metric]
            peer, ours = (chosen["median"][side][metric] for side in ("peer", "ours"))
            rows.append(
                f"| {label}, {label_pairs} | {chosen['pairs']} | {peer:.1f} | {ours:.1f} "
                f"| x{statistics.median(ratios):.3f} (x{min(ratios):.3f} to "
                f"x{max(ratios):.3f}) |"
            )
    gaps = result["loss_gaps"]
    first = gaps[f"max_abs_first_{COMPARED_STEPS}_steps"]
    rows.append(
        f"\nLoss, ours against the peer, step by step: at most {first:.1e} apart over the "
        f"first {COMPARED_STEPS} steps, {gaps['max_abs_all_steps']:.1e} over every step. "
        f"Clean pairs: other programs used under {CLEAN_SHARE:.0%} of the cores in both runs."
    )
    return "\n".join(rows)


def machine() -> dict[str, object]:
    """What the numbers were measured on and with."""
    import platform

    import torch
    import transformers

    return {
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", default=str(REPO / ".venv/bin/train"), help="ours")
    parser.add_argument("--repeats", type=int, default=4, help="runs of each side")
    parser.add_argument(
        "--quiet", type=float, default=0.1, help="start a pair below this share of others' CPU"
    )
    parser.add_argument("--max-wait", type=float, default=60, help="seconds a pair, --quiet")
    args = parser.parse_args()
    # The first process to import torch would otherwise pay for a cold page cache.
    subprocess.run([sys.executable, "-c", "import transformers, torch.distributed.run"], check=True)
    try:
        runs = run_pairs(args.train, args.repeats, args.quiet, args.max_wait)
    except CommandFailed as err:
        print(f"benchmark aborted: {err}", file=sys.stderr)
        return 1
    result = summarise(runs)
    table = markdown_table(result)
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {"config": str(CONFIG.relative_to(REPO)), "peer_args": peer_args(CONFIG)}
    record |= {"machine": machine(), "quiet": args.quiet, "max_wait_s": args.max_wait}
    record |= {"repeats": args.repeats, "runs": runs, **result, "table_markdown": table}
    out = RESULTS / "hf_pp_vs_transformers.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    first = result["loss_gaps"][f"max_abs_first_{COMPARED_STEPS}_steps"]
    if first > LOSS_TOLERANCE:
        print(f"losses differ by {first:.2e} over the first steps: different work", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
