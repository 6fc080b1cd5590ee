"""The package's shape, checked by reading its source: one room per concept, two processes in
two rooms that never import each other, one owner of the run folder's paths, and modules and
functions split along real seams."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

from launcher.config.spec import StrategyName
from launcher.parallel.registry import STRATEGIES
from launcher.replicas.registry import ENGINES
from tests.conftest import REPO

# Reads source files only: the same on every torch.
pytestmark = pytest.mark.launcher_only

PACKAGE = REPO / "launcher"
MODULES = sorted(PACKAGE.rglob("*.py"))
# What both processes share, each room importing only those before it: the error types, the
# spec, the run folder, the metrics files, the strategies, the checkpoints. And where a job runs
# (clusters): placed after the run folder for that import rule, though only `launch` and `cli`
# may import it (test_clusters_are_a_room_only_the_train_process_enters).
SHARED = ("top", "config", "rundir", "clusters", "metrics", "parallel", "checkpoint")
# Each process's own rooms: the `train` process (launch), every worker (worker), and the
# readers of run folders (runs, torch-free). They never import one another.
PROCESSES = ("launch", "worker", "runs")
# Replica groups (`launcher/replicas/`): a room of two halves, the workers' engines and the
# launcher's coordinators, whose only ways in are its torch-free registry and the engine
# interface the strategy holds (test_replicas_are_a_room_of_two_halves).
REPLICAS = "replicas"
ROOMS = (*SHARED[1:], *PROCESSES, REPLICAS, "cli")
# The room's doors: its module, and the rooms that may enter by it.
REPLICA_DOORS = {
    "launcher.replicas.registry": {"parallel", "launch"},
    "launcher.replicas.engine": {"parallel"},
    # `train validate` cuts the model on meta into streaming DiLoCo's fragments, as the
    # workers' engine will.
    "launcher.replicas.fragments": {"cli"},
}


def _room(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else "top"


def _imported_names(source: str) -> set[str]:
    """What `source` imports: each module, and each `module.name` it imports from one."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return names


def _rooms_in(source: str, room: str) -> set[str]:
    """The other rooms of the package that `source` (in `room`) imports."""
    rooms = set()
    for name in _imported_names(source):
        parts = name.split(".")
        if parts[0] == "launcher" and len(parts) > 1:
            rooms.add(parts[1] if parts[1] in ROOMS else "top")
    return rooms - {room}


def _rooms_imported(path: Path) -> set[str]:
    return _rooms_in(path.read_text(), _room(path))


def _rooms_past_replica_doors(path: Path) -> set[str]:
    """`_rooms_imported`, where the replicas room counts only if it is entered by another
    way than its doors for this module's room (`REPLICA_DOORS`)."""
    room, rooms = _room(path), _rooms_imported(path)
    inside = {n for n in _imported_names(path.read_text()) if n.startswith("launcher.replicas.")}
    if room != REPLICAS and all(room in REPLICA_DOORS.get(_module_of(n), ()) for n in inside):
        rooms.discard(REPLICAS)
    return rooms


def _module_of(name: str) -> str:
    """The package's module an imported name is of: `launcher.replicas.registry.ENGINES` is
    of `launcher.replicas.registry`."""
    return ".".join(name.split(".")[:3])


def test_one_room_per_concept_and_few_loose_modules() -> None:
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(
        ROOMS
    )
    loose = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    assert len(loose) <= 6, loose
    assert not (PACKAGE / "train").exists()
    assert {p.name for p in (PACKAGE / "launch").glob("*.py")} >= {"plan.py", "agent.py"}
    assert {p.name for p in (PACKAGE / "worker").glob("*.py")} >= {"main.py", "loop.py"}


def test_the_test_folders_mirror_the_rooms() -> None:
    """A room's tests are in the folder of its name (`tests/data/` holds their files)."""
    tests = REPO / "tests"
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders - {"data"} == set(ROOMS)


