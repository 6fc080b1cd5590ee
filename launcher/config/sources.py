"""Where each value of a spec came from: its YAML line, a `key=value` override or a flag.

`train validate --explain` prints it, and every run's `spec.yaml` carries it as comments, so a
value nobody remembers setting can be traced to the file, line or flag that set it. The
sources themselves are collected by `launcher.config.loader.load_spec_and_sources`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from launcher.config.spec import RunSpec

# What the command line gave, rather than the YAML file.
_GIVEN = ("override ", "--")
_UNSET = object()  # a required key has no default: any value it has was given


def explain(spec: RunSpec, sources: Mapping[str, str]) -> list[tuple[str, Any, str]]:
    """(dotted key, value, where it came from) for each key that is not at its default or was
    given explicitly; a key changed by no source says so."""
    rows = []
    for key, value, default in _leaves(spec, ""):
        source = _source_of(key, sources)
        if source is None and value == default:
            continue
        if source is None:
            source = "set by the launcher"
        elif value == default:
            source += " (the default anyway)"
        rows.append((key, value, source))
    return rows


def explain_text(spec: RunSpec, sources: Mapping[str, str]) -> str:
    rows = explain(spec, sources)
    if not rows:
        return "Every key is at its default."
    shown = [(key, _show(value), source) for key, value, source in rows]
    width = max(len(key) for key, _, _ in shown)
    vwidth = max(len(value) for _, value, _ in shown)
    lines = ["Keys given or not at their default, and where each value came from:"]
    lines += [f"  {key:<{width}}  {value:<{vwidth}}  {source}" for key, value, source in shown]
    return "\n".join(lines)


def set_keys(spec: BaseModel) -> set[str]:
    """The dotted keys whose value is not their default (or that have none)."""
    return {key for key, value, default in _leaves(spec, "") if value != default}


def changed_keys(given: BaseModel, resolved: BaseModel) -> dict[str, Any]:
    """{dotted key: its value in `given`} for each key whose value `resolved` changed."""
    before = {key: value for key, value, _ in _leaves(given, "")}
    return {key: before[key] for key, value, _ in _leaves(resolved, "") if before[key] != value}


def annotate_yaml(text: str, sources: Mapping[str, str]) -> str:
    """`text` (a spec as `spec_to_yaml` writes it) with `# <source>` after each key that has
    one, or on a line of its own above a key whose value takes several lines (a list, a long
    string): a comment never lands inside a value."""
    lines = text.splitlines()
    after: dict[int, str] = {}  # line -> the comment at its end
    above: dict[int, list[str]] = {}  # line -> comment lines before it
    for key, key_node, value_node in _key_nodes(yaml.compose(text), ""):
        source = sources.get(key)
        inner = any(k.startswith(key + ".") for k in sources)
        if source is None or (isinstance(value_node, yaml.MappingNode) and inner):
            continue  # a section's (or a mapping's) keys carry their own
        line = key_node.start_mark.line
        if value_node.end_mark.line == line:
            after[line] = source
        else:
            indent = " " * key_node.start_mark.column
            above.setdefault(line, []).append(f"{indent}# {key.rsplit('.', 1)[-1]}: {source}")
    out = []
    for i, line in enumerate(lines):
        out += above.get(i, [])
        out.append(f"{line}  # {after[i]}" if i in after else line)
    return "\n".join(out) + "\n"


def given_on_command_line(source: str) -> bool:
    """Whether a key's source (as `sources` records it) is a `key=value` override or a flag,
    rather than the YAML file."""
    return source.startswith(_GIVEN)


def _key_nodes(node: yaml.Node | None, prefix: str) -> Iterator[tuple[str, yaml.Node, yaml.Node]]:
    if not isinstance(node, yaml.MappingNode):
        return
    for key_node, value_node in node.value:
        key = f"{prefix}{key_node.value}"
        yield key, key_node, value_node
        yield from _key_nodes(value_node, key + ".")


def _leaves(model: BaseModel, prefix: str) -> Iterator[tuple[str, Any, Any]]:
    """(dotted key, value, default) of every key that holds a value, not a section."""
    for name, field in type(model).model_fields.items():
        key = f"{prefix}{field.alias or name}"
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            yield from _leaves(value, key + ".")
            continue
        default = field.get_default(call_default_factory=True)
        yield key, value, (_UNSET if default is PydanticUndefined else default)


def _source_of(key: str, sources: Mapping[str, str]) -> str | None:
    """The key's own source, and the overrides and flags of keys inside it
    (`recipe.model.hidden=64`); the YAML's lines inside it are the key's own line's."""
    own = [sources[key]] if key in sources else []
    inside = [
        f"{k[len(key) + 1 :]} from {v}"
        for k, v in sources.items()
        if k.startswith(key + ".") and (not own or v.startswith(_GIVEN))
    ]
    return "; ".join(own + inside) or None


def _show(value: Any) -> str:
    """A value as YAML writes it in flow style (`true`, `null`, `{in_dim: 16}`); a long one
    keeps its start, where a path has its root and a mapping its first keys, and its end,
    where a path has its file name: `/home/alice/projects/llm/rec...recipes/gpt.py`."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9).strip()
    text = text.removesuffix("\n...").removesuffix("...").strip()
    return text if len(text) <= 48 else f"{text[:30]}...{text[-15:]}"
