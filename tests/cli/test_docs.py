"""The docs stay true: README.md and docs/*.md link only to files and headings that exist, and
every `train` command line in their code blocks names a command the CLI has and only flags that
command takes. Reads files and the CLI's declarations; runs nothing."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer

from tests.conftest import REPO

pytestmark = pytest.mark.launcher_only

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_IDS = [str(page.relative_to(REPO)) for page in PAGES]

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)[^`]*?\1", re.S)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_SHELL_OPERATORS = ("|", "||", "&&", ";", "&")


# --- reading a page ----------------------------------------------------------------------------


def _split(text: str) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """The page's prose lines (code blocks blanked, so line numbers hold) and its fenced code
    blocks, each with the line number of its first line."""
    prose: list[str] = []
    blocks: list[tuple[int, list[str]]] = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
            blocks.append((number + 1, []))
            prose.append("")
        elif fence is not None and line.strip().startswith(fence):
            fence = None
            prose.append("")
        elif fence is not None:
            blocks[-1][1].append(line)
            prose.append("")
        else:
            prose.append(line)
    return prose, blocks


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text without markup, lower case, punctuation
    other than `-` and `_` dropped, spaces as `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts as its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _split(page.read_text())[0]:
        match = _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    """Each relative link of `page` that leads to no file, or to no heading of its file."""
    prose = "\n".join(_split(page.read_text())[0])
    # Code spans hold no links; blank them, keeping the line breaks.
    prose = _CODE_SPAN.sub(lambda m: "\n" * m.group(0).count("\n"), prose)
    problems = []
    for match in _LINK.finditer(prose):
        target = match.group(1)
        line = prose.count("\n", 0, match.start()) + 1
        if _SCHEME.match(target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(REPO)}:{line}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading #{anchor} in {dest.name}")
    return problems


def train_lines(page: Path) -> list[tuple[int, list[str]]]:
    """The `train` command lines of the page's code blocks, as the words after `train`."""
    return [(number, words[1:]) for number, words in command_lines(page, {"train"})]


def command_lines(page: Path, programs: set[str]) -> list[tuple[int, list[str]]]:
    """The command lines of the page's code blocks that run one of `programs`, as their words:
    in a block with `$ ` prompts only the prompted lines (the rest is output); `\\` continues
    a line; `VAR=value` before the program, comments, `...` and what follows a redirect or
    pipe are dropped."""
    found = []
    for first, block in _split(page.read_text())[1]:
        prompted = any(line.lstrip().startswith("$ ") for line in block)
        logical: list[tuple[int, str]] = []
        carry: tuple[int, str] | None = None
        for offset, line in enumerate(block):
            if carry is not None:
                line = carry[1] + " " + line.strip()
            number = carry[0] if carry else first + offset
            carry = None
            if line.rstrip().endswith("\\"):
                carry = (number, line.rstrip()[:-1])
                continue
            logical.append((number, line.strip()))
        for number, line in logical:
            if prompted:
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            plain = line.split()
            while plain and _ENV.match(plain[0]):
                plain = plain[1:]
            if not plain or plain[0] not in programs:
                continue  # another program, or output: never read as shell words
            words = _words(line)
            while words and _ENV.match(words[0]):
                words = words[1:]
            found.append((number, words))
    return found


def console_scripts_shown(pages: list[Path]) -> dict[str, str]:
    """The commands of the environment's Python packages (their console scripts, such as
    `tensorboard`) that the pages show, in a code block or a code span that starts with one
    (`mlflow server ...`): {command: where it is first shown}. `train` is checked apart, and
    `pip` installs into an environment of the reader's own."""
    from importlib.metadata import entry_points

    scripts = {script.name for script in entry_points(group="console_scripts")}
    scripts -= {"train", "pip", "pip3"}
    shown: dict[str, str] = {}
    for page in pages:
        where = str(page.relative_to(REPO))
        for number, words in command_lines(page, scripts):
            shown.setdefault(words[0], f"{where}:{number}")
        prose = "\n".join(_split(page.read_text())[0])
        for span in _CODE_SPAN.finditer(prose):
            words = span.group(0).strip("`").split()
            if len(words) > 1 and words[0] in scripts:
                line = prose.count("\n", 0, span.start()) + 1
                shown.setdefault(words[0], f"{where}:{line}")
    return shown


