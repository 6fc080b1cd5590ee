"""Where the display's lines go: plain text in large batches when stdout is a file, a pipe or
CI, or rich text above the live table on a terminal, which folds bursts it cannot show."""

import contextlib
from collections.abc import Callable, Collection, Iterable, Iterator

from rich.console import Console
from rich.text import Text

from launcher.launch.closed_output import reader_gone, stop_writing
from launcher.launch.display.alerts import AlertDetector, may_hold_alerts
from launcher.launch.display.lines import format_line, prefix
from launcher.safe_text import clean, clean_chunk

Group = tuple[Collection[int], str]  # the ranks that printed a line, and the line
# A terminal shows at most this many lines of one burst, the first and the last; the rest is
# folded into one line that says how many and where they are. Alerts are never folded away,
# up to this many per burst.
FOLD_HEAD, FOLD_TAIL, FOLD_ALERTS = 20, 20, 200


class PlainSink:
    """Plain prefixed lines, written as one string per batch: no colours, no live table."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def lines(self, groups: Iterable[Group]) -> None:
        text = "".join(f"{prefix(sorted(ranks))} {clean(line)}\n" for ranks, line in groups)
        if text:
            self._write(text)

    def block(self, rank: int, chunk: bytes) -> None:
        """`chunk`: complete lines of one rank, each ending in a newline."""
        head = prefix((rank,)) + " "
        self._write(head + clean_chunk(chunk)[:-1].replace("\n", "\n" + head) + "\n")

    def _write(self, text: str) -> None:
        # Under the console's own lock, the one rich writes under: a line the launcher
        # prints meanwhile (from another thread) comes between blocks, never inside one.
        # A text file's write is not atomic across threads: it fills its buffer in parts.
        with self.console._lock, quiet_if_reader_gone(self.console):
            if not self.console.quiet:
                self.console.file.write(text)

    def flush(self) -> None:
        with self.console._lock, quiet_if_reader_gone(self.console):
            self.console.file.flush()


class TerminalSink:
    """Coloured lines printed above the live table; a burst of more lines than a terminal
    can take is folded (`... 12,345 more lines (see logs/rank-1.log)`), never queued. Each
    rank's tracebacks are followed across lines and bursts, so no part of one is folded."""

    def __init__(self, console: Console, log_of: Callable[[int], str]) -> None:
        self.console = console
        self.log_of = log_of
        self._detector = AlertDetector()

    def lines(self, groups: Iterable[Group]) -> None:
        groups = list(groups)
        for ranks, line in groups:
            for rank in ranks:
                self._detector.is_alert(rank, line)
        self._print(groups)

    def block(self, rank: int, chunk: bytes) -> None:
        lines = clean_chunk(chunk, keep_sgr=True).split("\n")[:-1]
        if len(lines) <= FOLD_HEAD + FOLD_TAIL + 1:
            self.lines(((rank,), line) for line in lines)
            return
        middle = lines[FOLD_HEAD:-FOLD_TAIL]
        self.lines(((rank,), line) for line in lines[:FOLD_HEAD])
        alerts = self._alerts(rank, middle)
        kept = alerts[:FOLD_ALERTS]
        more = len(alerts) - len(kept)
        self.console.print(
            Text(
                f"{prefix((rank,))} ... {len(middle) - len(kept):,} more lines"
                + (f", {more:,} of them warnings or errors" if more else "")
                + f" (see {self.log_of(rank)})",
                style="dim",
            ),
            soft_wrap=True,
            highlight=False,
        )
        self._print([((rank,), line) for line in kept])
        self.lines(((rank,), line) for line in lines[-FOLD_TAIL:])

    def _print(self, groups: list[Group]) -> None:
        if groups:
            # One print per batch: with a live region, every print redraws the table.
            self.console.print(
                Text("\n").join(
                    format_line(sorted(ranks), clean(line, keep_sgr=True)) for ranks, line in groups
                ),
                soft_wrap=True,
                highlight=False,
                markup=False,
                emoji=False,
            )

    def flush(self) -> None:
        with quiet_if_reader_gone(self.console):
            self.console.file.flush()

    def _alerts(self, rank: int, lines: list[str]) -> list[str]:
        """The warnings, errors and traceback lines among a rank's `lines`, in order."""
        if not self._detector.in_block(rank) and not may_hold_alerts("\n".join(lines)):
            return []
        return [line for line in lines if self._detector.is_alert(rank, line)]


@contextlib.contextmanager
def quiet_if_reader_gone(console: Console) -> Iterator[None]:
    """A write whose reader is gone (`train ... | head`) quiets the console for good: the run
    goes on, and the display says nothing more."""
    try:
        yield
    except OSError as exc:
        if not reader_gone(exc):
            raise
        stop_writing(console)
