"""Loader workers that cannot hang at fork: `data.worker_start: auto` starts DataLoader workers
by forkserver (spawn where there is none), never by forking a training process with threads,
which on a CPython with gh-112275 could hang a worker for good as it started. An explicit
`fork` on such a Python is warned of on rank 0 (`launcher.worker.loader_workers`)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

from launcher.config.loader import load_cli_spec, load_spec_and_sources
from launcher.config.spec import DataSection
from launcher.errors import UsageError
from launcher.worker import loader_workers
from launcher.worker.loader_workers import (
    check_sendable,
    fork_may_hang,
    start_method,
    warn_of_fork_hang,
    worker_options,
)

LINUX = ["fork", "spawn", "forkserver"]


def test_the_key_defaults_to_auto_and_names_its_choices(tmp_path: Path) -> None:
    spec_file = tmp_path / "run.yaml"
    spec_file.write_text("recipe: {source: r.py}\ntrain: {max_steps: 5}\n")
    assert load_cli_spec(spec_file).data.worker_start == "auto"
    with pytest.raises(UsageError) as caught:
        load_spec_and_sources(spec_file, ["data.worker_start=threads"])
    assert (
        "data.worker_start (override data.worker_start=threads): expected one of 'auto', "
        "'fork', 'forkserver' or 'spawn', got 'threads'"
    ) in caught.value.render()


def test_auto_starts_workers_by_forkserver_on_every_python() -> None:
    """Not only where gh-112275 is: a forked child of a process with threads may find any
    lock held (POSIX, CPython 3.12's warning, 3.14's default). So the choice depends on the
    platform's start methods alone, and `start_method` takes no Python version."""
    assert start_method("auto", LINUX) == "forkserver"
    assert start_method("auto", ["spawn"]) == "spawn"  # a platform without a fork server
    assert start_method("fork", LINUX) == "fork"  # asked for by name
    assert start_method("spawn", LINUX) == "spawn"


def test_a_start_method_the_platform_lacks_is_refused_by_key() -> None:
    with pytest.raises(UsageError, match=r"data\.worker_start: forkserver is not a start method"):
        start_method("forkserver", ["spawn"])


@pytest.mark.parametrize(
    ("version", "may_hang"),
    [
        ((3, 10, 13), True),
        ((3, 10, 15), False),
        ((3, 11, 7), True),
        ((3, 11, 9), True),
        ((3, 11, 10), False),
        ((3, 12, 1), False),
        ((3, 13, 0), False),
    ],
)
def test_the_releases_with_the_bug_are_known(version: tuple[int, int, int], may_hang: bool):
    assert fork_may_hang(version) is may_hang


def test_only_forked_workers_on_such_a_release_are_warned(capsys: pytest.CaptureFixture[str]):
    warn_of_fork_hang(DataSection(num_workers=2, worker_start="fork"), (3, 11, 7))
    warning = capsys.readouterr().err
    assert warning.startswith("WARNING: data.worker_start: fork: Python 3.11.7 ")
    assert "gh-112275" in warning and "3.11.10" in warning

    warn_of_fork_hang(DataSection(num_workers=2), (3, 11, 7))  # auto: not forked
    warn_of_fork_hang(DataSection(num_workers=0, worker_start="fork"), (3, 11, 7))
    warn_of_fork_hang(DataSection(num_workers=2, worker_start="fork"), (3, 12, 1))
    assert capsys.readouterr().err == ""


def test_the_loader_options_of_each_start_method() -> None:
    assert worker_options(DataSection(num_workers=0), {}) == {}  # no worker, no context
    forked = worker_options(DataSection(num_workers=2, worker_start="fork"), {})
    assert forked["multiprocessing_context"].get_start_method() == "fork"
    assert "worker_init_fn" not in forked
    for method in ("forkserver", "spawn"):
        options = worker_options(DataSection(num_workers=2, worker_start=method), {})
        assert options["multiprocessing_context"].get_start_method() == method
        assert options["worker_init_fn"].training_pid == multiprocessing.current_process().pid


class _Holder:
    def __init__(self) -> None:
        self.transform = lambda x: x  # a lambda: pickle cannot name it


def test_what_cannot_be_pickled_is_refused_in_one_line_naming_the_keys() -> None:
    check_sendable([torch.zeros(3)] * 300, "the train dataset", "forkserver")  # fine
    with pytest.raises(UsageError) as caught:
        worker_options(DataSection(num_workers=2), {"the train dataset": _Holder()})
    message = caught.value.render()
    assert "\n" not in message
    assert message.startswith(
        "data.worker_start: the train dataset (_Holder) cannot be pickled for loader workers "
        "started by forkserver (Can't pickle local object"
    )
    assert "or set data.worker_start: fork or data.num_workers: 0" in message
    # Forked workers are not sent anything: nothing to check.
    worker_options(DataSection(num_workers=2, worker_start="fork"), {"x": _Holder()})


class _InMemory:
    """A dataset held in memory: 200 MB of tensor (never touched: torch.empty), and a lambda
    where `broken`."""

    def __init__(self, broken: bool) -> None:
        self.samples = torch.empty(50_000_000)
        self.labels = torch.arange(10)
        self.transform = (lambda x: x) if broken else None


def test_the_check_leaves_tensors_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pickling a tensor by value copies its storage (torch.save into bytes): the check would
    double a rank's memory for every loader it builds. Its tensors are left out of the check,
    not what else the dataset holds."""
    sinks: list[loader_workers._Discard] = []

    class Counted(loader_workers._Discard):
        def __init__(self) -> None:
            super().__init__()
            sinks.append(self)

    def no_copy(*args: object, **kwargs: object) -> None:
        raise AssertionError("the check copied a tensor's storage")

    monkeypatch.setattr(loader_workers, "_Discard", Counted)
    monkeypatch.setattr(torch, "save", no_copy)
    check_sendable(_InMemory(broken=False), "the train dataset", "forkserver")
    assert len(sinks) == 1 and 0 < sinks[0].written < 10_000
    with pytest.raises(UsageError, match=r"\(_InMemory\) cannot be pickled .*local object"):
        check_sendable(_InMemory(broken=True), "the train dataset", "forkserver")
