"""The experts' load (`launcher.worker.expert_load`): how evenly a mixture of experts' router
spreads the tokens, and its auxiliary loss apart from the main loss, with a warning in the
live display when one expert takes most of them for many steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launcher.worker.expert_load import AUX_LOSS, IMBALANCE, WARN_AFTER_STEPS, ExpertLoad
from tests.conftest import REPO, metrics_of, run_train, write_spec

transformers = pytest.importorskip("transformers")

# The Hugging Face recipe with every router sending every token to expert 0.
BIASED_RECIPE = f"""
import importlib.util
import sys

import torch

sys.path.insert(0, {str(REPO / "recipes")!r})  # the recipe imports its sibling
_spec = importlib.util.spec_from_file_location("hf", {str(REPO / "recipes" / "hf_causal_lm.py")!r})
hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf)
build_dataset, loss = hf.build_dataset, hf.loss


def to_expert_0(router, args, output):
    logits, scores, indices = output
    return logits, torch.ones_like(scores), torch.zeros_like(indices)


def build_model(**kwargs):
    model = hf.build_model(**kwargs)
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(to_expert_0)
    return model
"""


def tiny_moe(**kwargs: object) -> torch.nn.Module:
    import importlib.util
    import sys

    sys.path.insert(0, str(REPO / "recipes"))
    spec = importlib.util.spec_from_file_location("hf_recipe", REPO / "recipes" / "hf_causal_lm.py")
    recipe = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(recipe)  # type: ignore[union-attr]
    torch.manual_seed(0)
    return recipe.build_model(family="qwen3_moe", layers=2, hidden=32, **kwargs)


def test_the_tokens_each_expert_takes_and_the_aux_loss_are_read_from_hooks() -> None:
    model = tiny_moe(experts=4, top_k=2)
    load = ExpertLoad.attach(model)
    assert load is not None and load.experts == 4
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        output = model(input_ids=ids, labels=ids)
    figures = load.take()
    assert figures[AUX_LOSS] == output.aux_loss  # the model's own, unscaled
    # Each layer's experts took 2 x 32 tokens between them: the busiest over the mean.
    assert 1.0 <= float(figures[IMBALANCE]) <= 4.0
    assert load.take() == {}  # taken: a clean slate for the next micro-batch


def test_a_model_without_experts_has_no_load() -> None:
    assert ExpertLoad.attach(torch.nn.Linear(2, 2)) is None
    no_aux = tiny_moe(aux_loss_coef=0.0)  # output_router_logits off: no aux_loss
    load = ExpertLoad.attach(no_aux)
    assert load is not None
    with torch.no_grad():
        no_aux(input_ids=torch.zeros(1, 4, dtype=torch.long))
    assert set(load.take()) == {IMBALANCE}


def test_the_warning_comes_once_per_stretch_of_uneven_steps() -> None:
    load = ExpertLoad(torch.nn.Linear(1, 1), [], experts=4)
    uneven, even = {IMBALANCE: 3.5}, {IMBALANCE: 1.1}
    said = [load.warning(uneven, 4) for _ in range(5)]  # steps 4, 8, 12, 16, 20
    assert [s is not None for s in said] == [False, False, True, False, False]
    assert "3.5x the mean expert's tokens" in said[2] and f"for {12} steps" in said[2]
    assert WARN_AFTER_STEPS <= 12
    assert load.warning(even, 4) is None  # the stretch ends
    assert [load.warning(uneven, 10) is not None for _ in range(2)] == [True, False]


def test_a_router_that_sends_every_token_to_one_expert_is_shown_and_warned_of(
    tmp_path: Path,
) -> None:
    (tmp_path / "biased.py").write_text(BIASED_RECIPE)
    recipe = {
        "source": str(tmp_path / "biased.py"),
        "model": {"family": "qwen3_moe", "layers": 2, "hidden": 32, "experts": 4, "top_k": 1},
        "dataset": {"seq_len": 16},
    }
    spec = write_spec(
        tmp_path / "run.yaml",
        launch={"devices": 1},
        recipe=recipe,
        train={"max_steps": 12, "log_every": 2},
        checkpoint={"enabled": False},
    )
    result = run_train(["--config", str(spec), "--run-dir", str(tmp_path / "run")], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    imbalance = [r[IMBALANCE] for r in metrics_of(tmp_path / "run") if IMBALANCE in r]
    assert imbalance == [4.0] * 6  # every token to 1 of 4 experts: 4x the mean
    warned = [line for line in result.stdout.splitlines() if "warning: the router" in line]
    assert len(warned) == 1, result.stdout
    assert "4.0x the mean expert's tokens (experts/imbalance) for 10 steps" in warned[0]
