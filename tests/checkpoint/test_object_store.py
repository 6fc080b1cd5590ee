"""Checkpoints in an object store (`checkpoint.dir: s3://...`), against a real S3 server on
loopback (moto): the same exact resume as from a disk, crash safety without a rename, the
retention rules, every reader taking a URL, two nodes with private run folders, and the
errors and secrets rules."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.conftest import (
    finish_train,
    free_port,
    metrics_of,
    only_run_dir,
    run_train,
    start_train,
    tiny_gpt,
    usage_error,
    write_spec,
)
from tests.forked_train import fork_train
from tests.s3_server import BUCKET, S3Server, s3_server

pytestmark = pytest.mark.timeout(300)
STEPS = 8


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    yield from s3_server()


def _spec(folder: Path, *, store: str | None, **sections: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    checkpoint = {"every_n_steps": 2, **({"dir": store} if store else {})}
    defaults = {
        "checkpoint": checkpoint,
        "recipe": tiny_gpt(max_bytes=4000),
        "data": {"batch_size": 4, "shuffle": True},
        "optim": {"name": "AdamW", "lr": 3e-3},
        "train": {"max_steps": STEPS, "log_every": 1},
    }
    return write_spec(folder / "run.yaml", defaults, **sections)


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics_of(run_dir) if "loss" in r}


def _weights(checkpoint_dir: Path, scratch: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(checkpoint_dir, scratch)
    return torch.load(scratch, weights_only=True)["model"]


def _download(s3: S3Server, prefix: str, into: Path) -> Path:
    s3.filesystem().get(f"{BUCKET}/{prefix}/", str(into), recursive=True)
    return into


def _complete_steps(s3: S3Server, prefix: str) -> list[int]:
    fs = s3.filesystem()
    return sorted(int(p.split("/")[-2][5:]) for p in fs.glob(f"{BUCKET}/{prefix}/step-*/COMPLETE"))


def _glob(fs: object, pattern: str) -> list[str]:
    """What matches now: s3fs's glob raises FileNotFoundError when an object it listed is
    replaced as it looks (DCP writes `.metadata.tmp`, then renames it)."""
    try:
        return fs.glob(pattern)  # type: ignore[attr-defined]
    except FileNotFoundError:
        return []


def _kill_in_upload(s3: S3Server, proc: subprocess.Popen[str], pattern: str) -> None:
    """SIGKILLs the run while the file `pattern` names is in the store and the checkpoint's
    meta.json is held back on its way there (its COMPLETE marker would follow it)."""
    fs = s3.filesystem()
    deadline = time.monotonic() + 150
    while not _glob(fs, pattern):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the run ended (or hung) before {pattern} appeared")
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_killed_in_an_upload_resumes_from_the_last_complete_one_bitwise(
    tmp_path: Path, s3: S3Server, strategy: str
) -> None:
    """Killed while step 4's meta.json is uploading: its shards are in the store, its marker
    is not, so `--resume latest` takes step 2 and the run ends exactly as one never stopped."""
    launch = {"launch": {"strategy": strategy}}
    reference = tmp_path / "reference"
    result = run_train(["--config", str(_spec(reference, store=None, **launch))], cwd=reference)
    assert result.returncode == 0, result.stdout + result.stderr
    folder, prefix = tmp_path / "stored", f"kill-{strategy}"
    spec = _spec(folder, store=f"s3://{BUCKET}/{prefix}/{{run}}", **launch)
    s3.slow_puts["step-00000004/meta.json"] = 60.0
    try:
        proc = fork_train(["--config", str(spec)], folder, env=s3.env)
        _kill_in_upload(s3, proc, f"{BUCKET}/{prefix}/*/step-00000004/.metadata")
        # Held until no process of the run is left: its workers outlive the launcher's SIGKILL
        # by a moment, in which rank 0 may still send meta.json (CI saw it, on a loaded machine).
        finish_train(proc, folder)
    finally:
        s3.slow_puts.clear()
    run_dir = only_run_dir(folder / "runs")
    store = f"{prefix}/{run_dir.name}"
    assert _complete_steps(s3, store) == [2]
    assert s3.filesystem().glob(f"{BUCKET}/{store}/step-00000004/*.distcp")  # half uploaded

    resumed = run_train(["--config", str(spec), "--resume", "latest"], folder, env=s3.env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed at step 2" in resumed.stdout
    assert only_run_dir(folder / "runs") == run_dir  # continued in its own folder
    assert _complete_steps(s3, store) == [2, 4, 6, 8]
    ours, theirs = _losses(run_dir), _losses(only_run_dir(reference / "runs"))
    assert ours == theirs
    final = _download(s3, f"{store}/step-{STEPS:08d}", tmp_path / "final")
    a = _weights(final, tmp_path / "a.pt")
    b = _weights(
        only_run_dir(reference / "runs") / f"checkpoints/step-{STEPS:08d}", tmp_path / "b.pt"
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    _assert_no_secret(run_dir, s3)


def test_a_save_the_store_refuses_fails_the_run_and_loses_no_checkpoint(
    tmp_path: Path, s3: S3Server
) -> None:
    """Step 4's upload is refused (AccessDenied, after the client's own retries, if any): the
    run fails, step 2 stays the newest complete checkpoint, nothing of step 4 is left, and a
    resume continues from step 2 to the end."""
    spec = _spec(tmp_path, store=f"s3://{BUCKET}/refused/{{run}}", train={"max_steps": 6})
    s3.refused_puts.add("step-00000004/rank-0.pt")
    try:
        failed = run_train(["--config", str(spec)], tmp_path, env=s3.env)
    finally:
        s3.refused_puts.clear()
    assert failed.returncode == 1, failed.stdout + failed.stderr
    said = "could not be written to s3://runs/refused/"  # one line, not DCP's tracebacks
    assert said in failed.stdout and "refused by the test" in failed.stdout, failed.stdout
    assert "earlier checkpoints are intact (newest: step-00000002)" in failed.stdout
    assert "Traceback" not in failed.stdout
    run_dir = only_run_dir(tmp_path / "runs")
    store = f"refused/{run_dir.name}"
    assert _complete_steps(s3, store) == [2]
    assert not s3.filesystem().glob(f"{BUCKET}/{store}/step-00000004/*")
    resumed = run_train(["--config", str(spec), "--resume", "latest"], tmp_path, env=s3.env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed at step 2" in resumed.stdout
    assert _complete_steps(s3, store) == [2, 4, 6]


def _assert_no_secret(run_dir: Path, s3: S3Server) -> None:
    secrets = [s3.env["AWS_SECRET_ACCESS_KEY"], s3.env["AWS_ACCESS_KEY_ID"]]
    for path in run_dir.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert not any(s.encode() in data for s in secrets), path


def test_retention_keeps_the_newest_the_best_and_the_one_resumed_from(
    tmp_path: Path, s3: S3Server
) -> None:
    """keep_last 1 with the best 2 by val/loss over 10 saves; then a resume from the newest,
    which the resumed run's own pruning never takes."""
    spec = write_spec(
        tmp_path / "run.yaml",
        train={"max_steps": 10, "log_every": 1},
        eval={"every_n_steps": 1, "max_batches": 2},
        checkpoint={
            "every_n_steps": 1,
            "keep_last": 1,
            "monitor": "val/loss",
            "mode": "max",  # the falling loss's best are its oldest: kept whatever their age
            "keep_best": 2,
            "dir": f"s3://{BUCKET}/retention/{{run}}",
        },
    )
    result = run_train(["--config", str(spec)], tmp_path, env=s3.env)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = only_run_dir(tmp_path / "runs")
    store = f"retention/{run_dir.name}"
    scores = {r["step"]: r["val/loss"] for r in metrics_of(run_dir) if "val/loss" in r}
    best = sorted(scores, key=lambda step: (-scores[step], step))[:2]
    assert max(best) < 9  # the test's point: old ones kept
    assert _complete_steps(s3, store) == sorted({10, *best})
    assert not [
        p
        for p in s3.filesystem().ls(f"{BUCKET}/{store}")
        if "COMPLETE" not in str(p) and not s3.filesystem().exists(f"{p}/COMPLETE")
    ]  # nothing half deleted

    more = ["--config", str(spec), "--resume", "latest", "train.max_steps=12"]
    result = run_train(more, tmp_path, env=s3.env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert 10 in _complete_steps(s3, store) and 12 in _complete_steps(s3, store)


def test_export_and_load_weights_take_a_url(tmp_path: Path, s3: S3Server) -> None:
    spec = _spec(tmp_path, store=f"s3://{BUCKET}/readers/{{run}}", train={"max_steps": 2})
    result = run_train(["--config", str(spec)], tmp_path, env=s3.env)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = only_run_dir(tmp_path / "runs")
    url = f"s3://{BUCKET}/readers/{run_dir.name}/step-00000002"
    for source, out in [(url, "a.safetensors"), (str(run_dir), "b.safetensors")]:
        exported = run_train(["export", source, "--out", out], tmp_path, env=s3.env)
        assert exported.returncode == 0, exported.stdout + exported.stderr
        assert url in exported.stdout  # a run folder's newest is in its store
    local = _download(s3, f"readers/{run_dir.name}/step-00000002", tmp_path / "local")
    exported = run_train(["export", str(local), "--out", "c.safetensors"], tmp_path)
    assert exported.returncode == 0, exported.stdout + exported.stderr
    from safetensors.torch import load_file

    a, c = load_file(tmp_path / "a.safetensors"), load_file(tmp_path / "c.safetensors")
    assert a.keys() == c.keys() and all(torch.equal(a[k], c[k]) for k in a)

    fine_tune = ["--config", str(spec), "--load-weights", url, "checkpoint.enabled=false"]
    tuned = run_train(fine_tune, tmp_path, env=s3.env)
    assert tuned.returncode == 0, tuned.stdout + tuned.stderr
    assert "load.weights: loaded" in tuned.stdout and url in tuned.stdout


def _node(spec: Path, rank: int, port: int, folder: Path, *extra: str) -> list[str]:
    return [
        "--config", str(spec), "--devices", "1", "--nnodes", "2", "--node-rank", str(rank),
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job1",
        "--run-dir", str(folder / "job1"), *extra,
    ]  # fmt: skip


def _two_nodes(spec: Path, s3: S3Server, *extra: str) -> Path:
    """Two nodes on loopback, each with a run folder of its own; node 0's run folder."""
    port, cwd = free_port(), spec.parent
    # One OpenMP thread per worker. Each node's launcher gives its workers every core, and
    # the GPT's float32 losses move by a rounding step with the size of the team that ran
    # its kernels (1 or 2 threads: steps 5 and 6 of 8). CI once saw the losses of two runs
    # of one spec a step apart, before any resume; one thread leaves no team to differ.
    env = {**s3.env, "OMP_NUM_THREADS": "1"}
    procs = [
        start_train(_node(spec, rank, port, cwd / f"node{rank}", *extra), cwd, env=env)
        for rank in (1, 0)  # node 1 first: it waits for node 0, which hosts the rendezvous
    ]
    # Both nodes' processes carry the folder in their command lines: look for leftovers only
    # once both have ended.
    deadline = time.monotonic() + 150
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(1.0, deadline - time.monotonic()))
    for result in [finish_train(proc, cwd, timeout=5) for proc in procs]:
        assert result.returncode == 0, result.stdout + result.stderr
    return cwd / "node0" / "job1"


