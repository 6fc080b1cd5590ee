"""A node count, a node rank and a rendezvous port: one parser each, whether the value came
from a flag (`--nnodes`) or from a variable a cluster set (`PET_NNODES`, `SLURM_NODEID`), and
each error names where it came from, so the user is pointed at what they can find and fix.

`nodes.py` reads the flags, `kubernetes.py` and `slurm.py` the variables; these live apart
from `nodes.py` because it imports both of those.
"""

from __future__ import annotations

from launcher.config.yaml_file import echo
from launcher.errors import UsageError
from launcher.plain_number import plain_number


def shown(label: str, text: str) -> str:
    """A value as an error shows it: `--nnodes 3:2` as typed, `PET_NNODES='3:2'` quoted (a
    variable may hold anything, a blank or a newline included)."""
    return f"{label} {text}" if label.startswith("--") else f"{label}={echo(text)}"


def parse_node_count(
    text: str, label: str = "--nnodes", *, elastic: bool = True
) -> tuple[int, int]:
    """(MIN, MAX) of `N`, or of `MIN:MAX` where `elastic` (torchrun's --nnodes and PET_NNODES;
    a count of pods or of SLURM nodes is one number)."""
    low, sep, high = text.partition(":") if elastic else (text, "", "")
    least, most = plain_number(low), plain_number(high if sep else low)
    if least is None or most is None or not 1 <= least <= most:
        form = ", or MIN:MAX such as 2:4 for an elastic run" if elastic else ", 1 or more"
        raise UsageError(f"{shown(label, text)}: expected a node count such as 4{form}")
    return least, most


def parse_node_rank(text: str, nnodes: int, label: str = "--node-rank", count: str = "") -> int:
    """This node's rank, below `nnodes`. `count`: where the count came from, as an error shows
    it (`PET_NNODES=4`, `--nnodes 4`), wherever the rank and the count are not both flags."""
    rank = plain_number(text)
    if rank is None or rank >= nnodes:
        expected = (
            f"this node's rank: 0 or more and below {count}"
            if count
            else f"0 to {nnodes - 1}, this node's place among {nnodes} nodes (node 0 hosts the "
            "rendezvous)"
        )
        raise UsageError(f"{shown(label, text)}: expected {expected}")
    return rank


def port_number(text: str) -> int | None:
    """A TCP port, 1 to 65535, or None."""
    port = plain_number(text, digits=5)
    return port if port is not None and 0 < port < 65536 else None


def parse_port(text: str, label: str) -> int:
    """The rendezvous port a variable gives (`--rdzv-endpoint` is HOST:PORT: `nodes.py`)."""
    port = port_number(text)
    if port is None:
        raise UsageError(f"{shown(label, text)}: expected the rendezvous port, 1 to 65535")
    return port
