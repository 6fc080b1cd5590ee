"""The bucket a checkpoint store writes under, which the launcher never creates.

A store's first level is its bucket: an S3 or GCS bucket, an Azure container, or for `file://`
the top folder of the path (`/mnt` of `file:///mnt/shared/ckpt`). Folders below it are made
where a store has them (`file://`, a mount); the bucket itself never is. s3fs's, gcsfs's and
adlfs's `makedirs` create a missing bucket: a bucket deleted while a run saves into it would
come back new, with the store's default region, encryption and policies, created by a training
job, and the run would go on as if nothing had been lost. So every folder a store makes goes
through `make_folder`, and a save that fails asks `bucket_is_gone` before it says why.
"""

from __future__ import annotations

import contextlib
import posixpath
from typing import Any


def make_folder(fs: Any, folder: str) -> None:
    """Makes `folder` on the fsspec file system `fs`, and its missing parents, one level at a
    time (`create_parents=False`, which no store takes as leave to create a bucket), never the
    bucket. A missing bucket is FileNotFoundError naming it. On a store without folders (S3)
    this is one check that the bucket is there."""
    path = fs._strip_protocol(folder).rstrip("/")
    if _is_bucket(path):
        if not fs.exists(path):
            raise FileNotFoundError(f"no such bucket: {path} (a checkpoint store never makes one)")
        return
    try:
        fs.mkdir(path, create_parents=False)
    except FileExistsError:
        return
    except FileNotFoundError:  # its parent is missing (a folder), or the bucket is
        make_folder(fs, posixpath.dirname(path))
        with contextlib.suppress(FileExistsError):  # another rank made it meanwhile
            fs.mkdir(path, create_parents=False)


def bucket_of(root: Any) -> str:
    """The bucket of a store's location (a UPath), as its file system names it."""
    path = root.fs._strip_protocol(root.path).strip("/")
    return root.fs.root_marker + path.split("/")[0]


def bucket_is_gone(root: Any) -> bool:
    """Whether the bucket of `root` no longer exists; False where the store cannot tell (it
    does not answer, or these credentials may not look)."""
    try:
        return not root.fs.exists(bucket_of(root))
    except Exception:  # each store's client raises its own types
        return False


def _is_bucket(path: str) -> bool:
    return "/" not in path.strip("/")
