"""`train plot`'s reading of a metrics file of any length: a few metrics' curves, found by
numpy in the file's bytes rather than by parsing each record, then cut down to the plot's
width. The file is read 2 MB at a time into one buffer; in it, each `"key":` is found from the
colon that ends it, each value's text is cut at its delimiter, and the texts of the values
on whole lines are converted to numbers all at once. A million records parse in seconds; they
scan in under one, most of it the conversion of the numbers. `train runs` reads the end of
the metrics file of a run written before progress.json the same way (`tail_progress`).

A record is a line that starts with `{` and ends with `}`; a key's value is the number after
`"key":` in it (the last one where a line holds two, as a line a killed run left half written
and the next record continued does). Anything else (a string, `true`) is no value, as in
`launcher.runs.metrics_file`, whose rules (a resumed run's replaced records) this follows; a
NaN or an infinity is kept, for the plot to show where it happened.

`downsample` keeps, per pixel column, the first, last, lowest and highest point: a one-step
spike stays drawn at any length, and a curve never has more than 4 points a column."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from launcher.metrics.progress import Extremes, Progress
from launcher.metrics.record_fields import RESUMED_AT
from launcher.rundir.reading import open_regular
from launcher.runs.metrics_file import MAX_METRICS_BYTES

_CHUNK = 2 << 20  # bytes read at once (the buffer grows for a longer line): fits a cache
_WINDOW = 32  # bytes read at once of a value; a longer one (a 400-digit integer) alone
_NUMBER = re.compile(rb"\s*(-?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|Infinity)|NaN)\s*$")
_PLAIN = np.zeros(256, dtype=bool)  # what a finite number's text is made of, or its padding
_PLAIN[list(b"0123456789.eE+- \0")] = True
_NEWLINE, _SPACE, _COLON = ord("\n"), ord(" "), ord(":")
_SEARCH = 1 << 16  # bytes searched at once for a line's end


@dataclass
class Column:
    """One key's values in a file: the records (line numbers) that hold it, and the values."""

    lines: np.ndarray  # int64, ascending
    values: np.ndarray  # float64

    def at(self, lines: np.ndarray) -> np.ndarray:
        """The values at these lines; NaN where a line has none."""
        if not len(self.lines):
            return np.full(len(lines), np.nan)
        where = np.minimum(np.searchsorted(self.lines, lines), len(self.lines) - 1)
        return np.where(self.lines[where] == lines, self.values[where], np.nan)


def scan(path: Path, keys: Sequence[str], limit: int = MAX_METRICS_BYTES) -> dict[str, Column]:
    """Each key's column in the file's last `limit` bytes (a missing file has none)."""
    found: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {key: [] for key in keys}
    line_offset = 0
    for padded, size in _chunks(path, limit):
        data = padded[:size]
        ends = np.flatnonzero(data == _NEWLINE)
        starts = np.concatenate(([0], ends[:-1] + 1))
        whole = (ends > starts) & (data[starts] == ord("{")) & (data[ends - 1] == ord("}"))
        # Each `"key":` ends at a colon: the letter before its closing quote rules most out.
        colons = np.flatnonzero(data == _COLON)
        last_letters = data[colons - 2]  # the first line's may wrap around: ruled out later
        for key in keys:
            at = _after_key(data, colons[last_letters == ord(key[-1])], key)
            lines = np.searchsorted(ends, at)
            on_whole = whole[lines]
            at, lines = at[on_whole], lines[on_whole]
            readable, values = _numbers(padded, at, ends[lines])
            lines = lines[readable]
            last = np.ones(len(lines), dtype=bool)  # a line's last value of the key
            last[:-1] = lines[1:] != lines[:-1]
            found[key].append((lines[last] + line_offset, values[last]))
        line_offset += len(ends)
    return {
        key: Column(
            np.concatenate([lines for lines, _ in parts] or [np.zeros(0, np.int64)]),
            np.concatenate([values for _, values in parts] or [np.zeros(0)]),
        )
        for key, parts in found.items()
    }


def _after_key(data: np.ndarray, colons: np.ndarray, key: str) -> np.ndarray:
    """Where a value starts after `"key":`, of the colons that may end one (those after its
    last letter). Its opening quote first: it rules out the keys of other lengths."""
    pattern = b'"' + key.encode() + b'":'
    colons = colons[colons >= len(pattern) - 1]
    for back in (len(pattern) - 1, 1, *range(3, len(pattern) - 1)):  # bytes before the colon
        colons = colons[data[colons - back] == pattern[-1 - back]]
    return colons + 1


def _chunks(path: Path, limit: int) -> Iterator[tuple[np.ndarray, int]]:
    """The whole lines of the file's last `limit` bytes, about _CHUNK bytes at a time: an
    array whose first `size` bytes are lines, each ending with a newline, followed by
    _WINDOW spaces (a value's window never runs past the array). One buffer, reused."""
    with open_regular(path) as file:
        if file is None:
            return
        try:
            size = file.seek(0, 2)
            file.seek(max(0, size - limit))
            yield from _lines(file, cut=size > limit)
        except OSError:
            return


