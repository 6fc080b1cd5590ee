"""torchft's Lighthouse, which forms each step's quorum of replica groups
(`fault_tolerance.lighthouse: auto`): a process of its own beside the launcher, so that its
loss is a fault the launcher sees and reports, like a worker's.

`python -m launcher.replicas.lighthouse --bind ADDR ...` prints the address it listens at, then
serves until its parent (the launcher) ends.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from launcher.clusters.nodes import Nodes
from launcher.config.fault_tolerance import FaultToleranceSection
from launcher.errors import RunError, UsageError

PROBE_TIMEOUT_S = 5  # a Lighthouse answers its page at once


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


def check_before_launch(options: FaultToleranceSection, nodes: Nodes, listen: str) -> None:
    """Before the run folder exists: a given Lighthouse answers as one (each group would
    otherwise retry it for minutes), and the port of the Lighthouse this node starts is free.
    UsageError naming the key where not."""
    given = options.lighthouse_url(nodes.host if nodes.multi else None)
    if options.lighthouse != "auto":
        _check_answers(given or "", options.lighthouse)
    elif nodes.multi and nodes.node_rank == 0:
        _check_port_free(listen, options.lighthouse_port)


def _check_answers(url: str, given: str) -> None:
    """torchft's Lighthouse serves its dashboard on its gRPC port: a page that names it."""
    key = f"fault_tolerance.lighthouse {given}"
    try:
        with urllib.request.urlopen(f"{url}/", timeout=PROBE_TIMEOUT_S) as page:
            said = page.read(64 * 1024)
    except urllib.error.HTTPError as exc:
        said = f"HTTP {exc.code}".encode()
    except (OSError, ValueError) as exc:  # refused, unreachable, no such host, a timeout
        reason = getattr(exc, "reason", exc)
        raise UsageError(
            f"{key}: nothing answers there ({reason})",
            hint="Start the Lighthouse first (torchft_lighthouse), or set "
            "fault_tolerance.lighthouse: auto for the launcher to start one.",
        ) from None
    if b"torchft" not in said:
        raise UsageError(
            f"{key}: something answers there, but not a torchft Lighthouse",
            hint="Give the HOST:PORT that torchft_lighthouse printed as it started.",
        )


def _check_port_free(listen: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in listen else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((listen, port))
        except OSError as exc:
            raise UsageError(
                f"fault_tolerance.lighthouse_port {port}: taken on {listen} "
                f"({exc.strerror or exc}); node 0 starts the Lighthouse there",
                hint="Set fault_tolerance.lighthouse_port to a free port, the same on every node.",
            ) from None


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
    parser = argparse.ArgumentParser(prog="launcher.replicas.lighthouse")
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
