"""The live log stream under a flood, ours against `torchrun --tee 3`.

1. The display alone: two rank logs get LINES lines each at once, and the launcher's display
   (RunDisplay) shows them; lines/s per rank, with stdout to a file and to a pseudo-terminal.
2. End to end: `train` with bench/flood_recipe.py (2 ranks print LINES lines each, then 2
   DDP steps) against `torchrun --nproc-per-node 2 --tee 3 bench/flood_recipe.py LINES`
   (the same by hand); whole-command seconds, lines shown and lines lost, with stdout to a
   file and to a pseudo-terminal (where ours folds bursts it cannot show).

Usage: python bench/log_flood.py [--lines 200000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from flood_recipe import line  # noqa: E402
from rich.console import Console  # noqa: E402

from launcher.launch.display import RunDisplay  # noqa: E402

_FLOOD = re.compile(rb"flood rank (\d) line (\d{7})")
_FOLDED = re.compile(rb"\.\.\. ([\d,]+) more lines")


def _pty_reader(master: int, into: list[bytes]) -> threading.Thread:
    def read() -> None:
        while True:
            try:
                data = os.read(master, 1 << 20)
            except OSError:  # EIO: every writer closed the terminal
                return
            if not data:
                return
            into.append(data)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


class _Output:
    """Where output goes: a pseudo-terminal (read as it comes) or a file."""

    def __init__(self, terminal: bool, path: Path) -> None:
        self.terminal, self.path = terminal, path
        self._got: list[bytes] = []
        if terminal:
            self._master, self.fd = os.openpty()
            self._reader = _pty_reader(self._master, self._got)
        else:
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def text(self) -> bytes:
        """Everything written, once the writers are done."""
        os.close(self.fd)
        if not self.terminal:
            return self.path.read_bytes()
        self._reader.join(10)
        os.close(self._master)
        return b"".join(self._got)


def display_alone(lines: int, terminal: bool) -> dict:
    """Lines/s per rank the display shows when two ranks print `lines` lines at once."""
    blobs = {rank: "".join(line(rank, i) + "\n" for i in range(lines)) for rank in (0, 1)}
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        (run / "logs").mkdir()
        output = _Output(terminal, run / "out.txt")
        with open(output.fd, "w", closefd=False) as out:
            display = RunDisplay(run, [0, 1], console=Console(file=out, force_terminal=terminal))
            display.start()
            started = time.perf_counter()
            for rank, blob in blobs.items():
                (run / "logs" / f"rank-{rank}.log").write_text(blob)
            display.stop()
            seconds = time.perf_counter() - started
        text = output.text()
    return {"lines_per_s_per_rank": lines / seconds, **_count(text, lines)}


def _count(text: bytes, lines: int) -> dict:
    """Flood lines shown (each once), folded, lost, shown twice, and shown out of order."""
    seen: dict[bytes, list[int]] = {}
    for match in _FLOOD.finditer(text):
        seen.setdefault(match[1], []).append(int(match[2]))
    shown = sum(len(set(numbers)) for numbers in seen.values())
    folded = sum(int(m[1].replace(b",", b"")) for m in _FOLDED.finditer(text))
    return {
        "shown": shown,
        "folded": folded,
        "lost": 2 * lines - shown - folded,
        "twice": sum(len(numbers) for numbers in seen.values()) - shown,
        "out_of_order": sum(numbers != sorted(numbers) for numbers in seen.values()),
    }


def end_to_end(argv: list[str], lines: int, terminal: bool) -> dict:
    env = {**os.environ, "COLUMNS": "200", "TERM": "xterm-256color", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        argv = [a.replace("{tmp}", tmp) for a in argv]
        output = _Output(terminal, Path(tmp) / "out.txt")
        started = time.perf_counter()
        code = subprocess.call(
            argv,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=output.fd,
            stderr=output.fd if terminal else subprocess.DEVNULL,
            start_new_session=True,
        )
        seconds = time.perf_counter() - started
        text = output.text()
    if code != 0:
        raise RuntimeError(f"exit code {code}: {' '.join(argv)}\n{text[-2000:].decode()}")
    return {"seconds": seconds, **_count(text, lines)}


def commands(lines: int) -> dict[str, list[str]]:
    recipe = str(REPO / "bench" / "flood_recipe.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return {
        "torchrun --tee 3": [*torchrun, "--nproc-per-node", "2", "--tee", "3", recipe, str(lines)],
        "ours": [
            str(Path(sys.executable).parent / "train"),
            "--config",
            str(REPO / "bench" / "flood.yaml"),
            "--run-dir",
            "{tmp}/run",
            f"recipe.model.lines={lines}",
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=200_000, help="lines per rank")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/log_flood.json")
    args = parser.parse_args()
    results: dict = {"lines_per_rank": args.lines}
    for where, terminal in (("file", False), ("pty", True)):
        runs = [display_alone(args.lines, terminal) for _ in range(args.repeats)]
        results[f"display alone, {where}"] = _median(runs)
        timed: dict[str, list[dict]] = {}
        for _ in range(args.repeats):  # alternating, so that drift hits both alike
            for name, argv in commands(args.lines).items():
                timed.setdefault(name, []).append(end_to_end(argv, args.lines, terminal))
        for name, runs in timed.items():
            results[f"{name}, {where}"] = _median(runs)
    for name, row in results.items():
        print(f"{name}: {row}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


def _median(runs: list[dict]) -> dict:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


if __name__ == "__main__":
    main()
