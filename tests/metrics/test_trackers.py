"""Experiment trackers (`log.trackers`), for real and offline: a real `mlflow server` on
loopback with a SQLite store, W&B in offline mode (its files read back with its own
protobuf records), and the CSV file. A run killed past its checkpoint and resumed is one
tracker run in each, with every step sent once; a tracker that cannot be reached says so once
and the run goes on; a tracker whose package is missing stops the launch with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from launcher.config.spec import RunSpec
from launcher.metrics.sinks import RunEnd
from launcher.metrics.trackers.mlflow_run import MlflowSink
from launcher.metrics.trackers.records import TrackerRecords
from tests.conftest import (
    FAULTY_RECIPE,
    finish_train,
    free_port,
    metrics_of,
    only_run_dir,
    run_train,
    start_train,
    usage_error,
    write_spec,
)
from tests.metrics.mlflow_server import mlflow_server as running_mlflow_server
from tests.metrics.wandb_offline import read_offline_run

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_mlflow_server(tmp_path_factory.mktemp("mlflow")) as url:
        yield url


def _kill_past_checkpoint(proc: subprocess.Popen[str], run_dir: Path) -> int:
    """SIGKILLs the launcher and its workers once every tracker was sent two steps past the
    newest checkpoint (which a resume starts from, doing them again); returns its step."""
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"the run ended first: {proc.communicate()}"
        assert time.monotonic() < deadline, "no tracker got past a checkpoint in time"
        saved = [int(c.name[5:]) for c in (run_dir / "checkpoints").glob("step-*")]
        try:
            entries = json.loads((run_dir / "trackers.json").read_text())
        except (OSError, ValueError):
            entries = {}
        sent = [e.get("step", -1) for e in entries.values()]
        if saved and len(sent) == 3 and min(sent) >= max(saved) + 2:
            break
        time.sleep(0.02)
    # The launcher and its workers; W&B's own service process outlives them for as long as
    # it takes to end, as it does when an OOM kill ends a worker.
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in tree:
        if p.name() != "wandb-core":
            p.kill()
    proc.wait(timeout=30)
    _, alive = psutil.wait_procs(tree[1:], timeout=30)
    assert not alive, alive
    return max(int(c.name[5:]) for c in (run_dir / "checkpoints").glob("step-*"))


def test_a_killed_and_resumed_run_is_one_tracker_run(tmp_path: Path, mlflow_server: str) -> None:
    (tmp_path / "faulty.py").write_text(FAULTY_RECIPE)
    spec = write_spec(
        tmp_path / "run.yaml",
        recipe={"source": "faulty.py", "dataset": {}},
        train={"max_steps": 40, "log_every": 1},
        eval={"every_n_steps": 10},
        checkpoint={"every_n_steps": 10, "monitor": "val/loss"},
        log={"trackers": ["mlflow", "wandb", "csv", "tensorboard"],
             "mlflow": {"experiment": "trackers-test"}},
    )  # fmt: skip
    env = {"MLFLOW_TRACKING_URI": mlflow_server, "WANDB_MODE": "offline", "FAULT": "slow"}
    proc = start_train(["--config", str(spec)], tmp_path, env)
    run_dir = _wait_for_run_dir(tmp_path / "runs", proc)
    resumes_from = _kill_past_checkpoint(proc, run_dir)
    finish_train(proc, tmp_path)
    wandb_id = json.loads((run_dir / "trackers.json").read_text())["wandb"]["id"]
    resumed = run_train(["--config", str(spec), "--resume", "latest"], tmp_path, env=env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed at step {resumes_from}" in resumed.stdout + resumed.stderr
    assert only_run_dir(tmp_path / "runs") == run_dir
    losses = {r["step"]: r["loss"] for r in metrics_of(run_dir) if "loss" in r}
    assert sorted(losses) == list(range(1, 41))

    _check_mlflow(mlflow_server, run_dir, losses)
    _check_wandb(run_dir, wandb_id, resumes_from, losses)
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    steps = [int(row.split(",")[0]) for row in rows[1:]]
    assert {"loss", "val/loss", "lr"} <= set(header), header
    assert sorted(Counter(steps).items()) == [(s, 1 + (s % 10 == 0)) for s in range(1, 41)]


def _wait_for_run_dir(runs: Path, proc: subprocess.Popen[str]) -> Path:
    deadline = time.monotonic() + 60
    while not list(runs.glob("*/*/spec.yaml")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    return only_run_dir(runs)


def _check_mlflow(url: str, run_dir: Path, losses: dict[int, float]) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(url)
    experiment = client.get_experiment_by_name("trackers-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == run_dir.name
    assert run.info.status == "FINISHED"
    assert run.data.params["train.max_steps"] == "40"
    assert run.data.params["log.trackers"] == '["mlflow", "wandb", "csv", "tensorboard"]'
    assert run.data.tags["best_checkpoint"].startswith(str(run_dir / "checkpoints" / "step-"))
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 41))  # each step once
    assert {m.step: m.value for m in history} == pytest.approx(losses, rel=1e-6)
    val = client.get_metric_history(run.info.run_id, "val/loss")
    assert sorted(m.step for m in val) == [10, 20, 30, 40]


def _check_wandb(run_dir: Path, run_id: str, resumed_from: int, losses: dict) -> None:
    """The resumed attempt's offline run: the first attempt's W&B run id, each step from the
    checkpoint on once. (W&B's service process holds what it is sent until it writes it, and
    ends without writing it when the process it serves is killed.)"""
    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(f.name.endswith(run_id) for f in folders), folders
    run = read_offline_run(folders[1])
    assert run.run_id == run_id
    assert run.exit_code == 0  # finished
    sent = Counter(row["_step"] for row in run.history if "loss" in row)
    assert sorted(sent.items()) == [(s, 1) for s in range(resumed_from + 1, 41)]
    assert {r["_step"]: r["loss"] for r in run.history if "loss" in r} == pytest.approx(
        {s: loss for s, loss in losses.items() if s > resumed_from}
    )
    val = sorted(r["_step"] for r in run.history if "val/loss" in r)
    assert val == list(range(resumed_from + 10, 41, 10))
    assert run.config["train"]["max_steps"] == 40
    assert run.config["run_dir"] == str(run_dir)
    assert run.summary["best_checkpoint"].startswith(str(run_dir / "checkpoints"))


def test_a_stopped_run_is_killed_in_mlflow_and_running_again_on_resume(
    tmp_path: Path, mlflow_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sink by itself, in this process: a stop to be resumed (a preemption) is MLflow's
    KILLED, and the next attempt sets the same run RUNNING; a key the resume changed is a tag,
    as MLflow refuses to change a param."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    spec = RunSpec.model_validate(
        {"run": {"name": "stopped"}, "recipe": {"source": "x.py"}, "train": {"max_steps": 5}}
    )
    record = {"step": 1, "loss": 0.5, "time": time.time()}
    sink = MlflowSink(spec, tmp_path, TrackerRecords(tmp_path / "trackers.json"))
    sink.start()
    sink.write(record)
    sink.end(RunEnd("stopped"))
    sink.close()
    client = MlflowClient(mlflow_server)
    run_id = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]["run_id"]
    assert client.get_run(run_id).info.status == "KILLED"

    longer = spec.model_copy(update={"train": spec.train.model_copy(update={"max_steps": 9})})
    again = MlflowSink(longer, tmp_path, TrackerRecords(tmp_path / "trackers.json"))
    again.start()
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING"
    assert run.data.params["train.max_steps"] == "5"
    assert run.data.tags["resumed/train.max_steps"] == "9"
    again.write(record)  # step 1 again: sent before the stop
    again.write({**record, "step": 2})
    again.end(RunEnd("failed"))
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2]
    assert client.get_run(run_id).info.status == "FAILED"


def test_a_tracker_that_cannot_be_reached_warns_once_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    spec = write_spec(tmp_path / "run.yaml", log={"trackers": ["mlflow", "csv"]})
    env = {
        "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}",  # nobody listens there
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    }
    result = run_train(["--config", str(spec)], tmp_path, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    output = result.stdout + result.stderr
    assert output.count("WARNING: mlflow: could not write to") == 1, output
    assert "training goes on" in output
    run_dir = only_run_dir(tmp_path / "runs")
    assert [r["step"] for r in metrics_of(run_dir)] == list(range(1, 11))
    assert len((run_dir / "metrics.csv").read_text().splitlines()) == 11  # the others go on
    assert not (run_dir / "tb").exists()  # `trackers` without tensorboard: none


# `train` in an environment without wandb: None in sys.modules is Python's own way to say a
# module cannot be imported (find_spec finds nothing, and `import wandb` fails).
_WITHOUT_WANDB = """
import sys
sys.modules["wandb"] = None
sys.argv = ["train", *sys.argv[1:]]
from launcher.cli.app import main
main()
"""


def test_a_tracker_without_its_package_is_refused_before_launch(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "run.yaml", log={"trackers": ["tensorboard", "wandb"]})
    for command in (["--config", str(spec)], ["validate", "--config", str(spec)]):
        result = subprocess.run(
            [sys.executable, "-c", _WITHOUT_WANDB, *command], cwd=tmp_path, text=True,
            capture_output=True, timeout=120,
        )  # fmt: skip
        usage_error(result, "log.trackers: wandb needs the wandb package", "launcher[wandb]")
    assert not (tmp_path / "runs").exists()
