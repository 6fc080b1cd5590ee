"""Running a `LaunchPlan`: the run folder, torch.distributed's elastic agent, the live display.

One process per device, started by the same elastic agent that torchrun uses; each runs
`launcher.worker`, which writes its own log file that the display follows.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from launcher.display import RunDisplay
from launcher.errors import RunError, UsageError
from launcher.plan import LaunchPlan
from launcher.ranks import format_ranks
from launcher.spec_loader import spec_to_yaml
from launcher.strategies import strategy_info

SIGNAL_EXIT = {"SIGINT": 130, "SIGTERM": 143}


def execute(plan: LaunchPlan, console: Console | None = None) -> int:
    """Runs the plan to the end and returns the process exit code."""
    spec_file = prepare_run_dir(plan)
    console = console or Console()
    _quiet_elastic(plan.debug)
    os.environ.update(plan.worker_env())  # the elastic agent passes its environment on
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=plan.nproc,
        run_id=f"{plan.spec.run.name}-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        # Port 0: the store binds a free port itself, so two runs never race for one.
        rdzv_endpoint="127.0.0.1:0",
        rdzv_configs={"is_host": True},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(plan.run_dir / ".elastic")),
    )
    args = [
        "-u",
        "-m",
        "launcher.worker",
        "--run-dir",
        str(plan.run_dir),
        "--spec",
        str(spec_file),
        "--accelerator",
        plan.accelerator,
    ]
    if plan.resume_from is not None:
        args += ["--resume", str(plan.resume_from)]
    if strategy_info(plan.spec.launch.strategy).processes == "xla_spawn":
        args += ["--xla-spawn", "all" if plan.devices.spawn_all else "1"]
    verb = "resuming" if plan.resume_from else "starting"
    for note in plan.notes:
        console.print(Text("warning: ", style="bold yellow") + Text(note), soft_wrap=True)
    console.print(
        f"{verb} {plan.spec.run.name}: {plan.devices.count} x {plan.accelerator}, "
        f"strategy {plan.spec.launch.strategy}, run dir {plan.run_dir}",
        highlight=False,
        soft_wrap=True,
    )
    display = RunDisplay(
        plan.run_dir,
        ranks=range(plan.devices.replica_logs),
        show=plan.show_ranks,
        console=console,
        title=plan.spec.run.name,
    )
    try:
        with display:
            elastic_launch(config, sys.executable)(*args)
    except ChildFailedError as exc:
        return _report_failure(exc, plan, console)
    except SignalException as exc:
        console.print(f"stopped by {exc.sigval.name}; logs in {plan.run_dir / 'logs'}")
        return SIGNAL_EXIT.get(exc.sigval.name, 1)
    console.print(f"finished: {plan.run_dir}", highlight=False, soft_wrap=True)
    return 0


def prepare_run_dir(plan: LaunchPlan) -> Path:
    """Creates the run folder (never world-writable) and saves the resolved spec into it."""
    # A new run claims its folder atomically: two launches never share one.
    fresh = plan.resume_from is None and not (
        plan.run_dir.is_dir() and not any(plan.run_dir.iterdir())
    )
    try:
        plan.run_dir.mkdir(parents=True, exist_ok=not fresh, mode=0o755)
        (plan.run_dir / "logs").mkdir(exist_ok=True)
    except FileExistsError:
        raise UsageError(f"--run-dir {plan.run_dir}: appeared while starting; run again") from None
    except OSError as exc:
        raise UsageError(f"--run-dir {plan.run_dir}: cannot create it ({exc.strerror})") from None
    if not os.access(plan.run_dir, os.W_OK):
        raise UsageError(f"--run-dir {plan.run_dir}: not writable")
    spec_file = plan.run_dir / "spec.yaml"
    if spec_file.exists():
        # A resumed run keeps the spec it started with; this attempt's goes beside it.
        n = len(list(plan.run_dir.glob("spec.resume-*.yaml"))) + 1
        spec_file = plan.run_dir / f"spec.resume-{n}.yaml"
    spec_file.write_text(spec_to_yaml(plan.spec))
    return spec_file


def _report_failure(exc: ChildFailedError, plan: LaunchPlan, console: Console) -> int:
    rank, failure = root_cause(exc.failures)
    code = failure.exitcode
    how = f"exit code {code}" if code >= 0 else f"signal {-code}"
    log = plan.run_dir / "logs" / f"rank-{rank}.log"
    others = sorted(set(exc.failures) - {rank})
    failed = [r for r in others if exc.failures[r].exitcode > 0]
    stopped = [r for r in others if r not in failed]
    also = "".join(
        f" ({label}: ranks {format_ranks(ranks)})"
        for label, ranks in (("also failed", failed), ("then stopped", stopped))
        if ranks
    )
    console.print(
        Text(f"rank {rank} failed", style="bold red") + Text(f" with {how}{also}; its log: {log}"),
        soft_wrap=True,
    )
    # A worker's own usage error (exit 2) is still the user's input to fix.
    return code if code in (1, 2) else (128 - code if code < 0 else 1)


def root_cause(failures: dict[int, Any]) -> tuple[int, Any]:
    """The rank that failed first by itself, not one the agent stopped because of it."""
    own = {r: f for r, f in failures.items() if f.exitcode > 0} or failures
    return min(own.items(), key=lambda item: (item[1].timestamp, item[0]))


def _quiet_elastic(debug: bool) -> None:
    # The agent's INFO/WARNING chatter repeats what the display shows; --debug brings it back.
    level = logging.INFO if debug else logging.CRITICAL
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(level)


__all__ = ["RunError", "execute", "prepare_run_dir"]
