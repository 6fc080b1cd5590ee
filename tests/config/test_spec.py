"""The run spec: parsing, overrides, and errors that name the key and say how to fix it."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.config.loader import load_cli_spec, load_spec_and_sources, parse_override
from launcher.config.reference import DOCS_PAGE, END, START, config_reference
from launcher.errors import UsageError
from tests.conftest import REPO

MINIMAL = "recipe: {source: r.py}\ntrain: {max_steps: 5}\n"


def _spec(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def _errors(path: Path, overrides: list[str] | None = None, **flags) -> str:
    with pytest.raises(UsageError) as info:
        load_spec_and_sources(path, overrides, flags=flags)
    assert info.value.exit_code == 2
    return info.value.render()


def test_minimal_spec_takes_documented_defaults(tmp_path: Path) -> None:
    spec = load_cli_spec(_spec(tmp_path, MINIMAL))
    assert spec.launch.strategy == "ddp" and spec.data.batch_size == 32
    assert spec.recipe.source == str(tmp_path / "r.py")  # relative to the YAML file


def test_a_recipe_path_given_as_an_override_is_relative_to_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    spec, _ = load_spec_and_sources(_spec(tmp_path, MINIMAL), ["recipe.source=other.py"])
    assert spec.recipe.source == str(work / "other.py")


def test_all_errors_at_once_with_key_line_and_suggestion(tmp_path: Path) -> None:
    text = MINIMAL + "optim:\n  lr: fast\n  lrr: 3\ntrian: {}\nlaunch: {accelerator: gpux}\n"
    message = _errors(_spec(tmp_path, text))
    assert "4 problems" in message
    assert "optim.lr (line 4): expected a number, got 'fast'" in message
    assert "optim.lrr (line 5): unknown key; did you mean 'optim.lr'?" in message
    assert "trian (line 6): unknown key; did you mean 'train'?" in message
    assert "launch.accelerator (line 7): expected one of 'auto', 'cpu', 'gpu' or 'tpu'" in message


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    message = _errors(_spec(tmp_path, MINIMAL + "optim:\n  lr: [1\ndata: {}\n"))
    assert "run.yaml:5:" in message and "invalid YAML" in message


def test_duplicate_keys_are_an_error_not_a_silent_overwrite(tmp_path: Path) -> None:
    message = _errors(_spec(tmp_path, MINIMAL + "optim: {lr: 1.0}\noptim: {lr: 2.0}\n"))
    assert "duplicate key 'optim' (first on line 3)" in message


def test_scientific_notation_is_a_number_everywhere(tmp_path: Path) -> None:
    spec = load_cli_spec(
        _spec(tmp_path, MINIMAL + "optim: {lr: 3e-4, kwargs: {weight_decay: 1e-2}}\n")
    )
    assert spec.optim.lr == 3e-4 and spec.optim.kwargs["weight_decay"] == 1e-2


def test_precedence_flag_over_override_over_yaml(tmp_path: Path) -> None:
    path = _spec(tmp_path, MINIMAL + "launch: {devices: 1}\noptim: {lr: 0.1}\n")
    spec = load_cli_spec(path, ["launch.devices=3", "optim.lr=0.2"], devices="4")
    assert spec.launch.devices == 4 and spec.optim.lr == 0.2


def test_flag_and_override_errors_name_their_origin(tmp_path: Path) -> None:
    message = _errors(
        _spec(tmp_path, MINIMAL), ["train.max_steps=0"], **{"launch.devices": ("--devices", -1)}
    )
    assert "launch.devices (--devices): expected a positive number of devices or 'auto'" in message
    assert "train.max_steps (override train.max_steps=0): must be greater than 0" in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("optim: {name: Adamm}", "expected a torch.optim optimizer"),
        ("optim: {kwargs: {momentum: 0.9}}", "AdamW does not take momentum; it takes: betas"),
        ("train: {max_steps: null}", "set train.max_steps or train.max_epochs"),
        ("data: {batch_size: 0}", "data.batch_size (line 3): must be greater than 0"),
        ("run: {name: 'my run/1'}", "run.name (line 3): use letters, digits"),
        ("launch: {devices: two}", "expected a positive number of devices or 'auto', got 'two'"),
        ("train: {precision: fp8, max_steps: 1}", "expected one of 'fp32', 'bf16' or 'fp16'"),
        ("optim: {name: '..'}", "optim.name (line 3): expected a torch.optim optimizer or a"),
        ("optim: {lr: .inf}", "optim.lr (line 3): Input should be a finite number"),
        (
            "optim: {kwargs: {weight_decay: .nan}}",
            "optim.kwargs (line 3): weight_decay: nan is not a number an optimizer can use",
        ),
        (
            "optim: {name: Adam, kwargs: {betas: [2, 0.9]}}",
            "optim.kwargs (line 3): Adam refuses betas=[2, 0.9]: Invalid beta parameter at "
            "index 0: 2",
        ),
        ("optim: {kwargs: {weight_decay: -1}}", "weight_decay: must be 0 or more, got -1"),
        (
            "optim: {groups: [{params: ['*'], lr: -1}]}",
            "optim.groups (line 3): group 1: lr: must be 0 or more, got -1",
        ),
        (
            "optim: {groups: [{params: ['*'], weight_decay: -0.5}]}",
            "group 1: weight_decay: must be 0 or more, got -0.5",
        ),
        (
            "optim: {name: Adam, groups: [{params: ['*'], betas: [0.9, .inf]}]}",
            "group 1: betas: inf is not a number an optimizer can use",
        ),
        (
            "optim: {name: SGD, groups: [{params: ['*'], nesterov: true}]}",
            "group 1: SGD refuses nesterov=True: Nesterov momentum requires a momentum",
        ),
    ],
)
def test_bad_values_get_a_specific_message(tmp_path: Path, text: str, expected: str) -> None:
    if text.startswith("train:"):
        base = "recipe: {source: r.py}\n" + text + "\ndata: {}\n"
    else:
        base = MINIMAL + text + "\n"
    assert expected in _errors(_spec(tmp_path, base))


def test_a_groups_settings_are_checked_over_the_kwargs(tmp_path: Path) -> None:
    text = "optim: {name: SGD, kwargs: {momentum: 0.9}, groups: [{params: ['*'], nesterov: true}]}"
    spec = load_cli_spec(_spec(tmp_path, MINIMAL + text + "\n"))
    assert spec.optim.groups[0]["nesterov"] is True


@pytest.mark.parametrize(
    ("recipe", "overrides", "key"),
    [
        ("loop.py", [], "recipe.source"),  # in the YAML file: relative to it
        ("r.py", ["recipe.source=loop.py"], "recipe.source"),
        ("r.py", ["load.weights=loop.py"], "load.weights"),
    ],
)
def test_a_symbolic_link_loop_is_refused_naming_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recipe: str, overrides: list[str], key: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loop.py").symlink_to("other.py")
    (tmp_path / "other.py").symlink_to("loop.py")
    text = f"recipe: {{source: {recipe}}}\ntrain: {{max_steps: 5}}\n"
    message = _errors(_spec(tmp_path, text), overrides)
    assert f"{key} " in message and "loop.py': cannot follow it" in message, message
    assert "leads back to itself" in message


def test_missing_sections_are_named(tmp_path: Path) -> None:
    message = _errors(_spec(tmp_path, "run: {name: x}\n"))
    assert "recipe: required, but missing" in message and "train: required" in message


@pytest.mark.parametrize("text", ["nodots=1", "optim.lr", "=3", ".lr=1"])
def test_malformed_overrides(text: str) -> None:
    with pytest.raises(UsageError, match=r"is not an override: write section\.key=value"):
        parse_override(text)


def test_missing_config_file_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"--config .*nope\.yaml: no such file"):
        load_cli_spec(tmp_path / "nope.yaml")


@pytest.mark.parametrize("config", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates_and_says_how_to_run_it(config: Path) -> None:
    load_cli_spec(config)
    first = config.read_text().splitlines()[0]
    assert first.startswith("# train --config configs/" + config.name), first


def test_docs_config_reference_is_generated_from_the_spec() -> None:
    page = (REPO / DOCS_PAGE).read_text()
    block = page[page.index(START) + len(START) : page.index(END)].strip()
    assert block == config_reference(), f"{DOCS_PAGE} is stale: run `make docs`"
