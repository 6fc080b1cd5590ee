"""A FLOP rate as a person reads it, whatever the device: 391.2 TFLOP/s on a GPU, 35.1 GFLOP/s
on a CPU, rather than 3.51e-02 TFLOP/s. The log line (`launcher.worker.flops`) and the live
table (`launcher.launch.display.status`) both show it so."""

from __future__ import annotations

_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def flop_rate(tflops: float) -> tuple[str, str]:
    """`tflops` (TFLOP/s, as metrics.jsonl records it) as a number and its SI prefix:
    `("391.2", "T")`, `("35.1", "G")`; three significant digits below 10, one decimal above
    (a GPU's 2,250 TFLOP/s stays in TFLOP/s, the unit its peak is known by)."""
    rate = tflops * 1e12
    scale, prefix = next(((s, p) for s, p in _PREFIXES if abs(rate) >= s), (1.0, ""))
    value = rate / scale
    return (f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"), prefix


def flop_rate_text(tflops: float) -> str:
    """e.g. `391.2 TFLOP/s`, `35.1 GFLOP/s`, `812 MFLOP/s`."""
    number, prefix = flop_rate(tflops)
    return f"{number} {prefix}FLOP/s"
