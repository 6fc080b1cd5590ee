"""Imported once by the tests' fork server (`tests/forked_train.py`), never by a test: the
installed libraries the tests' recipes import (Hugging Face's models), so that every forked
`train`, and the workers' server it forks, holds them already. Quietly, as the workers'
server preloads: what torchao, which transformers imports, prints as it loads is no test's
output. Where transformers is not installed (the smoke environments), nothing."""

from __future__ import annotations

import os

from launcher.worker.fork_server import preload

saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
os.dup2(null, 2)
try:
    preload(("transformers.modeling_utils",))
finally:
    os.dup2(saved, 2)
    os.close(saved)
    os.close(null)
