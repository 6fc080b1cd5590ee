"""Merge identical lines that several ranks print at about the same time.

Eight ranks printing ``loading data`` becomes one ``[ranks 0-7] loading data``. Pure
logic: the caller passes the clock in, so tests need no threads or sleeps.
"""

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

# How long a line one rank printed waits for the other ranks' copies. Ranks that print the
# same line together may still reach the file seconds apart on a loaded machine (each is one
# of many runnable processes); past this, a line printed by one rank alone, as most lines
# after the start are, would come noticeably late.
WINDOW_S = 0.5


@dataclass
class _Group:
    seq: int
    text: str
    first_seen: float
    ranks: set[int] = field(default_factory=set)


class Coalescer:
    """Holds each line up to ``window_s`` so other ranks' copies of it can join.

    Output keeps first-seen order, and each rank's own lines keep their order: a rank may
    only join a group that started after the last group it is in. So a rank printing the
    same text twice gives two lines, and a merge never reorders any rank's output.

    A copy joins while its line is still held, that is until the first ``ready`` at or past
    the window: the caller adds what one read of the files brought, then asks ``ready``, so a
    read that comes late (the reading thread waited for a core) does not shorten the window.
    """

    def __init__(self, window_s: float = WINDOW_S, expected: Iterable[int] | None = None) -> None:
        """``expected``: ranks that can print a line; once all of them have, it goes at once."""
        self.window_s = window_s
        self._expected = frozenset(expected) if expected is not None else None
        self._pending: deque[_Group] = deque()
        # Pending groups by text, oldest first, so a burst of lines stays linear-time.
        self._by_text: dict[str, deque[_Group]] = {}
        self._last_seq: dict[int, int] = {}
        self._next_seq = 0

    def add(self, rank: int, text: str, now: float) -> None:
        group = self._joinable(rank, text)
        if group is None:
            group = _Group(self._next_seq, text, now)
            self._next_seq += 1
            self._pending.append(group)
            self._by_text.setdefault(text, deque()).append(group)
        group.ranks.add(rank)
        self._last_seq[rank] = group.seq

    def ready(self, now: float) -> list[tuple[frozenset[int], str]]:
        """Lines whose wait is over, oldest first; a later line never overtakes an earlier."""
        done = 0
        for group in self._pending:
            if now - group.first_seen < self.window_s and not self._complete(group):
                break
            done += 1
        return self._take(done)

    def flush(self) -> list[tuple[frozenset[int], str]]:
        """Every pending line, regardless of its wait."""
        return self._take(len(self._pending))

    def _joinable(self, rank: int, text: str) -> _Group | None:
        after = self._last_seq.get(rank, -1)
        for group in self._by_text.get(text, ()):
            if group.seq > after:
                return group
        return None

    def _complete(self, group: _Group) -> bool:
        return self._expected is not None and group.ranks >= self._expected

    def _take(self, count: int) -> list[tuple[frozenset[int], str]]:
        taken = []
        for _ in range(count):
            group = self._pending.popleft()
            same_text = self._by_text[group.text]
            same_text.popleft()  # groups leave in order, so it is the oldest of its text
            if not same_text:
                del self._by_text[group.text]
            taken.append((frozenset(group.ranks), group.text))
        return taken
