"""`train.float8`: the model's large linear layers run their matrix products in float8, through
torchao's float8 training (dynamic tensorwise scaling), as torchtitan's float8 converter does.

The layers are swapped for torchao's `Float8Linear` right after the model is built, before
tensor parallelism, compilation and sharding, so that `train.compile` fuses the casts to
float8 into the blocks' graphs (without it the casts cost more than float8 saves). Which
layers: torchao's own filter for tensorwise scaling (both dimensions multiples of 16, and
large enough that float8 is faster; measured on H100s by torchao), less the model's output
head (its last linear layer), which torchtitan also keeps in higher precision for the loss's
sake. The rest of the model runs in `train.precision`.

Only GPUs with float8 tensor cores run it (compute capability 8.9 and up: Ada, Hopper,
Blackwell); the launch refuses it elsewhere in one line (`refusal`), before anything starts.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING

from launcher.errors import UsageError

if TYPE_CHECKING:  # the launcher's process checks the option without importing torch
    from torch import nn

KEY = "train.float8"
MIN_CAPABILITY = (8, 9)
CARDS = "compute capability 8.9 or newer: L4, L40S, H100, H200, B200"
INSTALL_HINT = "Install torchao (pip install 'launcher[float8]'), or set train.float8: false."


def refusal(accelerator: str, tp: int, capability: tuple[int, int] | None) -> str | None:
    """Why this run cannot train in float8, in one line; None where it can. `capability`:
    the first GPU's compute capability (None: no GPU is visible)."""
    if accelerator != "gpu":
        return (
            f"{KEY}: float8 training needs a GPU with float8 tensor cores ({CARDS}); this "
            f"run is on {accelerator}"
        )
    if tp > 1:
        return f"{KEY}: not available with tensor parallelism (parallel.tp: {tp}) yet"
    if importlib.util.find_spec("torchao") is None:
        return f"{KEY}: needs torchao, which is not installed in this environment"
    if capability is not None and capability < MIN_CAPABILITY:
        major, minor = capability
        return (
            f"{KEY}: this GPU (compute capability {major}.{minor}) has no float8 tensor "
            f"cores; float8 training needs {CARDS}"
        )
    return None


def check(accelerator: str, tp: int, capability: tuple[int, int] | None) -> None:
    """`refusal` as a UsageError (exit 2), with what to do."""
    why = refusal(accelerator, tp, capability)
    if why is not None:
        hint = INSTALL_HINT if "torchao" in why else f"Set {KEY}: false, or run on such a GPU."
        raise UsageError(why, hint=hint)


def convert(model: nn.Module) -> str:
    """Swaps `model`'s eligible linear layers for torchao's `Float8Linear` in place (on any
    device, meta included); returns the line that says how many."""
    from torch import nn
    from torchao.float8 import (
        Float8LinearConfig,
        _auto_filter_for_recipe,
        convert_to_float8_training,
    )

    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    head = linears[-1] if linears else None
    fast_enough = _auto_filter_for_recipe("tensorwise", filter_fqns=[])

    def eligible(module: nn.Module, name: str) -> bool:
        return name != head and fast_enough(module, name)

    convert_to_float8_training(model, config=Float8LinearConfig(), module_filter_fn=eligible)
    swapped = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    kept = f"the output head ({head}) and the layers too small to gain" if head else "none"
    return (
        f"{KEY}: {swapped} of {len(linears)} linear layers in float8 (torchao, tensorwise "
        f"scaling); kept in the run's precision: {kept}"
    )


# transformers imports torchao wherever it is installed (`transformers.modeling_utils`, through
# its quantizers), so every process that imports a Hugging Face model imports torchao, float8
# or not; the launcher cannot stop that without hiding torchao from the recipe as well. On
# import, torchao logs each optional kernel library it cannot load here (`_C_mxfp8`,
# `_C_cutlass_90a`: built for other GPUs or another Python), and registers two of its enums
# through a pytree API that torch now deprecates: four lines in every process, none of which
# a run can act on. These filters drop exactly those records, and nothing else those loggers
# say.
_TORCHAO_LOGGER = "torchao"
_PYTREE_LOGGER = "torch.utils._pytree"
_DEPRECATED_ENUM_REGISTRATION = "register_constant() on Enum subclasses is deprecated"


class _TorchaoImportNoise(logging.Filter):
    def __init__(self, keep_kernel_failures: bool) -> None:
        super().__init__()
        self.keep_kernel_failures = keep_kernel_failures

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == _TORCHAO_LOGGER:
            message = record.getMessage()
            unloaded = message.startswith("Failed to load ") and ".so: " in message
            return self.keep_kernel_failures or not unloaded
        registered = record.args[0] if isinstance(record.args, tuple) and record.args else None
        torchaos = getattr(registered, "__module__", "").startswith("torchao.")
        return not (torchaos and _DEPRECATED_ENUM_REGISTRATION in str(record.msg))


def quiet_torchao_import(float8: bool) -> None:
    """Drops what torchao logs as it is imported (see above), in this process. Where the run
    trains in float8 (`float8`), a kernel library torchao cannot load is still said: float8
    runs on torchao, where it may matter."""
    for name in (_TORCHAO_LOGGER, _PYTREE_LOGGER):
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, _TorchaoImportNoise)]:
            logger.removeFilter(old)  # called again: the newest word on float8 holds
        logger.addFilter(_TorchaoImportNoise(keep_kernel_failures=float8))
