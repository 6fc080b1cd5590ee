"""Counted FLOPs (FlopCounterMode around the first micro-batch's forward and backward): the
GPT recipe's count is the transformer formula's, the MLP's is its matmuls exactly; the figures
reach the log line, metrics.jsonl and summary.json; the count calls nothing of the recipe's
that the step would not (build_model once per process, loss once per micro-batch); a
resumed run keeps its checkpoint's count; and what the count leaves out (an LSTM's
recurrence) is said in one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from launcher.worker.flops import count_flops, describe, peak_flops
from launcher.worker.recipe import load_recipe
from tests.conftest import REPO, metrics_of, only_run_dir, run_train, write_spec
from tests.tiny_recipes import tiny_recipe, write_recipe

pytestmark = pytest.mark.timeout(120)


def test_the_gpt_count_is_the_transformer_formula() -> None:
    recipe = load_recipe(str(REPO / "recipes" / "gpt.py"))
    n_layer, width, vocab, batch, length = 2, 64, 256, 4, 64
    model = {"n_layer": n_layer, "n_head": 2, "n_embd": width, "block_size": length}
    tokens = torch.zeros(batch, length, dtype=torch.long)
    with torch.device("meta"):
        meta_model = recipe.build_model(**model)
    counted = count_flops(recipe, meta_model, (tokens, tokens))
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
    counted = _count(recipe.build_model(), batch, recipe)
    forward = sum(2 * n * a * b for a, b in sizes)
    # Backward: every weight's gradient, and every input's but the data's (it needs none).
    backward = forward + sum(2 * n * a * b for a, b in sizes[1:])
    assert counted == forward + backward


def _count(model: torch.nn.Module, batch: tuple, recipe, speed=None) -> int:  # type: ignore[no-untyped-def]
    """What the loop does: the first micro-batch's forward and backward under `counting`."""
    from launcher.worker.flops import Speed

    speed = speed or Speed(torch.device("cpu"), "fp32", True, 1)
    with speed.counting(batch):
        loss, _ = recipe.loss(model, batch)
        loss.backward()
    return speed.per_step


def test_a_model_that_reads_values_is_counted_too() -> None:
    """The count follows the real step: a model that reads a value on the host (`.item()`)
    runs as it does in training, and is counted."""

    class Reads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.layer(x)
            return -out if out.sum().item() > 0 else out

    recipe = load_recipe(str(REPO / "recipes" / "mlp.py"))
    counted = _count(Reads(), (torch.zeros(2, 4), torch.zeros(2, 1)), recipe)
    assert counted == 2 * 2 * 4 * 1 * 2  # forward and the weight's gradient


def test_a_resumed_run_keeps_its_checkpoints_count_for_the_same_shapes() -> None:
    from launcher.worker.flops import Speed

    recipe = load_recipe(str(REPO / "recipes" / "mlp.py"))
    batch = (torch.zeros(8, 16), torch.zeros(8, 1))
    first = Speed(torch.device("cpu"), "fp32", True, 1)
    counted = _count(recipe.build_model(), batch, recipe, first)
    resumed = Speed(torch.device("cpu"), "fp32", True, 1)
    resumed.load_state_dict(first.state_dict())
    with resumed.counting(batch):
        pass  # nothing counted: the checkpoint's count stands
    assert resumed.per_step == counted
    other = Speed(torch.device("cpu"), "fp32", True, 1)
    other.load_state_dict(first.state_dict())
    bigger = (torch.zeros(16, 16), torch.zeros(16, 1))  # a new batch size: counted again
    assert _count(recipe.build_model(), bigger, recipe, other) == 2 * counted


# Hooks on the tiny recipe (one hidden layer of 8, 64 samples): each build and loss call
# leaves a mark in $MARKS.
COUNTING_HOOKS = """
import os
from pathlib import Path

from torch import nn

def _mark(what):
    marks = Path(os.environ["MARKS"])
    marks.mkdir(exist_ok=True)
    with open(marks / f"{what}-{os.environ['RANK']}", "a") as f:
        f.write("x")

def build_model(hidden):
    _mark("build_model")
    print("building the model (once)")
    return tiny.build_model(hidden=hidden)

def init_weights(model):  # fsdp builds it on meta and initialises each rank's shards
    for p in model.parameters():
        nn.init.normal_(p, std=0.1)

def loss(model, batch):
    _mark("loss")
    return tiny.loss(model, batch)
"""


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_recipe_runs_as_often_as_documented_and_flops_are_counted(
    tmp_path: Path, strategy: str
) -> None:
    """build_model once per process (fsdp's meta build included), loss once per micro-batch."""
    recipe = write_recipe(tmp_path, COUNTING_HOOKS, "counting.py")
    spec = write_spec(
        tmp_path / "run.yaml",
        launch={"strategy": strategy},
        recipe=tiny_recipe(recipe, model={"hidden": 8}, n_samples=64),
        train={"max_steps": 3, "log_every": 3, "grad_accum_steps": 2},
        checkpoint={"enabled": False},
    )
    marks = tmp_path / "marks"
    result = run_train(["--config", str(spec)], cwd=tmp_path, env={"MARKS": str(marks)})
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in (0, 1):
        assert (marks / f"build_model-{rank}").read_text() == "x"
        assert (marks / f"loss-{rank}").read_text() == "x" * 6  # 3 steps of 2 micro-batches
    # One line for both ranks (the display merges the same line from every rank), once.
    assert result.stdout.count("building the model (once)") == 1, result.stdout
    summary = json.loads((only_run_dir(tmp_path / "runs") / "summary.json").read_text())
    per_micro_batch = 3 * 2 * 8 * (4 * 8 + 8 * 1) - 2 * 8 * 4 * 8  # no input gradient
    assert summary["flops_per_step"] == 2 * per_micro_batch


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
    records = metrics_of(run)
    assert all(r["tflops_per_device"] > 0 and "mfu" not in r for r in records)
    # A CPU's rate in a unit that reads (MFLOP/s or GFLOP/s here), not 3.51e-05 TFLOP/s.
    assert re.search(r" \| \d+(\.\d+)? [kMG]FLOP/s", result.stdout), result.stdout
    assert "TFLOP/s" not in result.stdout and "MFU" not in result.stdout
    status = (run / "telemetry" / "rank-0.jsonl").read_text()
    assert "tflops_per_device" in status


