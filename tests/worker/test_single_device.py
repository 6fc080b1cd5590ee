"""One process, no DDP: a world-size-1 run is not wrapped, yet trains bitwise as a DDP-wrapped
world-size-1 run does, and its checkpoints resume on two processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoint.test_resume import _assert_bitwise, _weights
from tests.conftest import REPO, free_port, metrics_of, run_train, tiny_gpt, write_spec

pytestmark = pytest.mark.timeout(240)

UNWRAPPED = "ddp: 1 process, nothing to all-reduce: the model runs unwrapped"

# The reference: the same worker plan, run by a worker whose ddp wraps one process in DDP too,
# as every world size was before.
WRAPPED_WORKER = """
import sys
from torch.nn.parallel import DistributedDataParallel
from launcher.worker import main as worker
from launcher.parallel.ddp import DDPStrategy

def wrap(self, model):
    return DistributedDataParallel(model.to(self.device), gradient_as_bucket_view=True)

DDPStrategy.wrap_model = wrap
worker.main(["--plan", sys.argv[1]])
"""


def _losses(run: Path) -> dict[int, float]:
    records = metrics_of(run)
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _run_wrapped(plan_of: Path, run_dir: Path) -> None:
    plan = json.loads((plan_of / "worker-plan.json").read_text())
    plan["run_dir"] = str(run_dir)
    run_dir.mkdir()
    (run_dir / "worker-plan.json").write_text(json.dumps(plan))
    env = {
        **os.environ,
        **{"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"},
        **{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())},
    }
    plan_file = str(run_dir / "worker-plan.json")
    result = subprocess.run(
        [sys.executable, "-c", WRAPPED_WORKER, plan_file], cwd=REPO, env=env, timeout=120
    )
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert result.returncode == 0, log
    assert UNWRAPPED not in log


def test_one_process_is_unwrapped_bitwise_as_ddp_and_resumes_on_two(tmp_path: Path) -> None:
    recipe = tiny_gpt(max_bytes=4000)
    recipe["model"]["dropout"] = 0.0  # the two-process resume draws other random numbers
    spec = write_spec(
        tmp_path / "run.yaml",
        launch={"devices": 1},
        recipe=recipe,
        data={"batch_size": 4, "shuffle": True},
        optim={"name": "AdamW", "lr": 3e-3},
        train={"max_steps": 6, "grad_accum_steps": 2, "log_every": 1, "grad_clip_norm": 1.0},
        checkpoint={"every_n_steps": 3},
    )
    plain = tmp_path / "plain"
    result = run_train(["--config", str(spec), "--run-dir", str(plain)], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert UNWRAPPED in result.stdout

    wrapped = tmp_path / "wrapped"
    _run_wrapped(plain, wrapped)
    assert sorted(_losses(plain)) == list(range(1, 7))
    assert _losses(plain) == _losses(wrapped)
    last = "checkpoints/step-00000006"
    _assert_bitwise(
        _weights(plain / last, tmp_path / "a.pt"), _weights(wrapped / last, tmp_path / "b.pt")
    )

    # The same global batch on two processes, from the unwrapped run's checkpoint.
    two = tmp_path / "two"
    args = ["--resume", str(plain / "checkpoints" / "step-00000003"), "--run-dir", str(two)]
    args += ["--devices", "2", "data.batch_size=2"]
    result = run_train(["--config", str(spec), *args], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resuming on 2 processes instead of 1 process" in result.stdout
    ours, theirs = _losses(two), _losses(plain)
    assert sorted(ours) == [4, 5, 6]
    for step in ours:
        torch.testing.assert_close(ours[step], theirs[step], rtol=1e-5, atol=1e-5)
