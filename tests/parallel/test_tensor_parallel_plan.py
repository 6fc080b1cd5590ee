"""A Hugging Face model's tensor-parallel plan is refused, before anything is split, where
`parallel.tp` does not divide its heads (the worker and `train validate` both ask)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from launcher.errors import UsageError
from launcher.parallel.tensor_parallel import check_plan


class _PlannedModel(nn.Module):
    """What `check_plan` reads of a transformers model: its `tp_plan` and its config's heads."""

    def __init__(self, heads: int, kv_heads: int | None) -> None:
        super().__init__()
        self.q_proj = nn.Linear(8, 8)
        self.tp_plan = {"q_proj": "colwise"}
        self.config = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "refused"),
    [
        (4, 2, 2, None),
        (4, None, 4, None),  # no key-value heads of their own
        (4, 2, 4, "cannot split _PlannedModel's 2 key-value heads (num_key_value_heads)"),
        (6, 6, 4, "cannot split _PlannedModel's 6 attention heads (num_attention_heads)"),
    ],
)
def test_a_tp_that_does_not_divide_the_heads_is_refused(
    heads: int, kv_heads: int | None, tp: int, refused: str | None
) -> None:
    model = _PlannedModel(heads, kv_heads)
    if refused is None:
        assert list(check_plan(model, None, tp)) == ["q_proj"]
        return
    with pytest.raises(UsageError) as caught:
        check_plan(model, None, tp)
    assert caught.value.message == (
        f"parallel.tp: {tp} processes {refused}: each process must hold whole heads"
    )
