"""What the launcher says when a run ends badly: the root-cause panel (the rank that failed
first by itself, `root_cause`; where, how in plain words, its traceback and the last lines of
its log), a hang, and a rendezvous that failed. Built from what the failed worker left on disk, so it works for any
failure, a Python exception or a SIGKILL from the kernel, with nothing to decorate."""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import socket
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.text import Text
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from launcher.errors import RunError, UsageError
from launcher.launch import rendezvous
from launcher.launch.display.lines import format_ranks
from launcher.launch.plan import LaunchPlan
from launcher.launch.watchdog import Stall, describe
from launcher.rundir.disk import disk_bytes, megabytes
from launcher.rundir.layout import CheckpointFiles, RunLayout
from launcher.rundir.reading import read_json_or_none, read_log_tail
from launcher.safe_text import clean

_SIGNALS = {
    signal.SIGKILL: "killed (SIGKILL): most often the kernel's out-of-memory killer; "
    "see `dmesg` or your scheduler's memory report",
    signal.SIGSEGV: "segmentation fault (SIGSEGV): a crash in native code (an extension, "
    "a driver, or a tensor used after its memory was freed)",
    signal.SIGABRT: "aborted (SIGABRT): native code gave up, usually on a failed check",
    signal.SIGBUS: "bus error (SIGBUS): often shared memory (/dev/shm) ran out",
    signal.SIGFPE: "floating-point exception (SIGFPE): e.g. an integer division by zero",
    signal.SIGILL: "illegal instruction (SIGILL): a binary built for another CPU",
    signal.SIGTERM: "terminated (SIGTERM) from outside",
    signal.SIGINT: "interrupted (SIGINT)",
    signal.SIGHUP: "hung up (SIGHUP): its terminal or session went away",
    signal.SIGPIPE: "broken pipe (SIGPIPE)",
    signal.SIGXFSZ: "file size limit exceeded (SIGXFSZ): a file outgrew `ulimit -f`",
}
_CODES = {
    1: "exited with an error (exit code 1)",
    2: "stopped on bad input (exit code 2)",
}
_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):$", re.MULTILINE)
_ERROR = re.compile(r"^error: ", re.MULTILINE)
# torch's ExceptionWrapper: a DataLoader worker's traceback, inside the message it raises.
_ORIGINAL = "Original Traceback (most recent call last):"
# Below this, the run folder's disk is called full (a failed write leaves a few KB at most).
_FULL_BELOW_BYTES = 16 * 2**20


def describe_exit(code: int) -> str:
    """An exit code as the elastic agent reports it (negative: killed by that signal)."""
    if code < 0 or code > 128:
        number = -code if code < 0 else code - 128
        try:
            sig = signal.Signals(number)
        except ValueError:
            return f"killed by signal {number}"
        return _SIGNALS.get(sig, f"killed by {sig.name}")
    return _CODES.get(code, f"exited with code {code}")


def last_traceback(log: str) -> str | None:
    """The last Python traceback in a log, through its exception line(s). An exception a
    DataLoader worker raised comes with its own traceback ("Original Traceback"), which holds
    the recipe's frame and message: it is kept too."""
    starts = list(_TRACEBACK.finditer(log))
    if not starts:
        return None
    lines = log[starts[-1].start() :].splitlines()
    in_original = False
    for i, line in enumerate(lines[1:], start=1):
        if line.startswith(_ORIGINAL):
            in_original = True
        elif line and not line[0].isspace():  # an exception line ends a traceback
            following = lines[i + 1] if i + 1 < len(lines) else ""
            if in_original or not following.startswith(_ORIGINAL):
                return "\n".join(lines[: i + 1])
    return "\n".join(lines)


# What a rank says when a peer on another node is gone (gloo, NCCL, the TCP store).
_PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited"
    r"|NCCL communicator was aborted|failed to recv, got 0 bytes"
)


def peer_lost(log_file: Path) -> bool:
    """Whether a rank failed because a peer went away, not by itself."""
    detail = last_traceback(read_log_tail(log_file)) or ""
    return bool(_PEER_LOST.search(detail))


