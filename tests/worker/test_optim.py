"""`optim.fused`: on CUDA, the fused kernel where the optimizer has one and the user chose no
implementation; elsewhere, and when the user chose, torch's own default."""

from __future__ import annotations

import inspect

import pytest
import torch

from launcher.config.optim import OptimSection
from launcher.worker.optim import build_optimizer, fused_default


def _fused(device_type: str, **optim: object) -> dict:
    section = OptimSection(**optim)  # type: ignore[arg-type]
    cls = getattr(torch.optim, section.name)
    return fused_default(cls, section, inspect.signature(cls).parameters, device_type)


@pytest.mark.parametrize("name", ["AdamW", "Adam", "SGD"])
def test_fused_on_cuda_for_the_optimizers_that_have_a_cuda_kernel(name: str) -> None:
    assert _fused("cuda", name=name) == {"fused": True}


@pytest.mark.parametrize(
    ("device_type", "optim"),
    [
        ("cpu", {"name": "AdamW"}),
        ("xla", {"name": "AdamW"}),
        ("cuda", {"name": "AdamW", "fused": False}),
        ("cuda", {"name": "AdamW", "kwargs": {"foreach": True}}),
        ("cuda", {"name": "AdamW", "kwargs": {"fused": False}}),
        ("cuda", {"name": "Adagrad"}),  # its fused kernel is CPU-only
        ("cuda", {"name": "RMSprop"}),  # no fused kernel at all
    ],
)
def test_torchs_default_elsewhere_or_when_the_user_chose(device_type: str, optim: dict) -> None:
    assert _fused(device_type, **optim) == {}


def test_the_users_kwargs_reach_the_optimizer_on_cpu() -> None:
    params = [torch.nn.Parameter(torch.ones(2))]
    optimizer = build_optimizer(
        OptimSection(name="AdamW", kwargs={"foreach": False}), [{"params": params}]
    )
    assert optimizer.defaults["foreach"] is False
    assert not optimizer.defaults.get("fused")


def test_an_optimizer_that_refuses_the_groups_is_a_usage_error_naming_optim() -> None:
    from launcher.errors import UsageError

    groups = [{"params": [torch.nn.Parameter(torch.ones(2))], "lr": 0.1}]
    groups.append({"params": [torch.nn.Parameter(torch.ones(2))]})
    with pytest.raises(UsageError) as refused:
        build_optimizer(OptimSection(name="LBFGS", lr=0.1), groups)
    assert refused.value.message.startswith("optim: LBFGS refuses the run's 2 parameter groups")
    assert "doesn't support per-parameter options" in refused.value.message
