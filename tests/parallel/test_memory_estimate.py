"""The memory a layout needs per device, estimated before launch: exact counts for a model whose
parameter, gradient and Adam bytes are known, sharding dividing them, activations growing with
the micro-batch, the advice a GPU launch gives where a layout does not fit, and the line
`train validate` prints."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from launcher.config.fsdp import FSDPSection
from launcher.parallel.dims import ParallelDims
from launcher.parallel.memory_estimate import Layout, MemoryEstimate, estimate_memory
from launcher.parallel.memory_fit import fit_advice
from tests.conftest import REPO, write_spec
from tests.forked_train import train_in_fork

pytestmark = pytest.mark.timeout(120)

SIZES = [(32, 64), (64, 48), (48, 10)]  # (in, out) of each Linear layer


def _linears() -> nn.Module:
    return nn.Sequential(*(nn.Linear(i, o) for i, o in SIZES))


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _estimate(dims: ParallelDims, strategy: str = "fsdp", batch_size: int = 16) -> MemoryEstimate:
    batch = (torch.randn(batch_size, SIZES[0][0]), torch.randint(0, 10, (batch_size,)))
    layout = Layout(strategy, dims, FSDPSection(wrap=["Linear"]), "fp32", batch_size)
    return estimate_memory(
        _linears, lambda model: torch.optim.Adam(model.parameters()), batch, _loss, layout
    )


def _rank0_shard_bytes(shards: int) -> int:
    """fp32 bytes of rank 0's shards: FSDP splits each tensor's first dimension in `shards`
    chunks (torch.chunk), of which rank 0 holds the first, the longest."""
    total = 0
    for fan_in, fan_out in SIZES:
        total += math.ceil(fan_out / shards) * fan_in  # the weight: (out, in)
        total += math.ceil(fan_out / shards)  # the bias
    return 4 * total


def test_unsharded_counts_are_exact() -> None:
    """ddp: every device holds the whole model: P fp32 parameters, P gradients and Adam's two
    moments (2P); the activations of a micro-batch come on top."""
    estimate = _estimate(ParallelDims(dp_replicate=4), strategy="ddp")
    params = 4 * sum(fan_in * fan_out + fan_out for fan_in, fan_out in SIZES)
    assert (estimate.params, estimate.grads, estimate.optimizer) == (params, params, 2 * params)
    assert estimate.activations > 0
    assert estimate.peak >= estimate.state  # the peak also holds a step's temporaries
    assert "ddp, dp_replicate 4, fp32, micro-batch of 16" in estimate.describe()


@pytest.mark.parametrize(
    ("dims", "shards"),
    [(ParallelDims(dp_shard=2), 2), (ParallelDims(dp_shard=4), 4), (ParallelDims(2, 2), 2)],
)
def test_sharding_divides_params_grads_and_optimizer(dims: ParallelDims, shards: int) -> None:
    """fsdp over a fake process group of the run's world: rank 0's shards, exactly (1/n of
    the model, plus the rows of uneven splits); HSDP divides by its shards, not its world. No
    process group is left behind."""
    estimate = _estimate(dims)
    expected = _rank0_shard_bytes(shards)
    assert (estimate.params, estimate.grads, estimate.optimizer) == (
        expected,
        expected,
        2 * expected,
    )
    whole = _estimate(ParallelDims(dp_replicate=1), strategy="ddp")
    assert whole.params / shards <= estimate.params < whole.params / shards * 1.2
    assert not dist.is_initialized()


def test_activations_grow_with_the_micro_batch() -> None:
    small, large = (_estimate(ParallelDims(dp_shard=2), batch_size=n) for n in (8, 64))
    assert 0 < small.activations < large.activations
    assert small.state == large.state  # the batch does not change what sharding divides
    assert small.peak < large.peak


def _made_up(strategy: str, dims: ParallelDims, batch: int = 8, **fsdp: bool) -> MemoryEstimate:
    """An estimate of 8 GiB of state and 2 GiB of activations (0.25 GiB per sample)."""
    gib = 2**30
    layout = Layout(strategy, dims, FSDPSection(**fsdp), "bf16", batch)
    return MemoryEstimate(
        params=2 * gib, grads=2 * gib, optimizer=4 * gib, activations=2 * gib, peak=10 * gib,
        layout=layout,
    )  # fmt: skip


def test_advice_names_a_layout_that_fits() -> None:
    """The decision a GPU launch makes, as a pure function: nothing where the estimate fits;
    else a layout that would fit, as the spec keys to set."""
    gib = 2**30
    ddp = _made_up("ddp", ParallelDims(dp_replicate=4))
    assert fit_advice(ddp, 80 * gib) is None
    # 8 GiB of state over 4 shards is 2 GiB: 4 GiB in all fits 9 GiB of a 10 GiB device.
    advice = fit_advice(ddp, 10 * gib)
    assert advice is not None
    assert "needs about 10.0 GiB per device" in advice
    assert "launch.strategy: fsdp (sharded over all 4 processes) needs about 4.0 GiB" in advice
    # HSDP: sharding over the whole world instead of within a replica.
    hsdp = _made_up("fsdp", ParallelDims(2, 2))
    advice = fit_advice(hsdp, 8 * gib) or ""
    assert "parallel.dp_shard: 4 with parallel.dp_replicate: 1 needs about" in advice
    # Already sharded over everything: a smaller micro-batch (state 2 GiB + 0.25 GiB a sample
    # fits 3.6 GiB with 6 samples), or activation checkpointing.
    fsdp = _made_up("fsdp", ParallelDims(dp_shard=4))
    fsdp = replace(fsdp, params=gib // 2, grads=gib // 2, optimizer=gib, peak=4 * gib)
    advice = fit_advice(fsdp, 4 * gib) or ""
    assert "data.batch_size: 6 needs about 3.5 GiB" in advice
    assert "fsdp.activation_checkpointing: true" in advice
    # One sample's activations fit, but not the state (8 GiB in all): 6 shards of it fit
    # beside 0.25 GiB of activations in 1.8 GiB.
    single = replace(fsdp, layout=replace(fsdp.layout, batch_size=1), activations=gib // 4)
    single = replace(single, peak=single.state + single.activations)
    advice = fit_advice(single, 2 * gib) or ""
    assert "fsdp sharded over at least 6 processes (parallel.dp_shard: 6" in advice


@pytest.mark.smoke
def test_validate_prints_the_estimate(tmp_path: Path) -> None:
    """`train validate` on the GPT recipe under fsdp on 4 CPU devices prints the per-device
    estimate of that layout; ddp's, on the same spec, holds 4x the state."""
    recipe = {
        "source": str(REPO / "recipes" / "gpt.py"),
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32},
        "dataset": {"block_size": 32, "max_bytes": 100_000},
    }
    spec = write_spec(
        tmp_path / "run.yaml",
        launch={"accelerator": "cpu", "devices": 4, "strategy": "fsdp"},
        recipe=recipe,
        optim={"name": "AdamW", "lr": 1e-3},
    )
    result = train_in_fork(["validate", "--config", str(spec)], cwd=tmp_path, timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("memory per device")]
    assert len(lines) == 1, result.stdout
    assert "(estimate, fsdp, dp_shard 4, fp32, micro-batch of 8): peak " in lines[0]
    for part in ("params ", "grads ", "optimizer ", "activations "):
        assert part in lines[0]


def _frozen_first_layer() -> nn.Module:
    model = _linears()
    model[0].requires_grad_(False)
    return model


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_frozen_parameters_hold_no_gradient_or_optimizer_state(strategy: str) -> None:
    """A frozen layer (a fine-tune's embedding, a LoRA base) is held but gets no gradient and
    no Adam moments: the estimate counts it once, where torch's tracker used to refuse it."""
    batch = (torch.randn(16, SIZES[0][0]), torch.randint(0, 10, (16,)))
    layout = Layout(strategy, ParallelDims(dp_replicate=1), FSDPSection(), "fp32", 16)

    def adam(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(p for p in model.parameters() if p.requires_grad)

    estimate = estimate_memory(_frozen_first_layer, adam, batch, _loss, layout)
    every = 4 * sum(fan_in * fan_out + fan_out for fan_in, fan_out in SIZES)
    trainable = 4 * sum(fan_in * fan_out + fan_out for fan_in, fan_out in SIZES[1:])
    assert (estimate.params, estimate.grads) == (every, trainable)
    assert estimate.optimizer == 2 * trainable
    assert estimate.peak >= every + trainable + 2 * trainable
