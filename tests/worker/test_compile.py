"""`train.compile`: the repeated blocks compiled (inductor, on CPU here) train what eager
trains, within compiled kernels' rounding; a compiled run resumed from a checkpoint is bitwise
the compiled run that never stopped, and loads its kernels from the run folder's cache; a
recompilation after warm-up is reported, naming the step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.checkpoint.test_resume import _assert_bitwise, _weights
from tests.conftest import metrics_of, only_run_dir, run_train, tiny_gpt, write_spec

pytestmark = pytest.mark.timeout(300)


def _gpt(folder: Path, dropout: float, **sections: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    recipe = tiny_gpt(max_bytes=6000)
    recipe["model"] = {**recipe["model"], "n_layer": 2, "dropout": dropout}
    return write_spec(
        folder / "run.yaml",
        recipe=recipe,
        data={"batch_size": 4, "shuffle": True},
        optim={"name": "AdamW", "lr": 3e-3},
        train={"max_steps": 8, "grad_accum_steps": 2, "log_every": 1, "compile": True},
        eval={"every_n_steps": 4, "max_batches": 2},
        checkpoint={"every_n_steps": 4},
        **sections,
    )


def _run(spec: Path, *args: str) -> Path:
    """The run's folder: `--run-dir`'s where given."""
    result = run_train(["--config", str(spec), *args], cwd=spec.parent, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    given = [args[i + 1] for i, arg in enumerate(args) if arg in ("--run-dir", "--resume")]
    return Path(given[0]) if given else only_run_dir(spec.parent / "runs")


def _losses(run: Path) -> dict[int, float]:
    records = metrics_of(run)
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_compiled_fsdp_with_accumulation_and_eval_agrees_with_eager(tmp_path: Path) -> None:
    spec = _gpt(tmp_path / "compiled", dropout=0.0, launch={"strategy": "fsdp"})
    compiled = _run(spec)
    eager = _run(
        _gpt(tmp_path / "eager", dropout=0.0, launch={"strategy": "fsdp"}), "train.compile=false"
    )
    ours, theirs = _losses(compiled), _losses(eager)
    assert sorted(ours) == list(range(1, 9))
    # Fused kernels sum in another order: agreement to float32 rounding over 8 steps.
    for step in ours:
        torch.testing.assert_close(ours[step], theirs[step], rtol=1e-4, atol=1e-5)
    last = "checkpoints/step-00000008"
    a, b = _weights(compiled / last, tmp_path / "a.pt"), _weights(eager / last, tmp_path / "b.pt")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)
    assert (
        "train.compile: 2 x Block compiled block by block"
        in (compiled / "logs" / "rank-0.log").read_text()
    )
    summary = _summary(compiled)
    assert summary["dynamo_compilations"] > 0
    assert summary["flops_per_step"] > 0  # counted, compiled blocks included
    assert summary["dynamo_compilations_after_warmup"] == 0


def test_compiled_resume_is_bitwise_and_loads_the_cached_kernels(tmp_path: Path) -> None:
    """With dropout (inductor draws its own random numbers) and bf16 autocast. The run that
    stops at step 4 and resumes in its own folder compiles nothing afresh."""
    spec = _gpt(tmp_path, dropout=0.1, launch={"strategy": "ddp"})
    bf16 = "train.precision=bf16"
    full = _run(spec, "--run-dir", str(tmp_path / "full"), bf16)
    part = _run(spec, "--run-dir", str(tmp_path / "part"), bf16, "train.max_steps=4")
    _run(spec, "--resume", str(part), bf16, "train.max_steps=8")  # the run's own was 4
    ours, theirs = _losses(part), _losses(full)
    assert sorted(ours) == list(range(1, 9))
    assert ours == theirs
    last = "checkpoints/step-00000008"
    _assert_bitwise(
        _weights(part / last, tmp_path / "a.pt"), _weights(full / last, tmp_path / "b.pt")
    )
    cache = _summary(part)["compile_cache"]  # of the resumed run: training's graph, eval's
    assert cache["misses"] == 0 and cache["hits"] >= 2, cache


def test_a_recompilation_after_warm_up_names_the_step(tmp_path: Path) -> None:
    """36 samples in batches of 8: every epoch's fifth step has a batch of 4, a new shape."""
    spec = write_spec(
        tmp_path / "run.yaml",
        launch={"devices": 1},
        recipe={"dataset": {"n_samples": 36}},
        data={"batch_size": 8, "drop_last": False, "shuffle": False},
        train={"max_steps": 7, "compile": True},
        checkpoint={"enabled": False},
    )
    result = run_train(["--config", str(spec)], cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    output = result.stdout + result.stderr
    assert "step 5: torch.compile compiled" in output, output
    assert "new graph" in output
    # The first step's only micro-batch runs eager while its FLOPs are counted: the blocks
    # compile in step 2, as expected, not as a recompilation.
    assert "step 2: torch.compile" not in output, output
    summary = _summary(only_run_dir(tmp_path / "runs"))
    assert summary["dynamo_compilations_after_warmup"] >= 1