def test_the_launch_room_holds_supervision_and_the_display_alone() -> None:
    """`launch/` is the `train` process's supervision and its display: 20 modules at most. The
    resume decision and the folder choice are the checkpoint room's, the replica groups'
    coordinators the replicas room's; a concept that grows up beside supervision gets a room."""
    modules = [p for p in (PACKAGE / "launch").rglob("*.py") if p.name != "__init__.py"]
    assert len(modules) <= 20, sorted(str(p.relative_to(PACKAGE)) for p in modules)
    moved = {"resume_decision.py", "folder_choice.py", "lighthouse.py", "replica_groups.py"}
    assert not {p.name for p in modules} & moved


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_one_way(path: Path) -> None:
    room, imported = _room(path), _rooms_past_replica_doors(path)
    assert "cli" not in imported, f"{path} imports the command line, which imports everything"
    if room in SHARED:
        later = imported - set(SHARED[: SHARED.index(room)])
        assert not later, f"{path} ({room}, shared) imports {later}"
    elif room in PROCESSES:
        others = imported - set(SHARED)
        assert not others, f"{path} ({room}) imports another process's code: {others}"
        if room == "runs":  # `train runs` and `train plot` answer without torch
            heavy = imported & {"parallel", "checkpoint"}
            if heavy == {"checkpoint"}:  # its stores and catalogue alone, which are torch-free
                names = _imported_names(path.read_text())
                heavy = {n for n in names if n.startswith("launcher.checkpoint")}
                heavy -= {*_TORCH_FREE, *_names_in(*_TORCH_FREE)}
            assert not heavy, f"{path} imports torch's rooms"


# What `train runs` may read of the checkpoint room: the stores and the catalogue.
_TORCH_FREE = ("launcher.checkpoint.store", "launcher.checkpoint.catalog")


def _names_in(*modules: str) -> set[str]:
    """`module.X` for each name each of `modules` defines."""
    names = set()
    for module in modules:
        tree = ast.parse((REPO / f"{module.replace('.', '/')}.py").read_text())
        defined = [n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)]
        names |= {f"{module}.{name}" for name in defined}
    return names


