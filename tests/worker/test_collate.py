"""A recipe's `collate(samples)`: the variable-length recipe's padded batches give the exact
evaluation mean on 1, 2 and 3 processes (DataLoader workers included), a stream collated by it
keeps its shares and resumes exactly, `train validate` runs it and then the loss on the meta
device, and a batch counts its samples by the documented convention."""

from __future__ import annotations

import json
from collections import UserDict
from pathlib import Path
from types import ModuleType

import pytest
import torch

from launcher.errors import UsageError
from launcher.worker.data import Collate, batch_size
from launcher.worker.recipe import Recipe
from recipes import varlen
from tests.conftest import REPO, metrics_of, only_run_dir, run_train, usage_error, write_spec
from tests.forked_train import train_in_fork

pytestmark = pytest.mark.timeout(300)

VARLEN = str(REPO / "recipes" / "varlen.py")


def _plain_means(model: torch.nn.Module, samples: list[dict]) -> tuple[float, float]:
    """The val split's mean squared and absolute errors, one unpadded sample at a time."""
    errors = []
    with torch.no_grad():
        for sample in samples:
            tokens = sample["tokens"].unsqueeze(0)
            errors.append(model(tokens, tokens != varlen.PAD)[0] - sample["target"])
    stacked = torch.cat(errors)
    return stacked.pow(2).mean().item(), stacked.abs().mean().item()


