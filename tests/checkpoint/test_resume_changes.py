"""A resume runs what the user asks for now: the run's own spec (its flags and overrides
included), changed only by what is given again or edited in the YAML since, every change said
before anything starts and then truly applied; and what no resume can take, refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from launcher.config.loader import cli_layers, read_layers
from launcher.config.resume import spec_on_resume
from launcher.config.spec import RunSpec
from tests.conftest import (
    metrics_of,
    only_run_dir,
    run_train,
    tiny_gpt,
    usage_error,
    write_spec,
)

BASE = {
    "run": {"name": "t"},
    "launch": {"accelerator": "cpu", "devices": 2, "strategy": "ddp"},
    "recipe": {"source": "/r.py"},
    "optim": {"lr": 0.05},
    "train": {"max_steps": 6},
}


def _recorded(**changes: dict) -> dict:
    """A checkpoint's spec: the resolved spec of a run started from BASE (with `changes`)."""
    raw = yaml.safe_load(yaml.safe_dump(BASE))
    for section, values in changes.items():
        raw.setdefault(section, {}).update(values)
    return RunSpec.model_validate(raw).model_dump(mode="json", by_alias=True)


def _layers(tmp_path: Path, yaml_text: str, overrides: list[str] | None = None):  # type: ignore[no-untyped-def]
    path = tmp_path / "run.yaml"
    path.write_text(yaml_text)
    return read_layers(path, overrides)


def _yaml(**changes: dict) -> str:
    raw = yaml.safe_load(yaml.safe_dump(BASE))
    for section, values in changes.items():
        raw.setdefault(section, {}).update(values)
    return yaml.safe_dump(raw)


def test_a_resume_that_changes_nothing_keeps_the_runs_flags(tmp_path: Path) -> None:
    # Started with --strategy fsdp over a YAML that says ddp: the run is fsdp.
    recorded = _recorded(launch={"strategy": "fsdp"})
    then = _layers(tmp_path, _yaml()).yaml
    resumed = spec_on_resume(recorded, then, _layers(tmp_path, _yaml()))
    assert resumed.spec.launch.strategy == "fsdp" and resumed.changes == []


def test_a_key_given_now_changes_and_says_where_from(tmp_path: Path) -> None:
    then = _layers(tmp_path, _yaml()).yaml
    layers = _layers(tmp_path, _yaml(), ["optim.lr=1e-6"])
    resumed = spec_on_resume(_recorded(), then, layers)
    assert resumed.spec.optim.lr == 1e-6
    [change] = resumed.changes
    assert change.describe() == (
        "changed on resume: optim.lr 0.05 -> 1.0e-06 (override optim.lr=1e-6)"
    )
    assert resumed.sources["optim.lr"] == "override optim.lr=1e-6"
    assert resumed.sources["run.name"] == "as the run had it"  # not at its default
    assert "launch.strategy" not in resumed.sources  # at its default: no comment


def test_a_key_edited_in_the_yaml_since_changes(tmp_path: Path) -> None:
    then = _layers(tmp_path, _yaml()).yaml
    now = _layers(tmp_path, _yaml(data={"batch_size": 64}, optim={"lr": 0.01}))
    resumed = spec_on_resume(_recorded(), then, now)
    assert (resumed.spec.data.batch_size, resumed.spec.optim.lr) == (64, 0.01)
    assert {c.key: c.origin for c in resumed.changes} == {
        "data.batch_size": f"edited in {tmp_path / 'run.yaml'}",
        "optim.lr": f"edited in {tmp_path / 'run.yaml'}",
    }


def test_a_key_removed_from_the_yaml_takes_its_default(tmp_path: Path) -> None:
    then = _layers(tmp_path, _yaml(data={"batch_size": 64})).yaml
    resumed = spec_on_resume(_recorded(data={"batch_size": 64}), then, _layers(tmp_path, _yaml()))
    assert resumed.spec.data.batch_size == 32  # the default


def test_an_older_checkpoint_changes_only_by_the_command_line(tmp_path: Path) -> None:
    # No record of the YAML as it was: nothing in it counts as edited.
    layers = _layers(tmp_path, _yaml(optim={"lr": 0.5}), ["train.max_steps=9"])
    resumed = spec_on_resume(_recorded(), None, layers)
    assert (resumed.spec.optim.lr, resumed.spec.train.max_steps) == (0.05, 9)


def test_a_bad_value_given_on_resume_is_refused_naming_it(tmp_path: Path) -> None:
    from launcher.errors import UsageError

    then = _layers(tmp_path, _yaml()).yaml
    with pytest.raises(UsageError) as info:
        spec_on_resume(_recorded(), then, _layers(tmp_path, _yaml(), ["optim.lr=fast"]))
    assert "optim.lr (override optim.lr=fast): expected a number" in info.value.render()


TP_AND_HSDP = {"dp_replicate": 2, "dp_shard": 2, "tp": 2}
ALL_DROPPED = {"parallel.dp_replicate": None, "parallel.dp_shard": None, "parallel.tp": 1}


