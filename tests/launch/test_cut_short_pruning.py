"""A launcher killed while it pruned an old checkpoint leaves its hidden `.step-N.deleting`
folder, as large as a checkpoint (issue 39). The next launcher of the run folder removes it,
and nothing else, once it holds the folder's lock; a launcher that does not hold it (another
node of the job, or a file system without flock) leaves it to the one that does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from launcher.checkpoint.pruning import finish_cut_short
from launcher.clusters.nodes import Nodes
from launcher.errors import UsageError
from launcher.launch.plan import make_plan
from launcher.launch.run_folder import prepare_run_dir
from launcher.rundir.layout import CheckpointFiles, RunLayout
from launcher.rundir.lock import RunLock, take
from tests.conftest import bare_spec

pytestmark = [pytest.mark.launcher_only, pytest.mark.timeout(60)]


def _cut_short(layout: RunLayout, step: int, megabytes: int = 1) -> Path:
    """What a launcher killed mid-prune leaves: a checkpoint unpublished, partly deleted."""
    folder = CheckpointFiles(layout.checkpoint(step)).unpublished
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"\0" * (megabytes << 20))
    return folder


def test_the_next_launcher_of_the_folder_removes_it_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    node_0, node_1 = (Nodes(2, 2, rank, "node01:29500", "job7") for rank in (0, 1))
    layout = make_plan(bare_spec(tmp_path), nodes=node_0).layout
    left = _cut_short(layout, 2, megabytes=3)
    interrupted = layout.staging(4)  # a save cut short: the failure report names it
    interrupted.mkdir()
    # Another node of the job holds no lock: it leaves the folder to node 0's launcher.
    prepare_run_dir(make_plan(bare_spec(tmp_path), nodes=node_1)).release()
    assert left.is_dir()
    with prepare_run_dir(make_plan(bare_spec(tmp_path), nodes=node_0)):
        assert not left.exists()
        said = capsys.readouterr().err
        assert f"note: removed {left.name} from {layout.checkpoints}" in said
        assert "cut short (3.0 MB freed)" in said
        assert interrupted.is_dir()
        # A launcher refused because this one holds the folder removes nothing.
        again = _cut_short(layout, 6)
        with pytest.raises(UsageError, match=f"pid {os.getpid()} on host"):
            prepare_run_dir(make_plan(bare_spec(tmp_path), nodes=node_0))
        assert again.is_dir()


def test_only_pruned_folders_are_removed_and_only_under_the_lock(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path / "run")
    left = _cut_short(layout, 2)
    kept = [layout.checkpoint(4), layout.staging(6), layout.checkpoints / ".step-8.deleting"]
    for folder in kept:
        folder.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "data").write_text("a user's")
    link = CheckpointFiles(layout.checkpoint(10)).unpublished
    link.symlink_to(elsewhere, target_is_directory=True)
    # No flock on this file system: another launcher may be deleting it right now.
    assert finish_cut_short(layout, RunLock()) is None
    assert left.is_dir()
    layout.root.mkdir(exist_ok=True)
    with take(layout) as lock:
        assert finish_cut_short(layout, lock) is not None
    assert not left.exists()
    assert all(folder.is_dir() for folder in kept)
    assert link.is_symlink() and (elsewhere / "data").read_text() == "a user's"
    with take(layout) as lock:  # nothing left to remove: nothing said
        assert finish_cut_short(layout, lock) is None
