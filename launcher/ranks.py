"""Rank sets as short text: ``0-3,5,7-8``.

Used for the ``--ranks`` flag and for prefixes of lines that several ranks printed.
"""

from collections.abc import Iterable

from launcher.plain_number import plain_number

_EXPECTED = "use a comma-separated list such as 0,2-3"


def format_ranks(ranks: Iterable[int]) -> str:
    """Format ranks as sorted, deduplicated runs: ``[7, 0, 1, 2, 3, 5, 8] -> "0-3,5,7-8"``."""
    ordered = sorted(set(ranks))
    runs: list[str] = []
    start = 0
    for i in range(1, len(ordered) + 1):
        if i == len(ordered) or ordered[i] != ordered[i - 1] + 1:
            first, last = ordered[start], ordered[i - 1]
            runs.append(str(first) if first == last else f"{first}-{last}")
            start = i
    return ",".join(runs)


def parse_ranks(text: str) -> frozenset[int]:
    """Parse ``"0,2-3"`` into ``{0, 2, 3}``; raise ValueError naming the bad part."""
    if not text.strip():
        raise ValueError(f"--ranks: expected at least one rank; {_EXPECTED}")
    ranks: set[int] = set()
    for part in text.split(","):
        ranks.update(_parse_part(part.strip()))
    return frozenset(ranks)


def _parse_part(part: str) -> range:
    first, dash, last = part.partition("-")
    if not dash:
        rank = _parse_rank(part, part)
        return range(rank, rank + 1)
    lo, hi = _parse_rank(first, part), _parse_rank(last, part)
    if lo > hi:
        raise ValueError(f"--ranks: {part!r} is not a rank range; {_EXPECTED}")
    return range(lo, hi + 1)


def _parse_rank(token: str, part: str) -> int:
    rank = plain_number(token.strip())
    if rank is None:
        raise ValueError(f"--ranks: {part!r} is not a rank or rank range; {_EXPECTED}")
    return rank
