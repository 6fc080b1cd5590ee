"""Runs of one model in several layouts of parallelism, compared with ddp on the same global
batch (`tests/parallel/test_dims.py`, `test_pipeline.py`, `test_pipeline_hf.py`). The ddp
reference on 2 processes is trained once per session (`tests/parallel/conftest.py`'s
`ddp_on_2`), and every layout compares with it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import yaml

from tests.conftest import (
    REPO,
    finish_train,
    metrics_of,
    only_run_dir,
    run_train,
    wait_for_step,
)
from tests.forked_train import fork_train, train_in_fork

# fp32, no dropout: the layouts differ only in how sums are ordered.
GPT = {
    "source": str(REPO / "recipes" / "gpt.py"),
    "model": {"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 16, "dropout": 0.0},
    "dataset": {"block_size": 16, "max_bytes": 120_000},
}

# The GPT recipe, recording which batch each process of a 4-process run trained on.
PROBE = f"""
import importlib.util, os

_spec = importlib.util.spec_from_file_location("gpt", {str(REPO / "recipes" / "gpt.py")!r})
gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)
build_model, build_dataset, parallelize = gpt.build_model, gpt.build_dataset, gpt.parallelize


def loss(model, batch):
    if model.training and os.environ["WORLD_SIZE"] == "4":
        with open(f"batches-{{os.environ['RANK']}}.txt", "a") as out:
            out.write(f"{{int(batch[0].sum())}}\\n")
    return gpt.loss(model, batch)
"""


def spec_file(path: Path, devices: int, strategy: str, steps: int = 20, **sections: dict) -> Path:
    spec = {
        "run": {"name": "dims", "output_dir": str(path.parent / "runs"), "seed": 3},
        "launch": {"accelerator": "cpu", "devices": devices, "strategy": strategy},
        "recipe": dict(GPT),
        "data": {"batch_size": 4},
        "optim": {"name": "AdamW", "lr": 0.003},
        "train": {"max_steps": steps, "log_every": 1, "grad_clip_norm": 1.0},
        "checkpoint": {"every_n_steps": 10, "async": False},
        "eval": {"every_n_steps": 10, "max_batches": 3},
    }
    for name, values in sections.items():
        spec.setdefault(name, {}).update(values)
    path.write_text(yaml.safe_dump(spec))
    return path


def train(cwd: Path, spec: Path, run_dir: str, *extra: str) -> subprocess.CompletedProcess[str]:
    result = run_train(["--config", str(spec), "--run-dir", str(cwd / run_dir), *extra], cwd, 240)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def curves(run_dir: Path) -> tuple[list[float], list[float], list[float]]:
    records = metrics_of(run_dir)
    losses = [r["loss"] for r in records if "loss" in r]
    norms = [r["grad_norm"] for r in records if "grad_norm" in r]
    vals = [r["val/loss"] for r in records if "val/loss" in r]
    return losses, norms, vals


def assert_close(ours: list[float], theirs: list[float], rel: float) -> None:
    assert len(ours) == len(theirs) and ours, (ours, theirs)
    assert ours == pytest.approx(theirs, rel=rel, abs=rel), (ours, theirs)


def resumes_as_ddp(folder: Path, run: str, layout: str, rel: float, ddp: str = "ddp.yaml") -> str:
    """`folder/run`'s step-10 checkpoint (a 4-process `layout`) resumed as ddp on 2 (the spec
    `folder/ddp`, naming the recipe the run trained) gives steps 11-20 of `folder/ddp`, within
    `rel`; returns the checkpoint's path."""
    checkpoint = str(folder / run / "checkpoints" / "step-00000010")
    resumed = train(folder, folder / ddp, f"{run}-as-ddp", "--resume", checkpoint)
    assert f"resuming on 2 processes instead of 4 processes ({layout})" in resumed.stdout
    assert_close(curves(folder / f"{run}-as-ddp")[0], curves(folder / "ddp")[0][10:], rel=rel)
    return checkpoint


def assert_exports_alike(folder: Path, ours: str, theirs: str) -> None:
    """`train export` of the runs `folder/ours` and `folder/theirs`: the same names, and the
    same tensors to float32 rounding over 20 steps."""
    for name in (ours, theirs):
        out = folder / f"{name}.pt"
        if out.exists():  # exported for another layout's comparison: `train export` keeps it
            continue
        export = train_in_fork(["export", str(folder / name), "--out", str(out)], folder)
        assert export.returncode == 0, export.stdout + export.stderr
    mine, other = torch.load(folder / f"{ours}.pt"), torch.load(folder / f"{theirs}.pt")
    assert mine.keys() == other.keys()
    for key, tensor in other.items():
        torch.testing.assert_close(mine[key], tensor, rtol=1e-4, atol=1e-5)


def assert_a_killed_run_resumes_bit_for_bit(folder: Path, run: str) -> None:
    """`folder/run.yaml` started again, SIGKILLed whole past its step-10 save, then `--resume
    latest`: steps 11-20 and the exported weights are those of `folder/run`, uninterrupted,
    to the bit."""
    spec = folder / f"{run}.yaml"
    proc = fork_train(["--config", str(spec)], folder)  # into runs/, where latest looks
    try:
        wait_for_step(wait_for_run_dir(folder / "runs"), 0, 13, proc)  # past the step-10 save
        kill_tree(proc)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    resumed = finish_train(
        fork_train(["--config", str(spec), "--resume", "latest"], folder), folder, timeout=240
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    run_dir = only_run_dir(folder / "runs")
    ours, theirs = curves(run_dir), curves(folder / run)
    # Steps 11-20 as the uninterrupted run logged them, to the bit (steps 11-13 logged twice).
    assert ours[0][-10:] == theirs[0][-10:] and ours[1][-10:] == theirs[1][-10:]
    exported = [export_plain(folder, name) for name in (str(run_dir), run)]
    for key, tensor in exported[1].items():
        assert torch.equal(exported[0][key], tensor), key


def wait_for_run_dir(runs: Path) -> Path:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = [p for p in runs.glob("*/*") if p.is_dir()] if runs.exists() else []
        if found:
            return found[0]
        time.sleep(0.05)
    pytest.fail(f"no run folder appeared under {runs}")


def kill_tree(proc: object) -> None:
    """SIGKILL of the launcher and every process under it (the whole run)."""
    root = psutil.Process(proc.pid)  # type: ignore[attr-defined]
    tree = [root, *root.children(recursive=True)]
    for p in tree:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(tree, timeout=30)


def export_plain(folder: Path, run: str) -> dict[str, torch.Tensor]:
    out = folder / f"{Path(run).name}.pt"
    result = train_in_fork(["export", str(folder / run), "--out", str(out)], folder)
    assert result.returncode == 0, result.stdout + result.stderr
    return torch.load(out)


def assert_hf_export_matches(folder: Path, ours: str, theirs: str, family: str) -> None:
    """`export --hf` of both runs loads with `from_pretrained`; the logits agree within 1e-5."""
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = []
    for name in (ours, theirs):
        out = folder / f"{name}-hf"
        result = train_in_fork(["export", str(folder / name), "--hf", str(out)], folder)
        assert result.returncode == 0, result.stdout + result.stderr
        model = _transformers().AutoModelForCausalLM.from_pretrained(out).eval()
        if family == "gpt2":
            assert model.lm_head.weight is model.transformer.wte.weight
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def _transformers() -> Any:  # imported where a test compares Hugging Face exports
    import transformers

    return transformers
