"""The run spec's JSON Schema, from the same pydantic models that validate it.

`train schema` prints it; configs/run.schema.json is a copy (a test keeps them equal), which
editors with a YAML language server read through the configs' first-lines modeline, to
complete keys and show each one's description.
"""

from __future__ import annotations

import json
from typing import Any

from launcher.config.spec import RunSpec

SCHEMA_ID = "https://json-schema.org/draft/2020-12/schema"


def spec_schema() -> dict[str, Any]:
    schema = RunSpec.model_json_schema(mode="validation")
    return {
        "$schema": SCHEMA_ID,
        "title": "launcher run spec",
        "description": "The YAML that `train --config` reads. Each key's description is "
        "the one in launcher/config/*.py; docs/config.md lists them all.",
        **{k: v for k, v in schema.items() if k not in ("title", "description")},
    }


def schema_text() -> str:
    return json.dumps(spec_schema(), indent=2, ensure_ascii=False) + "\n"
