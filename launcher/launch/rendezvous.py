"""The rendezvous: torch.distributed.elastic's c10d rendezvous, registered with three changes.

1. One node listens on loopback only. torch's c10d rendezvous binds its TCP stores (its own,
   and the one the workers bootstrap from) on every interface, even when the endpoint says
   127.0.0.1: on a shared machine anyone on the network could reach them. For one node both
   stores are created on sockets bound to 127.0.0.1 (TCPStore's `master_listen_fd`).
2. Every round gets a fresh worker store: a restarted group must not read the addresses that
   its dead predecessors left in the old one (gloo then connects to a closed port).
3. Several nodes with a fixed count take their group rank from `--node-rank`, so node K
   always runs global ranks K*nproc...: c10d alone orders nodes by host name and pid. After
   each round the nodes check through the rendezvous store that their node ranks are
   distinct and that each runs as many processes, and say which node is wrong if not.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

NAME = "launcher"
LOOPBACK = "127.0.0.1"


class NodeMismatch(RuntimeError):
    """The nodes that joined do not make one run (same node rank twice, unequal sizes)."""


@dataclass(frozen=True)
class Round:
    """What this node learned from one rendezvous round."""

    group_rank: int  # this node's rank among the nodes
    nodes: int  # nodes in this round


@dataclass(frozen=True)
class NodeConfig:
    """This node's part in the rendezvous, passed through LaunchConfig.rdzv_configs."""

    nproc: int  # worker processes on this node: every node must run as many
    spec_digest: str = ""  # of the resolved spec: every node must train the same run
    node_rank: int | None = None  # group rank to take (a fixed node count), or c10d's order
    loopback: bool = True  # a single node: stores of its own, on `listen` (127.0.0.1) only
    listen: str = LOOPBACK  # a replica group of a run of several machines: its network's address
    on_round: Callable[[Round], None] | None = None  # told before the workers start

    def rdzv_configs(self) -> dict[str, Any]:
        configs: dict[str, Any] = {"launcher_node": self}
        if not self.loopback and self.node_rank is not None:
            # Node 0 hosts the rendezvous store; without this every node whose address
            # matches the endpoint (all of them, on one test machine) would try to.
            configs["is_host"] = self.node_rank == 0
        return configs


def loopback_store(timeout_s: float = 60, listen: str = LOOPBACK) -> Any:
    """A TCPStore server that accepts connections from this machine only (`listen`: another
    address of this machine, the rendezvous network's, from that network), on a free port."""
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in listen else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((listen, 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    return dist.TCPStore(
        listen,
        port,
        is_master=True,
        multi_tenant=True,
        master_listen_fd=sock.detach(),  # the store owns the socket from here
        timeout=timedelta(seconds=timeout_s),
    )


def _create_handler(params: Any) -> Any:
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    node: NodeConfig = params.config.pop("launcher_node", None) or NodeConfig(nproc=1)

    class Backend(c10d_rendezvous_backend.C10dRendezvousBackend):
        @property
        def name(self) -> str:  # the registry checks that the handler is the one it asked for
            return NAME

    if node.loopback:
        store = loopback_store(params.get_as_int("read_timeout", 60), node.listen)
    else:
        _, store = c10d_rendezvous_backend.create_backend(params)
    handler = create_handler(store, Backend(store, params.run_id), params)
    if node.loopback:
        # The store the workers bootstrap from (MASTER_ADDR:MASTER_PORT) is made by this.
        handler._create_tcp_store_server = lambda addr, port: loopback_store(listen=node.listen)
    join = handler.next_rendezvous

    def next_round() -> Any:
        handler._bootstrap_store_info = None
        handler._shared_tcp_store_server = None
        info = join()
        group_rank = _check_nodes(info, node)
        if group_rank != info.rank:
            info = type(info)(info.store, group_rank, info.world_size, info.bootstrap_store_info)
        if node.on_round is not None:
            node.on_round(Round(group_rank, info.world_size))
        return info

    handler.next_rendezvous = next_round
    return handler


class _Peer(NamedTuple):
    """One node's record in a round: what the nodes compare."""

    rank: str  # its --node-rank, or "None"
    nproc: str
    digest: str
    host: str

    @property
    def label(self) -> str:
        return self.host if self.rank == "None" else f"{self.host} (node {self.rank})"


def _check_nodes(info: Any, node: NodeConfig) -> int:
    """This node's group rank, after checking with every other node of the round."""
    if info.world_size == 1:
        return 0
    store, me = info.store, info.rank
    # The store is this round's own (prefixed by the round), so keys never go stale.
    record = f"{node.node_rank} {node.nproc} {node.spec_digest or '-'} {socket.gethostname()}"
    store.set(f"launcher/node/{me}", record)
    peers = [
        _Peer(*store.get(f"launcher/node/{r}").decode().split(" ", 3))
        for r in range(info.world_size)
    ]
    if len({p.nproc for p in peers}) > 1:
        listing = ", ".join(f"{p.label}: {p.nproc}" for p in peers)
        raise NodeMismatch(
            f"the nodes run different numbers of processes ({listing}); every node must run "
            "the same --devices"
        )
    if len({p.digest for p in peers}) > 1:
        listing = ", ".join(f"{p.label}: {p.digest}" for p in peers)
        raise NodeMismatch(
            f"the nodes were given different specs (digests {listing}); start every node with "
            "the same config, overrides and flags"
        )
    if len({p.rank == "None" for p in peers}) > 1:
        raise NodeMismatch("some nodes gave --node-rank and some did not; give all or none")
    if node.node_rank is None:
        return me
    taken: dict[str, str] = {}
    for p in peers:
        if p.rank in taken:
            raise NodeMismatch(
                f"--node-rank {p.rank}: taken by both {taken[p.rank]} and {p.host}; give each "
                f"node its own, 0 to {info.world_size - 1}"
            )
        taken[p.rank] = p.host
    return node.node_rank


def register() -> str:
    """Makes the rendezvous available to LaunchConfig(rdzv_backend=NAME); returns NAME."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    with contextlib.suppress(ValueError):  # registered already, by an earlier run here
        rendezvous_handler_registry.register(NAME, _create_handler)
    return NAME
