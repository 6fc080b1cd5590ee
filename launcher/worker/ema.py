"""`train.ema`: an exponential moving average of the trained weights.

Each rank averages its own parameters as they are held: a replica's whole tensors under ddp,
its shards under fsdp (the average of a DTensor is a DTensor of the same placement, so it is
never gathered, and the checkpoint saves it sharded, as `ema.<name>` beside `model.<name>`).
The update is one fused multi-tensor op after each optimizer step, on the device.
Frozen parameters do not change, so they are not averaged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from launcher.parallel.base import local_shard
from launcher.parallel.wrapper_names import named_parameters


class WeightAverage:
    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        named = [(n, p) for n, p in named_parameters(model) if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            self.average = [p.detach().clone() for p in self.params]

    def update(self) -> None:
        """After an optimizer step: average = decay * average + (1 - decay) * weights."""
        with torch.no_grad():
            torch._foreach_lerp_(
                self._local(self.average), self._local(self.params), 1 - self.decay
            )

    def restart(self) -> None:
        """The average starts again from the weights as they are (a resumed run whose
        checkpoint has no average)."""
        with torch.no_grad():
            torch._foreach_copy_(self._local(self.average), self._local(self.params))

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The averaged weights in the model, for an evaluation; the trained ones after."""
        with torch.no_grad():
            trained = [t.clone() for t in self._local(self.params)]
            torch._foreach_copy_(self._local(self.params), self._local(self.average))
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self._local(self.params), trained)

    def state_dict(self) -> dict[str, Any]:
        """The averages by parameter name: the keys of the model's own state dict."""
        return dict(zip(self.names, self.average, strict=True))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The checkpointer loads in place into `state_dict()`'s tensors; copy otherwise.
        with torch.no_grad():
            for name, average in zip(self.names, self.average, strict=True):
                if state[name] is not average:
                    local_shard(average).copy_(local_shard(state[name]))

    @staticmethod
    def _local(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        # A DTensor's local shard: the multi-tensor ops run on plain tensors on every torch.
        return [local_shard(t) for t in tensors]
