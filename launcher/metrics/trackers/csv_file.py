"""The `csv` tracker: `<run dir>/metrics.csv`, a row per metrics record and a column per
metric, for a spreadsheet or `pandas.read_csv`. A metric first seen late (the first
evaluation's) adds a column: the file is rewritten once with it. The spec, the run's status
and its best checkpoint are beside it in the run folder (spec.yaml, outcome.json,
summary.json)."""

from __future__ import annotations

import csv
import io
from typing import Any, TextIO

from launcher.metrics.sink_types import RunEnd
from launcher.metrics.trackers.base import TrackerSink
from launcher.rundir.atomic import write_atomic

_FIRST = ["step", "epoch", "time"]


class CsvSink(TrackerSink):
    name = "csv"

    def connect(self, earlier: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        self.path = self.layout.metrics_csv
        self.where = str(self.path)
        self.columns = list(_FIRST)
        self._file: TextIO | None = None
        if self.path.exists():  # an earlier attempt's: go on with its columns
            with self.path.open(newline="") as file:
                self.columns = next(csv.reader(file), None) or self.columns
        return {}, self.path.exists()

    def send(self, step: int, metrics: dict[str, float], record: dict[str, Any]) -> None:
        new = [key for key in metrics if key not in self.columns]
        if new or self._file is None:
            self._reopen(self.columns + new)
        row = {"step": step, "epoch": record.get("epoch"), "time": record.get("time"), **metrics}
        assert self._file is not None
        csv.DictWriter(self._file, self.columns).writerow(row)

    def _reopen(self, columns: list[str]) -> None:
        """Opens the file to append, first rewriting it whole where `columns` grew."""
        if self._file is not None:
            self._file.close()
        if columns != self.columns or not self.path.exists():
            rows = []
            if self.path.exists():
                with self.path.open(newline="") as file:
                    rows = list(csv.DictReader(file))
            text = io.StringIO()
            writer = csv.DictWriter(text, columns)
            writer.writeheader()
            writer.writerows(rows)
            write_atomic(self.path, text.getvalue())
            self.columns = columns
        self._file = self.path.open("a", newline="")

    def push(self) -> None:
        if self._file is not None:
            self._file.flush()

    def finish(self, outcome: RunEnd) -> None:
        pass  # outcome.json and summary.json hold the end, beside this file

    def disconnect(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
