"""Running a `LaunchPlan` on this node: the run folder, the elastic agent, supervision, and
what the launcher says at the end.

One process per device, started by the same elastic agent that torchrun uses; each runs
`launcher.worker.main --plan FILE`, which writes its own log file that the display follows.
"""

from __future__ import annotations

import gc
import os
from typing import NamedTuple, NoReturn

from rich.console import Console
from rich.text import Text
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from launcher.errors import RunError
from launcher.launch import failure_report
from launcher.launch.agent import AgentThread, agent_config, quiet_elastic
from launcher.launch.closed_output import LauncherConsole
from launcher.launch.fork_server import ForkServer, forked_workers
from launcher.launch.plan import LaunchPlan
from launcher.launch.reaper import Reaper
from launcher.launch.run_folder import prepare_run_dir
from launcher.launch.supervise import SIGNAL_EXIT, NodeView, Outcome, exit_now, supervise
from launcher.replicas.registry import coordinator_function
from launcher.rundir.outcome import OutcomeRecorder


def execute(
    plan: LaunchPlan, console: Console | None = None, fork_server: ForkServer | None = None
) -> NoReturn:
    """Runs the plan to the end and ends the process with its exit code; the run folder
    records how it ended (`launcher.rundir.outcome`). `fork_server`: the workers' server,
    forked from this process as it started (`fork_server.warm_server`), which the run owns."""
    # Whatever the user's umask, nothing the run writes (folders, logs, checkpoints, by the
    # launcher or its workers, who inherit this) is writable by other users.
    os.umask(os.umask(0) | 0o002)
    # Locked: this launcher is the run folder's one writer until the run ends.
    with (
        prepare_run_dir(plan),
        OutcomeRecorder(plan.layout, plan.writes_shared_files) as recorder,
    ):
        ending = _run(plan, console, fork_server)
        recorder.record(*ending)
    # The run is recorded and every process of it has ended. What a normal exit adds is the
    # interpreter's teardown of torch's modules: 0.3 to 1 s that nothing needs (issue 41); and
    # after a kill, the elastic agent's thread may still be inside torch (`exit_now`).
    exit_now(ending.code)


class Ending(NamedTuple):
    """What the launcher said at the end, as `outcome.json` records it."""

    code: int
    stopped: bool = False  # on request (a signal, a stop request): it resumes; not a failure
    reason: str = ""


def _run(plan: LaunchPlan, console: Console | None, fork_server: ForkServer | None) -> Ending:
    # Left by an earlier attempt in this folder (a requeued job's, say): its stop request.
    # Every node removes it before it joins, so never after the run has started.
    plan.layout.stop_request.unlink(missing_ok=True)
    console = console or LauncherConsole()
    quiet_elastic(plan.debug)
    os.environ.update(plan.worker_env())  # the elastic agent passes its environment on
    # The start is over (`launcher.cli.options.run_guarded` paused the collector for it): what
    # it built lives as long as the launcher, so the collector never walks it again.
    gc.freeze()
    gc.enable()
    _announce(plan, console)
    try:
        # Nothing the run starts outlives it; its workers are forked by a warm server.
        with Reaper() as reaper, forked_workers(plan, fork_server):
            # Replica groups (fault_tolerance): their engine's coordinator runs them.
            supervise_groups = coordinator_function(plan.spec.fault_tolerance, "supervise")
            if supervise_groups is not None:
                outcome = supervise_groups(plan, console, reaper.pid)
            else:
                view = NodeView(plan, console)
                agent = AgentThread(*agent_config(plan, view.follow))
                outcome = supervise(plan, [agent], view, console, reaper.pid)
            return _conclude(outcome, plan, console)
    finally:
        # The request has been answered: a stopped run's folder keeps no leftover of it. On
        # several nodes another node's launcher may not have read it yet, so it stays for
        # the next attempt's start (above) to remove.
        if not plan.nodes.multi:
            plan.layout.stop_request.unlink(missing_ok=True)


def _announce(plan: LaunchPlan, console: Console) -> None:
    for note in plan.notes:
        console.print(Text("warning: ", style="bold yellow") + Text(note), soft_wrap=True)
    for change in plan.changes:
        console.print(Text(change), soft_wrap=True, highlight=False)
    what = (
        f"resuming {plan.spec.run.name} from {plan.resume_from}"
        if plan.resume_from
        else (f"starting {plan.spec.run.name}")
    )
    if plan.spec.load.weights and not plan.resume_from:
        what += f" from the weights of {plan.spec.load.weights}"
    console.print(
        f"{what}: {plan.devices.count} x {plan.accelerator}, "
        f"strategy {plan.spec.launch.strategy}, run dir {plan.run_dir}",
        highlight=False,
        soft_wrap=True,
    )
    if plan.nodes.multi and not plan.replica_groups:  # groups meet at the Lighthouse instead
        console.print(plan.nodes.describe(), highlight=False, soft_wrap=True)


