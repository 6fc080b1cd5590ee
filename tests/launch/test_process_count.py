"""A process count nobody can mean (100,000 CPU workers) is refused before anything starts,
naming where it came from: `--devices`, the key `launch.devices`, or Kubeflow's
PET_NPROC_PER_NODE (issue 39, item 3)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from launcher.errors import UsageError
from launcher.launch.devices import cpu_device_limit, resolve_devices
from launcher.launch.plan import make_plan
from tests.conftest import bare_spec, free_port, usage_error, write_spec
from tests.forked_train import train_in_fork

TOO_MANY = 100_000


def test_the_cpu_limit_is_four_a_core_and_never_below_eight(tmp_path: Path) -> None:
    limit = cpu_device_limit()
    assert limit == max(8, 4 * (os.cpu_count() or 1))
    assert resolve_devices(8, "cpu", "ddp").processes == 8  # 8 ranks on a 2-core laptop
    assert resolve_devices(limit, "cpu", "ddp").processes == limit
    with pytest.raises(UsageError) as refused:
        resolve_devices(limit + 1, "cpu", "ddp")
    assert refused.value.message.startswith(f"--devices {limit + 1}: ")
    assert f"4 per core, and at least 8: {limit}" in refused.value.message


@pytest.mark.parametrize(
    ("source", "named"),
    [
        (None, f"--devices {TOO_MANY}: "),
        ("--devices (over run.yaml:4)", f"--devices {TOO_MANY}: "),
        ("run.yaml:4", f"launch.devices: {TOO_MANY} (run.yaml:4): "),
        (
            f"override launch.devices={TOO_MANY}",
            f"launch.devices: {TOO_MANY} (override launch.devices={TOO_MANY}): ",
        ),
        (
            "PET_NPROC_PER_NODE (Kubeflow PyTorchJob demo) (over run.yaml:4)",
            f"PET_NPROC_PER_NODE={TOO_MANY} (Kubeflow PyTorchJob demo): ",
        ),
    ],
)
def test_the_plan_names_where_the_count_came_from(
    tmp_path: Path, source: str | None, named: str
) -> None:
    sources = {"launch.devices": source} if source else {}
    with pytest.raises(UsageError) as refused:
        make_plan(bare_spec(tmp_path, devices=TOO_MANY), sources=sources)
    assert refused.value.message.startswith(named), refused.value.message
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("env", "devices", "named"),
    [
        ({"CPU_NUM_DEVICES": str(TOO_MANY)}, "auto", f"CPU_NUM_DEVICES={TOO_MANY}: "),
        ({"CPU_NUM_DEVICES": "²"}, "auto", "CPU_NUM_DEVICES=²: expected a positive number"),
        ({}, TOO_MANY, f"--devices {TOO_MANY}: "),
    ],
)
def test_xlas_cpu_devices_have_the_same_limit(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], devices: int | str, named: str
) -> None:
    """XLA's CPU client makes CPU_NUM_DEVICES devices in one process (torch_xla is not needed
    to decide how many)."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(UsageError) as refused:
        resolve_devices(devices, "tpu", "xla_spmd")
    assert refused.value.message.startswith(named), refused.value.message
    monkeypatch.setenv("CPU_NUM_DEVICES", "4")
    assert resolve_devices("auto", "tpu", "xla_spmd").count == 4


def _refused_before_anything_starts(
    result: subprocess.CompletedProcess[str], tmp_path: Path, *expected: str
) -> None:
    usage_error(result, *expected)
    assert not (tmp_path / "runs").exists()  # no run folder, so no worker plan, no worker
    assert "[rank" not in result.stdout + result.stderr
    assert len((result.stdout + result.stderr).strip().splitlines()) <= 3


@pytest.mark.timeout(60)
def test_train_refuses_a_process_bomb_by_flag_and_by_key(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "run.yaml")  # launch.devices: 2
    result = train_in_fork(
        ["--config", str(spec), "--devices", str(TOO_MANY)], tmp_path, timeout=40
    )
    _refused_before_anything_starts(result, tmp_path, f"--devices {TOO_MANY}: ")
    spec = write_spec(tmp_path / "run.yaml", launch={"devices": TOO_MANY})
    result = train_in_fork(["--config", str(spec)], tmp_path, timeout=40)
    _refused_before_anything_starts(result, tmp_path, f"launch.devices: {TOO_MANY} ({spec}:")


@pytest.mark.timeout(60)
def test_train_refuses_a_process_bomb_from_a_kubeflow_pod(tmp_path: Path) -> None:
    """The probe of issue 39: torchrun's four rendezvous variables (pointing at loopback)
    and PET_NPROC_PER_NODE=100000 started workers until the machine stalled."""
    spec = write_spec(tmp_path / "run.yaml")
    # One node: nothing to wait for, so the old launcher went straight to starting workers.
    pod = {"PET_NNODES": "1", "PET_NODE_RANK": "0", "PET_NPROC_PER_NODE": str(TOO_MANY)}
    pod |= {"PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(free_port())}
    pod |= {"HOSTNAME": "demo-master-0"}
    result = train_in_fork(["--config", str(spec)], tmp_path, timeout=40, env=pod)
    expected = f"PET_NPROC_PER_NODE={TOO_MANY} (Kubeflow PyTorchJob demo): "
    _refused_before_anything_starts(result, tmp_path, expected)
