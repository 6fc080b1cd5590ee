"""`train` end to end, as a user runs it: real processes, real gloo, real files."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO, metrics_of, only_run_dir, run_train, write_spec

pytestmark = pytest.mark.timeout(180)


@pytest.mark.smoke
def test_two_ranks_stream_prefixed_logs_and_write_run_files(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "run.yaml", checkpoint={"every_n_steps": 5})
    result = run_train(["--config", str(spec)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr + result.stdout
    out = result.stdout
    assert "\x1b[" not in out  # not a terminal: plain lines, no ANSI codes
    assert "[rank 0] process 0/2" in out and "[rank 1] process 1/2" in out
    assert "[ranks 0-1] " in out  # the header every rank prints, folded into one line
    assert "[rank 0] step 10/10 | loss" in out

    run = only_run_dir(tmp_path / "runs")
    for rank in (0, 1):
        log = (run / "logs" / f"rank-{rank}.log").read_text()
        assert f"process {rank}/2" in log
    metrics = metrics_of(run)
    assert [m["step"] for m in metrics] == list(range(1, 11))
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert checkpoints == ["step-00000005", "step-00000010"]
    assert (run / "checkpoints" / "step-00000010" / "COMPLETE").is_file()
    assert "max_steps: 10" in (run / "spec.yaml").read_text()


def test_recipe_file_outside_the_repo_trains_on_two_devices(tmp_path: Path) -> None:
    recipe = tmp_path / "elsewhere" / "my_recipe.py"
    recipe.parent.mkdir()
    (recipe.parent / "my_helpers.py").write_text("WIDTH = 8\n")
    recipe.write_text(
        textwrap.dedent("""
        import torch
        from torch.utils.data import TensorDataset
        from my_helpers import WIDTH  # a sibling module, as a script would import it

        def build_model():
            return torch.nn.Linear(WIDTH, 1)

        def build_dataset(split):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(256, WIDTH, generator=g)
            return TensorDataset(x, x.sum(1, keepdim=True))

        def loss(model, batch):
            x, y = batch
            return torch.nn.functional.mse_loss(model(x), y)
    """)
    )
    spec = write_spec(
        tmp_path / "run.yaml", recipe={"source": "elsewhere/my_recipe.py", "dataset": {}}
    )
    result = run_train(["--config", str(spec), "--devices", "2", "train.max_steps=4"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr + result.stdout
    assert "[rank 0] step 4/4" in result.stdout


def test_resume_latest_continues_the_same_run(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "run.yaml", checkpoint={"every_n_steps": 3})
    first = run_train(["--config", str(spec), "train.max_steps=6"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr + first.stdout
    second = run_train(
        ["--config", str(spec), "--resume", "latest", "train.max_steps=9"], cwd=tmp_path
    )
    assert second.returncode == 0, second.stderr + second.stdout
    assert "resumed at step 6" in second.stdout
    assert "step 7/9" in second.stdout and "step 1/9" not in second.stdout
    run = only_run_dir(tmp_path / "runs")  # continued in place, no second run folder
    steps = [r["step"] for r in metrics_of(run)]
    assert steps == list(range(1, 10))
    assert (run / "spec.yaml").is_file() and (run / "spec.resume-1.yaml").is_file()


def test_quickstart_config_is_what_make_demo_runs(tmp_path: Path) -> None:
    result = run_train(
        [
            "--config",
            str(REPO / "configs" / "quickstart.yaml"),
            f"run.output_dir={tmp_path}/runs",
            "train.max_steps=20",
            "--ranks",
            "1",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr + result.stdout
    assert "[rank 1] process 1/2" in result.stdout
    assert "[rank 0] process 0/2" not in result.stdout  # hidden by --ranks 1


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_on_cpu(tmp_path: Path, precision: str) -> None:
    spec = write_spec(tmp_path / "run.yaml", train={"precision": precision, "max_steps": 8})
    result = run_train(["--config", str(spec), "optim.name=AdamW", "optim.lr=1e-2"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr + result.stdout
    run = only_run_dir(tmp_path / "runs")
    losses = [r["loss"] for r in metrics_of(run)]
    assert len(losses) == 8 and all(loss == loss for loss in losses)  # no NaN
    assert losses[-1] < losses[0]
