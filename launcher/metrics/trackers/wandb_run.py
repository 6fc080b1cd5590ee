"""The `wandb` tracker: one W&B run per run folder, whose id is kept in trackers.json, so a
resumed or restarted run goes on with it (`resume="allow"`). W&B's own `WANDB_*` variables
apply (`WANDB_MODE=offline` among them: the run's files then wait in `<run dir>/wandb/` for
`wandb sync`); `log.wandb` gives the project, entity and tags."""

from __future__ import annotations

import os
import secrets
from typing import Any

from launcher.metrics.sinks import RunEnd
from launcher.metrics.trackers.base import TrackerSink
from launcher.metrics.trackers.records import SentSteps

# W&B's exit codes for a run: 0 is finished, anything else failed. A stop to be resumed (a
# preemption) is marked preempting first, so W&B shows it as such until it resumes.
_EXIT_CODE = {"finished": 0, "failed": 1, "stopped": 143}


class WandbSink(TrackerSink):
    name = "wandb"

    def connect(self, earlier: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        import wandb

        run_id = earlier.get("id") or secrets.token_hex(4)  # W&B's own ids: 8 characters
        options = self.spec.log.wandb
        # Our logs are in the run folder: W&B must not wrap this process's stdout and stderr,
        # which the launcher has redirected. WANDB_CONSOLE still says otherwise.
        settings = wandb.Settings(console=os.environ.get("WANDB_CONSOLE", "off"))
        self.run = run = wandb.init(
            id=run_id,
            resume="allow",
            project=options.project or os.environ.get("WANDB_PROJECT") or self.spec.run.name,
            entity=options.entity,
            tags=options.tags or None,
            name=self.layout.root.name,
            dir=None if os.environ.get("WANDB_DIR") else str(self.layout.wandb_parent),
            settings=settings,
        )
        # After init, not through it: a resume may have changed keys, which init refuses.
        run.config.update(self.spec.model_dump(mode="json", by_alias=True), allow_val_change=True)
        run.config.update({"run_dir": str(self.layout.root)}, allow_val_change=True)
        self.where = run.url or run.dir
        return {"id": run_id, "project": run.project}, "id" in earlier

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
