"""A healing replica group's copy of a live group's state, two ways, in one process on
loopback: the launcher's state server (`launcher.replicas.peer_state`: the run's token asked,
tensors and plain values loaded with `weights_only=True`) against torchft's own HTTPTransport
(every interface, no token, full pickle), which it replaces.

    python bench/peer_state_transfer.py [--mb 256] [--repeats 5]

Each way: one group serves the state (`send_checkpoint`), another fetches it
(`recv_checkpoint`) and the server stops serving (`disallow_checkpoint`); seconds from the
send to the state in the receiver's hands, after one untimed copy each, the two ways
alternated, median over the repeats. Writes
bench/results/peer_state_transfer.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from launcher.replicas.peer_state import PeerStateServer  # noqa: E402

TIMEOUT = timedelta(seconds=120)


def state_of(mb: int) -> dict[str, Any]:
    """Weights and an optimizer's two moments, `mb` MiB in all, in tensors of 4 MiB, and the
    loop's plain values."""
    count = max(1, mb // 12)
    weights = {f"layer{i}.weight": torch.randn(1024, 1024) for i in range(count)}
    moments = {k: {"exp_avg": torch.randn(1024, 1024), "exp_avg_sq": torch.rand(1024, 1024)}
               for k in weights}  # fmt: skip
    return {"model": {"model": weights, "optim": {"state": moments}}, "loop": {"step": 7}}


def timed(sender: Any, receiver: Any, state: dict[str, Any], repeats: int) -> list[float]:
    seconds = []
    for step in range(1, repeats + 1):
        started = time.perf_counter()
        sender.send_checkpoint([1], step, state, TIMEOUT)
        got = receiver.recv_checkpoint(0, sender.metadata(), step, TIMEOUT)
        sender.disallow_checkpoint()
        seconds.append(time.perf_counter() - started)
        assert torch.equal(
            got["model"]["model"]["layer0.weight"], state["model"]["model"]["layer0.weight"]
        )
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/peer_state_transfer.json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    from torchft.checkpointing.http_transport import HTTPTransport

    state = state_of(args.mb)
    mb = sum(t.numel() * 4 for t in _tensors(state)) / 2**20
    ours = [PeerStateServer("127.0.0.1", "127.0.0.1", "token", TIMEOUT) for _ in range(2)]
    theirs = [HTTPTransport(timeout=TIMEOUT, num_chunks=0) for _ in range(2)]
    timed(*ours, state, 1), timed(*theirs, state, 1)  # warm-up: first connections, allocator
    results: dict[str, Any] = {"mb": round(mb, 1), "launcher_s": [], "torchft_http_s": []}
    for _ in range(args.repeats):  # alternated, so that a busy moment costs both alike
        results["launcher_s"] += timed(*ours, state, 1)
        results["torchft_http_s"] += timed(*theirs, state, 1)
    for transport in (*ours, *theirs):
        transport.shutdown(wait=False)
    medians = {k: statistics.median(results[k]) for k in ("launcher_s", "torchft_http_s")}
    results["ratio"] = medians["launcher_s"] / medians["torchft_http_s"]
    print(f"{mb:.0f} MiB of state, {args.repeats} copies each, medians:")
    print(f"  the launcher's state server: {medians['launcher_s']:.3f} s")
    print(f"  torchft's HTTPTransport:     {medians['torchft_http_s']:.3f} s")
    print(f"  ratio: x{results['ratio']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    return []


if __name__ == "__main__":
    main()
