"""The workers' fork server: one warm process per launcher that holds torch and the worker's
code, imported once, and forks a worker whenever the elastic agent starts one
(`launch.worker_start`; `launcher.launch.fork_server` is the launcher's half).

Why: a worker started as a new interpreter spends 1.5-2.5 s of CPU importing torch and the
launcher before it does anything (issue 54), every rank at once on every start and restart. A
fork of a process that imported them once starts in milliseconds, sharing those pages.

How it starts, either way with the same life after (`serve`):
- Forked from the launcher (`run_forked`), the usual way: once the spec is valid, while the
  launcher is single-threaded, has imported torch and has not yet imported the recipe. It
  first becomes what `python -m` would have started (`_as_new_process`): a session of its
  own, /dev/null in place of every descriptor it inherited, Python's own signal handlers,
  the collector on.
- As a new interpreter (`python -m launcher.worker.fork_server --fd N`), where the launcher
  could not fork it (a thread was running) and for each replica group (its environment, as
  tools read it from /proc, holds the group's).

Why it is safe to fork: this process is single-threaded (nothing it imports starts a Python
thread), so a child cannot inherit a lock another thread held (CPython gh-112275). It imports
no user code, initialises no device and runs no collective.

What a child is: the same `python -u -m launcher.worker.main ARGS` the agent asked for, run by
`runpy` as `__main__`, in a session of its own, with the environment, working directory,
`sys.path[0]` and standard streams it was sent (as `subprocess.Popen(start_new_session=True)`
would give it). What a new interpreter reads from its environment only as it starts, a forked
one is given by call: OpenMP's threads (`torch.set_num_threads`) and glibc's allocator
settings (`mallopt`). Its command line is this server's, its name (`comm`) the interpreter's.

What it preloads: torch and the worker's own modules (`PRELOAD`), and the installed
libraries the recipe imports (a transformers model's modules), which the launcher found as it
checked the recipe and sends. Never the recipe itself: user code may do anything as it
is imported. An import that started a thread or initialised CUDA makes the server refuse to
fork (the launcher then starts the workers as new interpreters).

The protocol, on a Unix socket from the launcher: first the recipe's libraries (a
length, then a pickled tuple of module names); then each request is a pickled `Request`
(sent as a plain tuple: the command, environment, working directory, umask, the reaper's
mark and the job's signals the launcher ignores) with four
descriptors (stdin, stdout, stderr, and the child's own status socket). On the status
socket the child says its pid once it leads a session of its own, then the server, once it
has reaped it, says its exit code as `subprocess` gives it (negative: ended by that signal).
How it ends: with the launcher. The kernel SIGKILLs it as the launcher ends, however that
ends (its parent-death signal), and its workers with it (theirs): at once, so that no worker
goes on without the launcher, not even to finish a checkpoint. On an end the launcher
controls, it first closes the control socket: EOF ends the server, which kills whatever its
workers started that outlived them and came back to it, their subreaper (whatever session
they moved to). What escapes both, the launcher's reaper ends: a worker's forks carry its
mark (`Request.mark`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib
import mmap
import os
import pickle
import runpy
import selectors
import signal
import socket
import struct
import sys
import warnings
from typing import NamedTuple

from launcher.stop_signals import JOB_SIGNALS

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
    "psutil",  # this server's own, to end its descendants at once when the launcher ends
)
# The signals this server ignores, which its children take back: Ctrl-C at the terminal and
# SLURM's SIGTERM to every process of the job are the workers' to handle; ending this server
# would end them all at once (SIGKILL, their parent-death signal) before they could save.
IGNORED = JOB_SIGNALS
# A status message: what it says (STARTED: the value is the child's pid; EXITED: its exit
# code), and the value.
STATUS = struct.Struct("=cq")
LENGTH = struct.Struct("!I")  # of the launcher's first message
STARTED, EXITED = b"p", b"x"
MAX_REQUEST = 1 << 20
# Its name (`comm`: what `ps -e`, `top` and `pgrep` show); the workers take the interpreter's.
NAME = "fork-server"
# glibc reads these from the environment once, as a process starts (`mallopt`'s numbers).
_MALLOC_SETTINGS = {
    "MALLOC_TRIM_THRESHOLD_": -1,
    "MALLOC_TOP_PAD_": -2,
    "MALLOC_MMAP_THRESHOLD_": -3,
    "MALLOC_MMAP_MAX_": -4,
    "MALLOC_ARENA_TEST": -7,
    "MALLOC_ARENA_MAX": -8,
}
_PR_SET_NAME, _PR_SET_CHILD_SUBREAPER = 15, 36
# Held for a forked worker's life: the mapping that marks it and its forks as the run's.
_mark: mmap.mmap | None = None


def serve(control: socket.socket) -> None:
    """Forks a worker per request until the launcher closes the control socket."""
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
                    _end_descendants()
                    return
                _fork(request, children, ours)
            else:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
        _reap(children)


def _receive(control: socket.socket) -> tuple[tuple, list[int]] | None:
    message, fds, _, _ = socket.recv_fds(control, MAX_REQUEST, 4)
    if not message:
        return None
    return pickle.loads(message), fds


class Request(NamedTuple):
    """A worker to start, as the launcher sends it: what `subprocess.Popen` would be given
    (the command, environment and working directory) and what it would inherit (the umask,
    and of `IGNORED` the signals the launcher ignores: an exec keeps them ignored and sets
    the others, which the launcher handles, back to their defaults); and the name of the
    mark it carries (`launch.reaper.forked_mark`; "" for none)."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    umask: int
    mark: str = ""
    ignored: tuple[int, ...] = ()


