"""Team Great Expectations suites are untrusted input: a strict schema and an allow-list, checked before GX.

A GX suite is not data. GX hands an expectation's ``row_condition`` (with ``condition_parser:
pandas``) to ``DataFrame.query``, which evaluates ``@name`` references as Python: a suite JSON
dropped into the project ran shell commands inside the publishing process, which holds the noise
key and reads the private inputs (issue 19 item 5). Suite parameters (``{"$PARAMETER": ...}``) go
through GX's own expression evaluator, regex and pattern expectations cost what their pattern
says (catastrophic backtracking), ``unexpected_rows_expectation`` runs a query, and custom
expectations are plugins (code). So dpops reads every team suite itself, as JSON, and accepts it
only if each expectation is one of the types in :data:`ALLOWED_EXPECTATIONS` with exactly the
keyword arguments that type's model lists, each of a plain JSON type (a string, a finite number, a
boolean, a list of those). Anything else is refused with the file, the expectation's index and the
field, before GX ever sees the suite. A ``row_condition`` or ``condition_parser`` key anywhere in the
document is refused by name.

The allow-list (why these): team checks run on the NOISY output, which is post-processing (semantics.md
section 6), so a check may look at any published value. These types cover what teams check on a
release table (columns present, row counts, value ranges, nulls, membership in a set, uniqueness,
pairwise order such as ``ci95_low <= ci95_high``, aggregates such as a total's range) and what dpops'
own suites use; none of them evaluates an expression, a pattern or a parameter. The input schema is
checked by dpops alone (``dpops.release.gx_checks.check_input_schema``, metadata only): teams add no
input suites.

Privacy reason for each refusal: a suite that can run code can read the key (then every published
value can be de-noised) or the private rows, and copy them anywhere; a suite that can only compare
published values to constants cannot.

Who may write the project: the operator's service account only. :func:`check_project_tree` refuses
a project directory, a directory on the way to a suite, or a suite file that is a symlink, owned by
another user, or writable by group or others (``SpecError``, exit 3, naming the path).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeAlias

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from dpops.errors import SpecError

# A scalar a team may compare published values with.
Number: TypeAlias = StrictInt | StrictFloat
Scalar: TypeAlias = StrictStr | StrictInt | StrictFloat | StrictBool
MAX_SUITE_BYTES = 1 << 20
MAX_SET = 10_000
_SEGMENT_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CONDITION_KEYS = ("row_condition", "condition_parser")
Column = StrictStr  # checked for length and control characters in _Kwargs


class _Kwargs(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @field_validator("*", mode="after")
    @classmethod
    def _plain(cls, value: object, info: ValidationInfo) -> object:
        _check_value(str(info.field_name), value)
        return value


def _check_value(name: str, value: object) -> None:
    """No NaN/inf (GX compares with them inconsistently), no control characters, bounded sets."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("must be a finite number")
    if isinstance(value, str) and (len(value) > 256 or any(ord(ch) < 32 or ord(ch) == 127 for ch in value)):
        raise ValueError("at most 256 characters, no control characters")
    if isinstance(value, (list, tuple)):
        if len(value) > MAX_SET:
            raise ValueError(f"at most {MAX_SET} entries")
        for item in value:
            _check_value(name, item)


class _Mostly(_Kwargs):
    mostly: Number | None = Field(default=None, ge=0, le=1)


class _Range(_Kwargs):
    min_value: Number | None = None
    max_value: Number | None = None
    strict_min: StrictBool = False
    strict_max: StrictBool = False


class ColumnKw(_Kwargs):
    """A column name (``expect_column_to_exist``)."""

    column: Column


class ColumnMostlyKw(_Mostly):
    """A column and an optional ``mostly`` fraction."""

    column: Column


class ColumnRangeKw(_Range):
    """A column and an inclusive/strict range for one of its aggregates."""

    column: Column


class ColumnValuesRangeKw(_Range):
    """A column, a range for every value, an optional ``mostly``."""

    column: Column
    mostly: Number | None = Field(default=None, ge=0, le=1)


class ColumnSetKw(_Mostly):
    """A column, the set its values must lie in, an optional ``mostly``."""

    column: Column
    value_set: list[Scalar]


class ColumnDistinctSetKw(_Kwargs):
    """A column and the set its distinct values are compared with."""

    column: Column
    value_set: list[Scalar]


class ColumnTypeListKw(_Mostly):
    """A column and the dtype names it may have."""

    column: Column
    type_list: list[StrictStr]


class ColumnPairKw(_Kwargs):
    """Two columns, A >= B (or >), and how missing values are treated."""

    column_A: Column  # noqa: N815 - GX's own keyword names
    column_B: Column  # noqa: N815
    or_equal: StrictBool = False
    ignore_row_if: Literal["both_values_are_missing", "either_value_is_missing", "neither"] = "both_values_are_missing"
    mostly: Number | None = Field(default=None, ge=0, le=1)


class TableRangeKw(_Range):
    """A range for the table's row count."""


