"""The bundled recipes: shapes, determinism under a seed, and that they learn."""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

# recipes/ is a top-level package of the repo, not part of the installed launcher.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from recipes import gpt, mlp

SMALL_BYTES = 100_000
SMALL_GPT = {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32}


def first_batch_loss(recipe, model_args: dict, dataset_args: dict) -> torch.Tensor:
    torch.manual_seed(0)
    model = recipe.build_model(**model_args)
    dataset = recipe.build_dataset("train", **dataset_args)
    batch = next(iter(DataLoader(dataset, batch_size=4)))
    out = recipe.loss(model, batch)
    return out[0] if isinstance(out, tuple) else out


def test_mlp_shapes_and_metrics() -> None:
    dataset = mlp.build_dataset("train", n_samples=100, in_dim=8)
    x, y = dataset[0]
    assert len(dataset) == 100 and x.shape == (8,) and y.shape == (1,)
    model = mlp.build_model(in_dim=8, hidden=16, depth=3)
    assert model(torch.randn(5, 8)).shape == (5, 1)
    mse, metrics = mlp.loss(model, next(iter(DataLoader(dataset, batch_size=10))))
    assert mse.shape == () and set(metrics) == {"mae"}


def test_mlp_splits_share_targets_not_inputs() -> None:
    train, val = mlp.build_dataset("train"), mlp.build_dataset("val")
    assert not torch.equal(train.tensors[0], val.tensors[0])
    assert torch.equal(train.tensors[0], mlp.build_dataset("train").tensors[0])
    with pytest.raises(ValueError, match="split"):
        mlp.build_dataset("test")


@pytest.mark.parametrize(
    ("recipe", "model_args", "dataset_args"),
    [
        (mlp, {}, {}),
        (gpt, SMALL_GPT, {"block_size": 32, "max_bytes": SMALL_BYTES}),
    ],
)
def test_same_seed_same_first_loss(recipe, model_args: dict, dataset_args: dict) -> None:
    first = first_batch_loss(recipe, model_args, dataset_args)
    assert torch.equal(first, first_batch_loss(recipe, model_args, dataset_args))


def test_mlp_loss_decreases_with_sgd() -> None:
    torch.manual_seed(0)
    model = mlp.build_model()
    loader = DataLoader(mlp.build_dataset("train"), batch_size=64, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for batch in itertools.islice(loader, 50):
        loss, _ = mlp.loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.2 * sum(losses[:5]) / 5


def test_gpt_items_are_shifted_non_overlapping_chunks() -> None:
    dataset = gpt.build_dataset("train", block_size=16, max_bytes=SMALL_BYTES)
    x, y = dataset[0]
    assert x.shape == y.shape == (16,) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1])
    # Item i+1 starts where item i's inputs end: its first input is item i's last target.
    assert dataset[1][0][0] == y[-1]
    assert dataset[len(dataset) - 1][1].shape == (16,)
    with pytest.raises(IndexError):
        dataset[len(dataset)]


def test_gpt_train_and_val_are_disjoint_slices() -> None:
    train = gpt.build_dataset("train", block_size=16, max_bytes=SMALL_BYTES)
    val = gpt.build_dataset("val", block_size=16, max_bytes=SMALL_BYTES)
    text = gpt._stdlib_tokens(SMALL_BYTES)
    assert len(text) == SMALL_BYTES
    assert len(train.tokens) + len(val.tokens) == len(text)
    assert torch.equal(torch.cat([train.tokens, val.tokens]), text)
    assert len(val.tokens) == pytest.approx(0.1 * len(text), abs=1)


def test_gpt_text_is_read_once_per_process() -> None:
    gpt.build_dataset("train", max_bytes=SMALL_BYTES)
    misses = gpt._stdlib_tokens.cache_info().misses
    gpt.build_dataset("val", max_bytes=SMALL_BYTES)
    gpt.build_dataset("train", max_bytes=SMALL_BYTES)
    assert gpt._stdlib_tokens.cache_info().misses == misses


def test_gpt_model_shapes_and_initial_loss() -> None:
    torch.manual_seed(0)
    model = gpt.build_model(**SMALL_GPT)
    assert len(model.blocks) == 2 and all(isinstance(b, gpt.Block) for b in model.blocks)
    idx = torch.randint(0, 256, (3, 32))
    assert model(idx).shape == (3, 32, 256)
    # With std-0.02 weights the logits are near zero, so the loss starts near uniform.
    loss = gpt.loss(model, (idx, idx))
    assert loss.item() == pytest.approx(math.log(256), rel=0.05)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_gpt_init_weights_fully_materialises_a_meta_model() -> None:
    reference = gpt.build_model(**SMALL_GPT)
    torch.manual_seed(1)
    reference.init_weights()
    with torch.device("meta"):
        model = gpt.build_model(**SMALL_GPT)
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    model.init_weights()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    assert list(model.buffers()) == []
