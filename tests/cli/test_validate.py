"""`train validate` builds what a run builds (datasets, a batch, the model on the meta device)
and refuses what the run would fail on; `train` checks the recipe's arguments before it
starts anything."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from launcher.cli.recipe_check import check_arguments
from launcher.config.spec import RecipeSection
from launcher.errors import UsageError
from launcher.worker.recipe import Recipe
from tests.conftest import REPO, usage_error, write_spec
from tests.forked_train import train_in_fork

pytestmark = pytest.mark.timeout(120)

HEAD = "import torch\nfrom torch import nn\nfrom torch.utils.data import IterableDataset\n\n"
MODEL = "def build_model():\n    return nn.Linear(4, 1)\n\n"
LOSS = "def loss(model, batch):\n    return model(batch[0]).mean()\n\n"
STREAM = """
class Stream(IterableDataset):
    def __iter__(self):
        while True:
            yield torch.randn(4), torch.randn(1)


def build_dataset(split):
    return Stream()
"""
STRINGS = "def build_dataset(split):\n    return ['not a tensor'] * 64\n"
EMPTY = "def build_dataset(split):\n    return torch.utils.data.TensorDataset(torch.zeros(0, 4))\n"
BUGGY_MODEL = """
def build_model():
    return helper()


def helper():
    raise RuntimeError("my model is broken")


def build_dataset(split):
    return torch.utils.data.TensorDataset(torch.randn(64, 4))
"""


FROZEN_AND_READS_A_VALUE = """
def build_model():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    model[0].requires_grad_(False)  # frozen: 40 of its 49 parameters
    return model


def build_dataset(split):
    return torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))


def loss(model, batch):
    x, y = batch
    if y.abs().max().item() > 100:  # reads a value, which the meta device does not have
        raise ValueError("an outlier")
    return nn.functional.mse_loss(model(x), y)
