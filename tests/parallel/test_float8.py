"""`train.float8`: which runs may train in float8 (a GPU with float8 tensor cores, torchao, no
tensor parallelism), and which of a model's layers become torchao's `Float8Linear`, checked
on a model built on the meta device. The float8 step itself needs such a GPU:
bench/gpu_bench.py measures it against bf16 (BENCHMARKS.md). On CPU the launch is refused in
one line (tests/cli/test_bad_inputs.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from launcher.errors import UsageError
from launcher.parallel import float8
from launcher.worker.recipe import load_recipe
from tests.conftest import REPO

HOPPER, AMPERE = (9, 0), (8, 0)


def test_float8_runs_on_gpus_with_float8_tensor_cores_only() -> None:
    if importlib.util.find_spec("torchao") is not None:
        assert float8.refusal("gpu", 1, HOPPER) is None
    for accelerator in ("cpu", "tpu"):
        assert f"this run is on {accelerator}" in float8.refusal(accelerator, 1, HOPPER)
    assert "compute capability 8.0" in float8.refusal("gpu", 1, AMPERE)
    assert "parallel.tp: 2" in float8.refusal("gpu", 2, HOPPER)
    with pytest.raises(UsageError) as refused:
        float8.check("gpu", 1, AMPERE)
    assert "train.float8: false" in refused.value.hint


def test_without_torchao_the_refusal_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    found = importlib.util.find_spec
    monkeypatch.setattr(
        float8.importlib.util, "find_spec", lambda name: None if name == "torchao" else found(name)
    )
    with pytest.raises(UsageError) as refused:
        float8.check("gpu", 1, HOPPER)
    assert "needs torchao" in str(refused.value)
    assert "launcher[float8]" in refused.value.hint


def test_the_large_linear_layers_become_float8_and_the_head_stays() -> None:
    pytest.importorskip("torchao")
    recipe = load_recipe(str(REPO / "recipes" / "gpt.py"))
    with torch.device("meta"):
        model = recipe.build_model(n_layer=2, n_head=8, n_embd=1024, block_size=32)
    names = dict(model.state_dict())
    line = float8.convert(model)
    kinds = {
        name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, nn.Linear)
    }
    # torchao's tensorwise filter: an output of at most 1024 features and an input of at most
    # 4096 gains nothing (the attention and MLP output projections here); the head stays.
    assert kinds == {
        **{f"blocks.{i}.attn.qkv": "Float8Linear" for i in range(2)},
        **{f"blocks.{i}.mlp.fc": "Float8Linear" for i in range(2)},
        **{f"blocks.{i}.attn.proj": "Linear" for i in range(2)},
        **{f"blocks.{i}.mlp.proj": "Linear" for i in range(2)},
        "lm_head": "Linear",
    }
    assert line.startswith("train.float8: 4 of 9 linear layers in float8")
    assert "the output head (lm_head)" in line
    # The same parameters under the same names, still on meta: checkpoints move between float8
    # and bf16 runs, and fsdp's meta init materialises them as before.
    assert list(model.state_dict()) == list(names)
    assert all(p.device.type == "meta" for p in model.parameters())
