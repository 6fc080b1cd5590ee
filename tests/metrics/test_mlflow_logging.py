"""MLflow's INFO lines (its database's set-up, ...) stay out of the live stream unless
`--debug`: the launcher sets MLflow's own `MLFLOW_LOGGING_LEVEL` for the workers, a setting
the user's environment overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.config.loader import load_cli_spec
from launcher.launch.devices import Devices
from launcher.launch.plan import LaunchPlan
from tests.conftest import only_run_dir, run_train, write_spec

pytestmark = pytest.mark.launcher_only


def _plan(tmp_path: Path, debug: bool) -> LaunchPlan:
    return LaunchPlan(
        spec=load_cli_spec(write_spec(tmp_path / "run.yaml")),
        run_dir=tmp_path / "run",
        accelerator="cpu",
        devices=Devices(2, 1, 1),
        resume_from=None,
        show_ranks=None,
        omp_threads=1,
        debug=debug,
    )


def test_mlflow_is_told_to_keep_quiet_unless_debug(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_LOGGING_LEVEL", raising=False)
    assert _plan(tmp_path, debug=False).worker_env()["MLFLOW_LOGGING_LEVEL"] == "WARNING"
    assert "MLFLOW_LOGGING_LEVEL" not in _plan(tmp_path, debug=True).worker_env()
    monkeypatch.setenv("MLFLOW_LOGGING_LEVEL", "DEBUG")  # the user's own setting wins
    assert _plan(tmp_path, debug=False).worker_env()["MLFLOW_LOGGING_LEVEL"] == "DEBUG"


@pytest.mark.timeout(180)
def test_a_run_with_the_mlflow_tracker_shows_no_info_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new SQLite store: MLflow says at INFO that it creates its tables."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_LOGGING_LEVEL", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = write_spec(tmp_path / "run.yaml", log={"trackers": ["mlflow"]}, train={"max_steps": 3})
    result = run_train(["--config", str(spec)], cwd=tmp_path, env={"MLFLOW_TRACKING_URI": uri})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "INFO" not in output, output
    # Rank 0 alone waited for MLflow's start (seconds): the header every rank prints still
    # comes together and folds into one line.
    assert "[ranks 0-1] " in result.stdout, output
    client = MlflowClient(uri)
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.run_name == only_run_dir(tmp_path / "runs").name  # the sink did its work
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 3
