"""Which of this machine's addresses a run's servers listen on: loopback for a run of one
machine, which needs no other; across machines, the one address of the rendezvous network,
never every interface (`0.0.0.0`, `[::]`). Decided once, in the plan.

The libraries that pick an interface themselves (gloo and NCCL choose the host name's, which
is often the machine's public address) are told which by name (`GLOO_SOCKET_IFNAME`,
`NCCL_SOCKET_IFNAME`), so it is named here too.
"""

from __future__ import annotations

import ipaddress
import socket

from launcher.errors import UsageError


def address_towards(host: str) -> str:
    """This machine's address on the network that reaches `host` (the rendezvous host):
    `host` itself where it is one of this machine's addresses (node 0), else the source
    address the kernel routes to it from. A UDP `connect` sends nothing."""
    try:
        family, _, _, _, where = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)[0]
    except OSError as exc:
        raise UsageError(
            f"--rdzv-endpoint: cannot find the address of {host!r} ({exc.strerror or exc})",
            hint="Give node 0's host name or address as every node resolves it.",
        ) from None
    target = str(where[0])
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((target, 0))  # one of ours: the rendezvous host is this machine
            return target
        except OSError:
            pass
        probe.connect((target, 9))
        return str(probe.getsockname()[0])


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds `address` (`lo`, `eth0`); None where
    none does."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(entry.address.split("%")[0] == address for entry in addresses):
            return name
    return None


def socket_interface_env(address: str, nccl: bool) -> dict[str, str]:
    """The variables that tell gloo (and NCCL, where `nccl`) to listen on `address`'s
    interface alone; none where no interface holds it."""
    name = interface_of(address)
    if name is None:
        return {}
    return {"GLOO_SOCKET_IFNAME": name, **({"NCCL_SOCKET_IFNAME": name} if nccl else {})}


def host_port(address: str, port: int) -> str:
    """`address:port`, an IPv6 address in brackets."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