def test_what_the_count_leaves_out_is_said_in_one_line(capsys: pytest.CaptureFixture) -> None:
    """An LSTM's recurrence (`mkldnn_rnn_layer` on a CPU, `_cudnn_rnn` on a GPU) has no
    formula in torch's counter: the line names it, and says whether anything was counted."""
    from launcher.worker.flops import Speed

    def counted(model: torch.nn.Module, *inputs: torch.Tensor) -> str:
        speed = Speed(torch.device("cpu"), "fp32", True, 1)
        with speed.counting(inputs):
            out = model(*inputs)
            (out[0] if isinstance(out, tuple) else out).sum().backward()
        return capsys.readouterr().out

    lstm = counted(torch.nn.LSTM(4, 8, batch_first=True), torch.randn(2, 5, 4))
    assert lstm.startswith("FLOPs not counted: torch.utils.flop_counter has no formula for aten.")
    assert re.search("rnn|lstm", lstm) and lstm.count("\n") == 1, lstm
    recipe = load_recipe(str(REPO / "recipes" / "varlen.py"))  # its linear head is counted
    samples = [recipe.module.build_dataset("train", n_samples=2)[i] for i in range(2)]
    batch = recipe.module.collate(samples)
    speed = Speed(torch.device("cpu"), "fp32", True, 1)
    with speed.counting(batch):
        recipe.loss(recipe.build_model(), batch)[0].backward()
    assert capsys.readouterr().out.startswith("FLOPs partly counted: ")
    assert speed.per_step and speed.per_step > 0
    assert counted(torch.nn.Linear(4, 2), torch.randn(3, 4)) == ""  # all of it counted


def test_the_cpus_fused_attention_is_counted_by_torchs_formula(
    capsys: pytest.CaptureFixture,
) -> None:
    """On a CPU, scaled_dot_product_attention runs `_scaled_dot_product_flash_attention_for_cpu`
    (and its backward): counted as torch counts its GPU siblings, QK^T and AV forward (4 B H
    L^2 D) and five such matmuls backward (10 B H L^2 D), with no line about a partial count."""
    from launcher.worker.flops import Speed

    b, h, length, d = 2, 2, 8, 4
    q, k, v = (torch.randn(b, h, length, d, requires_grad=True) for _ in range(3))
    speed = Speed(torch.device("cpu"), "fp32", True, 1)
    with speed.counting((q, k, v)):
        attention = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        attention.sum().backward()
    assert speed.per_step == 14 * b * h * length**2 * d
    assert capsys.readouterr().out == ""


@pytest.mark.smoke
def test_grouped_query_attention_is_counted_as_its_heads_repeated() -> None:
    """Fewer key-value heads than query heads (Llama's and Qwen's GQA, `enable_gqa`): counted
    as attention over the query's heads, which the kernels broadcast the key-value heads to.
    torch 2.9 and 2.11's formulas refuse such shapes, which stopped every such run at its
    first step."""
    from launcher.worker.flops import Speed

    b, heads, kv_heads, length, d = 2, 4, 2, 8, 4
    q = torch.randn(b, heads, length, d, requires_grad=True)
    k, v = (torch.randn(b, kv_heads, length, d, requires_grad=True) for _ in range(2))
    speed = Speed(torch.device("cpu"), "fp32", True, 1)
    with speed.counting((q, k, v)):
        attention = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        )
        attention.sum().backward()
    assert speed.per_step == 14 * b * heads * length**2 * d


@pytest.mark.parametrize(
    ("tflops", "line", "cell"),
    [
        (391.2, " | 391.2 TFLOP/s", "391.2T"),
        (2250.0, " | 2250.0 TFLOP/s", "2250.0T"),  # a B200's peak stays in TFLOP/s
        (3.51e-2, " | 35.1 GFLOP/s", "35.1G"),
        (3.51e-8, " | 35.1 kFLOP/s", "35.1k"),
        (8.12e-4, " | 812.0 MFLOP/s", "812.0M"),
    ],
)
def test_a_rate_is_shown_in_a_unit_that_reads(tflops: float, line: str, cell: str) -> None:
    """The log line and the live table's column (`FLOP/s`) give a CPU's rate in GFLOP/s or
    MFLOP/s, where both used to say `3.51e-08 TFLOP/s`."""
    import json

    from rich.console import Console

    from launcher.launch.display.status import TelemetryBoard

    assert describe({"tflops_per_device": tflops}) == line
    board = TelemetryBoard([0])
    board.update(0, json.dumps({"step": 3, "max_steps": 9, "tflops_per_device": tflops}))
    console = Console(record=True, width=120)
    console.print(board.render())
    table = console.export_text()
    assert "FLOP/s" in table and "TFLOP/s" not in table, table
    assert f" {cell} " in table, table
