"""How one output line looks: ``[rank 3] text`` or ``[ranks 0-3] text``, coloured by rank; and
rank sets as short text (``0-3,5,7-8``), for those prefixes and for the ``--ranks`` flag."""

from collections.abc import Collection, Iterable

from rich.text import Text

from launcher.plain_number import plain_number

# No red: red should mean trouble, not "rank 1".
RANK_PALETTE = (
    "cyan",
    "magenta",
    "green",
    "yellow",
    "blue",
    "bright_cyan",
    "bright_magenta",
    "bright_green",
    "bright_yellow",
    "bright_blue",
)
# A merged line belongs to no single rank, so it gets no rank's colour.
MERGED_STYLE = "bold"


def rank_style(rank: int) -> str:
    return RANK_PALETTE[rank % len(RANK_PALETTE)]


def prefix(ranks: Collection[int]) -> str:
    if len(ranks) == 1:
        return f"[rank {next(iter(ranks))}]"
    return f"[ranks {format_ranks(ranks)}]"


def format_line(ranks: Collection[int], text: str) -> Text:
    """The printable line; ``text`` is taken verbatim (no markup, no highlighting)."""
    style = rank_style(next(iter(ranks))) if len(ranks) == 1 else MERGED_STYLE
    line = Text()
    line.append(prefix(ranks) + " ", style=style)
    # Workers' own colours (e.g. coloured logging) become styles instead of raw escape
    # codes, so a non-terminal console drops them like it drops ours.
    line.append_text(Text.from_ansi(text) if "\x1b" in text else Text(text))
    return line


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
