"""Pipelines on stock Hugging Face causal LMs (`parallel.pp`): Llama, Qwen3 and GPT-2 (its head
tied to its embedding), tiny and randomly initialised, cut by their own plan, run by torch's
schedules on 4 processes over gloo in fp32, with no pipeline hooks in the recipe
(`recipes/hf_causal_lm.py`): the launcher supplies the causal LM's. Each layout sees ddp's
global batch, so losses, gradient norms and evaluation means are ddp's; checkpoints keep the
whole model's names, so they resume bit for bit, resume as ddp, and export for
`from_pretrained`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launcher.parallel.pipeline.layout import MIN_TORCH
from tests.conftest import (
    REPO,
    usage_error,
)
from tests.forked_train import train_in_fork
from tests.parallel.layouts import (
    assert_a_killed_run_resumes_bit_for_bit,
    assert_close,
    assert_hf_export_matches,
    curves,
    resumes_as_ddp,
    spec_file,
    train,
)

transformers = pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.timeout(400),
    pytest.mark.skipif(
        tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < MIN_TORCH,
        reason="this torch is refused pipelines (tests/parallel/test_pipeline.py)",
    ),
]


def recipe(family: str) -> dict:
    return {
        "source": str(REPO / "recipes" / "hf_causal_lm.py"),
        "model": {"family": family},
        "dataset": {"seq_len": 16},
    }


def hf_spec(
    folder: Path, name: str, devices: int, strategy: str, family: str, **sections: dict
) -> Path:
    # lr 1e-3: Adam's first steps amplify the rounding of micro-batch sums less than at 3e-3.
    return spec_file(
        folder / f"{name}.yaml", devices, strategy, recipe=recipe(family),
        optim={"name": "AdamW", "lr": 0.001}, **sections,
    )  # fmt: skip


def pipelined(folder: Path, family: str, schedule: str, **parallel: object) -> Path:
    name = f"{family}-{schedule}"
    spec = hf_spec(
        folder, name, 4, "fsdp", family, parallel={"pp": 2, "pp_schedule": schedule, **parallel},
        checkpoint={"every_n_steps": 10, "async": False},
    )  # fmt: skip
    output = train(folder, spec, name).stdout
    assert "stage 0 (from the model's start) holds" in output  # and of the whole model's
    return folder / name


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ddp on 2 and pp 2 x dp_shard 2 on 4 (1F1B), 20 steps, checkpoints every 10."""
    folder = tmp_path_factory.mktemp("llama")
    train(folder, hf_spec(folder, "ddp", 2, "ddp", "llama"), "ddp")
    pipelined(folder, "llama", "1F1B")
    return folder


@pytest.mark.smoke
def test_a_stock_llama_pipelines_as_ddp_without_recipe_hooks(llama: Path) -> None:
    for ours, theirs in zip(curves(llama / "llama-1F1B"), curves(llama / "ddp"), strict=True):
        assert_close(ours, theirs, rel=1e-5)
    gpipe = pipelined(llama, "llama", "GPipe", dp_shard=1, dp_replicate=2)  # pp x ddp-like replicas
    for ours, theirs in zip(curves(gpipe), curves(llama / "ddp"), strict=True):
        assert_close(ours, theirs, rel=1e-5)


@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
def test_qwen3_and_a_tied_gpt2_pipeline_as_ddp(tmp_path: Path, family: str) -> None:
    train(tmp_path, hf_spec(tmp_path, "ddp", 2, "ddp", family), "ddp")
    for schedule in ("GPipe", "1F1B"):
        run = pipelined(tmp_path, family, schedule)
        for ours, theirs in zip(curves(run), curves(tmp_path / "ddp"), strict=True):
            assert_close(ours, theirs, rel=1e-5)
    if family == "gpt2":  # the tie kept: one weight, exported once, that loads tied
        assert_hf_export_matches(tmp_path, "gpt2-1F1B", "ddp", family)


def test_a_pipeline_of_tensor_parallel_stages_matches_ddp(llama: Path) -> None:
    # pp 2 x tp 2: one data-parallel rank, given ddp's global batch of 2 x 4.
    spec = hf_spec(
        llama, "pp-tp", 4, "fsdp", "llama", parallel={"pp": 2, "tp": 2},
        data={"batch_size": 8}, checkpoint={"enabled": False},
    )  # fmt: skip
    output = train(llama, spec, "pp-tp").stdout
    assert "fsdp (pp 2 x tp 2) on 4 x cpu" in output
    for ours, theirs in zip(curves(llama / "pp-tp"), curves(llama / "ddp"), strict=True):
        assert_close(ours, theirs, rel=1e-4)


def test_stages_that_compute_in_bf16_send_what_the_next_one_expects(tmp_path: Path) -> None:
    """`fsdp.param_dtype: bf16`: the stages compute in bf16 where the CPU example that sized
    the exchanges computed in fp32; what a stage sends is cast to the agreed dtype (before
    the fix the next stage read fp32 from bf16 bytes: a NaN loss at step 1)."""
    low = {"param_dtype": "bf16"}
    off = {"enabled": False}
    fsdp = hf_spec(tmp_path, "fsdp", 2, "fsdp", "llama", fsdp=low, checkpoint=off)
    train(tmp_path, fsdp, "fsdp")
    pp = hf_spec(tmp_path, "pp", 4, "fsdp", "llama", fsdp=low, checkpoint=off, parallel={"pp": 2})
    train(tmp_path, pp, "pp")
    for ours, theirs in zip(curves(tmp_path / "pp"), curves(tmp_path / "fsdp"), strict=True):
        assert_close(ours, theirs, rel=3e-2)  # bf16's rounding, summed in other orders


