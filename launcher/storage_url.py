"""Checkpoint locations that are URLs: `s3://bucket/prefix`, and any other fsspec protocol
(`gs://`, `az://`, `file://`) whose package is installed; and the secrets they must not carry.

A location is a `pathlib.Path` on this machine's file system, or a `upath.UPath` (universal
pathlib, fsspec's own path type) for a URL: the same `/`, `.name`, `.exists()` and `.open()`,
so the readers of checkpoints take either. Credentials never travel with a location: they come
from the environment and the usual chains of each store (for S3: `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`, profiles), so no file a run writes can hold one.
A secret in `checkpoint.storage_options` (at any depth) or in a URL's user-info
(`s3://KEY:SECRET@bucket`) is refused, and no error line repeats it: `mask_urls` and
`mask_override` are what an error shows of a URL or an override instead.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from launcher.errors import UsageError

# `scheme://`: what tells a URL from a path (a path may hold a colon, never `://` after a name).
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# Tried only where a run of scheme characters starts: a long text is read once, not once a letter.
_SCHEME = re.compile(r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*://")
_SPACE = re.compile(r"\s")

# storage_options names that hold a secret, and where each store takes it from instead.
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
# Any other name holding one of these (lowercase, separators dropped: `SSECustomerKey` and
# `sse_customer_key` alike) names a secret too. `customerkey` is S3's SSE-C key, sent with every
# request (`SSECustomerAlgorithm` is not a secret); `token` only as a word of its own, since
# `tokenizer` and `max_tokens` name no credential.
_SECRET_PARTS = ("secret", "password", "passwd", "passphrase", "credential", "accesskey")
_SECRET_PARTS += ("privatekey", "apikey", "accountkey", "customerkey", "connectionstring")
_SECRET_PARTS += ("authorization",)
_TOKEN = re.compile(r"token(?!s|i[sz])")
_SECRET_NAMES = {re.sub(r"[^a-z0-9]", "", name) for name in SECRET_OPTIONS}
_GENERAL_HOME = "the store's own credential variable or credentials file (for S3: AWS_PROFILE)"
_SSE_C = "use SSE-KMS (ServerSideEncryption: aws:kms) or the bucket's default encryption, not SSE-C"

# fsspec's file systems that keep nothing a checkpoint needs: each process's memory (gone with
# it, and another process's is another), or a store that cannot be written.
_MEMORY = "fsspec.implementations.memory.MemoryFileSystem"
_READ_ONLY = {
    f"fsspec.implementations.{name}"
    for name in (
        "http.HTTPFileSystem",
        "zip.ZipFileSystem",
        "tar.TarFileSystem",
        "libarchive.LibArchiveFileSystem",
        "github.GithubFileSystem",
        "gist.GistFileSystem",
        "git.GitFileSystem",
        "reference.ReferenceFileSystem",
        "data.DataFileSystem",
    )
} | {"dvc.api.DVCFileSystem"}

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
    beside this one). `what` names the key or flag that gave it, for the errors; a URL with
    credentials in it is refused."""
    if not is_url(text):
        return Path(text)
    text = str(text)
    if problem := url_credentials_problem(text):
        raise UsageError(f"{what} {problem}".lstrip(), hint=_CREDENTIALS_HINT)
    try:
        from upath import UPath
    except ImportError:  # pragma: no cover - universal_pathlib is a dependency
        raise UsageError(f"{what} {mask_urls(text)}: URLs need universal_pathlib") from None
    protocol = text.split("://", 1)[0]
    try:
        return UPath(text.rstrip("/"), **(options or {}), use_listings_cache=False)
    except (ImportError, ValueError) as exc:
        package = _PACKAGES.get(protocol, f"the fsspec package for {protocol}://")
        raise UsageError(
            mask_urls(f"{what} {text}: no file system for {protocol}:// here ({exc})").lstrip(),
            hint=f"Install {package}.",
        ) from None


