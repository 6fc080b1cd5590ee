"""ours fsdp against hand-written `fully_shard` at 2 processes (gloo, CPU), both clipping the
gradients, and the clipping call alone (issue 17). `make bench` runs it.

    python bench/fsdp_overhead.py [--train .venv/bin/train] [--repeats 3]

1. bench/compare.py: `train --config bench/gpt_fsdp_bench.yaml` against
   `bench/handwritten_ddp.py --fsdp --clip`, alternately (ABBA). The hand-written loop's
   arguments are read from that YAML, so both run the same model, data, batch, optimizer,
   steps and clipping.
2. bench/clip_cost.py under torchrun: torch's `clip_grad_norm_` over FSDP2's DTensor gradients
   (what the hand-written loop calls) against the launcher's, on local shards with one
   all-reduce (launcher/parallel/grad_norm.py); ms per call.

Prints one table and writes bench/results/fsdp_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

# Imported first: it puts the repository on sys.path, for the launcher's imports below.
from hf_runs import REPO, as_argv, check_fixed

from launcher.config.loader import load_cli_spec
from launcher.parallel.dims import resolve_dims

CONFIG = REPO / "bench/gpt_fsdp_bench.yaml"
RESULTS = REPO / "bench/results"


def handwritten_args(config: Path) -> list[str]:
    """bench/handwritten_ddp.py's arguments for the run that `config` describes, read through
    the launcher's own spec loader (defaults applied, `1e-3` a number) as `train` reads it."""
    spec = load_cli_spec(config)
    model, dataset = spec.recipe.model, spec.recipe.dataset
    fixed = {
        "optim.name": (spec.optim.name, "AdamW"),
        "optim.kwargs": (spec.optim.kwargs, {"weight_decay": 0.0}),
        "run.seed": (spec.run.seed, 0),
        "launch.strategy": (spec.launch.strategy, "fsdp"),
    }
    check_fixed(config, fixed)
    values = {
        "--steps": spec.train.max_steps,
        "--batch-size": spec.data.batch_size,
        "--lr": spec.optim.lr,
        "--n-layer": model["n_layer"],
        "--n-head": model["n_head"],
        "--n-embd": model["n_embd"],
        "--block-size": model["block_size"],
        "--max-bytes": dataset["max_bytes"],
        "--clip": spec.train.grad_clip_norm,
    }
    # The parallel section as the launcher resolves it on this run's processes (HSDP, TP:
    # bench/dims_overhead.py); a plain fsdp run has neither.
    devices = int(spec.launch.devices)  # a number in every bench YAML
    dims = resolve_dims(spec.parallel, "fsdp", devices, devices)
    if dims.dp_replicate > 1:
        values["--dp-replicate"] = dims.dp_replicate
    if dims.tp > 1:
        values["--tp"] = dims.tp
    if dims.pp > 1:
        values["--pp"] = dims.pp
        values["--pp-microbatches"] = spec.parallel.pp_microbatches or dims.pp
    return ["--fsdp", *as_argv(values)]


def run(argv: list[str], **env: str) -> None:
    print("$", shlex.join(argv), flush=True)
    subprocess.run(argv, cwd=REPO, env={**os.environ, **env}, check=True, timeout=3600)


def markdown_table(e2e: dict, clip: dict) -> str:
    hand, ours = e2e["median"]["handwritten"], e2e["median"]["ours"]
    step_ratio = e2e["steady_step_ratio_ours_over_handwritten"]
    n = clip["gradient_tensors"]
    return "\n".join(
        [
            f"| fsdp, 2 processes (median of {e2e['repeats']}) | hand-written `fully_shard` "
            "| ours | ours / hand-written |",
            "|---|---:|---:|---:|",
            f"| steady-state ms/step | {hand['steady_ms_per_step']:.1f} | "
            f"{ours['steady_ms_per_step']:.1f} | x{step_ratio:.3f} |",
            f"| ms to end of first step | {hand['first_step_ms']:.0f} | "
            f"{ours['first_step_ms']:.0f} | {ours['first_step_ms'] - hand['first_step_ms']:+.0f} "
            "ms |",
            f"| whole command, s | {hand['wall_s']:.2f} | {ours['wall_s']:.2f} | "
            f"{ours['wall_s'] - hand['wall_s']:+.2f} s |",
            f"| `clip_grad_norm_(1.0)` alone, ms per call ({n} gradients; torch's over DTensors "
            f"/ ours) | {clip['torch_ms']:.2f} | {clip['ours_ms']:.2f} | "
            f"x{clip['ours_ms'] / clip['torch_ms']:.2f} |",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", default=str(REPO / ".venv/bin/train"), help="ours")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    e2e_out, clip_out = RESULTS / "fsdp_vs_fully_shard.json", RESULTS / "clip_cost.json"
    ours = f"{args.train} --config {CONFIG} --run-dir {{run_dir}}"
    compare = [sys.executable, str(REPO / "bench/compare.py"), "--ours", ours]
    compare += ["--handwritten-args", shlex.join(handwritten_args(CONFIG))]
    run([*compare, "--repeats", str(args.repeats), "--out", str(e2e_out)])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    run([*torchrun, "--nproc-per-node", "2", str(REPO / "bench/clip_cost.py")], OMP_NUM_THREADS="1")
    e2e, clip = json.loads(e2e_out.read_text()), json.loads(clip_out.read_text())
    table = markdown_table(e2e, clip)
    print(table)
    record = {"end_to_end": e2e, "clip_call": clip, "table_markdown": table}
    (RESULTS / "fsdp_overhead.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {RESULTS / 'fsdp_overhead.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
