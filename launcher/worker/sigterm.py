"""How a worker process, and its DataLoader workers, take SIGTERM.

A SIGTERM from anyone but the launcher (SLURM preemption and scancel signal every process of
the job) asks for the same graceful stop as the launcher's stop file; one from the launcher
(its elastic agent stops the workers because a peer failed), from the process's parent, or a
second one, ends it at once by signal 15. Programs a worker starts get SIGTERM unblocked again.

A loader worker takes it the same way, quietly (its training process got the same signal and
says so): a forked one through an at-fork hook, one started by forkserver or spawn (a new
interpreter: `launcher.worker.loader_workers`) by `take_in_loader_worker`, with the rule the
training process took (`loader_worker_rule`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

from launcher.rundir.layout import RunLayout
from launcher.stop_signals import SIGTERM_REPEAT_WINDOW_S

REPEAT_WINDOW_S = SIGTERM_REPEAT_WINDOW_S  # a module attribute: tests shorten it
_sigterm_lock = threading.Lock()
_sigterm_taken = False
# The (run folder, launcher pid) this process took SIGTERM by: what its loader workers take.
_rule: tuple[Path, int] | None = None


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
    global _sigterm_taken, _rule
    if not hasattr(signal, "sigwaitinfo"):  # macOS: SIGTERM keeps its default action
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    with _sigterm_lock:  # XLA replicas can call this from a thread per device
        if _sigterm_taken:
            return
        _sigterm_taken = True
        _rule = (run_dir, launcher_pid)
    _start_programs_with_sigterm_unblocked()
    _start_sigterm_thread(run_dir, launcher_pid, quiet=False)
    # A forked child (a DataLoader worker) inherits the blocked mask but not the thread: it
    # gets its own. Quiet: its training process got the same signal and says so. It must not
    # simply die either: under SLURM its death would fail the training process's loader
    # ("DataLoader worker ... is killed by signal: Terminated") before the checkpoint is saved.
    os.register_at_fork(
        after_in_child=lambda: _start_sigterm_thread(run_dir, launcher_pid, quiet=True)
    )


def loader_worker_rule() -> tuple[Path, int] | None:
    """The (run folder, launcher pid) of `stop_on_outside_sigterm` in this process, for the
    loader workers it starts without fork; None where it took none."""
    return _rule


def take_in_loader_worker(run_dir: Path, launcher_pid: int, training_pid: int) -> None:
    """In a loader worker started by forkserver or spawn: SIGTERM as a forked one takes it.
    Its parent may be the fork server: the training process, which ends its workers with
    SIGTERM, counts as its parent. It was born with SIGTERM blocked (the mask survives exec
    and fork), so a SIGTERM that came before this is taken now."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    _start_sigterm_thread(run_dir, launcher_pid, quiet=True, parent=training_pid)


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


def _start_sigterm_thread(
    run_dir: Path, launcher_pid: int, quiet: bool, parent: int | None = None
) -> None:
    """`parent`: whose SIGTERM ends this process at once besides the launcher's; None: its
    parent process."""

    def take() -> None:
        stopping_since: float | None = None
        while True:
            sender = signal.sigwaitinfo({signal.SIGTERM}).si_pid
            if sender in (launcher_pid, os.getppid() if parent is None else parent):
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
