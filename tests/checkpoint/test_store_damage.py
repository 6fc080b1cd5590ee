"""Checkpoints in an object store, damaged or taken away (issue 52), against moto's S3 server on
loopback: a bucket deleted mid-run stops the run and is never created again; damaged contents
(meta.json, bytes flipped in a shard, a store that answers with short bodies or HTTP 500s) are
one line, never a traceback; and a checkpoint whose files differ from the checksums recorded at
save is refused before launch, on a store and on a disk alike."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from launcher.checkpoint.bucket import make_folder
from launcher.checkpoint.checksums import (
    Unreadable,
    changed_file,
    entry_of,
    fingerprints,
    marker_text,
)
from launcher.storage_url import location
from tests.conftest import only_run_dir, run_train, usage_error, write_spec
from tests.forked_train import train_in_fork
from tests.s3_server import BUCKET, S3Server, s3_server
from tests.tiny_recipes import write_recipe

pytestmark = pytest.mark.timeout(300)

STEP_2, STEP_4 = "step-00000002", "step-00000004"
# A client gives up on HTTP 500s after two tries: a user's retries as many times, longer.
FEW_RETRIES = {"AWS_MAX_ATTEMPTS": "2"}

# Rank 0 deletes every object of the bucket $DOOMED_BUCKET, and the bucket, at micro-step 3:
# after step 2's checkpoint was published, before step 4's save.
BUCKET_GONE = """
import os

calls = 0


def loss(model, batch):
    global calls
    calls += 1
    if calls == 3 and os.environ["RANK"] == "0" and os.environ.get("DOOMED_BUCKET"):
        import s3fs

        s3fs.S3FileSystem().rm(os.environ["DOOMED_BUCKET"], recursive=True)
    return tiny.loss(model, batch)
