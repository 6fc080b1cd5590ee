"""torchft's Lighthouse, which forms each step's quorum of replica groups
(`fault_tolerance.lighthouse: auto`): a process of its own beside the launcher, so that its
loss is a fault the launcher sees and reports, like a worker's.

`python -m launcher.launch.lighthouse --bind ADDR ...` prints the address it listens at, then
serves until its parent (the launcher) ends.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from launcher.config.fault_tolerance import FaultToleranceSection
from launcher.errors import RunError


class Lighthouse:
    """The running Lighthouse process, and the address the groups reach it at."""

    def __init__(self, process: subprocess.Popen[str], address: str) -> None:
        self.process, self.address = process, address

    def alive(self) -> bool:
        return self.process.poll() is None

    def describe_end(self) -> str:
        code = self.process.poll()
        if code is not None and code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"


@contextlib.contextmanager
def started(options: FaultToleranceSection, bind: str, log: Path) -> Iterator[Lighthouse]:
    """A Lighthouse listening at `bind` (`127.0.0.1:0`: loopback, a free port) for the run's
    lifetime, its own output in `log`."""
    argv = [
        sys.executable, "-m", __name__, "--bind", bind,
        "--min-replicas", str(options.min_replicas),
        "--heartbeat-timeout-ms", str(options.heartbeat_timeout_ms),
    ]  # fmt: skip
    log.parent.mkdir(parents=True, exist_ok=True)
    # Its address on stdout, then nothing there; its own lines (torchft's Rust side) in `log`.
    # RUST_LOG: torchft logs every quorum at INFO.
    env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
    with open(log, "ab") as errors:
        process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=errors, text=True, start_new_session=True, env=env
        )
    try:
        assert process.stdout is not None
        address = process.stdout.readline().strip()
        if not address:
            raise RunError(
                f"fault_tolerance: the Lighthouse did not start at {bind} (exit code "
                f"{process.wait()}); is the port taken?",
                hint="Set fault_tolerance.lighthouse_port, or see the error above.",
            )
        yield Lighthouse(process, address)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="launcher.launch.lighthouse")
    parser.add_argument("--bind", required=True)
    parser.add_argument("--min-replicas", type=int, required=True)
    parser.add_argument("--heartbeat-timeout-ms", type=int, required=True)
    args = parser.parse_args(argv)
    from torchft.coordination import LighthouseServer

    parent = os.getppid()
    server = LighthouseServer(
        bind=args.bind,
        min_replicas=args.min_replicas,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    address = server.address()
    if args.bind.startswith("127.0.0.1:"):  # it names the machine; the groups use loopback
        address = "http://127.0.0.1:" + address.rsplit(":", 1)[1]
    print(address, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while os.getppid() == parent:  # the launcher gone, even killed, so is its Lighthouse
        time.sleep(0.5)


if __name__ == "__main__":
    main()
