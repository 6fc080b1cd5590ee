"""The newest checkpoint of each run whose checkpoints are in a store (`checkpoint.dir:
s3://...`, recorded in its run folder), for `train runs`: the stores are asked at once, in
threads, for as long as they answer: the listing gives up on the rest after `STORE_WAIT_S`
without an answer, or `STORE_WAIT_MAX_S` in all. So stores that hang cost it seconds, never
minutes, however many runs they hold, while a slow store of many runs is still listed whole.
A store that cannot be listed leaves its runs' newest checkpoint unknown, with the reason,
which `train runs` prints under its table and in `--json`.
"""

from __future__ import annotations

import queue
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.checkpoint.store import Store, store_of_run
from launcher.errors import LauncherError, UsageError
from launcher.storage_url import storage_options

STORE_WAIT_S = 5.0  # without any answer
STORE_WAIT_MAX_S = 30.0  # in all
_THREADS = 16  # stores asked at once
# S3's client tries a refused connection again for some ten seconds, and waits a minute for
# an endpoint that accepts and says nothing: a listing asks once and gives up sooner, so that
# a refused connection is told by its own reason within STORE_WAIT_S.
_QUICK_LISTING = {
    "s3": {
        "config_kwargs": {"connect_timeout": 2, "read_timeout": 10, "retries": {"max_attempts": 1}}
    }
}
_QUICK_LISTING["s3a"] = _QUICK_LISTING["s3"]  # s3fs too
# A request's query string in a client's message (the prefix listed, the encoding): noise,
# and different for every run of one store, whose lines `train runs` gathers by reason.
_QUERY = re.compile(r"\?[^\s\"')]*")


@dataclass(frozen=True)
class StoreAnswer:
    store: str  # the store's URL, where the run's checkpoints are
    newest: Any | None = None  # the newest complete checkpoint there
    problem: str | None = None  # why the store could not be listed; None: it was


def ask_stores(run_dirs: Iterable[Path]) -> dict[Path, StoreAnswer]:
    """The answer of its store for each run of `run_dirs` that keeps its checkpoints in one
    (the others are not in it). A store still silent when the listing gives up is left to
    its thread, which nobody waits for: `train runs` ends without it."""
    stores = {run: store for run in run_dirs if (store := _store_of(run)) is not None}
    asked: queue.SimpleQueue[tuple[Path, Store]] = queue.SimpleQueue()
    for item in stores.items():
        asked.put(item)
    answered: queue.SimpleQueue[tuple[Path, StoreAnswer]] = queue.SimpleQueue()

    def answer_some() -> None:
        while True:
            try:
                run, store = asked.get_nowait()
            except queue.Empty:
                return
            answered.put((run, _ask(store)))

    for _ in range(min(_THREADS, len(stores))):
        threading.Thread(target=answer_some, name="store-listing", daemon=True).start()
    answers: dict[Path, StoreAnswer] = {}
    end = time.monotonic() + STORE_WAIT_MAX_S
    while len(answers) < len(stores):
        wait = min(STORE_WAIT_S, end - time.monotonic())
        try:
            run, answer = answered.get(timeout=max(0.0, wait))
        except queue.Empty:
            break
        answers[run] = answer
    waited = STORE_WAIT_MAX_S if time.monotonic() >= end else STORE_WAIT_S
    silent = f"no answer within {waited:g} s"
    return {
        run: answers.get(run) or StoreAnswer(str(store.root), problem=silent)
        for run, store in stores.items()
    }


def _store_of(run_dir: Path) -> Store | None:
    """The run's store, set to answer quickly; None: its checkpoints are in its run folder,
    or its record of the store is damaged (its checkpoint is then unknown, as before)."""
    try:
        store = store_of_run(run_dir)
    except LauncherError:
        return None
    if not store.remote:
        return None
    quick = _QUICK_LISTING.get(getattr(store.root, "protocol", ""))
    if not quick:
        return store
    options = storage_options(store.root)
    for key, settings in quick.items():
        options[key] = {**(options.get(key) or {}), **settings}
    return store.with_options(options)


def _ask(store: Store) -> StoreAnswer:
    root = store.root
    try:
        return StoreAnswer(str(root), newest=store.latest())
    except UsageError as exc:  # the catalogue says why, after the store's URL
        reason = exc.message.partition(f"{root}: ")[2] or exc.message
        return StoreAnswer(str(root), problem=_QUERY.sub("", reason))
    except Exception as exc:  # a listing must never break the list of runs
        return StoreAnswer(str(root), problem=f"{type(exc).__name__}: {exc}")
