"""Importing a user's recipe: a `.py` file anywhere on disk, or a dotted module.

A recipe defines:
  build_model(**model) -> nn.Module
  build_dataset(split, **dataset) -> torch.utils.data.Dataset
  loss(model, batch) -> Tensor | (Tensor, dict of metrics)
and may define
  evaluate(model, batch) -> dict of metrics | Tensor | (Tensor, dict)
for evaluation on the `val` split (default: `loss`), each metric a mean over the batch, and
`state_dict() -> obj` / `load_state_dict(obj)` for state of its own that a checkpoint must keep
(tensors, numbers, strings, lists and dicts of them), and
  param_groups(model[, optim]) -> list of torch param-group dicts
for the optimizer's parameter groups (instead of `optim.groups`; `optim`: the run's optimizer
settings, `launcher.worker.param_groups.OptimSettings`), and
  collate(samples[, split]) -> batch
to make one batch of a list of samples (`build_dataset` items) for train, val and streamed
batches alike (`split`, when it takes one by that name: "train" or "val"), in DataLoader
workers too (default: torch's `default_collate`), e.g. padding
sequences to the longest with a mask. Its batch must count the samples it was given: the
leading dimension its tensors share, or, where they share none (a packed batch), a dict
batch's `"num_samples": len(samples)` (an int, left in the batch the loss gets); see
`launcher.worker.data.batch_size`. And
  parallelize(model, mesh)
to split the model's layers over the `tp` axis of the device mesh (`parallel.tp`), e.g. with
torch's `parallelize_module` (`launcher.parallel.tensor_parallel`). And, for pipeline
parallelism (`parallel.pp`: the loss runs on the last stage's output), both of
  split_batch(batch) -> (inputs, targets)
  loss_from_output(output, targets) -> Tensor
where `inputs` (a tensor or a tuple of them) is what the model's forward takes, and `loss` is
`loss_from_output(model(*inputs), targets)`.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from launcher.config.sources import given_on_command_line
from launcher.errors import UsageError
from launcher.parallel.float8 import quiet_torchao_import
from launcher.parallel.hugging_face import init_hf_weights, is_hf_model

REQUIRED = ("build_model", "build_dataset", "loss")
PIPELINE_HOOKS = ("split_batch", "loss_from_output")


@dataclass(frozen=True)
class PipelineHooks:
    """What a pipeline needs of a recipe: a batch's model inputs and targets, and the loss of
    the last stage's output; None where the recipe has no such hook (the launcher supplies a
    Hugging Face causal LM's: `launcher.parallel.pipeline.causal_lm`)."""

    split_batch: Callable[[Any], tuple[Any, Any]] | None
    loss_from_output: Callable[[Any, Any], torch.Tensor] | None

    @property
    def split(self) -> Callable[[Any], tuple[tuple[Any, ...], Any]] | None:
        """(inputs as a tuple of positional arguments, targets), of a batch."""
        hook = self.split_batch
        if hook is None:
            return None

        def split(batch: Any) -> tuple[tuple[Any, ...], Any]:
            inputs, targets = call_user("recipe: split_batch(batch)", hook, batch)
            return (inputs if isinstance(inputs, tuple) else (inputs,)), targets

        return split


