"""Streaming datasets (an IterableDataset from build_dataset): every rank and every DataLoader
worker reads its own share, the stream repeats until train.max_steps, a resumed run continues
each share exactly where it stopped, and a streamed val split is evaluated."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.conftest import metrics_of, only_run_dir, run_train, usage_error, write_spec
from tests.forked_train import train_in_fork
from tests.tiny_recipes import write_recipe

pytestmark = pytest.mark.timeout(300)

# Item i is a function of i alone, so a reader that skips items computes nothing for them.
# Every batch's ids are written down, by rank, to check which items each rank took. The model
# and the loss are the tiny recipe's.
STREAM_HOOKS = """
import os
import torch
from torch.utils.data import IterableDataset


def item(i):
    x = torch.randn(4, generator=torch.Generator().manual_seed(i))
    return {"id": i, "x": x, "y": x.sum(0, keepdim=True) + 0.1 * (i % 7)}


class Stream(IterableDataset):
    def __init__(self, n, offset=0):
        self.n, self.offset = n, offset

    def __iter__(self):
        return (item(self.offset + i) for i in range(self.n))


class Resumable(Stream):
    # torchdata's Stateful protocol: it says where its iteration stands, and starts there.
    def __init__(self, n):
        super().__init__(n)
        self.next = 0

    def __iter__(self):
        start, self.next = self.next, 0
        for i in range(start, self.n):
            self.next = i + 1
            yield item(i)
        self.next = 0

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"]


def build_dataset(split, n=100000, stateful=False, val_n=40):
    if split == "val":
        return Stream(val_n, offset=10**7)
    return Resumable(n) if stateful else Stream(n)


def loss(model, batch):
    with open(f"seen-rank{os.environ['RANK']}.txt", "a") as f:
        f.write(" ".join(map(str, batch["id"].tolist())) + "\\n")
    return tiny.loss(model, (batch["x"], batch["y"]))
