"""How long a checkpoint save blocks training: sync against `checkpoint.async: true`.

    python bench/checkpoint_blocking.py
    python bench/checkpoint_blocking.py --gpu    # one GPU: the 86M GPT, block 1024, bf16
    python bench/checkpoint_blocking.py --smoke  # a few tiny saves, to see it runs
    python bench/checkpoint_blocking.py --store  # also to S3 on loopback (moto), side by side

Trains the gpt recipe (about 5M parameters, ~60 MB of model and AdamW state) on 2 CPU
processes with a checkpoint every 10 steps, once with each mode, and reads the time each
save kept rank 0 from training (RUN_DIR/summary.json, `checkpoint_blocked_s`) and how long it
took to be written and published (`checkpoint_written_s`: for async, the background upload).
The last save, at the end of the run, waits for its write in both modes and is left out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from s3_loopback import s3_on_loopback

REPO = Path(__file__).resolve().parent.parent
TRAIN = shutil.which("train") or str(Path(sys.executable).parent / "train")
ARGS = [
    "--config",
    str(REPO / "bench" / "gpt_bench.yaml"),
    "recipe.model={n_layer: 6, n_head: 8, n_embd: 256, block_size: 128}",
    "train.max_steps=60",
    "train.log_every=60",
    "checkpoint.every_n_steps=10",
]
# A save's write (1 GB of model and AdamW state) takes about 2 s on the GPU machines' disk, 20
# times a step: saves 10 steps apart would each wait for the last one's write, which is not
# what an async save is for (the launcher warns of it). 200 steps apart, as a run's would be.
GPU = [
    "launch.accelerator=gpu",
    "launch.devices=1",
    "train.precision=bf16",
    "recipe.model={n_layer: 12, n_head: 12, n_embd: 768, block_size: 1024}",
    "recipe.dataset.block_size=1024",
    "train.max_steps=800",
    "train.log_every=800",
    "checkpoint.every_n_steps=200",
]

SMOKE = [
    "recipe.model={n_layer: 2, n_head: 2, n_embd: 32, block_size: 32}",
    "recipe.dataset.block_size=32",
    "train.max_steps=15",
    "checkpoint.every_n_steps=5",
]


def run(mode_async: bool, folder: Path, extra: list[str], env: dict | None = None) -> dict:
    run_dir = folder / (("async" if mode_async else "sync") + ("-s3" if env else ""))
    cmd = [
        str(TRAIN),
        *ARGS,
        *extra,
        f"checkpoint.async={str(mode_async).lower()}",
        "--run-dir",
        str(run_dir),
    ]
    store = ["checkpoint.dir=s3://bench/{run}"] if env else []
    done = subprocess.run(
        cmd + store, cwd=REPO, capture_output=True, text=True, timeout=900, env=env
    )
    (folder / f"{run_dir.name}.log").write_text(done.stdout + done.stderr)
    done.check_returncode()
    summary = json.loads((run_dir / "summary.json").read_text())
    blocked = summary["checkpoint_blocked_s"][:-1]  # the final save always waits
    written = summary["checkpoint_written_s"][:-1]
    return {
        "written_ms_median": 1000 * statistics.median(written),
        "saves": len(blocked),
        "blocked_ms_median": 1000 * statistics.median(blocked),
        "blocked_ms_max": 1000 * max(blocked),
        "step_ms_median": 1000 * summary["median_step_s"],
        "blocked_ms": [round(1000 * s, 1) for s in blocked],
        "warnings": [line for line in done.stdout.splitlines() if "WARNING" in line],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/checkpoint_blocking.json")
    parser.add_argument("--gpu", action="store_true", help="one GPU, the 86M GPT")
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT, 2 saves")
    parser.add_argument("--store", action="store_true", help="also to S3 on loopback (moto)")
    args = parser.parse_args()
    extra = GPU if args.gpu else SMOKE if args.smoke else []
    with tempfile.TemporaryDirectory() as tmp, s3_on_loopback(args.store) as env:
        results = {"sync": run(False, Path(tmp), extra), "async": run(True, Path(tmp), extra)}
        if env:  # the same runs, with the store's right after the disk's
            results |= {"sync-s3": run(False, Path(tmp), extra, env)}
            results |= {"async-s3": run(True, Path(tmp), extra, env)}
    ratio = results["async"]["blocked_ms_median"] / results["sync"]["blocked_ms_median"]
    print("| where, mode | saves | blocked ms (median) | blocked ms (max) | written ms (median) "
          "| step ms (median) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for mode, r in results.items():
        print(
            f"| {mode} | {r['saves']} | {r['blocked_ms_median']:.1f} | {r['blocked_ms_max']:.1f} "
            f"| {r['written_ms_median']:.1f} | {r['step_ms_median']:.1f} |"
        )
    print(f"\nasync blocks {100 * ratio:.1f}% of the sync time (target: under 10%)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**results, "async_over_sync": ratio}, indent=1))


if __name__ == "__main__":
    main()
