"""Counted FLOPs (FlopCounterMode on a meta copy of the model): the GPT recipe's count is the
transformer formula's, the MLP's is its matmuls exactly; the figures reach the log line,
metrics.jsonl and summary.json; a model that cannot run on meta is said, never fatal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from launcher.worker.flops import count_flops, describe, peak_flops
from launcher.worker.recipe import load_recipe
from tests.conftest import REPO, only_run_dir, run_train, write_spec

pytestmark = pytest.mark.timeout(120)


def test_the_gpt_count_is_the_transformer_formula() -> None:
    recipe = load_recipe(str(REPO / "recipes" / "gpt.py"))
    n_layer, width, vocab, batch, length = 2, 64, 256, 4, 64
    model = {"n_layer": n_layer, "n_head": 2, "n_embd": width, "block_size": length}
    tokens = torch.zeros(batch, length, dtype=torch.long)
    counted = count_flops(recipe, model, (tokens, tokens))
    # 6 FLOPs per matmul weight per token (forward 2, backward 4): a block's 12 C^2 weights
    # (qkv 3, proj 1, mlp 4 + 4) and the lm_head; embeddings are lookups, not matmuls. Plus
    # attention's QK^T and AV, 4 B L^2 C per layer forward, twice that backward (counted
    # whole: the counter does not halve a causal mask's work).
    matmul_weights = n_layer * 12 * width**2 + width * vocab
    formula = 6 * matmul_weights * batch * length + 12 * n_layer * batch * length**2 * width
    assert abs(counted - formula) / formula < 0.05, (counted, formula)


def test_the_mlp_count_is_its_matmuls_exactly() -> None:
    recipe = load_recipe(str(REPO / "recipes" / "mlp.py"))
    n, sizes = 8, [(16, 64), (64, 64), (64, 1)]
    batch = (torch.zeros(n, 16), torch.zeros(n, 1))
    counted = count_flops(recipe, {}, batch)
    forward = sum(2 * n * a * b for a, b in sizes)
    # Backward: every weight's gradient, and every input's but the data's (it needs none).
    backward = forward + sum(2 * n * a * b for a, b in sizes[1:])
    assert counted == forward + backward


COUNTING_RECIPE = """
import torch
from torch import nn

calls = 0


class Reads(nn.Module):
    def __init__(self, read):
        super().__init__()
        self.layer, self.read = nn.Linear(4, 1), read

    def forward(self, x):
        if self.read and self.layer(x).sum().item() > 0:  # no meta tensor has a value
            return -self.layer(x)
        return self.layer(x)


def build_model(read=False):
    return Reads(read)


def build_dataset(split):
    return torch.utils.data.TensorDataset(torch.zeros(8, 4))


def loss(model, batch):
    global calls
    calls += 1
    return model(batch).mean()
"""


@pytest.mark.parametrize("read", [False, True])
def test_counting_leaves_the_recipes_state_alone(tmp_path: Path, read: bool) -> None:
    """The count runs a fresh copy of the recipe's module: the training's recipe sees no
    extra call of its loss (a recipe may count its calls); one that reads values on the host
    is not counted, and says why."""
    from launcher.worker.flops import Speed

    (tmp_path / "counting.py").write_text(COUNTING_RECIPE)
    recipe = load_recipe(str(tmp_path / "counting.py"))
    speed = Speed(torch.device("cpu"), "fp32", True, 1)
    note = speed.count(recipe, {"read": read}, torch.zeros(2, 4))
    assert recipe.module.calls == 0
    if read:
        assert note is not None and note.startswith("FLOPs not counted"), note
        assert speed.per_step is None and speed.fields(0.1) == {}
    else:
        assert note is None and speed.per_step == 2 * 2 * 4 * 2  # forward and weight grad
    assert speed.count(recipe, {}, torch.zeros(2, 4)) is None  # once per process


def test_the_peak_table() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16", True) == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16", True) == 756e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp32", True) == 494.5e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp32", False) == 67e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp16", True) == 312e12
    assert peak_flops("NVIDIA GeForce RTX 3090", "bf16", True) is None
    assert peak_flops(None, "bf16", True) is None  # CPU, TPU
    line = describe({"tflops_per_device": 391.2, "mfu": 0.3955})
    assert line == " | 391.2 TFLOP/s | MFU 39.6%"


def test_a_run_reports_flops_per_step_and_tflops(tmp_path: Path) -> None:
    spec = write_spec(
        tmp_path / "run.yaml",
        launch={"devices": 1},
        data={"batch_size": 8},
        train={"max_steps": 4, "grad_accum_steps": 2, "log_every": 2},
        checkpoint={"enabled": False},
    )
    result = run_train(["--config", str(spec)], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run = only_run_dir(tmp_path / "runs")
    summary = json.loads((run / "summary.json").read_text())
    per_micro_batch = 232_448  # test_the_mlp_count_is_its_matmuls_exactly, at 8 samples
    assert summary["flops_per_step"] == 2 * per_micro_batch
    assert summary["tflops_per_device"] > 0 and summary["peak_flops"] is None
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["tflops_per_device"] > 0 and "mfu" not in r for r in records)
    assert "TFLOP/s" in result.stdout and "MFU" not in result.stdout
    status = (run / "telemetry" / "rank-0.jsonl").read_text()
    assert "tflops_per_device" in status