class TableEqualKw(_Kwargs):
    """The table's exact row count."""

    value: StrictInt = Field(ge=0)


class TableColumnsKw(_Kwargs):
    """The table's column set."""

    column_set: list[Column]
    exact_match: StrictBool = True


#: expectation type -> the model of its keyword arguments (every other key is refused).
ALLOWED_EXPECTATIONS: dict[str, type[_Kwargs]] = {
    "expect_column_to_exist": ColumnKw,
    "expect_table_columns_to_match_set": TableColumnsKw,
    "expect_table_row_count_to_be_between": TableRangeKw,
    "expect_table_row_count_to_equal": TableEqualKw,
    "expect_column_values_to_not_be_null": ColumnMostlyKw,
    "expect_column_values_to_be_between": ColumnValuesRangeKw,
    "expect_column_values_to_be_in_set": ColumnSetKw,
    "expect_column_values_to_be_unique": ColumnMostlyKw,
    "expect_column_values_to_be_in_type_list": ColumnTypeListKw,
    "expect_column_distinct_values_to_equal_set": ColumnDistinctSetKw,
    "expect_column_distinct_values_to_be_in_set": ColumnDistinctSetKw,
    "expect_column_pair_values_a_to_be_greater_than_b": ColumnPairKw,
    "expect_column_min_to_be_between": ColumnRangeKw,
    "expect_column_max_to_be_between": ColumnRangeKw,
    "expect_column_sum_to_be_between": ColumnRangeKw,
    "expect_column_mean_to_be_between": ColumnRangeKw,
}


class _Expectation(BaseModel):
    """One expectation as GX writes it; ``meta`` must be empty (it is rendered into Data Docs)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    type: StrictStr
    kwargs: dict[str, object]
    id: StrictStr | None = Field(default=None, max_length=64)
    meta: dict[str, StrictStr] = Field(default_factory=dict, max_length=0)
    severity: Literal["critical", "warning", "info"] = "critical"
    notes: StrictStr | None = Field(default=None, max_length=2000)
    description: StrictStr | None = Field(default=None, max_length=2000)


class _Suite(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    name: StrictStr
    expectations: list[dict[str, object]] = Field(max_length=1000)
    id: StrictStr | None = Field(default=None, max_length=64)
    meta: dict[str, StrictStr] = Field(default_factory=dict, max_length=4)
    notes: StrictStr | None = Field(default=None, max_length=2000)


@dataclass(frozen=True)
class CheckedExpectation:
    """An allow-listed expectation: its type and its validated keyword arguments (plain JSON values)."""

    type: str
    kwargs: dict[str, object]


@dataclass(frozen=True)
class TeamSuite:
    """A team suite that passed :func:`validate_suite`: safe to hand to GX."""

    name: str
    path: str
    expectations: tuple[CheckedExpectation, ...]

    def as_payload(self) -> dict[str, object]:
        """The suite as the sandboxed child receives it (re-validated there)."""
        return {"name": self.name, "expectations": [{"type": e.type, "kwargs": e.kwargs} for e in self.expectations]}


def _refuse(where: str, field: str, what: str) -> SpecError:
    return SpecError(f"{where}: {field}: {what}. Team suites may use only the expectation types and keyword "
                     "arguments listed in docs/manifest.md (Great Expectations project); fix or remove the file")


def _find_condition(doc: object, path: str) -> str | None:
    """The path of the first row_condition/condition_parser key anywhere in ``doc``, else None."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            here = f"{path}.{k}" if path else str(k)  # made printable by _refuse's caller
            if k in _CONDITION_KEYS:
                return here
            found = _find_condition(v, here)
            if found:
                return found
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            found = _find_condition(v, f"{path}[{i}]")
            if found:
                return found
    return None


_UNION_TAG_RE = re.compile(r"^(int|float|str|bool|none|(function|list|literal|dict)[-\w]*\[.*\])$")


def _printable(text: str) -> str:
    """A field path from the file, safe to print: control characters escaped, at most 200 characters."""
    out = "".join(ch if ch.isprintable() else f"\\x{ord(ch):02x}" for ch in text)
    return out if len(out) <= 200 else out[:200] + "..."


def _loc(err: ValidationError, prefix: str) -> str:
    first = err.errors()[0]
    loc = list(first["loc"])
    parts = [prefix] if prefix else []
    for n, p in enumerate(loc):
        if isinstance(p, str) and n < len(loc) - 1 and _UNION_TAG_RE.match(p):
            continue  # pydantic's union-member tags, not fields (the last element is always a real key)
        if isinstance(p, int):
            parts[-1:] = [f"{parts[-1]}[{p}]"] if parts else [f"[{p}]"]
        else:
            parts.append(str(p))
    return _printable(".".join(parts)) or "(document)"


def _reason(err: ValidationError) -> str:
    first = err.errors()[0]
    if first["type"] == "extra_forbidden":
        return "unknown field (not allowed for this expectation type)"
    # pydantic's messages quote types and limits, never the value itself
    return first["msg"]


