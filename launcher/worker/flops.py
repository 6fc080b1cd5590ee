"""How fast a run computes: FLOPs per training step, counted for any model, and what a step's
time makes of them (achieved TFLOP/s per device, and MFU where the device's peak is known),
with each rank's peak device memory.

The FLOPs are counted, not assumed from a formula for one model family: the recipe's model is
built again on the meta device and one micro-batch's forward and backward run through
`torch.utils.flop_counter.FlopCounterMode`, once, at the first step. On meta tensors nothing
is computed or allocated, so it costs milliseconds whatever the model's size. (Counting the
real step would not do: a compiled block hides its matmuls from the counter.)
"""

from __future__ import annotations

from typing import Any

import torch

from launcher.parallel import rng
from launcher.parallel.base import map_tensors
from launcher.worker.recipe import Recipe

# Dense peak FLOP/s by device name (the first match wins, so specific names come first), for
# 16-bit tensor-core math, TF32 and plain fp32; torchtitan keeps the same table. From NVIDIA's
# data sheets, without sparsity.
PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bf16": 756e12, "tf32": 378e12, "fp32": 51e12}),
    ("H100 NVL", {"bf16": 835e12, "tf32": 417.5e12, "fp32": 60e12}),
    ("H100", {"bf16": 989e12, "tf32": 494.5e12, "fp32": 67e12}),  # SXM
    ("H200", {"bf16": 989e12, "tf32": 494.5e12, "fp32": 67e12}),
    ("B200", {"bf16": 2.25e15, "tf32": 1.1e15, "fp32": 80e12}),
    ("A100", {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
)
GIB = 2**30


def peak_flops(device_name: str | None, precision: str, tf32: bool) -> float | None:
    """The device's dense peak for the run's math; None where it is not known (CPUs, TPUs,
    GPUs missing from the table)."""
    if device_name is None:
        return None
    math = "bf16" if precision in ("bf16", "fp16") else ("tf32" if tf32 else "fp32")
    for name, peaks in PEAKS:
        if name in device_name:
            return peaks[math]
    return None


def count_flops(recipe: Recipe, model_kwargs: dict[str, Any], batch: Any) -> int:
    """FLOPs of one micro-batch's forward and backward, on a meta copy of the model built by
    a fresh copy of the recipe's module, so that the training's recipe sees no extra call."""
    from torch.utils.flop_counter import FlopCounterMode

    state = rng.rng_state()  # a constructor may draw from Python's or numpy's generators
    try:
        recipe = recipe.fresh_copy()
        with torch.device("meta"):
            model = recipe.build_model(**model_kwargs)
        meta_batch = map_tensors(batch, lambda t: torch.empty_like(t, device="meta"))
        with FlopCounterMode(display=False) as counter:
            loss, _ = recipe.loss(model, meta_batch)
            loss.backward()
        return int(counter.get_total_flops())
    finally:
        rng.set_rng_state(state)


class Speed:
    """The run's FLOPs per step and per device, and the figures each log line reports."""

    def __init__(
        self, device: torch.device, precision: str, tf32: bool, per_process: float
    ) -> None:
        self.device = device
        cuda = device.type == "cuda"
        self.peak = peak_flops(
            torch.cuda.get_device_name(device) if cuda else None, precision, tf32
        )
        self.per_process = per_process  # micro-batches per step / devices per process
        self.per_step: int | None = None  # FLOPs per optimizer step per device
        self.counted = False

    def count(self, recipe: Recipe, model_kwargs: dict[str, Any], batch: Any) -> str | None:
        """Counts once; returns a line to say where the FLOPs could not be counted."""
        if self.counted:
            return None
        self.counted = True
        try:
            flops = count_flops(recipe, model_kwargs, batch)
        except Exception as exc:  # a model that reads values (.item()) cannot run on meta
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            return f"FLOPs not counted (the model does not run on the meta device: {reason[:160]})"
        self.per_step = round(flops * self.per_process)
        return None

    def fields(self, seconds_per_step: float) -> dict[str, float]:
        """TFLOP/s per device, MFU and this rank's peak device memory, where known."""
        out: dict[str, float] = {}
        if self.per_step and seconds_per_step > 0:
            achieved = self.per_step / seconds_per_step
            out["tflops_per_device"] = _figures(achieved / 1e12)
            if self.peak:
                out["mfu"] = _figures(achieved / self.peak)
        if self.device.type == "cuda":
            out["max_memory_allocated_gib"] = round(
                torch.cuda.max_memory_allocated(self.device) / GIB, 3
            )
            out["max_memory_reserved_gib"] = round(
                torch.cuda.max_memory_reserved(self.device) / GIB, 3
            )
        return out

    def summary(self, median_step_s: float | None) -> dict[str, Any]:
        """summary.json's figures: FLOPs per step and device, and at the median step time."""
        out: dict[str, Any] = {"flops_per_step": self.per_step, "peak_flops": self.peak}
        if median_step_s:
            out.update(self.fields(median_step_s))
        return out


def describe(fields: dict[str, float]) -> str:
    """The log line's part: ` | 39.1 TFLOP/s | MFU 39.6% | mem 12.3/14.0 GiB`."""
    text = ""
    if "tflops_per_device" in fields:
        tflops = fields["tflops_per_device"]
        text += f" | {tflops:.1f} TFLOP/s" if tflops >= 10 else f" | {tflops:.3g} TFLOP/s"
    if "mfu" in fields:
        text += f" | MFU {100 * fields['mfu']:.1f}%"
    if "max_memory_allocated_gib" in fields:
        allocated, reserved = fields["max_memory_allocated_gib"], fields["max_memory_reserved_gib"]
        text += f" | mem {allocated:.1f}/{reserved:.1f} GiB"
    return text


def _figures(value: float) -> float:
    return float(f"{value:.4g}")  # a CPU's 0.005 TFLOP/s keeps its digits too
