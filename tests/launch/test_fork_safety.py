"""Forked DataLoader workers on a CPython with gh-112275: a worker can hang for good as it
starts, when a C++ thread of its training process (gloo's, freeing a collective's tensors)
held the interpreter's thread-list lock at the fork. No code of ours can prevent it; the
worker says so on rank 0 (`launcher.worker.main.warn_of_fork_hang`)."""

from __future__ import annotations

import pytest

from launcher.worker.main import forked_workers_may_hang, warn_of_fork_hang


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
    assert forked_workers_may_hang(version) is may_hang


def test_a_run_with_workers_on_such_a_release_is_warned(capsys: pytest.CaptureFixture[str]):
    warn_of_fork_hang(2, (3, 11, 7))
    warning = capsys.readouterr().err
    assert warning.startswith("WARNING: data.num_workers: Python 3.11.7 ")
    assert "gh-112275" in warning and "3.11.10" in warning

    warn_of_fork_hang(0, (3, 11, 7))  # no worker is forked
    warn_of_fork_hang(2, (3, 12, 1))
    assert capsys.readouterr().err == ""
