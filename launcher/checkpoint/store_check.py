"""A checkpoint store (`checkpoint.dir`) tried before anything starts: listed, and written to
and read back, so that a missing bucket, missing credentials or an unreachable endpoint is one
line naming the URL (exit 2), not a failure at the first save, steps of work later."""

from __future__ import annotations

import secrets
from typing import Any

from launcher.checkpoint.catalog import Catalog
from launcher.checkpoint.store_errors import unusable
from launcher.storage_url import is_remote


def reachable_newest(root: Any) -> Any | None:
    """The newest complete checkpoint under `root`, once a probe file was written there,
    read back and removed; UsageError naming `root` where that fails."""
    probe = root / f".launcher-probe-{secrets.token_hex(6)}"
    try:
        probe.write_bytes(b"probe")
        if probe.read_bytes() != b"probe":
            raise OSError("a probe file written there read back otherwise")
        probe.unlink()
    except Exception as exc:  # each store and its client library raise their own types
        raise unusable(root, exc) from None
    return Catalog(root).latest()


def readable(place: Any, what: str) -> Any:
    """`place` itself, once a store's is found listable: UsageError naming `what` (the flag
    or command) and the URL where not. A local path is taken as it is."""
    if not is_remote(place):
        return place
    try:
        place.exists()
    except Exception as exc:  # each store and its client library raise their own types
        raise unusable(place, exc, what) from None
    return place
