"""Merge identical lines that several ranks print at about the same time.

Eight ranks printing ``loading data`` becomes one ``[ranks 0-7] loading data``. Pure
logic: the caller passes the clock in, so tests need no threads or sleeps.
"""

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from fractions import Fraction

# How long a line one rank printed waits for the other ranks' copies. Ranks that print the
# same line together may still reach the file seconds apart on a loaded machine (each is one
# of many runnable processes); past this, a line printed by one rank alone, as most lines
# after the start are, would come noticeably late.
WINDOW_S = 0.5


@dataclass(eq=False)  # compared by identity: two groups are never the same one
class _Group:
    # Its place in the output order: a count, or a fraction between two for a line moved
    # before another (`_move_before`).
    seq: int | Fraction
    text: str
    first_seen: float
    ranks: set[int] = field(default_factory=set)


class Coalescer:
    """Holds each line up to ``window_s`` so other ranks' copies of it can join.

    Output keeps first-seen order, and each rank's own lines keep their order: a rank may
    only join a group that comes after the last group it is in. So a rank printing the
    same text twice gives two lines, and a merge never reorders any rank's output. One
    exception keeps a rank's own chatter from splitting a line all ranks print: where the
    groups that keep a rank from a copy of its line hold that rank's lines alone (torch's
    ``[Gloo] Rank 1 is connected ...``, read after rank 0's next line), they move to just
    before the copy, which reorders no rank's lines, and the rank joins it.

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
        # Each rank's pending groups, oldest first; and the place of the newest group it shares
        # with another rank (one a rank's own lines never move before).
        self._mine: dict[int, deque[_Group]] = {}
        self._shared_seq: dict[int, int | Fraction] = {}
        self._next_seq = 0
        self._taken_seq: int | Fraction = -1  # the place of the last group that left

    def add(self, rank: int, text: str, now: float) -> None:
        group = self._joinable(rank, text) or self._joinable_by_moving(rank, text)
        if group is None:
            group = _Group(self._next_seq, text, now)
            self._next_seq += 1
            self._pending.append(group)
            self._by_text.setdefault(text, deque()).append(group)
        group.ranks.add(rank)
        if len(group.ranks) > 1:
            for each in group.ranks:
                self._shared_seq[each] = max(group.seq, self._shared_seq.get(each, group.seq))
        self._mine.setdefault(rank, deque()).append(group)

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
        # After the rank's last pending group; with none, every pending group comes after
        # the last one it was in.
        mine = self._mine.get(rank)
        after = mine[-1].seq if mine else self._taken_seq
        for group in self._by_text.get(text, ()):
            if group.seq > after:
                return group
        return None

    def _joinable_by_moving(self, rank: int, text: str) -> _Group | None:
        """A pending copy of the line that only lines this rank printed alone keep it from
        (they came after the copy): those lines moved to just before it."""
        shared = self._shared_seq.get(rank, self._taken_seq)
        for group in self._by_text.get(text, ()):
            if group.seq > shared and rank not in group.ranks:
                mine = self._mine.get(rank, ())
                self._move_before(group, [g for g in mine if g.seq > group.seq])
                return group
        return None

    def _move_before(self, target: _Group, moved: list[_Group]) -> None:
        """Puts `moved` (pending, after `target`, each one rank's alone), in their order, just
        before `target`, between it and the group before it."""
        leaving = set(map(id, moved))
        order = [group for group in self._pending if id(group) not in leaving]
        at = order.index(target)
        before = order[at - 1].seq if at else self._taken_seq
        gap = Fraction(target.seq - before, len(moved) + 1)
        for count, group in enumerate(moved, start=1):
            group.seq = before + gap * count
        order[at:at] = moved
        self._pending = deque(order)
        for text in {group.text for group in moved}:
            self._by_text[text] = deque(sorted(self._by_text[text], key=lambda g: g.seq))

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
            for rank in group.ranks:
                self._mine[rank].popleft()  # and the oldest of each of its ranks
            self._taken_seq = group.seq
            taken.append((frozenset(group.ranks), group.text))
        return taken
