"""Which host of a TPU pod this is. A pod runs the same `train` on every host, and torch_xla
finds the others itself; the launcher only needs the host's index, to name the logs its
processes write and to follow them. It reads it where torch_xla does, without importing it:
`CLOUD_TPU_TASK_ID` or `TPU_WORKER_ID`, else the TPU VM's metadata server."""

from __future__ import annotations

import contextlib
import urllib.request
from collections.abc import Mapping

import yaml

from launcher.plain_number import plain_number

_METADATA = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/tpu-env"


def host_index(env: Mapping[str, str], ask_metadata: bool = True) -> int:
    """This host's index in its TPU slice: 0 on a single host."""
    for key in ("CLOUD_TPU_TASK_ID", "TPU_WORKER_ID"):
        if (index := plain_number(env.get(key, ""), digits=6)) is not None:
            return index
    if ask_metadata and not env.get("TPU_SKIP_MDS_QUERY"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
            request = urllib.request.Request(_METADATA, headers={"Metadata-Flavor": "Google"})
            with urllib.request.urlopen(request, timeout=2) as reply:
                return int(yaml.safe_load(reply.read().decode())["WORKER_ID"])
    return 0
