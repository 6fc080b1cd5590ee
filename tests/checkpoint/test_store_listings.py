"""How often a launch lists a run's store (issue 54): on S3 each listing is a LIST request,
billed and slow, and a launch asks "which is the newest checkpoint" in many places (the resume
rule, the choice of folder, the store's check, the damage check). The launcher lists once and
passes the answer on; its workers read the checkpoint their plan names without listing."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.checkpoint.catalog import Listings
from launcher.checkpoint.selection import attempt_start, resume_point
from launcher.checkpoint.store import Listing, store_at, store_described
from launcher.checkpoint.stores.local_folder import LocalStore
from launcher.launch.plan import make_plan
from launcher.rundir.layout import CheckpointFiles, RunLayout
from launcher.rundir.worker_plan import WorkerPlan
from tests.conftest import bare_spec, finish_train, run_train, write_spec
from tests.forked_train import fork_train
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
    the launcher made 16 LIST requests: it asked for the newest checkpoint 6 times (the resume
    rule, the folder's choice twice, the store check, the resume again, the folder's check
    under its lock), each a listing of two requests or more, and the damage check listed the
    checkpoint once more. Now: one listing for the newest checkpoint, whose files the damage
    check takes from it, and one under the run folder's lock, where another launcher may have
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
    proc = fork_train(args, tmp_path, env=s3.env)
    said = _launcher_part(proc)
    launcher = _listings(s3, since)
    resumed = finish_train(proc, tmp_path)
    assert resumed.returncode == 0, "".join(said) + resumed.stdout + resumed.stderr
    assert "resumed at step 1" in resumed.stdout
    assert len(launcher) <= 2, "\n".join(launcher)


def _complete(run_dir: Path, step: int) -> Path:
    """A checkpoint folder with its marker: complete, as a listing sees it."""
    path = RunLayout(run_dir).checkpoint(step)
    path.mkdir(parents=True)
    CheckpointFiles(path).marker.touch()
    return path


def _counted(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The folders whose store a listing is made of, from here on."""
    made: list[Path] = []
    listing = LocalStore.listing

    def counted(store: LocalStore) -> Listing:
        made.append(store.root)
        return listing(store)

    monkeypatch.setattr(LocalStore, "listing", counted)
    return made


def test_a_launch_lists_each_store_once_and_a_run_of_one_machine_s_workers_not_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "runs" / "exp" / "a"
    chosen = _complete(run, 4)
    made = _counted(monkeypatch)
    listings = Listings()
    assert listings.newest(run) == chosen
    assert listings.of(store_at(RunLayout(run).checkpoints)).newest == chosen  # another object
    assert resume_point(chosen, run, listings) == chosen
    assert len(made) == listings.made == 1
    newer = _complete(run, 8)  # saved since, by an attempt of this launch
    assert attempt_start(chosen, run, 0, store_at(RunLayout(run).checkpoints), False) == chosen
    assert len(made) == 1  # one machine: no node joins, so its first attempt is the plan's
    assert attempt_start(chosen, run, 0) == newer  # nodes may join: it looks
    assert attempt_start(chosen, run, 1, nodes_may_join=False) == newer  # a restart: the rule


def test_the_workers_are_told_the_store_the_launcher_resolved_once(tmp_path: Path) -> None:
    """`{run}` filled in once, in the decision: spec.yaml, the worker plan and the run folder's
    record all name that store, and a worker builds it from its plan alone."""
    run_dir = tmp_path / "runs" / "exp" / "a"
    (tmp_path / "store" / "a").mkdir(parents=True)  # file:// makes no top folder of its own
    spec = bare_spec(tmp_path)
    checkpoint = spec.checkpoint.model_copy(update={"dir": f"file://{tmp_path}/store/{{run}}"})
    plan = make_plan(spec.model_copy(update={"checkpoint": checkpoint}), run_dir=run_dir)
    url = f"file://{tmp_path}/store/a"
    assert plan.spec.checkpoint.dir == url and str(plan.store.root) == url
    plan.worker_plan().write(tmp_path / "worker-plan.json")
    told = WorkerPlan.read(tmp_path / "worker-plan.json")
    assert told.store == plan.store.describe() and told.nodes_may_join is False
    assert store_described(told.store) == plan.store and store_described(told.store).remote


def test_a_run_that_saved_to_a_store_resumes_with_checkpoints_off(tmp_path: Path) -> None:
    """A run whose checkpoints went to a store, continued with checkpoints off: its folder's
    record says where they are, and the launch and its workers keep that store, not the
    folder's empty `checkpoints/` (which the launch, listing it again under the folder's lock,
    took for another launcher's work)."""
    (tmp_path / "store" / "a").mkdir(parents=True)  # file:// makes no top folder of its own
    spec = write_spec(
        tmp_path / "run.yaml",
        launch={"devices": 1},
        checkpoint={"every_n_steps": 1, "dir": f"file://{tmp_path}/store/{{run}}"},
        train={"max_steps": 1},
    )
    run_dir = tmp_path / "a"
    first = run_train(["--config", str(spec), "--run-dir", str(run_dir)], tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    args = ["--resume", str(run_dir), "checkpoint.enabled=false", "train.max_steps=2"]
    resumed = run_train(args, tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed at step 1" in resumed.stdout
