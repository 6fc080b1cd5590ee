"""TPU pods: each host finds its index where torch_xla does, and its ranks follow from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.clusters.tpu_pod import host_index
from launcher.config.spec import RunSpec
from launcher.launch.devices import Devices
from launcher.launch.plan import LaunchPlan


@pytest.mark.parametrize(
    ("env", "index"),
    [
        ({"CLOUD_TPU_TASK_ID": "3"}, 3),
        ({"TPU_WORKER_ID": "2"}, 2),
        ({"CLOUD_TPU_TASK_ID": "1", "TPU_WORKER_ID": "2"}, 1),  # torch_xla's order
        ({"TPU_WORKER_ID": ""}, 0),
        ({"TPU_WORKER_ID": "²", "CLOUD_TPU_TASK_ID": "9" * 5000}, 0),  # not numbers: ignored
        ({}, 0),
    ],
)
def test_the_host_index_comes_from_where_torch_xla_reads_it(env: dict, index: int) -> None:
    assert host_index(env, ask_metadata=False) == index


@pytest.mark.parametrize(
    ("devices", "offset"),
    [(Devices(4, 1, 1), 2), (Devices(4, 1, 4, spawn_all=True), 8)],  # xla_spmd, then xla
)
def test_a_hosts_logs_come_after_the_hosts_before_it(devices: Devices, offset: int) -> None:
    spec = RunSpec.model_validate(
        {"recipe": {"source": "r.py"}, "train": {"max_steps": 1}, "launch": {"strategy": "xla"}}
    )
    plan = LaunchPlan(spec, Path("run"), "tpu", devices, None, None, 1, host_index=2)
    assert plan.rank_offset == offset
    assert plan.worker_plan().rank_offset == offset
    # The hosts share the run folder: this one keeps its own files apart, and leaves the
    # run's spec.yaml to host 0.
    assert plan.node_dir == Path("run/nodes/host-2") and not plan.writes_shared_files
