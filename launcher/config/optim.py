"""The `optim` section: it needs torch to check optimizer names and their keyword arguments.

torch is imported only by those checks, and they are skipped when validation runs with
`TORCH_FREE` as its context: the CLI answers `--help` and reports a spec's other mistakes in a
fraction of a second, before anything imports torch (seconds).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from launcher.config.section import Section

if TYPE_CHECKING:
    import torch

Schedule = Literal["constant", "cosine"]

# `RunSpec.model_validate(raw, context=TORCH_FREE)`: every check except those that need torch.
TORCH_FREE = {"torch_free": True}


def _skip_torch_checks(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get("torch_free"))


def _optimizer_names() -> list[str]:
    import torch

    return sorted(
        n
        for n, c in vars(torch.optim).items()
        if isinstance(c, type)
        and issubclass(c, torch.optim.Optimizer)
        and c is not torch.optim.Optimizer
    )


def _optimizer_class(name: str) -> type[torch.optim.Optimizer] | None:
    import torch

    cls = getattr(torch.optim, name, None)
    ok = isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
    return cls if ok and cls is not torch.optim.Optimizer else None


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    cls = _optimizer_class(name)
    assert cls is not None, name  # the spec validated it
    return cls


class OptimSection(Section):
    name: str = Field(
        "AdamW",
        description="Any optimizer class in `torch.optim`, by name (`SGD`, `AdamW`, …).",
    )
    lr: float = Field(
        1e-3, ge=0, description="Peak learning rate (0 leaves the weights as they are)."
    )
    kwargs: dict[str, Any] = Field(
        {}, description="Other keyword arguments of the optimizer, e.g. `{weight_decay: 0.1}`."
    )
    fused: bool = Field(
        True,
        description="On CUDA, the optimizer's fused implementation (one kernel for all "
        "parameters) where it has one (`AdamW`, `Adam`, `SGD`, ...) and `kwargs` sets neither "
        "`fused` nor `foreach`; `false`: torch's default.",
    )
    schedule: Schedule = Field(
        "constant", description="`constant`, or `cosine` decay to `min_lr_ratio * lr`."
    )
    warmup_steps: int = Field(
        0, ge=0, description="Linear warmup from 0 to `lr` over this many steps."
    )
    min_lr_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="Final learning rate of `cosine`, as a fraction of `lr`."
    )

    @field_validator("name")
    @classmethod
    def _known_optimizer(cls, name: str, info: ValidationInfo) -> str:
        if not _skip_torch_checks(info) and not _optimizer_class(name):
            known = ", ".join(_optimizer_names())
            raise ValueError(f"expected a torch.optim optimizer ({known}), got {name!r}")
        return name

    @field_validator("kwargs")
    @classmethod
    def _kwargs_fit(cls, kwargs: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if not kwargs or _skip_torch_checks(info):
            return kwargs
        optimizer = _optimizer_class(info.data.get("name", ""))
        if optimizer is None:
            return kwargs  # the name's own error says what is wrong
        accepted = [p for p in inspect.signature(optimizer).parameters if p not in ("params", "lr")]
        wrong = [k for k in kwargs if k not in accepted]
        if wrong:
            raise ValueError(
                f"{optimizer.__name__} does not take {', '.join(wrong)}; it takes: {', '.join(accepted)}"
            )
        return kwargs