"""


def _spec(folder: Path, **sections: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    recipe = write_recipe(folder, STREAM_HOOKS, "stream_recipe.py")
    defaults = {
        "recipe": {"source": str(recipe), "dataset": {}},
        "data": {"batch_size": 4, "num_workers": 2},
        "train": {"max_steps": 12, "log_every": 1},
    }
    return write_spec(folder / "run.yaml", defaults, **sections)


def _seen(folder: Path, rank: int) -> list[list[int]]:
    """The ids of every batch rank `rank` trained on (evaluation batches excluded)."""
    lines = (folder / f"seen-rank{rank}.txt").read_text().splitlines()
    batches = [[int(i) for i in line.split()] for line in lines]
    return [b for b in batches if b[0] < 10**7]


def _losses(run: Path) -> dict[int, float]:
    records = metrics_of(run)
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def counted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """12 steps of the stream without a state_dict, checkpoints at steps 5 and 10: its folder
    (each rank's seen-rank<r>.txt is there) and its output."""
    folder = tmp_path_factory.mktemp("counted")
    dataset = {"dataset": {"stateful": False}}
    spec = _spec(folder, recipe=dataset, checkpoint={"every_n_steps": 5})
    result = run_train(["--config", str(spec)], cwd=folder)
    assert result.returncode == 0, result.stdout + result.stderr
    return folder, result.stdout


def test_each_rank_and_worker_reads_its_own_share(counted: tuple[Path, str]) -> None:
    folder, output = counted
    assert "12 steps, a stream" in output
    ids = {rank: [i for b in _seen(folder, rank) for i in b] for rank in (0, 1)}
    for rank, taken in ids.items():
        assert len(taken) == 12 * 4
        assert all(i % 2 == rank for i in taken), f"rank {rank} took another rank's items"
    everything = ids[0] + ids[1]
    assert len(set(everything)) == len(everything), "an item was seen twice"
    # Two workers per rank: rank r's worker w reads items r + 2w (mod 4), taking turns.
    first = _seen(folder, 0)[:2]
    assert first == [[0, 4, 8, 12], [2, 6, 10, 14]]


def test_a_finite_stream_repeats_until_max_steps(tmp_path: Path) -> None:
    """24 items, 2 ranks, 2 workers: 6 items per reader, fewer than 2 batches."""
    spec = _spec(tmp_path, recipe={"dataset": {"n": 24}}, train={"max_steps": 9})
    result = run_train(["--config", str(spec)], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in (0, 1):
        taken = [i for b in _seen(tmp_path, rank) for i in b]
        assert len(taken) == 9 * 4
        assert set(taken) == set(range(rank, 24, 2))
        # Every item of a worker's share comes round as often as any other.
        for worker in (0, 1):
            mine = [i for i in taken if i % 4 == rank + 2 * worker]
            counts = [mine.count(i) for i in set(mine)]
            assert max(counts) - min(counts) <= 1, (rank, worker, counts)


@pytest.mark.parametrize(
    "stateful",
    [False, pytest.param(True, marks=pytest.mark.smoke)],  # smoke: the one with more torch API
    ids=["counted", "state_dict"],
)
def test_resume_continues_the_stream_exactly(
    tmp_path: Path, stateful: bool, request: pytest.FixtureRequest
) -> None:
    dataset = {"dataset": {"stateful": stateful}}
    if stateful:
        reference = tmp_path / "reference"
        spec = _spec(reference, recipe=dataset, checkpoint={"every_n_steps": 5})
        result = run_train(["--config", str(spec)], cwd=reference)
        assert result.returncode == 0, result.stdout + result.stderr
    else:
        reference, _ = request.getfixturevalue("counted")
    run = only_run_dir(reference / "runs")

    branch = tmp_path / "branch"
    spec = _spec(branch, recipe=dataset)
    start = run / "checkpoints" / "step-00000005"
    args = ["--config", str(spec), "--resume", str(start), "--run-dir", str(branch / "run")]
    result = run_train(args, cwd=branch)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ("reads again and skips" in result.stdout) is not stateful
    for rank in (0, 1):
        assert _seen(branch, rank) == _seen(reference, rank)[5:], f"rank {rank}"
    ours, theirs = _losses(branch / "run"), _losses(run)
    assert ours == {step: loss for step, loss in theirs.items() if step > 5}


def test_resume_on_another_world_size_goes_on_approximately(
    tmp_path: Path, counted: tuple[Path, str]
) -> None:
    start = only_run_dir(counted[0] / "runs") / "checkpoints" / "step-00000005"
    branch = tmp_path / "branch"
    spec = _spec(branch, launch={"devices": 1}, train={"max_steps": 8})
    args = ["--config", str(spec), "--resume", str(start), "--run-dir", str(branch / "run")]
    result = run_train(args, cwd=branch)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "its position is approximate" in result.stdout
    # 40 items were taken before, 10 per reader: each of the 2 readers now skips 20.
    taken = [i for b in _seen(branch, 0) for i in b]
    assert len(taken) == 3 * 4 and min(taken) >= 36


def test_a_streamed_val_split_is_evaluated(tmp_path: Path) -> None:
    spec = _spec(tmp_path, train={"max_steps": 4}, eval={"every_n_steps": 2, "max_batches": 3})
    result = run_train(["--config", str(spec)], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("eval at step") == 2
    val = [b for b in (tmp_path / "seen-rank1.txt").read_text().splitlines() if len(b) > 20]
    assert any(int(line.split()[0]) >= 10**7 for line in val)


def test_a_streamed_val_split_needs_max_batches(tmp_path: Path) -> None:
    spec = _spec(tmp_path, train={"max_steps": 4}, eval={"every_n_steps": 2})
    result = train_in_fork(["--config", str(spec)], cwd=tmp_path)
    usage_error(result, "eval.max_batches")


def test_a_stream_needs_max_steps(tmp_path: Path) -> None:
    spec = _spec(tmp_path, train={"max_steps": None, "max_epochs": 1})
    result = train_in_fork(["--config", str(spec)], cwd=tmp_path)
    usage_error(result, "train.max_steps")


@pytest.mark.xla
@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None, reason="needs torch_xla")
def test_a_stream_with_1d_tensors_trains_and_resumes_under_xla_spmd(tmp_path: Path) -> None:
    """Batches holding a 1-D tensor (the ids here; class labels elsewhere) are split over the
    devices too: torch_xla's own spec for dimension 0 failed on them."""
    launch = {"accelerator": "tpu", "devices": 4, "strategy": "xla_spmd"}
    spec = _spec(
        tmp_path,
        launch=launch,
        data={"batch_size": 2, "num_workers": 1},
        train={"max_steps": 6},
        checkpoint={"every_n_steps": 3},
    )
    env = {"PJRT_DEVICE": "CPU"}
    result = run_train(["--config", str(spec)], cwd=tmp_path, env=env, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    run = only_run_dir(tmp_path / "runs")
    start = run / "checkpoints" / "step-00000003"
    args = ["--config", str(spec), "--resume", str(start), "--run-dir", str(tmp_path / "b")]
    result = run_train(args, cwd=tmp_path, env=env, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    ours, theirs = _losses(tmp_path / "b"), _losses(run)
    assert ours == {step: loss for step, loss in theirs.items() if step > 3}
