"""What bench/hf_pipeline.py and bench/hf_experts.py share: running ours (`train`) and a
hand-written torchrun peer on the same YAML, reading each run's step time, period and losses,
in rounds that wait for a quiet machine, and the record of what they ran on. The fixed-keys
check (`check_fixed`) serves bench/fsdp_overhead.py too.

Imported from a script in bench/ (`from hf_runs import ...`), whose folder is then first on
`sys.path`.
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from compare import CommandFailed, measure, run_command  # noqa: E402
from machine_load import others_share, wait_until_quiet  # noqa: E402

from launcher.rundir.layout import RunLayout  # noqa: E402

RESULTS = REPO / "bench/results"
# Same weights and batches agree to float32 rounding (a few 1e-7) for the first steps; a
# different initial weight, batch or loss mean moves the first loss by 1e-3 or more. Later
# steps drift apart as the rounding of two sums of the gradient norm feeds AdamW.
LOSS_TOLERANCE = 1e-5
COMPARED_STEPS = 10
# A pair or round is clean where other programs kept less than this share of the cores busy
# during each of its runs: a few percent moves a step by about as much.
CLEAN_SHARE = 0.05
Runner = Callable[[Path], dict]
T = TypeVar("T")


def check_fixed(config: Path, fixed: dict[str, tuple[object, object]]) -> None:
    """Exits unless every key of `fixed` has its expected value: `{key: (value, expected)}`.
    A hand-written loop hard-codes these; a YAML that strays from them is another run."""
    for key, (value, expected) in fixed.items():
        if value != expected:
            sys.exit(f"{config}: {key} is {value!r}; the hand-written loop runs {expected!r}")


def as_argv(values: dict[str, object]) -> list[str]:
    """`{"--flag": value}` as command-line words."""
    return [str(x) for pair in values.items() for x in pair]


def steady_ms(seconds: list[float]) -> float:
    """The median, in ms, of a step's seconds after the warm-up steps that bench/compare.py's
    `measure` leaves out; `seconds` from step 2 on (the period of step 1 is unknown)."""
    skip = max(5, (len(seconds) + 1) // 10)
    return 1000 * statistics.median(seconds[skip:])


def run_ours(
    train: str, config: Path, run_dir: Path, overrides: Sequence[str] = ()
) -> tuple[dict, list[float], dict]:
    """One launcher run of `config` with KEY=VALUE `overrides`: its measure with its period
    step to step, every step's loss, and its summary.json."""
    argv = [*shlex.split(train), "--config", str(config), "--run-dir", str(run_dir), *overrides]
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
    return measured, [r["loss"] for r in steps], json.loads(layout.summary.read_text())


def run_peer(script: str, args: list[str], run_dir: Path) -> tuple[dict, dict]:
    """One hand-written run of `script` on 2 processes (torchrun, OMP_NUM_THREADS=1 as
    torchrun's default): its measure with its period step to step, and the summary it wrote."""
    out = run_dir / "summary.json"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    argv += ["--nproc-per-node", "2", script, *args]
    start, wall = run_command(
        [*argv, "--out", str(out)], {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600
    )
    measured = measure(out, start, wall)
    summary = json.loads(out.read_text())
    # Its timed step is the whole loop: nothing runs between two steps.
    measured["period_ms_per_step"] = steady_ms(summary["step_times_s"][1:])
    return measured, summary


def run_rounds(
    runners: dict[str, Runner], repeats: int, quiet: float, max_wait_s: float, prefix: str
) -> list[dict[str, dict]]:
    """`repeats` rounds of every runner, the order reversed every other round (ABBA); each
    round after other programs have left the machine `quiet` (bench/machine_load.py), or
    `max_wait_s`. Each run gets a fresh folder and records the others' share meanwhile."""
    rounds: list[dict[str, dict]] = []
    for repeat in range(repeats):
        order = list(runners) if repeat % 2 == 0 else list(reversed(runners))
        before = wait_until_quiet(quiet, max_wait_s)
        found: dict[str, dict] = {}
        for name in order:
            with (
                tempfile.TemporaryDirectory(prefix=f"{prefix}-{name}-") as run_dir,
                others_share() as load,
            ):
                measured = runners[name](Path(run_dir))
            found[name] = {**measured, **load, "others_cpu_share_before": before}
            shown = {k: v for k, v in found[name].items() if k != "losses"}
            print(f"repeat {repeat + 1}/{repeats} {name}: {shown}", flush=True)
        rounds.append(found)
    return rounds


def loss_gap(pairs: list[tuple[list[float], list[float]]]) -> dict[str, float]:
    """The largest difference of a step's loss between two runs, over every pair of runs:
    over the first `COMPARED_STEPS` steps, and over every step."""
    diffs = [[abs(a - b) for a, b in zip(one, other, strict=True)] for one, other in pairs]
    return {
        f"max_abs_first_{COMPARED_STEPS}_steps": max(max(d[:COMPARED_STEPS]) for d in diffs),
        "max_abs_all_steps": max(max(d) for d in diffs),
    }


def driver_args(doc: str, repeats: int, repeats_help: str, unit: str) -> argparse.Namespace:
    """The drivers' command line: ours, how many `unit`s (a pair or a round), and how quiet."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--train", default=str(REPO / ".venv/bin/train"), help="ours")
    parser.add_argument("--repeats", type=int, default=repeats, help=repeats_help)
    parser.add_argument(
        "--quiet", type=float, default=0.1, help=f"start a {unit} below this share of others' CPU"
    )
    parser.add_argument("--max-wait", type=float, default=60, help=f"seconds a {unit}, --quiet")
    return parser.parse_args()


def warm_imports() -> None:
    """Imports torch once: the first process to import it would otherwise pay for a cold
    page cache, inside a measured run."""
    warm = [sys.executable, "-c", "import transformers, torch.distributed.run"]
    subprocess.run(warm, check=True, timeout=300)


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


def collect(run: Callable[[], T]) -> T | None:
    """`run()` once the imports are warm; None, said on stderr, where a command failed."""
    warm_imports()
    try:
        return run()
    except CommandFailed as err:
        print(f"benchmark aborted: {err}", file=sys.stderr)
        return None


def publish(name: str, table: str, args: argparse.Namespace, head: dict, tail: dict) -> None:
    """Prints `table` and writes bench/results/`name`: `head` (what ran), the machine and the
    command line's settings, `tail` (the runs and their summary), and the table."""
    print(table)
    record = {**head, "machine": machine(), "quiet": args.quiet, "max_wait_s": args.max_wait}
    record |= {"repeats": args.repeats, **tail, "table_markdown": table}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / name
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


def losses_agree(first: float, differ: str) -> int:
    """0 where the largest gap of the losses over the first steps is float32 rounding; else
    1, said on stderr as `differ` (a format of the gap)."""
    if first > LOSS_TOLERANCE:
        print(differ.format(first), file=sys.stderr)
        return 1
    return 0
