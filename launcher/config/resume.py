"""What a resumed run runs: the run's own spec, changed only where the user changes it now.

A resumed run starts from the spec its checkpoint recorded: every key as the run resolved it,
the flags and overrides it was started with included. A key changes only where the user
changes it now: given again as a flag or a `key=value` override, or edited in the YAML file
since the run was last started (the checkpoint records the file as it was read then). Every
change is said before anything starts; the launcher refuses the ones a run cannot take.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BaseModel

from launcher.config.loader import SpecLayers, validate_spec
from launcher.config.parallel import kept_on_resume
from launcher.config.section import Section
from launcher.config.sources import changed_keys, set_keys
from launcher.config.spec import RunSpec

_MISSING = object()  # a key the file does not set


@dataclass(frozen=True)
class Change:
    key: str  # dotted, e.g. optim.lr
    before: Any
    after: Any
    origin: str  # "override optim.lr=1e-6", "--strategy", "edited in run.yaml"

    def describe(self) -> str:
        return f"changed on resume: {self.key} {_show(self.before)} -> {_show(self.after)} ({self.origin})"


@dataclass(frozen=True)
class ResumedSpec:
    spec: RunSpec
    sources: dict[str, str]  # {dotted key: where its value came from}: spec.resume-N.yaml's
    changes: list[Change]
    yaml: dict[str, Any] | None  # the YAML file as this launch read it, for the next resume


def spec_on_resume(
    recorded: dict[str, Any], recorded_yaml: dict[str, Any] | None, layers: SpecLayers
) -> ResumedSpec:
    """The spec a run resumed from a checkpoint runs with: `recorded` (the checkpoint's spec)
    where the user changes nothing now; `recorded_yaml` is the YAML file as the run read it
    when it last started, None where the checkpoint predates that record (then only the
    command line changes a key)."""
    now = layers.yaml if layers.yaml is not None else recorded_yaml
    then = recorded_yaml if recorded_yaml is not None else now
    raw = copy.deepcopy(recorded)
    origins: dict[str, str] = {}
    edited = f"edited in {layers.config}" if layers.config else "edited"
    for key in field_keys(RunSpec):
        was, wanted = _get(then, key), _get(now, key)
        if was == wanted:
            continue
        if wanted is _MISSING:
            _delete(raw, key)  # no longer in the file: its default
        else:
            _set(raw, key, wanted)
        origins[key] = edited
    for key, value, origin in layers.given:
        _set(raw, key, value)
        origins[key] = origin
    origins.update(_drop_what_the_new_strategy_cannot_take(raw, recorded, origins))
    where = f"{layers.config or 'the checkpoint'} (resumed)"
    spec = validate_spec(raw, source=where, where=origins)
    before = RunSpec.model_validate(recorded)
    changes = [
        Change(key, was, _value(spec, key), _origin_of(key, origins))
        for key, was in changed_keys(before, spec).items()
    ]
    kept = {key: "as the run had it" for key in set_keys(spec) if key not in origins}
    return ResumedSpec(spec, {**kept, **origins}, changes, now)


def _drop_what_the_new_strategy_cannot_take(
    raw: dict[str, Any], recorded: dict[str, Any], origins: dict[str, str]
) -> dict[str, str]:
    """A strategy given now (a tp or HSDP run resumed as ddp) drops each stored `parallel` key
    it cannot take, back to its default, unless that key is given now too; returns their
    origins, so that each is said as a change."""
    strategy, stored = _get(raw, "launch.strategy"), _get(raw, "parallel")
    if "launch.strategy" not in origins or strategy == _get(recorded, "launch.strategy"):
        return {}
    dropped = {}
    for name, value in list(stored.items() if isinstance(stored, dict) else ()):
        key = f"parallel.{name}"
        if key not in origins and not kept_on_resume(strategy, name, value):
            _delete(raw, key)
            dropped[key] = f"dropped: launch.strategy {strategy} cannot take it"
    return dropped


def field_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every key of the spec, dotted, down to the fields that are not sections (a mapping such
    as `recipe.model` is one key)."""
    keys = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, Section):
            keys += field_keys(kind, f"{key}.")
        else:
            keys.append(key)
    return keys


def _origin_of(key: str, origins: dict[str, str]) -> str:
    """The origin of a key's change: its own, or those of the keys set inside it (an override
    of `recipe.model.hidden` changes `recipe.model`)."""
    if key in origins:
        return origins[key]
    inside = sorted({v for k, v in origins.items() if k.startswith(key + ".")})
    return ", ".join(inside) or "resolved at launch"


def _get(raw: dict[str, Any] | None, key: str) -> Any:
    node: Any = raw
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _set(raw: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = copy.deepcopy(value)


def _delete(raw: dict[str, Any], key: str) -> None:
    *parents, leaf = key.split(".")
    node: Any = raw
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(leaf, None)


def _value(spec: BaseModel, key: str) -> Any:
    node: Any = spec.model_dump(mode="json", by_alias=True)
    for part in key.split("."):
        node = node[part]
    return node


def _show(value: Any) -> str:
    return (
        yaml.safe_dump(value, default_flow_style=True, width=10**6)
        .strip()
        .removesuffix("...")
        .strip()
    )
