"""Parameter groups (`optim.groups`, a recipe's `param_groups`), any optimizer by dotted path,
frozen parameters, the weights' average (`train.ema`): each takes effect on 2 processes under
ddp and fsdp, and a resumed run continues them bitwise."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from launcher.config.optim import OptimSection
from launcher.errors import UsageError
from launcher.worker.param_groups import group_parameters
from launcher.worker.recipe import Recipe
from tests.conftest import metrics_of, only_run_dir, run_train, usage_error, write_spec
from tests.forked_train import train_in_fork
from tests.tiny_recipes import tiny_recipe, write_recipe

pytestmark = pytest.mark.timeout(300)

# A model whose `kept` and `decayed` get exactly zero gradients: AdamW moves them only by its
# weight decay, so `kept` (weight_decay 0) must stay ones and `decayed` shrink by
# (1 - lr * weight_decay) a step. `head` is in a group of lr 0; `frozen` needs no gradient.
# The data and loss are the tiny recipe's (DATA).
RECIPE = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)
        self.kept = nn.Parameter(torch.ones(8))
        self.decayed = nn.Parameter(torch.ones(8))

    def forward(self, x):
        out = self.head(torch.relu(self.body(self.frozen(x))))
        return out + 0 * (self.kept.sum() + self.decayed.sum())

def build_model():
    return Net()
"""
HOOK = """
def param_groups(model):
    others = [p for n, p in model.named_parameters() if n != "kept" and p.requires_grad]
    return [{"params": [model.kept], "weight_decay": 0.0}, {"params": others}]
"""
LR, DECAY, STEPS = 0.01, 0.5, 6
GROUPS = [{"params": ["kept"], "weight_decay": 0.0}, {"params": ["head.*"], "lr": 0.0}]


DATA = {"n_samples": 256, "target": "sum", "val_seed": 1}
RUN = {
    "optim": {"name": "AdamW", "lr": LR, "kwargs": {"weight_decay": DECAY}},
    "train": {"max_steps": STEPS, "log_every": 1},
    "checkpoint": {"every_n_steps": 2},
}


def _spec(folder: Path, recipe: str, strategy: str, **sections: dict) -> Path:
    grouped = write_recipe(folder, recipe, "grouped.py")
    recipe_section = tiny_recipe(grouped, **DATA)
    return write_spec(
        folder / "run.yaml", RUN, launch={"strategy": strategy}, recipe=recipe_section, **sections
    )


def _checkpoint(run: Path, step: int, scratch: Path) -> dict[str, torch.Tensor]:
    out = scratch / f"step-{step}.pt"
    dcp_to_torch_save(run / "checkpoints" / f"step-{step:08d}", out)
    state = torch.load(out, weights_only=True)
    return {**state["model"], **{f"ema.{k}": v for k, v in state.get("ema", {}).items()}}


