"""A single-node rendezvous that listens on loopback only.

torch.distributed.elastic's c10d rendezvous binds its TCP stores (the rendezvous's own, and
the one it shares with the workers) on every interface, even when the endpoint says
127.0.0.1: on a shared machine anyone on the network could then reach them. This is that
same rendezvous, registered under a name of its own, with both stores created on sockets
bound to 127.0.0.1 (TCPStore's `master_listen_fd`).
"""

from __future__ import annotations

import contextlib
import socket
from datetime import timedelta
from typing import Any

NAME = "launcher-loopback"
LOOPBACK = "127.0.0.1"


def loopback_store(timeout_s: float = 60) -> Any:
    """A TCPStore server that accepts connections from this machine only, on a free port."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    return dist.TCPStore(
        LOOPBACK,
        port,
        is_master=True,
        multi_tenant=True,
        master_listen_fd=sock.detach(),  # the store owns the socket from here
        timeout=timedelta(seconds=timeout_s),
    )


def _create_handler(params: Any) -> Any:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    class LoopbackBackend(C10dRendezvousBackend):
        @property
        def name(self) -> str:  # the registry checks that the handler is the one it asked for
            return NAME

    store = loopback_store(params.get_as_int("read_timeout", 60))
    handler = create_handler(store, LoopbackBackend(store, params.run_id), params)
    # The store the workers bootstrap from (MASTER_ADDR:MASTER_PORT) is made by this method.
    handler._create_tcp_store_server = lambda addr, port: loopback_store()
    first_round = handler.next_rendezvous

    def next_round() -> Any:
        # A fresh worker store for every round: a restarted group must not read the
        # addresses that its dead predecessors left in the old one (gloo then connects to a
        # closed port and fails the restart).
        handler._bootstrap_store_info = None
        handler._shared_tcp_store_server = None
        return first_round()

    handler.next_rendezvous = next_round
    return handler


def register() -> str:
    """Makes the rendezvous available to LaunchConfig(rdzv_backend=NAME); returns NAME."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    with contextlib.suppress(ValueError):  # registered already, by an earlier run here
        rendezvous_handler_registry.register(NAME, _create_handler)
    return NAME
