"""How a rank's DataLoader workers start (`data.worker_start`), and what they are sent.

Why not fork. A forked child of a process with threads inherits every lock as it was at the
fork, held by threads that do not exist in the child. On CPython before 3.10.15 and 3.11.10
(gh-112275) a loader worker could hang for good as it started, when a C++ thread of the
training process (gloo's, freeing a collective's tensors) held the interpreter's thread-list
lock at the fork: 2 of 3 fsdp runs of configs/varlen.yaml with 2 workers hung on CPython
3.11.7. Every rank has threads (gloo's, the metrics sinks', the SIGTERM taker), POSIX allows a
forked child of such a process only async-signal-safe calls, CPython 3.12 warns at such a fork,
and 3.14 starts multiprocessing's children by forkserver on Linux. So `auto` is `forkserver`
everywhere: a server process, started by fork and exec at once (no Python runs in between),
with one thread, forks the workers. `spawn` starts each worker as a new interpreter.

What a worker gets. One started by forkserver or spawn is sent its process object pickled:
the dataset, the collate and the loader's seeds. Before unpickling them it imports the recipe
files its training process imported, under the same names (`recipe.import_recipe_file`), so
classes and functions defined in a recipe file load there. Tensors are copied into the
pickle rather than shared by file descriptor as torch does: a dataset of thousands of small
tensors (configs/varlen.yaml's) needs one descriptor each, beyond the ~250 a fork server can
be sent. A dataset or collate that cannot be pickled is refused before the first worker
starts (`check_sendable`). The fork server imports torch once, so a worker, started again at
every epoch and evaluation, costs the pickling of what it is sent, not an import of torch.

A worker started so takes SIGTERM as a forked one does (`launcher.worker.sigterm`), and ends
when its training process ends: its parent is the fork server, not that process, so torch's
own check (its parent changed) would never see it go.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import select
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.context import (
    BaseContext,
    ForkServerContext,
    ForkServerProcess,
    SpawnContext,
    SpawnProcess,
)
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch.utils.data  # the fork server preloads this module: torch with it

from launcher.config.spec import DataSection
from launcher.errors import UsageError
from launcher.worker.recipe import import_recipe_file, recipe_files
from launcher.worker.sigterm import loader_worker_rule, take_in_loader_worker


def start_method(requested: str, available: Sequence[str] | None = None) -> str:
    """The multiprocessing start method of `data.worker_start: requested` on a platform
    whose methods are `available` (this one's by default)."""
    methods = multiprocessing.get_all_start_methods() if available is None else available
    if requested == "auto":
        return "forkserver" if "forkserver" in methods else "spawn"
    if requested not in methods:
        raise UsageError(
            f"data.worker_start: {requested} is not a start method of this platform "
            f"(it has {', '.join(methods)}); use data.worker_start: auto"
        )
    return requested


# The first CPython release of each line without gh-112275 (3.12 never had it).
_FORK_HANG_FIXED_IN = {(3, 9): (3, 9, 20), (3, 10): (3, 10, 15), (3, 11): (3, 11, 10)}


def fork_may_hang(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> bool:
    """Whether this CPython can leave a forked child hung for good as it starts (gh-112275):
    the child waits on the lock of the interpreter's thread list when another thread held it
    at the fork, which C++ threads take, without the GIL, whenever they enter Python."""
    fixed_in = _FORK_HANG_FIXED_IN.get(tuple(version[:2]))
    return sys.implementation.name == "cpython" and fixed_in is not None and version < fixed_in


def warn_of_fork_hang(
    data: DataSection, version: tuple[int, ...] = tuple(sys.version_info[:3])
) -> None:
    """Says so once (on rank 0) when a run asks for forked loader workers on such a CPython:
    the hang is rare, and stops the run on launch.stall_timeout with nothing else to say why."""
    if data.num_workers and data.worker_start == "fork" and fork_may_hang(version):
        python = ".".join(str(part) for part in version[:3])
        print(
            # Not "DataLoader worker": that is how torch says one died, and tests look for it.
            f"WARNING: data.worker_start: fork: Python {python} can leave a forked loader "
            "process hung as it starts (CPython bug gh-112275, fixed in 3.10.15 and 3.11.10); "
            "the run then stops on launch.stall_timeout. data.worker_start: auto cannot hang so",
            file=sys.stderr,
            flush=True,
        )


def worker_options(data: DataSection, sent: dict[str, Any]) -> dict[str, Any]:
    """The DataLoader arguments that start `data.num_workers` workers as `data.worker_start`
    says. `sent`: what the workers are sent, by what to call it in an error ("the train
    dataset"), checked here when it must be pickled."""
    method = checked_start(data, sent)
    if method is None:
        return {}
    if method == "fork":  # asked for by name: Python 3.14's default would be forkserver
        return {"multiprocessing_context": multiprocessing.get_context("fork")}
    return {
        "multiprocessing_context": _context(method),
        "worker_init_fn": WorkerSetup(os.getpid(), loader_worker_rule()),
    }


def checked_start(data: DataSection, sent: dict[str, Any]) -> str | None:
    """The start method of `data.num_workers` loader workers (None where there are none),
    once what they are `sent` is known to reach them: pickled, unless they are forked."""
    if not data.num_workers:
        return None
    method = start_method(data.worker_start)
    if method != "fork":
        for what, value in sent.items():
            check_sendable(value, what, method)
    return method


def check_sendable(value: Any, what: str, method: str) -> None:
    """Pickles `value` as a worker's start will (into nothing, its tensors left out): a
    UsageError naming the keys and the ways out where it cannot be."""
    try:
        _CheckPickler(_Discard(), pickle.HIGHEST_PROTOCOL).dump(value)
    except Exception as exc:
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise UsageError(
            f"data.worker_start: {what} ({type(value).__name__}) cannot be pickled for loader "
            f"workers started by {method} ({reason}); make it picklable (classes and "
            "functions at the top level of the recipe, files opened in __getitem__), or set "
            "data.worker_start: fork or data.num_workers: 0"
        ) from None


@dataclass(frozen=True)
class WorkerSetup:
    """The first call of a worker started by forkserver or spawn (DataLoader's
    `worker_init_fn`, after torch seeded it): it takes SIGTERM as its training process does,
    and ends with that process."""

    training_pid: int
    sigterm_rule: tuple[Path, int] | None  # (run folder, launcher pid): `sigterm`'s

    def __call__(self, worker_id: int) -> None:
        if self.sigterm_rule is not None:
            take_in_loader_worker(*self.sigterm_rule, self.training_pid)
        _end_with(self.training_pid)


def _end_with(pid: int) -> None:
    """Ends this process when process `pid` ends (a pidfd: no pid reuse can fool it)."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):  # no pidfd (macOS, Linux before 5.3): the reaper's job
        return

    def wait() -> None:
        select.select([handle], [], [])
        os._exit(1)

    threading.Thread(target=wait, name="training-process-watch", daemon=True).start()


class _SendsRecipes:
    """A worker process object that its new interpreter unpickles after importing the
    recipe files, with the tensors it holds copied (`_ByValuePickler`)."""

    def __reduce__(self) -> tuple[Any, ...]:
        state = _pickled_by_value(self.__dict__)
        return (_process_in_worker, (type(self), recipe_files(), state))


def _process_in_worker(cls: type, files: list[tuple[str, str]], state: bytes) -> Any:
    for name, path in files:
        import_recipe_file(name, path)
    process = cls.__new__(cls)
    process.__dict__.update(pickle.loads(state))
    return process


class _ForkServerProcess(_SendsRecipes, ForkServerProcess):
    pass


class _SpawnProcess(_SendsRecipes, SpawnProcess):
    pass


class _ForkServerContext(ForkServerContext):
    Process = _ForkServerProcess  # type: ignore[assignment]


class _SpawnContext(SpawnContext):
    Process = _SpawnProcess  # type: ignore[assignment]


def _context(method: str) -> BaseContext:
    _start_resource_tracker()
    if method == "spawn":
        return _SpawnContext()
    context = _ForkServerContext()
    # Imported once in the server rather than in every worker (torch takes seconds); must be
    # set before the server starts, the first time a loader starts its workers.
    context.set_forkserver_preload([__name__])
    return context


def _start_resource_tracker() -> None:
    """Starts multiprocessing's resource tracker (workers started without fork need it), and
    keeps this thread's signal mask: CPython before 3.12.9 and 3.13.2 (gh-127586) unblocks
    SIGTERM in the thread that starts it, which would let SIGTERM end this process instead
    of being taken by `launcher.worker.sigterm`, and be unblocked in the fork server and
    every worker it starts."""
    from multiprocessing import resource_tracker

    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


class _ByValuePickler(ForkingPickler):
    """multiprocessing's pickler (pipes, locks and sockets are sent as it sends them) without
    torch's reducers, which would share each tensor through a file descriptor of its own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dispatch_table = {
            kind: reduce
            for kind, reduce in self.dispatch_table.items()
            if getattr(reduce, "__module__", "") != "torch.multiprocessing.reductions"
        }


class _CheckPickler(_ByValuePickler):
    """`_ByValuePickler` with every tensor and storage pickled as its class alone: pickling
    a storage by value copies it into memory (torch.save into bytes), which for a dataset
    held in memory would double a rank's memory only to learn that a tensor pickles, as
    every tensor does. Its class is still pickled: one defined in a function cannot be."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            return (_stand_in, (type(obj),))
        return NotImplemented


def _stand_in(cls: type) -> None:
    """What `_CheckPickler` pickles in a tensor's place: never called, the pickle unread."""


def _pickled_by_value(value: Any) -> bytes:
    buffer = io.BytesIO()
    _ByValuePickler(buffer, pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


class _Discard(io.RawIOBase):
    """A sink that keeps nothing, only the count of bytes written to it (for tests)."""

    def __init__(self) -> None:
        super().__init__()
        self.written = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        self.written += size
        return size