def last_words(log: str, max_error_lines: int = 8) -> str | None:
    """What a rank said last about its failure: its last Python traceback, or the error a
    worker printed after it (`error: ...`, then its details and hint, the log's last lines)."""
    errors, tracebacks = list(_ERROR.finditer(log)), list(_TRACEBACK.finditer(log))
    if not errors or (tracebacks and tracebacks[-1].start() > errors[-1].start()):
        return last_traceback(log)
    lines = log[errors[-1].start() :].rstrip("\n").splitlines()
    # Anything printed after the error (another thread's output) leaves its first line only.
    return "\n".join(lines if len(lines) <= max_error_lines else lines[:1])


def failure_panel(
    rank: int, host: str, code: int, log_file: Path, tail: int = 12, max_traceback: int = 16
) -> Panel:
    log = clean(read_log_tail(log_file))  # a rank's words, as on the live display
    parts: list[Text] = [
        Text.assemble(("how: ", "bold"), describe_exit(code)),
        Text.assemble(("log: ", "bold"), clean(str(log_file))),
    ]
    detail = last_words(log)
    if detail and detail.count("\n") > max_traceback:  # the innermost frames say the most
        detail = "  ...\n" + "\n".join(detail.splitlines()[-max_traceback:])
    if detail:
        parts += [Text(""), Text(detail, style="red")]
    lines = [line for line in log.splitlines() if line.strip()]
    # Bad input (exit 2) is said in full by its error line; other failures get the context.
    shown = [] if code == 2 else [line for line in lines[-tail:] if line not in (detail or "")]
    if shown:
        parts += [Text(""), Text(f"last lines of rank {rank}'s log:", style="bold")]
        parts += [Text(line, style="dim") for line in shown]
    return Panel(
        Group(*parts),
        title=Text(f"rank {rank} failed on {host}", style="bold red"),
        title_align="left",
        border_style="red",
        expand=False,
    )


def report_failure(exc: ChildFailedError, plan: LaunchPlan, console: Console) -> int:
    rank, failure = root_cause(exc.failures, plan.run_dir)
    code = failure.exitcode
    log = plan.layout.log(rank)
    if plan.nodes.multi and peer_lost(log):
        console.print(
            Text("lost another node: ", style="bold red")
            + Text(
                f"rank {rank} on this node lost its connection to ranks on another node. The "
                "cause is most likely there: see that node's output (on shared storage, its "
                f"ranks' logs are in {plan.layout.logs})."
            ),
            soft_wrap=True,
        )
    console.print(failure_panel(rank, socket.gethostname(), code, log))
    others = sorted(set(exc.failures) - {rank})
    failed = [r for r in others if exc.failures[r].exitcode > 0]
    stopped = [r for r in others if r not in failed]
    also = "; ".join(
        f"{label}: ranks {format_ranks(ranks)}"
        for label, ranks in (("also failed", failed), ("stopped because of it", stopped))
        if ranks
    )
    if also:
        console.print(also, highlight=False)
    if plan.spec.launch.max_restarts:
        console.print(f"gave up after {plan.spec.launch.max_restarts} restart(s)")
    for note in storage_notes(plan.layout):
        console.print(Text("note: ", style="bold yellow") + Text(note), soft_wrap=True)
    # A worker's own usage error (exit 2) is still the user's input to fix.
    return code if code in (1, 2) else (128 - code if code < 0 else 1)


def storage_notes(layout: RunLayout) -> list[str]:
    """What a failure left on the run folder's file system, said whether or not a rank could
    say it (on a full disk its log may end mid-line): saves cut short, and a full disk."""
    notes = []
    with contextlib.suppress(OSError):  # another node may be removing them right now
        for path in sorted(layout.checkpoints.iterdir()):
            files = CheckpointFiles(path)
            if path.is_dir() and files.looks_interrupted and not files.is_complete:
                notes.append(
                    f"a save that did not finish left {path} ({megabytes(disk_bytes(path))}); it "
                    "is never resumed from: delete it to free the space"
                )
    free = None
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(layout.root).free
    if free is not None and free < _FULL_BELOW_BYTES:
        notes.append(
            f"the disk holding {layout.root} is full ({megabytes(free)} free): free space, "
            "or keep fewer checkpoints (checkpoint.keep_last)"
        )
    return notes


