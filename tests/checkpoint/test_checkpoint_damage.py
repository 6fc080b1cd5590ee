"""A damaged checkpoint is refused by the launcher before it creates a folder or starts a worker
(exit 2, no traceback), naming the damaged file and the newest intact checkpoint; nothing that
existed is changed; bytes changed in place, of the same size, are found by the checksums a save
records. A branch attempt that failed never blocks its retry, and what a pruning cut short
leaves is removed by the next start."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from launcher.checkpoint.checksums import (
    HashingStream,
    changed_file,
    entry_of,
    marker_text,
    recorded_files,
)
from tests.conftest import metrics_of, run_train, usage_error, write_spec
from tests.forked_train import train_in_fork

pytestmark = pytest.mark.timeout(240)

RUN = "runs/t/base"
STEP_4, STEP_6 = f"{RUN}/checkpoints/step-00000004", f"{RUN}/checkpoints/step-00000006"


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flipped(data: bytes) -> bytes:
    """A few bytes in the middle flipped, the size kept: what only a checksum finds."""
    middle = len(data) // 2
    return data[:middle] + bytes(b ^ 0xFF for b in data[middle : middle + 8]) + data[middle + 8 :]


# The damage done to step 6, and what the message names. Where DCP's metadata is read, the
# smoke suite checks on every torch.
DAMAGES = [
    pytest.param(lambda c: (c / "__0_0.distcp").unlink(), "__0_0.distcp is missing", id="missing"),
    pytest.param(
        lambda c: _truncate(c / "__1_0.distcp"),
        "__1_0.distcp is truncated",
        id="truncated-distcp",
        marks=pytest.mark.smoke,
    ),
    pytest.param(lambda c: _truncate(c / "rank-1.pt"), "rank-1.pt does not load", id="rank-pt"),
    pytest.param(
        lambda c: (c / "__0_0.distcp").write_bytes(_flipped((c / "__0_0.distcp").read_bytes())),
        "__0_0.distcp does not match its checksum",
        id="flipped-bytes",  # the same size: it loaded, or failed in a rank (issue 52)
        marks=pytest.mark.smoke,  # the checksums are recorded through DCP's writer's streams
    ),
    pytest.param(
        lambda c: (c / "meta.json").write_text("{garbage"),
        "meta.json: not valid JSON",
        id="garbage-meta",
    ),
]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run of 2 processes with checkpoints at steps 2, 4 and 6, evaluated at each."""
    folder = tmp_path_factory.mktemp("base")
    _spec(folder)
    result = run_train(["--config", "run.yaml", "--run-dir", RUN], cwd=folder)
    assert result.returncode == 0, result.stdout + result.stderr
    return folder


def _spec(folder: Path) -> None:
    write_spec(
        folder / "run.yaml",
        train={"max_steps": 6, "log_every": 1},
        checkpoint={"every_n_steps": 2, "monitor": "val/loss"},
        eval={"every_n_steps": 2, "max_batches": 2},
    )


def _copy(base: Path, tmp_path: Path) -> None:
    shutil.copytree(base / "runs", tmp_path / "runs")
    _spec(tmp_path)


def _snapshot(folder: Path) -> dict[Path, str]:
    return {
        p: hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
        for p in folder.rglob("*")
    }


@pytest.mark.parametrize(("damage", "named"), DAMAGES)
def test_a_damaged_checkpoint_is_refused_naming_the_file_and_the_newest_intact_one(
    base: Path, tmp_path: Path, damage: Callable[[Path], None], named: str
) -> None:
    _copy(base, tmp_path)
    damage(tmp_path / STEP_6)
    before = _snapshot(tmp_path)
    result = train_in_fork(["--config", "run.yaml", "--resume", "latest"], tmp_path, timeout=60)
    usage_error(result, "step-00000006", named, f"newest intact checkpoint is {tmp_path / STEP_4}")
    assert "--run-dir" in result.stdout + result.stderr  # how to resume it: branch off
    assert _snapshot(tmp_path) == before, "a file was changed, added or deleted"


def test_resume_best_refuses_a_damaged_record_of_the_best(base: Path, tmp_path: Path) -> None:
    _copy(base, tmp_path)
    (tmp_path / STEP_6 / "meta.json").write_text("{garbage")
    before = _snapshot(tmp_path)
    result = train_in_fork(["--config", "run.yaml", "--resume", "best"], tmp_path, timeout=60)
    usage_error(result, "--resume best", "meta.json: not valid JSON", "step-00000004")
    assert _snapshot(tmp_path) == before