def test_a_pipeline_checkpoint_resumes_as_ddp_and_exports_for_from_pretrained(llama: Path) -> None:
    (llama / "ddp.yaml").write_text((llama / "ddp.yaml").read_text())  # resumes_as_ddp's spec
    resumes_as_ddp(llama, "llama-1F1B", "pp 2 x dp_shard 2", rel=1e-5)
    assert_hf_export_matches(llama, "llama-1F1B", "ddp", "llama")


def test_a_killed_pipeline_resumes_latest_bit_for_bit(llama: Path) -> None:
    assert_a_killed_run_resumes_bit_for_bit(llama, "llama-1F1B")


# train validate: the cut, and one forward and backward of every stage, before any start.

WRONG_HOOK = f"""
import importlib.util
import sys
import torch.nn.functional as F

sys.path.insert(0, {str(REPO / "recipes")!r})  # the recipe imports its sibling

_spec = importlib.util.spec_from_file_location("hf", {str(REPO / "recipes" / "hf_causal_lm.py")!r})
hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf)
build_model, build_dataset, loss = hf.build_model, hf.build_dataset, hf.loss


def loss_from_output(output, labels):
    return F.cross_entropy(output.logits.flatten(0, 1), labels.flatten())  # a tensor arrives
"""

T5 = """
import torch
from transformers import T5Config, T5ForConditionalGeneration


def build_model():
    return T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4))


def build_dataset(split):
    return [{"input_ids": torch.arange(8), "labels": torch.arange(8)} for _ in range(64)]


def loss(model, batch):
    return model(**batch).loss


def split_batch(batch):
    return (batch["input_ids"],), batch["labels"]


def loss_from_output(output, labels):
    return output.sum()
"""


@pytest.mark.parametrize(
    ("source", "overrides", "expected"),
    [
        (WRONG_HOOK, [], ["parallel.pp: stage 1 (from model.layers.2) fails on one micro-batch",
                          "'Tensor' object has no attribute 'logits'", "in loss_from_output"]),
        (T5, [], ["parallel.pp: T5ForConditionalGeneration is an encoder-decoder model",
                  "parallel.pp: 1"]),
        (None, ["recipe.model.family=gpt2", "parallel.pp_schedule=ZBVZeroBubble",
                "parallel.dp_shard=1", "parallel.dp_replicate=2"],
         ["ZBVZeroBubble cannot keep GPT2LMHeadModel's head tied", "tie_word_embeddings=False"]),
    ],
    ids=["a-hook-that-fails-on-the-last-stage", "encoder-decoder", "zero-bubble-of-a-tied-head"],
)  # fmt: skip
def test_validate_refuses_a_cut_that_would_fail_naming_the_cause(
    tmp_path: Path, source: str | None, overrides: list[str], expected: list[str]
) -> None:
    spec = hf_spec(tmp_path, "run", 4, "fsdp", "llama", parallel={"pp": 2})
    if source is not None:
        (tmp_path / "model.py").write_text(source)
        overrides = ["recipe.source=model.py", "recipe.model={}", "recipe.dataset={}"]
    result = train_in_fork(["validate", "--config", str(spec), *overrides], tmp_path)
    usage_error(result, *expected)


def test_validate_sums_the_stages_a_device_holds(tmp_path: Path) -> None:
    spec = hf_spec(
        tmp_path, "run", 4, "fsdp", "gpt2",
        parallel={"pp": 2, "pp_schedule": "Interleaved1F1B", "pp_microbatches": 4},
    )  # fmt: skip
    result = train_in_fork(["validate", "--config", str(spec)], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 stages (Interleaved1F1B, 4 micro-batches, cut by the order of its modules)" in (
        result.stdout
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("memory per device")]
    assert [
        "pp rank 0: stages 0 and 2 of 4" in lines[0],
        "pp rank 1: stages 1 and 3 of 4" in lines[1],
    ] == [True, True], lines

    # Each device's figures are its two stages' summed.
    from launcher.cli.dry_build import first_train_batch
    from launcher.cli.recipe_check import load_checked
    from launcher.cli.stage_memory import per_device, stage_estimates
    from launcher.config.loader import load_spec_and_sources
    from launcher.parallel.dims import resolve_dims
    from launcher.parallel.memory_estimate import Layout

    loaded, _ = load_spec_and_sources(spec)
    chosen = load_checked(loaded)
    batch = first_train_batch(chosen, loaded)
    dims = resolve_dims(loaded.parallel, "fsdp", 4, 4)
    layout = Layout("fsdp", dims, loaded.fsdp, "fp32", loaded.data.batch_size)

    def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters())

    stages = stage_estimates(loaded, chosen, batch, layout, optimizer)
    devices = per_device(stages, loaded.parallel)  # what validate prints, from these
    for device, held in zip(devices, ([0, 2], [1, 3]), strict=True):
        for figure in ("params", "grads", "optimizer", "activations", "peak"):
            assert getattr(device, figure) == sum(getattr(stages[i], figure) for i in held)
        assert device.params > 0 and device.activations > 0