def test_two_nodes_with_their_own_run_folders_save_to_and_resume_from_one_store(
    tmp_path: Path, s3: S3Server
) -> None:
    """Before stores, nodes whose run folders are their own were refused (and earlier lost
    their work at the first save). The resumed run matches one that never stopped."""
    stopped = _spec(tmp_path / "a", store=f"s3://{BUCKET}/nodes/{{run}}", train={"max_steps": 4})
    node0 = _two_nodes(stopped, s3)
    assert _complete_steps(s3, "nodes/job1") == [2, 4]
    _two_nodes(stopped, s3, "--resume", "latest", f"train.max_steps={STEPS}")
    assert _complete_steps(s3, "nodes/job1") == [2, 4, 6, 8]
    for node in (node0, tmp_path / "a" / "node1" / "job1"):
        assert (node / "checkpoint-store.json").is_file()
        assert not (node / "checkpoints").exists() or not any((node / "checkpoints").iterdir())

    whole = _spec(tmp_path / "b", store=f"s3://{BUCKET}/nodes-whole/{{run}}")
    assert _losses(node0) == _losses(_two_nodes(whole, s3))


@pytest.mark.parametrize(
    "case",
    ["secret in the spec", "no such bucket", "no credentials", "unreachable endpoint"],
)
def test_a_store_that_cannot_serve_is_one_line_before_anything_starts(
    tmp_path: Path, s3: S3Server, case: str
) -> None:
    store = f"s3://{BUCKET}/errors/{{run}}"
    env, extra, expected = dict(s3.env), [], ""  # the test process has no AWS_ variables
    if case == "secret in the spec":
        extra, expected = ["checkpoint.storage_options.secret=abc"], "AWS_SECRET_ACCESS_KEY"
    elif case == "no such bucket":
        store, expected = "s3://no-such-bucket/x", "no such bucket"
    elif case == "no credentials":
        del env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
        expected = "no credentials found"
    else:
        env["AWS_ENDPOINT_URL"], expected = f"http://127.0.0.1:{free_port()}", "unreachable"
    spec = _spec(tmp_path, store=store)
    result = run_train(["--config", str(spec), *extra], tmp_path, env=env)
    usage_error(result, expected)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and (case == "secret in the spec" or store.split("{")[0] in errors[0])
    assert not (tmp_path / "runs").exists()  # refused before a run folder exists
