"""How a model's weights get their first values, whichever strategy builds it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from launcher.parallel.rng import seed_everything


class Initialisation(Protocol):
    """What a recipe says of a model's initialisation (`launcher.worker.recipe.Recipe`)."""

    def init_entry(self, model: torch.nn.Module) -> tuple[str, Callable[[], None]] | None: ...

    def defines_init(self, model: torch.nn.Module) -> bool: ...

    def init_weights(self, model: torch.nn.Module) -> None: ...


@dataclass(frozen=True)
class WeightInit:
    """How weights get their first values, the same whichever strategy builds the model.

    A plain build (`build`: ddp, the XLA strategies, `fsdp.init: cpu`) runs the constructors
    after seeding the generators with `seed`; where the recipe or the model has an explicit
    initialisation (`Recipe.init_entry`), it then runs that too, again from `seed`. fsdp's
    meta-device build runs the same initialisation from the same seed on each rank's shards
    (`sharded_init`), so with an explicit one the two give bitwise the same weights. Without
    one, only each module's `reset_parameters()` is left to run on the meta device, and that
    is what a constructor does only where it initialises nothing itself (torchvision's ResNet
    re-draws every conv with kaiming_normal_ in its constructor): fsdp then builds on CPU
    (`fsdp.init: auto`).
    """

    recipe: Initialisation
    seed: int

    def exact(self, model: torch.nn.Module) -> str | None:
        """The explicit initialisation that defines `model`'s weights wherever it is built,
        by name; None where only its constructors do."""
        entry = self.recipe.init_entry(model)
        return entry[0] if entry is not None else None

    def needed_after_build(self, model: torch.nn.Module) -> bool:
        return self.recipe.defines_init(model)

    def build(self, factory: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        """A plain build: the constructors from `seed`, then the explicit initialisation."""
        seed_everything(self.seed)
        model = factory()
        if self.needed_after_build(model):
            self(model)
        return model

    def __call__(self, model: torch.nn.Module) -> None:
        seed_everything(self.seed)
        self.recipe.init_weights(model)
