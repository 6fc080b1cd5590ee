"""Reading a run spec: YAML file + `key=value` overrides -> a validated `RunSpec`.

Every problem is collected and reported at once, each naming its dotted key, the YAML line
where there is one, what was expected and what was given.
"""

from __future__ import annotations

import copy
import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from launcher.config.optim import TORCH_FREE
from launcher.config.spec import RunSpec
from launcher.config.yaml_file import clip, echo, parse_yaml_value, read_yaml_file
from launcher.errors import UsageError
from launcher.storage_url import is_url, mask_override

# Room for a message's own words around what it quotes.
_MESSAGE_CHARS = 240


@dataclass(frozen=True)
class SpecLayers:
    """What the user gave for a run, layer by layer, before they are merged: the YAML file as
    read, then `key=value` overrides and flags (a resumed run merges them onto its own spec:
    `launcher.config.resume`)."""

    config: Path | None  # --config; None: a resume that gave none
    yaml: dict[str, Any] | None  # the file's mapping, `recipe.source` made absolute
    where: dict[str, str]  # {dotted key: its line in the file}
    given: tuple[tuple[str, Any, str], ...] = ()  # (key, value, origin): overrides, then flags


def load_cli_spec(
    config: Path,
    overrides: list[str] | None = None,
    strict_compile: bool = False,
    **flags: str | None,
) -> RunSpec:
    """The spec `--config` names, with `overrides` and the flags given (`--devices` ...) applied
    by precedence: flag > key=value > YAML > default."""
    return load_cli_spec_and_sources(config, overrides, strict_compile, **flags)[0]


def load_cli_spec_and_sources(
    config: Path,
    overrides: list[str] | None = None,
    strict_compile: bool = False,
    **flags: str | None,
) -> tuple[RunSpec, dict[str, str]]:
    """`load_cli_spec`, and where each given key came from (`launcher.config.sources`)."""
    return spec_from_layers(cli_layers(config, overrides, strict_compile, **flags))


def cli_layers(
    config: Path | None,
    overrides: list[str] | None = None,
    strict_compile: bool = False,
    load_weights: str | None = None,
    **flags: str | None,
) -> SpecLayers:
    """The layers of the command line: `--config`'s file (None: none given), the overrides,
    and the flags that set spec keys (`flags`: `launch.*`'s)."""
    # Numbers and `null` are read as YAML, as in overrides; names stay strings.
    typed = ("devices", "max_restarts", "stall_timeout")
    given: dict[str, tuple[str, object]] = {}
    for key, text in flags.items():
        if text is None:
            continue
        flag = f"--{key.replace('_', '-')}"
        value = parse_yaml_value(text, f"{flag} {echo(text)}") if key in typed else text
        given[f"launch.{key}"] = (flag, value)
    if strict_compile:
        given["xla.strict_compile"] = ("--strict-compile", True)
    if load_weights is not None:
        given["load.weights"] = ("--load-weights", load_weights)
    return read_layers(config, overrides, given)


def read_layers(
    path: Path | None,
    overrides: list[str] | None = None,
    flags: dict[str, tuple[str, Any]] | None = None,
) -> SpecLayers:
    """The YAML file at `path` (none: None) and the overrides and `flags` ({dotted key: (flag
    name, value)}) as layers; a path in the file is relative to the file, one given on the
    command line to the working directory."""
    raw, where = read_yaml_file(path) if path is not None else (None, {})
    if path is not None:
        _require_mapping(raw, source=str(path))  # before overrides are set into it
        _absolutize_paths(raw, path.parent)
    # An override's label (errors, spec.yaml's comments) never repeats a secret it holds.
    given = [
        (*parse_override(text), f"override {clip(mask_override(text))}") for text in overrides or []
    ]
    given += [(key, value, flag) for key, (flag, value) in (flags or {}).items()]
    given = [(key, _absolute_path(key, value, Path.cwd()), origin) for key, value, origin in given]
    return SpecLayers(path, raw, where, tuple(given))


def spec_from_layers(
    layers: SpecLayers, torch_checks: bool = True
) -> tuple[RunSpec, dict[str, str]]:
    """The spec, and where each key that was given came from: {dotted key: "x.yaml:12" |
    "override k=v (over x.yaml:12)" | "--devices"} (`launcher.config.sources` shows them).
    Raises `UsageError` listing every problem. Precedence: flags > overrides > YAML.
    `torch_checks=False` skips the checks that import torch (optimizer names)."""
    path = layers.config
    raw = copy.deepcopy(layers.yaml) if layers.yaml is not None else {}
    where = dict(layers.where)
    sources = {key: f"{path}:{line.removeprefix('line ')}" for key, line in where.items()}
    for key, value, origin in layers.given:
        _set_dotted(raw, key, value, origin=origin)
        where[key] = origin
        over = sources.get(key)
        sources[key] = f"{origin} (over {over})" if over else origin
    source = str(path) if path is not None else "the command line"
    spec = validate_spec(raw, source=source, where=where, torch_checks=torch_checks)
    return spec, sources


def load_spec_and_sources(
    path: Path,
    overrides: list[str] | None = None,
    flags: dict[str, tuple[str, Any]] | None = None,
    torch_checks: bool = True,
) -> tuple[RunSpec, dict[str, str]]:
    """Reads, overrides and validates a spec (`spec_from_layers`)."""
    return spec_from_layers(read_layers(path, overrides, flags), torch_checks)


