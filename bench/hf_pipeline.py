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

import statistics
import sys
from functools import partial
from pathlib import Path

# Imported first: it puts the repository on sys.path, for the launcher's imports below.
import hf_runs
from hf_runs import CLEAN_SHARE, COMPARED_STEPS, REPO

from launcher.config.loader import load_cli_spec

CONFIG = REPO / "bench/hf_pp_bench.yaml"
PEER = "bench/handwritten_hf_pipeline.py"


def peer_args(config: Path) -> list[str]:
    """bench/handwritten_hf_pipeline.py's arguments for the run `config` describes, read
    through the launcher's own spec loader as `train` reads it."""
    spec = load_cli_spec(config)
    model, dataset = spec.recipe.model, spec.recipe.dataset
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
    hf_runs.check_fixed(config, fixed)
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
    return hf_runs.as_argv(values)


def ours_run(train: str, run_dir: Path) -> dict:
    """One launcher run: its measure, step to step, and every step's loss."""
    measured, losses, _ = hf_runs.run_ours(train, CONFIG, run_dir)
    return {**measured, "losses": losses}


def peer_run(args: list[str], run_dir: Path) -> dict:
    """One hand-written run: its measure, step to step, and every step's loss."""
    measured, summary = hf_runs.run_peer(PEER, args, run_dir)
    return {**measured, "losses": summary["losses"]}


def run_pairs(train: str, repeats: int, quiet: float, max_wait_s: float) -> dict[str, list[dict]]:
    """`repeats` runs of each side, alternating which goes first (ABBA); each pair after
    other programs have left the machine `quiet` (bench/machine_load.py), or `max_wait_s`."""
    runners = {"peer": partial(peer_run, peer_args(CONFIG)), "ours": partial(ours_run, train)}
    rounds = hf_runs.run_rounds(runners, repeats, quiet, max_wait_s, prefix="bench-hf-pp")
    return {name: [found[name] for found in rounds] for name in runners}


def loss_gaps(runs: dict[str, list[dict]]) -> dict[str, float]:
    """The largest difference of a step's loss between the two sides, over every pair: over
    the first `COMPARED_STEPS` steps, and over every step."""
    pairs = zip(runs["ours"], runs["peer"], strict=True)
    return hf_runs.loss_gap([(ours["losses"], peer["losses"]) for ours, peer in pairs])


METRICS = ("steady_ms_per_step", "period_ms_per_step", "wall_s")


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


def main() -> int:
    args = hf_runs.driver_args(__doc__, repeats=4, repeats_help="runs of each side", unit="pair")
    runs = hf_runs.collect(lambda: run_pairs(args.train, args.repeats, args.quiet, args.max_wait))
    if runs is None:
        return 1
    result = summarise(runs)
    head = {"config": str(CONFIG.relative_to(REPO)), "peer_args": peer_args(CONFIG)}
    hf_runs.publish(
        "hf_pp_vs_transformers.json", markdown_table(result), args, head, {"runs": runs, **result}
    )
    return hf_runs.losses_agree(
        result["loss_gaps"][f"max_abs_first_{COMPARED_STEPS}_steps"],
        "losses differ by {:.2e} over the first steps: different work",
    )


if __name__ == "__main__":
    sys.exit(main())