def _fork(
    request: tuple[tuple, list[int]],
    children: dict[int, socket.socket],
    inherited: tuple,
) -> None:
    message, fds = request
    status = socket.socket(fileno=fds[3])
    # Blocked across the fork: a signal sent to the child before it takes its defaults back
    # waits for them instead of meeting this server's SIG_IGN (which would drop it).
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, IGNORED)
    pid = os.fork()
    if pid == 0:
        for sock in children.values():
            sock.close()
        _become_worker(Request(*message), fds[:3], (*inherited, status), mask)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    for fd in fds[:3]:
        os.close(fd)
    children[pid] = status


def _reap(children: dict[int, socket.socket]) -> None:
    """Reaps every ended child: a worker's exit code goes to the launcher, on that worker's
    status socket; an orphan this server adopted (a worker's child) has no one to tell."""
    while True:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        status = children.pop(pid, None)
        if status is None:
            continue
        with contextlib.suppress(OSError):  # the launcher stopped listening: nothing to tell
            status.sendall(STATUS.pack(EXITED, os.waitstatus_to_exitcode(wait_status)))
        status.close()


def _end_descendants() -> None:
    """SIGKILLs this server's children until none is left: the workers (ended already unless
    the launcher was), and whatever they started that outlived them, which came back to this
    subreaper (a daemon in a session of its own, a forked child that closed its descriptors)."""
    import psutil

    while children := psutil.Process().children():
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()
        with contextlib.suppress(ChildProcessError):
            for _ in children:  # each one killed is reaped; its orphans come back to us
                os.waitpid(-1, 0)


def _become_worker(
    request: Request,
    streams: list[int],
    inherited: tuple,
    mask: set[signal.Signals],
) -> None:
    """The child's whole life: what `python ARGV` would have been, then os._exit."""
    code = 1
    try:
        _leave_server(streams, request.ignored, inherited, mask)
        module = _take(request)
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


def _leave_server(
    streams: list[int], ignored: tuple[int, ...], inherited: tuple, mask: set[signal.Signals]
) -> None:
    """A session of its own, the signals a worker takes, the server's descriptors closed and
    the standard streams it was sent; its pid said to the launcher."""
    os.setsid()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # As an exec from the launcher leaves them (whatever this server inherited as it was
    # forked: `nohup` ignores SIGHUP), then as Python sets SIGINT as it starts.
    for sig in IGNORED:
        signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
    if signal.SIGINT not in ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
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


def _take(request: Request) -> str:
    """Becomes the process `request` describes, as an interpreter started so would be;
    returns the module to run."""
    if request.mark:
        _carry_mark(request.mark)
    os.chdir(request.cwd)
    os.umask(request.umask)
    os.environ.clear()
    os.environ.update(request.env)
    _name_process(os.path.basename(sys.executable))
    _take_start_settings(request.env)
    module, args = _module_and_args(request.argv)
    sys.argv = [module, *args]
    if not sys.flags.safe_path:  # `python -m` puts its working directory first
        sys.path[0] = request.cwd
    return module


def _carry_mark(name: str) -> None:
    """Maps a page of memory named `name`, which every process forked from this one inherits
    and keeps (whatever session it moves to, whatever descriptors it closes) until it runs
    another program: how the launcher's reaper knows a fork as the run's, where its
    environment, as /proc shows it, is still the launcher's at its start."""
    global _mark
    try:  # where the kernel refuses (a sandbox), the server's end still ends them, unless killed
        descriptor = os.memfd_create(name, os.MFD_CLOEXEC)
    except OSError:
        return
    with contextlib.suppress(OSError):
        os.ftruncate(descriptor, mmap.PAGESIZE)
        _mark = mmap.mmap(descriptor, mmap.PAGESIZE)
    os.close(descriptor)


