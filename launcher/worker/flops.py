"""How fast a run computes: FLOPs per training step, counted for any model, and what a step's
time makes of them (achieved TFLOP/s per device, and MFU where the device's peak is known),
with each rank's peak device memory.

The FLOPs are counted, not assumed from a formula for one model family: the first
micro-batch's forward and backward run under `torch.utils.flop_counter.FlopCounterMode`, which
counts every matmul and convolution as it goes, for any model, strategy and device, and calls
nothing of the recipe's that the step would not call anyway (compiled code runs eagerly under
the counter, for that one micro-batch). A resumed run keeps the count its checkpoint holds when
its batches have the same shapes, so that its steps are those of a run that never stopped.
Under activation checkpointing the recomputed forward counts too. The CPU's fused attention
(`_scaled_dot_product_flash_attention_for_cpu`), which the counter has no formula for, is
counted by torch's own formula for its GPU siblings, and grouped-query attention as attention
over the query's heads. Ops that do a model's heavy work but have
no formula in the counter (a CPU LSTM's `mkldnn_rnn_layer`) are named in one line, once: the
count leaves their work out.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from launcher.metrics.flop_rate import flop_rate_text
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


def count_flops(recipe: Recipe, model: torch.nn.Module, batch: Any) -> int:
    """FLOPs of one micro-batch's forward and backward through the recipe's loss, on `model`
    built on the meta device, where nothing is computed (the benchmarks' count)."""
    meta_batch = map_tensors(batch, lambda t: torch.empty_like(t, device="meta"))
    with flop_counter() as counter:
        loss, _ = recipe.loss(model, meta_batch)
        loss.backward()
    return int(counter.get_total_flops())


def flop_counter() -> Any:
    """torch's `FlopCounterMode`, silent, with torch's attention formulas given key-value heads
    broadcast to the query's (`attention_formulas`)."""
    from torch.utils import flop_counter

    counter = flop_counter.FlopCounterMode(display=False, custom_mapping=attention_formulas())
    if hasattr(counter, "mod_tracker"):
        counter.mod_tracker = _TotalOnly()
    return counter


# The fused attention ops (query, key, value of shape [batch, heads, length, dim] first, the
# gradient of the output before them backward): the GPU kernels', whose formulas torch has,
# and the CPU's, which it has none for.
_ATTENTION = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)


def attention_formulas() -> dict[Any, Any]:
    """torch's formulas for each fused attention op of this torch, forward and backward, over
    shapes, given key and value with the query's heads: grouped-query attention (fewer
    key-value heads, `enable_gqa`) costs what the kernels broadcast it to, and torch 2.9 and
    2.11's formulas refuse its shapes. The counter wraps what it is given (shapes in place of
    tensors), so it is given the formulas unwrapped."""
    from torch.utils import flop_counter

    forward = flop_counter.sdpa_flop.__wrapped__
    backward = flop_counter.sdpa_backward_flop.__wrapped__
    formulas: dict[Any, Any] = {}
    for name in _ATTENTION:
        for op_name, count in (
            (name, _forward(forward)),
            (f"{name}_backward", _backward(backward)),
        ):
            op = getattr(torch.ops.aten, op_name, None)
            if op is not None:
                formulas[op] = count
    return formulas


def _query_heads(shape: Any, query: Any) -> Any:
    """A key's or value's shape [b, h, s, d] with the query's heads."""
    return (shape[0], query[1], *shape[2:]) if len(shape) == 4 == len(query) else shape


