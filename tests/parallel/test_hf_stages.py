"""Hugging Face models cut into pipeline stages by their own plan (`launcher.parallel.pipeline.
hf_stages`), in one process: the stages run one after another give the whole model's logits
and gradients exactly, under the whole model's parameter names, with padding masks and tied
heads; what cannot be cut is refused in one line."""

from __future__ import annotations

import contextlib

import pytest
import torch

from launcher.errors import UsageError
from launcher.parallel.pipeline.hf_plan import hf_plan
from launcher.parallel.pipeline.hf_stages import cut_by_plan, router
from launcher.parallel.pipeline.stages import shared_parameters
from launcher.worker.recipe import load_recipe
from tests.conftest import REPO

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(120)


def tiny(family: str, **extra: object) -> torch.nn.Module:
    """The recipe's model, imported as the launcher imports a recipe file."""
    recipe = load_recipe(str(REPO / "recipes" / "hf_causal_lm.py"))
    torch.manual_seed(0)
    return recipe.build_model(family=family, layers=4, **extra)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_the_stages_compute_the_whole_models_logits_and_gradients(family: str) -> None:
    model = tiny(family)
    ids = torch.randint(0, 64, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded row: every stage must mask it as the whole model does
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    expected = model(**batch)
    expected.loss.backward()
    whole = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    plan = hf_plan(model)
    assert plan is not None
    args, by_name = router(model)(({"input_ids": ids, "attention_mask": mask},))
    points = [f"{plan.layers}.1", f"{plan.layers}.3"]
    stages = cut_by_plan(model, plan, points, (args, by_name), [0, 1, 2], contextlib.nullcontext)
    inputs, sent = args, []
    for module in stages.modules:
        out = module(*inputs, **by_name)
        sent.append((inputs, out))
        inputs = (out.detach().requires_grad_(),)
    logits = sent[-1][1]
    torch.testing.assert_close(logits, expected.logits, rtol=0, atol=0)
    loss = model.loss_function(logits=logits, labels=ids, vocab_size=model.config.vocab_size)
    loss.backward()
    for index in range(len(sent) - 1, 0, -1):  # the gradient of each stage's input, sent back
        sent[index - 1][1].backward(sent[index][0][0].grad)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, whole[name], rtol=1e-6, atol=1e-7, msg=name)

    # Each stage's names are the whole model's.
    names = set(dict(model.named_parameters()))
    for module in stages.modules:
        assert set(dict(module.named_parameters())) <= names


def test_a_tied_head_is_held_by_the_first_and_last_stages_under_the_embeddings_name() -> None:
    model = tiny("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    plan = hf_plan(model)
    assert plan is not None and plan.tied_to_last == ["transformer.wte"]
    ids = torch.randint(0, 64, (2, 8))
    stages = cut_by_plan(
        model, plan, ["transformer.h.2"], ((ids,), {}), [0, 1], contextlib.nullcontext
    )
    assert shared_parameters(stages.modules) == {"transformer.wte.weight": [0, 1]}
    first, last = (dict(m.named_parameters()) for m in stages.modules)
    assert "transformer.wpe.weight" in first and "transformer.wpe.weight" not in last
    assert "lm_head.weight" not in first  # the head is the last stage's alone


def test_an_untied_model_shares_nothing_between_stages() -> None:
    model = tiny("llama")
    plan = hf_plan(model)
    assert plan is not None and plan.tied_to_last == []
    assert plan.first == ["model.embed_tokens"] and plan.last == ["model.norm", "lm_head"]
    assert plan.source == "its config's base_model_pp_plan"


def test_an_encoder_decoder_is_refused_naming_what_would_work() -> None:
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4
    )
    with pytest.raises(UsageError, match="encoder-decoder") as refused:
        hf_plan(transformers.T5ForConditionalGeneration(config))
    assert "parallel.pp: 1" in str(refused.value.hint)


def test_a_split_point_that_is_not_a_block_is_refused() -> None:
    model = tiny("llama")
    plan = hf_plan(model)
    assert plan is not None
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(UsageError, match=r"model\.norm is not a block"):
        cut_by_plan(model, plan, ["model.norm"], ((ids,), {}), [0, 1], contextlib.nullcontext)
