"""What the hand-written Hugging Face peers (bench/handwritten_hf_pipeline.py,
bench/handwritten_hf_ep.py) share: their command line, recipes/hf_causal_lm.py's model with
the weights the launcher gives it, the batches as the launcher feeds a data-parallel rank, and
the summary they write. Each is what a careful user writes by hand, so none of this calls the
launcher.

Imported from a script in bench/ (`import hf_peer`), whose folder is then first on `sys.path`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler
from transformers import PreTrainedModel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
import hf_causal_lm


def parser(doc: str, batch_help: str, layers: int) -> argparse.ArgumentParser:
    """The arguments both peers take (a step, the optimizer, the seed, the recipe's model and
    data, where rank 0 writes); each adds its own model's."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=8, help=batch_help)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--clip", type=float, default=1.0, help="the global gradient norm")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--out", type=Path, required=True)
    return parser


def build_model(args: argparse.Namespace, family: str, **shape: Any) -> PreTrainedModel:
    """The recipe's `family` model with the weights the launcher gives it: the constructors
    from the seed, then the model's own init from the seed once more (`init_hf_weights`).
    `shape`: the family's own arguments besides those of `parser`."""
    torch.manual_seed(args.seed)
    model = hf_causal_lm.build_model(
        family=family, vocab_size=args.vocab_size, hidden=args.hidden, layers=args.layers,
        heads=args.heads, kv_heads=args.kv_heads, **shape,
    )  # fmt: skip
    # post_init marks every module initialised, after which init_weights would draw nothing.
    for owner in itertools.chain(model.modules(), model.parameters(), model.buffers()):
        vars(owner).pop("_is_hf_initialized", None)
    torch.manual_seed(args.seed)
    model.init_weights()
    return model


def batches(
    args: argparse.Namespace, replicas: int = 1, rank: int = 0
) -> Iterator[dict[str, torch.Tensor]]:
    """The recipe's train split as the launcher feeds data-parallel rank `rank` of
    `replicas`: its share, shuffled by the run's seed, epoch after epoch."""
    dataset = hf_causal_lm.build_dataset("train", seq_len=args.seq_len, vocab_size=args.vocab_size)
    sampler = DistributedSampler(
        dataset, num_replicas=replicas, rank=rank, shuffle=True, seed=args.seed, drop_last=True
    )
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from loader


def summary(step_times: list[float], losses: list[float], first_end: float) -> dict:
    """The launcher's summary.json format (final_loss: the last step's, as the launcher's with
    `train.log_every: 1`), and every step's loss."""
    return {
        "final_loss": losses[-1],
        "steps_run": len(step_times),
        "first_step_end_unix": first_end,
        "step_times_s": step_times,
        "losses": losses,
    }


def run(train: Callable[[], dict], out: Path) -> None:
    """`train` in a gloo process group of torchrun's processes; rank 0 writes the summary it
    returns to `out`."""
    if "LOCAL_RANK" not in os.environ:
        sys.exit("run this under torchrun; see the module docstring")
    dist.init_process_group("gloo")
    written = train()
    if dist.get_rank() == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(written))
    dist.destroy_process_group()
