"""Shared helpers: run `train` as a user does, as a subprocess, and leave nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
TRAIN = Path(sys.executable).parent / "train"


def run_train(
    args: list[str], cwd: Path, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`train ARGS` in its own process group; killed as a group if it outlives `timeout`."""
    proc = subprocess.Popen(
        [str(TRAIN), *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"train {' '.join(args)} timed out after {timeout}s\n{out}\n{err}")
    finally:
        _assert_no_leftovers(proc.pid, marker=str(cwd))
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _assert_no_leftovers(pgid: int, marker: str) -> None:
    """Workers run in sessions of their own (the elastic agent starts them so), so look for
    them by the test's own folder in their command line as well as by process group."""
    left = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            mine = os.getpgid(p.pid) == pgid or any(marker in a for a in p.info["cmdline"] or [])
        except (ProcessLookupError, psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if mine and p.pid != os.getpid():
            left.append(p)
    for p in left:
        p.kill()
    assert not left, f"processes left behind: {[p.pid for p in left]}"


def usage_error(result: subprocess.CompletedProcess[str], *expected: str) -> None:
    """Exit code 2, no traceback, and every expected text in the output."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output
    for text in expected:
        assert text in output, output


def write_spec(path: Path, **sections: dict) -> Path:
    """A spec for the mlp recipe with small, fast defaults; `sections` override per key."""
    spec = {
        "run": {"name": "t", "output_dir": str(path.parent / "runs")},
        "launch": {"accelerator": "cpu", "devices": 2, "strategy": "ddp"},
        "recipe": {"source": str(REPO / "recipes" / "mlp.py"), "dataset": {"n_samples": 512}},
        "data": {"batch_size": 8},
        "optim": {"name": "SGD", "lr": 0.05},
        "train": {"max_steps": 10, "log_every": 1},
    }
    for name, values in sections.items():
        spec.setdefault(name, {}).update(values)
    path.write_text(yaml.safe_dump(spec))
    return path


def only_run_dir(runs: Path) -> Path:
    found = [p for p in runs.glob("*/*") if p.is_dir()]
    assert len(found) == 1, found
    return found[0]
