"""Which log lines are alerts: shown even for ranks that ``--ranks`` hides.

Filtering a rank out must never hide why it failed, so anything that looks like a
warning, an error or part of a traceback passes the filter. A false positive costs one
extra line; a false negative hides a crash, so the patterns lean towards matching.
"""

import re
from collections.abc import Hashable
from enum import Enum

from launcher.safe_text import strip_sgr

_ALERT_PATTERNS = [
    r"\b(?:WARN|WARNING|ERROR|FATAL|CRITICAL)\b",
    # RuntimeError, UserWarning, ncclInternalError, KeyboardInterrupt, bare "Error" ...
    r"(?:Error|Exception|Warning|Interrupt)\b",
    r"(?i:\b(?:error|warning)\s*:|\bfatal\b)",
    r"Segmentation fault|core dumped|\bSIG(?:SEGV|ABRT|BUS|KILL|TERM)\b",
    r"(?i:\b(?:nccl|gloo)\b.*\b(?:error|fail(?:ed|ure)?|abort(?:ed)?|timed? ?out|closed|reset)\b)",
    # gloo's C++ log lines carry their source path: "[.../gloo/transport/tcp/pair.cc:534] ..."
    r"/gloo/\S+\.(?:cc|h):\d+\]",
    # c10 / glog-style native messages: "[W socket.cpp:...]", "E1121 10:28:00.123 ..."
    r"^\[?[WEF]\d{4} \d\d:\d\d:\d\d|^\[[WEF] ",
]
_ALERT = re.compile("|".join(f"(?:{p})" for p in _ALERT_PATTERNS))
# What every alert above contains, found by plain substring search (in C, at memory speed):
# lowercase words for the patterns that ignore case, and the rest as written.
_WORDS = (
    "warn",
    "error",
    "fatal",
    "critical",
    "exception",
    "interrupt",
    "traceback",
    "nccl",
    "gloo",
)
_AS_WRITTEN = ("SIG", "Segmentation fault", "core dumped")
_NATIVE_LINE = re.compile(r"[\n\r](?:\[?[WEF]\d{4} \d\d:\d\d:\d\d|\[[WEF] )")

_TRACEBACK_START = re.compile(r"Traceback \(most recent call last\):")
# Lines Python prints between the parts of a chained exception.
_CHAIN_LINE = re.compile(
    r"^(?:During handling of the above exception, another exception occurred:"
    r"|The above exception was the direct cause of the following exception:)\s*$"
)


def looks_like_alert(text: str) -> bool:
    """Whether one line, on its own, reads as a warning or an error (coloured or not)."""
    return _ALERT.search(strip_sgr(text) if "\x1b" in text else text) is not None


def may_hold_alerts(text: str) -> bool:
    """Whether any line of `text` (many lines) may be an alert or start a traceback. A few
    substring searches over the whole chunk: a flood without alerts costs no per-line work;
    a True costs a look at each line (`AlertDetector`)."""
    lowered = text.lower()
    return (
        any(word in lowered for word in _WORDS)
        or any(word in text for word in _AS_WRITTEN)
        or _NATIVE_LINE.search("\n" + text) is not None
    )


class _Block(Enum):
    NONE = 0
    TRACEBACK = 1  # inside "Traceback ...": indented frames until the exception line
    AFTER = 2  # just after an exception line: a chained exception may follow


class AlertDetector:
    """Classifies lines as alerts, tracking multi-line traceback blocks per stream."""

    def __init__(self) -> None:
        self._block: dict[Hashable, _Block] = {}

    def in_block(self, stream: Hashable) -> bool:
        """Whether `stream` is inside a traceback (its next lines may be alerts)."""
        return self._block.get(stream, _Block.NONE) is not _Block.NONE

    def is_alert(self, stream: Hashable, text: str) -> bool:
        """Classify the next line of ``stream`` (e.g. a rank); call for every line in order."""
        if "\x1b" in text:
            text = strip_sgr(text)
        block = self._block.get(stream, _Block.NONE)
        if _TRACEBACK_START.search(text):
            self._block[stream] = _Block.TRACEBACK
            return True
        if block is _Block.TRACEBACK:
            # Frames and source lines are indented; the first flush-left line is the
            # "SomeError: message" line that ends the block.
            if not text[:1].isspace() and text.strip():
                self._block[stream] = _Block.AFTER
            return True
        if block is _Block.AFTER and (not text.strip() or _CHAIN_LINE.match(text)):
            return True
        self._block[stream] = _Block.NONE
        return looks_like_alert(text)
