"""`train schema`: print the run spec's JSON Schema, for editors."""

from __future__ import annotations

import sys


def schema_command() -> None:
    """Print the run spec's JSON Schema, every key with its description, for editors:
    train schema > run.schema.json, then `# yaml-language-server: $schema=run.schema.json`
    as a line of the YAML."""
    from launcher.config.schema import schema_text

    sys.stdout.write(schema_text())