def _conclude(outcome: Outcome, plan: LaunchPlan, console: Console) -> Ending:
    logs = plan.layout.logs
    if outcome.signals >= 2:
        console.print(f"stopped at once by a second {outcome.signal_name}; logs in {logs}")
        return Ending(outcome.exit_code_of_signal, True, outcome.signal_name)
    if outcome.untrained:
        console.print(
            f"stopped by {outcome.signal_name} before the first step: nothing to save; "
            f"logs in {logs}",
            highlight=False,
            soft_wrap=True,
        )
        return Ending(outcome.exit_code_of_signal, True, outcome.signal_name)
    if outcome.folder_gone:
        return Ending(_folder_gone(plan, console), False, "the run folder was deleted")
    if outcome.fault:
        return Ending(_fault(plan, console), False, outcome.fault)
    if outcome.stalls:
        after = outcome.signal_name if outcome.signals else None
        return Ending(
            failure_report.report_stall(outcome.stalls, plan, console, after), False, "a rank hung"
        )
    error = outcome.error
    if isinstance(error, ChildFailedError):
        return Ending(failure_report.report_failure(error, plan, console), False, "a rank failed")
    if isinstance(error, SignalException):  # a signal the agent took (e.g. SIGHUP)
        console.print(f"stopped by {error.sigval.name}; logs in {logs}")
        return Ending(SIGNAL_EXIT.get(error.sigval.name, 1), True, error.sigval.name)
    if error is not None:  # the rendezvous or the agent itself, not a worker
        failure_report.explain_rendezvous_error(error, plan)
        raise RunError(
            f"torch.distributed.elastic failed: {type(error).__name__}: {error}",
            hint="Run again with --debug to see its traceback and logs.",
        ) from error
    # A stop asked for elsewhere: a worker's own SIGTERM (SLURM signals every process), or
    # another node's Ctrl-C when the nodes share the run folder.
    if outcome.signals or plan.layout.stop_request.exists():
        reason = outcome.signal_name if outcome.signals else "stop request"
        return Ending(_stopped(outcome, plan, console), True, reason)
    console.print(f"finished: {plan.run_dir}", highlight=False, soft_wrap=True)
    return Ending(0)


def _fault(plan: LaunchPlan, console: Console) -> int:
    """The run stopped by a fault its coordinator saw (a lost Lighthouse, a stranger in the
    quorum), said already: where it can go on from."""
    latest = plan.store.latest()  # listed again: the run saved since the plan's listing
    said = (
        f"checkpoints are intact (newest: {latest.name}). Continue with: --resume {plan.run_dir}"
        if latest
        else "no checkpoint was saved yet"
    )
    console.print(said, highlight=False, soft_wrap=True)
    return 1


def _folder_gone(plan: LaunchPlan, console: Console) -> int:
    latest = plan.store.latest()  # listed again: the run saved since the plan's listing
    said = (
        f"stopped: the run folder was deleted or moved; saved {latest} into a new one. "
        f"Continue with: --resume {plan.run_dir}"
        if latest
        else f"stopped: the run folder {plan.run_dir} was deleted or moved; nothing was saved"
    )
    console.print(Text(said, style="bold red"), soft_wrap=True)
    return 1


def _stopped(outcome: Outcome, plan: LaunchPlan, console: Console) -> int:
    latest = plan.store.latest()  # listed again: the run saved since the plan's listing
    resume = "latest" if plan.nodes.job_id else str(plan.run_dir)
    if latest:
        end = f"; saved {latest}. Continue with: --resume {resume}"
    elif plan.spec.checkpoint.enabled:  # the ranks stopped before their first step
        end = " before the first step: nothing to save"
    else:
        end = " (checkpoints are off: nothing to resume)"
    console.print(
        (f"stopped by {outcome.signal_name}" if outcome.signals else "stopped on request") + end,
        highlight=False,
        soft_wrap=True,
    )
    if outcome.signals:
        return outcome.exit_code_of_signal
    # Another node's SIGTERM: under Kubernetes an exit of 0 would count this pod as done.
    return SIGNAL_EXIT["SIGTERM"] if plan.nodes.restarted_by_exit_code else 0


__all__ = ["execute"]
