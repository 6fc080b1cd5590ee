"""The package's shape, checked by reading its source: two processes in two rooms that never
import each other, one owner of the run folder's paths, and small modules and functions."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import get_args

import pytest

from launcher.config.spec import StrategyName
from launcher.parallel.registry import STRATEGIES
from tests.conftest import REPO

# Reads source files only: the same on every torch.
pytestmark = pytest.mark.launcher_only

PACKAGE = REPO / "launcher"
MODULES = sorted(PACKAGE.rglob("*.py"))
# The entry points parse flags, then start the launch; they check a recipe as workers load it,
# and `train export` reads a checkpoint as the workers wrote it.
ENTRY = {PACKAGE / "cli.py", PACKAGE / "cli_tools.py"}


def _room(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 and parts[0] in ("launch", "train", "runs") else "top"


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _room_of_import(name: str) -> str | None:
    for room in ("launch", "train"):
        if name == f"launcher.{room}" or name.startswith(f"launcher.{room}."):
            return room
    return None


def test_the_rooms_exist_and_hold_their_process_code() -> None:
    assert {p.name for p in (PACKAGE / "launch").glob("*.py")} >= {"plan.py", "agent.py"}
    assert {p.name for p in (PACKAGE / "train").glob("*.py")} >= {"worker.py", "loop.py"}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_launch_and_train_never_import_each_other(path: Path) -> None:
    room = _room(path)
    rooms = {_room_of_import(name) for name in _imports(path)} - {None}
    if room == "launch":
        assert "train" not in rooms, f"{path} (runs in `train`) imports the workers' code"
    elif room == "train":
        assert "launch" not in rooms, f"{path} (runs in workers) imports the launcher's code"
    elif room == "runs":
        # `train runs` and `train plot` read run folders in the CLI's process: the launcher's
        # lock tells a live run, and nothing of the workers' (or torch) is needed.
        assert "train" not in rooms, f"{path} (reads run folders) imports the workers' code"
    elif path not in ENTRY:
        assert not rooms, f"{path} is read by both processes and imports {rooms}"


# Names of things inside a run folder: only run_layout.py may spell them.
_RUN_PARTS = re.compile(
    r"^(logs|telemetry|checkpoints|nodes|xla_cache|\.elastic)$"
    r"|rank-|metrics\.jsonl|summary\.json|outcome\.json|^tb$|spec\.yaml|spec\.resume|stop-request|worker-plan"
    r"|meta\.json|COMPLETE|\.partial|\.deleting|^\.metadata$|step-\d|step-\{|host-|^node-"
)


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


def test_only_run_layout_names_the_parts_of_a_run_folder() -> None:
    offenders = [
        f"{path.relative_to(REPO)}:{line}: {text!r}"
        for path in MODULES
        if path.name != "run_layout.py"
        for line, text in _strings(ast.parse(path.read_text()))
        # Only strings that look like file or folder names, not the words of a message.
        if " " not in text.strip() and _RUN_PARTS.search(text)
    ]
    assert not offenders, "\n".join(offenders)


def test_the_layout_check_finds_a_path_spelled_out() -> None:
    tree = ast.parse('def f(run_dir):\n    return run_dir / "logs" / f"rank-{0}.log"\n')
    assert [t for _, t in _strings(tree) if _RUN_PARTS.search(t)] == ["logs", "rank-"]


def _length(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined,operator]


def _is_typer_command(node: ast.FunctionDef) -> bool:
    """A typer command's signature is its option declarations; its body stays small."""
    return any(
        isinstance(d, ast.Call) and getattr(d.func, "attr", "") == "command"
        for d in node.decorator_list
    )


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_and_functions_stay_small(path: Path) -> None:
    lines = path.read_text().count("\n")
    assert lines <= 300, f"{path}: {lines} lines; split it along a real seam"
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        length = _length(node)
        if _is_typer_command(node):  # count the body only
            length -= node.body[0].lineno - node.lineno
        assert length <= 60, f"{path}:{node.lineno} {node.name} is {length} lines"


def test_the_spec_names_exactly_the_registered_strategies() -> None:
    assert set(get_args(StrategyName)) == set(STRATEGIES)
