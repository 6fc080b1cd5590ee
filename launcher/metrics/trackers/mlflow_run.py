"""The `mlflow` tracker: one MLflow run per run folder, on the server `MLFLOW_TRACKING_URI`
names (MLflow's own default where unset), in the experiment `log.mlflow.experiment`. A resumed
or restarted run sets the same MLflow run RUNNING again and goes on logging to it.

Everything goes through `MlflowClient` (no fluent API): the client keeps no process-wide active
run, and it is only used from this sink's own thread.

MLflow's client waits 120 s for an answer and retries 7 times, minutes in all, before it says a
server is gone: this sink sets shorter ones (`REQUEST_LIMITS`) where the environment sets none,
so a dead or hung server is noticed in seconds. MLflow reads them from the environment at each
request and has no setting of its own for one client, so rank 0's recipe sees them too."""

from __future__ import annotations

import os
from typing import Any

from launcher.metrics.sink_types import RunEnd, warn
from launcher.metrics.trackers.base import TrackerSink, flat_params

# MLflow's limits on one request (mlflow.utils.validation): params and metrics per batch, a
# param's length.
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000
_PARAM_LENGTH = 6000
_STATUS = {"finished": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}
# Seconds a request waits for an answer, and retries of a request that failed (the second
# after 4 s): a server that does not answer is given up after about 20 s, one that refuses
# connections after about 4 s.
REQUEST_LIMITS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "5", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2"}


class MlflowSink(TrackerSink):
    name = "mlflow"

    def connect(self, earlier: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        import mlflow
        from mlflow.tracking import MlflowClient

        for variable, value in REQUEST_LIMITS.items():
            os.environ.setdefault(variable, value)
        uri = mlflow.get_tracking_uri()
        self.where = uri
        self.client = client = MlflowClient(uri)
        self._pending: list[Any] = []  # metrics sent since the last push
        run_id = earlier.get("run_id") if earlier.get("tracking_uri") == uri else None
        same_run = run_id is not None and self._reopened(run_id)
        if same_run:
            self.run_id = run_id
            self._log_params(client.get_run(run_id).data.params)
        else:
            experiment = self._experiment_id()
            tags = {"launcher.run_dir": str(self.layout.root)}
            run = client.create_run(experiment, run_name=self.layout.root.name, tags=tags)
            self.run_id = run.info.run_id
            self._log_params({})
        return {"run_id": self.run_id, "tracking_uri": uri}, same_run

    def _reopened(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.update_run(run_id, status="RUNNING")
        except MlflowException as exc:  # deleted, or a server reset: a new run, said once
            warn(self.name, f"run {run_id} of an earlier attempt is gone ({exc}); logging to "
                 "a new MLflow run")  # fmt: skip
            return False
        return True

    def _experiment_id(self) -> str:
        name = (
            self.spec.log.mlflow.experiment
            or os.environ.get("MLFLOW_EXPERIMENT_NAME")
            or self.spec.run.name
        )
        found = self.client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else self.client.create_experiment(name)

    def _log_params(self, logged: dict[str, str]) -> None:
        """The spec's keys the run has not logged. MLflow refuses to change a param, so a key
        a resume changed is a tag, `resumed/<key>`, with its new value."""
        from mlflow.entities import Param, RunTag

        params, tags = [], []
        for key, value in flat_params(self.spec).items():
            value = value[:_PARAM_LENGTH]
            if key not in logged:
                params.append(Param(key, value))
            elif logged[key] != value:
                tags.append(RunTag(f"resumed/{key}", value))
        for start in range(0, len(params), _PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[start : start + _PARAMS_PER_BATCH])
        for start in range(0, len(tags), _PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, tags=tags[start : start + _PARAMS_PER_BATCH])

    def send(self, step: int, metrics: dict[str, float], record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        millis = int(1000 * float(record.get("time", 0.0)))
        self._pending += [Metric(key, value, millis, step) for key, value in metrics.items()]

    def push(self) -> None:
        # One request for every record since the last push: a request per record would make
        # the server insert rows at every step of a fast run.
        pending, self._pending = self._pending, []
        for start in range(0, len(pending), _METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=pending[start : start + _METRICS_PER_BATCH])

    def finish(self, outcome: RunEnd) -> None:
        if outcome.best_checkpoint:
            self.client.set_tag(self.run_id, "best_checkpoint", outcome.best_checkpoint)
        self.client.set_terminated(self.run_id, status=_STATUS[outcome.status])
