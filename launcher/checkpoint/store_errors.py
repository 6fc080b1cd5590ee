"""A store that cannot serve (`checkpoint.dir`, a URL given to `--resume` or `train export`),
said in one line naming its URL and what to do: each store's client library raises its own
types, which are told apart here by name, never imported."""

from __future__ import annotations

from typing import Any

from launcher.errors import UsageError
from launcher.safe_text import clean
from launcher.storage_url import mask_urls


def unusable(root: Any, exc: BaseException, what: str = "checkpoint.dir") -> UsageError:
    # Masked: a client library's own text may quote a URL whole, user-info and all.
    reason, hint = _diagnosis(exc)
    return UsageError(mask_urls(f"{what} {root}: {reason}"), hint=hint)


def _diagnosis(exc: BaseException) -> tuple[str, str]:
    text = clean(str(exc)).splitlines()[0] if str(exc) else type(exc).__name__
    names = {type(e).__name__ for e in _chain(exc)}
    if "NoCredentialsError" in names or "PartialCredentialsError" in names:
        return "no credentials found", (
            "Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the "
            "environment; the spec never holds them."
        )
    if "EndpointConnectionError" in names or "ConnectTimeoutError" in names:
        return f"the endpoint is unreachable ({text})", (
            "Check the endpoint (AWS_ENDPOINT_URL, or checkpoint.storage_options.endpoint_url) "
            "and the network."
        )
    if "NoSuchBucket" in text or (isinstance(exc, FileNotFoundError) and "bucket" in text.lower()):
        return "no such bucket", "Create the bucket, or fix its name in checkpoint.dir."
    if isinstance(exc, PermissionError) or "AccessDenied" in text or "Forbidden" in text:
        return f"access denied ({text})", "Use credentials that may write under this prefix."
    return f"cannot write there ({type(exc).__name__}: {text})", (
        "Check the URL, the credentials in the environment and checkpoint.storage_options."
    )


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen
