"""The package's shape, checked by reading its source: one room per concept, two processes in
two rooms that never import each other, one owner of the run folder's paths, and modules and
functions split along real seams."""

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
# What both processes share, each room importing only those before it: the error types, the
# spec, the run folder, the metrics files, the strategies, the checkpoints.
SHARED = ("top", "config", "rundir", "metrics", "parallel", "checkpoint")
# Each process's own rooms: the `train` process (launch), every worker (worker), and the
# readers of run folders (runs, torch-free). They never import one another.
PROCESSES = ("launch", "worker", "runs")
ROOMS = (*SHARED[1:], *PROCESSES, "cli")


def _room(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else "top"


def _rooms_in(source: str, room: str) -> set[str]:
    """The other rooms of the package that `source` (in `room`) imports."""
    rooms = set()
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        for name in names:
            parts = name.split(".")
            if parts[0] == "launcher" and len(parts) > 1:
                rooms.add(parts[1] if parts[1] in ROOMS else "top")
    return rooms - {room}


def _rooms_imported(path: Path) -> set[str]:
    return _rooms_in(path.read_text(), _room(path))


def test_one_room_per_concept_and_few_loose_modules() -> None:
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(
        ROOMS
    )
    loose = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    assert len(loose) <= 6, loose
    assert not (PACKAGE / "train").exists()
    assert {p.name for p in (PACKAGE / "launch").glob("*.py")} >= {"plan.py", "agent.py"}
    assert {p.name for p in (PACKAGE / "worker").glob("*.py")} >= {"main.py", "loop.py"}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_one_way(path: Path) -> None:
    room, imported = _room(path), _rooms_imported(path)
    assert "cli" not in imported, f"{path} imports the command line, which imports everything"
    if room in SHARED:
        later = imported - set(SHARED[: SHARED.index(room)])
        assert not later, f"{path} ({room}, shared) imports {later}"
    elif room in PROCESSES:
        others = imported - set(SHARED)
        assert not others, f"{path} ({room}) imports another process's code: {others}"
        if room == "runs":  # `train runs` and `train plot` answer without torch
            assert not imported & {"parallel", "checkpoint"}, f"{path} imports torch's rooms"


def test_the_import_check_finds_a_launcher_that_imports_the_workers() -> None:
    source = (
        "from launcher.config.spec import RunSpec\n\ndef f():\n    import launcher.worker.loop\n"
    )
    assert _rooms_in(source, "launch") - set(SHARED) == {"worker"}
    assert _rooms_in("from launcher import errors\n", "config") == {"top"}


# Names of things inside a run folder: only rundir/layout.py may spell them.
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
        if path != PACKAGE / "rundir" / "layout.py"
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


def _is_typer_command(path: Path, node: ast.FunctionDef) -> bool:
    """A command of `train` (cli/, `*_command`): its signature is its option declarations,
    one typer.Option each; its body stays small."""
    return path.parent == PACKAGE / "cli" and node.name.endswith("_command")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_and_functions_stay_small(path: Path) -> None:
    lines = path.read_text().count("\n")
    assert lines <= 500, f"{path}: {lines} lines; split it along a real seam"
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        length = _length(node)
        if _is_typer_command(path, node):  # count the body only
            length -= node.body[0].lineno - node.lineno
        assert length <= 60, f"{path}:{node.lineno} {node.name} is {length} lines"


def test_the_spec_names_exactly_the_registered_strategies() -> None:
    assert set(get_args(StrategyName)) == set(STRATEGIES)
