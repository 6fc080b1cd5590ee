"""Autocast and gradient scaling for fp32, bf16 and fp16, on any torch device type."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

# The one map from a precision name in the spec to a torch dtype.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_of(name: str | None) -> torch.dtype | None:
    """The dtype a spec names; None where the spec leaves it to torch."""
    return DTYPES[name] if name is not None else None


class MixedPrecision:
    def __init__(self, precision: str, device_type: str) -> None:
        self.dtype = DTYPES[precision]
        self.device_type = device_type
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