@dataclass(frozen=True)
class Recipe:
    source: str
    module: ModuleType

    def build_model(self, **kwargs: Any) -> torch.nn.Module:
        model = call_user("recipe.model", self.module.build_model, **kwargs)
        if not isinstance(model, torch.nn.Module):
            raise UsageError(
                f"{self.source}: build_model() returned {type(model).__name__}, expected an nn.Module"
            )
        return model

    def build_dataset(self, split: str, **kwargs: Any) -> torch.utils.data.Dataset:
        return call_user("recipe.dataset", self.module.build_dataset, split, **kwargs)

    def init_entry(self, model: torch.nn.Module) -> tuple[str, Callable[[], None]] | None:
        """The explicit initialisation of `model`, named for messages: the recipe's
        `init_weights(model)`, else a Hugging Face model's own init, else the model's
        `init_weights()`. None where only the constructors define the weights."""
        hook = getattr(self.module, "init_weights", None)
        if callable(hook):
            return "the recipe's init_weights(model)", lambda: hook(model)
        name = type(model).__name__
        if is_hf_model(model):
            return f"{name}'s Hugging Face init", lambda: init_hf_weights(model)
        own = getattr(model, "init_weights", None)
        if callable(own):
            return f"{name}.init_weights()", own
        return None

    def defines_init(self, model: torch.nn.Module) -> bool:
        """Whether the recipe or the model has an explicit initialisation (`init_entry`)."""
        return self.init_entry(model) is not None

    def init_weights(self, model: torch.nn.Module) -> None:
        """The explicit initialisation (`init_entry`), else every submodule's
        `reset_parameters()` (what most constructors run, but not all: see `WeightInit`)."""
        entry = self.init_entry(model)
        if entry is not None:
            entry[1]()
            return
        for module in model.modules():
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()  # type: ignore[operator]

    def param_groups_hook(self) -> Callable[[torch.nn.Module, Any], Any] | None:
        """The recipe's optional `param_groups(model)` or `param_groups(model, optim)`: the
        optimizer's groups, as torch's param-group dicts (`launcher.worker.param_groups`),
        called here as `(model, optim)` whichever it takes. `optim` is given by name, as
        collate's `split` is: another optional parameter (`decay=0.8`) keeps its default."""
        hook = getattr(self.module, "param_groups", None)
        if not callable(hook):
            return None
        takes_optim = self._takes_checked(
            hook,
            "param_groups",
            "optim",
            "must take the model, and may take the run's optimizer settings by name: "
            "param_groups(model) or param_groups(model, optim)",
            "docs/recipes.md#parameter-groups-and-the-optimizer",
        )
        if takes_optim:
            return lambda model, optim: hook(model, optim=optim)
        return lambda model, optim: hook(model)

    def parallelize_hook(self) -> Callable[[torch.nn.Module, Any], Any] | None:
        """The recipe's optional `parallelize(model, mesh)`: its tensor-parallel plan, applied
        to the model over the `tp` mesh axis (`launcher.parallel.tensor_parallel`)."""
        hook = getattr(self.module, "parallelize", None)
        return hook if callable(hook) else None

    def pipeline_hooks(self) -> PipelineHooks:
        """The recipe's `split_batch` and `loss_from_output`, which `parallel.pp` needs (None
        for each it does not define)."""
        hooks = {name: getattr(self.module, name, None) for name in PIPELINE_HOOKS}
        given = {name: hook if callable(hook) else None for name, hook in hooks.items()}
        return PipelineHooks(given["split_batch"], given["loss_from_output"])

    def collate_hook(self) -> Callable[..., Any] | None:
        """The recipe's optional `collate(samples)` or `collate(samples, split)`, which makes a
        batch of a list of samples (`split`: "train" or "val", `collate_takes_split`); None:
        torch's default_collate (`launcher.worker.data.collate_fn`)."""
        hook = getattr(self.module, "collate", None)
        if not callable(hook) and callable(getattr(self.module, "collate_fn", None)):
            # DataLoader's name for it: ignored, it would leave the batches unpadded.
            raise UsageError(
                f"{self.source}: defines collate_fn(); the launcher calls a recipe's "
                "collate(samples)",
                hint="Rename it collate (docs/recipes.md#collate-padding-a-batch).",
            )
        if not callable(hook):
            return None
        self._takes_checked(
            hook,
            "collate",
            "split",
            "must take the list of samples, and may take the split by name: "
            "collate(samples) or collate(samples, split)",
            "docs/recipes.md#collate-padding-a-batch",
        )
        return hook

    def _takes_checked(
        self, hook: Callable[..., Any], what: str, name: str, usage: str, hint: str
    ) -> bool:
        """Whether the recipe's hook `what` takes `name` by name (`_takes_by_name`), once it
        is known to be callable with its one positional argument and, where it takes it,
        `name`: a UsageError saying `usage` where not. One not inspectable (written in C) is
        called with its positional argument alone, as always."""
        try:
            signature = inspect.signature(hook)
        except (TypeError, ValueError):
            return False
        takes = _takes_by_name(hook, name)
        try:
            signature.bind(None, **({name: None} if takes else {}))
        except TypeError:
            raise UsageError(f"{self.source}: {what}{signature} {usage}", hint=hint) from None
        return takes

    def state_dict(self) -> Any:
        """The recipe's own state to checkpoint (its optional `state_dict()` hook)."""
        hook = getattr(self.module, "state_dict", None)
        return hook() if callable(hook) else None

    def load_state_dict(self, state: Any) -> None:
        hook = getattr(self.module, "load_state_dict", None)
        if callable(hook) and state is not None:
            hook(state)

    def loss(self, model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """The recipe's loss, always as (loss, metrics)."""
        out = self.module.loss(model, batch)
        loss, metrics = out if isinstance(out, tuple) else (out, {})
        return loss, dict(metrics)

    def evaluate(self, model: torch.nn.Module, batch: Any) -> dict[str, Any]:
        """The metrics of one evaluation batch, by name: the recipe's `evaluate`, else its
        `loss` (as `loss` plus its metrics)."""
        hook = getattr(self.module, "evaluate", None)
        out = hook(model, batch) if callable(hook) else self.module.loss(model, batch)
        if isinstance(out, dict):
            return dict(out)
        loss, metrics = out if isinstance(out, tuple) else (out, {})
        return {"loss": loss, **metrics}


def collate_takes_split(hook: Callable[..., Any]) -> bool:
    """Whether a recipe's collate takes the split ("train" or "val"), given by name."""
    return _takes_by_name(hook, "split")


def _takes_by_name(hook: Callable[..., Any], name: str) -> bool:
    """Whether `hook` has a parameter `name` that can be given by name. By name, so that an
    optional parameter of another meaning (`collate(samples, pad_to=8)`,
    `param_groups(model, decay=0.8)`) is never given the split or the optimizer settings."""
    try:
        parameters = inspect.signature(hook).parameters
    except (TypeError, ValueError):
        return False
    wanted = parameters.get(name)
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return wanted is not None and wanted.kind in by_name


def load_recipe(source: str, origin: str = "", float8: bool = False) -> Recipe:
    """Import `source` and check it has what the launcher calls. `origin`: where the path came
    from, as `launcher.config.sources` records it (the launcher knows; a worker does not).
    `float8`: the run trains in float8 (`train.float8`), which keeps more of what torchao
    says as a recipe's imports import it (`launcher.parallel.float8.quiet_torchao_import`).

    A failure inside the user's own module shows their traceback: it is their bug to fix.
    """
    quiet_torchao_import(float8)
    try:
        module = _import(source, origin)
    except UsageError:
        raise
    except SyntaxError as exc:
        where = f"{exc.filename}:{exc.lineno}" if exc.filename else source
        code = (exc.text or "").rstrip("\n")
        caret = " " * max(0, (exc.offset or 1) - 1 - (len(code) - len(code.lstrip()))) + "^"
        raise UsageError(
            f"recipe.source: {where}: {exc.msg}",
            details=[code.strip(), caret] if code.strip() else [],
        ) from None
    except Exception as exc:
        raise UsageError(
            f"recipe.source: importing {source} failed:", details=[users_traceback(exc)]
        ) from None
    missing = [name for name in REQUIRED if not callable(getattr(module, name, None))]
    if missing:
        raise UsageError(
            f"recipe.source: {source} does not define {', '.join(missing)}",
            hint="A recipe defines build_model(**model), build_dataset(split, **dataset) "
            "and loss(model, batch); see docs/recipes.md.",
        )
    return Recipe(source, module)


def _relative_to(origin: str) -> str:
    """What a relative path given where `origin` says was relative to: the path the user gave
    has already been made absolute by the loader."""
    given = origin.split(" (over ")[0]
    if not given:  # a worker: its plan holds the path its launcher checked
        return (
            "A path in a YAML file is relative to that file's folder; one given on the command "
            "line (recipe.source=PATH), to the working directory."
        )
    if given_on_command_line(given):
        return (
            f"It was given on the command line ({given}): a path given there is relative to "
            f"the working directory, {os.getcwd()}."
        )
    yaml_file = Path(given.rsplit(":", 1)[0]).resolve()
    return (
        f"It was given in {given}: a path in a YAML file is relative to that file's folder, "
        f"{yaml_file.parent}."
    )


# Frames of these say nothing about the user's bug: the launcher's, torch's, importlib's.
_NOT_USERS = (str(Path(__file__).parents[1]), str(Path(torch.__file__).parent), "<frozen")


def users_traceback(exc: BaseException) -> str:
    """The traceback of an exception from a recipe's code, its own frames only."""
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_NOT_USERS)
    ]
    return "".join(traceback.format_list(frames) + traceback.format_exception_only(exc)).rstrip()