"""
KEYED_LOSS = "def loss(model, batch):\n    return model(batch['x']).mean()\n\n"
TENSORS = (
    "def build_dataset(split):\n    return torch.utils.data.TensorDataset(torch.randn(64, 4))\n"
)


def _validate(tmp_path: Path, *args: str, **sections: dict) -> tuple[int, str]:
    spec = write_spec(tmp_path / "run.yaml", **sections)
    result = train_in_fork(["validate", "--config", str(spec), *args], cwd=tmp_path, timeout=90)
    return result.returncode, result.stdout + result.stderr


def _recipe(tmp_path: Path, body: str) -> dict:
    (tmp_path / "recipe.py").write_text(HEAD + body)
    return {"source": str(tmp_path / "recipe.py"), "dataset": {}}


def test_a_mistyped_model_keyword_is_refused_with_the_real_name(tmp_path: Path) -> None:
    code, output = _validate(tmp_path, "recipe.model.hiddn=3")
    assert code == 2, output
    assert "recipe.model.hiddn: unknown key of build_model()" in output
    assert "did you mean 'recipe.model.hidden'?" in output
    assert "valid here: in_dim, hidden, depth, out_dim" in output
    assert "Traceback" not in output


def test_train_refuses_a_mistyped_keyword_before_it_creates_anything(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "run.yaml", recipe={"model": {"hiddn": 3}})
    result = train_in_fork(["--config", str(spec)], cwd=tmp_path, timeout=90)
    usage_error(result, "recipe.model.hiddn", "did you mean 'recipe.model.hidden'?")
    assert "rank" not in result.stdout + result.stderr  # no worker ever started
    assert not (tmp_path / "runs").exists()


def test_a_mistyped_dataset_keyword_is_refused(tmp_path: Path) -> None:
    code, output = _validate(tmp_path, "recipe.dataset.n_sample=64")
    assert code == 2, output
    assert "recipe.dataset.n_sample: unknown key of build_dataset()" in output
    assert "did you mean 'recipe.dataset.n_samples'?" in output


def test_a_good_spec_reports_the_model_and_the_data(tmp_path: Path) -> None:
    code, output = _validate(tmp_path, "eval.every_n_steps=5", "recipe.dataset.n_samples=1000")
    assert code == 0, output
    assert "run.yaml: ok · model Sequential 5,313 parameters, 5,313 trainable" in output
    # 1,000 samples over 2 devices x 8, the last short batch dropped: 62 steps.
    assert "train 1,000 samples (62 steps/epoch at 2 devices x 8)" in output
    assert "val 1,000 samples" in output
    assert not (tmp_path / "runs").exists()


def test_a_stream_is_reported_without_a_length(tmp_path: Path) -> None:
    recipe = _recipe(tmp_path, MODEL + LOSS + STREAM)
    code, output = _validate(tmp_path, "eval.every_n_steps=5", "eval.max_batches=2", recipe=recipe)
    assert code == 0, output
    assert "train stream (no length; train.max_steps=10)" in output
    assert "val stream" in output
    assert "model Linear 5 parameters" in output


def test_a_streamed_val_split_needs_max_batches(tmp_path: Path) -> None:
    recipe = _recipe(tmp_path, MODEL + LOSS + STREAM)
    code, output = _validate(tmp_path, "eval.every_n_steps=5", recipe=recipe)
    assert code == 2, output
    assert "eval.max_batches: the val split is a stream" in output


def test_a_stream_needs_max_steps(tmp_path: Path) -> None:
    recipe = _recipe(tmp_path, MODEL + LOSS + STREAM)
    code, output = _validate(tmp_path, "train.max_steps=null", "train.max_epochs=1", recipe=recipe)
    assert code == 2, output
    assert "train.max_steps: the train split is a stream" in output


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param(MODEL + LOSS + STRINGS, ["a batch holds no tensor"], id="no-tensor"),
        pytest.param(MODEL + LOSS + EMPTY, ["build_dataset('train') is empty"], id="empty"),
        pytest.param(
            MODEL + KEYED_LOSS + TENSORS,
            [
                "recipe: loss(model, batch) failed on a train batch made by torch's "
                "default_collate:",
                "recipe.py",
                "in loss",
                "TypeError: list indices must be integers or slices, not str",
            ],
            id="loss-on-the-batch",
        ),
        pytest.param(
            LOSS + BUGGY_MODEL,
            ["recipe: build_model() failed", "recipe.py", "in helper", "my model is broken"],
            id="model-raises",
        ),
    ],
)
def test_what_the_run_would_fail_on_is_refused(
    tmp_path: Path, body: str, expected: list[str]
) -> None:
    code, output = _validate(tmp_path, recipe=_recipe(tmp_path, body))
    assert code == 2, output
    for text in expected:
        assert text in output, output
    assert "Traceback" not in output and "launcher/" not in output, output


def test_a_model_the_meta_device_cannot_build_is_built_for_real(tmp_path: Path) -> None:
    body = MODEL.replace("return", "torch.ones(1).item()\n    return") + LOSS + STRINGS
    body = body.replace("['not a tensor']", "[torch.ones(4)]")
    code, output = _validate(tmp_path, recipe=_recipe(tmp_path, body))
    assert code == 0, output
    assert "model Linear 5 parameters, 5 trainable (built on the CPU" in output
    assert "loss not checked (the model was built on the CPU)" in output


def test_frozen_parameters_are_counted_apart_and_an_unchecked_loss_is_said(
    tmp_path: Path,
) -> None:
    code, output = _validate(tmp_path, recipe=_recipe(tmp_path, FROZEN_AND_READS_A_VALUE))
    assert code == 0, output
    assert "model Sequential 49 parameters, 9 trainable" in output
    assert "loss not checked (it cannot run on the meta device: Tensor.item())" in output


def _module(source: str) -> Recipe:
    module = ModuleType("recipe_under_test")
    exec(textwrap.dedent(source), module.__dict__)
    return Recipe("recipe_under_test.py", module)


@pytest.mark.parametrize(
    ("model", "dataset", "expected"),
    [
        ({"anything": 1}, {"at_all": 2}, None),  # **kwargs takes every key
        ({}, {"size": 3, "split": "val"}, "recipe.dataset.split: build_dataset() gets this"),
        ({"extra": 1}, {"size": 3}, "recipe.model.extra: unknown key of build_model()"),
        ({}, {}, "recipe.dataset.size: required by build_dataset(), but missing"),
    ],
)
def test_arguments_are_checked_against_the_signatures(
    model: dict, dataset: dict, expected: str | None
) -> None:
    takes_any = "anything" in model
    recipe = _module(
        f"""
        def build_model({"**kwargs" if takes_any else ""}):
            pass

        def build_dataset(split, {"**kwargs" if takes_any else "size"}):
            pass
        """
    )
    section = RecipeSection(source="x.py", model=model, dataset=dataset)
    if expected is None:
        check_arguments(recipe, section)
        return
    with pytest.raises(UsageError) as caught:
        check_arguments(recipe, section)
    assert expected in caught.value.render()


def test_a_dataset_builder_without_a_split_parameter_is_named() -> None:
    recipe = _module("def build_model():\n    pass\ndef build_dataset():\n    pass\n")
    with pytest.raises(UsageError) as caught:
        check_arguments(recipe, RecipeSection(source="x.py"))
    assert "recipe.dataset: build_dataset() must take the split" in caught.value.render()


def test_a_call_no_keyword_can_fix_is_named_by_its_section() -> None:
    recipe = _module("def build_model(width, /):\n    pass\ndef build_dataset(split):\n    pass\n")
    with pytest.raises(UsageError) as caught:
        check_arguments(recipe, RecipeSection(source="x.py"))
    assert "recipe.model: build_model() cannot be called this way" in caught.value.render()


# build_model() reads a value, which the meta device does not hold.
READS_A_VALUE = MODEL.replace("return", "torch.ones(1).item()\n    return") + LOSS + TENSORS


def test_validate_builds_the_model_as_fsdp_will(tmp_path: Path) -> None:
    recipe = _recipe(tmp_path, READS_A_VALUE)
    launch = {"strategy": "fsdp"}
    code, output = _validate(tmp_path, recipe=recipe, launch=launch)
    assert code == 0, output
    assert "cannot be built on the meta device (RuntimeError: Tensor.item()" in output
    assert "fsdp.init: auto builds it on CPU in every process" in output
    code, output = _validate(tmp_path, "fsdp.init=meta", recipe=recipe, launch=launch)
    assert code == 2 and "Traceback" not in output, output
    assert "fsdp.init: meta: the model cannot be built on the meta device" in output
    assert "Set fsdp.init: cpu (or auto)" in output
    # One process shards nothing, so fsdp builds it as ddp does, whatever fsdp.init says.
    alone = {**launch, "devices": 1}
    code, output = _validate(tmp_path, "fsdp.init=meta", recipe=recipe, launch=alone)
    assert code == 0 and "(built on the CPU: the model cannot be built" in output, output
    assert "fsdp.init: auto builds it" not in output


def _weights(tmp_path: Path, name: str) -> str:
    """load.weights for `Linear(4, 1)`: `fit.pt` its own, `wide.pt` a Linear(4, 2)'s, and
    `junk.pt` no torch file at all."""
    import torch

    shape = {"fit.pt": (1, 4), "wide.pt": (2, 4)}.get(name)
    if shape is None:
        (tmp_path / name).write_bytes(b"not a torch file")
    else:
        torch.save({"weight": torch.zeros(shape), "bias": torch.zeros(shape[0])}, tmp_path / name)
    return str(tmp_path / name)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("missing.pt", ["load.weights", "missing.pt: no such file or folder"]),
        ("junk.pt", ["load.weights", "junk.pt: cannot read it"]),
        ("wide.pt", ["load.weights", "do not fit the model", "shape of weight: weights [2, 4]"]),
    ],
)
def test_weights_that_do_not_fit_the_model_are_refused(
    tmp_path: Path, name: str, expected: list[str]
) -> None:
    path = _weights(tmp_path, name) if name != "missing.pt" else str(tmp_path / name)
    recipe = _recipe(tmp_path, MODEL + LOSS + TENSORS)
    code, output = _validate(tmp_path, f"load.weights={path}", recipe=recipe)
    assert code == 2 and "Traceback" not in output, output
    for text in expected:
        assert text in output, output


def test_weights_that_fit_are_said(tmp_path: Path) -> None:
    path = _weights(tmp_path, "fit.pt")
    recipe = _recipe(tmp_path, MODEL + LOSS + TENSORS)
    code, output = _validate(tmp_path, f"load.weights={path}", recipe=recipe)
    assert code == 0, output
    assert "load.weights: 2 tensors fit" in output


def test_an_optimizer_that_refuses_the_groups_is_refused(tmp_path: Path) -> None:
    groups = "optim.groups=[{params: ['*.bias'], lr: 0.1}]"
    code, output = _validate(tmp_path, "optim.name=LBFGS", groups)
    assert code == 2 and "Traceback" not in output, output
    assert "optim: LBFGS refuses the run's 2 parameter groups" in output
    assert "doesn't support per-parameter options" in output


# The GPT recipe, small: 2 heads of 16 over an embedding of 32.
GPT_TWO_HEADS = {
    "source": str(REPO / "recipes" / "gpt.py"),
    "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16},
    "dataset": {"block_size": 16, "max_bytes": 20_000},
}


@pytest.mark.parametrize(("tp", "refused"), [(2, False), (4, True)])
def test_a_tensor_parallel_split_the_heads_cannot_take_is_refused(
    tmp_path: Path, tp: int, refused: bool
) -> None:
    launch = {"strategy": "fsdp", "devices": tp}
    code, output = _validate(tmp_path, recipe=GPT_TWO_HEADS, launch=launch, parallel={"tp": tp})
    if not refused:
        assert code == 0, output
        return
    assert code == 2 and "Traceback" not in output, output
    assert "parallel.tp: 4: the model split over 4 processes fails in loss(model, batch)" in output
    assert "whole attention heads" in output


def test_steps_per_epoch_count_data_parallel_ranks_not_processes(tmp_path: Path) -> None:
    """tp 2 x dp_shard 2 on 4 processes: the two processes of a tensor-parallel group share a
    batch, so an epoch takes as many steps as on 2 processes of ddp."""
    launch = {"strategy": "fsdp", "devices": 4}
    parallel = {"tp": 2, "dp_shard": 2}
    code, output = _validate(tmp_path, recipe=GPT_TWO_HEADS, launch=launch, parallel=parallel)
    assert code == 0, output
    found = re.search(r"train ([\d,]+) samples \(([\d,]+) steps/epoch at (.*?)\)", output)
    assert found, output
    samples, steps = (int(found[i].replace(",", "")) for i in (1, 2))
    assert steps == samples // (2 * 8), output  # 2 batches of 8 a step, the short one dropped
    assert found[3] == "2 data-parallel ranks of 4 devices x 8", output


FROZEN = """
def build_model():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    model[0].requires_grad_(False)
    return model


