"""The tiny recipe the tests train: a linear regression (or one hidden layer) on a seeded
TensorDataset, with the knobs the tests vary as `recipe.model` and `recipe.dataset` keys.

Used three ways: as a recipe file itself (`tiny_recipe()`, a spec's `recipe` section); as the
base of a recipe file in a test's folder that adds hooks or replaces one function
(`write_recipe(folder, hooks)`: the hooks reach the shared functions as `tiny.<name>`); and
imported by tests that compute what a run should have computed.

torch is imported inside the functions: conftest takes `FAULTY_RECIPE` from here, and the
launcher-only tests must not pay for torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


def build_model(width: int = 4, hidden: int = 0, bias: bool = True) -> Any:
    """`nn.Linear(width, 1)`; with `hidden`, `Linear(width, hidden), ReLU, Linear(hidden, 1)`
    in a Sequential (tensor parallelism splits its layers "0" and "2")."""
    from torch import nn

    if not hidden:
        return nn.Linear(width, 1, bias=bias)
    return nn.Sequential(nn.Linear(width, hidden, bias=bias), nn.ReLU(), nn.Linear(hidden, 1))


def build_dataset(
    split: str,
    n_samples: int = 512,
    width: int = 4,
    target: str = "noise",
    out_width: int = 1,
    seed: int = 0,
    val_seed: int | None = None,
    scale: float = 1.0,
) -> Any:
    """`TensorDataset(x[n_samples, width], y)`, x drawn from a generator seeded `seed` (or
    `val_seed` for the val split; by default val is train), times `scale`. `target`: "noise"
    (y[n, out_width] drawn after x from the same generator, times `scale`: nothing to learn)
    or "sum" (y = x summed over its features: learnable)."""
    import torch
    from torch.utils.data import TensorDataset

    if target not in ("noise", "sum"):
        raise ValueError(f"target: expected 'noise' or 'sum', got {target!r}")
    g = torch.Generator().manual_seed(seed if split == "train" or val_seed is None else val_seed)
    x = torch.randn(n_samples, width, generator=g) * scale
    if target == "sum":
        return TensorDataset(x, x.sum(1, keepdim=True))
    return TensorDataset(x, torch.randn(n_samples, out_width, generator=g) * scale)


def loss(model: Any, batch: Any) -> Any:
    """Mean squared error of `(x, y)` batches."""
    from torch import nn

    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def recipe_text(hooks: str = "") -> str:
    """The source of a recipe file: the tiny recipe's three functions, the module itself as
    `tiny`, then `hooks` (source text), whose own definitions replace the shared ones."""
    # tests/ leaves sys.path at once: its folders (data, metrics...) are no modules of a run.
    return (
        "import sys\n"
        f"sys.path.insert(0, {str(HERE.parent)!r})\n"
        "import tiny_recipes as tiny\n"
        "from tiny_recipes import build_dataset, build_model, loss  # noqa: F401\n"
        f"sys.path.remove({str(HERE.parent)!r})\n"
        f"{hooks}"
    )


def write_recipe(folder: Path, hooks: str = "", name: str = "recipe.py") -> Path:
    """`folder/name` holding `recipe_text(hooks)`; returns its path."""
    path = folder / name
    path.write_text(recipe_text(hooks))
    return path


def tiny_recipe(
    source: Path | str | None = None, model: dict | None = None, **dataset: Any
) -> dict:
    """A spec's `recipe` section: `source` (default: this file) with `model` and `dataset`
    keywords (every one not given takes the function's default)."""
    return {"source": str(source or HERE), "model": model or {}, "dataset": dataset}


# Misbehaves on demand: $FAULT at micro-step $FAULT_AT (default 4) of rank
# $FAULT_RANK (default 1): raise, sleep (hang), segv, flood (FLOOD_MB MiB of log, then raise),
# flood-then-hang; or slow (every step sleeps 0.1 s), or
# shrink (every rank, from that step on, drops one sample: a new shape). FAULT_OTHERS=sleep:
# the other ranks sleep in that micro-step, outside any collective. The tests give it
# `dataset: {}`: the tiny recipe's 512 samples.
FAULTY_RECIPE = recipe_text("""
import ctypes, os, time

calls = 0
FAULT = os.environ.get("FAULT", "")
AT = int(os.environ.get("FAULT_AT", "4"))
HERE = os.environ.get("RANK") == os.environ.get("FAULT_RANK", "1")


def loss(model, batch):
    global calls
    calls += 1
    x, y = batch
    if FAULT == "slow":
        time.sleep(0.1)
    if FAULT == "shrink" and calls >= AT:
        x, y = x[:-1], y[:-1]
    if calls == AT and not HERE and os.environ.get("FAULT_OTHERS") == "sleep":
        time.sleep(3600)
    if calls == AT and HERE:
        if FAULT == "raise":
            with open("crashed_at", "w") as f:
                f.write(repr(time.time()))
            raise RuntimeError(f"boom on rank {os.environ['RANK']}")
        if FAULT == "sleep":
            open("sleeping", "w").close()  # tests wait for this, not for a step
            time.sleep(3600)
        if FAULT == "segv":
            ctypes.string_at(0)
        if FAULT.startswith("flood"):  # FLOOD_MB MiB of log, then raise or hang
            for _ in range(int(os.environ.get("FLOOD_MB", "500")) * 1024):
                sys.stderr.write("x" * 1023 + "\\n")
            if FAULT == "flood-then-hang":
                time.sleep(3600)
            raise RuntimeError(f"boom on rank {os.environ['RANK']} after a flood")
    return tiny.loss(model, (x, y))
""")
