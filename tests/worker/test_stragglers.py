"""A rank that is merely slow (`launch.straggler`): named, with its part (compute or data) and
host, within `window` logged windows; its waits kept apart from its compute, so that the fast
ranks, which wait for it, never look slow; no alarm on a healthy run on a loaded machine; and
`action: stop` saves and stops with the line."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.config.straggler import StragglerSection
from launcher.parallel.control import ControlChannel
from launcher.replicas.engine import NoReplicas
from launcher.rundir import fault_events
from launcher.rundir.layout import RunLayout
from launcher.worker.stragglers import StragglerWatch
from tests.conftest import REPO, metrics_of, only_run_dir, run_train, usage_error, write_spec
from tests.tiny_recipes import tiny_recipe, write_recipe

pytestmark = [pytest.mark.timeout(300), pytest.mark.launcher_only]

# Hooks on the tiny recipe. Each step works `busy` seconds (a sleep: work that takes the
# host's time as a GPU's does, which a VM's noisy cores do not move; the loaded machine's test
# spins matrix products instead). The rank `slow_rank` then sleeps `compute` times what its
# work took (0.4: 40% slower), in every attempt or, with `first_attempt`, in its first one
# only (a replica group's restart heals it); or sleeps `data` seconds per sample as its
# loader reads it. Under fault tolerance, `slow_rank` is the run's rank.
SLOW_HOOKS = """
import os
import time

import torch

HERE = {}


def _rank():
    group = os.environ.get("REPLICA_GROUP_ID")
    rank = int(os.environ.get("RANK", "0"))
    return rank + int(group) * int(os.environ["WORLD_SIZE"]) if group else rank


def build_model(slow_rank=1, compute=0.0, busy=0.0, first_attempt=False):
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    slow = _rank() == slow_rank and (first or not first_attempt)
    HERE.update(slow=slow, compute=compute, busy=busy)
    return tiny.build_model()


class SlowReads(torch.utils.data.Dataset):
    def __init__(self, inner, seconds):
        self.inner, self.seconds = inner, seconds

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        time.sleep(self.seconds)
        return self.inner[i]


def build_dataset(split, slow_rank=1, data=0.0, **kwargs):
    dataset = tiny.build_dataset(split, **kwargs)
    slow = _rank() == slow_rank and split == "train"
    return SlowReads(dataset, data) if slow and data else dataset


def loss(model, batch):
    started = time.perf_counter()
    if HERE["busy"]:
        time.sleep(HERE["busy"])
    else:
        spin = torch.full((192, 192), 0.01)
        for _ in range(160):
            spin = torch.tanh(spin @ spin)
    if HERE["slow"] and HERE["compute"]:
        time.sleep(HERE["compute"] * (time.perf_counter() - started))
    return tiny.loss(model, batch)
