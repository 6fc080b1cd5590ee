"""The runs under an output folder (`<output_dir>/<run.name>/<timestamp or rdzv-id>/`) or in
folders named, and what `train runs` says of each: its status, progress, losses, best
evaluation, newest checkpoint and times. Everything is read from the run folder's files, never
by asking torch.

A run is `running` while a launcher holds its lock (however old it is); else its launcher's
record says how it ended (`launcher.rundir.outcome`); else it ended without a word (its
launcher was killed, or its machine lost): `interrupted`. `unknown`: the file system cannot
tell whether the lock is held (no flock), and the run recorded no end.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.errors import LauncherError
from launcher.metrics.telemetry import read_beat
from launcher.rundir.layout import RunLayout, step_of
from launcher.rundir.lock import is_held
from launcher.rundir.outcome import RunOutcome, read_outcome
from launcher.runs.metrics_file import read_records, tail_records, value

if TYPE_CHECKING:
    from launcher.config.spec import RunSpec


@dataclass(frozen=True)
class RunRow:
    """One run, as `train runs --json` prints it (times are unix times, in seconds)."""

    name: str
    folder: str
    status: str  # running, finished, failed, stopped, interrupted, unknown or unreadable
    exit_code: int | None
    reason: str  # a stop's signal, or what failed
    step: int | None  # the newest step done (rank 0's)
    total_steps: int | None
    last_loss: float | None
    best_loss: float | None
    best_val_metric: str | None  # checkpoint.monitor (or early_stop's), else val/loss
    best_val: float | None
    best_val_step: int | None
    checkpoint: str | None  # the newest complete checkpoint
    checkpoint_step: int | None
    started: float | None  # when the run first started (resumes continue it)
    ended: float | None  # None while it runs
    duration_s: float | None


def is_run(path: Path) -> bool:
    """Whether a launcher made this folder: it wrote its lock or spec there."""
    layout = RunLayout(path)
    return path.is_dir() and (layout.lock.is_file() or layout.spec.is_file())


def find_runs(output_dir: Path, names: Sequence[str] = ()) -> list[Path]:
    """The run folders under `output_dir` (of these run names only, if any), oldest first."""
    groups = [output_dir / name for name in names] if names else _folders(output_dir)
    return _oldest_first(run for group in groups for run in _folders(group) if is_run(run))


def find_runs_in(paths: Sequence[Path]) -> list[Path]:
    """The run folders in `paths`, oldest first, each found once: a path is a run folder
    itself (`--run-dir` put it anywhere), a folder of one name's runs (`runs/NAME/`) or an
    output folder (`runs/`)."""
    found: dict[Path, Path] = {}
    for path in paths:
        for run in _runs_in(path):
            found.setdefault(run.resolve(), run)
    return _oldest_first(found.values())


def _runs_in(path: Path) -> list[Path]:
    if is_run(path):
        return [path]
    runs = []
    for child in _folders(path):
        runs += [child] if is_run(child) else [run for run in _folders(child) if is_run(run)]
    return runs


def _oldest_first(runs: Iterable[Path]) -> list[Path]:
    return sorted(runs, key=lambda run: (_started(RunLayout(run)) or 0.0, str(run)))


def _folders(path: Path) -> list[Path]:
    """The folders in `path`; a link is none (`--resume latest` skips it too): it would list a
    run twice, or one of another folder's."""
    try:
        return sorted(p for p in path.iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return []


def describe_run(run_dir: Path, now: float | None = None) -> RunRow:
    """What `train runs` says of a run; one that cannot be read is `unreadable`, never an
    error: one bad run must not break the list of all of them."""
    try:
        return _describe(run_dir, now)
    except Exception as exc:  # whatever its files hold
        blank = dict.fromkeys(f.name for f in fields(RunRow))
        return RunRow(**{**blank, "name": run_dir.parent.name, "folder": str(run_dir),
                         "status": "unreadable", "reason": f"{type(exc).__name__} reading it"})  # fmt: skip


def _describe(run_dir: Path, now: float | None) -> RunRow:
    layout = RunLayout(run_dir)
    status, outcome = run_status(layout)
    records = read_records(layout.metrics)
    spec = _spec(layout)
    losses = [loss for r in records if (loss := value(r, "loss")) is not None]
    steps = [int(s) for r in records if (s := value(r, "step")) is not None]
    best_val = _best_val(records, spec)
    newest = layout.latest_complete()
    started = _started(layout)
    ended = _ended(layout, status, outcome)
    end = ended if ended is not None else (now or time.time()) if status == "running" else None
    return RunRow(
        # The spec's: a run written with --run-dir is in a folder of any name.
        name=spec.run.name if spec is not None else run_dir.parent.name,
        folder=str(run_dir),
        status=status,
        exit_code=outcome.exit_code if outcome else None,
        reason=outcome.reason if outcome else "",
        step=_step(layout, steps),
        total_steps=_total_steps(layout, spec),
        last_loss=losses[-1] if losses else None,
        best_loss=min(losses) if losses else None,
        best_val_metric=best_val[0] if best_val else None,
        best_val=best_val[1] if best_val else None,
        best_val_step=best_val[2] if best_val else None,
        checkpoint=str(newest) if newest else None,
        checkpoint_step=step_of(newest) if newest else None,
        started=started,
        ended=ended,
        duration_s=round(end - started, 3) if end is not None and started is not None else None,
    )


def run_status(layout: RunLayout) -> tuple[str, RunOutcome | None]:
    """The run's status, and its launcher's record of its end (None while it runs)."""
    held = is_held(layout)
    if held:
        return "running", None
    outcome = read_outcome(layout)
    if outcome is not None:
        return outcome.status, outcome
    return ("unknown" if held is None else "interrupted"), None


def _spec(layout: RunLayout) -> RunSpec | None:
    """The spec the run started with, or None where it cannot be read (a spec written by
    another version of the launcher, say)."""
    from launcher.config.loader import load_spec_and_sources

    if not layout.spec.is_file():
        return None
    try:
        return load_spec_and_sources(layout.spec, torch_checks=False)[0]
    except (LauncherError, OSError):
        return None


def _step(layout: RunLayout, logged: list[int]) -> int | None:
    # Rank 0's heartbeat names its newest step, logged or not; metrics only the logged ones.
    beat = read_beat(layout.beat(0))
    return beat.step if beat is not None else logged[-1] if logged else None


def _total_steps(layout: RunLayout, spec: RunSpec | None) -> int | None:
    # What rank 0 counted (train.max_epochs included), else what the spec says.
    for record in reversed(tail_records(layout.telemetry(0))):
        if (total := value(record, "max_steps")) is not None:
            return int(total)
    return spec.train.max_steps if spec is not None else None


def _best_val(
    records: list[dict[str, Any]], spec: RunSpec | None
) -> tuple[str, float, int | None] | None:
    """The best value of the monitored evaluation metric (checkpoint.monitor, else
    early_stop.monitor, by their mode), else the lowest val/loss: (metric, value, step)."""
    metric, mode = "val/loss", "min"
    for section in (spec.checkpoint, spec.early_stop) if spec is not None else ():
        if section.monitor:
            metric, mode = section.monitor, section.mode
            break
    points = [(v, r.get("step")) for r in records if (v := value(r, metric)) is not None]
    if not points:
        return None
    best = (max if mode == "max" else min)(points, key=lambda point: point[0])
    return metric, best[0], best[1]


def _started(layout: RunLayout) -> float | None:
    # The spec is written when the run first starts (a resumed attempt's goes beside it).
    return _mtime(layout.spec) or _mtime(layout.lock)


def _ended(layout: RunLayout, status: str, outcome: RunOutcome | None) -> float | None:
    if status == "running":
        return None
    if outcome is not None:
        return outcome.ended
    # Ended without a word: when it last wrote.
    written = [_mtime(p) for p in (layout.metrics, layout.telemetry(0), layout.log(0))]
    return max((t for t in written if t is not None), default=_started(layout))


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None
