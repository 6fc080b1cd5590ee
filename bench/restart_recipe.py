"""The quickstart recipe (`recipes/mlp.py`), whose rank 1 fails once: on its first attempt,
at its RESTART_FAIL_AT-th loss (default 6). Used by bench/worker_start.py to time a restart."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
from mlp import build_dataset, build_model  # noqa: F401
from mlp import loss as _loss

sys.path.pop(0)
_calls = 0


def loss(model, batch):
    global _calls
    _calls += 1
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    at = int(os.environ.get("RESTART_FAIL_AT", "6"))
    if first_attempt and os.environ.get("RANK") == "1" and _calls == at:
        raise RuntimeError("the failure bench/worker_start.py restarts from")
    return _loss(model, batch)
