"""The CLI answers at once: help, bad flags and a spec's mistakes without importing torch; its
usage line, command list and shell completion; the schema editors read; where each value of a
spec came from (`validate --explain`, spec.yaml's comments)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launcher.config.loader import load_cli_spec, load_spec_and_sources
from launcher.config.yaml_file import read_yaml_file
from launcher.launch.plan import make_plan
from launcher.launch.run_folder import prepare_run_dir
from launcher.rundir.layout import RunLayout
from tests.conftest import REPO, write_spec

pytestmark = [pytest.mark.launcher_only, pytest.mark.timeout(120)]

# Runs `train ARGS` in this interpreter, then says whether torch was imported.
_PROBE = """
import sys
from launcher.cli.app import main
sys.argv = ["train", *sys.argv[1:]]
try:
    main()
except SystemExit as exc:
    code = exc.code
else:
    code = 0
print("TORCH-IMPORTED" if "torch" in sys.modules else "NO-TORCH", file=sys.stderr)
sys.exit(code)
"""


def _train(
    args: list[str], cwd: Path = REPO, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _PROBE, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "100", **(env or {})},
    )


@pytest.fixture
def bad_spec(tmp_path: Path) -> Path:
    return write_spec(tmp_path / "bad.yaml", train={"max_steps": -1, "bogus": 2})


@pytest.mark.parametrize(
    "args, code",
    [
        (["--help"], 0),
        (["validate", "--help"], 0),
        (["runs", "--help"], 0),
        (["plot", "--help"], 0),
        (["schema"], 0),
        (["--config", "configs/quickstart.yaml", "--no-such-flag"], 2),
        (["--config", "configs/quickstart.yaml", "--devices", "many"], 2),
        (["--config", "configs/quickstart.yaml", "optim.lr"], 2),
        (["validate", "--config", "BAD"], 2),
        (["--config", "BAD"], 2),
        (["validate", "--config", "MINIMAL_BAD"], 2),
        (["--config", "MINIMAL_BAD"], 2),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else str(v),
)
def test_it_answers_without_importing_torch(
    args: list[str], code: int, bad_spec: Path, tmp_path: Path
) -> None:
    # Without an `optim` section, its default is built with no validation context.
    minimal = tmp_path / "minimal.yaml"
    minimal.write_text(f"recipe: {{source: {REPO}/recipes/mlp.py}}\ntrain: {{max_steps: -1}}\n")
    given = {"BAD": str(bad_spec), "MINIMAL_BAD": str(minimal)}
    args = [given.get(a, a) for a in args]
    result = _train(args)
    assert result.returncode == code, result.stdout + result.stderr
    assert result.stderr.rstrip().endswith("NO-TORCH"), result.stderr[-2000:]
    if code == 2:
        assert "Traceback" not in result.stderr


def test_a_spec_that_is_fine_imports_torch_to_check_its_optimizer(tmp_path: Path) -> None:
    # The probe can tell: the checks that need torch still run once the rest is right.
    spec = write_spec(tmp_path / "run.yaml", optim={"name": "NoSuchOptimizer"})
    result = _train(["validate", "--config", str(spec)])
    assert result.returncode == 2 and "NoSuchOptimizer" in result.stderr
    assert result.stderr.rstrip().endswith("TORCH-IMPORTED")


def test_the_usage_line_and_the_commands_listed() -> None:
    from launcher.cli.app import COMMANDS

    out = _train(["--help"]).stdout
    assert re.search(r"Usage: train \[OPTIONS\] \[KEY=VALUE\]\.\.\.", out), out
    assert not re.search(r"train run\b", out)  # the run command is `train` itself
    for name in ("validate", "slurm", "export", "schema", "runs", "plot"):
        assert name in COMMANDS and re.search(rf"^\s*{name}\s+\S", out, re.M), name
    error = _train(["--config", "x.yaml", "--nope"]).stderr
    assert "Usage: train [OPTIONS] [KEY=VALUE]..." in error


@pytest.mark.parametrize("args", [["run"], ["run", "--config", "configs/quickstart.yaml"]])
def test_train_run_is_refused_one_letter_from_train_runs(args: list[str]) -> None:
    result = _train(args)
    assert result.returncode == 2, result.stdout + result.stderr
    error = result.stderr.replace("NO-TORCH", "").strip()
    assert len(error.splitlines()) == 1, error
    assert "`train --config FILE` runs a spec" in error and "`train runs`" in error


def _complete(words: str) -> list[str]:
    cword = len(words.split()) - (0 if words.endswith(" ") else 1)
    env = {"_TRAIN_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(cword)}
    return _train([], env=env).stdout.split()


def test_shell_completion_offers_commands_and_the_runs_options() -> None:
    assert {"validate", "runs", "plot", "schema"} <= set(_complete("train "))
    assert _complete("train --con") == ["--config"]
    assert set(_complete("train --devices 2 --str")) == {"--strategy", "--strict-compile"}
    assert _complete("train validate --ex") == ["--explain"]
    assert _complete("train ru") == ["runs"]


def test_the_printed_schema_is_the_shipped_one_and_every_config_validates() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    result = _train(["schema"])
    schema = json.loads(result.stdout)
    assert schema == json.loads((REPO / "configs" / "run.schema.json").read_text()), (
        "configs/run.schema.json is stale: train schema > configs/run.schema.json"
    )
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    configs = sorted([*(REPO / "configs").glob("*.yaml"), *(REPO / "bench").glob("*.yaml")])
    assert len(configs) >= 6
    for config in configs:
        text = config.read_text()
        assert "# yaml-language-server: $schema=" in text.splitlines()[1], config
        # Read as YAML 1.2, as the launcher and editors' language servers do (`1e-3` a number).
        errors = [e.message for e in validator.iter_errors(read_yaml_file(config)[0])]
        assert not errors, (config, errors)
    # It does check keys: a misspelt one is refused, with the description at hand.
    typo = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    typo["optim"]["learning_rate"] = 1.0
    assert list(validator.iter_errors(typo))
    assert schema["$defs"]["OptimSection"]["properties"]["lr"]["description"]


def test_explain_names_the_yaml_line_the_override_and_the_flag(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "run.yaml", optim={"lr": 0.01})
    lines = spec.read_text().splitlines()
    lr_line = next(i for i, line in enumerate(lines, 1) if re.match(r"\s+lr:", line))
    result = _train(
        ["validate", "--config", str(spec), "--explain", "optim.lr=3e-4", "--devices", "2"],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert rows["optim.lr"].split()[1] == "0.0003"
    assert f"override optim.lr=3e-4 (over {spec}:{lr_line})" in rows["optim.lr"]
    assert "--devices" in rows["launch.devices"]
    assert f"{spec}:" in rows["train.max_steps"]
    assert "optim.fused" not in rows  # at its default, and not given


def test_spec_yaml_says_where_each_value_came_from_and_reads_back(tmp_path: Path) -> None:
    config = write_spec(
        tmp_path / "run.yaml",
        run={"name": "exp", "output_dir": str(tmp_path / "runs")},
        launch={"accelerator": "auto", "devices": 1},
    )
    spec, sources = load_spec_and_sources(
        config, ["optim.lr=0.5"], flags={"launch.strategy": ("--strategy", "ddp")}
    )
    plan = make_plan(spec, sources=sources)
    prepare_run_dir(plan)
    saved = RunLayout(plan.run_dir).spec
    text = saved.read_text()
    assert re.search(
        r"^  lr: 0\.5  # override optim\.lr=0\.5 \(over .*run\.yaml:\d+\)$", text, re.M
    )
    assert re.search(r"^  strategy: ddp  # --strategy \(over .*run\.yaml:\d+\)$", text, re.M)
    assert re.search(r"^  seed: 0$", text, re.M) and re.search(r"^optim:$", text, re.M)
    assert re.search(
        r"^  accelerator: cpu  # resolved at launch \(was 'auto' from .*\)$", text, re.M
    )
    assert re.search(rf"^  max_steps: \d+  # {re.escape(str(config))}:\d+$", text, re.M)
    assert load_cli_spec(saved) == plan.spec  # the comments change nothing it says


def test_demo_tells_how_to_put_train_on_the_path() -> None:
    makefile = (REPO / "Makefile").read_text()
    demo = makefile[makefile.index("\ndemo:") :].split("\n\n")[0]
    assert "source .venv/bin/activate" in demo
    readme = (REPO / "README.md").read_text()
    assert readme.index("source .venv/bin/activate") < readme.index(
        "## ", readme.index("make demo")
    )


# The docs page that shows each command's `--help` (its usage line and first lines).
HELP_PAGES = {
    "validate": "docs/config.md",
    "slurm": "docs/multi-node-and-slurm.md",
    "k8s": "docs/multi-node-and-slurm.md",
    "export": "docs/evaluation-and-checkpoints.md",
    "schema": "docs/config.md",
    "runs": "docs/seeing-runs.md",
    "plot": "docs/seeing-runs.md",
}


def _words(path: str) -> str:
    """The page's text with its whitespace collapsed: a line may wrap anywhere."""
    return " ".join((REPO / path).read_text().split())


