"""DataLoader workers under `data.worker_start: auto` (forkserver), end to end: an fsdp run of the
variable-length recipe with 2 workers per rank, whose dataset class and `collate(samples,
split)` live in a recipe file that each worker imports, trains, evaluates and resumes exactly
(each worker's random stream seeded as before); and a dataset that cannot be pickled for its
workers is refused in one line naming the keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import (
    FORKED_LOADER_WORKERS_MAY_HANG,
    REPO,
    metrics_of,
    only_run_dir,
    run_train,
    usage_error,
    write_spec,
)
from tests.forked_train import train_in_fork

pytestmark = pytest.mark.timeout(300)

# varlen's samples, each target nudged by the loader worker's own random stream (a resume at
# an epoch's start is exact only if every worker is seeded as in the first run), from a class
# of this file.
NOISY_RECIPE = """
import multiprocessing
import os
import sys

import torch
from torch.utils.data import Dataset

sys.path.insert(0, {repo!r})
from recipes import varlen
from recipes.varlen import build_model


class Noisy(Dataset):
    def __init__(self, split, **kwargs):
        self.inner = varlen.build_dataset(split, **kwargs)

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        parent = multiprocessing.parent_process()
        forked = parent is not None and parent.pid == os.getppid()
        with open(f"worker-{{os.getpid()}}.txt", "w") as f:
            f.write("forked" if forked else "started")
        sample = self.inner[i]
        return {{**sample, "target": sample["target"] + 0.01 * torch.rand(1)}}


def build_dataset(split, **kwargs):
    return Noisy(split, **kwargs)


def collate(samples, split):
    batch = varlen.collate(samples)
    batch["val"] = torch.full((len(samples),), split == "val")
    return batch


def loss(model, batch):
    assert not batch.pop("val").any(), "a train batch collated as val"
    return varlen.loss(model, batch)


def evaluate(model, batch):
    assert batch.pop("val").all(), "a val batch collated as train"
    return varlen.loss(model, batch)
"""


def _run(folder: Path, *args: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "noisy.py").write_text(NOISY_RECIPE.format(repo=str(REPO)))
    spec = write_spec(
        folder / "run.yaml",
        launch={"strategy": "fsdp"},
        recipe={"source": "noisy.py", "dataset": {"n_samples": 160}, "model": {"width": 8}},
        data={"batch_size": 8, "num_workers": 2},
        optim={"name": "AdamW", "lr": 0.003},
        train={"max_steps": 14, "log_every": 1},  # 10 steps an epoch: workers start again
        eval={"every_n_steps": 7},
        checkpoint={"every_n_steps": 10},
    )
    result = run_train(["--config", str(spec), *args], cwd=folder, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "WARNING" not in output  # none about forked workers either
    return folder


def test_fsdp_with_two_workers_started_by_forkserver_resumes_exactly(tmp_path: Path) -> None:
    reference = _run(tmp_path / "reference")
    run = only_run_dir(reference / "runs")
    starts = {p.read_text() for p in reference.glob("worker-*.txt")}
    assert starts == {"started"}, starts  # by the fork server, not forked from a rank
    # 2 ranks x 2 workers, started again for epochs 1 and 2 and for the 2 evaluations.
    assert len(list(reference.glob("worker-*.txt"))) == 16

    # From the end of epoch 0: epoch 1's workers draw as they did (a resume within an epoch
    # starts its workers' streams over, whatever starts them).
    start = run / "checkpoints" / "step-00000010"
    branch = _run(tmp_path / "branch", "--resume", str(start), "--run-dir", "run")
    losses = {r["step"]: r["loss"] for r in metrics_of(run) if "loss" in r}
    resumed = {r["step"]: r["loss"] for r in metrics_of(branch / "run") if "loss" in r}
    assert resumed == {step: loss for step, loss in losses.items() if step > 10}
    evaluated = {r["step"]: r["val/loss"] for r in metrics_of(run) if "val/loss" in r}
    again = {r["step"]: r["val/loss"] for r in metrics_of(branch / "run") if "val/loss" in r}
    assert again == {14: evaluated[14]}


UNPICKLABLE = """
import sys
sys.path.insert(0, {repo!r})
from recipes.varlen import build_model, collate, loss
from recipes import varlen


class Opened(varlen.Sequences):
    def __init__(self):
        super().__init__(64, 2, 8, 32, seed=1)
        self.log = open(__file__)  # a file handle: pickle cannot send it


def build_dataset(split):
    return Opened()
"""


def test_a_dataset_the_workers_cannot_be_sent_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "opened.py").write_text(UNPICKLABLE.format(repo=str(REPO)))
    spec = write_spec(
        tmp_path / "run.yaml",
        recipe={"source": "opened.py", "dataset": {}},
        data={"batch_size": 4, "num_workers": 2},
    )
    result = train_in_fork(["--config", str(spec)], cwd=tmp_path)
    usage_error(
        result,
        "error: data.worker_start: the train dataset (Opened) cannot be pickled for loader "
        "workers started by forkserver (cannot pickle '_io.TextIOWrapper' object); make it "
        "picklable (classes and functions at the top level of the recipe, files opened in "
        "__getitem__), or set data.worker_start: fork or data.num_workers: 0",
    )


@FORKED_LOADER_WORKERS_MAY_HANG
def test_forked_workers_need_no_pickled_dataset(tmp_path: Path) -> None:
    (tmp_path / "opened.py").write_text(UNPICKLABLE.format(repo=str(REPO)))
    spec = write_spec(
        tmp_path / "run.yaml",
        recipe={"source": "opened.py", "dataset": {}},
        data={"batch_size": 4, "num_workers": 2, "worker_start": "fork"},
    )
    # Forked workers share the training process's memory: nothing is pickled.
    forked = run_train(["--config", str(spec)], cwd=tmp_path)
    assert forked.returncode == 0, forked.stdout + forked.stderr
