"""RunDisplay: every rank's log lines, prefixed and coloured, above a live status table.

The display polls the workers' log files from a background thread. It only reads files, so
it can never make a worker wait, and it swallows its own errors, so it can never take the
run down. Lines are read and written in large chunks: ordinary logging goes line by line
(identical lines of several ranks fold into one), a flood goes through as whole blocks.
When the run ends, `stop` shows every line to the end of every log, within a bounded wait.
"""

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType

from rich.console import Console, RenderableType
from rich.live import Live
from rich.text import Text

from launcher.launch.closed_output import LauncherConsole
from launcher.launch.display.alerts import AlertDetector, may_hold_alerts
from launcher.launch.display.coalesce import WINDOW_S, Coalescer
from launcher.launch.display.sinks import PlainSink, TerminalSink
from launcher.launch.display.status import TelemetryBoard
from launcher.launch.display.tail import FileTail, MultiTail, decode_line, split_lines
from launcher.rundir.layout import RunLayout
from launcher.safe_text import decode

POLL_S = 0.1
REFRESH_PER_SECOND = 4
# stop() waits this long for the last lines to be shown; then it says how many were not
# (a console that blocks, or a backlog too large) and where they are.
DRAIN_TIMEOUT_S = 5.0
# A poll with more lines than this, over all ranks, is a flood: it goes through in blocks per
# rank, without waiting for other ranks' copies of each line.
LINE_BY_LINE_MAX = 2000
# Shown after a last line that never got its newline (a rank killed mid-print).
NO_NEWLINE = " [no newline]"