def test_the_docs_show_each_commands_help_first_lines() -> None:
    from launcher.cli.app import COMMANDS

    assert set(HELP_PAGES) == set(COMMANDS), "a new command: name the docs page of its --help"
    readme = _words("README.md")
    assert "Usage: train [OPTIONS] [KEY=VALUE]..." in readme
    for name, (_, listed) in COMMANDS.items():
        # README's command list: each command with the line `train --help` lists it with.
        assert f"`train {name}`: {listed}" in readme, f"README.md's command list lacks {name}"
        page = _words(HELP_PAGES[name])
        lines = [line.strip() for line in _train([name, "--help"]).stdout.splitlines()]
        usage = next(i for i, line in enumerate(lines) if line.startswith("Usage:"))
        first = next(line for line in lines[usage + 1 :] if line)
        where = HELP_PAGES[name]
        assert lines[usage] in page, f"{where} lacks `{lines[usage]}`"
        assert first in page, f"{where} lacks `train {name} --help`'s first line: {first}"


def test_spec_yaml_comments_never_land_inside_a_value() -> None:
    from launcher.config.loader import spec_to_yaml
    from launcher.config.sources import annotate_yaml
    from launcher.config.spec import RunSpec

    long, lines = "word " * 40, "a: b\nc: d\n"  # wrapped, and quoted over several lines
    spec = RunSpec.model_validate(
        {
            "recipe": {"source": "r.py", "model": {"note": long, "text": lines}},
            "train": {"max_steps": 3},
            "fsdp": {"wrap": ["Block", "Other"]},
        }
    )
    sources = {
        "recipe.model.note": "x.yaml:6",
        "recipe.model.text": "override recipe.model.text=...",
        "fsdp.wrap": "override fsdp.wrap=[Block, Other]",
        "train.max_steps": "x.yaml:9",
    }
    text = annotate_yaml(spec_to_yaml(spec), sources)
    assert RunSpec.model_validate(yaml.safe_load(text)) == spec
    assert re.search(r"^    note: '?word .*  # x\.yaml:6$", text, re.M)
    assert re.search(r"^    # text: override recipe\.model\.text=\.\.\.\n    text: ", text, re.M)
    assert re.search(
        r"^  # wrap: override fsdp\.wrap=\[Block, Other\]\n  wrap:\n  - Block", text, re.M
    )
    assert re.search(r"^  max_steps: 3  # x\.yaml:9$", text, re.M)


def test_a_mistyped_command_is_named_with_the_one_meant() -> None:
    result = _train(["valdate", "--config", "run.yaml"])
    assert result.returncode == 2
    assert "no command 'valdate'; did you mean `train validate`?" in result.stderr
    # An override is not taken for a command.
    result = _train(["--config", "no.yaml", "optim.lr=1"])
    assert result.returncode == 2 and "no command" not in result.stderr
