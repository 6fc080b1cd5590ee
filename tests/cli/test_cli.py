"""The CLI at its boundary: `train` as a subprocess, its exit codes and messages. What is
refused before any worker starts runs in a fork of this process (tests/forked_train.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO, only_run_dir, run_train, write_spec
from tests.conftest import usage_error as _usage_error
from tests.forked_train import train_in_fork

pytestmark = pytest.mark.timeout(120)


def test_help_shows_every_flag_and_real_examples(tmp_path: Path) -> None:
    result = run_train(["--help"], cwd=tmp_path)
    assert result.returncode == 0
    for flag in (
        "--config",
        "--accelerator",
        "--devices",
        "--strategy",
        "--resume",
        "--run-dir",
        "--ranks",
        "--debug",
        "train --config configs/quickstart.yaml",
        "train validate",
    ):
        assert flag in result.stdout, flag


def test_validate_accepts_a_good_spec_and_runs_nothing(tmp_path: Path) -> None:
    result = train_in_fork(
        ["validate", "--config", str(REPO / "configs" / "gpt_ddp.yaml")], cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{REPO / 'configs' / 'gpt_ddp.yaml'}: ok · model GPT")
    assert result.stderr == ""
    assert not (tmp_path / "runs").exists()


def test_bad_spec_exits_2_with_every_problem_and_no_traceback(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "run.yaml", optim={"lr": "fast"}, data={"batch_sise": 3})
    result = train_in_fork(["--config", str(spec), "--devices", "0"], cwd=tmp_path)
    _usage_error(
        result,
        "3 problems",
        "optim.lr",
        "data.batch_sise",
        "did you mean 'data.batch_size'",
        "launch.devices (--devices)",
    )


def test_recipe_without_required_functions(tmp_path: Path) -> None:
    (tmp_path / "half.py").write_text("def build_model():\n    pass\n")
    spec = write_spec(tmp_path / "run.yaml", recipe={"source": "half.py"})
    result = train_in_fork(["validate", "--config", str(spec)], cwd=tmp_path)
    _usage_error(result, "half.py does not define build_dataset, loss")


def test_gpu_without_cuda_says_what_is_missing(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "run.yaml")
    result = train_in_fork(["--config", str(spec), "--accelerator", "gpu"], cwd=tmp_path)
    _usage_error(result, "--accelerator gpu: no CUDA GPU is visible", "--accelerator cpu")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--resume", "nowhere"], "--resume nowhere: no such folder"),
        (["--resume", "latest"], "--resume latest: no run named 't'"),
        (["--ranks", "3-1"], "--ranks: '3-1' is not a rank range"),
        (["--strategy", "xla", "--accelerator", "cpu"], "runs on TPUs through torch_xla"),
        (["--strategy", "fsdp", "--accelerator", "tpu"], "TPUs use xla_fsdp"),
        (["--strategy", "fsdp", "fsdp.cpu_offload=true"], "fsdp.cpu_offload: moves shards"),
    ],
)
def test_bad_flags(tmp_path: Path, args: list[str], expected: str) -> None:
    spec = write_spec(tmp_path / "run.yaml")
    _usage_error(train_in_fork(["--config", str(spec), *args], cwd=tmp_path), expected)


def test_an_existing_run_dir_is_never_overwritten(tmp_path: Path) -> None:
    existing = tmp_path / "mine"
    existing.mkdir()
    (existing / "notes.txt").write_text("precious")
    spec = write_spec(tmp_path / "run.yaml")
    result = train_in_fork(["--config", str(spec), "--run-dir", str(existing)], cwd=tmp_path)
    _usage_error(result, "already holds a run; it is never overwritten", "--resume")
    assert [p.name for p in existing.iterdir()] == ["notes.txt"]


def test_bad_model_arguments_name_the_key(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "run.yaml", recipe={"model": {"widht": 3}})
    result = train_in_fork(["--config", str(spec)], cwd=tmp_path)
    _usage_error(result, "recipe.model.widht: unknown key of build_model()", "valid here: in_dim")


def test_a_recipe_bug_shows_the_users_traceback(tmp_path: Path) -> None:
    (tmp_path / "buggy.py").write_text(
        textwrap.dedent("""
        def build_model():
            return helper()

        def helper():
            raise RuntimeError("my model is broken")

        def build_dataset(split):
            return []

        def loss(model, batch):
            return 0
    """)
    )
    spec = write_spec(tmp_path / "run.yaml", recipe={"source": "buggy.py", "dataset": {}})
    result = run_train(["--config", str(spec), "--ranks", "0"], cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    # Rank 1 is hidden by --ranks, but its traceback is an alert and still shown.
    assert (
        "[rank 1] RuntimeError: my model is broken" in result.stdout
        or "[ranks 0-1] RuntimeError: my model is broken" in result.stdout
    ), result.stdout
    assert 'buggy.py", line 6, in helper' in result.stdout
    assert "exited with an error (exit code 1)" in result.stdout
    run = only_run_dir(tmp_path / "runs")
    assert "my model is broken" in (run / "logs" / "rank-1.log").read_text()
