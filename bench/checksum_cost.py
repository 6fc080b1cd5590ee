"""What a checkpoint's checksums cost: a save with them against one without, and the check
before a resume, on a disk and on S3 (moto, on loopback).

    python bench/checksum_cost.py               # 512 MB of tensors, 3 saves each way
    python bench/checksum_cost.py --mb 64 --repeats 1 --store   # and to S3 on loopback

One process saves a state of `--mb` MB of float32 tensors with torch.distributed.checkpoint,
through DCP's own writer (no checksums) and through the launcher's (`launcher.checkpoint.
writers`: every file hashed as it is written), alternating, each into a fresh folder; then
times the check before a resume (`launcher.checkpoint.checksums.changed_file`): on a disk it
reads every byte (here from the page cache: the save just wrote them), on a store it is one
LIST when the ETags recorded at save still hold, and a full download when they do not (a
copied checkpoint). The launcher saves with checksums always; this measures what that costs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from s3_loopback import s3_on_loopback  # noqa: E402

from launcher.checkpoint.checksums import changed_file, marker_text  # noqa: E402
from launcher.checkpoint.store import store_at  # noqa: E402
from launcher.checkpoint.writers import local_writer, store_writer  # noqa: E402
from launcher.storage_url import location  # noqa: E402


def state_of(mb: int) -> dict[str, Any]:
    """About `mb` MB of float32 tensors, 16 of them, as a model's and optimizer's would be."""
    numel = mb * 2**20 // 4 // 16
    g = torch.Generator().manual_seed(0)
    return {"model": {f"w{i}": torch.randn(numel, generator=g) for i in range(16)}}


def save(state: dict[str, Any], writer: Any) -> float:
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process: DCP says torch.distributed is disabled
        dcp.save(state, storage_writer=writer)
    return time.perf_counter() - started


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def publish(store: Any, folder: Any, writer: Any) -> None:
    """The marker a publish writes (meta.json left out: a few hundred bytes)."""
    store.write_file(folder / "COMPLETE", marker_text(writer.files, writer.listed))


def disk(state: dict[str, Any], repeats: int, root: Path) -> dict[str, Any]:
    plain, hashed, checks = [], [], []
    store = store_at(root)  # a folder's: LocalStore
    for i in range(repeats):
        folder = root / f"plain-{i}"
        folder.mkdir()
        plain.append(save(state, dcp.FileSystemWriter(folder)))
        folder = root / f"hashed-{i}"
        folder.mkdir()
        rank_file = (folder / "rank-0.pt", b"rank state")
        writer = local_writer(folder).record(rank_file, store.write_file)
        hashed.append(save(state, writer))
        publish(store, folder, writer)
        checks.append(timed(lambda folder=folder: changed_file(folder)))
    return _summary(plain, hashed, checks, {})


def s3(state: dict[str, Any], repeats: int, url: str) -> dict[str, Any]:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    root = location(url)
    store = store_at(root)  # a URL's: ObjectStore
    plain, hashed, checks, downloads = [], [], [], []
    for i in range(repeats):
        plain.append(save(state, FsspecWriter(f"{url}/plain-{i}", sync_files=False)))
        folder = root / f"hashed-{i}"
        writer = store_writer(folder).record(
            (folder / "rank-0.pt", b"rank state"), store.write_file
        )
        hashed.append(save(state, writer))
        publish(store, folder, writer)
        checks.append(timed(lambda folder=folder: changed_file(folder)))
        # As a copy of it would be checked: no ETag vouches for a file, every byte is read.
        store.write_file(folder / "COMPLETE", marker_text(writer.files, {}))
        downloads.append(timed(lambda folder=folder: changed_file(folder)))
    return _summary(plain, hashed, checks, {"check_without_etags_s": downloads})


def _summary(plain: list[float], hashed: list[float], checks: list[float], more: dict) -> dict:
    median = statistics.median
    return {
        "save_s": median(plain),
        "save_with_checksums_s": median(hashed),
        "ratio": median(hashed) / median(plain),
        "check_s": median(checks),
        **{key: median(values) for key, values in more.items()},
        "runs": {"save_s": plain, "save_with_checksums_s": hashed, "check_s": checks, **more},
    }


def sha256_rate(mb: int = 256) -> float:
    """SHA-256 over `mb` MB in memory, in GB/s: what hashing alone costs on this machine."""
    data = os.urandom(mb * 2**20)
    started = time.perf_counter()
    hashlib.sha256(data).digest()
    return mb * 2**20 / 1e9 / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512, help="the state's size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--store", action="store_true", help="also to S3 on loopback (moto)")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/checksum_cost.json")
    args = parser.parse_args()
    state = state_of(args.mb)
    gb = sum(t.numel() * 4 for t in state["model"].values()) / 1e9
    results: dict[str, Any] = {"gb": gb, "sha256_gb_per_s": sha256_rate()}
    with tempfile.TemporaryDirectory() as tmp, s3_on_loopback(args.store) as env:
        results["disk"] = disk(state, args.repeats, Path(tmp))
        if env:
            os.environ.update(env)  # the store is read in this process
            results["s3"] = s3(state, args.repeats, "s3://bench/checksums")
    print(f"{gb:.2f} GB of tensors; SHA-256 alone: {results['sha256_gb_per_s']:.2f} GB/s\n")
    print("| where | save s | with checksums s | ratio | check before resume s | s per GB |")
    print("|---|---:|---:|---:|---:|---:|")
    for where in ("disk", "s3"):
        if where in results:
            r = results[where]
            print(
                f"| {where} | {r['save_s']:.2f} | {r['save_with_checksums_s']:.2f} "
                f"| x{r['ratio']:.2f} | {r['check_s']:.3f} | {r['check_s'] / gb:.3f} |"
            )
    if "s3" in results:
        print(f"\nS3, a copy (no ETag holds): the check reads it all, "
              f"{results['s3']['check_without_etags_s']:.2f} s")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
