"""The run spec as the CLI's commands load it: YAML, `key=value` overrides, then flags."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from launcher.config.spec import RunSpec


def load_cli_spec(
    config: Path, overrides: list[str] | None, strict_compile: bool = False, **flags: str | None
) -> RunSpec:
    """The spec `--config` names, with `overrides` and the flags given (`--devices` ...) applied
    by precedence: flag > key=value > YAML > default."""
    return load_cli_spec_and_sources(config, overrides, strict_compile, **flags)[0]


def load_cli_spec_and_sources(
    config: Path, overrides: list[str] | None, strict_compile: bool = False, **flags: str | None
) -> tuple[RunSpec, dict[str, str]]:
    """`load_cli_spec`, and where each given key came from (`launcher.config.sources`)."""
    from launcher.config.loader import load_spec_and_sources
    from launcher.config.yaml_file import echo, parse_yaml_value

    # Numbers and `null` are read as YAML, as in overrides; names stay strings.
    typed = ("devices", "max_restarts", "stall_timeout")
    given: dict[str, tuple[str, object]] = {}
    for key, text in flags.items():
        if text is None:
            continue
        flag = f"--{key.replace('_', '-')}"
        value = parse_yaml_value(text, f"{flag} {echo(text)}") if key in typed else text
        given[f"launch.{key}"] = (flag, value)
    if strict_compile:
        given["xla.strict_compile"] = ("--strict-compile", True)
    return load_spec_and_sources(config, overrides or [], flags=given)
