"""The ddp reference every layout of `tests/parallel/layouts.py` compares with, trained once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parallel.layouts import GPT, PROBE, spec_file, train


@pytest.fixture(scope="session")
def ddp_on_2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ddp on 2 processes, 20 steps of the GPT recipe (through `PROBE`, which records the
    batches of 4-process runs only): a folder holding `ddp.yaml` and its run, `ddp/`, in which
    the layouts under test train their own runs, each under a name of its own."""
    folder = tmp_path_factory.mktemp("layouts")
    (folder / "probe.py").write_text(PROBE)
    probe = {**GPT, "source": "probe.py"}  # a resume continues with the recipe it started with
    train(folder, spec_file(folder / "ddp.yaml", 2, "ddp", recipe=probe), "ddp")
    return folder
