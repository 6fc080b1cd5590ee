"""A loss or gradient norm that is NaN or infinite (`train.on_nonfinite`).

`stop` checks every step on the device, without reading anything back: the step where each
rank first saw a bad loss, or a bad gradient norm (global, so the same on every rank), is kept
in a device tensor that rides along with the metrics of each log line. Before any save the
tensor and the weights are checked on the host, so a checkpoint with non-finite weights is
never written and the newest finite one is never pruned. `skip` must decide before each update
whether to drop it, so it reads one flag per step, agreed across ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from launcher.errors import RunError
from launcher.parallel.base import Strategy, local_shard

MAX_SKIPS_IN_A_ROW = 10
_NONE = -1  # no bad step seen


class NonFiniteWatch:
    def __init__(self, policy: str, strategy: Strategy, lr: float = 1e-3) -> None:
        self.policy, self.strategy = policy, strategy
        self.lr = lr  # optim.lr: the advice after a stop suggests a lower one
        self.skipped = 0  # updates dropped (`skip`), over the whole run
        self.in_a_row = 0
        self.last_skip = ""
        self.first: list[int] | None = None  # host: first bad step of [loss, gradients]
        self.weights_bad = False
        self._first: torch.Tensor | None = None  # the same, on the device
        self._clock: torch.Tensor | None = None

    def allows_update(self, step: int, loss: torch.Tensor, norm: torch.Tensor | None) -> bool:
        """Before the update of step `step`: whether to apply it."""
        # The norm lives where the gradients do: in CPU memory with fsdp.cpu_offload.
        grad_bad = (
            (~torch.isfinite(norm)).to(loss.device)
            if norm is not None
            else torch.zeros_like(loss, dtype=torch.bool)
        )
        bad = torch.stack([~torch.isfinite(loss), grad_bad])
        if self.policy == "skip":
            return self._decide(step, [bool(b) for b in bad.tolist()])
        if self._first is None or self._clock is None:
            self._first = torch.full((2,), _NONE, dtype=torch.int32, device=loss.device)
            # From the host once; after that the step count lives on the device, since XLA
            # would compile a new graph for every new Python number.
            self._clock = torch.tensor(step - 1, dtype=torch.int32, device=loss.device)
        self._clock = self._clock + 1
        self._first = torch.where(bad & (self._first == _NONE), self._clock, self._first)
        return True

    def device_record(self) -> torch.Tensor:
        """The first bad steps (`stop`), to read with the next log line's metrics."""
        if self._first is None:
            return torch.full((2,), _NONE, dtype=torch.float32, device=self.strategy.device)
        return self._first.float()

    def note(self, record: list[float]) -> None:
        """The host values of `device_record`."""
        if self.first is None and max(record) > _NONE:
            self.first = [int(v) for v in record]

    def check_now(self, model: nn.Module) -> bool:
        """Before a save: reads the device record and checks the weights. Whether this rank
        has seen anything non-finite."""
        if self._first is not None:
            self.note(self._first.tolist())
        self.weights_bad = not _all_finite(model)
        return self.tripped

    @property
    def tripped(self) -> bool:
        return self.first is not None or self.weights_bad or self.in_a_row >= MAX_SKIPS_IN_A_ROW

    def failure(self, newest: Any) -> RunError:
        """Collective: the error that ends the run, the same on every rank."""
        seen = self.strategy.control.gather((self.first, self.weights_bad, self.last_skip))
        if self.in_a_row >= MAX_SKIPS_IN_A_ROW:
            what = f"{self.in_a_row} updates in a row skipped, the last at {self.last_skip}"
        else:
            what = _describe(seen)
        if newest:
            # A command to paste: the run's own spec, from its newest finite checkpoint, at a
            # tenth of the rate (a guess to start from; any optim.lr=... works).
            where = (
                "resume from the newest finite checkpoint at a lower learning rate: "
                f"train --resume {newest} optim.lr={self.lr / 10:g}"
            )
        else:
            where = "no checkpoint was saved before it"
        return RunError(
            f"non-finite values: {what}. Stopped ({self.policy} mode); {where}",
            hint="train.on_nonfinite: skip drops such updates instead of stopping.",
        )

    def _decide(self, step: int, flags: list[bool]) -> bool:
        own_loss, grads = flags
        any_loss, any_grads = self.strategy.control.any_rank_each([own_loss, grads])
        if not (any_loss or any_grads):
            self.in_a_row = 0
            return True
        ranks = [r for r, bad in enumerate(self.strategy.control.gather(own_loss)) if bad]
        self.skipped += 1
        self.in_a_row += 1
        self.last_skip = f"step {step}: {_parts(ranks, any_grads)}"
        if self.strategy.is_main:
            print(
                f"WARNING: {self.last_skip}; update skipped ({self.skipped} so far, "
                f"{self.in_a_row} in a row; the run stops at {MAX_SKIPS_IN_A_ROW})",
                flush=True,
            )
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state:
            self.skipped, self.in_a_row = state["skipped"], state["in_a_row"]


def _describe(seen: list[tuple[list[int] | None, bool, str]]) -> str:
    loss_steps = {r: first[0] for r, (first, _, _) in enumerate(seen) if first and first[0] >= 0}
    grad_steps = [first[1] for first, _, _ in seen if first and first[1] >= 0]
    steps = [*loss_steps.values(), *grad_steps]
    if not steps:
        ranks = [r for r, (_, weights, _) in enumerate(seen) if weights]
        return f"the weights on rank {_ranks(ranks)} are not finite"
    step = min(steps)
    ranks = [r for r, s in loss_steps.items() if s == step]
    return f"step {step}: {_parts(ranks, step in grad_steps)}"


def _parts(loss_ranks: list[int], grads: bool) -> str:
    loss = f"the loss on rank {_ranks(loss_ranks)}" if loss_ranks else ""
    if loss and grads:
        return f"{loss} and the gradient norm are not finite"
    return f"{loss or 'the gradient norm'} is not finite"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) < 8 else f"{ranks[0]} and {len(ranks) - 1} more"


def _all_finite(model: nn.Module) -> bool:
    flags = [torch.isfinite(local_shard(p)).all() for p in model.parameters()]
    return bool(torch.stack(flags).all().item()) if flags else True
