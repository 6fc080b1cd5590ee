"""One replica: `python -m launcher.worker.main --plan FILE`.

Started by torch.distributed's elastic agent, which sets RANK, WORLD_SIZE and friends; the
launcher's resolved plan (`launcher.rundir.worker_plan`) says everything else. The first
thing it does is point its own stdout and stderr, at the file-descriptor level, into its log
file, so that output from C/C++ code lands there too and the launcher can follow every rank.

With `xla_spawn` in its plan, the worker instead starts the replicas itself through torch_xla's spawn
(one per TPU device, or just one), and each replica redirects its own output the same way.

A SIGTERM from anyone but the launcher (SLURM preemption and scancel signal every process of
the job) asks for the same graceful stop as the launcher's stop file (`launcher.worker.sigterm`).
Whatever a worker starts ends with the run: the launcher's reaper ends every process of the run
once the launcher has ended.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from pathlib import Path

from launcher.rundir.layout import RunLayout
from launcher.rundir.worker_plan import ReplicaGroup, WorkerPlan
from launcher.worker import startup  # noqa: F401  (the collector paused until training)
from launcher.worker.sigterm import stop_on_outside_sigterm


def redirect_output(log_file: Path) -> None:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_file, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    # A killed earlier attempt may have left half a line; start ours on a line of its own.
    if os.fstat(fd).st_size and os.pread(fd, 1, os.fstat(fd).st_size - 1) != b"\n":
        os.write(fd, b"\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Line buffering: the launcher shows lines as they are written, not when a buffer fills.
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]


def _parse(argv: list[str] | None) -> tuple[WorkerPlan, int]:
    """The plan, and the launcher's pid: this process's parent, unless the launcher's fork
    server (`launcher.worker.fork_server`) is."""
    parser = argparse.ArgumentParser(prog="launcher.worker.main")
    parser.add_argument("--plan", type=Path, required=True, help="the launcher's worker plan")
    plan = WorkerPlan.read(parser.parse_args(argv).plan)
    return plan, plan.launcher_pid or os.getppid()


def die_with_parent(parent: int | None = None, code: int = 1) -> None:
    """The agent starts workers in sessions of their own; if it is killed (even by SIGKILL),
    the kernel kills this worker too instead of leaving it training on its own. `parent`:
    the pid the parent had, read before the fork (None: any but init's); a process whose
    parent ended before the signal was set exits with `code`."""
    if sys.platform != "linux":
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1 if parent is None else os.getppid() != parent:
        os._exit(code)


def dump_stacks_on_request() -> None:
    """SIGUSR2 prints every thread's Python stack into the log: the launcher's hang watchdog
    asks for it. faulthandler does it from C, so it works even when Python is stuck."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR2, all_threads=True)


def main(argv: list[str] | None = None) -> None:
    die_with_parent()
    plan, launcher_pid = _parse(argv)
    if plan.replica_group is not None:
        _join_replica_group(plan.replica_group)
    redirect_output(RunLayout(plan.run_dir).log(_own_rank(plan)))
    # Before torch starts threads of its own.
    stop_on_outside_sigterm(plan.run_dir, launcher_pid)
    dump_stacks_on_request()
    code = _xla_spawn(plan, launcher_pid) if plan.xla_spawn else _train(plan)
    _end_children()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: C++ destructors of a process group whose peers are gone can
    # abort (SIGABRT) and replace a meaningful exit code with a crash.
    os._exit(code)


def _end_children() -> None:
    """DataLoader workers of a loader still open at the end (a stream's, or one a device
    loader's thread holds) would outlive this process as orphans: end and reap them."""
    import multiprocessing

    children = multiprocessing.active_children()
    if children:
        # The loader's SIGCHLD handler would take the workers ended here for a crash and raise
        # "DataLoader worker ... killed by signal: Terminated" over the run's real error.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout=10)


def _join_replica_group(group: ReplicaGroup) -> None:
    """A fault-tolerant run's worker: the group's agent numbers its processes from 0, like
    any run's (its REPLICA_GROUP_ID set as it started), and the machine's devices are shared
    between the groups (LOCAL_RANK: this process's)."""
    # torchft's Rust side logs every quorum and vote at INFO: thousands of lines a minute.
    os.environ.setdefault("RUST_LOG", "warn")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    os.environ["LOCAL_RANK"] = str(group.first_device + local)


def _own_rank(plan: WorkerPlan) -> int:
    # On a TPU pod every host's agent numbers its processes from 0: the plan says where this
    # host's ranks start.
    return int(os.environ.get("RANK", "0")) + plan.rank_offset


def _xla_spawn(plan: WorkerPlan, launcher_pid: int) -> int:
    import torch_xla.distributed.xla_multiprocessing as xmp

    if plan.xla_spawn == "all":
        # Replicas are spawned processes, born with this thread's signal mask. Starting
        # multiprocessing's resource tracker unblocks SIGTERM in the thread that starts it
        # (CPython before 3.12.9/3.13.2, gh-127586): start it now, then block SIGTERM again.
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        # Replicas that fail end their own process with their exit code (see _spawned).
        nprocs = 1 if plan.xla_spawn == "1" else None
        xmp.spawn(_spawned, args=(plan, launcher_pid), nprocs=nprocs)
    except Exception as exc:  # a replica died: its own log holds its traceback
        print(f"error: a replica failed ({type(exc).__name__}); see its log", file=sys.stderr)
        return 1
    return 0


def _spawned(index: int, plan: WorkerPlan, launcher_pid: int) -> None:
    """One replica started by torch_xla's spawn (with `nprocs=1`, in this same process)."""
    import torch_xla.runtime as xr

    die_with_parent()
    redirect_output(RunLayout(plan.run_dir).log(xr.global_ordinal()))
    # A spawned replica inherits SIGTERM blocked but no thread to take it. The agent's SIGTERM
    # reaches it too (it signals the worker's process group), from the launcher, which is
    # not the replica's parent.
    stop_on_outside_sigterm(plan.run_dir, launcher_pid)
    dump_stacks_on_request()
    code = _train(plan)
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _train(plan: WorkerPlan) -> int:
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    from launcher.errors import LauncherError
    from launcher.metrics.telemetry import record_failure
    from launcher.parallel.build import build_strategy
    from launcher.worker.loader_workers import warn_of_fork_hang
    from launcher.worker.loop import Trainer
    from launcher.worker.recipe import load_recipe

    errors = get_error_handler()
    errors.initialize()
    strategy = None
    try:
        spec = plan.run_spec()
        if _own_rank(plan) == 0:
            warn_of_fork_hang(spec.data)
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        strategy = build_strategy(
            spec, plan.accelerator, plan.compile_cache, plan.replica_group, attempt
        )
        strategy.setup()
        strategy.engine.start()  # across replica groups (fault_tolerance): joins the others
        recipe = load_recipe(spec.recipe.source, float8=spec.train.float8)
        Trainer(
            spec, recipe, strategy, plan.run_dir, attempt, plan.resume_from, plan.config_file,
            plan.store, plan.nodes_may_join,
        ).fit(plan.memory_estimate)  # fmt: skip
        strategy.barrier()  # nobody leaves the group while a peer still talks to it
        strategy.engine.stop()
        strategy.teardown()
        return 0
    except BaseException as exc:
        if isinstance(exc, LauncherError):
            print(f"error: {exc.render()}", file=sys.stderr, flush=True)
        else:  # the user's bug, or ours: the traceback is the message
            traceback.print_exc()
            errors.record_exception(exc)  # the elastic agent's root-cause file, as @record does
        rank = strategy.engine.log_rank if strategy is not None else _own_rank(plan)
        record_failure(plan.run_dir, rank)
        return exc.exit_code if isinstance(exc, LauncherError) else 1


if __name__ == "__main__":
    main()
