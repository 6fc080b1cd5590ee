"""RunDisplay: every rank's log lines, prefixed and coloured, above a live status table.

The launcher's main thread is busy in torch's elastic agent, so the display polls the
workers' files from a background thread. It only reads files, so it can never make a
worker wait, and it swallows its own errors, so it can never take the run down.
"""

import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType

from rich.console import Console, RenderableType
from rich.live import Live
from rich.text import Text

from launcher.launch.display.alerts import AlertDetector
from launcher.launch.display.coalesce import Coalescer
from launcher.launch.display.lines import format_line
from launcher.launch.display.status import TelemetryBoard
from launcher.launch.display.tail import MultiTail
from launcher.run_layout import RunLayout

POLL_S = 0.1
REFRESH_PER_SECOND = 4
# stop() waits this long for the poller; a poller stuck on a blocked console is abandoned.
JOIN_TIMEOUT_S = 5.0


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
        coalesce_window_s: float = 0.2,
    ) -> None:
        self._layout = RunLayout(Path(run_dir))
        self._ranks = list(dict.fromkeys(ranks))
        self._show = show
        self._console = console if console is not None else Console(stderr=False)
        self._title = title
        self._status = ""
        self._alerts = AlertDetector()
        shown = [rank for rank in self._ranks if show is None or rank in show]
        self._coalescer = Coalescer(coalesce_window_s, expected=shown)
        self._board = TelemetryBoard(self._ranks)
        # Guards the board and status: the Live refresh thread reads them while we write.
        self._state_lock = threading.Lock()
        self._lifecycle_lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._live: Live | None = None
        self._logs: MultiTail[int] | None = None
        self._telemetry: MultiTail[int] | None = None
        self._started = self._stopped = self._error_reported = False

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
            if self._console.is_terminal and not self._console.is_dumb_terminal:
                self._guarded(self._start_live)
            self._thread = threading.Thread(target=self._poll_loop, name="run-display", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Print every remaining line, including a final partial one, then stop. Idempotent."""
        with self._lifecycle_lock:
            if not self._started or self._stopped:
                return
            self._stopped = True
            self._stopping.set()
            assert self._thread is not None
            self._thread.join(JOIN_TIMEOUT_S)
            if not self._thread.is_alive():
                self._guarded(self._drain)
            if self._live is not None:
                self._guarded(self._live.stop)
            for tail in (self._logs, self._telemetry):
                if tail is not None:
                    self._guarded(tail.close)

    def set_status(self, text: str) -> None:
        """One line shown above the table in the live region, e.g. ``attempt 2/3``."""
        with self._state_lock:
            self._status = text

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
        while not self._stopping.wait(POLL_S):
            self._guarded(self._tick)

    def _tick(self) -> None:
        assert self._logs is not None and self._telemetry is not None
        now = time.monotonic()
        self._accept(self._logs.poll(), now)
        self._print(self._coalescer.ready(now))
        self._apply_telemetry(self._telemetry.poll())

    def _drain(self) -> None:
        assert self._logs is not None and self._telemetry is not None
        self._accept(self._logs.flush(), time.monotonic())
        self._print(self._coalescer.flush())
        self._apply_telemetry(self._telemetry.flush())

    def _accept(self, lines: Iterable[tuple[int, str]], now: float) -> None:
        for rank, text in lines:
            # Every line goes through the detector, shown or not, to track tracebacks.
            alert = self._alerts.is_alert(rank, text)
            if alert or self._show is None or rank in self._show:
                self._coalescer.add(rank, text, now)

    def _print(self, groups: list[tuple[frozenset[int], str]]) -> None:
        if not groups:
            return
        # One print per batch: with a live region, every print redraws the table.
        batch = Text("\n").join(format_line(sorted(ranks), text) for ranks, text in groups)
        self._console.print(batch, soft_wrap=True, highlight=False, markup=False, emoji=False)

    def _apply_telemetry(self, lines: Iterable[tuple[int, str]]) -> None:
        with self._state_lock:
            for rank, line in lines:
                self._board.update(rank, line)

    def _render_status(self) -> RenderableType:
        # Called from Live's own refresh thread, which must not die either.
        try:
            with self._state_lock:
                return self._board.render(self._title, self._status)
        except Exception as exc:
            return Text(f"status unavailable: {exc!r}")

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
