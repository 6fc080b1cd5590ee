"""`train runs` and `train plot` at scale: N runs of M records, and one run of up to 10^6
records; the time and peak memory (RSS) of each command, which should stay flat in M.

The run folders are copies of one real small run (configs/quickstart.yaml, 40 steps), its
metrics.jsonl lengthened to M records (its training records repeated with new steps and
times) and hard-linked into every copy; a copy's progress.json is what the run's rank 0 would
have written for that file (`Progress.from_file`). "no progress.json" rows remove it: a run
written before it existed, read from the end of its metrics file.

--baseline DIR runs the same commands with the launcher at DIR (e.g. `git archive HEAD` of
an older commit, unpacked) for the before/after columns. Also measures summary.json's size
after 100 and 100,000 steps (in process).

Usage: python bench/runs_scale.py [--runs 200] [--baseline DIR] [--repeats 3]
Writes bench/results/runs_scale.json; BENCHMARKS.md records the figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from launcher.metrics.progress import Progress, read_progress  # noqa: E402
from launcher.metrics.telemetry import Telemetry  # noqa: E402
from launcher.rundir.layout import RunLayout  # noqa: E402

SMALL_RUN = ["train.max_steps=40", "train.log_every=4", "eval.every_n_steps=20"]
# The child's peak RSS (KiB on Linux): RUSAGE_CHILDREN of a process that ran only it.
MEASURE = (
    "import resource, subprocess, sys, time\n"
    "start = time.perf_counter()\n"
    "done = subprocess.run(sys.argv[2:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,"
    " env={**__import__('os').environ, 'PYTHONPATH': sys.argv[1]})\n"
    "wall = time.perf_counter() - start\n"
    "use = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
    "print(done.returncode, wall, use.ru_utime + use.ru_stime, use.ru_maxrss)\n"
    "sys.stderr.write(done.stderr.decode()[-2000:])\n"
)


def small_run(top: Path) -> Path:
    run = top / "base"
    cmd = [str(Path(sys.executable).parent / "train"), "--config", "configs/quickstart.yaml"]
    cmd += ["--run-dir", str(run), *SMALL_RUN]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=600)
    return run


def lengthened(base: Path, records: int, out: Path) -> Path:
    """The base run's metrics file, `records` records long (its eval records kept where
    their steps fall)."""
    rows = [json.loads(line) for line in RunLayout(base).metrics.read_text().splitlines()]
    period = max(r["step"] for r in rows)
    start = rows[0]["time"]
    with out.open("w") as f:
        for index in range(records // len(rows) + 1):
            for row in rows:
                step = index * period + row["step"]
                row = {**row, "step": step, "time": round(start + step * 0.02, 3)}
                f.write(json.dumps(row) + "\n")
    lines = out.read_bytes().splitlines(keepends=True)[:records]
    out.write_bytes(b"".join(lines))
    return out


def make_runs(base: Path, folder: Path, runs: int, metrics: Path, progress: bool) -> Path:
    """`runs` copies of the base run under folder/runs/NAME/, each with `metrics`."""
    written = Progress.from_file(metrics)
    written.about = read_progress(RunLayout(base)).about  # the name, monitor and steps
    progress_text = written.to_json() if progress else None
    for index in range(runs):
        run = folder / "runs" / f"sweep-{index:03d}" / "r1"
        shutil.copytree(base, run, ignore=shutil.ignore_patterns("checkpoints", "tb"))
        layout = RunLayout(run)
        layout.metrics.unlink()
        os.link(metrics, layout.metrics)
        layout.progress.unlink(missing_ok=True)
        if progress_text is not None:
            layout.progress.write_text(progress_text)
    return folder / "runs"


def measure(launcher: Path, args: list[str], repeats: int) -> dict:
    """The median wall and CPU time and the largest peak RSS of `train ARGS` over repeats."""
    results = []
    for _ in range(repeats):
        cmd = [sys.executable, "-c", MEASURE, str(launcher), sys.executable, "-m"]
        # Away from the repo: `python -m` puts the working folder first on sys.path.
        done = subprocess.run(
            [*cmd, "launcher.cli.app", *args], capture_output=True, text=True, cwd="/"
        )
        code, wall, cpu, rss = done.stdout.split()
        if code != "0":
            raise SystemExit(f"train {' '.join(args)} failed:\n{done.stderr}")
        results.append((float(wall), float(cpu), int(rss)))
    return {
        "wall_s": round(statistics.median(r[0] for r in results), 3),
        "cpu_s": round(statistics.median(r[1] for r in results), 3),
        "peak_rss_mb": round(max(r[2] for r in results) / 1024, 1),
    }


def summary_bytes(folder: Path, steps: int) -> int:
    """summary.json's size after `steps` steps, as rank 0 writes it (in process)."""
    folder.mkdir()
    telemetry = Telemetry(folder, rank=0, is_main=True)
    for seconds in itertools.islice(itertools.cycle([0.05, 0.051, 0.07]), steps):
        telemetry.step_done(seconds)
    telemetry.write_summary(final_loss=0.5)
    telemetry.close()
    return RunLayout(folder).summary.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--baseline", type=Path, help="an older launcher's source folder")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    launchers = {"after": REPO, **({"before": args.baseline} if args.baseline else {})}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="runs_scale-") as tmp:
        top = Path(tmp)
        base = small_run(top)

        def row(work: str, records: int, cmd: list[str]) -> None:
            for name, launcher in launchers.items():
                found = {"work": work, "records": records, "launcher": name}
                rows.append({**found, **measure(launcher, cmd, args.repeats)})
                print(json.dumps(rows[-1]), flush=True)

        for records in (1_000, 20_000):
            metrics = lengthened(base, records, top / f"m{records}.jsonl")
            for progress in (True, False):
                folder = make_runs(
                    base, top / f"n{records}-{progress}", args.runs, metrics, progress
                )
                kind = "" if progress else ", no progress.json"
                cmd = ["runs", "--output-dir", str(folder), "--json"]
                row(f"train runs, {args.runs} runs{kind}", records, cmd)
        for records in (10_000, 100_000, 1_000_000):
            metrics = lengthened(base, records, top / f"p{records}.jsonl")
            run = make_runs(base, top / f"plot{records}", 1, metrics, True) / "sweep-000" / "r1"
            png = top / f"plot{records}.png"
            row("train plot --out png", records, ["plot", str(run), "--out", str(png)])
        sizes = {steps: summary_bytes(top / f"summary-{steps}", steps) for steps in (100, 100_000)}
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.node()} ({os.cpu_count()} cores), load {os.getloadavg()[0]:.1f}",
        "summary_json_bytes": sizes,
        "rows": rows,
    }
    out = REPO / "bench" / "results" / "runs_scale.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"summary.json: {sizes[100]} bytes after 100 steps, {sizes[100_000]} after 100,000")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
