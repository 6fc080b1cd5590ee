"""Compare the launcher with the hand-written torchrun DDP loop on the same GPT recipe.

    python bench/compare.py --ours ".venv/bin/train --config bench/gpt_bench.yaml --run-dir {run_dir}"

Runs both commands R times, alternating which goes first (ABBA) so that drift in machine
load does not favour one side. Per run it records the whole-command wall time, the time from
launching the command to the end of the first training step, and the steady-state step time
(median step time after the warm-up steps). Prints a markdown table of medians over the
repeats and writes bench/results/ddp_vs_torchrun.json.

The hand-written command gets OMP_NUM_THREADS=1 (what torchrun defaults to as well); ours
runs with this script's environment unchanged, so its own thread settings are measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from launcher.metrics.step_times import read_sample  # noqa: E402
from launcher.rundir.layout import RunLayout  # noqa: E402

# Must match bench/gpt_bench.yaml: recipe kwargs, per-process batch size, lr and steps.
HANDWRITTEN_ARGS = (
    "--steps 250 --batch-size 8 --lr 1e-3 --n-layer 4 --n-embd 128 --n-head 4 "
    "--block-size 128 --max-bytes 8000000"
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ours", required=True, help="launcher command; {run_dir} is filled in")
    parser.add_argument("--ours-summary", default="{run_dir}/summary.json")
    parser.add_argument("--handwritten-args", default=HANDWRITTEN_ARGS)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per command")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/ddp_vs_torchrun.json")
    return parser.parse_args()


class CommandFailed(RuntimeError):
    pass


def run_command(
    argv: list[str], env: dict[str, str], timeout: float, log: Path | None = None
) -> tuple[float, float]:
    """Run ``argv`` from the repo root; return (start unix time, wall seconds). ``log`` gets
    its output, whatever the outcome."""
    # A new session lets a timeout kill torchrun's workers too, not only torchrun itself.
    start = time.time()
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        env=env,
        text=True,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    reason = None
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        reason = f"timed out after {timeout:.0f} s"
    if log is not None:
        log.write_text(stdout + stderr)
    if reason is None:
        if proc.returncode == 0:
            return start, time.time() - start
        reason = f"exit code {proc.returncode}"
    tail = "\n".join((stdout + stderr).splitlines()[-40:])
    raise CommandFailed(f"{reason}: {shlex.join(argv)}\n--- last output lines ---\n{tail}")


def measure(summary_path: Path, start: float, wall: float) -> dict:
    """Metrics of one run from its summary JSON (written by rank 0 of either command)."""
    if not summary_path.is_file():
        raise CommandFailed(f"command succeeded but wrote no summary at {summary_path}")
    summary = json.loads(summary_path.read_text())
    # The hand-written loop's every step; the launcher's in the run's step-time sample (every
    # step of a run this short).
    times = summary.get("step_times_s") or read_sample(RunLayout(summary_path.parent).step_times)
    # The first steps include lazy allocation and allocator warm-up, not steady state.
    skip = max(5, len(times) // 10)
    if len(times) <= skip:
        raise CommandFailed(f"{summary_path}: only {len(times)} steps, need more than {skip}")
    return {
        "wall_s": wall,
        "first_step_ms": 1000 * (summary["first_step_end_unix"] - start),
        "steady_ms_per_step": 1000 * statistics.median(times[skip:]),
        "steps_run": summary["steps_run"],
        # Both write it (the hand-written loop's: the mean over every step and rank), so that
        # a benchmark can check the two did the same work.
        "final_loss": summary.get("final_loss"),
    }


def run_handwritten(args: argparse.Namespace, run_dir: Path) -> dict:
    out = run_dir / "summary.json"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    argv += ["--nproc-per-node", str(args.nproc), "bench/handwritten_ddp.py"]
    argv += [*shlex.split(args.handwritten_args), "--out", str(out)]
    start, wall = run_command(argv, {**os.environ, "OMP_NUM_THREADS": "1"}, args.timeout)
    return measure(out, start, wall)


def run_ours(args: argparse.Namespace, run_dir: Path) -> dict:
    argv = shlex.split(args.ours.format(run_dir=run_dir))
    start, wall = run_command(argv, dict(os.environ), args.timeout)
    return measure(Path(args.ours_summary.format(run_dir=run_dir)), start, wall)


METRICS = ("wall_s", "first_step_ms", "steady_ms_per_step")


def summarise(runs: dict[str, list[dict]]) -> dict:
    medians = {
        name: {m: statistics.median(r[m] for r in rs) for m in METRICS} for name, rs in runs.items()
    }
    hand, ours = medians["handwritten"], medians["ours"]
    return {
        "median": medians,
        "steady_step_ratio_ours_over_handwritten": ours["steady_ms_per_step"]
        / hand["steady_ms_per_step"],
        "first_step_diff_ms_ours_minus_handwritten": ours["first_step_ms"] - hand["first_step_ms"],
        "wall_diff_s_ours_minus_handwritten": ours["wall_s"] - hand["wall_s"],
    }


def markdown_table(result: dict, repeats: int) -> str:
    hand, ours = result["median"]["handwritten"], result["median"]["ours"]
    rows = [
        f"| metric (median of {repeats}) | hand-written torchrun | ours | ours vs hand-written |",
        "|---|---:|---:|---:|",
        f"| steady-state ms/step | {hand['steady_ms_per_step']:.1f} | "
        f"{ours['steady_ms_per_step']:.1f} | "
        f"x{result['steady_step_ratio_ours_over_handwritten']:.3f} |",
        f"| ms to end of first step | {hand['first_step_ms']:.0f} | {ours['first_step_ms']:.0f} | "
        f"{result['first_step_diff_ms_ours_minus_handwritten']:+.0f} ms |",
        f"| whole command, s | {hand['wall_s']:.2f} | {ours['wall_s']:.2f} | "
        f"{result['wall_diff_s_ours_minus_handwritten']:+.2f} s |",
    ]
    return "\n".join(rows)


def main() -> int:
    args = parse_args()
    runners = {"handwritten": run_handwritten, "ours": run_ours}
    runs: dict[str, list[dict]] = {name: [] for name in runners}
    # The first process to import torch would otherwise pay for a cold page cache.
    subprocess.run([sys.executable, "-c", "import torch.distributed.run"], check=True)
    try:
        for repeat in range(args.repeats):
            order = list(runners) if repeat % 2 == 0 else list(reversed(runners))
            for name in order:
                with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as run_dir:
                    runs[name].append(runners[name](args, Path(run_dir)))
                print(f"repeat {repeat + 1}/{args.repeats} {name}: {runs[name][-1]}", flush=True)
    except CommandFailed as err:
        print(f"benchmark aborted: {err}", file=sys.stderr)
        return 1

    result = summarise(runs)
    table = markdown_table(result, args.repeats)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "ours_command": args.ours,
        "handwritten_args": args.handwritten_args,
        "nproc": args.nproc,
        "repeats": args.repeats,
        "runs": runs,
        **result,
        "table_markdown": table,
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
