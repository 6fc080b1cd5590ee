"""Parallelism as dimensions (issues 30 and 43): ours HSDP, tensor and pipeline parallelism
against the same by hand, at 4 processes (gloo, CPU). `make bench` runs it.

    python bench/dims_overhead.py [--train .venv/bin/train] [--repeats 3]

Each row is one bench/compare.py run (alternately, ABBA: `--repeats` pairs), ours
`train --config bench/gpt_<row>_bench.yaml` against `bench/handwritten_ddp.py --fsdp ...`,
whose arguments are read from that YAML (bench/fsdp_overhead.py's `handwritten_args`):

- hsdp: `parallel.dp_replicate: 2` against `fully_shard` per Block and root over a 2-D
  (dp_replicate, dp_shard) mesh;
- tp: `parallel.tp: 2` against the recipe's `parallelize_module` plan over a (dp_shard, tp)
  mesh's `tp` axis, then `fully_shard` over `dp_shard`;
- pp: `parallel.pp: 2` against torch.distributed.pipelining by hand (bench/handwritten_pipeline.py:
  the tracer's two stages, `fully_shard` per stage, `Schedule1F1B`, 2 micro-batches).

4 processes on a 2-core machine are oversubscribed: both sides run with OMP_NUM_THREADS=1.
The ratio is ours over hand-written of each pair's steady-state ms/step; the table shows
their median and range. Both sides report the mean loss over every step and rank, which
must agree (the same weights, batches and clipping), or the comparison is of different work.

Prints one table and writes bench/results/dims_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from fsdp_overhead import handwritten_args  # noqa: E402

RESULTS = REPO / "bench/results"
ROWS = {
    "hsdp": ("HSDP, dp_replicate 2 x dp_shard 2", "`fully_shard`, 2-D mesh"),
    "tp": ("TP, dp_shard 2 x tp 2", "`parallelize_module` + `fully_shard`"),
    "pp": ("PP, pp 2 x dp_shard 2 (1F1B)", "`pipelining` + `fully_shard` per stage"),
}
# The mean loss over 80 steps of the same work agrees to float32 rounding; a different batch
# or initial weights moves it by 1e-2 or more.
LOSS_TOLERANCE = 1e-4


def compare(name: str, train: str, repeats: int) -> dict:
    """One bench/compare.py run of row `name`; its record, with each pair's ratio added."""
    config = REPO / f"bench/gpt_{name}_bench.yaml"
    out = RESULTS / f"{name}_vs_handwritten.json"
    argv = [sys.executable, str(REPO / "bench/compare.py"), "--nproc", "4"]
    argv += ["--ours", f"{train} --config {config} --run-dir {{run_dir}}"]
    argv += ["--handwritten-args", shlex.join(handwritten_args(config))]
    argv += ["--repeats", str(repeats), "--out", str(out)]
    print("$", shlex.join(argv), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # compare.py gives it to both sides
    subprocess.run(argv, cwd=REPO, env=env, check=True, timeout=3600)
    record = json.loads(out.read_text())
    runs = record["runs"]
    ratios = [
        ours["steady_ms_per_step"] / hand["steady_ms_per_step"]
        for ours, hand in zip(runs["ours"], runs["handwritten"], strict=True)
    ]
    losses = {side: sorted({r["final_loss"] for r in rs}) for side, rs in runs.items()}
    return {**record, "pair_ratios": ratios, "final_losses": losses}


def check_losses(name: str, record: dict) -> str | None:
    """Where the two sides' losses disagree, why this row compares nothing."""
    values = [loss for losses in record["final_losses"].values() for loss in losses]
    if None in values or max(values) - min(values) > LOSS_TOLERANCE:
        return f"{name}: final losses differ, so the two runs did different work: " + str(
            record["final_losses"]
        )
    return None


def markdown_table(records: dict[str, dict], repeats: int) -> str:
    rows = [
        f"| 4 processes, {repeats} ABBA runs a side | hand-written peer | hand-written ms/step "
        "| ours ms/step | ours / hand-written: median of pairs (range) | mean loss, both |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, record in records.items():
        label, peer = ROWS[name]
        hand = record["median"]["handwritten"]["steady_ms_per_step"]
        ours = record["median"]["ours"]["steady_ms_per_step"]
        ratios = record["pair_ratios"]
        loss = record["final_losses"]["ours"][0]
        rows.append(
            f"| {label} | {peer} | {hand:.1f} | {ours:.1f} | x{statistics.median(ratios):.3f} "
            f"(x{min(ratios):.3f} to x{max(ratios):.3f}) | {loss:.4f} |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", default=str(REPO / ".venv/bin/train"), help="ours")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side, per row")
    parser.add_argument("--only", choices=sorted(ROWS), help="one row")
    args = parser.parse_args()
    names = [args.only] if args.only else list(ROWS)
    records = {name: compare(name, args.train, args.repeats) for name in names}
    problems = [p for name in names if (p := check_losses(name, records[name]))]
    table = markdown_table(records, args.repeats)
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {"rows": records, "repeats": args.repeats, "table_markdown": table}
    (RESULTS / "dims_overhead.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {RESULTS / 'dims_overhead.json'}")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
