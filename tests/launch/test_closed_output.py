"""A run whose output nobody reads any more (`train ... | head`, a closed terminal) trains to
its end and records how it really ended: the launcher stops writing, and says nothing of it."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from rich.console import Console

from launcher.launch.closed_output import LauncherConsole, flush_standard_streams
from launcher.launch.display import RunDisplay
from tests.conftest import TRAIN, finish_train, metrics_of, only_run_dir, start_train, write_spec

NOISE = ("Traceback", "BrokenPipeError", "Exception ignored", "display error")


def _assert_finished_whole(tmp_path: Path, steps: int) -> None:
    run_dir = only_run_dir(tmp_path / "runs")
    outcome = json.loads((run_dir / "outcome.json").read_text())
    assert (outcome["status"], outcome["exit_code"], outcome["reason"]) == ("finished", 0, "")
    records = metrics_of(run_dir)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, steps + 1))
    assert f"done: {steps} steps" in (run_dir / "logs" / "rank-0.log").read_text()


@pytest.mark.timeout(180)
def test_a_run_whose_stdout_is_closed_before_its_first_line_trains_to_the_end(tmp_path):
    # Before its first line: the launcher's own first print meets the closed pipe (rich's
    # answer was SystemExit(1): a finished run recorded as failed, exit 1).
    spec = write_spec(tmp_path / "run.yaml", train={"max_steps": 6, "log_every": 1})
    proc = start_train(["--config", str(spec)], cwd=tmp_path)
    assert proc.stdout is not None
    proc.stdout.close()
    result = finish_train(proc, tmp_path)
    assert result.returncode == 0, result.stderr
    for noise in NOISE:
        assert noise not in result.stderr, result.stderr
    _assert_finished_whole(tmp_path, steps=6)


@pytest.mark.timeout(180)
def test_train_piped_into_head_ends_as_the_run_did(tmp_path):
    spec = write_spec(tmp_path / "run.yaml", train={"max_steps": 12, "log_every": 1})
    command = f"'{TRAIN}' --config '{spec}' 2>&1 | head -3; exit ${{PIPESTATUS[0]}}"
    proc = subprocess.Popen(
        ["bash", "-c", command],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        start_new_session=True,
    )
    result = finish_train(proc, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(result.stdout.splitlines()) == 3
    assert not any(noise in result.stderr for noise in NOISE), result.stderr
    _assert_finished_whole(tmp_path, steps=12)
    listed = subprocess.run(
        [str(TRAIN), "runs", "--json"], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert [row["status"] for row in json.loads(listed.stdout)] == ["finished"]


def _closed_pipe() -> tuple[object, int]:
    """A writable text file whose reader is gone, and its file descriptor."""
    read, write = os.pipe()
    os.close(read)
    return os.fdopen(write, "w"), write


def test_the_console_goes_quiet_when_its_reader_is_gone():
    out, fd = _closed_pipe()
    console = LauncherConsole(file=out)
    console.print("a line nobody reads")  # rich's own Console raises SystemExit(1) here
    assert console.quiet
    console.print("and nothing more")
    assert os.path.samefile(f"/proc/self/fd/{fd}", os.devnull)
    out.close()


def test_a_closed_terminal_quiets_the_console_too():
    class ClosedTerminal(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(errno.EIO, "Input/output error")  # what a hung-up tty answers

    console = LauncherConsole(file=ClosedTerminal())
    console.print("a line nobody sees")
    assert console.quiet


@pytest.mark.timeout(30)
def test_the_display_stops_writing_to_a_closed_stdout_and_says_nothing(tmp_path, capfd):
    out, _ = _closed_pipe()
    console = Console(file=out, force_terminal=False)
    display = RunDisplay(tmp_path, [0], console=console)
    display.start()
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank-0.log").write_text("a line\n" * 3)
    deadline = time.monotonic() + 10
    while not console.quiet and time.monotonic() < deadline:
        time.sleep(0.05)
    display.stop()
    assert console.quiet
    assert capfd.readouterr().err == ""
    out.close()


def test_flushing_what_a_closed_stdout_never_took_succeeds(monkeypatch):
    out, fd = _closed_pipe()
    out.write("still buffered\n")
    monkeypatch.setattr("sys.stdout", out)
    flush_standard_streams()  # the interpreter's exit would say BrokenPipeError, and exit 120
    assert os.path.samefile(f"/proc/self/fd/{fd}", os.devnull)
    out.close()
