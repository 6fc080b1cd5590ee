"""Expert parallelism on a stock Hugging Face mixture of experts (issue 55): ours against
`transformers`' own expert parallelism and FSDP2 by hand, and against ours as ddp and as fsdp
without experts spread, on 2 CPU processes (gloo). `make bench` runs it.

    python bench/hf_experts.py [--train .venv/bin/train] [--repeats 3] [--quiet 0.1]

Four runs of the same training, in turn:

- `ep`: `train --config bench/hf_ep_bench.yaml` (recipes/hf_causal_lm.py's Qwen3-MoE,
  `parallel.ep: 2`: each process holds half of every layer's experts, the rest FSDP-sharded);
- `peer`: bench/handwritten_hf_ep.py under torchrun, whose arguments are read from that YAML:
  the same model, initial weights, batches, AdamW, clipping and steps, laid out by
  `apply_expert_parallelism` and `fully_shard` by hand;
- `ddp`: the same YAML with `launch.strategy=ddp parallel.ep=1` (every expert in every process);
- `fsdp`: with `parallel.ep=1` (every weight, experts too, sharded over both processes).

A repeat runs the four in turn, the order reversed every other repeat (ABBA); each run's
ratio is its steady-state ms/step (bench/compare.py's `measure`) over `ep`'s in the same
repeat, and the table shows the median and range of those ratios. Memory is rank 0's: its peak
RSS, and its bytes of parameters, gradients and optimizer state (its shards). `ep` and the
peer log every step's loss: they must agree to float32 rounding over the first steps
(`LOSS_TOLERANCE`), or the two ran different work.

Each repeat waits (up to `--max-wait` seconds) until other programs use less than `--quiet`
of the cores, and each run records the share they used meanwhile (bench/machine_load.py); the
table is repeated for the clean repeats where some were not.

Prints the table and writes bench/results/hf_experts.json.
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

CONFIG = REPO / "bench/hf_ep_bench.yaml"
PEER = "bench/handwritten_hf_ep.py"
# The launcher's runs besides `ep`: key=value overrides of the same YAML.
OVERRIDES = {
    "ep": [],
    "ddp": ["launch.strategy=ddp", "parallel.ep=1"],
    "fsdp": ["parallel.ep=1"],
}
RUNS = ("ep", "peer", "ddp", "fsdp")  # a repeat's order; reversed every other repeat
LABELS = {
    "ep": "ep 2 (ours)",
    "peer": "transformers by hand (peer)",
    "ddp": "ddp (ours)",
    "fsdp": "fsdp without ep (ours)",
}


def peer_args(config: Path) -> list[str]:
    """bench/handwritten_hf_ep.py's arguments for the run `config` describes, read through
    the launcher's own spec loader as `train` reads it."""
    spec = load_cli_spec(config)
    model, dataset = spec.recipe.model, spec.recipe.dataset
    fixed = {
        "optim.name": (spec.optim.name, "AdamW"),
        "optim.kwargs": (spec.optim.kwargs, {"weight_decay": 0.0}),
        "optim.schedule": (spec.optim.schedule, "constant"),
        "launch.strategy": (spec.launch.strategy, "fsdp"),
        "launch.devices": (spec.launch.devices, 2),
        "parallel.ep": (spec.parallel.ep, 2),
        "recipe.model.family": (model.get("family"), "qwen3_moe"),
        "recipe.dataset": (sorted(dataset), ["seq_len", "vocab_size"]),
        "recipe.dataset.vocab_size": (dataset["vocab_size"], model["vocab_size"]),
        "data.shuffle": (spec.data.shuffle, True),
        "data.drop_last": (spec.data.drop_last, True),
        "train.grad_accum_steps": (spec.train.grad_accum_steps, 1),
        "train.log_every": (spec.train.log_every, 1),
    }
    hf_runs.check_fixed(config, fixed)
    values = {
        "--steps": spec.train.max_steps,
        "--batch-size": spec.data.batch_size,
        "--lr": spec.optim.lr,
        "--clip": spec.train.grad_clip_norm,
        "--seed": spec.run.seed,
        "--seq-len": dataset["seq_len"],
    }
    names = ("vocab_size", "hidden", "layers", "heads", "kv_heads", "experts", "top_k")
    values |= {"--" + name.replace("_", "-"): model[name] for name in names}
    values["--aux-loss-coef"] = model["aux_loss_coef"]
    return hf_runs.as_argv(values)


def ours_run(train: str, overrides: list[str], run_dir: Path) -> dict:
    """One launcher run: its measure, step to step, memory, and every step's loss."""
    measured, losses, summary = hf_runs.run_ours(train, CONFIG, run_dir, overrides)
    memory = summary["memory"]
    return {
        **measured,
        "peak_rss_bytes": memory["peak_rss"],
        "state_bytes": memory["params"] + memory["grads"] + memory["optimizer"],
        "losses": losses,
    }


def peer_run(args: list[str], run_dir: Path) -> dict:
    """One hand-written run: its measure, step to step, rank 0's memory, and every step's
    loss."""
    measured, summary = hf_runs.run_peer(PEER, args, run_dir)
    return {
        **measured,
        "peak_rss_bytes": summary["peak_rss_bytes"],
        "state_bytes": sum(summary["state_bytes"].values()),
        "losses": summary["losses"],
    }