def runs_after_activating(command: str, venv: Path) -> subprocess.CompletedProcess[str]:
    """`command --version` (else `--help`) in a shell that has only sourced the venv's
    `activate`, as the README's set-up says, with nothing else of this process's PATH."""
    script = (
        f'source "{venv}/bin/activate" && command -v {command} && '
        f"{{ {command} --version || {command} --help; }}"
    )
    env = {"HOME": os.environ.get("HOME", "/"), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    return subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, env=env, timeout=120
    )


def _words(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words = []
    for word in lexer:
        if word in _SHELL_OPERATORS or word.startswith((">", "<")):
            break
        if word != "...":
            words.append(word)
    return words


# --- checking a command line against the CLI ---------------------------------------------------


def _cli() -> Any:
    """The click group behind `train` (typer's own copy of click: its classes are typer's)."""
    from launcher.cli.app import app

    group = typer.main.get_command(app)
    assert "run" in group.commands  # type: ignore[attr-defined]
    return group


def problems_of(args: list[str]) -> list[str]:
    """What the real CLI would refuse in `train ARGS` by name: an unknown command, an option
    its command does not have, a stray word where only KEY=VALUE overrides go."""
    group = _cli()
    if args and args[0] in group.commands:
        name, rest = args[0], args[1:]
    elif args and not args[0].startswith("-") and "=" not in args[0]:
        return [f"no command {args[0]!r}"]
    elif args and args[0] in ("--install-completion", "--show-completion"):
        return []
    else:
        name, rest = "run", args  # `train --config x` is `train run --config x`
    command = group.commands[name]
    options = {"--help": None, "-h": None}
    for param in command.params:
        if param.param_type_name == "option":
            options.update(dict.fromkeys([*param.opts, *param.secondary_opts], param))
    arguments = [p for p in command.params if p.param_type_name == "argument"]
    overrides_only = bool(arguments) and all(p.metavar == "KEY=VALUE" for p in arguments)
    problems = []
    words = iter(rest)
    for word in words:
        if word.startswith("-") and len(word) > 1:
            flag = word.split("=", 1)[0]
            if flag not in options:
                problems.append(f"`train {name}` has no option {flag}")
                continue
            param = options[flag]
            if param is not None and not param.is_flag and not param.count and "=" not in word:
                next(words, None)  # its value
        elif not arguments:
            problems.append(f"`train {name}` takes no argument, got {word!r}")
        elif overrides_only and "=" not in word:
            problems.append(f"`train {name}` takes KEY=VALUE overrides, got {word!r}")
    return problems


# --- the tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=_IDS)
def test_every_relative_link_leads_to_a_file_and_heading(page: Path) -> None:
    problems = broken_links(page)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=_IDS)