def explain_rendezvous_error(error: BaseException, plan: LaunchPlan) -> None:
    """Rendezvous failures in the words of the flags that set them up."""
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    nodes = plan.nodes
    if isinstance(error, rendezvous.NodeMismatch):
        raise UsageError(f"the nodes of job {nodes.job_id} do not match: {error}") from error
    if isinstance(error, RendezvousTimeoutError) and nodes.multi:
        raise RunError(
            f"gave up waiting for {nodes.min} nodes at {nodes.endpoint} (job {nodes.job_id})",
            hint="Start the missing nodes with the same command (after a failure, with "
            "--resume latest), or check that they reach the endpoint.",
        ) from error
    if isinstance(error, RendezvousConnectionError) and nodes.multi:
        hosting = nodes.node_rank == 0
        raise RunError(
            f"--rdzv-endpoint {nodes.endpoint}: "
            + ("node 0 cannot host the rendezvous there" if hosting else "cannot reach it")
            + f" ({error.__cause__ or error})",
            hint="Choose a port that is free on node 0, the same on every node."
            if hosting
            else "Start node 0 (--node-rank 0) on that host, and check that the port is open "
            "between the nodes.",
        ) from error


def report_stall(
    stalls: list[Stall], plan: LaunchPlan, console: Console, after_stop: str | None = None
) -> int:
    """A hang: caught by the stall timeout, or at a stop (`after_stop`: the signal) that no
    rank could honour, as none finished its step."""
    timeout = plan.spec.launch.stall_timeout
    said = (
        f"stopped at once: after {after_stop}, the ranks did not finish their step (hung); "
        "nothing was saved"
        if after_stop
        else f"stopped: no progress for {timeout:g} s (launch.stall_timeout)"
    )
    console.print(Text(said, style="bold red"))
    for stall in sorted(stalls, key=lambda s: s.rank):
        console.print(describe(stall), highlight=False, soft_wrap=True)
    console.print(
        f"Every stalled rank's Python stack is in its log ({plan.layout.logs}).",
        highlight=False,
        soft_wrap=True,
    )
    return 1


# -- which rank failed first, by itself: the one the report is about ------------------------


def root_cause(failures: dict[int, Any], run_dir: Path | None = None) -> tuple[int, Any]:
    """The rank that failed first by itself, not one that failed or was stopped because of it.

    A rank killed by a signal from outside (SIGKILL by the OOM killer, SIGSEGV) comes first:
    its peers only see their connections drop. Then ranks that raised, by the time each one
    recorded, or for a rank that died before it could record (os._exit, a full disk), by its
    log's last write; ranks the agent stopped, last.
    """
    failed_at = failure_times(run_dir) if run_dir else {}
    # Only this attempt's records: an earlier attempt's rank had another pid.
    failed_at = {
        r: t for r, (t, pid) in failed_at.items() if r in failures and failures[r].pid == pid
    }

    def order(item: tuple[int, Any]) -> tuple[int, float, int]:
        rank, failure = item
        code = failure.exitcode
        if code < 0 and code != -signal.SIGTERM:
            kind = 0
        elif code > 0:
            kind = 1
        else:
            kind = 2
        return kind, failed_at.get(rank) or _died_at(run_dir, rank, failure), rank

    return min(failures.items(), key=order)


def _died_at(run_dir: Path | None, rank: int, failure: Any) -> float:
    """When a rank that left no failure record failed: its log's last write, which is right
    before it ended. The agent's own timestamp is a whole second (rounded down), so it would
    come before the precise records of the peers that failed because of this rank."""
    seen = float(failure.timestamp)
    if run_dir is not None:
        with contextlib.suppress(OSError):
            return min(seen + 1, RunLayout(run_dir).log(rank).stat().st_mtime)
    return seen


def failure_times(run_dir: Path) -> dict[int, tuple[float, int]]:
    """{rank: (when it failed, its pid)} from the records failed workers left."""
    times: dict[int, tuple[float, int]] = {}
    for path in RunLayout(run_dir).failures():
        record = read_json_or_none(path, "record")
        with contextlib.suppress(ValueError, KeyError, TypeError, OverflowError):
            times[int(record["rank"])] = (float(record["failed_at"]), int(record["pid"]))
    return times
