"""What the trackers and the progress sink read, as anyone may have left it, and where W&B
writes: a trackers.json that is damaged, nested 100,000 levels deep or copied from another
run starts new tracker runs with one line saying why; a deep progress.json or metrics line
neither breaks `train runs` nor the progress sink; a W&B folder that cannot be written is
refused before launch, and said in one line where a worker finds it so."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from launcher.config.spec import RunSpec
from launcher.metrics.progress import ProgressSink, read_progress
from launcher.metrics.sink_types import RunEnd
from launcher.metrics.trackers.records import TrackerRecords
from launcher.rundir.layout import RunLayout
from launcher.runs.catalog import describe_run
from tests.conftest import run_train, usage_error, write_spec
from tests.forked_train import train_in_fork

pytestmark = pytest.mark.launcher_only

DEEP = "[" * 100_000 + "]" * 100_000
ENTRY = {"run_id": "abc", "tracking_uri": "http://mlflow", "step": 7, "keys": ["loss"]}


def _copied(tmp_path: Path) -> str:
    return json.dumps({"run_dir": str(tmp_path / "another"), "trackers": {"mlflow": ENTRY}})


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (DEEP, "nested too deeply"),
        ("\x00{garbage", "not valid JSON"),
        ("[1, 2]", "not a trackers record"),
        (json.dumps({"mlflow": {"pad": "x" * (2 << 20)}}), "more than a trackers file may have"),
        (_copied, "was written for the run folder"),
    ],
    ids=["deep", "garbage", "a-list", "huge", "copied"],
)
def test_a_trackers_json_not_this_run_s_starts_new_tracker_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: object, says: str
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = run_dir / "trackers.json"
    path.write_text(content(tmp_path) if callable(content) else str(content))
    records = TrackerRecords(path)
    assert records.get("mlflow") == {}  # a new tracker run
    err = capsys.readouterr().err
    assert err.count("WARNING: trackers:") == 1 and str(path) in err and says in err, err
    assert "every tracker starts a new tracker run" in err
    records.update("mlflow", run_id="new")
    records.save()  # now this run's
    saved = json.loads(path.read_text())
    assert saved == {"run_dir": str(run_dir.resolve()), "trackers": {"mlflow": {"run_id": "new"}}}


def test_a_trackers_json_of_this_run_or_written_before_it_named_one_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "trackers.json"
    path.write_text(json.dumps({"mlflow": ENTRY, "csv": {"step": 3}}))  # before it named one
    assert TrackerRecords(path).get("mlflow") == ENTRY
    mine = {"run_dir": str(tmp_path.resolve()), "trackers": {"mlflow": ENTRY}}
    path.write_text(json.dumps(mine))
    assert TrackerRecords(path).get("mlflow") == ENTRY
    assert capsys.readouterr().err == ""


def _run_with_metrics(run_dir: Path, lines: list[str]) -> RunLayout:
    layout = RunLayout(run_dir)
    run_dir.mkdir(parents=True)
    layout.lock.touch()  # a launcher made it
    layout.metrics.write_text("".join(line + "\n" for line in lines))
    return layout


def test_train_runs_reads_past_a_deep_progress_json(tmp_path: Path) -> None:
    records = [json.dumps({"step": s, "loss": 3.0 - s}) for s in (1, 2)]
    layout = _run_with_metrics(tmp_path / "runs" / "deep" / "r1", records)
    layout.progress.write_text(DEEP)
    row = describe_run(layout.root)
    assert row.status != "unreadable", row.reason  # its metrics file instead
    assert (row.step, row.last_loss, row.best_loss) == (2, 1.0, 1.0)
    listed = run_train(["runs", str(layout.root), "--json"], tmp_path, timeout=60)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    (found,) = json.loads(listed.stdout)
    assert found["status"] != "unreadable" and found["step"] == 2, found


def test_the_progress_sink_reads_past_a_deep_metrics_line(tmp_path: Path) -> None:
    """A resumed run's progress starts from its metrics file, whatever lines it holds."""
    layout = _run_with_metrics(tmp_path / "run", [json.dumps({"step": 1, "loss": 2.0}), DEEP])
    sink = ProgressSink(layout.root)
    sink.write({"step": 2, "loss": 1.0})
    sink.close()
    progress = read_progress(layout)
    assert progress is not None and progress.step == 2
    assert progress.best("loss") == (1.0, 2) and progress.best("loss", "max") == (2.0, 1)


@pytest.mark.timeout(180)
def test_a_wandb_dir_that_cannot_be_written_is_refused_before_launch(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    blocked = tmp_path / "a file"
    blocked.write_text("")
    spec = write_spec(tmp_path / "run.yaml", log={"trackers": ["wandb"]})
    env = {"WANDB_DIR": str(blocked / "wandb"), "WANDB_MODE": "offline"}
    for command in (["validate", "--config", str(spec)], ["--config", str(spec)]):
        result = train_in_fork(command, tmp_path, env=env)
        usage_error(result, f"WANDB_DIR={blocked / 'wandb'}", f"{blocked} is not a folder",
                    "or unset it")  # fmt: skip
    assert not (tmp_path / "runs").exists()


@pytest.mark.timeout(120)
def test_w_and_b_says_in_one_line_where_it_writes_instead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A worker that finds the W&B folder unwritable (on a node the launcher did not check):
    one line naming it and the folder W&B writes to instead; and the sink's timeouts, where
    the environment sets none (WANDB_INIT_TIMEOUT here sets one)."""
    wandb = pytest.importorskip("wandb")
    from launcher.metrics.trackers.wandb_run import WandbSink

    blocked, instead = tmp_path / "a file", tmp_path / "tmp"
    blocked.write_text("")
    instead.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(blocked / "wandb"))
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "99")
    monkeypatch.setattr(tempfile, "tempdir", str(instead))
    spec = RunSpec.model_validate(
        {"run": {"name": "wb"}, "recipe": {"source": "x.py"}, "train": {"max_steps": 5}}
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    sink = WandbSink(spec, run_dir, TrackerRecords(run_dir / "trackers.json"))
    try:
        sink.start()
        settings = sink.run.settings
        assert (settings.init_timeout, settings.finish_timeout) == (99.0, 8.0)
        assert settings.x_graphql_timeout_seconds == 10.0
        sink.write({"step": 1, "loss": 0.5, "time": 1.0})
        sink.end(RunEnd("finished"))
    finally:
        sink.close()
        wandb.teardown()  # its service process
    err = capsys.readouterr().err
    line = (f"WARNING: wandb: cannot write in {blocked / 'wandb'} ({blocked} is not a folder); "
            f"W&B keeps this run in {instead / 'wandb'} instead")  # fmt: skip
    assert err.count(line) == 1, err
    assert list((instead / "wandb").glob("offline-run-*"))
    shutil.rmtree(instead)
