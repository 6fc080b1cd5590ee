"""The workers' fork server: one warm process per launcher that imports torch and the
worker's code once, then forks a worker whenever the elastic agent starts one
(`launch.worker_start: forkserver`; `launcher.launch.agent.ForkServer` is the launcher's half).

Why: a worker started as a new interpreter spends 1.5-2.5 s of CPU importing torch and the
launcher before it does anything (issue 54), every rank at once on every start and restart. A
fork of a process that imported them once starts in milliseconds, sharing those pages.

Why it is safe to fork: this process is single-threaded (nothing it imports starts a Python
thread), so a child cannot inherit a lock another thread held (CPython gh-112275). It imports
no user code, initialises no device and runs no collective.

What a child is: the same `python -u -m launcher.worker.main ARGS` the agent asked for, run by
`runpy` as `__main__`, in a session of its own, with the environment, working directory and
standard streams it was sent (as `subprocess.Popen(start_new_session=True)` would give it). Its
command line stays this server's; tests and tools find workers as this server's children.

What it preloads: torch and the worker's own modules (`PRELOAD`), and the installed
libraries the recipe imports (a transformers model's modules), which the launcher found as it
checked the recipe and sends first. Never the recipe itself: user code may do anything as it
is imported. An import that started a thread or initialised CUDA makes the server refuse to
fork (the launcher then starts the workers as new interpreters).

The protocol, on a Unix socket from the launcher (`--fd`): first the recipe's libraries (a
length, then a pickled tuple of module names); then each request is a pickled
`(argv, env, cwd)` with four descriptors (stdin, stdout, stderr, and the child's own status
socket). On the status socket the child says its pid once it leads a session of its own, then
the server, once it has reaped it, says its exit code as `subprocess` gives it (negative:
ended by that signal). EOF on the control socket (the
launcher ended, however) ends the server; its children end with it (`die_with_parent`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import pickle
import runpy
import selectors
import signal
import socket
import struct
import sys
import warnings

# What every worker imports on its way to training (torch first). A module that fails to
# import (renamed, or an optional dependency missing) is left to the worker, which reports it.
PRELOAD = (
    "torch",
    "torch._dynamo",  # the optimizer's first step imports it: a second of CPU
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.utils.flop_counter",
    "torch.distributed.elastic.multiprocessing.errors",
    "launcher.worker.main",
    "launcher.worker.loop",
    "launcher.worker.recipe",
    "launcher.parallel.build",
    "launcher.parallel.torch_distributed",
    "launcher.checkpoint.writers",
    "launcher.metrics.telemetry",
    "launcher.metrics.tensorboard_events",
)
# The signals this server ignores, which its children take back: Ctrl-C at the terminal and
# SLURM's SIGTERM to every process of the job are the workers' to handle; ending this server
# would end them all at once (SIGKILL, their parent-death signal) before they could save.
IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2)
# A status message: what it says (STARTED: the value is the child's pid; EXITED: its exit
# code), and the value.
STATUS = struct.Struct("=cq")
LENGTH = struct.Struct("!I")  # of the launcher's first message
STARTED, EXITED = b"p", b"x"
MAX_REQUEST = 1 << 20


def serve(control: socket.socket) -> None:
    """Forks a worker per request until the launcher closes the control socket."""
    defaults = {sig: signal.getsignal(sig) for sig in IGNORED}
    for sig in IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through wake_w
    children: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    ours = (control, selector, wake_r, wake_w)  # what a child closes first
    while True:
        for key, _ in selector.select():
            if key.fileobj is control:
                request = _receive(control)
                if request is None:
                    return
                _fork(request, children, defaults, ours)
            else:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
        _reap(children)


def _receive(control: socket.socket) -> tuple[tuple, list[int]] | None:
    message, fds, _, _ = socket.recv_fds(control, MAX_REQUEST, 4)
    if not message:
        return None
    return pickle.loads(message), fds


def _fork(
    request: tuple[tuple, list[int]],
    children: dict[int, socket.socket],
    defaults: dict[int, object],
    inherited: tuple,
) -> None:
    (argv, env, cwd), fds = request
    status = socket.socket(fileno=fds[3])
    # Blocked across the fork: a signal sent to the child before it takes its defaults back
    # waits for them instead of meeting this server's SIG_IGN (which would drop it).
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, IGNORED)
    pid = os.fork()
    if pid == 0:
        for sock in children.values():
            sock.close()
        _become_worker(argv, env, cwd, fds[:3], defaults, (*inherited, status), mask)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    for fd in fds[:3]:
        os.close(fd)
    children[pid] = status


def _reap(children: dict[int, socket.socket]) -> None:
    """Tells the launcher each ended child's exit code, on that child's status socket."""
    for pid in list(children):
        done, wait_status = os.waitpid(pid, os.WNOHANG)
        if done == 0:
            continue
        status = children.pop(pid)
        with contextlib.suppress(OSError):  # the launcher stopped listening: nothing to tell
            status.sendall(STATUS.pack(EXITED, os.waitstatus_to_exitcode(wait_status)))
        status.close()


def _become_worker(
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    streams: list[int],
    defaults: dict[int, object],
    inherited: tuple,
    mask: set[signal.Signals],
) -> None:
    """The child's whole life: what `python ARGV` would have been, then os._exit."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for sig, handler in defaults.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        control, selector, wake_r, wake_w, status = inherited
        # The pid, from the child once it leads its session and takes signals as a worker
        # does: the agent may signal its process group as soon as it has it.
        status.sendall(STATUS.pack(STARTED, os.getpid()))
        status.close()
        control.close()
        selector.close()
        os.close(wake_r)
        os.close(wake_w)
        for target, fd in enumerate(streams):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        module, args = _module_and_args(argv)
        sys.argv = [module, *args]
        # Run afresh as `__main__`, as `python -m` runs it, not as the module preloaded.
        sys.modules.pop(module, None)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # as the interpreter would: the traceback, exit code 1
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _module_and_args(argv: list[str]) -> tuple[str, list[str]]:
    """`-u -m MODULE ARGS...` (the only form the launcher sends): MODULE and ARGS."""
    options = argv[: argv.index("-m")]
    if any(o != "-u" for o in options):
        raise ValueError(f"the worker fork server runs `-m MODULE` only, not {argv}")
    if "-u" in options:  # unbuffered, as `python -u` (the worker sets line buffering too)
        sys.stdout.reconfigure(write_through=True)  # type: ignore[union-attr]
        sys.stderr.reconfigure(write_through=True)  # type: ignore[union-attr]
    rest = argv[argv.index("-m") + 1 :]
    return rest[0], rest[1:]