class RunDisplay:
    """Shows the logs of ``ranks`` (global ranks this node follows) while a run is going.

    ``show`` is the ``--ranks`` filter (None shows all): other ranks' lines are hidden
    unless they are alerts (warnings, errors, tracebacks). Start it before the workers
    start: whatever the files already hold at start() (an earlier run's output) is skipped.
    """

    def __init__(
        self,
        run_dir: Path,
        ranks: Sequence[int],
        show: frozenset[int] | None = None,
        console: Console | None = None,
        title: str = "",
        *,
        coalesce_window_s: float = WINDOW_S,
    ) -> None:
        self._layout = RunLayout(Path(run_dir))
        self._ranks = list(dict.fromkeys(ranks))
        self._show = show
        self._console = console if console is not None else LauncherConsole()
        self._terminal = self._console.is_terminal and not self._console.is_dumb_terminal
        self._sink: PlainSink | TerminalSink = (
            TerminalSink(self._console, lambda rank: str(self._layout.log(rank)))
            if self._terminal
            else PlainSink(self._console)
        )
        self._title = title
        self._alerts = AlertDetector()
        shown = [rank for rank in self._ranks if show is None or rank in show]
        self._coalescer = Coalescer(coalesce_window_s, expected=shown)
        self._board = TelemetryBoard(self._ranks)
        # Guards the board and status: the Live refresh thread reads them while we write.
        self._state_lock = threading.Lock()
        self._lifecycle_lock = threading.Lock()
        self._stopping = threading.Event()
        self._give_up = threading.Event()  # the drain ran out of time: write nothing more
        self._thread: threading.Thread | None = None
        self._live: Live | None = None
        self._logs: MultiTail[int] | None = None
        self._telemetry: MultiTail[int] | None = None
        self._started = self._stopped = self._error_reported = False
        # Lines of each rank the display is done with (shown, or hidden by --ranks).
        self._handled = dict.fromkeys(self._ranks, 0)

    def start(self) -> None:
        """Start following the files (and the live region, on a terminal)."""
        with self._lifecycle_lock:
            if self._started:
                return
            self._started = True
            self._logs = MultiTail(
                {rank: self._layout.log(rank) for rank in self._ranks}, from_end=True
            )
            self._telemetry = MultiTail(
                {rank: self._layout.telemetry(rank) for rank in self._ranks},
                from_end=True,
            )
            if self._terminal:
                self._guarded(self._start_live)
            self._thread = threading.Thread(target=self._poll_loop, name="run-display", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Show every remaining line, to the end of every log (a last line without its
        newline too), then stop; after DRAIN_TIMEOUT_S, say what was not shown. Idempotent."""
        with self._lifecycle_lock:
            if not self._started or self._stopped:
                return
            self._stopped = True
            self._stopping.set()
            assert self._thread is not None and self._logs is not None
            self._thread.join(DRAIN_TIMEOUT_S)
            stuck = self._thread.is_alive()
            if stuck:  # blocked writing, or too far behind: it writes nothing more
                self._give_up.set()
                self._thread.join(0.5)
            self._report_unshown(self._logs.unshown(self._handled))
            # A thread stuck writing holds the console: restoring the terminal would block.
            if self._live is not None and not self._thread.is_alive():
                self._guarded(self._live.stop)
            for tail in (self._logs, self._telemetry):
                if tail is not None:
                    self._guarded(tail.close)

    def __enter__(self) -> "RunDisplay":
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _start_live(self) -> None:
        self._live = Live(
            console=self._console,
            get_renderable=self._render_status,
            refresh_per_second=REFRESH_PER_SECOND,
        )
        self._live.start()

    def _poll_loop(self) -> None:
        assert self._logs is not None
        # No wait while a file had more than one read takes: a flood is read back to back.
        while not self._stopping.wait(0 if self._logs.behind else POLL_S):
            self._guarded(self._tick)
        self._guarded(self._drain)

    def _tick(self) -> None:
        assert self._logs is not None and self._telemetry is not None
        now = time.monotonic()
        self._show_chunks(self._logs.poll_chunks(), now)
        self._write(self._coalescer.ready(now))
        self._sink.flush()  # lines reach a pipe or CI log now, not when a buffer fills
        self._apply_telemetry(self._telemetry.poll())

    def _drain(self) -> None:
        """To the end of every log: the workers are gone, nothing more will come."""
        assert self._logs is not None and self._telemetry is not None
        while not self._give_up.is_set() and (chunks := self._logs.poll_chunks()):
            self._guarded(lambda chunks=chunks: self._show_chunks(chunks, time.monotonic()))
        if self._give_up.is_set():
            return
        for rank, tail in self._logs.tails.items():
            self._guarded(lambda rank=rank, tail=tail: self._finish(rank, tail))
        self._guarded(lambda: self._write(self._coalescer.flush()))
        self._guarded(self._sink.flush)
        self._apply_telemetry(self._telemetry.flush())

    def _finish(self, rank: int, tail: FileTail) -> None:
        """A rank's last lines, and a last line it never ended, marked as such."""
        chunk, partial = tail.flush_chunk()
        self._show_chunks({rank: chunk} if chunk else {}, time.monotonic())
        if partial:
            self._accept(rank, decode_line(partial) + NO_NEWLINE, time.monotonic())

    def _show_chunks(self, chunks: dict[int, bytes], now: float) -> None:
        """Ordinary logging line by line, through the coalescer; a flood in blocks."""
        if sum(chunk.count(b"\n") for chunk in chunks.values()) <= LINE_BY_LINE_MAX:
            for rank, chunk in chunks.items():
                for text in split_lines(chunk):
                    self._accept(rank, text, now)
            return
        # Whatever waits for other ranks' copies goes first: each rank's lines keep order.
        self._write(self._coalescer.flush())
        for rank, chunk in chunks.items():
            if self._give_up.is_set():
                return
            if self._shown(rank):
                self._sink.block(rank, chunk)
                self._handled[rank] += chunk.count(b"\n")
            elif self._alerts.in_block(rank) or may_hold_alerts(decode(chunk)):
                for line in split_lines(chunk):
                    self._accept(rank, line, now)
            else:  # a hidden rank's lines, none of them an alert
                self._handled[rank] += chunk.count(b"\n")

    def _accept(self, rank: int, text: str, now: float) -> None:
        # A hidden rank's lines go through the detector, which follows its tracebacks.
        if self._shown(rank) or self._alerts.is_alert(rank, text):
            self._coalescer.add(rank, text, now)
        else:
            self._handled[rank] += 1

    def _write(self, groups: list[tuple[frozenset[int], str]]) -> None:
        if self._give_up.is_set():
            return
        self._sink.lines(groups)
        for ranks, _ in groups:
            for rank in ranks:
                self._handled[rank] += 1

    def _shown(self, rank: int) -> bool:
        return self._show is None or rank in self._show

    def _apply_telemetry(self, lines: Iterable[tuple[int, str]]) -> None:
        with self._state_lock:
            for rank, line in lines:
                self._board.update(rank, line)

    def _render_status(self) -> RenderableType:
        # Called from Live's own refresh thread, which must not die either.
        try:
            with self._state_lock:
                return self._board.render(self._title)
        except Exception as exc:
            return Text(f"status unavailable: {exc!r}")

    def _report_unshown(self, unshown: dict[int, int]) -> None:
        if not unshown:
            return
        ranks = ", ".join(f"{n:,} of rank {rank}" for rank, n in sorted(unshown.items()))
        message = (
            f"launcher: {sum(unshown.values()):,} lines were not shown ({ranks}); "
            f"every line is in {self._layout.logs}\n"
        )
        # Not through the console: it may be what blocked.
        with contextlib.suppress(Exception):
            sys.__stderr__.write(message)
            sys.__stderr__.flush()

    def _guarded(self, action: Callable[[], object]) -> None:
        try:
            action()
        except Exception as exc:
            self._report_once(exc)

    def _report_once(self, exc: Exception) -> None:
        if self._error_reported:
            return
        self._error_reported = True
        message = f"launcher display error (the run continues): {exc!r}"
        try:
            self._console.print(Text(message, style="red"), soft_wrap=True)
        except Exception:
            print(message, file=sys.__stderr__)
