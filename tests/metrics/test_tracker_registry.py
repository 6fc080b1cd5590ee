"""The trackers' registry (`launcher.metrics.trackers.registry`): the spec names exactly the
registered trackers, each entry's class and check exist, the sinks are built through it in
`log.trackers`' order, and the metrics modules import one another in one direction only (the
sink types in a leaf), read from their source."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import get_args

import pytest

from launcher.config.log import TrackerName
from launcher.config.spec import RunSpec
from launcher.metrics.progress import ProgressSink
from launcher.metrics.sinks import build_sinks
from launcher.metrics.trackers.registry import TRACKERS, tracker_check, tracker_class
from launcher.metrics.trackers.tensorboard import TensorBoardSink
from launcher.rundir.layout import RunLayout
from tests.conftest import REPO

pytestmark = pytest.mark.launcher_only

METRICS = REPO / "launcher" / "metrics"


def _spec(**log: object) -> RunSpec:
    return RunSpec.model_validate(
        {"run": {"name": "r"}, "recipe": {"source": "x.py"}, "train": {"max_steps": 5}, "log": log}
    )


def test_the_spec_names_exactly_the_registered_trackers() -> None:
    assert set(get_args(TrackerName)) == set(TRACKERS)


@pytest.mark.parametrize("name", sorted(TRACKERS))
def test_each_registered_tracker_has_its_class_and_check(name: str) -> None:
    cls = tracker_class(name)  # imports its module, never its optional package
    assert cls.name == name  # its warnings and trackers.json entry say the name the spec takes
    assert callable(cls.for_run)
    check = tracker_check(name)
    assert check is None or callable(check)


def test_the_sinks_are_built_through_the_registry_in_order(tmp_path: Path) -> None:
    sinks = build_sinks(_spec(trackers=["csv", "tensorboard"]), tmp_path)
    assert [s.name for s in sinks] == ["progress.json", "csv", "tensorboard"]
    assert isinstance(sinks[0], ProgressSink) and isinstance(sinks[2], TensorBoardSink)
    assert Path(sinks[2].where) == RunLayout(tmp_path).tensorboard_dir
    # TensorBoard is on by default, one tracker among the others.
    assert [s.name for s in build_sinks(_spec(), tmp_path)][1:] == ["tensorboard"]


def _imports(path: Path) -> set[str]:
    """The launcher.metrics modules `path` imports: at module level, in a function or under
    TYPE_CHECKING alike."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("launcher.metrics.")}


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_metrics_modules_import_each_other_in_one_direction() -> None:
    modules = {_module(p): p for p in METRICS.rglob("*.py")}
    graph = {name: _imports(path) & set(modules) - {name} for name, path in modules.items()}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, " -> ".join((*path[path.index(name) :], name))
        if name not in done:
            for imported in graph[name]:
                visit(imported, (*path, name))
            done.add(name)

    for name in graph:
        visit(name, ())
    for leaf in ("sink_types", "record_fields", "trackers.registry"):
        assert not graph[f"launcher.metrics.{leaf}"], leaf
    importlib.import_module("launcher.metrics.sinks")  # and it imports for real
