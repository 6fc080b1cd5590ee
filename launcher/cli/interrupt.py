"""Ctrl-C in `train` outside a running run (whose signals `launcher.launch.supervise` takes):
"interrupted" and exit 130, never a traceback.

The entry point imports this module before anything else: importing the rest takes seconds on
a busy machine (torch), and a KeyboardInterrupt raised in there would print a traceback of
whatever was being imported. From then on SIGINT ends `train` at once and quietly; inside a
command (`unwinding`) it raises KeyboardInterrupt instead, so that what the command set up (a
run folder's lock, the reaper) is undone on the way out.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

from launcher.errors import INTERRUPTED


def _exit_quietly(signum: int, frame: object) -> None:
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(INTERRUPTED)


def unwinding(command: Callable[[], int]) -> int:
    """command(), where Ctrl-C raises KeyboardInterrupt; 130 if it did."""
    quiet = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return command()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED
    finally:
        signal.signal(signal.SIGINT, quiet)


signal.signal(signal.SIGINT, _exit_quietly)