def validate_suite(doc: object, where: str, expected_name: str | None = None) -> TeamSuite:
    """Check one suite document; return it as a :class:`TeamSuite` or raise ``SpecError`` naming
    ``where`` (the file), the expectation index and the field."""
    cond = _find_condition(doc, "")
    if cond:
        raise _refuse(where, _printable(cond),
                      "row conditions are refused (GX evaluates them as pandas/Python expressions)")
    if not isinstance(doc, dict):
        raise _refuse(where, "(document)", "a suite is a JSON object")
    try:
        suite = _Suite.model_validate(doc)
    except ValidationError as exc:
        raise _refuse(where, _loc(exc, ""), _reason(exc)) from None
    if expected_name is not None and suite.name != expected_name:
        raise _refuse(where, "name", f"the suite in this file must be named {expected_name!r} (its path decides it)")
    checked = []
    for i, raw in enumerate(suite.expectations):
        base = f"expectations[{i}]"
        try:
            exp = _Expectation.model_validate(raw)
        except ValidationError as exc:
            raise _refuse(where, _loc(exc, base), _reason(exc)) from None
        model = ALLOWED_EXPECTATIONS.get(exp.type)
        if model is None:
            shown = exp.type if re.fullmatch(r"[a-z0-9_]{1,100}", exp.type) else "(not a type name)"
            raise _refuse(where, f"{base}.type", f"expectation type {shown} is not in dpops' allow-list")
        try:
            kw = model.model_validate(exp.kwargs)
        except ValidationError as exc:
            raise _refuse(where, _loc(exc, f"{base}.kwargs"), _reason(exc)) from None
        checked.append(CheckedExpectation(type=exp.type, kwargs=kw.model_dump(exclude_defaults=True)))
    return TeamSuite(name=suite.name, path=where, expectations=tuple(checked))


# ----------------------------------------------------------------------- the project tree


def check_private_path(path: Path, what: str) -> os.stat_result:
    """``path`` is no symlink, owned by this process's user (or root) and not writable by group/others."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise SpecError(f"{what} {path}: cannot be read ({exc.strerror}); fix the GX project") from None
    if stat.S_ISLNK(st.st_mode):
        raise SpecError(f"{what} {path} is a symlink; the GX project must hold real files and directories")
    if st.st_uid not in (os.geteuid(), 0):
        raise SpecError(f"{what} {path} is owned by uid {st.st_uid}, not by this service account "
                        f"(uid {os.geteuid()}); only the operator may write the GX project")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise SpecError(f"{what} {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                        f"only the operator may write the GX project: chmod go-w {path} (dpops creates it 0700)")
    return st


def suite_dirs(root: Path, release: str) -> tuple[Path, Path]:
    """The two directories whose suites run on ``release``: ``output/<release>`` and ``output/all``."""
    base = root / "gx" / "expectations" / "output"
    return base / release, base / "all"


def _suite_files(directory: Path) -> Iterator[Path]:
    check_private_path(directory, "GX suite directory")
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        p = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            yield from _suite_files(p)
        elif entry.name.endswith(".json") or entry.is_symlink():
            yield p


def check_project_tree(root: Path) -> None:
    """The project directory and its ``gx`` directory belong to the operator (see the module docstring)."""
    check_private_path(root, "GX project directory")
    for sub in (root / "gx", root / "gx" / "expectations", root / "gx" / "expectations" / "output"):
        if os.path.lexists(sub):
            check_private_path(sub, "GX project directory")


def _read_suite_file(path: Path) -> object:
    st = check_private_path(path, "GX suite file")
    if not stat.S_ISREG(st.st_mode):
        raise SpecError(f"GX suite file {path} is not a regular file")
    if st.st_size > MAX_SUITE_BYTES:
        raise SpecError(f"GX suite file {path} is larger than {MAX_SUITE_BYTES} bytes")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(MAX_SUITE_BYTES + 1)
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise SpecError(f"GX suite file {path}: not UTF-8 JSON; fix or remove it") from None


def load_team_suites(root: str | os.PathLike[str], release: str) -> list[TeamSuite]:
    """Every team suite that runs on ``release``, validated; refuses the first bad file (``SpecError``).

    Suite ``output.<release>.<a>.<b>`` lives in ``gx/expectations/output/<release>/<a>/<b>.json`` (GX's
    own file layout); ``output.all.<name>`` runs on every release. Other files are never read."""
    root = Path(root)
    check_project_tree(root)
    suites = []
    for directory, prefix in zip(suite_dirs(root, release), (f"output.{release}", "output.all"), strict=True):
        if not os.path.lexists(directory):
            continue
        for path in _suite_files(directory):
            rel = path.relative_to(directory).with_suffix("").parts
            if not rel or not all(_SEGMENT_RE.match(p) for p in rel) or path.suffix != ".json":
                raise SpecError(f"GX suite file {path}: file names are [A-Za-z0-9_-] segments ending in .json")
            suites.append(validate_suite(_read_suite_file(path), str(path), ".".join((prefix, *rel))))
    return sorted(suites, key=lambda s: s.name)

