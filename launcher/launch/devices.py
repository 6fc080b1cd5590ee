"""Which accelerator a run uses, and how many of this machine's devices.

Decided in the launcher before any worker starts. Nothing here initialises a device, and
torch_xla is never imported (that alone takes 4 to 8 s): its presence and its TPUs are found
from package metadata and the PCI bus.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from launcher.errors import UsageError
from launcher.parallel.registry import STRATEGIES, strategy_info
from launcher.plain_number import plain_number

TPU_INSTALL = (
    "pip install 'torch==2.9.0' 'torch_xla[tpu]==2.9.0'   (or: pip install 'launcher[tpu]')"
)
_XLA_EQUIVALENT = {"ddp": "xla", "fsdp": "xla_fsdp"}
_TORCH_EQUIVALENT = {"xla": "ddp", "xla_spmd": "ddp", "xla_fsdp": "fsdp"}


@dataclass(frozen=True)
class Devices:
    """This node's share of a run."""

    count: int  # devices used on this node
    processes: int  # worker processes the elastic agent starts on this node
    replica_logs: int  # rank-N.log files this node writes: one per process or spawned replica
    spawn_all: bool = False  # xla: torch_xla's spawn starts a replica per device (else just 1)
    env: dict[str, str] = field(default_factory=dict)


def resolve_accelerator(requested: str, strategy: str) -> str:
    accelerators = strategy_info(strategy).accelerators
    if requested == "auto":
        if "tpu" in accelerators:
            requested = "tpu"
        else:
            return "gpu" if torch.cuda.is_available() else "cpu"
    if requested not in accelerators:
        if requested == "tpu":
            raise UsageError(
                f"--accelerator tpu: strategy {strategy!r} is for CPUs and GPUs; TPUs use "
                f"{_XLA_EQUIVALENT.get(strategy, 'xla')} (torch_xla)",
                hint=f"Add --strategy {_XLA_EQUIVALENT.get(strategy, 'xla')}.",
            )
        raise UsageError(
            f"--accelerator {requested}: strategy {strategy!r} runs on TPUs through torch_xla; "
            f"on a {requested.upper()} use {_TORCH_EQUIVALENT[strategy]}",
            hint=f"Use --accelerator tpu, or --strategy {_TORCH_EQUIVALENT[strategy]}.",
        )
    if requested == "gpu" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise UsageError(
            f"--accelerator gpu: no CUDA GPU is visible (torch {torch.__version__}, {build})",
            hint="Use --accelerator cpu, or install a CUDA build of torch on a machine with a GPU.",
        )
    if requested == "tpu":
        check_torch_xla()
        if xla_device_type() == "TPU" and tpu_devices() == 0:
            raise UsageError(
                "--accelerator tpu: torch_xla is installed, but no TPU is attached to this "
                "machine (none on its PCI bus)",
                hint="Run on a TPU VM. To try the XLA path on this machine's CPU instead, "
                "set PJRT_DEVICE=CPU (docs/tpus.md, 'XLA on CPU').",
            )
    return requested


def check_torch_xla() -> None:
    """torch_xla is importable and paired with its torch (its wheel does not declare the pin,
    and a mismatched pair fails at import with an undefined symbol)."""
    if importlib.util.find_spec("torch_xla") is None:
        raise UsageError(
            f"--accelerator tpu: torch_xla is not installed in this environment ({sys.executable})",
            hint=f"Install it: {TPU_INSTALL}",
        )
    xla = importlib.metadata.version("torch_xla")
    if xla.split(".")[:2] != torch.__version__.split("+")[0].split(".")[:2]:
        raise UsageError(
            f"--accelerator tpu: torch_xla {xla} needs torch {'.'.join(xla.split('.')[:2])}, "
            f"but this environment has torch {torch.__version__}",
            hint=f"Install the matching pair: {TPU_INSTALL}",
        )


def xla_device_type() -> str:
    """What torch_xla will run on: PJRT_DEVICE, as torch_xla reads it (TPU unless set)."""
    return os.environ.get("PJRT_DEVICE", "TPU").upper()


# torch_xla._internal.tpu counts TPUs the same way (Google's PCI vendor id and TPU device ids);
# v2 and v3 chips hold two devices each.
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = {"0x0027": 2, "0x005e": 1, "0x0063": 1, "0x006f": 1, "0x0076": 1}


