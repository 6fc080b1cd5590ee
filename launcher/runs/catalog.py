"""The runs under an output folder (`<output_dir>/<run.name>/<timestamp or rdzv-id>/`) or in
folders named, and what `train runs` says of each: its status, progress, losses, best
evaluation, newest checkpoint and times. Everything is read from the run folder's files, never
by asking torch, and read in a bounded time: a run's progress.json (kept current by its rank 0,
`launcher.metrics.progress`), its heartbeat, lock and outcome, never its whole metrics file. A
run written before progress.json existed is read from the end of its metrics file (its last
`FALLBACK_METRICS_BYTES`: its best values are those of its newest records only).

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

from launcher.checkpoint.store import step_of, store_of_run
from launcher.errors import LauncherError
from launcher.metrics.progress import Progress, monitored, read_progress
from launcher.metrics.telemetry import read_beat
from launcher.rundir import fault_events
from launcher.rundir.layout import RunLayout
from launcher.rundir.lock import is_held
from launcher.rundir.outcome import RunOutcome, read_outcome
from launcher.rundir.reading import parse_json_or_none, read_json_or_none, read_tail
from launcher.runs.metrics_file import value
from launcher.runs.store_listing import StoreAnswer, ask_stores

if TYPE_CHECKING:
    from launcher.config.spec import RunSpec

# What `train runs` reads of a metrics file without progress.json: some 1,000 to 2,500 records
# (of 10 or 4 metrics), in which numpy finds the loss and the monitored metric: a run of any
# length costs as little as a short one.
FALLBACK_METRICS_BYTES = 256 << 10


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
    checkpoint_store: str | None  # where the checkpoints are, when not in the run folder
    # why that store could not be listed (the newest checkpoint is then unknown); None: it was
    checkpoint_store_error: str | None
    started: float | None  # when the run first started (resumes continue it)
    ended: float | None  # None while it runs
    duration_s: float | None
    # fault_tolerance's: replica groups lost (and restarted) so far; None without it
    groups_lost: int | None = None
    # fault_tolerance.sync of a finished semi-synchronous run (summary.json): its method,
    # `every`, syncs, and the bytes between groups it saved against per-step syncing
    sync: dict[str, Any] | None = None
    # launch.straggler: the ranks named slow so far, "rank N (part)"; the recovered too
    stragglers: list[str] | None = None


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


def describe_runs(run_dirs: Sequence[Path], now: float | None = None) -> list[RunRow]:
    """`describe_run` of each, their stores asked all at once (`launcher.runs.store_listing`)."""
    stores = ask_stores(run_dirs)
    return [describe_run(run, now, stores) for run in run_dirs]


def describe_run(
    run_dir: Path, now: float | None = None, stores: dict[Path, StoreAnswer] | None = None
) -> RunRow:
    """What `train runs` says of a run; one that cannot be read is `unreadable`, never an
    error: one bad run must not break the list of all of them. `stores`: `ask_stores`'
    answers, which name this run if its checkpoints are in a store (None: asked here)."""
    try:
        return _describe(run_dir, now, stores)
    except Exception as exc:  # whatever its files hold
        blank = dict.fromkeys(f.name for f in fields(RunRow))
        return RunRow(**{**blank, "name": run_dir.parent.name, "folder": str(run_dir),
                         "status": "unreadable", "reason": f"{type(exc).__name__} reading it"})  # fmt: skip


def _describe(run_dir: Path, now: float | None, stores: dict[Path, StoreAnswer] | None) -> RunRow:
    layout = RunLayout(run_dir)
    status, outcome = run_status(layout)
    progress = read_progress(layout)
    # What the spec says, without reading it (a run that logged).
    about = progress.about if progress is not None else {}
    spec = None if about else _spec(layout)
    metric, mode = (about["monitor"], about["mode"]) if about else monitored(spec)
    if progress is None:  # written before progress.json: the end of its metrics file
        progress = _tail_progress(layout, metric)
    best_loss = progress.best("loss")
    best = progress.best(metric, mode)
    best_val = (metric, *best) if best is not None else None
    newest, store = _newest_checkpoint(run_dir, stores)
    started = _started(layout)
    ended = _ended(layout, status, outcome)
    end = ended if ended is not None else (now or time.time()) if status == "running" else None
    return RunRow(
        # The spec's: a run written with --run-dir is in a folder of any name.
        name=about.get("name") or (spec.run.name if spec is not None else run_dir.parent.name),
        folder=str(run_dir),
        status=status,
        exit_code=outcome.exit_code if outcome else None,
        reason=outcome.reason if outcome else "",
        step=_step(layout, progress.step),
        total_steps=_total_steps(layout, about.get("max_steps", spec and spec.train.max_steps)),
        last_loss=progress.last("loss"),
        best_loss=best_loss[0] if best_loss else None,
        best_val_metric=best_val[0] if best_val else None,
        best_val=best_val[1] if best_val else None,
        best_val_step=best_val[2] if best_val else None,
        checkpoint=str(newest) if newest else None,
        checkpoint_step=step_of(newest) if newest else None,
        checkpoint_store=store.store if store else None,
        checkpoint_store_error=store.problem if store else None,
        started=started,
        ended=ended,
        duration_s=round(end - started, 3) if end is not None and started is not None else None,
        groups_lost=_groups_lost(layout),
        sync=_sync(layout),
        stragglers=_stragglers(layout),
    )


def _stragglers(layout: RunLayout) -> list[str] | None:
    """The ranks `launch.straggler` named slow (`stragglers.jsonl`), once each; None: none."""
    found = fault_events.read_file(layout.stragglers)
    named = [f"rank {e['rank']} ({e['part']})" for e in found if e.get("event") == "found"]
    return list(dict.fromkeys(named)) or None


def _groups_lost(layout: RunLayout) -> int | None:
    """Replica groups lost so far (`fault_tolerance`); None for a run without them."""
    if not fault_events.kept(layout.fault_events):
        return None
    return sum(e["event"] == "lost" for e in fault_events.read(layout.fault_events))


def _sync(layout: RunLayout) -> dict[str, Any] | None:
    """summary.json's `fault_tolerance.sync` (a finished LocalSGD or DiLoCo run); else None."""
    summary = read_json_or_none(layout.summary, "record")
    found = summary.get("fault_tolerance", {}).get("sync") if isinstance(summary, dict) else None
    return found if isinstance(found, dict) else None


