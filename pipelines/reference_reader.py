"""The reference CSV reader: the documented dialect, one line at a time, in plain Python (the oracle).

``pipelines/io.py`` reads CSV fast: it cuts the byte stream into blocks of whole lines and hands them to
pyarrow's vectorised parser, converts whole columns with Arrow casts, and falls back to slower paths only
where a block or a column needs it. Each of those paths must give every line exactly the rows the
documented dialect (README "The CSV dialect", the comment block of that name in ``pipelines/io.py``) gives
that line on its own. This module is that definition, written as directly as possible: it splits the
file into lines, and each line into fields and each needed cell into its value, with nothing shared
between lines, no pyarrow, no pandas and no regular-expression engine beyond Python's ``re`` on one cell.
It is slow (~0.1 ms a line, measured on 20,000 lines) and is never used by a release; the differential property in
``tests/test_reader_isolation.py`` checks the fast reader against it for attacker-chosen bytes.

Privacy reason: one unit's line may cost only itself (issue 19 item 3, issue 25 items 1-2). A reader
that parses each line alone cannot violate that by construction, so equality with it is the property.
It shares NO parsing code with the fast path on purpose: a shared helper would make both wrong at once.
Only the row rules after parsing (which rows a null or a bad value drops) are restated here from
``pipelines.io.prepare_batch``'s docstring, and hashing is left to the caller.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

from dpops.errors import InputDataError

MAX_LINE_BYTES = 16 << 20  # README: a line longer than 16 MiB (its end of line not counted) is malformed
_BOM = b"\xef\xbb\xbf"
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_MAX_NUMBER_TEXT = 1000  # README: beyond it the decimal form of an int, or a blank-padded float, is malformed
_BLANKS = " \t"

Value = str | int | float | bool | None


@dataclass(frozen=True)
class ReferenceRow:
    """One kept row: its line number in the file (the header is line 1) and its needed cells' values."""

    line: int
    values: dict[str, Value]


@dataclass
class ReferenceResult:
    """The kept rows of a file, in line order, and how many lines were malformed (skipped whole)."""

    rows: list[ReferenceRow] = field(default_factory=list)
    malformed_lines: int = 0  # lines skipped whole: open quote, wrong field count, too long


class _Bad:
    """A cell that does not convert to its declared type (its row is dropped)."""


BAD = _Bad()


# --------------------------------------------------------------------------- lines and fields


def split_lines(data: bytes) -> list[bytes]:
    """The file's lines, without their ends: a line ends at LF, CRLF or a lone CR; text after the last end
    is a last line; nothing after the last end is no line."""
    lines: list[bytes] = []
    cur = bytearray()
    i, n = 0, len(data)
    while i < n:
        c = data[i]
        if c == 0x0A:
            lines.append(bytes(cur))
            cur.clear()
        elif c == 0x0D:
            lines.append(bytes(cur))
            cur.clear()
            if i + 1 < n and data[i + 1] == 0x0A:
                i += 1
        else:
            cur.append(c)
        i += 1
    if cur:
        lines.append(bytes(cur))
    return lines


def split_fields(line: bytes) -> list[bytes | None] | None:
    """The fields of one line (None: an empty unquoted field, i.e. null), or None when a quoted field is
    still open at the line's end. A field starting with '"' is quoted up to the next '"' that is not
    doubled (``""`` is one '"'); what follows it up to the next ',' is kept literally; a '"' anywhere else
    is literal."""
    fields: list[bytes | None] = []
    i, n = 0, len(line)
    while True:
        if i < n and line[i] == 0x22:  # a quoted field
            value = bytearray()
            i += 1
            while True:
                if i >= n:
                    return None  # the quote is still open at the end of the line
                if line[i] == 0x22:
                    if i + 1 < n and line[i + 1] == 0x22:
                        value.append(0x22)
                        i += 2
                        continue
                    i += 1
                    break
                value.append(line[i])
                i += 1
            while i < n and line[i] != 0x2C:  # the literal tail after the closing quote
                value.append(line[i])
                i += 1
            fields.append(bytes(value))
        else:
            start = i
            while i < n and line[i] != 0x2C:
                i += 1
            fields.append(line[start:i] if i > start else None)
        if i >= n:
            return fields
        i += 1  # the ',' ; a field follows it (possibly empty)


