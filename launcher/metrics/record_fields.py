"""What a metrics record of metrics.jsonl holds besides its metrics: the fields that say where
a point is, and the marker of a resume. The writer (`launcher.metrics.telemetry`), rank 0's
sinks and the readers of run folders (`launcher.runs`) all read records by these names, so
they live here, in a module that imports nothing of the package."""

from __future__ import annotations

from typing import Any

# The marker rank 0 writes into metrics.jsonl when a run resumes: {"resumed_at": STEP, "time":
# ...}, STEP the step of the checkpoint it resumed from. The records before it of later steps
# were done again after it (the run was killed past its last checkpoint): readers keep the
# newer ones (`launcher.runs.metrics_file`).
RESUMED_AT = "resumed_at"
# The fields of a metrics record that say where a point is (its x axes), not a metric.
NOT_METRICS = frozenset({"step", "epoch", "time", RESUMED_AT})


def is_number(value: Any) -> bool:
    """Whether a record's field holds a number (JSON's `true` is a bool, not one)."""
    return isinstance(value, int | float) and not isinstance(value, bool)
