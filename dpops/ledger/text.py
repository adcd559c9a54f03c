"""Free text in the ledger (actors, reasons, scope descriptions): refused with control characters when
written, escaped when printed.

Why (issue 19 item 11): a reason or actor carrying terminal escape sequences reached ``ledger history``
raw; a cap raise from 10 to 1000 was visually erased from an operator's terminal. The history is the
evidence a reviewer reads, so what it says on screen must be what it holds. Entries are immutable and
old ones may hold such characters, hence both: refuse at write time (a clear error naming the field)
and escape at print time (every CLI table goes through ``printable``).

Refused and escaped: C0 controls (including newline and tab: a ledger field is one line), DEL, C1
controls (``\\x9b`` is a CSI on some terminals), and the bidirectional overrides and isolates that can
reorder what a terminal shows (U+202A-U+202E, U+2066-U+2069, U+200E/U+200F, U+061C).
"""

from __future__ import annotations

import re

from dpops.errors import InvalidParameter

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def check_free_text(value: str, field: str) -> str:
    """``value`` unchanged, or InvalidParameter (exit 3) naming ``field`` and the first control character's
    position (never echoing the value: it may be an attack on the terminal that reads the error)."""
    if isinstance(value, str):
        found = _CONTROL.search(value)
        if found:
            raise InvalidParameter(
                f"{field} holds a control character (U+{ord(found.group()):04X} at position {found.start() + 1}); "
                "ledger text is one line of printable characters (it is shown to operators forever): remove it"
            )
    return value


def printable(value: str, *, keep_newlines: bool = False) -> str:
    """``value`` with every control character shown as a visible escape (``\\x1b``, ``\\u202e``).

    ``keep_newlines``: a table cell may break lines on purpose (a newline moves the cursor, it cannot erase)."""
    if not _CONTROL.search(value):
        return value

    def esc(m: re.Match[str]) -> str:
        c = m.group()
        if keep_newlines and c == "\n":
            return c
        return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"

    return _CONTROL.sub(esc, value)