def test_the_catalogue_that_train_runs_reads_imports_no_torch() -> None:
    """Nor does any kind of store, which a listing imports (`kind_for`)."""
    code = (
        "import sys, launcher.checkpoint.catalog, launcher.runs.catalog; "
        "from launcher.checkpoint.store import _kinds; _kinds(); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


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


def _class_body(path: Path, name: str) -> list[ast.stmt]:
    tree = ast.parse(path.read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name).body


def test_the_strategy_interface_stays_small() -> None:
    """`Strategy` is what the loop asks of a backend. A feature's part is an object the
    strategy holds (`steps`, `control`, `rng`), not members that widen the interface of every
    backend. Methods and properties count; attributes declared in the class body do not."""
    body = _class_body(PACKAGE / "parallel" / "base.py", "Strategy")
    members = [n.name for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert len(members) <= 32, f"Strategy has {len(members)} members: {members}"


def test_a_strategy_never_asks_whether_it_runs_a_pipeline() -> None:
    """A step's shape is a part the strategy holds (`parallel/steps.py`), chosen once from the
    layout: no strategy module holds a pipeline or tests for one, FSDPStrategy reads `pp` in
    `build_model` alone (where it builds the stages and their step runner), and the worker
    asks the strategy's layout, never the spec, whether there are stages."""
    parallel = PACKAGE / "parallel"
    runs_pipelines = {parallel / "steps.py", *(parallel / "pipeline").rglob("*.py")}
    for path in sorted(set(parallel.rglob("*.py")) - runs_pipelines):
        held = [
            node.lineno
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute)
            and node.attr == "pipeline"
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ]
        assert not held, f"{path}:{held} holds a pipeline; its `steps` run one"
    readers = {
        method.name
        for method in _class_body(parallel / "fsdp.py", "FSDPStrategy")
        if isinstance(method, ast.FunctionDef)
        for node in ast.walk(method)
        if isinstance(node, ast.Attribute) and node.attr == "pp"
    }
    assert readers == {"build_model"}
    for path in (PACKAGE / "worker").glob("*.py"):
        assert "spec.parallel.pp" not in path.read_text(), f"{path} reads pp from the spec"


def test_clusters_are_a_room_only_the_train_process_enters() -> None:
    """Where a job runs (SLURM, Kubernetes, SkyPilot, TPU pods) is a room of its own: it reads
    only the error types, the spec and the run folder, never torch (`train slurm` and `train
    k8s` answer without it), and only `launch` and `cli` read it: the workers never do."""
    room = PACKAGE / "clusters"
    modules = {"slurm.py", "kubernetes.py", "k8s_manifest.py", "tpu_pod.py", "nodes.py"}
    assert {p.name for p in room.glob("*.py")} >= modules
    assert not {p.name for p in (PACKAGE / "launch").rglob("*.py")} & modules
    for path in room.glob("*.py"):
        assert _rooms_imported(path) <= {"top", "config", "rundir"}, path
        nodes = list(ast.walk(ast.parse(path.read_text())))
        names = {a.name for n in nodes if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in nodes if isinstance(n, ast.ImportFrom) and n.module}
        assert not {n for n in names if n.split(".")[0] == "torch"}, f"{path} imports torch"
    importers = {
        _room(p) if not _is_replica_coordinator(p) else "launch"  # the launcher's code too
        for p in MODULES
        if "clusters" in _rooms_imported(p)
    }
    assert importers <= {"launch", "cli"}, f"only launch and cli may import clusters: {importers}"


# The replicas room's two halves: what runs in the launcher (the coordinators the registry
# names, imported by name by launch/, and the modules they use) and what runs in the workers
# (every other module: the engines, imported by name by parallel/build.py, the interface
# that parallel/base.py imports, and what they use). A new engine is a module and a line of
# the registry: nothing to name here.
REPLICA_COORDINATOR_MODULES = {
    *(info.coordinator.rsplit(".", 1)[1] + ".py" for info in ENGINES.values() if info.coordinator),
    "lighthouse.py",  # the coordinators' Lighthouse process
}
REPLICA_ENGINE_MODULES = {
    p.name for p in (PACKAGE / REPLICAS).glob("*.py") if p.name not in REPLICA_COORDINATOR_MODULES
} - {"__init__.py", "registry.py"}


def _is_replica_coordinator(path: Path) -> bool:
    return path.parent == PACKAGE / REPLICAS and path.name in REPLICA_COORDINATOR_MODULES


def _torch_imported(path: Path) -> set[str]:
    return {n for n in _imported_names(path.read_text()) if n.split(".")[0] == "torch"}


def test_replicas_are_a_room_of_two_halves() -> None:
    """`launcher/replicas/`: the engines (workers' code) import the shared rooms, never the
    launcher's; the coordinators (the launcher's) import `launch/`, `clusters/` and the
    torch-free shared rooms, never torch, the strategies, the workers or an engine; the
    registry is torch-free. Outside the room only its doors lead in (`REPLICA_DOORS`):
    `launch/` reaches a coordinator by name alone."""
    room = PACKAGE / REPLICAS
    halves = REPLICA_ENGINE_MODULES | REPLICA_COORDINATOR_MODULES
    assert {p.name for p in room.glob("*.py")} >= REPLICA_COORDINATOR_MODULES
    assert {"engine.py", "torchft_engine.py", "peer_state.py"} <= REPLICA_ENGINE_MODULES
    engines = {info.module.rsplit(".", 1)[1] + ".py" for info in ENGINES.values()}
    assert engines <= REPLICA_ENGINE_MODULES  # the registry's engines: workers' code
    assert not {p.name for p in (PACKAGE / "launch").rglob("*.py")} & halves
    assert not {p.name for p in (PACKAGE / "parallel").rglob("*.py")} & halves
    own = {f"launcher.replicas.{name[:-3]}" for name in REPLICA_ENGINE_MODULES}
    theirs = {f"launcher.replicas.{name[:-3]}" for name in REPLICA_COORDINATOR_MODULES}
    for name in REPLICA_ENGINE_MODULES:
        path = room / name
        assert _rooms_imported(path) <= set(SHARED) - {"clusters"}, path
        assert not {_module_of(n) for n in _imported_names(path.read_text())} & theirs, path
    for name in REPLICA_COORDINATOR_MODULES:
        path = room / name
        assert _rooms_imported(path) <= {"top", "config", "rundir", "clusters", "launch"}, path
        assert not _torch_imported(path), f"{path} imports torch"
        assert not {_module_of(n) for n in _imported_names(path.read_text())} & own, path
    registry = room / "registry.py"
    assert _rooms_imported(registry) <= {"top", "config"} and not _torch_imported(registry)
    for path in MODULES:
        if _room(path) != REPLICAS:
            assert REPLICAS not in _rooms_past_replica_doors(path), f"{path} enters replicas/"


def test_the_replica_registry_imports_no_torch() -> None:
    """The launcher reads it before anything starts."""
    code = "import sys, launcher.replicas.registry; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_the_room_check_finds_a_launcher_that_imports_a_coordinator() -> None:
    source = "from launcher.replicas.torchft_coordinator import supervise\n"
    assert _rooms_in(source, "launch") == {REPLICAS}
    assert _module_of("launcher.replicas.registry.ENGINES") == "launcher.replicas.registry"


def _classes_built_by_type(tree: ast.AST) -> list[int]:
    """The lines where `type(name, bases, namespace)` builds a class (`type(x)`, which asks
    for an object's class, builds none)."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "type"
        and len(node.args) + len(node.keywords) >= 3
    ]


def test_no_class_is_built_at_run_time_and_the_engines_silence_no_types() -> None:
    """A feature is a part a class holds, not a class made with `type()` from a mixin; and
    the replica engines are typed, not silenced (`# type: ignore`)."""
    built = [
        f"{path.relative_to(REPO)}:{line}"
        for path in MODULES
        for line in _classes_built_by_type(ast.parse(path.read_text()))
    ]
    assert not built, f"classes built with type(): {built}"
    assert _classes_built_by_type(ast.parse("type('X', (object,), {})\ntype(x)\n")) == [1]
    silenced = [
        name
        for name in REPLICA_ENGINE_MODULES
        if "type: ignore" in (PACKAGE / REPLICAS / name).read_text()
    ]
    assert not silenced, f"# type: ignore in the replica engines: {silenced}"


def test_test_modules_train_the_shared_tiny_recipe() -> None:
    """A test module trains `tests/tiny_recipes.py` (as a file, or as the base of its hooks)
    rather than writing build_model, build_dataset or loss again, in code or in a string; the
    modules below define exactly those whose difference is what they test."""
    both, every = "build_model loss", "build_model build_dataset loss"
    allowed = {  # module: (the functions it defines, why its own)
        "tiny_recipes.py": (every, "the shared recipe, and FAULTY_RECIPE's faulting loss"),
        "checkpoint/test_export.py": ("build_model", "a GPT with its lm_head tied"),
        "checkpoint/test_resume.py": ("loss", "mlp's loss counting calls in recipe state"),
        "checkpoint/test_storage_faults.py": (both, "a model a full disk cannot hold"),
        "checkpoint/test_store_damage.py": ("loss", "a loss that deletes the bucket mid-run"),
        "cli/test_bad_inputs.py": (every, "recipes broken on purpose"),
        "cli/test_cli.py": (every, "a recipe whose build raises"),
        "cli/test_validate.py": (every, "recipes `train validate` refuses, piece by piece"),
        "launch/test_failures.py": ("build_dataset", "a sample that cannot be read"),
        "launch/test_leftovers.py": (both, "a build that starts processes"),
        "launch/test_loader_hangs.py": ("build_dataset loss", "a val split that hangs"),
        "launch/test_log_stream.py": ("build_model", "a build that prints control bytes"),
        "rundir/test_worker_plan.py": ("build_model", "a build that changes directory"),
        "launch/test_worker_signals.py": ("build_dataset", "samples that are worker pids"),
        "parallel/test_buffers.py": ("build_model build_dataset", "BatchNorm, off-centre data"),
        "parallel/layouts.py": ("loss", "the GPT's loss recording each process's batches"),
        "parallel/test_dims.py": (both, "Llama split by tensor parallelism"),
        "parallel/test_experts.py": (both, "a MoE recording the experts each process runs"),
        "parallel/test_fsdp.py": (every, "a model whose init the meta device loses"),
        "parallel/test_fsdp_init.py": (every, "a CNN on images, inits fsdp must repeat"),
        "parallel/test_pipeline_hf.py": (every, "a T5 the pipeline refuses; a hook that fails"),
        "worker/test_collate.py": ("build_dataset loss", "the varlen recipe's batches"),
        "worker/test_expert_load.py": ("build_model", "a MoE routing every token to one expert"),
        "worker/test_flops.py": (both, "a build and a loss that count their calls"),
        "replicas/test_fault_tolerance.py": ("loss", "a loss that kills its replica group"),
        "replicas/test_semi_sync.py": ("loss", "the GPT's loss, killing its replica group"),
        "worker/test_loader_workers.py": ("build_dataset loss", "varlen in loader workers"),
        "worker/test_nonfinite.py": (both, "a loss that turns NaN"),
        "worker/test_param_groups.py": ("build_model", "frozen, decayed and norm parameters"),
        "worker/test_rank_randomness.py": ("loss", "a loss that records random draws"),
        "worker/test_stream_resume.py": ("build_dataset", "a stream with a shuffle buffer"),
        "worker/test_stragglers.py": (every, "a rank slow at its compute or its loader"),
        "worker/test_streaming.py": ("build_dataset loss", "streams; a loss that records ids"),
        "worker/test_train_e2e.py": (every, "a recipe outside the repo, importing a sibling"),
    }
    defining = re.compile(r"\bdef (build_model|build_dataset|loss)\s*\(")
    found = {}
    for path in sorted((REPO / "tests").rglob("*.py")):
        names = set(defining.findall(path.read_text()))
        if names:
            found[str(path.relative_to(REPO / "tests"))] = names
    # The scan sees a plain recipe: the shared one defines all three.
    assert found.get("tiny_recipes.py") == set(every.split()), found
    expected = {module: set(names.split()) for module, (names, _) in allowed.items()}
    extra = {m: sorted(n - expected.get(m, set())) for m, n in found.items()}
    extra = {m: n for m, n in extra.items() if n}
    assert not extra, f"define their own recipe functions; use tests/tiny_recipes.py: {extra}"
    stale = {m: sorted(expected[m] - found.get(m, set())) for m in expected}
    stale = {m: n for m, n in stale.items() if n}
    assert not stale, f"allowed but no longer defined; shrink their entries: {stale}"


def test_the_resume_is_decided_in_one_module() -> None:
    """The launcher decides a resume once, in `checkpoint/resume_decision.py`: only there are the
    rule (`resume_point`), the damage check and the spec merge called. The rule's own module
    calls itself for a worker's restarted attempt (`attempt_start`, the worker's one way in)
    and checks the record it reads for `--resume best` (`_best_of`)."""
    asked = {"resume_point", "spec_on_resume", "refuse_damaged"}
    decision = "checkpoint/resume_decision.py"
    rule_itself = {
        ("checkpoint/selection.py", "attempt_start", "resume_point"),  # a restarted attempt
        ("checkpoint/selection.py", "_best_of", "refuse_damaged"),  # best's record, whole
    }
    found: set[tuple[str, str, str]] = set()
    for path in MODULES:
        module = str(path.relative_to(PACKAGE))
        todo: list[tuple[ast.AST, str]] = [(ast.parse(path.read_text()), "")]
        while todo:
            node, function = todo.pop()
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                function = node.name
            called = getattr(node, "func", None)
            name = getattr(called, "id", None) or getattr(called, "attr", None)
            if isinstance(node, ast.Call) and name in asked:
                found.add((module, function, name))
            todo += [(child, function) for child in ast.iter_child_nodes(node)]
    elsewhere = {call for call in found if call[0] != decision}
    assert elsewhere <= rule_itself, f"the resume decided outside {decision}: {elsewhere}"
    assert {name for module, _, name in found if module == decision} == asked
    worker = (PACKAGE / "worker" / "loop.py").read_text()
    assert "attempt_start(" in worker and "resume_point" not in worker


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(source: str, known: set[str]) -> set[str]:
    """The package's modules that `source` imports, wherever the import sits: at the top, in a
    function or under TYPE_CHECKING (a circle there is still two modules that need each
    other)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found |= {name for name in names if name in known}
    return found


