"""torchft's Manager, made to the run's rules (`launcher.replicas.torchft_engine`): its server
listens on the run's one address, every quorum is checked for strangers before torchft acts
on it, and what a healing group receives travels through the run's own state server
(`launcher.replicas.peer_state`).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
from torchft import Manager
from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

from launcher.config.fault_tolerance import FaultToleranceSection
from launcher.replicas.peer_state import PeerStateServer
from launcher.rundir.worker_plan import ReplicaGroup


def make_manager(
    group: ReplicaGroup,
    options: FaultToleranceSection,
    device: torch.device,
    rank: int,  # in the group
    world_size: int,  # the group's processes
) -> Manager:
    """This process's Manager in `group`, joined to the Lighthouse (no quorum yet)."""
    quiet_torchft()
    timeout = timedelta(seconds=options.timeout_s)
    on_gpu = device.type == "cuda"
    pg = ProcessGroupNCCL(timeout=timeout) if on_gpu else ProcessGroupGloo(timeout=timeout)
    state_server = PeerStateServer(group.listen, group.host, group.token, timeout)
    with _manager_server_on(group.listen):
        manager = Manager(
            pg=pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=options.min_replicas,
            # The quorum before the step's forward: a healing group starts the step healed,
            # on the data of that step, and trains in it.
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=rank,
            world_size=world_size,
            lighthouse_addr=group.lighthouse,
            replica_id=group.member_name(group.index),
            hostname=group.host,
            checkpoint_transport=state_server,
            # The groups build their weights alike from the run's seed: nothing to copy at
            # step 0.
            init_sync=False,
        )
    # Every quorum is checked before torchft acts on it (reconfigures its collectives or
    # heals from a member): a stranger in it stops the run instead. torchft has no hook for
    # it: its client is wrapped where the Manager keeps it.
    vars(manager)["_client"] = _QuorumCheck(manager._client, group)
    return manager


def quiet_torchft() -> None:
    """torchft's own lines (a traceback per failed collective, a warning per quorum on CPU)
    repeat what the launcher says in one line."""
    logging.getLogger("torchft").setLevel(logging.CRITICAL)
    # Received state is read from a bytes buffer: torch warns it is not writable; it is copied.
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


class StrangerInQuorum(Exception):
    def __init__(self, replica_id: str) -> None:
        super().__init__(replica_id)
        self.replica_id = replica_id


class _QuorumCheck:
    """torchft's client of the group's Manager, whose quorums are checked as they come: the
    Lighthouse takes any member that asks (it has no authentication), and torchft would
    reach a stranger's store and copy a stranger's state."""

    def __init__(self, client: Any, group: ReplicaGroup) -> None:
        self._client, self._group = client, group

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        stranger = self._group.stranger(list(quorum.replica_ids))
        if stranger is not None:
            raise StrangerInQuorum(stranger)
        return quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


@contextlib.contextmanager
def _manager_server_on(listen: str) -> Iterator[None]:
    """torchft's Manager, made meanwhile, serves on `listen` alone: torchft 0.2 binds its
    server to every interface (`[::]`) and has no setting for it, so the class it builds the
    server with is swapped, in its module, for one that binds `listen`."""
    import torchft.manager as torchft_manager

    original = torchft_manager.ManagerServer

    def bound(**options: Any) -> Any:
        port = str(options["bind"]).rsplit(":", 1)[1]
        host = f"[{listen}]" if ":" in listen else listen
        return original(**{**options, "bind": f"{host}:{port}"})

    vars(torchft_manager)["ManagerServer"] = bound
    try:
        yield
    finally:
        vars(torchft_manager)["ManagerServer"] = original