def test_failed_branch_attempts_leave_nothing_in_the_way_of_the_retry(
    base: Path, tmp_path: Path
) -> None:
    """One refused before anything starts, one that failed before its first step: the retry
    trains in the same folder."""
    _copy(base, tmp_path)
    _truncate(tmp_path / STEP_6 / "__1_0.distcp")
    branch = ["--config", "run.yaml", "--run-dir", "branch"]
    usage_error(train_in_fork([*branch, "--resume", STEP_6], tmp_path, timeout=60), "truncated")
    assert not (tmp_path / "branch").exists()
    branch += ["--resume", STEP_4]
    # Another model: the workers refuse the checkpoint, after the folder was created.
    failed = run_train([*branch, "recipe.model={hidden: 8}"], cwd=tmp_path)
    assert failed.returncode != 0 and "does not fit the model" in failed.stdout + failed.stderr
    assert "hidden: 8" in (tmp_path / "branch" / "spec.yaml").read_text()
    result = run_train([*branch, "train.max_steps=5"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "branch" / "checkpoints" / "step-00000005" / "COMPLETE").exists()
    assert {r["step"] for r in metrics_of(tmp_path / "branch")} == {5}
    # The folder's spec is the attempt's that trained, not the one that failed.
    assert "hidden" not in (tmp_path / "branch" / "spec.yaml").read_text()
    assert not list((tmp_path / "branch").glob("spec.resume-*"))


def test_a_pruning_cut_short_is_finished_by_the_next_start(base: Path, tmp_path: Path) -> None:
    """Its launcher was killed while it deleted an unpublished checkpoint: the resume removes
    the hidden folder, says what it freed, and keeps every checkpoint."""
    _copy(base, tmp_path)
    checkpoints = tmp_path / RUN / "checkpoints"
    left = checkpoints / ".step-00000002.deleting"
    shutil.move(checkpoints / "step-00000002", left)
    result = run_train(
        ["--config", "run.yaml", "--resume", "latest", "train.max_steps=7"], tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"note: removed {left.name} from {checkpoints}" in result.stderr
    assert not left.exists()
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "step-00000004",
        "step-00000006",
        "step-00000007",
    ]


def test_a_checkpoint_saved_before_checksums_still_resumes(base: Path, tmp_path: Path) -> None:
    """An empty COMPLETE marker, as every save wrote before checksums (issue 52): nothing to
    check against, and the checks before them still made."""
    _copy(base, tmp_path)
    (tmp_path / STEP_6 / "COMPLETE").write_text("")
    resume = ["--config", "run.yaml", "--resume", "latest", "train.max_steps=7"]
    resumed = run_train(resume, tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed at step 6" in resumed.stdout
    new = tmp_path / RUN / "checkpoints" / "step-00000007"
    assert recorded_files(new) is not None  # a new save records them


# The record of a checkpoint's files, without a run.


def _folder_with_a_record(folder: Path, files: dict[str, bytes]) -> Path:
    """A checkpoint folder holding `files`, its marker recording them as a save does."""
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    (folder / "COMPLETE").write_bytes(
        marker_text({name: entry_of(data) for name, data in files.items()}, {})
    )
    return folder


@pytest.mark.launcher_only
def test_the_record_finds_flipped_bytes_a_new_size_and_a_missing_file(tmp_path: Path) -> None:
    shard = bytes(range(256)) * 64
    files = {"__0_0.distcp": shard, "meta.json": b"{}"}
    checkpoint = _folder_with_a_record(tmp_path / "c", files)
    assert changed_file(checkpoint) is None
    (checkpoint / "__0_0.distcp").write_bytes(_flipped(shard))
    assert changed_file(checkpoint) == (
        "__0_0.distcp does not match its checksum: its bytes changed since it was saved"
    )
    (checkpoint / "__0_0.distcp").write_bytes(shard[:-1])
    assert changed_file(checkpoint) == "__0_0.distcp is 16,383 bytes, where 16,384 were saved"
    (checkpoint / "__0_0.distcp").unlink()
    assert changed_file(checkpoint) == "__0_0.distcp is missing"
    (checkpoint / "COMPLETE").write_text("")  # saved before checksums: nothing to check
    assert changed_file(checkpoint) is None
    (checkpoint / "COMPLETE").write_text('{"files": {"../x": {"size": 1, "sha256": "0"}}}')
    assert "names a file outside the checkpoint" in (changed_file(checkpoint) or "")


@pytest.mark.launcher_only
def test_a_stream_is_hashed_as_it_is_written(tmp_path: Path) -> None:
    with (tmp_path / "f").open("wb") as file:
        stream = HashingStream(file)
        for part in (b"abc", memoryview(b"def"), bytearray(b"g" * 100_000)):
            stream.write(part)
        assert stream.tell() == 100_006  # the stream's own, as DCP's writer asks it
    assert stream.entry() == entry_of((tmp_path / "f").read_bytes())
