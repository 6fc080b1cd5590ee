"""Checkpoint locations that are URLs: `s3://bucket/prefix`, and any other fsspec protocol
(`gs://`, `az://`, `file://`) whose package is installed.

A location is a `pathlib.Path` on this machine's file system, or a `upath.UPath` (universal
pathlib, fsspec's own path type) for a URL: the same `/`, `.name`, `.exists()` and `.open()`,
so the readers of checkpoints take either. Credentials never travel with a location: they come
from the environment and the usual chains of each store (for S3: `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`, profiles), so no file a run writes can hold one.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from launcher.errors import UsageError

# `scheme://`: what tells a URL from a path (a path may hold a colon, never `://` after a name).
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")

# storage_options keys that hold a secret, and where each store takes it from instead.
SECRET_OPTIONS = {
    "key": "AWS_ACCESS_KEY_ID",
    "secret": "AWS_SECRET_ACCESS_KEY",
    "token": "AWS_SESSION_TOKEN (or the store's own credential variable)",
    "session_token": "AWS_SESSION_TOKEN",
    "aws_access_key_id": "AWS_ACCESS_KEY_ID",
    "aws_secret_access_key": "AWS_SECRET_ACCESS_KEY",
    "aws_session_token": "AWS_SESSION_TOKEN",
    "password": "the store's own credential variable",
    "account_key": "AZURE_STORAGE_KEY",
    "sas_token": "AZURE_STORAGE_SAS_TOKEN",
    "connection_string": "AZURE_STORAGE_CONNECTION_STRING",
    "client_secret": "AZURE_CLIENT_SECRET",
    "credentials": "GOOGLE_APPLICATION_CREDENTIALS (a file's path)",
}

# The install that brings each protocol's file system.
_PACKAGES = {"s3": "launcher[s3]", "s3a": "launcher[s3]", "gs": "gcsfs", "gcs": "gcsfs"}
_PACKAGES |= {"az": "adlfs", "abfs": "adlfs", "abfss": "adlfs"}


def is_url(text: str | Path) -> bool:
    return isinstance(text, str) and bool(_URL.match(text))


def is_remote(location: Any) -> bool:
    """Whether a checkpoint location is a URL (a UPath), not a local path."""
    return location is not None and not isinstance(location, Path)


def location(text: str | Path, options: dict[str, Any] | None = None, what: str = "") -> Any:
    """The location `text` names: a Path, or for a URL a UPath that reads with `options`
    (fsspec's storage_options) and never caches a listing (other ranks and nodes write
    beside this one). `what` names the key or flag that gave it, for the errors."""
    if not is_url(text):
        return Path(text)
    try:
        from upath import UPath
    except ImportError:  # pragma: no cover - universal_pathlib is a dependency
        raise UsageError(f"{what} {text}: URLs need universal_pathlib") from None
    protocol = str(text).split("://", 1)[0]
    try:
        return UPath(str(text).rstrip("/"), **(options or {}), use_listings_cache=False)
    except (ImportError, ValueError) as exc:
        package = _PACKAGES.get(protocol, f"the fsspec package for {protocol}://")
        raise UsageError(
            f"{what} {text}: no file system for {protocol}:// here ({exc})".lstrip(),
            hint=f"Install {package}.",
        ) from None


def storage_options(path: Any) -> dict[str, Any]:
    """The storage_options a UPath reads with, less the listing-cache switch: what DCP's
    fsspec reader and writer are given."""
    options = dict(getattr(path, "storage_options", {}) or {})
    options.pop("use_listings_cache", None)
    return options


def secret_options(options: dict[str, Any]) -> dict[str, str]:
    """The keys of `options` that hold a secret, each with the variable to use instead."""
    return {k: SECRET_OPTIONS[k.lower()] for k in options if k.lower() in SECRET_OPTIONS}