def storage_options(path: Any) -> dict[str, Any]:
    """The storage_options a UPath reads with, less the listing-cache switch: what DCP's
    fsspec reader and writer are given."""
    options = dict(getattr(path, "storage_options", {}) or {})
    options.pop("use_listings_cache", None)
    return options


def unkept_store_problem(url: str) -> str | None:
    """Why a store at `url` cannot keep a checkpoint, or None: fsspec's in-memory file system
    (or one of its subclasses) dies with each process, and another process's is another, so a
    resume finds nothing; a read-only one cannot be written. Decided by the protocol's fsspec
    class, without importing a store's package."""
    from fsspec.implementations.memory import MemoryFileSystem
    from fsspec.registry import known_implementations, registry

    protocol = url.split("://", 1)[0].lower()
    imported = registry.get(protocol)  # a class already imported (or registered at run time)
    if imported is not None:
        name = f"{imported.__module__}.{imported.__qualname__}"
        memory = issubclass(imported, MemoryFileSystem)
    else:
        name = known_implementations.get(protocol, {}).get("class", "")
        memory = name == _MEMORY
    if memory:
        return (
            f"{protocol}:// keeps files in each process's memory, lost when it ends: a resume "
            "finds nothing"
        )
    if name in _READ_ONLY:
        return f"{protocol}:// is read-only: no checkpoint can be written there"
    return None


# --- secrets: which names and URLs hold one, and what an error shows instead


def names_a_secret(name: object) -> bool:
    """Whether a storage option (or any key) of this name holds a secret: a name of
    SECRET_OPTIONS, or one that holds a part of `_SECRET_PARTS`, or the word `token`."""
    glued = _glued(name)
    known = glued in _SECRET_NAMES
    return known or any(part in glued for part in _SECRET_PARTS) or bool(_TOKEN.search(glued))


def secret_home(name: object) -> str:
    """What to do instead of giving the secret `name` holds in the spec."""
    glued = _glued(name)
    for key, variable in SECRET_OPTIONS.items():
        if _glued(key) == glued:
            return f"set {variable} in the environment instead"
    if "customerkey" in glued:
        return _SSE_C
    return f"set {_GENERAL_HOME} instead"


def secrets_in(value: Any, prefix: str) -> list[tuple[str, str]]:
    """Where `value` (storage_options, at any depth of mappings and lists) holds a secret:
    (its dotted key under `prefix`, what is wrong and what to do instead), never the secret."""
    found = []
    if isinstance(value, dict):
        for key, inner in value.items():
            dotted = f"{prefix}.{_shown_name(key)}"
            if names_a_secret(key):
                found.append((dotted, f"holds a secret, {_NEVER}: {secret_home(key)}"))
            else:
                found += secrets_in(inner, dotted)
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            found += secrets_in(inner, f"{prefix}[{i}]")
    elif isinstance(value, str) and has_url_credentials(value):
        found.append((prefix, f"holds credentials in its URL ({mask_urls(value)}): {_IN_URL}"))
    return found


_NEVER = "which the spec never holds (the run saves it)"
_IN_URL = "give them through the environment or a credentials file, and the URL without them"
_CREDENTIALS_HINT = (
    "Credentials come from the environment (for S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
    "AWS_PROFILE) or the store's credentials file, never from a URL, which every log repeats."
)


def url_credentials_problem(url: str) -> str | None:
    """`url`, masked, and what is wrong with it where it carries credentials; else None."""
    if not has_url_credentials(url):
        return None
    return (
        f"{mask_urls(url)}: credentials in a URL are refused (logs and records would repeat them)"
    )


def has_url_credentials(url: str) -> bool:
    """Whether `url` carries credentials in its user-info: `user:password@`, or a `user@`
    that looks like a key rather than a name (Azure's `abfs://container@account` is a name)."""
    match = _SCHEME.match(url)
    info = _user_info(url[match.end() :]) if match else None
    return info is not None and (":" in info or _looks_like_key(info))