def build_dataset(split):
    return torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))


def loss(model, batch):
    return nn.functional.mse_loss(model(batch[0]), batch[1])
"""


def test_a_model_with_frozen_parameters_gets_a_memory_estimate(tmp_path: Path) -> None:
    code, output = _validate(tmp_path, recipe=_recipe(tmp_path, FROZEN))
    assert code == 0, output
    assert "model Sequential 49 parameters, 9 trainable" in output
    assert "memory per device (estimate, ddp, dp_replicate 2, fp32" in output, output


def test_explain_keeps_the_start_of_a_long_value(tmp_path: Path) -> None:
    """A long value keeps its start (a path's root, a mapping's first keys) and its end (the
    file name), where `--explain` used to cut it from the left."""
    from launcher.config.loader import load_cli_spec_and_sources
    from launcher.config.sources import explain_text

    recipe = tmp_path / "a-folder-with-a-long-name" / "and-another-one" / "my_recipe.py"
    model = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "dropout": 0.1}
    spec = write_spec(tmp_path / "run.yaml", recipe={"source": str(recipe), "model": model})
    rows = explain_text(*load_cli_spec_and_sources(spec)).splitlines()
    [source] = [row.split() for row in rows if row.split()[0] == "recipe.source"]
    [shown] = [row for row in rows if row.split()[0] == "recipe.model"]
    assert source[1] == f"{str(recipe)[:30]}...{str(recipe)[-15:]}", source
    assert source[1].endswith("/my_recipe.py")
    flow = "{block_size: 1024, dropout: 0.1, n_embd: 768, n_head: 12, n_layer: 12}"  # sorted
    assert f" {flow[:30]}...{flow[-15:]} " in shown, shown


OPENED = """
class Opened(torch.utils.data.Dataset):
    def __init__(self):
        self.log = open(__file__)  # an open file: no worker process but a forked one gets it

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.zeros(4), torch.zeros(1)

