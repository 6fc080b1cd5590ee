"""Creating a run's folder on this node and writing what the workers will read."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from launcher.checkpoint import folder_choice
from launcher.checkpoint.catalog import Listings
from launcher.checkpoint.pruning import finish_cut_short
from launcher.checkpoint.store import record_store
from launcher.config.loader import spec_to_yaml
from launcher.config.sources import annotate_yaml
from launcher.errors import UsageError
from launcher.launch.plan import LaunchPlan
from launcher.rundir import lock as run_lock
from launcher.rundir.atomic import write_atomic

_SPEC_HEADER = """\
# The spec this run ran with, every key: `train --config` reads it as it is. A comment names
# where a value came from (file:line, a key=value override, a flag, or resolved at launch);
# a key without one is at its default.
"""


def prepare_run_dir(plan: LaunchPlan) -> run_lock.RunLock:
    """Creates the run folder (never world-writable) and locks it, saves the resolved spec into
    it and writes this node's worker plan. Returns the lock: the run folder's one writer is the
    launcher that holds it (node 0's, when several nodes share the folder)."""
    # A damaged checkpoint was refused when the resume was decided (`resume_decision`), before
    # anything is created, so that a retry finds nothing in its way.
    _create(plan)
    lock = run_lock.take(plan.layout) if plan.writes_shared_files else run_lock.RunLock()
    try:
        if plan.writes_shared_files:
            # Listed again, under the lock: the plan's listing is from before it.
            listings = Listings()
            listings.take(plan.run_dir, plan.store)
            job = plan.nodes.job_id
            folder_choice.check_unchanged(plan.run_dir, plan.resume_from, job, listings)
            if freed := finish_cut_short(plan.layout, lock):
                print(f"note: {freed}", file=sys.stderr, flush=True)
        _write_files(plan)
    except BaseException:
        lock.release()
        raise
    return lock


def _create(plan: LaunchPlan) -> None:
    # A new run claims its folder atomically: two launches never share one. The nodes of a
    # job share theirs, which whichever comes first creates; a folder that an attempt which
    # never trained left (or an empty one) is taken over under the lock.
    fresh = (
        plan.resume_from is None
        and plan.nodes.job_id is None
        and not (plan.run_dir.is_dir() and not plan.layout.holds_a_run())
    )
    try:
        plan.run_dir.mkdir(parents=True, exist_ok=not fresh, mode=0o755)
    except FileExistsError:
        folder_choice.check_is_folder(plan.run_dir)
        raise UsageError(f"{plan.folder_label}: appeared while starting; run again") from None
    except OSError as exc:
        raise UsageError(f"{plan.folder_label}: cannot create it ({exc.strerror})") from None
    if not os.access(plan.run_dir, os.W_OK):
        raise UsageError(f"{plan.folder_label}: not writable")


def _check_writable(folder: Path) -> None:
    """Checkpoints are saved there: a folder that takes no file fails now, not at the first
    save, steps of work later. Tried for real: permissions say nothing of a read-only mount."""
    folder.mkdir(exist_ok=True)
    probe = folder / f".writable.{os.getpid()}"
    try:
        probe.touch()
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(folder)) from None
    probe.unlink()


def _write_files(plan: LaunchPlan) -> None:
    layout = plan.layout
    try:
        layout.logs.mkdir(exist_ok=True)
        layout.telemetry_dir.mkdir(exist_ok=True)
        plan.node_dir.mkdir(parents=True, exist_ok=True)
        if plan.store.remote:
            # Every node's own record, for the readers that find a run by its folder (the
            # workers are told by their plan): nodes need not share the run folder then.
            record_store(plan.run_dir, plan.store.root)
        elif plan.writes_shared_files:
            _check_writable(layout.checkpoints)
    except OSError as exc:
        where = Path(exc.filename or plan.run_dir)
        within = where != plan.run_dir and where.is_relative_to(plan.run_dir)
        inside = f" {where.relative_to(plan.run_dir)}/" if within else ""
        raise UsageError(
            f"{plan.folder_label}: cannot write in{inside or ' it'} ({exc.strerror})",
            hint="Make it writable (a read-only mount, or permissions), or resume into "
            "another folder: --resume CHECKPOINT --run-dir NEW_FOLDER.",
        ) from None
    text = _SPEC_HEADER + annotate_yaml(spec_to_yaml(plan.spec), plan.sources)
    if plan.writes_shared_files:
        # A resumed run keeps the spec it started with, and this attempt's goes beside it;
        # one that never trained is replaced.
        resumed = layout.spec.exists() and layout.holds_a_run()
        write_atomic(layout.next_resumed_spec() if resumed else layout.spec, text)
    if plan.node_dir != plan.run_dir:
        # Each node keeps the spec it ran, with or without storage the nodes share.
        write_atomic(layout.node_spec(plan.node_dir), text)
    plan.worker_plan().write(layout.worker_plan(plan.node_dir))
