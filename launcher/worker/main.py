"""One replica: `python -m launcher.worker.main --plan FILE`.

Started by torch.distributed's elastic agent, which sets RANK, WORLD_SIZE and friends; the
launcher's resolved plan (`launcher.rundir.worker_plan`) says everything else. The first
thing it does is point its own stdout and stderr, at the file-descriptor level, into its log
file, so that output from C/C++ code lands there too and the launcher can follow every rank.

With `xla_spawn` in its plan, the worker instead starts the replicas itself through torch_xla's spawn
(one per TPU device, or just one), and each replica redirects its own output the same way.

A SIGTERM from anyone but the launcher (SLURM preemption and scancel signal every process of
the job) asks for the same graceful stop as the launcher's stop file; see stop_on_outside_sigterm.
Programs a worker starts get SIGTERM unblocked again, and whatever it starts ends with the run:
the launcher's reaper ends every process of the run once the launcher has ended.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

from launcher.rundir.layout import RunLayout
from launcher.rundir.worker_plan import WorkerPlan
from launcher.stop_signals import SIGTERM_REPEAT_WINDOW_S


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


def _parse(argv: list[str] | None) -> WorkerPlan:
    parser = argparse.ArgumentParser(prog="launcher.worker.main")
    parser.add_argument("--plan", type=Path, required=True, help="the launcher's worker plan")
    return WorkerPlan.read(parser.parse_args(argv).plan)


def die_with_parent() -> None:
    """The agent starts workers in sessions of their own; if it is killed (even by SIGKILL),
    the kernel kills this worker too instead of leaving it training on its own."""
    if sys.platform != "linux":
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def dump_stacks_on_request() -> None:
    """SIGUSR2 prints every thread's Python stack into the log: the launcher's hang watchdog
    asks for it. faulthandler does it from C, so it works even when Python is stuck."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR2, all_threads=True)


REPEAT_WINDOW_S = SIGTERM_REPEAT_WINDOW_S  # a module attribute: tests shorten it
_sigterm_lock = threading.Lock()
_sigterm_taken = False


def stop_on_outside_sigterm(run_dir: Path, launcher_pid: int) -> None:
    """A SIGTERM from outside (slurmstepd on preemption or scancel signals every process of
    the job step, workers included) touches the stop file, so that every rank finishes its
    step and saves, as when the launcher asks. A SIGTERM from the launcher (its elastic agent
    stops the workers because a peer failed: a graceful stop would hang in a collective with
    the dead peer) or from this process's parent, or a second one, ends it at once by
    signal 15, as before.

    Python's signal handlers are not told who sent a signal; sigwaitinfo is. So SIGTERM stays
    blocked in every thread and one thread takes it. Call this before any other thread
    starts: a thread inherits the mask of the thread that started it.
    """
    global _sigterm_taken
    if not hasattr(signal, "sigwaitinfo"):  # macOS: SIGTERM keeps its default action
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    with _sigterm_lock:  # XLA replicas can call this from a thread per device
        if _sigterm_taken:
            return
        _sigterm_taken = True
    _start_programs_with_sigterm_unblocked()
    _start_sigterm_thread(run_dir, launcher_pid, quiet=False)
    # A forked child (a DataLoader worker) inherits the blocked mask but not the thread: it
    # gets its own. Quiet: its training process got the same signal and says so. It must not
    # simply die either: under SLURM its death would fail the training process's loader
    # ("DataLoader worker ... is killed by signal: Terminated") before the checkpoint is saved.
    os.register_at_fork(
        after_in_child=lambda: _start_sigterm_thread(run_dir, launcher_pid, quiet=True)
    )