def mask_urls(text: str) -> str:
    """`text` with the user-info of every URL in it shown as `***` (`s3://***@bucket/x`).
    Each URL is read up to a space or the next URL, so a long text costs one pass."""
    schemes = list(_SCHEME.finditer(text))
    out, done = [], 0
    for i, match in enumerate(schemes):
        end = schemes[i + 1].start() if i + 1 < len(schemes) else len(text)
        space = _SPACE.search(text, match.end(), end)
        info = _user_info(text[match.end() : space.start() if space else end])
        if info is not None:
            out.append(text[done : match.end()] + "***")
            done = match.end() + len(info)
    return "".join(out) + text[done:]


def mask_override(text: str) -> str:
    """A `key=value` override as errors and spec.yaml's comments show it: its value as `***`
    where it sets storage options and its key, or a key inside its value, names a secret;
    else with its URLs' user-info masked. Read as text: an override YAML cannot read is shown
    in its error too. Only the storage options are a place for store secrets: a recipe's
    `pad_token` or `eos_token` is none, and is saved in spec.yaml as given anyway."""
    key, sep, value = text.partition("=")
    path = key.split(".")
    if _STORAGE_OPTIONS[: len(path)] == path[: len(_STORAGE_OPTIONS)]:
        # Keys as YAML writes them in a value (`{secret: x}`, `- token: x`), `s3://` apart.
        inner = _YAML_KEY.findall(value)
        if any(names_a_secret(name) for name in [*path[len(_STORAGE_OPTIONS) :], *inner]):
            return f"{_shown_name(key)}{sep}***"
    return mask_urls(text)


_STORAGE_OPTIONS = ["checkpoint", "storage_options"]
# A name followed by `:` (a URL's `s3://` apart), tried only where a name starts.
_YAML_KEY = re.compile(r"(?<![\w.-])([A-Za-z_][\w.-]*)[\"']?\s*:(?!//)")


def _user_info(rest: str) -> str | None:
    """The user-info of a URL whose text after `scheme://` is `rest`, or None. It ends at the
    last `@` before the host's end (a password may hold `@`). An `@` after a `/` is a path's
    (`s3://bucket/model@v2`), unless what comes before that `/` is `user:...`: AWS secret keys
    hold `/`."""
    at = rest.find("@")
    if at < 0:
        return None
    head = rest[: _path_start(rest, 0)]
    if len(head) < at and not _user_and_password(head):
        return None
    return rest[: rest.rfind("@", 0, _path_start(rest, at))]


def _user_and_password(head: str) -> bool:
    """Whether a URL's text up to its first `/` is `user:password`, not `host` or `host:port`."""
    return ":" in head and not head.startswith("[") and not re.fullmatch(r"[^:]*:\d*", head)


def _path_start(rest: str, start: int) -> int:
    """Where the path (or query, or fragment) after `start` begins; the end if nowhere."""
    ends = [i for i in (rest.find(c, start) for c in "/?#") if i >= 0]
    return min(ends, default=len(rest))


# AWS access key ids (AKIA... long-term, ASIA... temporary); other keys are long mixed-case or
# base64 text, unlike a bucket, container or user name.
_KEY_ID = re.compile(r"(AKIA|ASIA|ABIA|ACCA|AGPA|AIDA|AIPA|ANPA|ANVA|APKA|AROA)[A-Z0-9]{12,}")


def _looks_like_key(user: str) -> bool:
    if _KEY_ID.fullmatch(user) or any(c in user for c in "+/=%"):
        return True
    mixed = any(c.isupper() for c in user) and any(c.islower() for c in user)
    return len(user) >= 16 and mixed and any(c.isdigit() for c in user)


def _glued(name: object) -> str:
    return re.sub(r"[^a-z0-9]", "", str(name).lower())


def _shown_name(name: object) -> str:
    """A key as an error names it: up to anything that is not part of a name (a key such as
    `secret:x`, YAML's reading of `{secret:x}`, holds its value)."""
    text = str(name)
    shown = re.match(r"[\w.-]*", text).group(0)  # type: ignore[union-attr]
    return shown if shown == text else f"{shown}…"
