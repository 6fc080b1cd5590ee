"""A checkpoint store (`checkpoint.dir`) tried before anything starts: written to and read
back, so that a missing bucket, missing credentials or an unreachable endpoint is one line
naming the URL (exit 2), not a failure at the first save, steps of work later. Whether it
holds checkpoints already is the launch's one listing of it (`catalog.Listings`)."""

from __future__ import annotations

import secrets

from launcher.checkpoint.store import Store
from launcher.checkpoint.store_errors import unusable


def check_reachable(store: Store) -> None:
    """A probe file written under the store's root, read back and removed; UsageError naming
    the store where that fails."""
    probe = store.root / f".launcher-probe-{secrets.token_hex(6)}"
    try:
        probe.write_bytes(b"probe")
        if probe.read_bytes() != b"probe":
            raise OSError("a probe file written there read back otherwise")
        probe.unlink()
    except Exception as exc:  # each store and its client library raise their own types
        raise unusable(store.root, exc) from None