@pytest.mark.parametrize(
    ("devices", "workers"), [pytest.param(1, 0, marks=pytest.mark.smoke), (2, 2), (3, 0)]
)
def test_padded_batches_give_the_exact_val_mean(tmp_path: Path, devices: int, workers: int) -> None:
    """37 val samples in batches of 4: not a multiple of 2 or 3 processes, nor of the batch.
    On 2 processes the last batch of rank 1 is cut to its real samples before collate pads
    it; on 3, ranks 1 and 2 end with a batch of padding alone. With lr 0 the model is the one
    it was built as, so the mean can be computed here, one unpadded sample at a time."""
    spec = write_spec(
        tmp_path / "run.yaml",
        launch={"devices": devices},
        recipe={"source": VARLEN, "dataset": {"n_samples": 37}, "model": {"width": 8}},
        data={"batch_size": 4, "num_workers": workers},
        optim={"name": "SGD", "lr": 0.0},
        train={"max_steps": 2},
        eval={"every_n_steps": 2},
        checkpoint={"every_n_steps": 2},
    )
    result = run_train(["--config", str(spec)], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run = only_run_dir(tmp_path / "runs")
    (got,) = [r for r in metrics_of(run) if "eval_s" in r]

    torch.manual_seed(0)  # what every rank does before building the model
    model = varlen.build_model(width=8)
    dataset = varlen.build_dataset("val", n_samples=37)
    mse, mae = _plain_means(model, [dataset[i] for i in range(len(dataset))])
    assert got["val/loss"] == pytest.approx(mse, rel=1e-5)
    assert got["val/mae"] == pytest.approx(mae, rel=1e-5)
    # Epochs count samples, not batches: 2 steps of 4 samples on each process.
    share = 37 // devices  # data.drop_last: the sampler's share of each process
    assert f"{share:,} samples per epoch" in result.stdout
    meta = json.loads((run / "checkpoints" / "step-00000002" / "meta.json").read_text())
    assert meta["progress"]["samples_in_epoch"] == 2 * 4 * devices


STREAM_RECIPE = """
import os
import sys

import torch
from torch.utils.data import IterableDataset

sys.path.insert(0, {repo!r})
from recipes import varlen
from recipes.varlen import build_model

VAL_IDS = 10**6  # val items' ids start here


class Stream(IterableDataset):
    def __init__(self, split):
        self.items = varlen.build_dataset(split, n_samples=64)
        self.first = VAL_IDS if split == "val" else 0

    def __iter__(self):
        for i in range(len(self.items)):
            yield {{"id": self.first + i, **self.items[i]}}


def build_dataset(split):
    return Stream(split)


def collate(samples):
    batch = varlen.collate(samples)
    batch["id"] = torch.tensor([s["id"] for s in samples])
    return batch


def loss(model, batch):
    with open(f"seen-rank{{os.environ['RANK']}}.txt", "a") as f:
        f.write(" ".join(map(str, batch["id"].tolist())) + "\\n")
    return varlen.loss(model, batch)
"""


def _stream_run(folder: Path, *args: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "stream_recipe.py").write_text(STREAM_RECIPE.format(repo=str(REPO)))
    spec = write_spec(
        folder / "run.yaml",
        recipe={"source": str(folder / "stream_recipe.py"), "dataset": {}},
        data={"batch_size": 4, "num_workers": 2},
        optim={"name": "SGD", "lr": 0.0},
        train={"max_steps": 6},
        eval={"every_n_steps": 6, "max_batches": 2},
        checkpoint={"every_n_steps": 3},
    )
    result = run_train(["--config", str(spec), *args], cwd=folder)
    assert result.returncode == 0, result.stdout + result.stderr
    return folder


def _seen(folder: Path, rank: int, val: bool = False) -> list[list[int]]:
    lines = (folder / f"seen-rank{rank}.txt").read_text().splitlines()
    batches = [[int(i) for i in line.split()] for line in lines]
    return [b for b in batches if (b[0] >= 10**6) == val]


def test_a_collated_stream_keeps_its_shares_and_resumes_exactly(tmp_path: Path) -> None:
    """2 ranks x 2 DataLoader workers each read their own share of the stream, through the
    recipe's collate; a run resumed at step 3 takes the batches the first run took next; the
    streamed val mean is exact over the items read (items 0-15: 2 batches of 4 per rank)."""
    reference = _stream_run(tmp_path / "reference")
    run = only_run_dir(reference / "runs")
    assert _seen(reference, 0)[:2] == [[0, 4, 8, 12], [2, 6, 10, 14]]
    assert _seen(reference, 1)[:2] == [[1, 5, 9, 13], [3, 7, 11, 15]]

    start = run / "checkpoints" / "step-00000003"
    branch = _stream_run(tmp_path / "branch", "--resume", str(start), "--run-dir", "run")
    for rank in (0, 1):
        assert _seen(branch, rank) == _seen(reference, rank)[3:], f"rank {rank}"
    losses = {r["step"]: r["loss"] for r in metrics_of(run) if "loss" in r}
    resumed = {r["step"]: r["loss"] for r in metrics_of(branch / "run") if "loss" in r}
    assert resumed == {step: loss for step, loss in losses.items() if step > 3}

    val_ids = sorted(i - 10**6 for rank in (0, 1) for b in _seen(reference, rank, True) for i in b)
    assert val_ids == list(range(16))
    (got,) = [r for r in metrics_of(run) if "eval_s" in r]
    torch.manual_seed(0)
    dataset = varlen.build_dataset("val", n_samples=64)
    mse, _ = _plain_means(varlen.build_model(), [dataset[i] for i in range(16)])
    assert got["val/loss"] == pytest.approx(mse, rel=1e-5)


def test_validate_runs_the_collate_and_the_loss_of_the_shipped_recipe(tmp_path: Path) -> None:
    config = REPO / "configs" / "varlen.yaml"
    result = train_in_fork(["validate", "--config", str(config)], cwd=tmp_path, timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "model Regressor 9,505 parameters, 9,505 trainable" in result.stdout
    assert "train 2,048 samples (32 steps/epoch at 2 devices x 32)" in result.stdout
    assert "loss not checked" not in result.stdout


BROKEN = """
import sys
import torch
sys.path.insert(0, {repo!r})
from recipes.varlen import PAD, build_dataset, build_model, collate, loss
import recipes.varlen as varlen

{change}
"""
MISSING_KEY = """
def loss(model, batch):
    lengths = batch["lengths"]  # which collate does not give
    return varlen.loss(model, batch)
"""
PER_SAMPLE = """
def loss(model, batch):
    pred = model(batch["tokens"], batch["mask"])
    return torch.nn.functional.mse_loss(pred, batch["target"], reduction="none")
"""
TIME_MAJOR = """
def collate(samples):
    batch = varlen.collate(samples)
    return {**batch, "tokens": batch["tokens"].T, "mask": batch["mask"].T}
"""


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        pytest.param(
            MISSING_KEY,
            [
                "recipe: loss(model, batch) failed on a train batch made by the recipe's "
                "collate():",
                "broken.py",
                "KeyError: 'lengths'",
            ],
            id="missing-key",
        ),
        pytest.param(
            PER_SAMPLE,
            ["returned a tensor of shape [8, 1]; the loss must be one number", ".mean()"],
            id="per-sample-loss",
        ),
        pytest.param(
            TIME_MAJOR,
            [
                "the batch's tensors disagree on its number of samples",
                "batch['tokens'] ",
                "batch['target'] 8",
                "'num_samples': len(samples)",
            ],
            id="time-major-batch",
        ),
    ],
)
def test_validate_refuses_a_batch_the_loss_cannot_use(
    tmp_path: Path, change: str, expected: list[str]
) -> None:
    (tmp_path / "broken.py").write_text(BROKEN.format(repo=str(REPO), change=change))
    spec = write_spec(
        tmp_path / "run.yaml", recipe={"source": str(tmp_path / "broken.py"), "dataset": {}}
    )
    result = train_in_fork(["validate", "--config", str(spec)], cwd=tmp_path, timeout=90)
    usage_error(result, *expected)
    assert "launcher/" not in result.stdout + result.stderr


