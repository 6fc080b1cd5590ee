"""How one output line looks: ``[rank 3] text`` or ``[ranks 0-3] text``, coloured by rank."""

from collections.abc import Collection

from rich.text import Text

from launcher.ranks import format_ranks

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
