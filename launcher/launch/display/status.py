"""The live status region: latest telemetry per rank as a small table, plus a status line.

Telemetry lines are JSON objects written by the workers, e.g.
``{"rank": 0, "step": 12, "max_steps": 200, "loss": 0.53, "samples_per_s": 1234.5,
"elapsed_s": 3.2, "attempt": 0}``. Any key may be missing and extra keys are ignored.
"""

import math
from collections.abc import Callable, Sequence
from statistics import fmean

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from launcher.launch.display.lines import format_ranks, rank_style
from launcher.metrics.flop_rate import flop_rate
from launcher.metrics.record_fields import is_number
from launcher.rundir.reading import parse_json_or_none

FIELDS = (
    "step", "max_steps", "loss", "val", "samples_per_s", "elapsed_s", "attempt",
    "tflops_per_device", "mfu", "max_memory_allocated_gib",
)  # fmt: skip
# Columns shown only once some rank reports them: (field, header, format or formatter).
Format = str | Callable[[float], str]
OPTIONAL: tuple[tuple[str, str, Format], ...] = (
    ("val", "val", "{:.4g}"),
    ("tflops_per_device", "FLOP/s", lambda tflops: "".join(flop_rate(tflops))),  # 391.2T, 35.1G
    ("mfu", "MFU", "{:.1%}"),
    ("max_memory_allocated_gib", "mem GiB", "{:.1f}"),
)
# Beyond this many ranks the rest share one summary row, so the region stays small.
MAX_ROWS = 16


def parse_telemetry(line: str) -> dict[str, float]:
    """The known numeric fields of one telemetry line; {} for a line that is not JSON."""
    record = parse_json_or_none(line)
    if not isinstance(record, dict):
        return {}
    return {key: record[key] for key in FIELDS if is_number(record.get(key))}


class TelemetryBoard:
    """Latest known progress of each rank."""

    def __init__(self, ranks: Sequence[int]) -> None:
        self._latest: dict[int, dict[str, float]] = {rank: {} for rank in ranks}

    def update(self, rank: int, line: str) -> bool:
        """Apply one telemetry line; returns whether it held anything usable."""
        fields = parse_telemetry(line)
        if fields:
            # Merge, so a record that omits a key keeps the last value seen for it.
            self._latest.setdefault(rank, {}).update(fields)
        return bool(fields)

    def latest(self, rank: int) -> dict[str, float]:
        return dict(self._latest.get(rank, {}))

    def render(self, title: str = "") -> RenderableType:
        table = self._table()
        return Group(Text(title, style="bold"), table) if title else table

    def _table(self) -> Table:
        table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), show_edge=False)
        # The evaluation's column only once a rank has evaluated; speed and memory likewise.
        extra = [c for c in OPTIONAL if any(c[0] in r for r in self._latest.values())]
        headers = ("rank", "step", "loss", *(c[1] for c in extra), "samples/s", "elapsed")
        for name in headers:
            table.add_column(name, justify="right", no_wrap=True)
        ranks = sorted(self._latest)
        shown = ranks if len(ranks) <= MAX_ROWS else ranks[: MAX_ROWS - 1]
        for rank in shown:
            cells = _cells(self._latest[rank], extra)
            table.add_row(Text(str(rank), style=rank_style(rank)), *cells)
        rest = ranks[len(shown) :]
        if rest:
            summary = _summarize([self._latest[rank] for rank in rest])
            table.add_row(Text(format_ranks(rest), style="dim"), *_cells(summary, extra))
        return table


def _summarize(records: list[dict[str, float]]) -> dict[str, float]:
    """The slowest step, mean loss and throughput, and longest elapsed of several ranks."""
    summary: dict[str, float] = {}
    for key, combine in (
        ("step", min),
        ("max_steps", max),
        ("loss", fmean),
        ("val", fmean),
        ("samples_per_s", fmean),
        ("elapsed_s", max),
        ("tflops_per_device", fmean),
        ("mfu", fmean),
        ("max_memory_allocated_gib", max),
    ):
        values = [record[key] for record in records if key in record]
        if values:
            summary[key] = combine(values)
    return summary


def _cells(record: dict[str, float], extra: Sequence[tuple[str, str, Format]] = ()) -> list[str]:
    step = _number(record.get("step"), "{:.0f}")
    if "max_steps" in record and "step" in record:
        step += f"/{record['max_steps']:.0f}"
    loss = _number(record.get("loss"), "{:.4g}")
    rate = record.get("samples_per_s")
    rate_text = _number(rate, "{:,.0f}" if rate is not None and rate >= 100 else "{:.1f}")
    optional = [_number(record.get(field), spec) for field, _, spec in extra]
    return [step, loss, *optional, rate_text, format_elapsed(record.get("elapsed_s"))]


def _number(value: float | None, spec: Format) -> str:
    if value is None:
        return "-"
    if not math.isfinite(value):
        return str(value)
    return spec(value) if callable(spec) else spec.format(value)


def format_elapsed(seconds: float | None) -> str:
    """``3.2s``, ``4:05``, ``1:02:03``."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