# --------------------------------------------------------------------------- cells


def _text(raw: bytes) -> str | _Bad:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return BAD


_DIGITS = re.compile(r"[0-9]+")
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _is_decimal(t: str) -> bool:
    return t.isascii() and _DECIMAL.fullmatch(t) is not None


def int_cell(text: str) -> int | _Bad:
    """README: ``[+-]digits``, or a decimal whose value is an integer (at most 1,000 characters), within
    int64; spaces and tabs around it ignored; ASCII digits only."""
    t = text.strip(_BLANKS)
    body = t[1:] if t[:1] in ("+", "-") else t
    if body.isascii() and _DIGITS.fullmatch(body):
        digits = body.lstrip("0") or "0"
        if len(digits) > 19:
            return BAD
        v = int(digits) * (-1 if t[:1] == "-" else 1)
    elif len(t) <= _MAX_NUMBER_TEXT and _is_decimal(t):
        try:
            d = Decimal(t)
        except (InvalidOperation, ValueError):  # an exponent beyond what Decimal holds: not an int64
            return BAD
        if not (_INT64_MIN <= d <= _INT64_MAX) or d != d.to_integral_value():
            return BAD
        v = int(d)
    else:
        return BAD
    return v if _INT64_MIN <= v <= _INT64_MAX else BAD


def float_cell(text: str) -> float | _Bad:
    """README: a decimal with optional exponent, or inf/infinity/nan (any case, a sign allowed); spaces
    and tabs around it ignored (a padded or spelled-out number of more than 1,000 characters is malformed)."""
    if _is_decimal(text):
        return float(text)
    t = text.strip(_BLANKS)
    if len(t) > _MAX_NUMBER_TEXT:
        return BAD
    if _is_decimal(t):
        return float(t)
    word = t[1:] if t[:1] in ("+", "-") else t
    if word.lower() in ("inf", "infinity", "nan") and word.isascii():
        return float(t)
    return BAD


def bool_cell(text: str) -> bool | _Bad:
    """README: ``true``/``false``/``1``/``0`` in any case, spaces and tabs around it ignored."""
    low = text.strip(_BLANKS).lower()
    if low in ("true", "1"):
        return True
    if low in ("false", "0"):
        return False
    return BAD


def time_cell(text: str) -> int | None:
    """README: ISO-8601 extended text -> nanoseconds since the epoch (UTC), or None when unreadable."""
    if not text.isascii():
        return None
    s = text
    if len(s) < 10 or s[4] != "-" or s[7] != "-" or not (s[:4] + s[5:7] + s[8:10]).isdigit():
        return None
    year, month, day = int(s[:4]), int(s[5:7]), int(s[8:10])
    rest = s[10:]
    hour = minute = second = frac_ns = 0
    offset_min = 0
    if rest:
        if rest[0] not in "T ":
            return None
        rest = rest[1:]
        # time: hh[:mm[:ss[.f]]]
        if len(rest) < 2 or not rest[:2].isdigit():
            return None
        hour, rest = int(rest[:2]), rest[2:]
        if rest[:1] == ":" and rest[1:3].isdigit() and len(rest) >= 3:
            minute, rest = int(rest[1:3]), rest[3:]
            if rest[:1] == ":" and rest[1:3].isdigit() and len(rest) >= 3:
                second, rest = int(rest[1:3]), rest[3:]
                if rest[:1] == ".":
                    k = 1
                    while k < len(rest) and rest[k].isdigit():
                        k += 1
                    frac = rest[1:k]
                    if not 1 <= len(frac) <= 9:
                        return None
                    frac_ns, rest = int(frac.ljust(9, "0")), rest[k:]
        # offset: Z | +hh | +hhmm | +hh:mm (or -)
        if rest == "Z":
            rest = ""
        elif rest[:1] in ("+", "-"):
            sign = 1 if rest[0] == "+" else -1
            body = rest[1:]
            if len(body) == 2 and body.isdigit():
                oh, om = int(body), 0
            elif len(body) == 4 and body.isdigit():
                oh, om = int(body[:2]), int(body[2:])
            elif len(body) == 5 and body[2] == ":" and (body[:2] + body[3:]).isdigit():
                oh, om = int(body[:2]), int(body[3:])
            else:
                return None
            if oh > 23 or om > 59:
                return None
            offset_min, rest = sign * (oh * 60 + om), ""
        if rest:
            return None
    try:
        t = dt.datetime(year, month, day, hour, minute, second)
    except ValueError:  # no such date or time (2024-02-30, hour 24, second 60, year 0)
        return None
    epoch = dt.datetime(1970, 1, 1)
    delta = t - epoch
    ns = ((delta.days * 86_400 + delta.seconds) * 10**9) + frac_ns - offset_min * 60 * 10**9
    if not (_INT64_MIN <= ns <= _INT64_MAX):  # README: years 1677-2262, the int64 nanosecond range
        return None
    return ns