def _start_programs_with_sigterm_unblocked() -> None:
    """A program started from here (a recipe's `subprocess.Popen`) would inherit SIGTERM
    blocked, since exec keeps the signal mask, and ignore a plain `kill`. CPython starts
    programs through vfork or posix_spawn, which run no at-fork hook, so the thread that
    starts one unblocks SIGTERM for that moment. A SIGTERM arriving just then (while the
    program starts) takes its default action and ends this process by signal 15, as the
    launcher's does, even one from outside. Forked children
    (DataLoader workers) and multiprocessing's spawned ones (XLA replicas) are not started
    this way: they keep SIGTERM blocked and take it as this process does."""
    start = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def unblocked(popen: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> None:
        mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        try:
            start(popen, *args, **kwargs)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    subprocess.Popen._execute_child = unblocked  # type: ignore[attr-defined]


def _start_sigterm_thread(run_dir: Path, launcher_pid: int, quiet: bool) -> None:
    def take() -> None:
        stopping_since: float | None = None
        while True:
            sender = signal.sigwaitinfo({signal.SIGTERM}).si_pid
            if sender in (launcher_pid, os.getppid()):
                _die_by_sigterm()
            if stopping_since is not None:
                if time.monotonic() - stopping_since > REPEAT_WINDOW_S:
                    _die_by_sigterm()
                continue
            try:
                RunLayout(run_dir).stop_request.touch()
            except OSError:  # no way to ask the others: stop as if it were the launcher's
                _die_by_sigterm()
            stopping_since = time.monotonic()
            if not quiet:
                print(
                    f"SIGTERM from pid {sender} (not the launcher): "
                    "finishing this step, saving and stopping",
                    flush=True,
                )

    threading.Thread(target=take, name="sigterm", daemon=True).start()


def _die_by_sigterm() -> NoReturn:
    # raise() signals this thread alone, which no longer blocks it, so the other threads'
    # masks cannot hold it off; the default action ends the process by signal 15, which the
    # agent and the launcher's failure report understand.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    signal.raise_signal(signal.SIGTERM)
    os._exit(128 + signal.SIGTERM)  # someone installed a SIGTERM handler, and it returned


def main(argv: list[str] | None = None) -> None:
    die_with_parent()
    plan = _parse(argv)
    redirect_output(RunLayout(plan.run_dir).log(_own_rank(plan)))
    # Before torch starts threads of its own. The worker's parent is the launcher.
    stop_on_outside_sigterm(plan.run_dir, os.getppid())
    dump_stacks_on_request()
    code = _xla_spawn(plan) if plan.xla_spawn else _train(plan)
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


# The first CPython release of each line without gh-112275 (3.12 never had it).
_FORK_HANG_FIXED_IN = {(3, 10): (3, 10, 15), (3, 11): (3, 11, 10)}


def forked_workers_may_hang(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> bool:
    """Whether this CPython can leave a forked child (a DataLoader worker) hung for good as it
    starts: the child waits on the lock of the interpreter's thread list when another thread
    held it at the fork, and C++ threads take that lock, without the GIL, whenever they enter
    Python (gloo's threads do, as they free a collective's tensors). Python code cannot keep
    other threads off that lock, so no fork hook here can help: only a fixed CPython does."""
    fixed_in = _FORK_HANG_FIXED_IN.get(tuple(version[:2]))
    return sys.implementation.name == "cpython" and fixed_in is not None and version < fixed_in


def warn_of_fork_hang(
    num_workers: int, version: tuple[int, ...] = tuple(sys.version_info[:3])
) -> None:
    """Says so once (on rank 0) when the run forks DataLoader workers on such a CPython: the
    hang is rare and stops the run on launch.stall_timeout with nothing else to explain it."""
    if num_workers and forked_workers_may_hang(version):
        python = ".".join(str(part) for part in version[:3])
        print(
            # Not "DataLoader worker": that is how torch says one died, and tests look for it.
            f"WARNING: data.num_workers: Python {python} can leave a forked loader process hung "
            "as it starts (CPython bug gh-112275, fixed in 3.10.15 and 3.11.10); the run then "
            "stops on launch.stall_timeout. Use a newer Python, or data.num_workers: 0",
            file=sys.stderr,
            flush=True,
        )


def _own_rank(plan: WorkerPlan) -> int:
    # On a TPU pod every host's agent numbers its processes from 0: the plan says where this
    # host's ranks start.
    return int(os.environ.get("RANK", "0")) + plan.rank_offset


def _xla_spawn(plan: WorkerPlan) -> int:
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
        xmp.spawn(_spawned, args=(plan, os.getppid()), nprocs=nprocs)
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
    from launcher.worker.loop import Trainer
    from launcher.worker.recipe import load_recipe

    errors = get_error_handler()
    errors.initialize()
    strategy = None
    try:
        spec = plan.run_spec()
        if _own_rank(plan) == 0:
            warn_of_fork_hang(spec.data.num_workers)
        strategy = build_strategy(spec, plan.accelerator, plan.compile_cache)
        strategy.setup()
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        recipe = load_recipe(spec.recipe.source)
        Trainer(
            spec, recipe, strategy, plan.run_dir, attempt, plan.resume_from, plan.config_file
        ).fit(plan.memory_estimate)
        strategy.barrier()  # nobody leaves the group while a peer still talks to it
        strategy.teardown()
        return 0
    except BaseException as exc:
        if isinstance(exc, LauncherError):
            print(f"error: {exc.render()}", file=sys.stderr, flush=True)
        else:  # the user's bug, or ours: the traceback is the message
            traceback.print_exc()
            errors.record_exception(exc)  # the elastic agent's root-cause file, as @record does
        rank = strategy.rank if strategy is not None else _own_rank(plan)
        record_failure(plan.run_dir, rank)
        return exc.exit_code if isinstance(exc, LauncherError) else 1


if __name__ == "__main__":
    main()
