"""What a fault-tolerant run shows to others, tried as an outsider would: its listeners, its
replica groups' state servers, and its Lighthouse's quorum (torchft, gloo, loopback)."""

from __future__ import annotations

import contextlib
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest

from launcher.rundir import fault_events
from launcher.rundir.layout import RunLayout
from tests.conftest import finish_train, start_train, training_processes
from tests.replicas.test_fault_tolerance import _spec, _wait_for_checkpoint

pytest.importorskip("torchft")
pytestmark = pytest.mark.timeout(240)


def _run_tree(pid: int) -> list[psutil.Process]:
    return [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]


def _listening(pid: int) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every socket the run's processes listen on."""
    found = []
    for process in _run_tree(pid):
        try:
            sockets = process.net_connections(kind="inet")
        except psutil.Error:
            continue  # ended meanwhile
        found += [(process.pid, s.laddr.ip, s.laddr.port) for s in sockets if s.status == "LISTEN"]
    return found


def _lighthouse(pid: int) -> str:
    """The address the run's own Lighthouse listens at, found as an outsider finds it."""
    (light,) = [
        p for p in _run_tree(pid) if "launcher.replicas.lighthouse" in " ".join(p.cmdline())
    ]
    (address,) = [s.laddr for s in light.net_connections(kind="inet") if s.status == "LISTEN"]
    return f"http://{address.ip}:{address.port}"


def _managers(lighthouse: str) -> list[str]:
    """The groups' Managers, as the Lighthouse's status page lists them to anyone."""
    with urllib.request.urlopen(f"{lighthouse}/status", timeout=10) as page:
        return re.findall(r"Manager: (http://\S+?) <br", page.read().decode())


def _served_states(lighthouse: str, manager_client: Any) -> list[str]:
    """Where each group's Manager says its state is served, as it tells anyone who asks. A
    group that a loaded machine made miss a heartbeat restarts with a new Manager, and the
    Lighthouse lists the old one until it times out: the list is read again then."""
    deadline = time.monotonic() + 90
    while True:
        managers = _managers(lighthouse)
        try:
            assert len(managers) == 2, managers
            return [
                manager_client(manager, connect_timeout=timedelta(seconds=10))._checkpoint_metadata(
                    0, timeout=timedelta(seconds=10)
                )
                for manager in managers
            ]
        except (AssertionError, RuntimeError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def _groups_of(workers: list[psutil.Process]) -> list[str] | None:
    """The workers' replica groups, sorted; None where one ended while it was read (its
    group restarting)."""
    try:
        return sorted(p.environ().get("REPLICA_GROUP_ID", "-") for p in workers)
    except psutil.NoSuchProcess:
        return None


def test_a_run_listens_on_loopback_alone_and_serves_its_state_to_its_groups_alone(
    tmp_path: Path,
) -> None:
    from torchft._torchft import ManagerClient

    proc = start_train(["--config", str(_spec(tmp_path, "ddp", 2, steps=50_000))], tmp_path)
    try:
        _wait_for_checkpoint(tmp_path / "runs", proc)
        listening = _listening(proc.pid)
        # The launcher's stores, the Lighthouse, each group's store, Manager, state server
        # and gloo: none of them on another interface (0.0.0.0, [::], the machine's address).
        assert len(listening) >= 8, listening
        assert all(ip in ("127.0.0.1", "::1") for _, ip, _ in listening), listening
        # Tools read a worker's group where they read its environment: from its start. (A
        # group that a loaded machine made miss a heartbeat is away while it restarts.)
        deadline = time.monotonic() + 90
        while True:
            groups = _groups_of(training_processes(proc.pid))
            if groups == ["0", "1"] or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert groups == ["0", "1"], groups
        for served in _served_states(_lighthouse(proc.pid), ManagerClient):
            assert served.startswith("http://127.0.0.1:"), served
            for headers in ({}, {"X-Launcher-Run-Token": "guess"}):
                asked = time.monotonic()
                request = urllib.request.Request(f"{served}1", headers=headers)
                with pytest.raises(urllib.error.HTTPError) as refused:
                    urllib.request.urlopen(request, timeout=30)
                # Refused at once: a stranger does not wait for the next heal to be served.
                assert refused.value.code == 403 and time.monotonic() - asked < 20
    finally:
        proc.send_signal(signal.SIGINT)
        result = finish_train(proc, tmp_path, 120)
    assert result.returncode == 130, result.stdout + result.stderr  # Ctrl-C's, saved


def test_a_stranger_in_the_quorum_stops_the_run_naming_it(tmp_path: Path) -> None:
    from torchft._torchft import LighthouseClient

    heartbeat_s = 2.0
    spec = _spec(tmp_path, "ddp", 2, steps=50_000)
    spec.write_text(
        spec.read_text().replace("heartbeat_timeout_ms: 1000", "heartbeat_timeout_ms: 2000")
    )
    proc = start_train(["--config", str(spec)], tmp_path)
    run_dir = _wait_for_checkpoint(tmp_path / "runs", proc)
    client = LighthouseClient(_lighthouse(proc.pid), connect_timeout=timedelta(seconds=10))

    def join() -> None:  # a member that claims to be far ahead, with a store at nowhere
        with contextlib.suppress(Exception):  # the run stopped, and its Lighthouse with it
            client.quorum(
                replica_id="launcher_group_7:evil", timeout=timedelta(seconds=60),
                address="http://127.0.0.1:9", store_address="127.0.0.1:9", step=10**6,
                world_size=1, shrink_only=False,
            )  # fmt: skip

    joined = time.time()
    threading.Thread(target=join, daemon=True).start()
    result = finish_train(proc, tmp_path, 120)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "a replica that is not one of this run's groups ('launcher_group_7:evil')" in output
    assert "checkpoints are intact (newest: step-" in output and "Traceback" not in output
    events = fault_events.read(RunLayout(run_dir).fault_events)
    strangers = [e for e in events if e["event"] == "stranger"]
    assert strangers and strangers[0]["replica"] == "launcher_group_7:evil", events
    seen = strangers[0]
    # Seen at the first quorum that holds it: well within twice the heartbeat timeout.
    assert seen["time"] - joined < 2 * heartbeat_s, seen["time"] - joined
