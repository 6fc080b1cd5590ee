"""How fast the CLI answers: `train --help`, a bad flag and a spec with a mistake, against
`python -c pass` (the interpreter's own start) and `python -c "import torch"` (what the CLI
used to pay), each the median of REPEATS runs, alternated so load hits all alike.

Usage: python bench/cli_startup.py [--repeats 15] [--also /other/clone/.venv/bin/train]
Writes bench/results/cli_startup.json; BENCHMARKS.md records the figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAIN = Path(sys.executable).parent / "train"
BAD_SPEC = "recipe: {source: recipes/mlp.py}\ntrain: {max_steps: -1}\n"


def _commands(bad: Path, also: list[str]) -> dict[str, list[str]]:
    py = sys.executable
    rows = {
        "python -c pass": [py, "-c", "pass"],
        'python -c "import torch"': [py, "-c", "import torch"],
        "train --help": [str(TRAIN), "--help"],
        "train --config x --no-such-flag": [str(TRAIN), "--config", str(bad), "--no-such-flag"],
        "train validate (a spec with a mistake)": [str(TRAIN), "validate", "--config", str(bad)],
    }
    for other in also:
        rows[f"train --help ({other})"] = [other, "--help"]
    return rows


def _once(cmd: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, capture_output=True, check=False)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--also", action="append", default=[], help="another `train` to time")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bad = Path(tmp) / "bad.yaml"
        bad.write_text(BAD_SPEC)
        commands = _commands(bad, args.also)
        for cmd in commands.values():
            _once(cmd)  # warm the page cache
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.repeats):
            for name, cmd in commands.items():
                times[name].append(_once(cmd))
    base = statistics.median(times["python -c pass"])
    rows = []
    print(f"{'command':<45} {'median s':>9} {'x python -c pass':>17}")
    for name, values in times.items():
        median = statistics.median(values)
        rows.append(
            {"command": name, "median_s": round(median, 4), "ratio": round(median / base, 2)}
        )
        print(f"{name:<45} {median:>9.3f} {median / base:>17.1f}")
    out = REPO / "bench" / "results" / "cli_startup.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
    }
    out.write_text(json.dumps({**meta, "repeats": args.repeats, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
