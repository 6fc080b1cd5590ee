"""The `wandb` tracker: one W&B run per run folder, whose id is kept in trackers.json, so a
resumed or restarted run goes on with it (`resume="allow"`). W&B's own `WANDB_*` variables
apply (`WANDB_MODE=offline` among them: the run's files then wait in `<run dir>/wandb/` for
`wandb sync`); `log.wandb` gives the project, entity and tags.

W&B waits 90 s for a server at the start and, by default, for as long as its uploads take at
the end: this sink sets shorter timeouts (`TIMEOUTS`) for its own run where the environment
sets none, so a dead server is noticed in seconds and the end of a run is not held up (what
was not uploaded stays in the run's W&B folder for `wandb sync`).

A W&B folder that cannot be written (`WANDB_DIR`) is refused before launch; one that turns out
unwritable in the worker is said in one line naming it, with the folder W&B writes to
instead, never silently."""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path
from typing import Any

from launcher.errors import UsageError
from launcher.metrics.sink_types import RunEnd, warn
from launcher.metrics.trackers.base import TrackerSink
from launcher.metrics.trackers.records import SentSteps

# W&B's exit codes for a run: 0 is finished, anything else failed. A stop to be resumed (a
# preemption) is marked preempting first, so W&B shows it as such until it resumes.
_EXIT_CODE = {"finished": 0, "failed": 1, "stopped": 143}
# W&B's settings, each with the variable that sets it and the value this sink sets where that
# variable is unset, in seconds: waiting for the server at the start, for the uploads at the
# end (less than the sinks' close timeout), and for one request.
TIMEOUTS = {
    "init_timeout": ("WANDB_INIT_TIMEOUT", 30.0),
    "finish_timeout": ("WANDB_FINISH_TIMEOUT", 8.0),
    "x_graphql_timeout_seconds": ("WANDB_HTTP_TIMEOUT", 10.0),
    "x_file_stream_timeout_seconds": ("WANDB__FILE_STREAM_TIMEOUT_SECONDS", 10.0),
}


def timeouts() -> dict[str, float]:
    """The W&B settings of `TIMEOUTS` whose variable this environment leaves unset."""
    return {
        key: value for key, (variable, value) in TIMEOUTS.items() if not os.environ.get(variable)
    }


def unwritable(folder: Path) -> str | None:
    """Why W&B could not make or write in `folder`, or None where it can: the nearest part of
    its path that exists must be a folder this process may write in."""
    found = folder
    while not os.path.lexists(found) and found != found.parent:
        found = found.parent
    if not found.is_dir():
        return f"{found} is not a folder"
    if not os.access(found, os.W_OK | os.X_OK):
        return f"{found} is not writable"
    return None


def check_usable() -> None:
    """Before launch (the registry's check): refuses a `WANDB_DIR` W&B cannot write in."""
    wandb_dir = os.environ.get("WANDB_DIR")
    if wandb_dir and (why := unwritable(Path(wandb_dir))) is not None:
        raise UsageError(
            f"WANDB_DIR={wandb_dir}: W&B cannot write there ({why})",
            hint="Point WANDB_DIR at a folder you can write in, or unset it: W&B then "
            "writes in the run folder (RUN_DIR/wandb/).",
        )


class WandbSink(TrackerSink):
    name = "wandb"

    def connect(self, earlier: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        import wandb

        run_id = earlier.get("id") or secrets.token_hex(4)  # W&B's own ids: 8 characters
        options = self.spec.log.wandb
        # Our logs are in the run folder: W&B must not wrap this process's stdout and stderr,
        # which the launcher has redirected. WANDB_CONSOLE still says otherwise.
        console = os.environ.get("WANDB_CONSOLE", "off")
        settings = wandb.Settings(console=console, **timeouts())
        self.run = run = wandb.init(
            id=run_id,
            resume="allow",
            project=options.project or os.environ.get("WANDB_PROJECT") or self.spec.run.name,
            entity=options.entity,
            tags=options.tags or None,
            name=self.layout.root.name,
            dir=self._folder(),
            settings=settings,
        )
        # After init, not through it: a resume may have changed keys, which init refuses.
        run.config.update(self.spec.model_dump(mode="json", by_alias=True), allow_val_change=True)
        run.config.update({"run_dir": str(self.layout.root)}, allow_val_change=True)
        self.where = run.url or run.dir
        return {"id": run_id, "project": run.project}, "id" in earlier

    def _folder(self) -> str | None:
        """wandb.init's `dir`: the run folder, unless WANDB_DIR names one (None: W&B reads
        it); a temporary folder, said in one line, where the one meant cannot be written."""
        named = os.environ.get("WANDB_DIR")
        meant = Path(named) if named else self.layout.wandb_parent
        why = unwritable(meant)
        if why is None:
            return None if named else str(meant)
        instead = tempfile.gettempdir()
        warn(self.name, f"cannot write in {meant} ({why}); W&B keeps this run in "
             f"{Path(instead) / 'wandb'} instead")  # fmt: skip
        return instead

    def already_sent(self, earlier: dict[str, Any]) -> SentSteps:
        # W&B's own word, not what earlier attempts sent: its service process holds what it
        # is sent until it writes it, and drops it when the process it serves is killed. A
        # resumed online run starts at the step after the newest one its server has.
        return SentSteps({"step": self.run.starting_step})

    def send(self, step: int, metrics: dict[str, float], record: dict[str, Any]) -> None:
        self.run.log(metrics, step=step)

    def finish(self, outcome: RunEnd) -> None:
        if outcome.best_checkpoint:
            self.run.summary["best_checkpoint"] = outcome.best_checkpoint
        if outcome.status == "stopped":
            self.run.mark_preempting()
        self.run.finish(exit_code=_EXIT_CODE[outcome.status])
        self.run = None

    def disconnect(self) -> None:
        if getattr(self, "run", None) is not None:  # no end was said: a failed start
            self.run.finish(exit_code=1)