def _import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that reach one another through imports (Tarjan's strongly
    connected components, iteratively), each of more than one module."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []
    for root in graph:
        if root in order:
            continue
        work = [(root, iter(sorted(graph[root])))]
        order[root] = low[root] = len(order)
        stack.append(root)
        while work:
            node, edges = work[-1]
            step = next((e for e in edges if e not in order or e in stack), None)
            if step is not None and step not in order:
                order[step] = low[step] = len(order)
                stack.append(step)
                work.append((step, iter(sorted(graph[step]))))
                continue
            if step is not None:
                low[node] = min(low[node], order[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == order[node]:
                group = stack[stack.index(node) :]
                del stack[stack.index(node) :]
                if len(group) > 1:
                    circles.append(sorted(group))
    return circles


def test_no_import_circle_anywhere_in_the_package() -> None:
    known = {_module_name(path) for path in MODULES}
    graph = {
        _module_name(path): _imported_modules(path.read_text(), known) - {_module_name(path)}
        for path in MODULES
    }
    assert _import_circles(graph) == []


def test_the_circle_check_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _import_circles(graph) == [["a", "b", "c"]]
    assert _import_circles({"a": {"b"}, "b": set()}) == []


# The store's modules: the one place that asks what kind a checkpoint location is.
_STORE_MODULES = {
    "checkpoint/store.py",
    *(f"checkpoint/stores/{p.name}" for p in (PACKAGE / "checkpoint" / "stores").glob("*.py")),
}


def test_only_the_store_asks_whether_a_location_is_remote() -> None:
    """`checkpoint.dir` is resolved into one store object, which says how its storage lists,
    reads and publishes (issue 54): nothing else asks whether a location is a URL, which is
    how a path and a store were once told apart in 7 modules."""
    asking = {
        str(path.relative_to(PACKAGE))
        for path in MODULES
        if re.search(r"\bis_remote\(", path.read_text())
    }
    assert asking - {"storage_url.py"} <= _STORE_MODULES, asking
    assert "checkpoint/store.py" in asking  # `kind_for`


def test_every_module_of_the_stores_is_one_kind_a_location_finds() -> None:
    """A new kind of store is one module of `checkpoint/stores/` (docs/architecture.md, "A
    checkpoint store"): its class names the schemes it takes, and `kind_for` finds it."""
    from launcher.checkpoint.store import Store, _kinds, kind_for
    from launcher.storage_url import location

    modules = {p.stem for p in (PACKAGE / "checkpoint" / "stores").glob("*.py")} - {"__init__"}
    kinds = _kinds()
    assert {kind.__module__.rsplit(".", 1)[-1] for kind in kinds.values()} == modules
    assert all(issubclass(kind, Store) for kind in kinds.values())
    assert kind_for(Path("runs/x/checkpoints")).__name__ == "LocalStore"
    assert not kind_for(Path("runs")).remote
    for url in ("s3://bucket/run", "file:///tmp/store"):
        assert kind_for(location(url)).__name__ == "ObjectStore" and kind_for(location(url)).remote