def _forward(formula: Any) -> Any:
    def count(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
        return formula(query, _query_heads(key, query), _query_heads(value, query), *args, **kwargs)

    return count


def _backward(formula: Any) -> Any:
    def count(grad: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
        heads = (_query_heads(key, query), _query_heads(value, query))
        return formula(grad, query, *heads, *args, **kwargs)

    return count


class _TotalOnly:
    """In place of `FlopCounterMode`'s module tracker, which sorts each count under the
    modules that ran it: the launcher reads the total alone, and the tracker's gradient hooks
    (`register_multi_grad_hook`) fail a pipeline schedule's backward that runs as
    `autograd.grad` (ZBVZeroBubble's)."""

    parents = ("Global",)  # where the counter files every count: `get_total_flops` reads it

    def __enter__(self) -> _TotalOnly:
        return self

    def __exit__(self, *args: object) -> None:
        return None


def shapes_of(batch: Any) -> list[list[int]]:
    """The shape of every tensor in a batch, in order: what a FLOP count depends on."""
    found: list[list[int]] = []
    map_tensors(batch, lambda t: found.append(list(t.shape)))
    return found


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
        self._count: dict[str, Any] | None = None
        self._restored: dict[str, Any] | None = None  # a checkpoint's count

    @contextlib.contextmanager
    def counting(self, batch: Any) -> Iterator[None]:
        """Around one micro-batch's forward and backward: counts them, the first time."""
        if self.counted:
            yield
            return
        self.counted = True
        shapes = shapes_of(batch)
        if self._restored is not None and self._restored.get("shapes") == shapes:
            restored = self._restored
            self._counted(restored["flops_per_micro_batch"], shapes, restored.get("uncounted", []))
            yield
            return
        # Compiled code under a dispatch mode would be skipped for good; forced eager for this
        # micro-batch, it compiles at the next one, as it would have at this one.
        # The ops the counter runs in the end (it decomposes those it has no formula for into
        # ones it may have) reach `ran`, below it.
        with (
            torch.compiler.set_stance("force_eager"),
            _OpsRun() as ran,
            flop_counter() as counter,
        ):
            yield
        uncounted = _uncounted(ran.ops, counter.flop_registry)
        self._counted(int(counter.get_total_flops()), shapes, uncounted)

    def _counted(self, flops: int, shapes: list[list[int]], uncounted: list[str]) -> None:
        self._count = {"flops_per_micro_batch": flops, "shapes": shapes, "uncounted": uncounted}
        self.per_step = round(flops * self.per_process)
        note = uncounted_note(flops, uncounted)
        if note:
            print(note, flush=True)  # every rank: the display folds the same lines into one

    def state_dict(self) -> dict[str, Any] | None:
        """The count, for the checkpoint: a resumed run with the same batch shapes keeps it."""
        return self._count

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self._restored = state

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


class _OpsRun(TorchDispatchMode):
    """Records the name of every op that runs (`aten.mm`) while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.add(str(func._overloadpacket))
        return func(*args, **(kwargs or {}))


# Names of the ops that do a model's heavy work: matmuls, convolutions, attention, RNNs.
_HEAVY = re.compile(r"mm|mv|dot|matmul|linear|einsum|conv|attention|rnn|lstm|gru")


def _uncounted(ops: set[str], registry: dict[Any, Any]) -> list[str]:
    """The ops of `ops` that do heavy work but have no formula in the counter's `registry`."""
    counted = {str(packet) for packet in registry}
    return sorted(op for op in ops if _HEAVY.search(op) and op not in counted)


def uncounted_note(flops: int, uncounted: list[str]) -> str | None:
    """One line on what the FLOP count leaves out (None: nothing known), and why."""
    if uncounted:
        ops = ", ".join(uncounted)
        if flops == 0:
            return (
                f"FLOPs not counted: torch.utils.flop_counter has no formula for {ops}, which "
                "did the step's work: no TFLOP/s or MFU is reported"
            )
        return (
            f"FLOPs partly counted: torch.utils.flop_counter has no formula for {ops}: "
            "TFLOP/s and MFU leave their work out"
        )
    if flops == 0:
        return (
            "FLOPs not counted: the step ran no matmul, convolution or attention that "
            "torch.utils.flop_counter counts: no TFLOP/s or MFU is reported"
        )
    return None


def describe(fields: dict[str, float]) -> str:
    """The log line's part: ` | 39.1 TFLOP/s | MFU 39.6% | mem 12.3/14.0 GiB`."""
    text = ""
    if "tflops_per_device" in fields:  # a CPU's in GFLOP/s or MFLOP/s, not 3.51e-05 TFLOP/s
        text += f" | {flop_rate_text(fields['tflops_per_device'])}"
    if "mfu" in fields:
        text += f" | MFU {100 * fields['mfu']:.1f}%"
    if "max_memory_allocated_gib" in fields:
        allocated, reserved = fields["max_memory_allocated_gib"], fields["max_memory_reserved_gib"]
        text += f" | mem {allocated:.1f}/{reserved:.1f} GiB"
    return text


def _figures(value: float) -> float:
    return float(f"{value:.4g}")  # a CPU's 0.005 TFLOP/s keeps its digits too