def build_dataset(split):
    return Opened()

def collate(samples, split):
    assert split == "val" or split == "train"
    return torch.utils.data.default_collate(samples)
"""


def test_validate_checks_what_loader_workers_are_sent(tmp_path: Path) -> None:
    """A dataset that loader workers started by a fork server cannot be sent is refused by
    validate, as by the run; forked workers (or none) take it."""
    recipe = _recipe(tmp_path, MODEL + LOSS + OPENED)
    code, output = _validate(tmp_path, "data.num_workers=2", recipe=recipe)
    usage = "data.worker_start: the train dataset (Opened) cannot be pickled"
    assert code == 2 and usage in output and "Traceback" not in output, output
    for fine in ("data.worker_start=fork", "data.num_workers=0"):
        code, output = _validate(tmp_path, "data.num_workers=2", fine, recipe=recipe)
        assert code == 0, output
    # The val split's loader workers are sent the val dataset: checked too.
    val_only = OPENED.replace(
        "    return Opened()",
        "    if split == 'train':\n"
        "        return torch.utils.data.TensorDataset(torch.zeros(64, 4), torch.zeros(64, 1))\n"
        "    return Opened()",
    )
    recipe = _recipe(tmp_path, MODEL + LOSS + val_only)
    code, output = _validate(tmp_path, "data.num_workers=2", "eval.every_n_steps=5", recipe=recipe)
    assert code == 2 and "the val dataset (Opened) cannot be pickled" in output, output