def call_user(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a recipe function, turning a bad keyword into a short message that names the key."""
    try:
        return fn(*args, **kwargs)
    except TypeError as exc:
        # Only a TypeError raised by the call itself is about the arguments; one from deeper
        # down is the recipe's own bug and keeps its traceback.
        tb = exc.__traceback__
        if tb is not None and tb.tb_next is None:
            raise UsageError(f"{what}: {exc}") from None
        raise


def _import(source: str, origin: str) -> ModuleType:
    if source.endswith(".py"):
        path = Path(source)
        if not path.is_file():
            raise UsageError(f"recipe.source: {source} does not exist", hint=_relative_to(origin))
        # A recipe may import its sibling modules, as a script would.
        sys.path.insert(0, str(path.parent))
        return _exec_file(f"recipe_{path.stem}", str(path))
    # Workers run with `python -m`, which puts the working directory on sys.path; a console
    # script does not, and `train validate` must import what the workers will.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(source)
    except ModuleNotFoundError as exc:
        if exc.name and (source == exc.name or source.startswith(exc.name + ".")):
            raise UsageError(
                f"recipe.source: no module named {source!r}",
                hint="Give a path to a .py file, or a module importable from the working directory.",
            ) from None
        raise


# The recipe files this process imported, by module name: a loader worker started by
# forkserver or spawn imports them again before it unpickles the dataset and collate, whose
# classes and functions live in them (`launcher.worker.loader_workers`).
_RECIPE_FILES: dict[str, str] = {}


def _exec_file(name: str, path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    _RECIPE_FILES[name] = path
    return module


def recipe_files() -> list[tuple[str, str]]:
    """(module name, path) of every recipe file imported here, in the order of import."""
    return list(_RECIPE_FILES.items())


def import_recipe_file(name: str, path: str) -> None:
    """Imports a recipe file under the name the training process gave it, unless it is
    already imported here. A worker's sys.path is its training process's (multiprocessing
    sends it), which holds the recipe's folder."""
    if name not in sys.modules:
        quiet_torchao_import(float8=False)  # a loader worker never trains
        _exec_file(name, path)
