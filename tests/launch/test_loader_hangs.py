"""A rank waiting on a hung DataLoader worker: the stall report says "waiting for a DataLoader
worker" (from the rank's own stack, which faulthandler writes on the watchdog's SIGUSR2), and
the first Ctrl-C stops a run hung in an evaluation, whose heartbeat, after every evaluation
batch, says how fast it goes (a save, or an evaluation before its first batch, is left to the
stall timeout)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from launcher.launch.watchdog import Stall, Watchdog, describe, where_in_stack
from launcher.metrics.telemetry import Telemetry
from tests.conftest import finish_train, write_spec
from tests.forked_train import fork_train
from tests.tiny_recipes import write_recipe
from tests.watchdog_clock import WatchdogClock

pytestmark = pytest.mark.timeout(300)

# faulthandler's dump of a rank whose main thread (the one the signal reached) waits for a
# batch from its loader workers; a thread of its own (the pin-memory thread) comes first.
DUMP = """step 12 done
Thread 0x00007fdf3ddff6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 327 in wait
  File "/venv/lib/python3.11/site-packages/torch/utils/data/_utils/pin_memory.py", line 52 in do_one_step

Current thread 0x00007fdf5c42bb80 (most recent call first):
  File "/usr/lib/python3.11/selectors.py", line 415 in select
  File "/usr/lib/python3.11/multiprocessing/connection.py", line 947 in wait
  File "/usr/lib/python3.11/multiprocessing/queues.py", line 113 in get
  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 1291 in _try_get_data
  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 1464 in _get_data
  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 1505 in _next_data
  File "/work/launcher/worker/loop.py", line 292 in _step
"""


def test_a_rank_waiting_for_its_loader_workers_is_named_so(tmp_path: Path) -> None:
    log = tmp_path / "rank-0.log"
    log.write_text(DUMP)
    where, loader_wait = where_in_stack(log)
    assert (where, loader_wait) == ("/usr/lib/python3.11/selectors.py:415 in select", True)
    assert describe(Stall(0, 12, 31.0, where, loader_wait=loader_wait)) == (
        "rank 0: no progress for 31 s after step 12, waiting for a DataLoader worker "
        "(data.num_workers), at /usr/lib/python3.11/selectors.py:415 in select"
    )
    # Only the current thread counts: another thread in the loader's code says nothing.
    log.write_text(DUMP.replace("dataloader.py", "other.py") + DUMP.split("\n\n")[0] + "\n")
    assert where_in_stack(log)[1] is False


def _beats_then_stop(
    folder: Path, evaluation: list[dict[str, bool]], clock: WatchdogClock
) -> list[Stall]:
    """A rank steps 5 times (a step's pace is known), then beats as `evaluation` says (the
    worker's `Telemetry.beat` arguments), then nothing for 0.7 s; a stop was asked 0.5 s
    ago."""
    folder.mkdir()
    telemetry = Telemetry(folder, rank=0, is_main=False)
    watchdog = Watchdog(folder, range(1), timeout_s=100)
    telemetry.start_from(0)
    beats = [{}] * 5 + evaluation
    for count, busy in enumerate(beats, start=1):
        telemetry.beat(min(count, 5), **busy)
        assert watchdog.check() == []
        clock.sleep(0.7 if count == len(beats) else 0.03)
    return watchdog.check_after_stop(asked_s=0.5, grace_s=0.2)


def test_after_a_stop_a_rank_evaluating_gets_the_grace_once_its_pace_is_known(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """0.5 s past a stop and 0.7 s without a beat is more than the grace (0.2 s) and 4 gaps
    of 0.03 s: a rank in an evaluation past its first batch (a beat after every batch) is
    hung. One that has not finished its first batch, or one saving, is left to the stall
    timeout."""
    started = {"busy": True}  # as a save: workers start, XLA compiles
    batch = {"busy": True, "evaluating": True}
    clock = WatchdogClock(monkeypatch)
    [stall] = _beats_then_stop(tmp_path / "batches", [started, batch, batch], clock)
    assert (stall.rank, stall.step) == (0, 5)
    assert _beats_then_stop(tmp_path / "first", [started], clock) == []
    assert _beats_then_stop(tmp_path / "steps", [], clock) != []  # in a step: as before


# The tiny recipe, whose val split hangs in rank 1's loader worker and whose steps are slow.
HOOKS = """
import os, time
import torch
from torch.utils.data import Dataset, get_worker_info


class Val(Dataset):
    \"\"\"In rank 1's loader worker, sample 24 and after never come.\"\"\"

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i >= 24 and os.environ["RANK"] == "1" and get_worker_info() is not None:
            open("sleeping", "w").close()
            time.sleep(3600)
        return torch.ones(4), torch.ones(1)


def build_dataset(split):
    return Val() if split == "val" else tiny.build_dataset(split)


def loss(model, batch):
    time.sleep(0.1)  # steps the watchdog sees one by one: it knows their pace
    return tiny.loss(model, batch)
"""


def test_ctrl_c_stops_a_run_hung_on_a_loader_worker_in_an_evaluation(tmp_path: Path) -> None:
    """Rank 1's 4th evaluation batch never comes from its loader worker: the first Ctrl-C
    ends the run within the grace of an evaluation batch, not the stall timeout, and names
    what rank 1 waits for."""
    write_recipe(tmp_path, HOOKS, "hangs.py")
    spec = write_spec(
        tmp_path / "run.yaml",
        recipe={"source": "hangs.py", "dataset": {}},
        data={"batch_size": 4, "num_workers": 1},
        train={"max_steps": 50, "log_every": 5},
        eval={"every_n_steps": 10},
    )
    proc = fork_train(["--config", str(spec), "--stall-timeout", "120"], tmp_path)
    deadline = time.monotonic() + 120
    while not (tmp_path / "sleeping").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1)
    asked = time.monotonic()
    proc.send_signal(signal.SIGINT)
    result = finish_train(proc, tmp_path, timeout=60)
    took = time.monotonic() - asked
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "stopped at once: after SIGINT" in output, output
    rank1 = next(x for x in output.splitlines() if x.startswith("rank 1: no progress"))
    assert "after step 10, waiting for a DataLoader worker (data.num_workers)" in rank1, output
    assert took < 30, took  # the grace (10 s), not the stall timeout (120 s)
