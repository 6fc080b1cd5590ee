"""Where each value of a spec came from: its YAML line, a `key=value` override or a flag.

`train validate --explain` prints it, and every run's `spec.yaml` carries it as comments, so a
value nobody remembers setting can be traced to the file, line or flag that set it. The
sources themselves are collected by `launcher.spec_loader.load_spec_and_sources`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from launcher.spec import RunSpec

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
    width = max(len(key) for key, _, _ in rows)
    shown = [(key, _show(value)) for key, value, _ in rows]
    vwidth = min(40, max(len(v) for _, v in shown))
    lines = ["Keys not at their default, and where each came from:"]
    for (key, value), (_, _, source) in zip(shown, rows, strict=True):
        lines.append(f"  {key:<{width}}  {value:<{vwidth}}  {source}")
    return "\n".join(lines)


def annotate_yaml(text: str, sources: Mapping[str, str]) -> str:
    """`text` (a spec as `spec_to_yaml` writes it: block style, two-space indents) with
    `# <source>` after each key that has one."""
    out, path = [], []
    for line in text.splitlines():
        match = re.match(r"^( *)([A-Za-z_][\w]*):( |$)", line)
        if match is None:
            out.append(line)
            continue
        depth = len(match.group(1)) // 2
        path = [*path[:depth], match.group(2)]
        source = sources.get(".".join(path))
        # A section's own line says nothing its keys' lines do not.
        out.append(f"{line}  # {source}" if source and match.group(3) else line)
    return "\n".join(out) + "\n"


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
    return "; ".join(own + inside) or _section_source(key, sources)


def _section_source(key: str, sources: Mapping[str, str]) -> str | None:
    """A whole section set by an override or a flag (`optim={lr: 1}`) sets each key in it."""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        source = sources.get(".".join(parts[:i]))
        if source is not None and source.startswith(_GIVEN):
            return source
    return None


def _show(value: Any) -> str:
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:37] + "..."