"""


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    yield from s3_server()


def _spec(folder: Path, store: str | None, **sections: dict) -> Path:
    """A run of the tiny recipe that saves at steps 2 and 4, into `store` (else its folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    write_recipe(folder, BUCKET_GONE)
    checkpoint = {"every_n_steps": 2, **({"dir": store} if store else {})}
    return write_spec(
        folder / "run.yaml",
        {
            "recipe": {"source": str(folder / "recipe.py"), "dataset": {}},
            "train": {"max_steps": 4, "log_every": 1},
            "checkpoint": checkpoint,
        },
        **sections,
    )


def _saved(folder: Path, s3: S3Server, prefix: str) -> str:
    """A finished run of 4 steps into the store under `prefix`; its checkpoints' prefix."""
    spec = _spec(folder, f"s3://{BUCKET}/{prefix}/{{run}}")
    result = run_train(["--config", str(spec)], folder, env=s3.env)
    assert result.returncode == 0, result.stdout + result.stderr
    return f"{BUCKET}/{prefix}/{only_run_dir(folder / 'runs').name}"


def _flip_bytes(data: bytes) -> bytes:
    """The same number of bytes, a few in the middle flipped: no size check sees it."""
    middle = len(data) // 2
    return data[:middle] + bytes(b ^ 0xFF for b in data[middle : middle + 8]) + data[middle + 8 :]


def _error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one error line of a run, said alike by every rank that said it (a rank's lines
    come prefixed with its rank)."""
    output = result.stdout + result.stderr
    said = {re.sub(r"^\[ranks? [0-9-]+\] ", "", line) for line in output.splitlines()}
    errors = [line for line in said if line.startswith("error:")]
    assert len(errors) == 1, output
    return errors[0]


def test_a_bucket_deleted_mid_run_stops_the_run_and_is_never_created_again(
    tmp_path: Path, s3: S3Server
) -> None:
    """s3fs's makedirs creates a missing bucket: the next save used to write steps 4 and 6
    into a new bucket (default region, encryption and policies) and end with exit 0."""
    s3.filesystem().mkdir("doomed")
    spec = _spec(tmp_path, "s3://doomed/runs/{run}", train={"max_steps": 6})
    result = run_train(["--config", str(spec)], tmp_path, env={**s3.env, "DOOMED_BUCKET": "doomed"})
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert not s3.filesystem().exists("doomed"), "the bucket was created again"
    assert "Traceback" not in output
    line = _error_line(result)
    assert "bucket doomed" in line and "no longer exists" in line, line
    assert f"{STEP_2}, the newest checkpoint, may be lost with it" in line, line
    assert "intact" not in line


def test_a_damaged_meta_json_in_the_store_is_one_line_before_launch(
    tmp_path: Path, s3: S3Server
) -> None:
    """It used to be two tracebacks (`expected str, bytes or os.PathLike object, not S3Path`):
    the damage check took a store's path for a local one."""
    prefix = _saved(tmp_path, s3, "meta")
    s3.filesystem().pipe(f"{prefix}/{STEP_4}/meta.json", b"{")
    result = train_in_fork(["--config", "run.yaml", "--resume", "latest"], tmp_path, s3.env)
    usage_error(result, f"{prefix}/{STEP_4}", "meta.json: not valid JSON")
    assert "meta.json" in _error_line(result)
    assert f"newest intact checkpoint is s3://{prefix}/{STEP_2}" in result.stdout + result.stderr


def test_flipped_bytes_of_the_same_size_are_refused_before_launch(
    tmp_path: Path, s3: S3Server
) -> None:
    """The pre-launch check read sizes only: the flipped shard failed in a rank (`Weights only
    load failed`), or worse, loaded. The checksums recorded at save catch it, from the store's
    ETag (the check downloads only the file whose ETag changed). A disk's checkpoint:
    tests/checkpoint/test_checkpoint_damage.py."""
    prefix = _saved(tmp_path, s3, "flipped")
    shard, fs = f"{prefix}/{STEP_4}/__0_0.distcp", s3.filesystem()
    fs.pipe(shard, _flip_bytes(fs.cat(shard)))
    resume = ["--config", "run.yaml", "--resume", "latest", "train.max_steps=6"]
    result = train_in_fork(resume, tmp_path, s3.env)
    intact = f"s3://{prefix}/{STEP_2}"
    usage_error(result, STEP_4, "__0_0.distcp", "checksum", f"newest intact checkpoint is {intact}")
    _error_line(result)


@pytest.mark.parametrize(
    ("file", "code"), [("meta.json", 2), ("__1_0.distcp", 1)], ids=["in-the-launcher", "in-a-rank"]
)
def test_a_store_that_answers_with_short_bodies_is_one_line(
    tmp_path: Path, s3: S3Server, file: str, code: int
) -> None:
    """GET bodies cut short of their Content-Length (aiohttp's ClientPayloadError) used to
    be a traceback: read by the launcher's check before launch (exit 2), or by a rank's
    load (exit 1), where the store's listing vouched for the file."""
    prefix = _saved(tmp_path, s3, f"short-{code}")
    s3.truncated_gets.add(f"{STEP_4}/{file}")
    try:
        resume = ["--config", "run.yaml", "--resume", "latest", "train.max_steps=6"]
        result = run_train(resume, tmp_path, env=s3.env)
    finally:
        s3.truncated_gets.clear()
    output = result.stdout + result.stderr
    assert result.returncode == code, output
    assert "Traceback" not in output
    line = _error_line(result)
    assert f"{prefix}/{STEP_4}" in line and file in line, line
    assert "could not be read" in line and "3" in re.sub(r"[^0-9]", "", line), line


def test_http_500s_on_a_steps_folder_are_the_could_not_be_written_line(
    tmp_path: Path, s3: S3Server
) -> None:
    """Every request for step 4's folder fails: its save stops the run with the line a failed
    save promises, even though what it wrote cannot be removed either (it used to be a
    rank's OSError from that removal)."""
    spec = _spec(tmp_path, f"s3://{BUCKET}/failing/{{run}}")
    s3.failing_paths.add(STEP_4)
    try:
        result = run_train(["--config", str(spec)], tmp_path, env={**s3.env, **FEW_RETRIES})
    finally:
        s3.failing_paths.clear()
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "Traceback" not in output
    line = _error_line(result)
    assert f"checkpoint {STEP_4} could not be written to s3://{BUCKET}/failing/" in line, line
    assert f"earlier checkpoints are intact (newest: {STEP_2})" in line, line


# The pure parts, with a store.


def test_a_store_folder_is_made_without_ever_making_a_bucket(tmp_path: Path, s3: S3Server) -> None:
    """s3fs's makedirs creates a missing bucket; `make_folder` never does, on a store or on a
    disk (where the top folder of a path is the store's bucket)."""
    fs = s3.filesystem()
    make_folder(fs, f"{BUCKET}/a/b/step-00000002")  # S3 has no folders: the bucket is there
    with pytest.raises(FileNotFoundError, match="no-such-bucket"):
        make_folder(fs, "no-such-bucket/a/step-00000002")
    assert not fs.exists("no-such-bucket")
    local = fsspec.filesystem("file")
    make_folder(local, str(tmp_path / "a" / "b" / "c"))
    assert (tmp_path / "a" / "b" / "c").is_dir()
    make_folder(local, str(tmp_path / "a" / "b" / "c"))  # there already: nothing to do
    with pytest.raises(FileNotFoundError):
        make_folder(local, "/no-such-top-folder-of-launcher-tests/a")
    assert not Path("/no-such-top-folder-of-launcher-tests").exists()


def test_a_store_listing_vouches_for_unchanged_files_and_a_copy_is_read(
    tmp_path: Path, s3: S3Server
) -> None:
    """A file whose ETag is the one recorded is not read (a body cut short would show it);
    one copied with another ETag is read and hashed, and passes when its bytes are the same."""
    fs, folder = s3.filesystem(), f"{BUCKET}/listed/step-00000002"
    shard = bytes(range(256)) * 64
    fs.pipe(f"{folder}/__0_0.distcp", shard)
    checkpoint = location(f"s3://{folder}", {"endpoint_url": s3.env["AWS_ENDPOINT_URL"]})
    with _env(s3.env):
        entries = {"__0_0.distcp": entry_of(shard)}
        fs.pipe(f"{folder}/COMPLETE", marker_text(entries, fingerprints(checkpoint)))
        s3.truncated_gets.add("__0_0.distcp")
        try:
            assert changed_file(checkpoint) is None  # the listing's ETag: no byte read
            fs.pipe(f"{folder}/COMPLETE", marker_text(entries, {"__0_0.distcp": '"another"'}))
            with pytest.raises(Unreadable, match="received 8192 of 16384 bytes"):
                changed_file(checkpoint)  # read, and the store cut it short
        finally:
            s3.truncated_gets.clear()
        assert changed_file(checkpoint) is None  # read whole: the same bytes


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    """The store's credentials in this process's environment, as a launcher has them."""
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
