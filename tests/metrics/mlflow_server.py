"""A real MLflow tracking server on loopback, its store a SQLite file: for the trackers' tests
and bench/trackers_cost.py. Started as a team would (`mlflow server`), without MLflow's
background job workers, which nothing here uses. A test may kill it midway (`kill_server`), as
a server that crashed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import free_port


@contextlib.contextmanager
def mlflow_server(folder: Path, startup_timeout: float = 90) -> Iterator[str]:
    """Runs `mlflow server` with its store in `folder`; yields its URL; ends it, and whatever
    it started, on the way out."""
    with mlflow_server_process(folder, startup_timeout) as (url, _):
        yield url


def kill_server(server: subprocess.Popen) -> None:
    """SIGKILLs the server and whatever it started, as a crash would."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)
    server.wait()


@contextlib.contextmanager
def mlflow_server_process(
    folder: Path, startup_timeout: float = 90
) -> Iterator[tuple[str, subprocess.Popen]]:
    """As mlflow_server, yielding its process too (in a session of its own)."""
    port = free_port()
    command = [
        sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
        "--workers", "1", "--backend-store-uri", f"sqlite:///{folder}/mlflow.db",
        "--default-artifact-root", str(folder / "artifacts"),
    ]  # fmt: skip
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log_path = folder / "server.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_until_up(url, server, log_path, startup_timeout)
            yield url, server
        finally:
            with contextlib.suppress(ProcessLookupError):  # killed already
                os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                kill_server(server)


def _wait_until_up(url: str, server: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2).close()
            return
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start:\n{log.read_text()}") from None
            time.sleep(0.3)