def _newest_checkpoint(
    run_dir: Path, stores: dict[Path, StoreAnswer] | None
) -> tuple[Any, StoreAnswer | None]:
    """The newest complete checkpoint and, for a run whose checkpoints are in a store
    (`checkpoint.dir`), the store's answer. A store that does not answer in time leaves the
    checkpoint unknown, and says why; it never breaks or holds up the listing."""
    store = (stores if stores is not None else ask_stores([run_dir])).get(run_dir)
    if store is not None:
        return store.newest, store
    try:
        store = store_of_run(run_dir)
    except LauncherError:  # a damaged record of the store
        return None, None
    return store.latest(), None


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


def _tail_progress(layout: RunLayout, metric: str) -> Progress:
    # numpy's scan, imported only here: a list of runs that all have progress.json needs none.
    from launcher.runs.metrics_scan import tail_progress

    return tail_progress(layout.metrics, ["loss", metric], FALLBACK_METRICS_BYTES)


def _step(layout: RunLayout, logged: int | None) -> int | None:
    # Rank 0's heartbeat names its newest step, logged or not; metrics only the logged ones.
    beat = read_beat(layout.beat(0))
    return beat.step if beat is not None else logged


def _total_steps(layout: RunLayout, planned: int | None) -> int | None:
    # What rank 0 counted (train.max_epochs included), else what the spec says: its newest
    # status record that says, parsed from the end (most often the last one).
    for line in reversed((read_tail(layout.telemetry(0), 16384) or b"").splitlines()):
        record = parse_json_or_none(line)  # None: half-written
        if isinstance(record, dict) and (total := value(record, "max_steps")) is not None:
            return int(total)
    return planned


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