def test_every_train_command_in_a_code_block_parses(page: Path) -> None:
    problems = [
        f"{page.relative_to(REPO)}:{number}: train {shlex.join(args)}: {problem}"
        for number, args in train_lines(page)
        for problem in problems_of(args)
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(300)
def test_every_package_command_the_docs_show_runs_after_activating_the_venv() -> None:
    """`tensorboard --logdir runs/` (the README), `mlflow server`, `wandb sync` (trackers.md):
    each such command is on the PATH once `.venv` is activated, and runs."""
    shown = console_scripts_shown(PAGES)
    assert {"tensorboard", "mlflow", "wandb"} <= shown.keys(), shown
    venv = REPO / ".venv"
    for command, where in sorted(shown.items()):
        result = runs_after_activating(command, venv)
        output = result.stdout + result.stderr
        assert result.returncode == 0, f"{where}: {command}: {output}"
        assert result.stdout.startswith(f"{venv}/bin/{command}\n"), f"{where}: {output}"


def test_the_python_the_docs_show_for_reading_tensorboard_runs(tmp_path: Path) -> None:
    """seeing-runs.md's `read_scalars` example, run on a run folder's `tb/` of two files."""
    from launcher.metrics.tensorboard_events import EventWriter

    for steps in (range(1, 4), range(3, 5)):  # a resume that repeats step 3
        writer = EventWriter(tmp_path / "tb")
        for step in steps:
            writer.add_scalars(step, {"train/loss": 2.0**-step, "train/lr": 0.1})
        writer.close()
    page = REPO / "docs" / "seeing-runs.md"
    blocks = ["\n".join(block) for _, block in _split(page.read_text())[1]]
    [example] = [block for block in blocks if "read_scalars(" in block]
    namespace: dict[str, Any] = {"run_dir": tmp_path}
    exec(example, namespace)
    assert namespace["losses"] == {1: 0.5, 2: 0.25, 3: 0.125, 4: 0.0625}


def test_the_readme_links_every_docs_page() -> None:
    readme = (REPO / "README.md").read_text()
    missing = [p.name for p in PAGES[1:] if f"(docs/{p.name}" not in readme]
    assert not missing, f"README.md links none of: {missing}"


def test_the_docs_show_command_lines_of_every_command() -> None:
    """So that the check above checks something: the pages' commands are found."""
    lines = [args for page in PAGES for _, args in train_lines(page)]
    assert len(lines) >= 20
    used = {args[0] if args and args[0] in _cli().commands else "run" for args in lines}
    assert used >= {"run", "validate", "slurm", "export", "schema", "runs", "plot"}


def test_the_checker_catches_a_made_up_flag() -> None:
    assert problems_of(_words("train --config x --no-such-flag")[1:]) == [
        "`train run` has no option --no-such-flag"
    ]
    assert problems_of(["valdate", "--config", "x"]) == ["no command 'valdate'"]
    assert problems_of(["export", "RUN", "--out", "m.pt", "--bestt"]) == [
        "`train export` has no option --bestt"
    ]
    assert problems_of(["--config", "x", "oops"]) == [
        "`train run` takes KEY=VALUE overrides, got 'oops'"
    ]
    # What the docs do write passes: flags with values, overrides, `-c`, a value with `=`.
    assert not problems_of(["--config", "x", "--devices", "2", "optim.lr=1e-3", "--debug"])
    assert not problems_of(["-c", "x", "--resume=latest"])
    assert not problems_of(["validate", "--config", "x", "--explain"])


def test_the_reader_finds_commands_as_a_shell_would(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```\n"
        "$ train runs --json\n"
        "train --output-of-a-prompted-block\n"
        "```\n\n"
        "```\n"
        "PJRT_DEVICE=CPU train --config a.yaml \\\n"
        "      --devices 4 ...   # a comment --no-flag\n"
        "train slurm --config a.yaml > job.sbatch && sbatch --bogus job.sbatch\n"
        "srun train --config a.yaml\n"
        "```\n"
    )
    assert train_lines(page) == [
        (2, ["runs", "--json"]),
        (7, ["--config", "a.yaml", "--devices", "4"]),
        (9, ["slurm", "--config", "a.yaml"]),
    ]


def test_the_link_check_catches_a_missing_file_and_heading(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "other.md").write_text("# Other\n\n## A `code` heading (here)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#a-code-heading-here) [ok](#page) [web](https://example.com)\n"
        "`[not a link](nowhere.md)`\n\n"
        "[gone](nowhere.md) [bad](other.md#nope) [self](#nope)\n"
    )
    assert broken_links(page) == [
        "page.md:6: nowhere.md: no such file",
        "page.md:6: other.md#nope: no heading #nope in other.md",
        "page.md:6: #nope: no heading #nope in page.md",
    ]