def preload(names: tuple[str, ...]) -> None:
    """Imports `names` (quietly: a warning an import gives is the worker's to give, where it
    imports something itself)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            with contextlib.suppress(Exception):
                importlib.import_module(name)


def _libraries(control: socket.socket) -> tuple[str, ...]:
    """The recipe's libraries, the launcher's first message: a length, then a pickled tuple."""
    size = LENGTH.unpack(control.recv(LENGTH.size, socket.MSG_WAITALL))[0]
    return pickle.loads(control.recv(size, socket.MSG_WAITALL)) if size else ()


def main() -> None:
    parser = argparse.ArgumentParser(prog="launcher.worker.fork_server")
    parser.add_argument("--fd", type=int, required=True, help="the control socket")
    parser.add_argument("--run-dir", help="the run it serves (shown in `ps`)")
    args = parser.parse_args()
    control = socket.socket(fileno=args.fd)
    # The launcher reads this answer once the imports are done: a request sent earlier would
    # wait for them anyway, but a server that cannot serve is then found at once.
    preload((*PRELOAD, *_libraries(control)))
    unsafe = _why_not_fork()
    # A launcher that has ended (closed or reset its socket) has no more workers to start.
    with contextlib.suppress(OSError):
        control.sendall(b"\x02" + unsafe.encode() if unsafe else b"\x01")
        if not unsafe:
            serve(control)
    os._exit(0)  # its children end with it; no teardown of torch's modules


def _why_not_fork() -> str:
    """Why a fork of this process would be broken, if it would: a thread an import started
    (CPython gh-112275), or CUDA's driver initialised by one, which does not survive a fork."""
    import threading

    import torch

    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        return f"an import started threads ({', '.join(others)})"
    if torch.cuda.is_initialized():
        return "an import initialised CUDA"
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:  # Linux's
        if any("libcuda.so" in line for line in maps):
            return "an import loaded CUDA's driver"
    return ""


if __name__ == "__main__":
    main()