def _lines(file: BinaryIO, cut: bool) -> Iterator[tuple[np.ndarray, int]]:
    buffer = np.empty(_CHUNK + 1 + _WINDOW, dtype=np.uint8)
    kept = 0  # the start of a line, carried over from the last read
    while True:
        room = len(buffer) - 1 - _WINDOW
        if kept == room:  # a line longer than the buffer: a larger one
            buffer = np.concatenate((buffer, np.empty(room, dtype=np.uint8)))
            room = len(buffer) - 1 - _WINDOW
        read = file.readinto(memoryview(buffer)[kept:room])
        filled = kept + read
        if read:
            end = _last_line_end(buffer, filled)
        else:  # the file's end: its last line, if whole, ends with `}`
            buffer[filled] = _NEWLINE
            end = filled + 1 if filled else 0
        start = 0
        if cut and end:  # the first line of a cut file is a part of one
            start, cut = _last_line_end(buffer, end, first=True), False
        rest = buffer[end:filled].copy()
        buffer[end : end + _WINDOW] = _SPACE
        if end > start:
            yield buffer[start : end + _WINDOW], end - start
        if not read:
            return
        buffer[: len(rest)] = rest
        kept = len(rest)


def _last_line_end(buffer: np.ndarray, stop: int, first: bool = False) -> int:
    """Where the last (or `first`) line of buffer[:stop] ends: after its newline; 0: none."""
    blocks = range(0, stop, _SEARCH) if first else range(stop, 0, -_SEARCH)
    for block in blocks:
        begin = block if first else max(0, block - _SEARCH)
        found = np.flatnonzero(buffer[begin : min(stop, begin + _SEARCH)] == _NEWLINE)
        if len(found):
            return begin + int(found[0 if first else -1]) + 1
    return 0