def _losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.parametrize(
    ("strategy", "schedule", "ema"),
    [("ddp", "wsd", None), pytest.param("fsdp", "linear", {"decay": 0.9}, marks=pytest.mark.smoke)],
)
def test_groups_take_effect_and_resume_bitwise(
    tmp_path: Path, strategy: str, schedule: str, ema: dict | None
) -> None:
    spec = _spec(
        tmp_path, RECIPE, strategy,
        optim={"groups": GROUPS, "schedule": schedule, "warmup_steps": 2},
        train={"ema": ema},
        eval={"every_n_steps": 3 if ema else None},
    )  # fmt: skip
    result = run_train(["--config", str(spec)], cwd=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "85 parameters (65 trainable)" in out  # not the frozen Linear's 20
    assert "optim group 1 ['kept']: 1 tensor, 8 parameters, weight_decay=0.0" in out
    assert "optim group 2 ['head.*']: 2 tensors, 9 parameters, lr=0.0" in out
    run = only_run_dir(tmp_path / "runs")
    first, last = _checkpoint(run, 2, tmp_path), _checkpoint(run, STEPS, tmp_path)
    assert torch.equal(last["kept"], torch.ones(8))
    lrs = [json.loads(r).get("lr") for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert len({lr for lr in lrs if lr is not None}) >= 2  # the schedule moved the rate
    assert all(r["grad_norm"] > 0 for r in metrics_of(run) if "loss" in r)
    assert last["decayed"].max() < 1 - 2 * LR * DECAY * 0.5  # decayed, by every group's lr
    for name in ("head.weight", "head.bias", "frozen.weight"):
        assert torch.equal(first[name], last[name]), name
    assert not torch.equal(first["body.weight"], last["body.weight"])
    if ema:  # the average is of the trained weights, and is evaluated beside them
        assert not torch.equal(last["ema.body.weight"], last["body.weight"])
        assert torch.equal(last["ema.head.weight"], last["head.weight"])  # lr 0: no change
        assert "ema.frozen.weight" not in last
        evals = [r for r in metrics_of(run) if "val/loss" in r]
        assert [r["step"] for r in evals] == [3, 6]
        assert all(r["val_ema/loss"] != r["val/loss"] for r in evals)
    _check_export_of_the_average(run, tmp_path, last if ema else None)
    # Resumed at step 2, it ends exactly where the uninterrupted run ended.
    branch = tmp_path / "branch"
    resumed = run_train(
        ["--config", str(spec), "--resume", str(run / "checkpoints" / "step-00000002"),
         "--run-dir", str(branch)],
        cwd=tmp_path,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    again = _checkpoint(branch, STEPS, tmp_path / "branch")
    assert again.keys() == last.keys()
    for key in last:
        assert torch.equal(again[key], last[key]), key
    assert {s: v for s, v in _losses(run).items() if s > 2} == _losses(branch)
    if strategy == "ddp":
        _check_a_resume_may_regroup(spec, run, tmp_path)


def _check_a_resume_may_regroup(spec: Path, run: Path, folder: Path) -> None:
    """Groups and their settings are the spec's now: each parameter's own optimizer state
    continues, whatever group it is in."""
    regrouped = folder / "regrouped"
    resumed = run_train(
        ["--config", str(spec), "--resume", str(run / "checkpoints" / "step-00000004"),
         "optim.groups=[]", "--run-dir", str(regrouped)],
        cwd=folder,
    )  # fmt: skip
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out
    assert "changed on resume: optim.groups" in out
    before, after = _checkpoint(run, 4, folder), _checkpoint(regrouped, STEPS, regrouped)
    assert not torch.equal(before["head.weight"], after["head.weight"])  # lr 0 no more
    assert after["kept"].max() < 1  # now decayed with the rest


def test_a_recipes_param_groups_and_a_dotted_optimizer(tmp_path: Path) -> None:
    (tmp_path / "my_optimizers.py").write_text(
        "import torch\n\nclass Decoupled(torch.optim.AdamW):\n    pass\n"
    )
    spec = _spec(tmp_path, RECIPE + HOOK, "ddp", optim={"name": "my_optimizers.Decoupled"})
    result = run_train(["--config", str(spec)], cwd=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "optim param_groups() group 1: 1 tensor, 8 parameters, weight_decay=0.0" in out
    last = _checkpoint(only_run_dir(tmp_path / "runs"), STEPS, tmp_path)
    assert torch.equal(last["kept"], torch.ones(8))
    assert last["decayed"].max() < 1
    # The hook and optim.groups together: one must go.
    both = train_in_fork(["--config", str(spec), f"optim.groups={json.dumps(GROUPS)}"], tmp_path)
    usage_error(both, "optim.groups", "param_groups(model)")


def test_a_pattern_that_matches_nothing_names_close_names(tmp_path: Path) -> None:
    spec = _spec(tmp_path, RECIPE, "ddp", optim={"groups": [{"params": ["heads.*"], "lr": 0}]})
    expected = ("optim.groups: group 1's pattern 'heads.*' matches no parameter", "head.")
    usage_error(train_in_fork(["validate", "--config", str(spec)], cwd=tmp_path), *expected)
    usage_error(train_in_fork(["--config", str(spec)], cwd=tmp_path), *expected)
    good = _spec(tmp_path, RECIPE, "ddp", optim={"groups": GROUPS})
    checked = train_in_fork(["validate", "--config", str(good)], cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "85 parameters, 65 trainable in 3 optimizer groups" in checked.stdout


def test_a_pattern_that_matches_only_frozen_parameters_is_refused(tmp_path: Path) -> None:
    groups = [{"params": ["frozen.*"], "lr": 0.1}]
    spec = _spec(tmp_path, RECIPE, "ddp", optim={"groups": groups})
    expected = (
        "optim.groups: group 1's pattern 'frozen.*' matches only frozen parameters",
        "frozen.weight, frozen.bias: requires_grad=False",
    )
    usage_error(train_in_fork(["validate", "--config", str(spec)], cwd=tmp_path), *expected)
    usage_error(train_in_fork(["--config", str(spec)], cwd=tmp_path), *expected)


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"lr": -1.0}, "lr: must be 0 or more, got -1.0"),
        ({"weight_decay": float("nan")}, "weight_decay: nan is not a number"),
        ({"betas": (2.0, 0.9)}, "AdamW refuses betas=(2.0, 0.9): Invalid beta parameter"),
    ],
)
def test_a_recipes_groups_are_held_to_the_same_values(settings: dict, expected: str) -> None:
    module = ModuleType("recipe_under_test")
    module.param_groups = lambda model: [{"params": model.parameters(), **settings}]  # type: ignore[attr-defined]
    with pytest.raises(UsageError, match=r"recipe: param_groups\(\) group 1: ") as refused:
        group_parameters(OptimSection(name="AdamW"), torch.nn.Linear(2, 1), Recipe("r.py", module))
    assert expected in refused.value.message


@pytest.mark.parametrize(
    ("optim", "expected"),
    [
        ({"name": "no_such_module.Fast"}, "cannot import no_such_module"),
        ({"name": "torch.nn.Linear"}, "not a torch.optim.Optimizer subclass"),
        ({"groups": [{"params": ["*.bias"], "momentum": 0.9}]}, "AdamW does not take momentum"),
        ({"groups": [{"weight_decay": 0.0}]}, "expected `params:`"),
        ({"schedule": "cosine", "decay_steps": 10}, "decay_steps: only `schedule: wsd`"),
    ],
)
def test_bad_optim_keys_are_refused_before_anything_starts(
    tmp_path: Path, optim: dict, expected: str
) -> None:
    spec = _spec(tmp_path, RECIPE, "ddp", optim=optim)
    usage_error(train_in_fork(["--config", str(spec)], cwd=tmp_path), expected)


def test_the_average_follows_the_weights_by_its_decay() -> None:
    from launcher.worker.ema import WeightAverage

    model = torch.nn.Linear(3, 2)
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    both = torch.nn.Sequential(model, frozen)
    average = WeightAverage(both, decay=0.75)
    assert list(average.state_dict()) == ["0.weight", "0.bias"]
    start = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(4.0)
    average.update()
    assert torch.allclose(average.state_dict()["0.weight"], start + 1.0)
    with average.swapped_in():
        assert torch.allclose(model.weight, start + 1.0)
    assert torch.equal(model.weight, start + 4.0)


def _check_export_of_the_average(
    run: Path, folder: Path, saved: dict[str, torch.Tensor] | None
) -> None:
    """`train export --ema` writes the average, which the recipe's model loads strictly; a
    run without one is refused."""
    out = folder / "average.pt"
    result = train_in_fork(["export", str(run), "--ema", "--out", str(out)], cwd=folder)
    if saved is None:
        usage_error(result, "--ema: this checkpoint holds no average")
        return
    assert result.returncode == 0, result.stdout + result.stderr
    namespace: dict = {}
    exec(RECIPE, namespace)  # the recipe's own model, as a user would build it
    model = namespace["build_model"]()
    model.load_state_dict(torch.load(out, weights_only=True), strict=True)
    assert torch.equal(model.body.weight, saved["ema.body.weight"])
    assert torch.equal(model.frozen.weight, saved["frozen.weight"])  # not averaged


class _OwnNorm(torch.nn.LayerNorm):
    """A recipe's own norm: a LayerNorm to `modules: [LayerNorm]`."""


def _sequential() -> torch.nn.Sequential:
    """Parameters named by position (`1.weight`): no name says which are norms."""
    return torch.nn.Sequential(
        torch.nn.Embedding(10, 8),
        torch.nn.LayerNorm(8),
        torch.nn.Linear(8, 8),
        torch.nn.Sequential(_OwnNorm(8), torch.nn.Linear(8, 2)),
    )


def test_groups_select_by_module_type_as_well_as_by_name() -> None:
    model = _sequential()
    norms = [model[1].weight, model[1].bias, model[3][0].weight, model[3][0].bias]
    groups = [{"modules": ["LayerNorm"], "weight_decay": 0.0}, {"params": ["*.bias"], "lr": 0.5}]
    grouping = group_parameters(OptimSection(groups=groups), model, None)
    by_type, biases, rest = (g.params for g in grouping.groups)
    assert by_type == norms  # a subclass of LayerNorm's too
    assert biases == [model[2].bias, model[3][1].bias]  # the first group that selects one wins
    assert rest == [model[0].weight, model[2].weight, model[3][1].weight]
    assert grouping.names() == ["group1", "group2", "other"]
    # `params` and `modules` in one group: what either selects.
    both = [{"name": "no_decay", "params": ["0.*"], "modules": "LayerNorm", "weight_decay": 0.0}]
    grouping = group_parameters(OptimSection(groups=both), model, None)
    assert grouping.groups[0].params == [model[0].weight, *norms]
    assert grouping.lines()[0].startswith(
        "optim group 1 (no_decay) ['0.*'] modules ['LayerNorm']: 5 tensors, 112 parameters"
    )
    assert grouping.names() == ["no_decay", "other"]


@pytest.mark.parametrize(
    ("modules", "expected"),
    [
        (["LayerNrom"], ("module type 'LayerNrom' is the class of no module", "LayerNorm")),
        (["ReLU"], ("module type 'ReLU' is the class of no module",)),
        (["Sequential"], ()),  # every parameter: the whole model is one
    ],
)
def test_a_module_type_must_name_modules_of_the_model(
    modules: list[str], expected: tuple[str, ...]
) -> None:
    optim = OptimSection(groups=[{"modules": modules, "lr": 0.1}])
    if not expected:
        assert len(group_parameters(optim, _sequential(), None).groups) == 1
        return
    with pytest.raises(UsageError) as refused:
        group_parameters(optim, _sequential(), None)
    text = refused.value.message + "".join(refused.value.details)
    assert all(part in text for part in expected), text


def test_a_module_type_of_frozen_or_no_parameters_is_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.LayerNorm(2))
    model[2].requires_grad_(False)
    for modules, expected in ((["ReLU"], "'ReLU' has no parameters"), (["LayerNorm"], "frozen")):
        with pytest.raises(UsageError, match=expected):
            group_parameters(OptimSection(groups=[{"modules": modules}]), model, None)


