"""The line rank 0 prints for each optimizer group shows its settings as a person reads
them: `lr=0.001125`, not the float arithmetic's `0.0011250000000000001`."""

from __future__ import annotations

import pytest
import torch

from launcher.worker.param_groups import Group


@pytest.mark.parametrize(
    ("options", "shown"),
    [
        ({"lr": 0.0015 * 0.75}, "lr=0.001125"),  # 0.0011250000000000001
        ({"lr": 1e-3 * 0.75**3}, "lr=0.000421875"),  # layer-wise decay: still exact
        ({"lr": 1e-3 / 3}, "lr=0.000333333"),  # six digits tell groups apart
        ({"weight_decay": 0.0, "lr": 3e-05}, "weight_decay=0.0, lr=3e-05"),
        ({"betas": (0.9, 0.95)}, "betas=(0.9, 0.95)"),
    ],
)
def test_a_groups_settings_are_shown_readably(options: dict, shown: str) -> None:
    group = Group("group 1 ['head.*']", [torch.nn.Parameter(torch.zeros(2, 3))], options)
    assert group.describe() == f"group 1 ['head.*']: 1 tensor, 6 parameters, {shown}"