@pytest.mark.parametrize(
    ("strategy", "overrides", "dropped"),
    [
        ("ddp", [], ALL_DROPPED),
        (None, ["launch.strategy=xla"], ALL_DROPPED),
        ("ddp", ["parallel.tp=2"], {k: v for k, v in ALL_DROPPED.items() if k != "parallel.tp"}),
        (None, ["parallel.tp=4"], {"parallel.tp": 4}),  # no strategy given: nothing dropped
    ],
)
def test_a_strategy_given_now_drops_the_stored_dimensions_it_cannot_take(
    tmp_path: Path, strategy: str | None, overrides: list[str], dropped: dict
) -> None:
    """A tp and HSDP run resumed as ddp (or xla) loses its `parallel` keys, each said as a
    change; a key given again now stays, for the launch to refuse by name."""
    recorded = _recorded(launch={"strategy": "fsdp", "devices": 8}, parallel=TP_AND_HSDP)
    then = _layers(tmp_path, _yaml()).yaml
    layers = cli_layers(tmp_path / "run.yaml", overrides, strategy=strategy)
    resumed = spec_on_resume(recorded, then, layers)
    changes = {c.key: c for c in resumed.changes if c.key.startswith("parallel.")}
    assert {key: change.after for key, change in changes.items()} == dropped
    name = resumed.spec.launch.strategy
    for key, change in changes.items():
        given = any(override.startswith(f"{key}=") for override in overrides)
        assert given or change.origin == f"dropped: launch.strategy {name} cannot take it"
    for key, value in TP_AND_HSDP.items():
        if f"parallel.{key}" not in dropped:
            assert getattr(resumed.spec.parallel, key) == value


def _first_run(tmp_path: Path, *flags: str) -> tuple[Path, Path]:
    spec = write_spec(
        tmp_path / "run.yaml",
        optim={"name": "SGD", "lr": 0.05},
        train={"max_steps": 4, "log_every": 1},
        checkpoint={"every_n_steps": 2},
    )
    first = run_train(["--config", str(spec), *flags], cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    return spec, only_run_dir(tmp_path / "runs")


@pytest.mark.timeout(240)
def test_a_resume_keeps_a_flag_given_strategy_and_needs_no_config(tmp_path: Path) -> None:
    spec, run = _first_run(tmp_path, "--strategy", "fsdp")
    resumed = run_train(
        ["--config", str(spec), "--resume", "latest", "train.max_steps=6"], tmp_path
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "strategy fsdp" in resumed.stdout and "fsdp on 2 x cpu" in resumed.stdout
    # The run's own folder is enough: its spec comes from its checkpoint.
    again = run_train(["--resume", str(run), "train.max_steps=8"], tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert re.search(r"resuming t from \S+step-00000006: 2 x cpu, strategy fsdp", again.stdout)
    assert "resumed at step 6" in again.stdout and "step 8/8" in again.stdout


@pytest.mark.timeout(240)
def test_what_no_resume_can_take_is_refused_then_an_lr_given_on_resume_is_applied(
    tmp_path: Path,
) -> None:
    """The refusals, before anything starts, leave the run as it was for the resume after."""
    spec, run = _first_run(tmp_path)
    recipe = (Path(__file__).parents[2] / "recipes" / "mlp.py").read_text()
    (tmp_path / "other.py").write_text(recipe + "\nWIDTH = 3  # another recipe\n")
    other = run_train(
        ["--config", str(spec), "--resume", "latest", "recipe.source=other.py"], tmp_path
    )
    usage_error(other, "recipe.source (override recipe.source=other.py)", "its own recipe")
    # The same recipe copied elsewhere is the same recipe: it passes on to the next check.
    # (Not copy.py: in the launch folder it would hide the standard library's copy from the
    # workers of the resume below.)
    (tmp_path / "mlp_copy.py").write_text(recipe)
    copy = run_train(
        ["--config", str(spec), "--resume", "latest", "recipe.source=mlp_copy.py"], tmp_path
    )
    usage_error(copy, "train.max_steps=4", "at step 4 already")
    past = run_train(["--config", str(spec), "--resume", "latest", "train.max_steps=3"], tmp_path)
    usage_error(past, "train.max_steps=3", "at step 4 already")
    no_config = run_train(["--resume", "latest"], tmp_path)
    usage_error(no_config, "--resume latest: needs --config")
    assert not list(run.glob("spec.resume-*"))  # nothing started

    resumed = run_train(
        ["--config", str(spec), "--resume", "latest", "optim.lr=1e-6", "train.max_steps=6"],
        cwd=tmp_path,
    )
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output
    assert "changed on resume: optim.lr 0.05 -> 1.0e-06 (override optim.lr=1e-6)" in output
    lrs = {r["step"]: r["lr"] for r in metrics_of(run) if "lr" in r}
    assert lrs == {1: 0.05, 2: 0.05, 3: 0.05, 4: 0.05, 5: 1e-6, 6: 1e-6}
    assert "lr: 1.0e-06  # override optim.lr=1e-6" in (run / "spec.resume-1.yaml").read_text()


@pytest.mark.timeout(240)
def test_a_tensor_parallel_run_resumes_as_ddp_with_only_the_strategy_given(
    tmp_path: Path,
) -> None:
    spec = write_spec(
        tmp_path / "run.yaml",
        launch={"accelerator": "cpu", "devices": 2, "strategy": "fsdp"},
        parallel={"tp": 2},
        recipe=tiny_gpt(20_000),
        train={"max_steps": 2, "log_every": 1},
        checkpoint={"every_n_steps": 2},
    )
    first = run_train(["--config", str(spec)], cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    resumed = run_train(
        ["--config", str(spec), "--resume", "latest", "--strategy", "ddp", "train.max_steps=3"],
        cwd=tmp_path,
    )
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output
    assert "changed on resume: launch.strategy fsdp -> ddp (--strategy)" in output
    assert (
        "changed on resume: parallel.tp 2 -> 1 (dropped: launch.strategy ddp cannot take it)"
        in output
    )
    assert "resumed at step 2" in output and "step 3/3" in output
