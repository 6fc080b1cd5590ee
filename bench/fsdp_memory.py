"""Memory per rank, ddp against fsdp, and the model only fsdp can train here.

    python bench/fsdp_memory.py            # ~100M-parameter GPT, ddp and fsdp, 2 processes
    python bench/fsdp_memory.py --big      # also: the 1B config, fsdp (and ddp, which fails)

For each run, rank 0's own bytes of parameters, gradients and optimizer state (its shards
under fsdp), its peak RSS, and how much its RSS grew while the model was built, from
RUN_DIR/summary.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAIN = Path(sys.executable).parent / "train"
GPT_100M = [
    "--config",
    str(REPO / "configs" / "gpt_ddp.yaml"),
    "recipe.model={n_layer: 14, n_head: 12, n_embd: 768, block_size: 256}",
    "recipe.dataset={block_size: 256, max_bytes: 2000000}",
    "data.batch_size=1",
    "train.max_steps=2",
    "train.log_every=1",
    "checkpoint.enabled=false",
]
GPT_1B = [
    "--config",
    str(REPO / "configs" / "gpt_1b_fsdp.yaml"),
    "train.max_steps=3",
    "checkpoint.enabled=false",
]
MB = 1024**2


def run(args: list[str], strategy: str, folder: Path, timeout: float) -> dict:
    run_dir = folder / f"{strategy}-{len(list(folder.iterdir()))}"
    cmd = [str(TRAIN), *args, "--strategy", strategy, "--run-dir", str(run_dir)]
    started = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:]
        return {"strategy": strategy, "failed": tail[0] if tail else f"exit {proc.returncode}"}
    summary = json.loads((run_dir / "summary.json").read_text())
    mem = summary["memory"]
    return {
        "strategy": strategy,
        "params_mb": mem["params"] / MB,
        "grads_mb": mem["grads"] / MB,
        "optimizer_mb": mem["optimizer"] / MB,
        "state_mb": (mem["params"] + mem["grads"] + mem["optimizer"]) / MB,
        "peak_rss_mb": mem["peak_rss"] / MB,
        "build_rss_mb": mem["build_rss_delta"] / MB,
        "step_s": summary["median_step_s"],
        "wall_s": time.time() - started,
    }


def table(rows: list[dict]) -> str:
    out = [
        "| model | strategy | params MB | grads MB | optimizer MB | total state MB | peak RSS MB "
        "| RSS growth building the model MB | s/step |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "failed" in r:
            out.append(f"| {r['model']} | {r['strategy']} | failed: {r['failed']} |||||||")
            continue
        out.append(
            f"| {r['model']} | {r['strategy']} | {r['params_mb']:.0f} | {r['grads_mb']:.0f} | "
            f"{r['optimizer_mb']:.0f} | {r['state_mb']:.0f} | {r['peak_rss_mb']:.0f} | "
            f"{r['build_rss_mb']:.0f} | {r['step_s']:.1f} |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big", action="store_true", help="also run the 1B config")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/fsdp_memory.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in ("ddp", "fsdp"):
            rows.append({"model": "gpt 100M", **run(GPT_100M, strategy, Path(tmp), 1200)})
        if args.big:
            for strategy in ("fsdp", "ddp"):
                rows.append({"model": "gpt 1B", **run(GPT_1B, strategy, Path(tmp), 3000)})
    print(table(rows))
    ddp, fsdp = rows[0], rows[1]
    if "failed" not in ddp and "failed" not in fsdp:
        print(
            f"\nfsdp holds {100 * fsdp['state_mb'] / ddp['state_mb']:.1f}% of ddp's "
            "parameter, gradient and optimizer bytes per rank (target: at most 55%)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