def runners(train: str) -> dict[str, hf_runs.Runner]:
    """Each run by name, given its run folder."""
    runs = {name: partial(ours_run, train, overrides) for name, overrides in OVERRIDES.items()}
    return {**runs, "peer": partial(peer_run, peer_args(CONFIG))}


def run_repeats(train: str, repeats: int, quiet: float, max_wait_s: float) -> list[dict]:
    """`repeats` rounds of the four runs, alternating their order (ABBA); each round after
    other programs have left the machine `quiet` (bench/machine_load.py), or `max_wait_s`."""
    runs = runners(train)
    ordered = {name: runs[name] for name in RUNS}
    return hf_runs.run_rounds(ordered, repeats, quiet, max_wait_s, prefix="bench-hf-ep")


def loss_gaps(rounds: list[dict]) -> dict[str, dict[str, float]]:
    """For each run against `ep`: the largest difference of a step's loss, over every
    repeat, over the first `COMPARED_STEPS` steps and over every step."""
    return {
        name: hf_runs.loss_gap([(found["ep"]["losses"], found[name]["losses"]) for found in rounds])
        for name in RUNS[1:]
    }


METRICS = ("steady_ms_per_step", "period_ms_per_step", "wall_s", "peak_rss_bytes", "state_bytes")


def summarise(rounds: list[dict]) -> dict:
    """For every repeat, and for the clean ones alone: each run's medians and its ratios to
    `ep` in the same repeat; and the losses' agreement."""
    clean = [f for f in rounds if max(r["others_cpu_share"] for r in f.values()) < CLEAN_SHARE]
    result = {which: of_rounds(chosen) for which, chosen in (("all", rounds), ("clean", clean))}
    return {**result, "loss_gaps": loss_gaps(rounds)}


def of_rounds(rounds: list[dict]) -> dict:
    if not rounds:
        return {"repeats": 0}
    return {
        "repeats": len(rounds),
        "median": {
            name: {m: statistics.median(f[name][m] for f in rounds) for m in METRICS}
            for name in RUNS
        },
        # Each run's step time over ep's in the same repeat (the launcher's own measure, and
        # step to step).
        "ratios_to_ep": {
            name: {m: [f[name][m] / f["ep"][m] for f in rounds] for m in METRICS[:2]}
            for name in RUNS
        },
    }


def markdown_table(result: dict) -> str:
    """A row for each run, over every repeat and, where some were not clean, over the clean
    ones; the losses' agreement below."""
    rows = [
        "| Qwen3-MoE, 8 experts, top 2, 2 processes | repeats | ms/step | step to step, ms "
        "| / ep (ours): median (range) | peak RSS per process | model state per process |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    sets = [("all", "")]
    if 0 < result["clean"]["repeats"] < result["all"]["repeats"]:
        sets.append(("clean", ", clean repeats"))
    for which, suffix in sets:
        chosen = result[which]
        for name in RUNS:
            median = chosen["median"][name]
            ratio = chosen["ratios_to_ep"][name]["steady_ms_per_step"]
            shown = f"x{statistics.median(ratio):.3f} (x{min(ratio):.3f} to x{max(ratio):.3f})"
            rows.append(
                f"| {LABELS[name]}{suffix} | {chosen['repeats']} "
                f"| {median['steady_ms_per_step']:.1f} | {median['period_ms_per_step']:.1f} "
                f"| {'x1' if name == 'ep' else shown} "
                f"| {median['peak_rss_bytes'] / 2**20:.0f} MiB "
                f"| {median['state_bytes'] / 2**20:.1f} MiB |"
            )
    return "\n".join([*rows, "", loss_line(result)])


def loss_line(result: dict) -> str:
    first = f"max_abs_first_{COMPARED_STEPS}_steps"
    gaps = result["loss_gaps"]
    each = "; ".join(
        f"{LABELS[name]} {gap[first]:.1e} over the first {COMPARED_STEPS} steps, "
        f"{gap['max_abs_all_steps']:.1e} over all"
        for name, gap in gaps.items()
    )
    return (
        f"Loss against ep (ours), step by step, largest gap: {each}. Clean repeats: other "
        f"programs used under {CLEAN_SHARE:.0%} of the cores in each run "
        f"({result['clean']['repeats']} of {result['all']['repeats']})."
    )


def main() -> int:
    args = hf_runs.driver_args(
        __doc__, repeats=3, repeats_help="rounds of the four runs", unit="round"
    )
    rounds = hf_runs.collect(
        lambda: run_repeats(args.train, args.repeats, args.quiet, args.max_wait)
    )
    if rounds is None:
        return 1
    result = summarise(rounds)
    head = {
        "config": str(CONFIG.relative_to(REPO)),
        "peer_args": peer_args(CONFIG),
        "overrides": OVERRIDES,
    }
    hf_runs.publish(
        "hf_experts.json", markdown_table(result), args, head, {"rounds": rounds, **result}
    )
    return hf_runs.losses_agree(
        result["loss_gaps"]["peer"][f"max_abs_first_{COMPARED_STEPS}_steps"],
        "ep and the peer differ by {:.2e}: different work",
    )


if __name__ == "__main__":
    sys.exit(main())