"""


def _spec(tmp_path: Path, model: dict, dataset: dict, **sections: dict) -> Path:
    recipe = tiny_recipe(write_recipe(tmp_path, SLOW_HOOKS), model=model, **dataset)
    defaults = {
        "recipe": recipe,
        "launch": {"straggler": {"window": 3}},
        "train": {"max_steps": 40, "log_every": 5},
        "checkpoint": {"enabled": False},
        # No tracker: TensorBoard's writer, imported by a thread of rank 0 during the first
        # windows, holds the interpreter's lock for milliseconds of rank 0's steps.
        "log": {"trackers": []},
    }
    return write_spec(tmp_path / "run.yaml", defaults, **sections)


def _named(result: subprocess.CompletedProcess[str]) -> list[str]:
    return re.findall(
        r"rank \d+ \(host [^)]+\) is [\d.]+x slower than the median in \w+", result.stdout
    )


def _events(run_dir: Path) -> list[dict]:
    path = RunLayout(run_dir).stragglers
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize(("strategy", "devices"), [("ddp", 2), ("ddp", 4), ("fsdp", 2)])
def test_a_rank_slower_at_its_compute_is_named_and_the_others_waits_are_not_compute(
    tmp_path: Path, strategy: str, devices: int
) -> None:
    launch = {"devices": devices, "strategy": strategy}
    spec = _spec(tmp_path, {"compute": 0.4, "busy": 0.05}, {}, launch=launch)
    result = run_train(["--config", str(spec)], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    named = _named(result)
    assert len(named) == 1 and named[0].startswith("rank 1 ") and named[0].endswith("in compute")
    assert "the job runs at its pace" in result.stdout
    run_dir = only_run_dir(tmp_path / "runs")
    [found] = _events(run_dir)
    assert found["event"] == "found" and found["rank"] == 1 and found["part"] == "compute"
    assert found["found_at"] <= 15  # within 3 logged windows of 5 steps
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [s["rank"] for s in summary["stragglers"]] == [1]
    # Each rank's figures, by rank, at the logging cadence. The fast ranks wait for rank 1 in
    # DDP's backward, or fully_shard's gathers: counted in their compute, their steps would be
    # as slow as rank 1's.
    record = [r for r in metrics_of(run_dir) if "rank_compute_s" in r][-1]
    compute, wait = record["rank_compute_s"], record["rank_wait_s"]
    assert len(compute) == devices == len(wait) == len(record["rank_data_s"])
    # The optimizer's update, a part of compute, timed apart too.
    assert all(0 < o < c for o, c in zip(record["rank_optimizer_s"], compute, strict=True))
    assert compute[1] >= 1.25 * max(c for rank, c in enumerate(compute) if rank != 1), compute
    assert all(w >= 0 for w in wait)


def test_a_rank_with_a_slow_loader_is_named_for_its_data(tmp_path: Path) -> None:
    spec = _spec(tmp_path, {}, {"data": 0.004})  # 32 ms a batch of 8
    result = run_train(["--config", str(spec)], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    named = _named(result)
    assert len(named) == 1 and named[0].startswith("rank 1 ") and named[0].endswith("in data")


def test_a_healthy_run_on_a_loaded_machine_names_no_one(tmp_path: Path) -> None:
    # 50 windows of 10 steps each, judged as they come. Windows of 5 steps named a rank 1.5x
    # slower under make test-loaded: busy loops and ranks share 2 cores unevenly for seconds
    # at a time, and the default 3 windows in a row fit inside such a spell when they are short.
    # One busy loop of its own: with the 2 ranks, 3 spinning processes on a 2-core machine share
    # them unevenly wherever the test runs (make test runs other suites beside it too).
    spec = _spec(tmp_path, {}, {}, train={"max_steps": 500, "log_every": 10})
    loop = subprocess.Popen(["python3", "-c", "while True: pass"])
    try:
        result = run_train(["--config", str(spec)], tmp_path, timeout=240)
    finally:
        loop.kill()
        loop.wait()
    assert result.returncode == 0, result.stdout + result.stderr
    assert _named(result) == [] and _events(only_run_dir(tmp_path / "runs")) == []


def test_stop_saves_then_stops_with_the_line(tmp_path: Path) -> None:
    spec = _spec(
        tmp_path, {"compute": 0.6, "busy": 0.05}, {},
        launch={"straggler": {"window": 2, "action": "stop"}},
        checkpoint={"enabled": True, "every_n_steps": 100},
    )  # fmt: skip
    result = run_train(["--config", str(spec)], tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout + result.stderr
    assert re.search(r"rank 1 \(host [^)]+\) is a straggler: [\d.]+x slower", out), out
    assert "replace its node and continue with: train --resume" in out
    run_dir = only_run_dir(tmp_path / "runs")
    saved = sorted((run_dir / "checkpoints").glob("step-*"))
    assert saved and (saved[-1] / "COMPLETE").is_file()
    assert [e["event"] for e in _events(run_dir)] == ["found", "stopping"]


def _watch(ranks: int, tmp_path: Path, action: str = "warn") -> StragglerWatch:
    """A watch of `ranks` processes judged on this one (rank 0 of one group)."""
    process = SimpleNamespace(rank=0, is_main=True, device="cpu", world_size=1)
    process.control = ControlChannel(1)
    process.engine = NoReplicas(process)
    said: list[str] = []
    settings = StragglerSection(window=2, action=action)
    watch = StragglerWatch(settings, process, RunLayout(tmp_path), said.append)  # type: ignore[arg-type]
    watch.own, watch.places = set(range(ranks)), {r: ("h", f"cpu:{r}") for r in range(ranks)}
    watch.said = said  # type: ignore[attr-defined]
    return watch


FAST = {"compute": 0.010, "data": 0.001, "wait": 0.0}
SLOW = {"compute": 0.016, "data": 0.001, "wait": 0.0}


def test_a_straggler_is_named_after_window_windows_and_recovers_after_as_many(
    tmp_path: Path,
) -> None:
    watch = _watch(3, tmp_path)
    assert watch.judge({0: FAST, 1: FAST, 2: SLOW}, 10, 10) is None  # one window: not yet
    found = watch.judge({0: FAST, 1: FAST, 2: SLOW}, 20, 10)
    assert found is not None and (found.rank, found.part) == (2, "compute")
    assert watch.said == [  # type: ignore[attr-defined]
        "rank 2 (host h, cpu:2) is 1.6x slower than the median in compute for 20 steps; "
        "the job runs at its pace"
    ]
    assert watch.judge({0: FAST, 1: FAST, 2: FAST}, 30, 10) is None
    watch.judge({0: FAST, 1: FAST, 2: FAST}, 40, 10)
    assert watch.said[-1] == "rank 2 (host h, cpu:2) is back at the median's pace in compute"  # type: ignore[attr-defined]
    assert watch.summary()["stragglers"][0]["recovered_at"] == 40
    # Below the factor, or a gap too small to matter (a loader 1.5x slower by 0.5 ms): nothing.
    barely = {"compute": 0.012, "data": 0.0015, "wait": 0.0}
    for step in (50, 60, 70):
        assert watch.judge({0: FAST, 1: FAST, 2: barely}, step, 10) is None
    assert [e["event"] for e in _events(tmp_path)] == ["found", "recovered"]


def test_a_rank_of_another_group_is_judged_alike_but_said_and_recorded_by_its_own(
    tmp_path: Path,
) -> None:
    """Under fault tolerance every process judges every rank of the run (this one's group
    holds ranks 0 and 1); a group outside the quorum is left out, and starts anew when back."""
    watch = _watch(2, tmp_path, action="restart")
    for step in (10, 20):
        found = watch.judge({0: FAST, 1: FAST, 2: SLOW, 3: FAST}, step, 10)
    assert found is not None and found.rank == 2 and not watch.ours(found)
    assert watch.said == [] and _events(tmp_path) == []  # type: ignore[attr-defined]
    assert watch.summary()["stragglers"] == [
        {"rank": 2, "part": "compute", "ratio": 1.6, "found_at": 20}
    ]
    # Group 1 (ranks 2 and 3) restarts: out of the quorum, then back, slow again for a window
    # (not yet named again), and fast.
    assert watch.judge({0: FAST, 1: FAST}, 30, 10) is None
    assert watch.judge({0: FAST, 1: FAST, 2: SLOW, 3: FAST}, 40, 10) is None
    for step in (50, 60):
        watch.judge({0: FAST, 1: FAST, 2: FAST, 3: FAST}, step, 10)
    assert watch.summary()["stragglers"][0]["recovered_at"] == 60
    assert watch.judge({0: SLOW}, 70, 10) is None  # alone in the quorum: nothing to compare
    for step in (80, 90):
        found = watch.judge({0: FAST, 1: SLOW, 2: FAST, 3: FAST}, step, 10)
    assert found is not None and found.rank == 1 and watch.ours(found)
    assert watch.said[-1].startswith("rank 1 (host h, cpu:1) is 1.6x slower")  # type: ignore[attr-defined]
    assert watch.said[-1].endswith("its replica group restarts and heals")  # type: ignore[attr-defined]
    error = watch.restart_error(found, 90)
    assert "rank 1 (host h, cpu:1) is a straggler" in str(error)
    assert [e["event"] for e in _events(tmp_path)] == ["found", "restarting"]


def test_a_bare_off_in_yaml_turns_the_watch_off() -> None:
    import yaml

    assert StragglerSection.model_validate(yaml.safe_load("action: off")).action == "off"
    with pytest.raises(ValueError, match="action"):
        StragglerSection.model_validate(yaml.safe_load("action: on"))


@pytest.mark.parametrize(
    ("straggler", "fault_tolerance", "expected"),
    [
        ({"action": "restart"}, None, "launch.straggler.action: restart needs fault_tolerance"),
        ({"action": "stop"}, {"enabled": True}, "launch.straggler.action: stop ends replica"),
    ],
)
def test_an_action_the_run_cannot_take_is_refused_naming_the_key(
    tmp_path: Path, straggler: dict, fault_tolerance: dict | None, expected: str
) -> None:
    sections = {"fault_tolerance": fault_tolerance} if fault_tolerance else {}
    spec = _spec(tmp_path, {}, {}, launch={"straggler": straggler}, **sections)
    usage_error(run_train(["validate", "--config", str(spec)], tmp_path), expected)


def test_under_fault_tolerance_the_straggling_group_restarts_and_heals(tmp_path: Path) -> None:
    """Two replica groups of one process: group 1 is 60% slower at its compute in its first
    attempt. Named (by the run's rank) against the other group, it restarts, heals from
    group 0's memory, and both groups end alike."""
    pytest.importorskip("torchft")
    spec = _spec(
        tmp_path,
        {"compute": 0.6, "busy": 0.03, "first_attempt": True},
        {"n_samples": 4096},
        launch={"devices": 2, "max_restarts": 2, "straggler": {"window": 2, "action": "restart"}},
        train={"max_steps": 300, "log_every": 5},
        fault_tolerance={"enabled": True, "replica_groups": 2, "heartbeat_timeout_ms": 1000},
    )
    result = run_train(["--config", str(spec)], tmp_path, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    named = _named(result)
    assert named and named[0].startswith("rank 1 ") and named[0].endswith("in compute"), output
    assert "its replica group restarts and heals" in output
    run_dir = only_run_dir(tmp_path / "runs")
    assert [e["event"] for e in _events(run_dir)][:2] == ["found", "restarting"]
    events = fault_events.read(RunLayout(run_dir).fault_events)
    [loss] = fault_events.summarize(events)
    assert loss["group"] == 1 and loss["heal_s"] is not None and not loss["gave_up"], events
    assert "copying the state of a live replica group" in (run_dir / "logs/rank-1.log").read_text()
    finished = [e for e in events if e["event"] == "finished"]
    assert {(e["group"], e["step"]) for e in finished} == {(0, 300), (1, 300)}, finished
    assert fault_events.groups_agree(events) is True, finished
    # Group 0's record keeps every rank of the run, and when rank 1 was back at its pace.
    summary = json.loads((run_dir / "summary.json").read_text())
    [episode] = summary["stragglers"]
    assert episode["rank"] == 1 and episode["recovered_at"] > episode["found_at"], episode
    record = [r for r in metrics_of(run_dir) if "rank_compute_s" in r][-1]
    assert len(record["rank_compute_s"]) == 2, record


def test_a_stock_hugging_face_model_is_timed_on_every_rank(tmp_path: Path) -> None:
    """A Llama built from its config (`recipes/hf_causal_lm.py`) under fsdp on 2: every rank
    is timed and its waits for the other are found on a model nobody here wrote, and its
    healthy ranks are named by no one."""
    pytest.importorskip("transformers")
    hf = {"source": str(REPO / "recipes/hf_causal_lm.py"), "model": {"family": "llama"},
          "dataset": {"seq_len": 16}}  # fmt: skip
    spec = write_spec(
        tmp_path / "run.yaml", recipe=hf, launch={"devices": 2, "strategy": "fsdp"},
        train={"max_steps": 20, "log_every": 5}, checkpoint={"enabled": False},
        log={"trackers": []},
    )  # fmt: skip
    result = run_train(["--config", str(spec)], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert _named(result) == []
    record = [r for r in metrics_of(only_run_dir(tmp_path / "runs")) if "rank_wait_s" in r][-1]
    assert all(c > 0 for c in record["rank_compute_s"]) and len(record["rank_compute_s"]) == 2
    assert all(w > 0 for w in record["rank_wait_s"]), record  # backward's end, the gathers
