"""Experiment trackers (`log.trackers`), for real and offline: a real `mlflow server` on
loopback with a SQLite store, W&B in offline mode (its files read back with its own
protobuf records), and the CSV file. A run killed past its checkpoint and resumed is one
tracker run in each, with every step sent once; a tracker that cannot be reached says so once
and the run goes on; one that never answers, or whose server is killed midway, holds up no
other record, and the end says what it missed; a trackers.json copied from another run starts
new tracker runs; a tracker whose package is missing stops the launch with exit 2."""

from __future__ import annotations

import csv
import json
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import psutil
import pytest

from launcher.config.spec import RunSpec
from launcher.metrics.progress import read_progress
from launcher.metrics.sink_types import RunEnd
from launcher.metrics.trackers.mlflow_run import REQUEST_LIMITS, MlflowSink
from launcher.metrics.trackers.records import TrackerRecords
from launcher.rundir.layout import RunLayout
from tests.conftest import (
    FAULTY_RECIPE,
    finish_train,
    free_port,
    metrics_of,
    only_run_dir,
    run_train,
    usage_error,
    write_spec,
)
from tests.forked_train import fork_train, train_in_fork
from tests.metrics.mlflow_server import kill_server, mlflow_server_process
from tests.metrics.mlflow_server import mlflow_server as running_mlflow_server
from tests.metrics.test_tensorboard import read_scalars
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
            entries = json.loads((run_dir / "trackers.json").read_text())["trackers"]
        except (OSError, ValueError, KeyError):
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
    proc = fork_train(["--config", str(spec)], tmp_path, env)
    run_dir = _wait_for_run_dir(tmp_path / "runs", proc)
    resumes_from = _kill_past_checkpoint(proc, run_dir)
    finish_train(proc, tmp_path)
    wandb_id = _entry(run_dir, "wandb")["id"]
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


def _entry(run_dir: Path, tracker: str) -> dict:
    """A tracker's entry in the run folder's trackers.json."""
    return json.loads((run_dir / "trackers.json").read_text())["trackers"][tracker]


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
    # As the sink's thread calls it: the writes are flushed before the end.
    sink.start()
    sink.write(record)
    sink.flush()
    sink.end(RunEnd("stopped"))
    sink.close()
    client = MlflowClient(mlflow_server)
    run_id = _entry(tmp_path, "mlflow")["run_id"]
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
    again.flush()
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


def _without_wandb() -> None:
    """`train` in an environment without wandb: None in sys.modules is Python's own way to say
    a module cannot be imported (find_spec finds nothing, and `import wandb` fails)."""
    sys.modules["wandb"] = None  # type: ignore[assignment]


def test_a_tracker_without_its_package_is_refused_before_launch(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "run.yaml", log={"trackers": ["tensorboard", "wandb"]})
    for command in (["--config", str(spec)], ["validate", "--config", str(spec)]):
        result = train_in_fork(command, tmp_path, timeout=120, preexec_fn=_without_wandb)
        usage_error(result, "log.trackers: wandb needs the wandb package", "launcher[wandb]")
    assert not (tmp_path / "runs").exists()


def _blackhole() -> socket.socket:
    """A loopback socket whose backlog takes connections that nobody ever answers."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    return hole


def _check_complete(run_dir: Path, steps: int) -> None:
    """progress.json, metrics.csv and TensorBoard's events hold every step, to the last."""
    losses = {r["step"]: r["loss"] for r in metrics_of(run_dir) if "loss" in r}
    assert sorted(losses) == list(range(1, steps + 1))
    progress = read_progress(RunLayout(run_dir))
    assert progress is not None and progress.step == steps
    assert progress.last("loss") == losses[steps]
    with (run_dir / "metrics.csv").open(newline="") as file:
        assert [int(row["step"]) for row in csv.DictReader(file)] == list(range(1, steps + 1))
    (events,) = (run_dir / "tb").glob("events.out.tfevents.*")
    scalars = read_scalars(events)
    assert [s for s, tag, _ in scalars if tag == "train/loss"] == list(range(1, steps + 1))