def convert_cell(raw: bytes | None, declared: str) -> Value | _Bad:
    """One CSV cell -> its value of the declared type, None (null: an empty cell), or BAD."""
    if raw is None:
        return None
    text = _text(raw)
    if isinstance(text, _Bad) or declared == "string":
        return text
    if declared == "int":
        return int_cell(text)
    if declared == "float":
        return float_cell(text)
    if declared == "bool":
        return bool_cell(text)
    raise InputDataError(f"the reference reader has no rule for type {declared!r}")


# --------------------------------------------------------------------------- rows


def read_reference(data: bytes, types: Mapping[str, str], *, unit_column: str | None,
                   partition_columns: Sequence[str], value_columns: Sequence[str] = (),
                   time_column: str | None = None, time_window_ns: tuple[int, int] | None = None,
                   max_line_bytes: int = MAX_LINE_BYTES) -> ReferenceResult:
    """The rows a CSV file gives under the documented dialect and row rules, each line read alone.

    ``types`` declares every needed column. A row is kept when every needed cell converts (``BAD``
    drops it), its time (if any) is readable and in ``[start, end)``, its unit and partition cells are
    neither null nor a float NaN, and its value cells are finite numbers (``pipelines.io.prepare_batch``'s rules).
    """
    lines = split_lines(data[len(_BOM):] if data.startswith(_BOM) else data)
    if not lines:
        raise InputDataError("the CSV file has no header line")
    header = split_fields(lines[0])
    if header is None or len(lines[0]) > max_line_bytes:
        raise InputDataError("the CSV header line is malformed")
    names = [_text(h or b"") for h in header]
    needed = [c for c in types]
    if any(isinstance(n, _Bad) for n in names) or [c for c in needed if c not in names]:
        raise InputDataError("a column declared in the spec is missing from the CSV header (line 1)")
    where = {c: names.index(c) for c in needed}  # the first column of that name
    out = ReferenceResult()
    for number, line in enumerate(lines[1:], start=2):
        cells = split_fields(line) if len(line) <= max_line_bytes else None
        if cells is None or len(cells) != len(names):
            out.malformed_lines += 1
            continue
        values: dict[str, Value] = {}
        keep = True
        for c in needed:
            raw = cells[where[c]]
            if c == time_column:
                text = None if raw is None else _text(raw)
                ns = time_cell(text) if isinstance(text, str) else None
                if time_window_ns is None or ns is None or not (time_window_ns[0] <= ns < time_window_ns[1]):
                    keep = False
                values[c] = ns
                continue
            v = convert_cell(raw, types[c])
            if isinstance(v, _Bad):
                keep = False
                continue
            values[c] = v
        if not keep:
            continue
        if unit_column is not None and _missing_key(values.get(unit_column)):
            continue
        if any(_missing_key(values.get(c)) for c in partition_columns):
            continue
        if any(not _finite(values.get(c)) for c in value_columns):
            continue
        out.rows.append(ReferenceRow(number, values))
    return out


def _missing_key(v: Value) -> bool:
    """README: a unit or partition cell that is empty, or a float NaN, drops its row."""
    return v is None or (isinstance(v, float) and v != v)


def _finite(v: Value) -> bool:
    if v is None or isinstance(v, (str, bool)):
        return False
    f = float(v)
    return f == f and f not in (float("inf"), float("-inf"))


__all__ = ["ReferenceResult", "ReferenceRow", "read_reference", "split_lines", "split_fields", "convert_cell",
           "time_cell", "int_cell", "float_cell", "bool_cell", "BAD", "MAX_LINE_BYTES"]
