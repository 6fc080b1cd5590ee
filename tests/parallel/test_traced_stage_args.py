"""The traced cut (`parallel.pp` on any model torch.export traces): each stage's graph calls the
model's own modules with the arguments the model gives them, bound by the names of each
module's forward, never by the order in which torch's tracer met them. No processes: the
stages run one after the other on CPU, against the whole model."""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

import pytest
import torch
from torch import nn

from launcher.errors import UsageError
from launcher.parallel.pipeline.traced import cut
from tests.conftest import REPO
from tests.parallel.layouts import GPT

pytestmark = pytest.mark.timeout(120)


class GatedBlock(nn.Module):
    """Two tensors of one shape. Its body reads `h` first, so torch's tracer passes the two
    in the other order (`scale`, `h`): swapped, the output changes and nothing raises."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.lin(h) + h * torch.sigmoid(scale)


class GatedNet(nn.Module):
    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.gate = nn.Linear(width, width)
        self.blocks = nn.ModuleList([GatedBlock(width) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        scale = self.gate(x)
        for block in self.blocks:
            h = block(h, scale)
        return h


class RotaryBlock(nn.Module):
    """Three tensors of one shape, passed by keyword in another order than its forward names
    them, and a flag the model sets against its default."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, flip: bool = False
    ) -> torch.Tensor:
        turned = h * cos + self.lin(h) * sin
        return -turned if flip else turned


class RotaryNet(nn.Module):
    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList([RotaryBlock(width) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, angle = self.inp(x), x * 3
        for block in self.blocks:
            h = block(sin=torch.sin(angle), h=h, cos=torch.cos(angle), flip=True)
        return h


class IgnoringBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.lin(h)


class IgnoringNet(nn.Module):
    """Passes each block a tensor its body never reads: the traced stage does not carry it,
    and calling the block without it would take the default the model did not give."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([IgnoringBlock(width) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for block in self.blocks:
            h = block(h, x > 0)
        return h


def run_stages(stages: list[nn.Module], inputs: tuple[Any, ...]) -> torch.Tensor:
    for stage in stages:
        out = stage(*inputs)
        inputs = out if isinstance(out, tuple) else (out,)
    (output,) = inputs
    return output


def gradients(model: nn.Module, output: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gradients of the model's parameters from `output` (which the stages, holding the
    model's own parameters, computed with them or the model did)."""
    model.zero_grad(set_to_none=True)
    weights = torch.linspace(-1.0, 1.0, output.numel()).reshape(output.shape)
    (output.float() * weights).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_stages_compute_the_model(model: nn.Module, example: tuple[Any, ...]) -> None:
    torch.manual_seed(0)
    expected = model(*example)
    expected_grads = gradients(model, expected)
    stages = cut(model, ["blocks.1"], example, [0, 1], contextlib.nullcontext)
    assert stages.count == 2
    output = run_stages(stages.modules, example)
    assert torch.equal(output, expected), (output - expected).abs().max()
    grads = gradients(model, output)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, expected_grads[name]), name


@pytest.mark.parametrize("net", [GatedNet, RotaryNet])
def test_each_stage_calls_the_models_modules_by_their_arguments_names(net: type) -> None:
    torch.manual_seed(0)
    assert_stages_compute_the_model(net(), (torch.randn(4, 8),))


def test_a_block_given_a_tensor_its_traced_body_never_reads_is_refused() -> None:
    torch.manual_seed(0)
    with pytest.raises(UsageError) as caught:
        cut(IgnoringNet(), ["blocks.1"], (torch.randn(4, 8),), [0, 1], contextlib.nullcontext)
    assert "blocks.0" in caught.value.message and "mask" in caught.value.message
    assert "\n" not in caught.value.message and caught.value.hint


def test_the_gpt_recipe_still_cuts_into_stages_that_compute_the_whole_model() -> None:
    spec = importlib.util.spec_from_file_location("gpt_recipe", REPO / "recipes" / "gpt.py")
    assert spec is not None and spec.loader is not None
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    torch.manual_seed(0)
    model = gpt.build_model(**GPT["model"])
    tokens = torch.randint(0, 256, (2, GPT["model"]["block_size"]))
    assert_stages_compute_the_model(model, (tokens,))