def tpu_devices(pci_root: Path = Path("/sys/bus/pci/devices")) -> int:
    count = 0
    for vendor in pci_root.glob("*/vendor"):
        try:
            if vendor.read_text().strip() != _GOOGLE_PCI_VENDOR:
                continue
            count += _TPU_PCI_DEVICES.get((vendor.parent / "device").read_text().strip(), 0)
        except OSError:
            continue
    return count


def cpu_device_limit() -> int:
    """The most CPU "devices" a node may ask for: on CPU each one is a process (or one of
    XLA's CPU devices) sharing the cores, so a few per core is plenty (8 on any machine, for
    tests of an 8-rank layout on a laptop); more is a mistake that would start a process
    bomb."""
    return max(8, 4 * (os.cpu_count() or 1))


def resolve_devices(
    devices: int | str, accelerator: str, strategy: str, named: str | None = None
) -> Devices:
    """This node's devices. `named`: how errors name the value and where it came from (e.g.
    `launch.devices: 3 (run.yaml:12)`); `--devices N` by default."""
    named = named or f"--devices {devices}"
    if accelerator == "tpu":
        return _xla_devices(devices, strategy, named)
    if accelerator == "gpu":
        visible = torch.cuda.device_count()
        if devices != "auto" and int(devices) > visible:
            raise UsageError(
                f"{named}: only {visible} GPU(s) visible on this machine",
                hint="Lower it, or check CUDA_VISIBLE_DEVICES.",
            )
        n = visible if devices == "auto" else int(devices)
        return Devices(n, n, n)
    # On CPU every process is a replica sharing the cores; `auto` keeps to one.
    n = 1 if devices == "auto" else int(devices)
    _check_cpu_count(n, named)
    return Devices(n, n, n)


def _check_cpu_count(n: int, named: str) -> None:
    limit = cpu_device_limit()
    if n > limit:
        raise UsageError(
            f"{named}: {n:,} devices on CPU cannot be meant; the limit is 4 per core, and "
            f"at least 8: {limit} on this machine's {os.cpu_count()} core(s)",
            hint=f"Set it to {limit} or fewer; every CPU process shares the same cores.",
        )


def _xla_devices(devices: int | str, strategy: str, named: str) -> Devices:
    spawn = STRATEGIES[strategy].processes == "xla_spawn"
    kind = xla_device_type()
    if kind == "CPU":
        # XLA's CPU client makes CPU_NUM_DEVICES devices in one process.
        if devices == "auto":
            named = f"CPU_NUM_DEVICES={os.environ.get('CPU_NUM_DEVICES', '1')}"
            n = _cpu_num_devices(named)
        else:
            n = int(devices)
        _check_cpu_count(n, named)
        if spawn and n > 1:
            raise UsageError(
                f"{named}: strategy xla on XLA's CPU devices can only use 1. There, "
                "torch_xla's spawn runs the replicas as threads of one process, and their "
                "collectives hang (an upstream torch_xla bug)",
                hint="Use --devices 1, or --strategy xla_spmd / xla_fsdp, which run on "
                "several CPU devices in one process.",
            )
        return Devices(n, 1, n if spawn else 1, spawn_all=False, env={"CPU_NUM_DEVICES": str(n)})
    if kind != "TPU":
        raise UsageError(
            f"PJRT_DEVICE={os.environ['PJRT_DEVICE']}: the xla strategies run on TPU "
            "(PJRT_DEVICE unset or TPU), or on CPU for testing (PJRT_DEVICE=CPU)"
        )
    available = tpu_devices()
    n = available if devices == "auto" else int(devices)
    if n == available or (spawn and n == 1):
        return Devices(n, 1, n if spawn else 1, spawn_all=spawn and n > 1)
    if spawn:
        raise UsageError(
            f"{named}: torch_xla's spawn starts either 1 replica or one per TPU device, "
            f"and this machine has {available}",
            hint=f"Use --devices 1, or --devices {available} (or auto).",
        )
    raise UsageError(
        f"{named}: strategy {strategy} drives every TPU device of the host ({available})",
        hint="Use --devices auto.",
    )


def _cpu_num_devices(named: str) -> int:
    count = plain_number(os.environ.get("CPU_NUM_DEVICES", "1"))
    if not count:  # None, or 0
        raise UsageError(
            f"{named}: expected a positive number of XLA CPU devices",
            hint="Set CPU_NUM_DEVICES=N, or give --devices N.",
        )
    return count
