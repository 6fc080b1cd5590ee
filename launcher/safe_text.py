"""What of a rank's output may reach the user's terminal: printable text, tabs, and (on a
terminal) the rank's own SGR colour codes. Every other control character is shown escaped
(`\\x1b`, `\\x0e`), so a rank printing binary data or a terminal reset cannot garble the
screen. The rank's log file keeps the exact bytes.

Works on whole chunks of lines at C speed (`re`, `str.replace`): a flood is never handled
line by line.
"""

import re

# SGR (colour and style) sequences: ESC [ params m.
_SGR = r"\x1b\[[0-9;:]*m"
# C0 controls but tab and newline, DEL, and C1 controls (U+0080-U+009F, which some terminals
# obey as escape sequences).
_CONTROL = r"[\x00-\x08\x0b-\x1f\x7f-\x9f]"
_UNSAFE = re.compile(f"({_SGR})|{_CONTROL}")
# Carriage returns: a line redrawn with \r (a progress bar) shows its last state, as a
# terminal would; CRLF line ends are plain line ends.
_CR_LINE_END = re.compile(r"\r+(?=\n|\Z)")
_BEFORE_CR = re.compile(r"[^\n\r]*\r")


_SGR_ONLY = re.compile(_SGR)


def strip_sgr(text: str) -> str:
    """`text` without its colour codes."""
    return _SGR_ONLY.sub("", text)


def _escape(char: str) -> str:
    return f"\\x{ord(char):02x}"


def _keep_sgr(match: re.Match[str]) -> str:
    return match.group(1) or _escape(match.group(0))


def _drop_sgr(match: re.Match[str]) -> str:
    return "" if match.group(1) else _escape(match.group(0))


def clean(text: str, keep_sgr: bool = False) -> str:
    """`text` (one line or many) as it may be shown: carriage returns resolved, SGR codes
    kept (`keep_sgr`, on a terminal) or dropped, every other control character escaped."""
    if "\r" in text:
        text = _BEFORE_CR.sub("", _CR_LINE_END.sub("", text))
    if _UNSAFE.search(text) is None:
        return text
    return _UNSAFE.sub(_keep_sgr if keep_sgr else _drop_sgr, text)


# Bytes that may start something unsafe: C0 controls but tab and newline, DEL, and 0xC2, the
# lead byte of C1 controls in UTF-8 (and of harmless characters such as "©", which only cost
# the slower check). Finding none of them is one pass of `bytes.translate`, in C.
_SUSPECT = bytes([*range(0x00, 0x09), *range(0x0B, 0x20), 0x7F, 0xC2])
_NOT_SUSPECT = bytes(b for b in range(256) if b not in _SUSPECT)


def decode(chunk: bytes) -> str:
    return chunk.decode("utf-8", errors="replace")


def clean_chunk(chunk: bytes, keep_sgr: bool = False) -> str:
    """A chunk of a rank's output (many lines), decoded and cleaned as `clean` does; a chunk
    of plain text, the common case, costs no regular expression at all."""
    text = decode(chunk)
    if b"\r" not in chunk and not chunk.translate(None, _NOT_SUSPECT):
        return text
    return clean(text, keep_sgr)