def _numbers(
    padded: np.ndarray, at: np.ndarray, line_ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Which of the values starting `at` are numbers, and those numbers (`padded`: the lines
    and their _WINDOW spaces; `line_ends`: where each value's line ends)."""
    if not len(at):
        return np.zeros(0, dtype=bool), np.zeros(0)
    # Each value's next _WINDOW bytes, up to its delimiter: a number ends at `,` or `}` (a
    # record's line ends with `}`, so no newline comes first). Zeros after it: no text.
    window = np.lib.stride_tricks.sliding_window_view(padded, _WINDOW)[at]
    delimiter = (window == ord(",")) | (window == ord("}"))
    length = delimiter.argmax(axis=1)
    ended = delimiter[np.arange(len(at)), length]
    width = max(1, int(length.max()))
    text = window[:, :width] * (np.arange(width) < length[:, None])
    values = np.full(len(at), np.nan)
    plain = ended.copy()
    try:  # the common case: every value a number (NaN and Infinity included)
        values[plain] = _as_floats(text if plain.all() else text[plain])
    except ValueError:  # `true`, a string, ...: only what looks like a number, the rest alone
        plain &= _PLAIN[text].all(axis=1) & ((text != _SPACE) & (text != 0)).any(axis=1)
        try:
            values[plain] = _as_floats(text[plain])
        except ValueError:  # `1-2`, `e`: a number's letters, not a number
            plain[:] = False
    readable = np.ones(len(at), dtype=bool)
    for row in np.flatnonzero(~plain):  # NaN, Infinity, longer numbers, and what is no number
        number = _read_one(padded[at[row] : line_ends[row]].tobytes())
        readable[row] = number is not None
        values[row] = np.nan if number is None else number
    return readable, values[readable]


def _as_floats(text: np.ndarray) -> np.ndarray:
    rows = np.ascontiguousarray(text, dtype=np.uint8)
    return rows.view(f"S{rows.shape[1]}").ravel().astype(np.float64)


def _read_one(line: bytes) -> float | None:
    """The number a line's rest starts with, up to its delimiter (None: it is no number)."""
    ends = [i for i in (line.find(b","), line.find(b"}")) if i >= 0]
    found = _NUMBER.match(line[: min(ends)] if ends else line)
    return float(found[1]) if found else None


def curves(
    path: Path, metrics: Sequence[str], x: str = "step"
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The metrics' curves, NaN and infinities included, from one pass over the file: by
    `step` (a step a resumed run did again keeps its newest value) or by `time` (seconds
    since the first record)."""
    keys = list(dict.fromkeys([*metrics, "step", RESUMED_AT, *(["time"] if x == "time" else [])]))
    columns = scan(path, keys)
    markers = columns[RESUMED_AT]
    found = {}
    for metric in metrics:
        points = columns[metric]
        steps = columns["step"].at(points.lines)
        keep = _not_replaced(points.lines, steps, markers)
        lines, ys, steps = points.lines[keep], points.values[keep], steps[keep]
        if x == "time":
            found[metric] = _by_time(columns["time"], markers, lines, ys)
        else:
            found[metric] = _by_step(steps, ys)
    return found


def tail_progress(path: Path, metrics: Sequence[str], limit: int) -> Progress:
    """The progress (`launcher.metrics.progress`) of these metrics in the file's last `limit`
    bytes: `train runs` of a run written before progress.json. As there, only finite values
    count, and a resumed run's replaced records do not."""
    columns = scan(path, list(dict.fromkeys([*metrics, "step", RESUMED_AT])), limit)
    markers, steps = columns[RESUMED_AT], columns["step"]
    progress = Progress()
    kept = _not_replaced(steps.lines, steps.values, markers) & np.isfinite(steps.values)
    kept &= ~np.isin(steps.lines, markers.lines)
    if kept.any():
        progress.step = int(steps.values[kept][-1])
    for metric in metrics:
        points = columns[metric]
        at = steps.at(points.lines)
        kept = _not_replaced(points.lines, at, markers) & np.isfinite(points.values)
        kept &= ~np.isin(points.lines, markers.lines)
        values, at = points.values[kept], at[kept]
        if len(values):
            low, high = int(np.argmin(values)), int(np.argmax(values))  # the first, if tied
            progress.metrics[metric] = Extremes(
                float(values[-1]), float(values[low]), _int(at[low]), float(values[high]),
                _int(at[high]),
            )  # fmt: skip
    return progress


def _int(step: float) -> int | None:
    return int(step) if np.isfinite(step) else None


def _by_step(steps: np.ndarray, ys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    has_x = ~np.isnan(steps)
    xs, ys = steps[has_x], ys[has_x]
    if len(xs) > 1 and not (np.diff(xs) > 0).all():
        # By step, then the newest of a step's values: the last of each step's run.
        order = np.lexsort((np.arange(len(xs)), xs))
        xs, ys = xs[order], ys[order]
        newest = np.append(xs[1:] != xs[:-1], True)
        xs, ys = xs[newest], ys[newest]
    return xs, ys


def _by_time(
    times: Column, markers: Column, lines: np.ndarray, ys: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    records = ~np.isin(times.lines, markers.lines)
    start = times.values[records][0] if records.any() else 0.0
    xs = times.at(lines) - start
    has_x = ~np.isnan(xs)
    order = np.argsort(xs[has_x], kind="stable")
    return xs[has_x][order], ys[has_x][order]


def _not_replaced(lines: np.ndarray, steps: np.ndarray, markers: Column) -> np.ndarray:
    """Which records no later resume marker replaced: one of a step past the marker's."""
    if not len(markers.lines):
        return np.ones(len(lines), dtype=bool)
    later_lowest = np.minimum.accumulate(markers.values[::-1])[::-1]
    upcoming = np.searchsorted(markers.lines, lines, side="right")
    limit = np.append(later_lowest, np.inf)[upcoming]
    return np.isnan(steps) | (steps <= limit)


# The largest magnitude a curve draws: twice it, and the margins the plotting packages add,
# stay finite.
DRAWABLE = 1e300


def downsample(
    xs: np.ndarray, ys: np.ndarray, width: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The points to draw `width` columns wide (xs ascending), and the x of each column that
    holds a value with no height: NaN, an infinity, or one so large that the axis' span
    would overflow (1e308 beside -1e308: the plotting packages fail on it)."""
    finite = np.abs(ys) <= DRAWABLE  # False for NaN too
    xs_kept, ys_kept = _extremes(xs[finite], ys[finite], width)
    bad = xs[~finite]
    if len(bad):
        columns = _columns(bad, xs[0], xs[-1], width)
        bad = bad[np.append(True, columns[1:] != columns[:-1])]
    return xs_kept, ys_kept, bad


def _extremes(xs: np.ndarray, ys: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    if len(xs) <= 4 * width:
        return xs, ys
    columns = _columns(xs, xs[0], xs[-1], width)
    starts = np.flatnonzero(np.append(True, columns[1:] != columns[:-1]))
    ends = np.append(starts[1:], len(xs)) - 1
    column_of = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(xs))))
    keep = [starts, ends]
    for extreme in (np.minimum, np.maximum):
        best = extreme.reduceat(ys, starts)
        hits = np.flatnonzero(ys == best[column_of])
        keep.append(hits[np.append(True, column_of[hits][1:] != column_of[hits][:-1])])
    chosen = np.unique(np.concatenate(keep))
    return xs[chosen], ys[chosen]


def _columns(xs: np.ndarray, low: float, high: float, width: int) -> np.ndarray:
    span = high - low
    if span <= 0:
        return np.zeros(len(xs), dtype=np.int64)
    return np.clip(((xs - low) * (width / span)).astype(np.int64), 0, width - 1)