@pytest.mark.timeout(180)
def test_a_tracker_that_never_answers_holds_up_no_other_record(tmp_path: Path) -> None:
    """MLflow's server takes connections and never answers: the run ends, progress.json,
    metrics.csv and TensorBoard have every step, and the end says what MLflow missed."""
    spec = write_spec(
        tmp_path / "run.yaml",
        train={"max_steps": 20, "log_every": 1},
        checkpoint={"enabled": False},
        log={"trackers": ["mlflow", "csv", "tensorboard"]},
    )
    with closing(_blackhole()) as hole:
        env = {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{hole.getsockname()[1]}"}
        result = run_train(["--config", str(spec)], tmp_path, timeout=150, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    run_dir = only_run_dir(tmp_path / "runs")
    _check_complete(run_dir, 20)
    assert "WARNING: mlflow: 20 of 20 records did not reach" in output, output
    summary = json.loads((run_dir / "summary.json").read_text())
    missed = {"progress.json": 0, "mlflow": 20, "csv": 0, "tensorboard": 0}
    assert summary["records_missed"] == missed


def _wait_until_logged(url: str, experiment: str, steps: int, proc: subprocess.Popen) -> None:
    """Waits until the MLflow server holds `steps` steps of the experiment's run's loss."""
    from mlflow.tracking import MlflowClient

    client, deadline = MlflowClient(url), time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"the run ended first: {proc.communicate()}"
        assert time.monotonic() < deadline, f"MLflow did not get {steps} steps in time"
        found = client.get_experiment_by_name(experiment)
        runs = client.search_runs([found.experiment_id]) if found is not None else []
        if runs and len(client.get_metric_history(runs[0].info.run_id, "loss")) >= steps:
            return
        time.sleep(0.2)


@pytest.mark.timeout(240)
def test_a_killed_mlflow_server_stops_mlflow_alone(tmp_path: Path) -> None:
    """The MLflow server is killed midway (SIGKILL): MLflow gives up in seconds, and
    progress.json, metrics.csv and TensorBoard go on to the last step."""
    (tmp_path / "faulty.py").write_text(FAULTY_RECIPE)
    spec = write_spec(
        tmp_path / "run.yaml",
        recipe={"source": "faulty.py", "dataset": {}},
        train={"max_steps": 40, "log_every": 1},
        checkpoint={"enabled": False},
        log={"trackers": ["mlflow", "csv", "tensorboard"], "mlflow": {"experiment": "killed"}},
    )
    (tmp_path / "mlflow").mkdir()
    with mlflow_server_process(tmp_path / "mlflow") as (url, server):
        env = {"MLFLOW_TRACKING_URI": url, "FAULT": "slow"}
        proc = fork_train(["--config", str(spec)], tmp_path, env)
        run_dir = _wait_for_run_dir(tmp_path / "runs", proc)
        _wait_until_logged(url, "killed", 5, proc)
        kill_server(server)
        result = finish_train(proc, tmp_path, timeout=180)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    _check_complete(run_dir, 40)
    assert output.count(f"WARNING: mlflow: could not write to {url}") == 1, output
    missed = json.loads((run_dir / "summary.json").read_text())["records_missed"]
    assert missed["mlflow"] > 0 and missed["progress.json"] == missed["csv"] == 0, missed
    assert missed["tensorboard"] == 0, missed
    assert f"WARNING: mlflow: {missed['mlflow']} of 40 records did not reach {url}" in output


@pytest.mark.timeout(120)
def test_mlflow_gives_up_on_a_server_that_never_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow's own limits (120 s an answer, 7 retries) would take many minutes: the sink's
    give up in seconds, and say that the server timed out."""
    from mlflow.exceptions import MlflowException

    for variable in REQUEST_LIMITS:  # unset here, as they are by default, and after the test
        monkeypatch.setenv(variable, "")
        monkeypatch.delenv(variable)
    spec = RunSpec.model_validate(
        {"run": {"name": "hole"}, "recipe": {"source": "x.py"}, "train": {"max_steps": 5}}
    )
    with closing(_blackhole()) as hole:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{hole.getsockname()[1]}")
        sink = MlflowSink(spec, tmp_path, TrackerRecords(tmp_path / "trackers.json"))
        with pytest.raises(MlflowException, match="Read timed out"):
            sink.start()


def test_a_trackers_json_copied_from_another_run_starts_a_new_mlflow_run(
    tmp_path: Path,
    mlflow_server: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    spec = RunSpec.model_validate(
        {"run": {"name": "copied"}, "recipe": {"source": "x.py"}, "train": {"max_steps": 5}}
    )
    first, second = tmp_path / "first", tmp_path / "second"
    record = {"step": 1, "loss": 0.5, "time": time.time()}
    for run_dir, sent in ((first, record), (second, {**record, "step": 2, "loss": 9.0})):
        run_dir.mkdir()
        if run_dir == second:
            shutil.copy(first / "trackers.json", second / "trackers.json")
        sink = MlflowSink(spec, run_dir, TrackerRecords(run_dir / "trackers.json"))
        sink.start()
        sink.write(sent)
        sink.flush()  # as the sink's thread does before the end
        sink.end(RunEnd("finished"))
        sink.close()
    err = capsys.readouterr().err
    assert err.count("WARNING: trackers:") == 1, err
    assert f"written for the run folder {first.resolve()}, not this one" in err
    first_id, second_id = _entry(first, "mlflow")["run_id"], _entry(second, "mlflow")["run_id"]
    assert second_id != first_id
    client = MlflowClient(mlflow_server)
    assert [m.step for m in client.get_metric_history(first_id, "loss")] == [1]
    assert [m.step for m in client.get_metric_history(second_id, "loss")] == [2]
    assert json.loads((second / "trackers.json").read_text())["run_dir"] == str(second.resolve())
