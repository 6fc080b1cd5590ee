"""Every line every rank prints reaches the terminal, in order, whatever ends the run; and
nothing but text does."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.conftest import (
    REPO,
    finish_train,
    only_run_dir,
    run_train,
    write_spec,
)
from tests.forked_train import fork_train
from tests.tiny_recipes import write_recipe

# The launcher's own display: the same on every torch, so it runs in .venv only.
pytestmark = [pytest.mark.timeout(240), pytest.mark.launcher_only]

FLOOD = 200_000
NO_NEWLINE = " [no newline]"


def _flood_spec(tmp_path: Path, max_steps: int = 2, **model: object) -> Path:
    return write_spec(
        tmp_path / "run.yaml",
        recipe={
            "source": str(REPO / "bench" / "flood_recipe.py"),
            "model": {"lines": FLOOD, **model},
            "dataset": {},
        },
        optim={"name": "SGD", "lr": 0.01},
        train={"max_steps": max_steps, "log_every": 1},
    )


def _assert_shown_in_order(stdout: str, run: Path, rank: int, at_least: int = FLOOD) -> None:
    """Every flood line in the rank's log is on stdout, in the log's order, none cut."""
    logged = [
        line
        for line in (run / "logs" / f"rank-{rank}.log").read_text().split("\n")
        if line.startswith("flood rank")
    ]
    prefix = f"[rank {rank}] "
    shown = [
        line[len(prefix) :].removesuffix(NO_NEWLINE)
        for line in stdout.splitlines()
        if line.startswith(prefix + "flood rank")
    ]
    assert len(logged) >= at_least
    assert len(shown) == len(logged), f"rank {rank}: {len(shown)} of {len(logged)} lines shown"
    assert shown == logged


def test_a_flood_then_a_normal_end_shows_every_line(tmp_path: Path) -> None:
    result = run_train(["--config", str(_flood_spec(tmp_path))], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    run = only_run_dir(tmp_path / "runs")
    for rank in (0, 1):
        _assert_shown_in_order(result.stdout, run, rank)
    assert result.stdout.rstrip().endswith(f"finished: {run}")


def test_a_flood_then_a_crash_shows_every_line_before_the_report(tmp_path: Path) -> None:
    result = run_train(["--config", str(_flood_spec(tmp_path, crash_rank=1))], cwd=tmp_path)
    assert result.returncode == 1
    run = only_run_dir(tmp_path / "runs")
    _assert_shown_in_order(result.stdout, run, 1)
    # Rank 0 is stopped when rank 1 fails, maybe in the middle of its flood.
    _assert_shown_in_order(result.stdout, run, 0, at_least=0)
    assert "rank 1 failed" in result.stdout


def test_a_flood_then_ctrl_c_shows_every_line(tmp_path: Path) -> None:
    spec = _flood_spec(tmp_path, max_steps=100_000, marker_dir=str(tmp_path), step_sleep=0.01)
    proc = fork_train(["--config", str(spec)], cwd=tmp_path)
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"flooded-{rank}").exists() for rank in (0, 1)):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    result = finish_train(proc, tmp_path)
    assert result.returncode == 130, result.stderr[-2000:]
    run = only_run_dir(tmp_path / "runs")
    for rank in (0, 1):
        _assert_shown_in_order(result.stdout, run, rank)


# The tiny recipe, whose build_model prints control bytes.
HOSTILE_HOOKS = r"""
def build_model():
    print("reset\x1bc shift\x0e bell\x07 tab\there del\x7f csi\x9b end")
    print("\x1b[31mred\x1b[0m and \x1b[2Jclear")
    return tiny.build_model()
"""


def test_control_bytes_are_escaped_on_the_display_and_kept_in_the_log(tmp_path: Path) -> None:
    write_recipe(tmp_path, HOSTILE_HOOKS, "hostile.py")
    spec = write_spec(
        tmp_path / "run.yaml", recipe={"source": str(tmp_path / "hostile.py"), "dataset": {}}
    )
    result = run_train(["--config", str(spec), "--devices", "1"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (
        "[rank 0] reset\\x1bc shift\\x0e bell\\x07 tab\there del\\x7f csi\\x9b end\n"
        in result.stdout
    )
    # Not a terminal: the rank's colours are dropped; any other escape sequence is escaped.
    assert "[rank 0] red and \\x1b[2Jclear\n" in result.stdout
    for byte in ("\x1b", "\x0e", "\x07", "\x7f", "\x9b"):
        assert byte not in result.stdout
    log = (only_run_dir(tmp_path / "runs") / "logs" / "rank-0.log").read_bytes()
    assert "reset\x1bc shift\x0e bell\x07 tab\there del\x7f csi\x9b end\n".encode() in log
    assert b"\x1b[31mred\x1b[0m and \x1b[2Jclear\n" in log


_WRITERS = """
import threading, time
from rich.console import Console
from launcher.launch.display.sinks import PlainSink

console = Console(highlight=False, soft_wrap=True)
sink = PlainSink(console)
chunk = b"".join(b"line %06d " % i + b"x" * 200 + b"\\n" for i in range(300))
display = threading.Thread(target=lambda: [sink.block(0, chunk) for _ in range(400)])
display.start()
while display.is_alive():
    console.print("SIGINT: every rank finishes its step")
    time.sleep(0.001)
display.join()
"""


@pytest.mark.timeout(60)
def test_the_launchers_own_lines_never_land_inside_a_block(tmp_path: Path) -> None:
    """The display writes blocks of a rank's lines from its thread while the launcher prints
    its own messages (a signal received) from the main thread, into one pipe that its reader
    drains late (a busy terminal, CI): no line may be cut by another."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITERS], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    time.sleep(0.5)  # the pipe fills up: the writers' writes go out in parts
    out, _ = proc.communicate(timeout=50)
    assert proc.returncode == 0
    lines = out.splitlines()
    ours = [line for line in lines if line.startswith("SIGINT")]
    assert ours and all(line == "SIGINT: every rank finishes its step" for line in ours)
    blocks = [line for line in lines if not line.startswith("SIGINT")]
    assert len(blocks) == 120_000
    assert all(line.startswith("[rank 0] line ") and line.endswith("x" * 200) for line in blocks)
