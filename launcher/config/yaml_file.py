"""The YAML that specs and `key=value` overrides are written in, and the limits on reading it.

YAML 1.2 numbers (`3e-4` is a float) and no duplicate keys. The limits keep an input that is
not a spec (`/dev/zero`, a 300-level nesting, an alias that expands a billion-fold) from
exhausting the machine: each is refused with one line naming the file, before anything runs.
"""

from __future__ import annotations

import re
import stat
from pathlib import Path
from typing import Any

import yaml

from launcher.errors import UsageError

# A spec is a few kilobytes. PyYAML reads about 1 MB/s, so this bounds the time too.
MAX_FILE_BYTES = 4 * 1024 * 1024
# Python's recursion limit is 1000 frames, and reading one level of YAML takes about 3.
MAX_DEPTH = 100
# Values after aliases are expanded: an alias bomb is small on disk but not once expanded.
MAX_VALUES = 100_000
# An error echoes what it was given; a 10 MB value must not become 10 MB of output.
ECHO_CHARS = 80


def clip(text: str, keep: int = ECHO_CHARS) -> str:
    """`text`, or its first `keep` characters and how long it was."""
    return text if len(text) <= keep else f"{text[:keep]}... ({len(text):,} characters)"


def echo(value: Any) -> str:
    """`repr(value)` as an error shows it: clipped, with a long string's own length."""
    if isinstance(value, str) and len(value) > ECHO_CHARS:
        return f"{value[:ECHO_CHARS]!r}... ({len(value):,} characters)"
    return clip(repr(value))


class LimitExceeded(yaml.MarkedYAMLError):
    """Valid YAML, but more than a spec can be."""

    def __init__(self, problem: str, mark: yaml.Mark) -> None:
        super().__init__(problem=problem, problem_mark=mark)


class _Loader(yaml.SafeLoader):
    """A safe loader that reads `3e-4` as a number (YAML 1.2), rejects duplicate keys, and
    refuses a document nested or expanded beyond the limits while it composes it, before
    anything recursive (constructing, validating, `repr`) sees it."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._ancestors = 0
        self._values = 0  # so far in the document, aliases expanded
        self._deepest = 0  # the deepest level reached inside the node being composed
        # id(node) -> (values in it, aliases expanded; levels from it to its deepest leaf)
        self._extent: dict[int, tuple[int, int]] = {}

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        level = self._ancestors + 1
        if level > MAX_DEPTH:
            raise LimitExceeded(f"nested more than {MAX_DEPTH} levels deep", event.start_mark)
        values_before, deepest_outside = self._values, self._deepest
        self._ancestors, self._deepest = level, level
        node = super().compose_node(parent, index)
        self._ancestors = level - 1
        if isinstance(event, yaml.AliasEvent):
            # An anchor still open refers to itself: constructing it refuses that.
            values, height = self._extent.get(id(node), (1, 1))
            self._values += values
            self._deepest = level + height - 1
        else:
            self._values += 1
            self._extent[id(node)] = (self._values - values_before, self._deepest - level + 1)
        if self._deepest > MAX_DEPTH:
            raise LimitExceeded(
                f"nested more than {MAX_DEPTH} levels deep once its aliases are expanded",
                event.start_mark,
            )
        if self._values > MAX_VALUES:
            raise LimitExceeded(
                f"more than {MAX_VALUES:,} values (an alias such as *name counts as a copy "
                "of what it names)",
                event.start_mark,
            )
        self._deepest = max(self._deepest, deepest_outside)
        return node


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
        try:
            duplicate = key in seen
        except TypeError:
            continue  # an unhashable key: construct_mapping refuses it, naming its line
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {echo(key)} (first on line {seen[key] + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong, in one line (PyYAML's own text quotes the input over several)."""
    if isinstance(exc, LimitExceeded):
        return str(exc.problem)
    # PyYAML quotes the input in some problems, e.g. a name after `*`.
    return f"invalid YAML: {clip(getattr(exc, 'problem', None) or str(exc).splitlines()[0])}"


def parse_yaml_value(text: str, origin: str) -> Any:
    """A value as YAML reads it: `3e-4` is a float, `true` a bool, `[1, 2]` a list. `origin`
    (the override or flag it came from) names it in the error."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise UsageError(f"{origin}: {yaml_problem(exc)}") from None


def read_yaml_file(path: Path) -> tuple[Any, dict[str, str]]:
    """The `--config` file's YAML (`{}` when empty), and "line N" for each dotted key in it."""
    loader = _Loader(_read_text(path))
    try:
        node = loader.get_single_node()
        raw = None if node is None else loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise UsageError(f"{where}: {yaml_problem(exc)}") from None
    finally:
        loader.dispose()
    return ({} if raw is None else raw), _key_lines(node)


def _read_text(path: Path) -> str:
    """The file's text, read only if it is a regular file within MAX_FILE_BYTES: a device
    (`/dev/zero`) or a pipe would be read forever."""
    label = f"--config {clip(str(path))}"
    limit = f"a spec may be at most {MAX_FILE_BYTES // 2**20} MiB ({MAX_FILE_BYTES:,} bytes)"
    try:
        info = path.stat()
        if stat.S_ISDIR(info.st_mode):
            raise UsageError(f"{label}: is a folder; give the spec's YAML file")
        if not stat.S_ISREG(info.st_mode):
            raise UsageError(f"{label}: not a regular file (a device, pipe or socket)")
        if info.st_size > MAX_FILE_BYTES:
            raise UsageError(f"{label}: {info.st_size:,} bytes; {limit}")
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)  # bounded, should it grow meanwhile
    except FileNotFoundError:
        raise UsageError(f"{label}: no such file") from None
    except OSError as exc:
        raise UsageError(
            f"{label}: cannot read it ({exc.strerror or type(exc).__name__})"
        ) from None
    if len(data) > MAX_FILE_BYTES:
        raise UsageError(f"{label}: it grew while read; {limit}")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise UsageError(f"{label}: cannot read it (not UTF-8 text)") from None


def _key_lines(root: yaml.Node | None) -> dict[str, str]:
    """Dotted key -> "line N", so errors can point into the file. A mapping repeated by an
    alias is walked once, so this costs no more than the file is long."""
    out: dict[str, str] = {}
    stack, seen = [(root, "")], set()
    while stack:
        node, prefix = stack.pop()
        if not isinstance(node, yaml.MappingNode) or id(node) in seen:
            continue
        seen.add(id(node))
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            out[key] = f"line {key_node.start_mark.line + 1}"
            stack.append((value_node, key + "."))
    return out
