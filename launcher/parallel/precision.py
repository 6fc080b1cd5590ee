"""Autocast and gradient scaling for fp32, bf16 and fp16, on any torch device type."""

from __future__ import annotations

import contextlib
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# The one map from a precision name in the spec to a torch dtype.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_of(name: str | None) -> torch.dtype | None:
    """The dtype a spec names; None where the spec leaves it to torch."""
    return DTYPES[name] if name is not None else None


# CPU flags of native bf16 arithmetic: x86's AVX512-BF16 and AMX, aarch64's BF16.
_FAST_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


def cpu_has_fast_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes in bf16 natively (`cpuinfo`: /proc/cpuinfo's text). Without
    it, bf16 autocast converts every operand and measured 4x slower than fp32."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:  # not Linux: torch can tell on x86; elsewhere, rather no false alarm
            if platform.machine().lower() not in ("x86_64", "amd64"):
                return True
            return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    flags = {
        flag
        for line in cpuinfo.splitlines()
        if line.split(":")[0].strip() in ("flags", "Features")
        for flag in line.partition(":")[2].split()
    }
    return bool(flags & _FAST_BF16_FLAGS)


def slow_bf16_note(precision: str, device_type: str) -> str | None:
    """The one line to say where bf16 would slow a CPU run down; None elsewhere."""
    if precision != "bf16" or device_type != "cpu" or cpu_has_fast_bf16():
        return None
    return (
        "train.precision: bf16 on a CPU without native bf16 arithmetic (no avx512_bf16 or "
        "amx_bf16 flag): autocast emulates it, about 4x slower than fp32; fp32 is faster here"
    )


class MixedPrecision:
    def __init__(self, precision: str, device_type: str) -> None:
        self.dtype = DTYPES[precision]
        self.device_type = device_type
        note = slow_bf16_note(precision, device_type)
        if note and (not dist.is_initialized() or dist.get_rank() == 0):
            print(note, flush=True)
        # fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none.
        self.scaler = (
            torch.amp.GradScaler(device_type)
            if precision == "fp16" and device_type == "cuda"
            else None
        )

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.dtype == torch.float32:  # full precision: no autocast at all
            yield
            return
        with torch.autocast(self.device_type, dtype=self.dtype):
            yield

    @contextlib.contextmanager
    def example_autocast(self) -> Iterator[None]:
        """The same autocast on CPU: for a run on the model's CPU copy whose dtypes stand for
        the device's (a pipeline's example activations)."""
        if self.dtype == torch.float32:
            yield
            return
        with torch.autocast("cpu", dtype=self.dtype):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Call before clipping, so the norm is of the true gradients."""
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()

    def skip(self) -> None:
        """A step dropped after `unscale`: the scaler starts its next step afresh."""
        if self.scaler:
            self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)
