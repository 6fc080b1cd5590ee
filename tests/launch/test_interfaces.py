"""Where a run's servers listen (`launcher.launch.interfaces`), decided once in the plan: the
replica groups' address, the interface gloo and NCCL are told, the groups' shared secret, and
how the groups tell the run's members from a stranger."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from launcher.clusters.nodes import Nodes
from launcher.config.spec import RunSpec
from launcher.errors import UsageError
from launcher.launch.interfaces import address_towards, interface_of, socket_interface_env
from launcher.launch.plan import make_plan
from launcher.launch.run_folder import prepare_run_dir
from launcher.rundir.layout import RunLayout
from launcher.rundir.worker_plan import ReplicaGroup
from tests.conftest import free_port

pytest.importorskip("torchft")


def _spec(tmp_path: Path, restarts: int = 2, **ft: object) -> RunSpec:
    return RunSpec.model_validate(
        {
            "run": {"name": "exp", "output_dir": str(tmp_path / "runs")},
            "launch": {"accelerator": "cpu", "devices": 2, "max_restarts": restarts},
            "recipe": {"source": "r.py"},
            "train": {"max_steps": 1},
            "fault_tolerance": {"enabled": True, "replica_groups": 2, **ft},
        }
    )


def test_the_address_towards_a_host_of_this_machine_is_that_host() -> None:
    assert address_towards("127.0.0.1") == "127.0.0.1"
    with pytest.raises(UsageError, match="--rdzv-endpoint: cannot find the address of"):
        address_towards("no-such-host.invalid")


def test_loopbacks_interface_is_named_for_gloo_and_nccl() -> None:
    name = interface_of("127.0.0.1")
    assert name is not None
    assert socket_interface_env("127.0.0.1", nccl=True) == {
        "GLOO_SOCKET_IFNAME": name,
        "NCCL_SOCKET_IFNAME": name,
    }
    assert socket_interface_env("192.0.2.254", nccl=False) == {}  # no interface holds it


def test_a_run_of_one_machine_listens_on_loopback_with_a_secret_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    plans = [make_plan(_spec(tmp_path)) for _ in range(2)]
    assert plans[0].listen == plans[0].group_host == "127.0.0.1"
    assert plans[0].worker_env()["GLOO_SOCKET_IFNAME"] == interface_of("127.0.0.1")
    tokens = {plan.replica_token for plan in plans}
    assert len(tokens) == 2 and all(len(token) == 32 for token in tokens)  # one per run
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # the user's own choice stays
    assert plans[0].worker_env()["GLOO_SOCKET_IFNAME"] == "eth7"
    # The worker plan holds the secret: readable by the run's user alone.
    prepare_run_dir(plans[0])
    written = RunLayout.worker_plan(plans[0].node_dir)
    assert stat.S_IMODE(os.stat(written).st_mode) == 0o600


def test_the_nodes_of_a_run_share_its_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LAUNCHER_FT_SECRET", raising=False)
    spec = _spec(tmp_path, lighthouse_port=free_port())
    endpoint = f"127.0.0.1:{free_port()}"

    def token(rank: int) -> str:
        nodes = Nodes(min=2, max=2, node_rank=rank, endpoint=endpoint, job_id="job7")
        plan = make_plan(spec, nodes=nodes)
        assert plan.listen == "127.0.0.1"  # every node on this machine: loopback
        return plan.replica_token

    assert token(0) == token(1)
    monkeypatch.setenv("LAUNCHER_FT_SECRET", "set-on-every-node")
    assert token(0) == token(1) == "set-on-every-node"


def test_a_run_without_restarts_is_warned_that_it_only_shrinks(tmp_path: Path) -> None:
    warned = make_plan(_spec(tmp_path, restarts=0)).notes
    assert any(
        "launch.max_restarts 0: a lost replica group is never restarted" in n for n in warned
    )
    assert not make_plan(_spec(tmp_path, restarts=1)).notes


def test_a_groups_ranks_devices_and_worker_plan_come_from_one_place(tmp_path: Path) -> None:
    """Node 1 of 2, two groups of 2 processes each: groups 2 and 3 of 4, ranks 4-5 and 6-7,
    on this machine's devices 0-1 and 2-3; the worker plan numbers their logs from there."""
    spec = _spec(tmp_path, lighthouse_port=free_port())
    spec = spec.model_copy(update={"launch": spec.launch.model_copy(update={"devices": 4})})
    nodes = Nodes(min=2, max=2, node_rank=1, endpoint=f"127.0.0.1:{free_port()}", job_id="j")
    plan = make_plan(spec, nodes=nodes)
    groups = [plan.replica_group(local, "http://127.0.0.1:1") for local in range(2)]
    assert [(g.index, g.count, g.local_index) for g in groups] == [(2, 4, 0), (3, 4, 1)]
    assert [list(g.ranks) for g in groups] == [[4, 5], [6, 7]]
    assert [g.first_device for g in groups] == [0, 2]
    assert groups[1].global_rank(1) == 7
    assert plan.worker_plan(groups[1]).rank_offset == 6
    assert groups[0].events == str(plan.layout.fault_events.absolute())


