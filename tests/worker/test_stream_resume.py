"""A Hugging Face stream that shuffles through a buffer resumes at its saved position, but its
state_dict() does not hold the buffer: the resume says so, once, on rank 0. `datasets` need not
be installed: stand-ins have the shape of its IterableDataset (found by class name, as the
launcher finds it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import IterableDataset

from launcher.worker.stream import StreamFeed, StreamShare, shuffle_buffer
from tests.conftest import run_train, write_spec
from tests.tiny_recipes import write_recipe


class ArrowExamplesIterable:
    """The source of a datasets stream."""


class BufferShuffledExamplesIterable:
    """What `datasets` wraps a stream in for `.shuffle(buffer_size=...)`."""

    def __init__(self, ex_iterable: Any, buffer_size: int = 1000) -> None:
        self.ex_iterable, self.buffer_size = ex_iterable, buffer_size


class MappedExamplesIterable:
    """What `.map(...)` wraps it in."""

    def __init__(self, ex_iterable: Any) -> None:
        self.ex_iterable = ex_iterable


class CyclingMultiSourcesExamplesIterable:
    """What `interleave_datasets` makes of several streams."""

    def __init__(self, ex_iterables: list[Any]) -> None:
        self.ex_iterables = ex_iterables


class Stream(IterableDataset):
    """A stateful stream of numbers over the iterables given."""

    def __init__(self, ex_iterable: Any) -> None:
        self._ex_iterable = ex_iterable
        self.at = 0

    def __iter__(self):
        while True:
            self.at += 1
            yield self.at

    def state_dict(self) -> dict:
        return {"at": self.at}

    def load_state_dict(self, state: dict) -> None:
        self.at = state["at"]


SHUFFLED = MappedExamplesIterable(BufferShuffledExamplesIterable(ArrowExamplesIterable(), 500))


def test_a_shuffle_buffer_is_found_through_what_wraps_it() -> None:
    assert shuffle_buffer(Stream(SHUFFLED)).buffer_size == 500
    mixed = CyclingMultiSourcesExamplesIterable([ArrowExamplesIterable(), SHUFFLED])
    assert shuffle_buffer(Stream(mixed)) is not None
    assert shuffle_buffer(Stream(MappedExamplesIterable(ArrowExamplesIterable()))) is None
    assert shuffle_buffer([1, 2, 3]) is None  # not a datasets stream at all


def test_an_older_datasets_shuffling_config_counts() -> None:
    stream = Stream(ArrowExamplesIterable())
    stream._shuffling = object()  # datasets 2.x-4.x: IterableDataset._shuffling
    assert shuffle_buffer(stream) is not None


def _resumed_note(stream: Any, saved_state: Any) -> str | None:
    feed = StreamFeed(None, StreamShare(stream, rank=0, world=1, repeat=True), 1, 1)
    position = {"passes": 0, "taken": 8, "state": saved_state}
    return feed.load_state_dict({"workers": 1, "next_worker": 0, "positions": {"0": position}}, 8)


def test_resuming_a_shuffled_stream_from_its_state_says_its_buffer_starts_empty() -> None:
    note = _resumed_note(Stream(SHUFFLED), {"at": 8})
    assert note is not None and "\n" not in note
    assert "resumes at its saved position" in note
    assert "shuffle buffer of 500 samples starts empty" in note
    assert _resumed_note(Stream(ArrowExamplesIterable()), {"at": 8}) is None  # no buffer
    # Fast-forwarded by reading (no state): the buffer fills as it did; only the time is said.
    assert "shuffle buffer" not in (_resumed_note(Stream(SHUFFLED), None) or "")


# A stream that looks like a shuffled Hugging Face one, under the tiny recipe's model and loss.
STREAM_HOOKS = """
import torch
from torch.utils.data import IterableDataset


class BufferShuffledExamplesIterable:
    buffer_size = 1000


class Stream(IterableDataset):
    def __init__(self):
        self._ex_iterable = BufferShuffledExamplesIterable()
        self.at = 0

    def __iter__(self):
        while True:
            self.at += 1
            x = torch.randn(4, generator=torch.Generator().manual_seed(self.at))
            yield x, x.sum(0, keepdim=True)

    def state_dict(self):
        return {"at": self.at}

    def load_state_dict(self, state):
        self.at = state["at"]


def build_dataset(split):
    return Stream()
"""


@pytest.mark.timeout(240)
def test_rank_0_says_it_once_when_the_run_resumes(tmp_path: Path) -> None:
    write_recipe(tmp_path, STREAM_HOOKS, "shuffled.py")
    spec = write_spec(
        tmp_path / "run.yaml",
        recipe={"source": "shuffled.py", "dataset": {}},
        train={"max_steps": 4, "log_every": 2},
    )
    first = run_train(["--config", str(spec)], cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "shuffle buffer" not in first.stdout
    resumed = run_train(
        ["--config", str(spec), "--resume", "latest", "train.max_steps=6"], cwd=tmp_path
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    said = [line for line in resumed.stdout.splitlines() if "shuffle buffer" in line]
    assert len(said) == 1, resumed.stdout
    assert said[0].startswith("[rank 0] ") and "of 1,000 samples starts empty" in said[0]
