"""Creating a run's folder on this node and writing what the workers will read."""

from __future__ import annotations

import os
from pathlib import Path

from launcher.errors import UsageError
from launcher.launch.plan import LaunchPlan
from launcher.spec_loader import spec_to_yaml


def prepare_run_dir(plan: LaunchPlan) -> None:
    """Creates the run folder (never world-writable), saves the resolved spec into it and
    writes this node's worker plan."""
    layout = plan.layout
    # A new run claims its folder atomically: two launches never share one. The nodes of a
    # job share theirs, which whichever comes first creates.
    fresh = (
        plan.resume_from is None
        and plan.nodes.job_id is None
        and not (plan.run_dir.is_dir() and not any(plan.run_dir.iterdir()))
    )
    try:
        plan.run_dir.mkdir(parents=True, exist_ok=not fresh, mode=0o755)
        layout.logs.mkdir(exist_ok=True)
        layout.telemetry_dir.mkdir(exist_ok=True)
        plan.node_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UsageError(f"--run-dir {plan.run_dir}: appeared while starting; run again") from None
    except OSError as exc:
        raise UsageError(f"--run-dir {plan.run_dir}: cannot create it ({exc.strerror})") from None
    if not os.access(plan.run_dir, os.W_OK):
        raise UsageError(f"--run-dir {plan.run_dir}: not writable")
    text = spec_to_yaml(plan.spec)
    if plan.writes_shared_files:
        # A resumed run keeps the spec it started with; this attempt's goes beside it.
        _write_atomic(layout.next_resumed_spec() if layout.spec.exists() else layout.spec, text)
    if plan.node_dir != plan.run_dir:
        # Each node keeps the spec it ran, with or without storage the nodes share.
        _write_atomic(layout.node_spec(plan.node_dir), text)
    plan.worker_plan().write(layout.worker_plan(plan.node_dir))


def _write_atomic(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text)
    partial.replace(path)