def _take_start_settings(env: dict[str, str]) -> None:
    """What a new interpreter would have read from `env` as it started, for a forked one:
    OpenMP's thread count (read as libgomp loads) and glibc's allocator settings (read at the
    first malloc). Values that are not numbers are left to the libraries, as they would be."""
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    settings = {name: env[name] for name in _MALLOC_SETTINGS if name in env}
    if settings and sys.platform == "linux":
        libc = ctypes.CDLL(None)
        for name, value in settings.items():
            if value.isdigit():
                libc.mallopt(_MALLOC_SETTINGS[name], int(value))


def _name_process(name: str) -> None:
    """Sets this process's name (`comm`, 15 bytes at most), as `ps -e` and `top` show it."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


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
    """Imports `names` quietly: a warning an import gives is the worker's to give, where it
    imports something itself. The warning filters the modules add as they are imported
    (sympy's, say) are kept, as a worker that imported them itself would have them."""
    before = list(warnings.filters)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quiet = warnings.filters[0]
        for name in names:
            with contextlib.suppress(Exception):
                importlib.import_module(name)
        added = [f for f in warnings.filters if f is not quiet and f not in before]
    for action, message, category, module, lineno in reversed(added):  # oldest first
        warnings.filterwarnings(
            action,
            message.pattern if message else "",
            category,
            module.pattern if module else "",
            lineno,
        )


def _libraries(control: socket.socket) -> tuple[str, ...] | None:
    """The recipe's libraries, the launcher's first message: a length, then a pickled tuple;
    None if the launcher closed the socket first (it ended, or its run forks no worker)."""
    head = control.recv(LENGTH.size, socket.MSG_WAITALL)
    if len(head) < LENGTH.size:
        return None
    size = LENGTH.unpack(head)[0]
    return pickle.loads(control.recv(size, socket.MSG_WAITALL)) if size else ()


def main() -> None:
    """The server started as a new interpreter: `python -m launcher.worker.fork_server`."""
    parser = argparse.ArgumentParser(prog="launcher.worker.fork_server")
    parser.add_argument("--fd", type=int, required=True, help="the control socket")
    parser.add_argument("--run-dir", help="the run it serves (shown in `ps`)")
    parser.add_argument("--parent", type=int, help="the launcher's pid, to die with it")
    args = parser.parse_args()
    _run(socket.socket(fileno=args.fd), args.parent)


def run_forked(control_fd: int, launcher_pid: int) -> None:
    """The server forked from the launcher (`launcher_pid`, read before the fork): the
    child's whole life, then os._exit."""
    try:
        _as_new_process(keep=control_fd)
        _run(socket.socket(fileno=control_fd), launcher_pid)
    finally:
        os._exit(0)


def _as_new_process(keep: int) -> None:
    """Makes this fresh fork of the launcher what `python -m` would have started, keeping the
    descriptor `keep`: a session of its own (Ctrl-C at the terminal is the launcher's and the
    workers'); /dev/null in place of every other descriptor (so that no pipe or socket of the
    launcher's is held open by it, and a Python object that still names one closes
    /dev/null, never a descriptor opened since); Python's own signal handlers, not the
    launcher's; the cyclic collector on (the launcher pauses it while it starts)."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in sorted(int(name) for name in os.listdir("/proc/self/fd")):
        if fd not in (keep, null):
            with contextlib.suppress(OSError):
                os.fstat(fd)  # the listing's own descriptor, closed since, is skipped
                os.dup2(null, fd, inheritable=fd <= 2)
    os.close(null)
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    gc.enable()


def _run(control: socket.socket, parent: int | None) -> None:
    """Imports what the workers import, says whether it can fork them, and serves. `parent`:
    the launcher, whose end (SIGKILL included) the kernel makes this server's at once, and so
    its workers' (their parent-death signal): EOF on the control socket would take this
    server a moment to see, in which they could go on (finish a checkpoint, say)."""
    if parent is not None:  # else its parent-death signal would follow an agent's thread
        from launcher.worker.main import die_with_parent

        die_with_parent(parent, code=0)
    if sys.platform == "linux":
        # What its workers leave behind comes back to it (on an end the launcher controls).
        ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    _name_process(NAME)
    # The launcher reads the answer once the imports are done: a request sent earlier would
    # wait for them anyway, but a server that cannot serve is then found at once.
    preload(PRELOAD)
    libraries = _libraries(control)
    if libraries is None:
        os._exit(0)
    preload(libraries)
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
