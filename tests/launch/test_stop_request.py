"""A stopped run's folder keeps no stop request: the launcher writes it to ask every rank to
finish its step and save (Ctrl-C, or a worker's own SIGTERM), and removes it once the run has
ended, so the folder holds only what the run left."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from launcher.rundir.layout import RunLayout
from tests.conftest import (
    FAULTY_RECIPE,
    finish_train,
    wait_for_step,
    write_spec,
)
from tests.forked_train import fork_train


@pytest.mark.timeout(180)
def test_ctrl_c_saves_and_leaves_no_stop_request(tmp_path: Path) -> None:
    (tmp_path / "faulty.py").write_text(FAULTY_RECIPE)
    spec = write_spec(
        tmp_path / "run.yaml",
        recipe={"source": "faulty.py", "dataset": {}},
        train={"max_steps": 200, "log_every": 5},
    )
    run_dir = tmp_path / "run"
    proc = fork_train(
        ["--config", str(spec), "--run-dir", str(run_dir)], tmp_path, {"FAULT": "slow"}
    )
    wait_for_step(run_dir, 0, 3, proc)
    os.kill(proc.pid, signal.SIGINT)
    result = finish_train(proc, tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 130, output
    assert "stopped by SIGINT; saved" in output
    assert not RunLayout(run_dir).stop_request.exists(), sorted(os.listdir(run_dir))
