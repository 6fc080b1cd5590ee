"""Reading a run spec: YAML file + `key=value` overrides -> a validated `RunSpec`.

Every problem is collected and reported at once, each naming its dotted key, the YAML line
where there is one, what was expected and what was given.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from launcher.errors import UsageError
from launcher.spec import RunSpec


class _Loader(yaml.SafeLoader):
    """A safe loader that reads `3e-4` as a number (YAML 1.2) and rejects duplicate keys."""


# PyYAML follows YAML 1.1, where `3e-4` (no dot) is a string: the classic silent lr bug.
_Loader.yaml_implicit_resolvers = {
    k: [r for r in v if r[0] != "tag:yaml.org,2002:float"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key!r} (first on line {seen[key] + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def parse_yaml_value(text: str) -> Any:
    """A value as YAML reads it: `3e-4` is a float, `true` a bool, `[1, 2]` a list."""
    return yaml.load(text, Loader=_Loader)


def load_spec(
    path: Path, overrides: list[str] | None = None, flags: dict[str, tuple[str, Any]] | None = None
) -> RunSpec:
    """Read, override and validate a spec. Raises `UsageError` listing every problem.

    Precedence: `flags` ({dotted key: (flag name, value)}) > `overrides` (`key=value`) > YAML.
    """
    raw, where = _read_yaml(path)
    _absolutize_recipe(raw, path.parent)
    settings = [(*parse_override(text), f"override {text}") for text in overrides or []]
    settings += [(key, value, flag) for key, (flag, value) in (flags or {}).items()]
    for key, value, origin in settings:
        _set_dotted(raw, key, value, origin=origin)
        where[key] = origin
        if key == "recipe.source":
            _absolutize_recipe(raw, Path.cwd())
    return validate_spec(raw, source=str(path), where=where)


def validate_spec(raw: Any, source: str, where: dict[str, str] | None = None) -> RunSpec:
    if not isinstance(raw, dict):
        raise UsageError(f"{source}: expected a mapping of sections (run, launch, recipe, …)")
    try:
        return RunSpec.model_validate(raw)
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
            f"{text!r} is not an override: write section.key=value, e.g. optim.lr=3e-4"
        )
    try:
        return key, parse_yaml_value(value)
    except yaml.YAMLError as exc:
        raise UsageError(f"override {text!r}: the value is not valid YAML ({exc})") from None


def spec_to_yaml(spec: RunSpec) -> str:
    return yaml.safe_dump(spec.model_dump(mode="json", by_alias=True), sort_keys=False)


def _read_yaml(path: Path) -> tuple[Any, dict[str, str]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UsageError(f"--config {path}: no such file") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise UsageError(f"--config {path}: cannot read it ({exc.__class__.__name__})") from None
    try:
        raw = yaml.load(text, Loader=_Loader)
        lines = _key_lines(yaml.compose(text, Loader=_Loader))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise UsageError(f"{where}: invalid YAML: {problem}") from None
    return ({} if raw is None else raw), lines


def _key_lines(node: yaml.Node | None, prefix: str = "") -> dict[str, str]:
    """Dotted key -> "line N", so errors can point into the file."""
    out: dict[str, str] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            out[key] = f"line {key_node.start_mark.line + 1}"
            out.update(_key_lines(value_node, key + "."))
    return out


def _absolutize_recipe(raw: Any, base: Path) -> None:
    recipe = raw.get("recipe") if isinstance(raw, dict) else None
    source = recipe.get("source") if isinstance(recipe, dict) else None
    if isinstance(source, str) and source.endswith(".py"):
        recipe["source"] = str((base / source).resolve())


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
    if not path and re.match(r"^[a-z_]+\.[a-z_]+: ", err["msg"].removeprefix("Value error, ")):
        return err["msg"].removeprefix("Value error, ")  # a rule across sections names its key
    origin = where.get(key)
    label = f"{key} ({origin})" if origin else key
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
        return f"expected {expected}, got {given!r}"
    if kind == "literal_error":
        return f"expected one of {err['ctx']['expected']}, got {given!r}"
    if kind in ("greater_than", "greater_than_equal", "less_than_equal", "less_than"):
        return f"{err['msg'].replace('Input should be', 'must be')}, got {given!r}"
    if kind == "string_pattern_mismatch":
        return f"use letters, digits, '.', '_' or '-' (no spaces or slashes), got {given!r}"
    message = err["msg"].removeprefix("Value error, ")
    return message


def _valid_keys(section_path: list[str]) -> list[str]:
    model: type[BaseModel] = RunSpec
    for part in section_path:
        field = model.model_fields.get(part)
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return [f.alias or name for name, f in model.model_fields.items()]
