"""Checkpoints in an object store, damaged or taken away (issue 52), against moto's S3 server on
loopback: a bucket deleted mid-run stops the run and is never created again; damaged contents
(meta.json, bytes flipped in a shard, a store that answers with short bodies or HTTP 500s) are
one line, never a traceback; and a checkpoint whose files differ from the checksums recorded at
save is refused before launch, on a store and on a disk alike."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from launcher.checkpoint.bucket import make_folder
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