def validate_spec(
    raw: Any, source: str, where: dict[str, str] | None = None, torch_checks: bool = True
) -> RunSpec:
    _require_mapping(raw, source)
    # The checks that need no torch first: a spec's mistakes are reported, all at once, before
    # torch's seconds of import. Those that need it (optimizer names) come once these pass: a
    # spec with both kinds of mistake is told of them in two rounds, for a CLI that answers at
    # once.
    spec = _validate(raw, source, where, TORCH_FREE)
    return _validate(raw, source, where, None) if torch_checks else spec


def _validate(raw: Any, source: str, where: dict[str, str] | None, context: Any) -> RunSpec:
    try:
        return RunSpec.model_validate(raw, context=context)
    except ValidationError as exc:
        problems = [_describe(err, where or {}) for err in exc.errors()]
        noun = "problem" if len(problems) == 1 else "problems"
        raise UsageError(
            f"{source}: {len(problems)} {noun} in the run spec:",
            details=problems,
            hint="Fix the keys above; `train validate --config FILE` checks a spec without running it.",
        ) from None


def parse_override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+", key):
        raise UsageError(
            f"{echo(mask_override(text))} is not an override: write section.key=value, e.g. "
            "optim.lr=3e-4"
        )
    return key, parse_yaml_value(value, origin=f"override {echo(mask_override(text))}")


def spec_to_yaml(spec: RunSpec) -> str:
    # Unwrapped: a long string stays on its key's line, where spec.yaml's comment can follow it.
    data = spec.model_dump(mode="json", by_alias=True)
    return yaml.safe_dump(data, sort_keys=False, width=10**9)


def _require_mapping(raw: Any, source: str) -> None:
    if not isinstance(raw, dict):
        raise UsageError(f"{source}: expected a mapping of sections (run, launch, recipe, …)")


# Keys whose value may be a path: relative to the YAML file that sets it, or to the working
# directory when given on the command line. `recipe.source` only as a `.py` file (else a module).
_PATH_KEYS = ("recipe.source", "load.weights")


def _absolute_path(key: str, value: Any, base: Path) -> Any:
    """`value`, made absolute from `base` where `key` names a file or folder."""
    if key not in _PATH_KEYS or not isinstance(value, str):
        return value
    if (key == "recipe.source" and not value.endswith(".py")) or is_url(value):
        return value
    try:
        return str((base / value).resolve())
    except (RuntimeError, OSError) as exc:  # a symbolic link loop (RuntimeError before 3.13)
        raise UsageError(
            f"{key} {echo(str(base / value))}: cannot follow it ({exc})",
            hint="Point it at a real file or folder; one of its symbolic links leads back to "
            "itself.",
        ) from None


def _absolutize_paths(raw: Any, base: Path) -> None:
    for key in _PATH_KEYS:
        section, leaf = key.split(".")
        node = raw.get(section) if isinstance(raw, dict) else None
        if isinstance(node, dict) and leaf in node:
            node[leaf] = _absolute_path(key, node[leaf], base)


def _set_dotted(raw: dict, key: str, value: Any, origin: str) -> None:
    *parents, leaf = key.split(".")
    node = raw
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parents[: i + 1])
            raise UsageError(f"{origin}: {where} is a value, not a section")
        node = child
    node[leaf] = value


def _describe(err: dict, where: dict[str, str]) -> str:
    path = [str(p) for p in err["loc"] if not str(p).startswith("function-")]
    # pydantic puts union members in loc (e.g. 'int', 'literal['auto']'); keep key names only.
    path = [p for p in path if not re.match(r"^(int|float|str|bool|none)$|^literal\[", p)]
    key = ".".join(path) or "(top level)"
    message = clip(err["msg"].removeprefix("Value error, "), keep=_MESSAGE_CHARS)
    if not path and re.match(r"^[a-z_]+\.[a-z_]+: ", message):
        return message  # a rule across sections names its key
    origin = where.get(key)
    label = f"{clip(key)} ({origin})" if origin else clip(key)
    return f"{label}: {_explain(err, path)}"


def _explain(err: dict, path: list[str]) -> str:
    kind, given = err["type"], err.get("input")
    if kind == "extra_forbidden":
        close = difflib.get_close_matches(path[-1], _valid_keys(path[:-1]), n=1)
        suggestion = f"; did you mean {'.'.join([*path[:-1], close[0]])!r}?" if close else ""
        valid = ", ".join(_valid_keys(path[:-1]))
        return f"unknown key{suggestion} (valid here: {valid})"
    if kind == "missing":
        return "required, but missing"
    expected = {
        "int_parsing": "an integer",
        "int_type": "an integer",
        "int_from_float": "an integer",
        "float_parsing": "a number",
        "float_type": "a number",
        "bool_parsing": "true or false",
        "bool_type": "true or false",
        "string_type": "a string",
        "dict_type": "a mapping",
        "model_type": "a mapping",
        "model_attributes_type": "a mapping",
    }.get(kind)
    if expected:
        return f"expected {expected}, got {echo(given)}"
    if kind == "literal_error":
        return f"expected one of {err['ctx']['expected']}, got {echo(given)}"
    if kind in ("greater_than", "greater_than_equal", "less_than_equal", "less_than"):
        return f"{err['msg'].replace('Input should be', 'must be')}, got {echo(given)}"
    if kind == "string_pattern_mismatch":
        return f"use letters, digits, '.', '_' or '-' (no spaces or slashes), got {echo(given)}"
    if kind == "string_too_long":
        return f"at most {err['ctx']['max_length']} characters, got {len(given):,}"
    # A validator's own message may quote a value whole.
    return clip(err["msg"].removeprefix("Value error, "), keep=_MESSAGE_CHARS)


def _valid_keys(section_path: list[str]) -> list[str]:
    model: type[BaseModel] = RunSpec
    for part in section_path:
        field = model.model_fields.get(part)
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return [f.alias or name for name, f in model.model_fields.items()]
