"""How often a launch lists a run's store (issue 54): on S3 each listing is a LIST request,
billed and slow, and a launch asks "which is the newest checkpoint" in many places (the resume
rule, the choice of folder, the store's check, the damage check). The launcher lists once and
passes the answer on; its workers read the checkpoint their plan names without listing."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import finish_train, run_train, start_train, write_spec
from tests.s3_server import BUCKET, S3Server, s3_server

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    yield from s3_server()


def _listings(s3: S3Server, since: int = 0) -> list[str]:
    """The LIST requests (ListObjectsV2) the server took since its `since`-th request."""
    return [r for r in s3.requests[since:] if r.startswith(f"GET /{BUCKET}?list-type=2")]


def _launcher_part(proc: subprocess.Popen[str]) -> list[str]:
    """What `train` prints up to the line that says it resumes, which it prints once it has
    planned and written the run folder, before it starts a worker."""
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("resuming "):
            return lines
    pytest.fail("train ended before it said it resumes:\n" + "".join(lines))


def test_a_resume_latest_lists_the_store_at_most_twice_in_the_launcher(
    tmp_path: Path, s3: S3Server
) -> None:
    """The shortest run that resumes from a store: one step, saved, then one more. Before,
    the launcher listed the store 6 times (the resume rule, the folder's choice twice, the
    store check, the resume again, the folder's check under its lock) and the damage check
    once more; now once for the newest checkpoint (whose files the damage check takes from
    that listing) and once under the run folder's lock, where another launcher may have
    written since."""
    store = f"s3://{BUCKET}/listed/{{run}}"
    spec = write_spec(
        tmp_path / "run.yaml",
        launch={"devices": 1},
        checkpoint={"every_n_steps": 1, "dir": store},
        train={"max_steps": 1},
    )
    first = run_train(["--config", str(spec)], tmp_path, env=s3.env)
    assert first.returncode == 0, first.stdout + first.stderr
    since = len(s3.requests)
    args = ["--config", str(spec), "--resume", "latest", "train.max_steps=2"]
    proc = start_train(args, tmp_path, env=s3.env)
    said = _launcher_part(proc)
    launcher = _listings(s3, since)
    resumed = finish_train(proc, tmp_path)
    assert resumed.returncode == 0, "".join(said) + resumed.stdout + resumed.stderr
    assert "resumed at step 1" in resumed.stdout
    assert len(launcher) <= 2, "\n".join(launcher)