def test_the_groups_tell_their_own_members_from_a_stranger() -> None:
    token = "0f3c9a5e7d2b4c6a8e1f0d3b5a7c9e2f"
    group = ReplicaGroup(index=0, count=2, lighthouse="http://127.0.0.1:1", host="h", token=token)
    ours = [f"{group.member_name(0)}:uuid-a", f"{group.member_name(1)}:uuid-b"]
    assert group.stranger(ours) is None
    assert group.member_name(1).endswith("_group_1")  # torchft reads the trailing digits
    assert token[:8] not in group.member_name(1)  # the Lighthouse's page shows names
    other_run = ReplicaGroup(index=0, count=2, lighthouse="", host="h", token="u")
    impostor = f"{other_run.member_name(1)}:uuid-c"
    assert group.stranger([ours[0], impostor]) == impostor
    assert (
        group.stranger([*ours, f"{group.member_name(1)}:uuid-d"])
        == f"{group.member_name(1)}:uuid-d"
    )
    assert group.stranger([ours[0], f"{group.member_name(2)}:x"]) == f"{group.member_name(2)}:x"
    assert group.stranger(["launcher_group_7:evil"]) == "launcher_group_7:evil"


def _an_address_of_this_machine_not_loopback() -> str | None:
    import ipaddress

    import psutil

    for addresses in psutil.net_if_addrs().values():
        for entry in addresses:
            try:
                address = ipaddress.ip_address(entry.address.split("%")[0])
            except ValueError:
                continue
            if address.version == 4 and not address.is_loopback:
                return str(address)
    return None


def test_across_machines_the_groups_listen_on_the_rendezvous_networks_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 0 of a run whose rendezvous host is this machine's other address: the groups'
    servers, the Lighthouse's port check and gloo take that address, never every interface."""
    address = _an_address_of_this_machine_not_loopback()
    if address is None:
        pytest.skip("this machine has no address but loopback")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    nodes = Nodes(min=2, max=2, node_rank=0, endpoint=f"{address}:29500", job_id="job7")
    plan = make_plan(_spec(tmp_path, lighthouse_port=free_port()), nodes=nodes)
    assert plan.listen == plan.group_host == address
    env = plan.worker_env()
    assert env["GLOO_SOCKET_IFNAME"] == interface_of(address)
    assert "NCCL_SOCKET_IFNAME" not in env  # across machines NCCL picks its own network
    no_groups = _spec(tmp_path).model_copy(
        update={
            "fault_tolerance": _spec(tmp_path).fault_tolerance.model_copy(update={"enabled": False})
        }
    )
    assert make_plan(no_groups, nodes=nodes).listen == ""  # torch's own choices, as before