def _recipe(**functions: object) -> Recipe:
    module = ModuleType("recipe_under_test")
    module.__dict__.update(functions)
    return Recipe("recipe_under_test.py", module)


def test_a_batch_counts_its_samples_by_the_convention() -> None:
    padded = {"tokens": torch.zeros(3, 7), "mask": torch.ones(3, 7), "scale": torch.tensor(2.0)}
    assert batch_size(padded) == 3  # the shared leading dimension; a 0-d tensor has none
    packed = {"tokens": torch.zeros(1, 20), "starts": torch.tensor([0, 5, 12, 20])}
    with pytest.raises(UsageError) as caught:
        batch_size(packed)
    assert "batch['tokens'] 1, batch['starts'] 4" in caught.value.render()
    assert batch_size({**packed, "num_samples": 3}) == 3  # given explicitly

    # A mapping that is not a dict, as a tokenizer's BatchEncoding (a UserDict), becomes one.
    made = Collate(lambda samples: UserDict(tokens=torch.stack(samples)))([torch.zeros(2)] * 3)
    assert type(made) is dict and made["tokens"].shape == (3, 2)
    miscounting = Collate(lambda samples: {"tokens": torch.zeros(1, 20), "num_samples": 2})
    with pytest.raises(UsageError, match="collate\\(\\) was given 3 samples, but its batch"):
        miscounting([torch.zeros(2)] * 3)


def test_a_recipe_without_collate_keeps_default_collate_and_collate_fn_is_named() -> None:
    assert _recipe().collate_hook() is None
    assert _recipe(collate=varlen.collate).collate_hook() is varlen.collate
    with pytest.raises(UsageError, match="defines collate_fn\\(\\); the launcher calls"):
        _recipe(collate_fn=varlen.collate).collate_hook()


def test_collate_is_told_the_split_where_it_takes_one_by_name() -> None:
    """`collate(samples, split)` gets "train" or "val" (mixup only on train batches); one of
    `collate(samples)` is called as always, and an optional parameter of another name is
    never given the split."""
    seen: list[object] = []

    def told(samples: list, split: str) -> torch.Tensor:
        seen.append(split)
        return torch.stack(samples)

    def keyword_only(samples: list, *, split: str = "?") -> torch.Tensor:
        seen.append(split)
        return torch.stack(samples)

    def other(samples: list, pad_to: object = None) -> torch.Tensor:
        seen.append(pad_to)
        return torch.stack(samples)

    samples = [torch.zeros(2)] * 3
    for hook in (told, keyword_only, other, lambda samples: torch.stack(samples)):
        assert _recipe(collate=hook).collate_hook() is hook
        for split in ("train", "val"):
            assert Collate(hook, split)(samples).shape == (3, 2)
    assert seen == ["train", "val", "train", "val", None, None]
    assert Collate(told)(samples) is not None and seen[-1] == "train"  # the default

    def two_required(samples, tokenizer):  # type: ignore[no-untyped-def]
        return samples

    with pytest.raises(UsageError) as caught:
        _recipe(collate=two_required).collate_hook()
    assert caught.value.render().startswith(
        "recipe_under_test.py: collate(samples, tokenizer) must take the list of samples, and "
        "may take the split by name: collate(samples) or collate(samples, split)"
    )


def test_the_varlen_recipe_ignores_padding_and_learns() -> None:
    torch.manual_seed(0)
    model = varlen.build_model()
    data = varlen.build_dataset("train", n_samples=256)
    samples = [data[i] for i in range(8)]
    batch = varlen.collate(samples)
    assert batch["tokens"].shape == (8, max(len(s["tokens"]) for s in samples))
    alone = [model(s["tokens"][None], torch.ones(1, len(s["tokens"]), dtype=bool)) for s in samples]
    torch.testing.assert_close(model(batch["tokens"], batch["mask"]), torch.cat(alone))

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(40):
        first = 32 * (step % 8)
        loss, _ = varlen.loss(model, varlen.collate([data[i] for i in range(first, first + 32)]))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert sum(losses[-8:]) < 0.2 * sum(losses[:8]), losses