@pytest.mark.parametrize(
    ("groups", "expected"),
    [
        ([{"name": "a b", "params": ["*"]}], "name: expected letters, digits"),
        ([{"name": "other", "params": ["*"]}], "'other' names the parameters in no group"),
        ([{"name": "x", "params": ["a"]}, {"name": "x", "params": ["b"]}], "two groups are named"),
        ([{"modules": []}], "or `modules:` with one or more module class names"),
    ],
)
def test_bad_group_selectors_are_refused(groups: list[dict], expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        OptimSection(groups=groups)


# Sequential with a LayerNorm: only `modules` can say which parameters are the norm's.
NORMED = """
from torch import nn

def build_model():
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1))
"""


def test_module_types_and_each_groups_logged_rate(tmp_path: Path) -> None:
    """`modules: [LayerNorm]` in a Sequential; the rate logged at step 1 is the one step 1
    used (half the peak: the first of 2 warmup steps), and each group's beside it."""
    groups = [{"name": "norms", "modules": ["LayerNorm"], "weight_decay": 0.0, "lr": 0.01}]
    optim = {"lr": 0.001, "groups": groups, "warmup_steps": 2}
    spec = _spec(tmp_path, NORMED, "ddp", optim=optim, checkpoint={"enabled": False})
    checked = train_in_fork(["validate", "--config", str(spec)], cwd=tmp_path)
    assert "65 trainable in 2 optimizer groups" in checked.stdout, checked.stdout + checked.stderr
    misspelled = json.dumps([{**groups[0], "modules": ["LayerNrom"]}])
    typo = train_in_fork(
        ["validate", "--config", str(spec), f"optim.groups={misspelled}"], tmp_path
    )
    usage_error(typo, "group 1's module type 'LayerNrom'", "close names: LayerNorm")
    result = run_train(["--config", str(spec)], cwd=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "optim group 1 (norms) modules ['LayerNorm']: 2 tensors, 16 parameters" in out
    steps = {r["step"]: r for r in metrics_of(only_run_dir(tmp_path / "runs")) if "lr" in r}
    assert {k: v for k, v in steps[1].items() if k.startswith("lr")} == {
        "lr": 0.001 * 0.5, "lr/norms": 0.01 * 0.5, "lr/other": 0.001 * 0.5,
    }  # fmt: skip
    assert steps[STEPS]["lr/norms"] == 0.01


# A hook that sets its groups relative to the run's optimizer settings.
RELATIVE_HOOK = """
def param_groups(model, optim):
    assert optim.name == "AdamW" and optim.weight_decay == 0.5
    head = [model.head.weight, model.head.bias]
    others = [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("head")]
    return [{"name": "head", "params": head, "lr": optim.lr * 10}, {"params": others}]
"""


def test_a_hook_gets_the_optimizer_settings_an_override_made(tmp_path: Path) -> None:
    spec = _spec(tmp_path, RECIPE + RELATIVE_HOOK, "ddp", checkpoint={"enabled": False})
    result = run_train(["--config", str(spec), "optim.lr=0.002"], cwd=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "optim param_groups() group 1 (head): 2 tensors, 9 parameters, lr=0.02" in out
    first = next(r for r in metrics_of(only_run_dir(tmp_path / "runs")) if "lr" in r)
    assert (first["lr"], first["lr/head"], first["lr/group2"]) == (0.002, 0.002 * 10, 0.002)


def test_a_hook_gets_the_settings_by_the_name_optim_alone() -> None:
    module = ModuleType("recipe_under_test")
    exec(
        "def param_groups(model, decay=0.25):\n"  # an option of its own keeps its default
        "    return [{'params': model.parameters(), 'weight_decay': decay}]\n",
        module.__dict__,
    )
    grouping = group_parameters(OptimSection(), torch.nn.Linear(2, 1), Recipe("r.py", module))
    assert grouping.groups[0].options == {"weight_decay": 0.25}
    exec(
        "def param_groups(model, *, optim):\n"
        "    return [{'params': model.parameters(), 'lr': optim.lr / 4}]\n",
        module.__dict__,
    )
    grouping = group_parameters(OptimSection(lr=0.5), torch.nn.Linear(2, 1), Recipe("r", module))
    assert grouping.groups[0].options == {"lr": 0.125}
    module.param_groups = lambda: []  # type: ignore[attr-defined]
    with pytest.raises(UsageError, match=r"param_groups\(\) must take the model"):
        group_parameters(OptimSection(), torch.nn.Linear(2, 1), Recipe("r.py", module))
