"""Value types of the budget ledger: scopes, run keys, run records, statuses, entries.

These are plain frozen dataclasses so that every other part of dpops (pipeline,
runs, manifests) can build and read them without touching the database.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import asdict, dataclass, field
from datetime import UTC, date, datetime, timedelta
from enum import StrEnum
from typing import Any

from dpops.errors import InvalidParameter, SpecError
from dpops.events import PrivacyEvent, canonical_json

# A run's allowed (from, to) state transitions; staying in the same state is an idempotent retry. The store
# enforces them on write and ``ledger verify`` on replay, so both read this one table.
TRANSITIONS = frozenset({
    ("reserved", "started"),
    ("started", "committed"),
    ("started", "spent_unpublished"),
    ("reserved", "released"),
})


class RunState(StrEnum):
    """A run's state in the ledger (the state diagram is in ``dpops.ledger.store``).

    A ``StrEnum``: each member *is* its string, so the values stored in SQL, written to JSON and
    compared by older code are the same strings as before.
    """

    RESERVED = "reserved"
    STARTED = "started"
    COMMITTED = "committed"
    SPENT_UNPUBLISHED = "spent_unpublished"
    RELEASED = "released"


class Adjacency(StrEnum):
    """Neighbouring datasets: one unit added or removed, or one unit's data replaced."""

    ADD_REMOVE = "add_remove"
    REPLACE = "replace"


class BucketSize(StrEnum):
    """The period a bucketed scope splits its cap by (and a unit may be scoped to)."""

    DAY = "day"
    WEEK = "week"
    MONTH = "month"


# The same values as plain-string tuples, in declaration order (click choices, SQL IN lists, messages).
RUN_STATES = tuple(s.value for s in RunState)
# Runs whose charge is still moving: composed from the runs table at each reservation.
OPEN_STATES = (RunState.RESERVED.value, RunState.STARTED.value)
# Runs whose events count against the cap (every state but released): what a scope total composes.
CHARGED_STATES = (RunState.COMMITTED.value, RunState.SPENT_UNPUBLISHED.value, RunState.STARTED.value,
                  RunState.RESERVED.value)
BUCKET_SIZES = tuple(b.value for b in BucketSize)
ADJACENCIES = tuple(a.value for a in Adjacency)
UNBUCKETED = "*"  # the single bucket of a scope that is not bucketed by period

# The time rule (issue 19 item 1): what decides which rows of an input belong to a run's period,
# and so to a bucket. ``type`` is the declared type of the time column; ``zone`` how a time without
# an offset is read; ``filter`` names the row filter the pipeline applies (pipelines.io.outside_window):
#   dpops.time-filter/1: keep a row iff interval_start <= t < interval_end (half-open, UTC instants);
#   Parquet timestamps of any unit, CSV cells as ISO-8601 text; a null or unreadable time drops the row.
# Each value's meaning never changes: a different rule is a new value, which a scope recorded with the
# old one refuses (its buckets were charged under the old one).
TIME_TYPES = ("timestamp",)
TIME_ZONE_RULES = ("naive=UTC",)
TIME_FILTERS = ("dpops.time-filter/1",)
CURRENT_TIME_ZONE_RULE = "naive=UTC"
CURRENT_TIME_FILTER = "dpops.time-filter/1"
# Entry kinds that set a scope's definition, and which field of their body holds the new definition.
SCOPE_DEFINITION_ENTRIES = {"scope_created": "definition", "cap_changed": "after", "scope_time_pinned": "after"}
_COLUMN_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")  # the spec's column-name rule (dpops.spec.COLUMN_RE)

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


def check_scope_name(name: Any) -> str:
    """``name`` if it is a valid scope name (it appears in paths and SQL values), else SpecError."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise SpecError(
            f"scope name must be 1-128 characters of letters, digits, '_', '.', '-' "
            f"(starting with a letter or digit), got {name!r}"
        )
    return name


def _nonempty(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidParameter(f"{what} must be a non-empty string, got {value!r}")
    return value


def parse_utc(value: Any, what: str) -> datetime:
    """ISO-8601 timestamp -> aware UTC datetime. A timestamp without offset is taken as UTC."""
    if not isinstance(value, str) or not value:
        raise InvalidParameter(f"{what} must be an ISO-8601 timestamp string, got {value!r}")
    try:
        dt = datetime.fromisoformat(value)
    except ValueError:
        raise InvalidParameter(f"{what} is not an ISO-8601 timestamp: {value!r} (e.g. 2024-01-31T00:00:00Z)") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.astimezone(UTC)


def normalize_utc(value: str, what: str = "timestamp") -> str:
    """One spelling per instant, so '...Z' and '...+00:00' are the same interval everywhere."""
    dt = parse_utc(value, what)
    text = dt.strftime("%Y-%m-%dT%H:%M:%S")
    if dt.microsecond:
        text += f".{dt.microsecond:06d}"
    return text + "Z"


def utc_now() -> str:
    """Now as an ISO-8601 UTC timestamp with microseconds: the ledger's ``ts``/``created_at`` form."""
    return datetime.now(UTC).isoformat(timespec="microseconds")


@dataclass(frozen=True)
class TimeRule:
    """Which timestamp decides a row's period, and how it is read (issue 19 item 1).

    Part of a scope's unit definition: two releases that put the same row in different days (one by
    ``ts``, one by ``shipped_at``) would each charge epsilon to a different day's bucket while one
    person's one-day data feeds both, so the parallel composition of buckets would not hold. A
    bucketed scope therefore records its time rule and refuses a release with another one.
    """

    column: str
    type: str = "timestamp"
    zone: str = CURRENT_TIME_ZONE_RULE
    filter: str = CURRENT_TIME_FILTER

    def __post_init__(self) -> None:
        if not isinstance(self.column, str) or not _COLUMN_RE.match(self.column):
            raise SpecError(f"time rule: column must be a column name matching {_COLUMN_RE.pattern}, "
                            f"got {self.column!r}")
        for value, allowed, what in ((self.type, TIME_TYPES, "type"), (self.zone, TIME_ZONE_RULES, "zone"),
                                     (self.filter, TIME_FILTERS, "filter")):
            if value not in allowed:
                raise SpecError(f"time rule: {what} must be one of {allowed}, got {value!r}")

    def to_dict(self) -> dict[str, str]:
        """The stored (hashed) form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> TimeRule:
        """Parse the stored form; an unknown field is refused (it could change which rows belong to a period)."""
        if not isinstance(data, dict):
            raise SpecError(f"time rule must be an object, got {data!r}")
        extra = set(data) - set(cls.__dataclass_fields__)
        if extra:
            raise SpecError(f"time rule: unknown field(s) {sorted(extra)}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**data)

    def describe(self) -> str:
        """One line for tables and messages, e.g. ``ts (timestamp, naive=UTC, dpops.time-filter/1)``."""
        return f"{self.column} ({self.type}, {self.zone}, {self.filter})"


@dataclass(frozen=True)
class ScopeDefinition:
    """A budget scope: a population of privacy units, a cap and the accountant that checks it.

    Exactly one of ``epsilon`` (checked at ``delta``) and ``rho`` (a zCDP cap) is set.
    ``bucket`` splits the cap per period; it is allowed only when the unit itself is
    period-scoped, which the definer states with ``unit_period`` equal to ``bucket``
    (semantics.md section 4: disjoint periods touch disjoint units).

    The unit definition is whole (issue 11 item 1): ``unit_column``, ``record_level``,
    ``adjacency`` and ``unit_period``. A release whose ``privacy_unit`` differs in any of
    them is refused before reservation (``dpops.release.reservation._check_scope``): an epsilon charged
    for one unit definition says nothing about another (a record-level release in a
    user scope costs a user up to rows*epsilon; add_remove epsilon is 2*epsilon under
    replace). ``adjacency=None`` is how a scope created before this field existed is
    read: its adjacency was never recorded, so no release can be checked against it and
    every release on it is refused (create a new scope). A missing ``record_level`` reads
    as False, the stricter "one unit = all rows of one unit id" reading.

    ``time_rule`` (issue 19 item 1) completes the definition for a bucketed scope: which column's
    time puts a row in a period, its type and zone rule (``TimeRule``). A new bucketed scope must
    record one (``Ledger.create_scope``). ``time_rule=None`` on a bucketed scope is how a scope
    created before this field existed is read: its releases are refused until the owner pins the
    rule with an explicit ledger entry (``dpops ledger scope pin-time``, ``Ledger.pin_time_rule``).
    An unbucketed scope composes every release over one cap whatever rows each reads, so it may
    record a time rule (then checked) or not.
    """

    name: str
    unit: str
    unit_column: str
    epsilon: float | None
    delta: float
    rho: float | None
    accountant: str
    bucket: str | None = None
    population: int | None = None
    owner: str = ""
    description: str = ""
    unit_period: str | None = None
    adjacency: str | None = None  # "add_remove" | "replace"; None = recorded before this field (refused)
    record_level: bool = False
    time_rule: TimeRule | None = None  # None: not recorded (unbucketed, or a bucketed scope from before)

    def __post_init__(self) -> None:
        check_scope_name(self.name)
        if not isinstance(self.unit, str) or not self.unit.strip():
            raise SpecError(f"scope {self.name!r}: 'unit' must say in words what one privacy unit is "
                            "(e.g. \"a user's events on one day\")")
        if not isinstance(self.unit_column, str) or not self.unit_column.strip():
            raise SpecError(f"scope {self.name!r}: 'unit_column' must name the column holding the unit id")
        if (self.epsilon is None) == (self.rho is None):
            raise SpecError(f"scope {self.name!r}: set exactly one cap, 'epsilon' or 'rho' (zCDP)")
        if self.bucket is not None and self.bucket not in BUCKET_SIZES:
            raise SpecError(f"scope {self.name!r}: bucket must be one of {BUCKET_SIZES} or None, got {self.bucket!r}")
        if self.unit_period is not None and self.unit_period not in BUCKET_SIZES:
            raise SpecError(f"scope {self.name!r}: unit_period must be one of {BUCKET_SIZES} or None, "
                            f"got {self.unit_period!r}")
        if self.bucket is not None and self.unit_period != self.bucket:
            raise SpecError(
                f"scope {self.name!r}: a scope may be bucketed by {self.bucket} only if its privacy unit is itself "
                f"scoped to one {self.bucket} (e.g. a user-{self.bucket}); declare unit_period={self.bucket!r} "
                f"to state that, or remove the bucket (got unit_period={self.unit_period!r})"
            )
        if self.adjacency is not None and self.adjacency not in ADJACENCIES:
            raise SpecError(f"scope {self.name!r}: adjacency must be one of {ADJACENCIES}, got {self.adjacency!r}")
        if not isinstance(self.record_level, bool):
            raise SpecError(f"scope {self.name!r}: record_level must be true or false, got {self.record_level!r}")
        for text, what in ((self.owner, "owner"), (self.description, "description"), (self.accountant, "accountant")):
            if not isinstance(text, str):
                raise SpecError(f"scope {self.name!r}: {what} must be a string, got {text!r}")
        if self.time_rule is not None:
            if not isinstance(self.time_rule, TimeRule):
                raise SpecError(f"scope {self.name!r}: time_rule must be a TimeRule, got {self.time_rule!r}")
            if self.time_rule.column == self.unit_column:
                raise SpecError(f"scope {self.name!r}: the time column {self.time_rule.column!r} cannot also be "
                                "the unit column")

    def to_dict(self) -> dict[str, Any]:
        """The stored (hashed) JSON form; fields added later are left out at their legacy values."""
        # The stored (hashed) form of a scope predates ``adjacency`` and ``record_level``: leave them
        # out at their legacy values so that a scope written before they existed reads back and
        # re-serialises byte for byte (the ledger's verify compares the stored definition).
        out = asdict(self)
        if out["adjacency"] is None:
            del out["adjacency"]
        if out["record_level"] is False:
            del out["record_level"]
        if out["time_rule"] is None:
            del out["time_rule"]
        return out

    @property
    def unit_definition(self) -> dict[str, Any]:
        """The whole unit definition a release must match (shown by ``ledger scope show`` and manifests)."""
        return {"unit_column": self.unit_column, "record_level": self.record_level, "adjacency": self.adjacency,
                "period": self.unit_period, "bucket": self.bucket,
                "time": self.time_rule.to_dict() if self.time_rule is not None else None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScopeDefinition:
        """Parse the stored form; an unknown field is refused rather than dropped (it may carry a limit)."""
        known = set(cls.__dataclass_fields__)
        extra = set(data) - known
        if extra:
            raise SpecError(f"scope definition: unknown field(s) {sorted(extra)}; known: {sorted(known)}")
        fields = dict(data)
        if fields.get("time_rule") is not None:
            fields["time_rule"] = TimeRule.from_dict(fields["time_rule"])
        return cls(**fields)

    @property
    def cap(self) -> float:
        """The cap value: rho for a zCDP cap, else epsilon."""
        return float(self.rho if self.rho is not None else self.epsilon)  # type: ignore[arg-type]

    @property
    def cap_unit(self) -> str:
        """``"rho"`` or ``"epsilon"``: the unit of ``cap`` and of every figure in the scope's status."""
        return "rho" if self.rho is not None else "epsilon"


def definition_set_by(kind: str, data: Any) -> dict[str, Any] | None:
    """The scope definition (stored form) an entry of ``kind`` puts in force, or None if it sets none.

    One owner for "which entries change a scope's definition": the ledger's replay (verify, import) and
    the manifest checks (definition in force at an entry) all read it from here.
    """
    field_name = SCOPE_DEFINITION_ENTRIES.get(kind)
    if field_name is None or not isinstance(data, dict):
        return None
    value = data.get(field_name)
    return value if isinstance(value, dict) else None


@dataclass(frozen=True)
class RunKey:
    """What makes a run unique; the same key always means the same noise (semantics.md section 3)."""

    release: str
    spec_hash: str
    interval_start: str
    interval_end: str
    input_fingerprint: str
    key_id: str

    def __post_init__(self) -> None:
        for name in ("release", "spec_hash", "input_fingerprint", "key_id"):
            _nonempty(getattr(self, name), f"run key {name}")
        start = parse_utc(self.interval_start, "run key interval_start")
        end = parse_utc(self.interval_end, "run key interval_end")
        if not start < end:
            raise InvalidParameter(
                f"run key interval [{self.interval_start}, {self.interval_end}) is empty: start must be before end"
            )

    def to_dict(self) -> dict[str, str]:
        """The key as stored in the ledger (intervals as given; ``run_id`` normalises them)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunKey:
        """Rebuild a key from its stored form (extra fields are ignored)."""
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})

    @property
    def start_utc(self) -> str:
        """``interval_start`` in the one UTC spelling."""
        return normalize_utc(self.interval_start)

    @property
    def end_utc(self) -> str:
        """``interval_end`` in the one UTC spelling."""
        return normalize_utc(self.interval_end)

    @property
    def run_id(self) -> str:
        """sha256 of the canonical key, intervals normalised to UTC (so spelling cannot double-charge)."""
        body = {
            "schema": "dpops.runkey/1",
            "release": self.release,
            "spec_hash": self.spec_hash,
            "interval_start": self.start_utc,
            "interval_end": self.end_utc,
            "input_fingerprint": self.input_fingerprint,
            "key_id": self.key_id,
        }
        return hashlib.sha256(canonical_json(body).encode()).hexdigest()[:32]


@dataclass
class RunRecord:
    """A run as the ledger holds it: its key, scope, state, the events it reserved, and its entries in the chain."""

    run_id: str
    key: RunKey
    scope: str
    state: str
    events: list[PrivacyEvent]
    buckets: list[str]
    restates: str | None
    output_uri: str | None
    entry_ids: list[int]
    entry_hashes: list[str]
    created_at: str
    updated_at: str
    epsilon: float  # this run alone, at the scope's delta, as the scope's accountant composes it
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BucketStatus:
    """Budget use of one bucket of a scope (see ScopeStatus for what each figure composes)."""

    bucket: str
    committed: float
    spent_unpublished: float
    started: float
    reserved: float
    total: float
    remaining: float
    runs: dict[str, int]


@dataclass(frozen=True)
class ScopeStatus:
    """Budget use of a scope. ``unit`` says whether the numbers are epsilon (at ``delta``) or zCDP rho.

    Each figure is the accountant's composition of that group of runs alone; ``total``
    composes everything charged (committed, spent-unpublished, started and reserved).
    For a bucketed scope the top-level figures are those of the fullest bucket.
    """

    scope: str
    accountant: str
    unit: str
    cap: float
    delta: float
    committed: float
    spent_unpublished: float
    started: float
    reserved: float
    total: float
    remaining: float
    buckets: list[BucketStatus]

    @property
    def remaining_epsilon(self) -> float | None:
        """``remaining`` when the cap is an epsilon, else None."""
        return self.remaining if self.unit == "epsilon" else None

    @property
    def total_epsilon(self) -> float | None:
        """``total`` when the cap is an epsilon, else None."""
        return self.total if self.unit == "epsilon" else None

    def to_dict(self) -> dict[str, Any]:
        """JSON form; infinite figures become null."""
        return _finite_or_none(asdict(self))


@dataclass(frozen=True)
class PlanItem:
    """One run of a budget plan: its cost alone and whether it still fits after the runs planned before it."""

    interval_start: str
    interval_end: str
    buckets: list[str]
    cost: float  # this run alone (epsilon at the scope delta, or rho)
    fits: bool
    total_after: float  # fullest touched bucket after this run, if it is admitted
    remaining_after: float
    reason: str = ""


@dataclass(frozen=True)
class PlanResult:
    """``ledger.plan``: what a sequence of runs would cost against a scope, without reserving anything."""

    scope: str
    unit: str
    cap: float
    delta: float
    items: list[PlanItem]

    @property
    def fits_all(self) -> bool:
        """Every planned run fits."""
        return all(i.fits for i in self.items)

    @property
    def admitted(self) -> int:
        """How many planned runs fit."""
        return sum(1 for i in self.items if i.fits)

    def to_dict(self) -> dict[str, Any]:
        """JSON form with ``fits_all`` and ``admitted``; infinite figures become null."""
        out = _finite_or_none(asdict(self))
        out["fits_all"] = self.fits_all
        out["admitted"] = self.admitted
        return out


@dataclass(frozen=True)
class Entry:
    """One hash-chained ledger entry: ``hash`` covers ``prev_hash`` and the entry's content."""

    id: int
    ts: str
    kind: str
    scope: str | None
    run_id: str | None
    buckets: list[str]
    actor: str
    data: dict[str, Any]
    prev_hash: str
    hash: str
    # The database role that wrote the entry (PostgreSQL session_user, recorded by the database; part of the
    # hashed body). None: SQLite (no roles) or written before schema version 3.
    writer: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form (all fields)."""
        return asdict(self)


@dataclass
class VerifyReport:
    """Result of ``ledger verify``: the chain, the tables against a replay of the entries, and the anchors."""

    ok: bool
    entries: int
    head_hash: str
    first_bad_entry: int | None = None
    problems: list[str] = field(default_factory=list)
    totals: dict[str, Any] = field(default_factory=dict)  # per scope/bucket, replayed from the entries
    anchors: dict[str, Any] = field(default_factory=dict)  # the checkpoints / expected heads checked, if any
    # Who wrote the owner-only entries: the owner role, writers per kind, entries without a recorded writer
    writers: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (all fields)."""
        return asdict(self)


def _finite_or_none(obj: Any) -> Any:
    """JSON has no infinity: an infinite epsilon (e.g. Gaussian noise at delta=0) is reported as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite_or_none(v) for v in obj]
    return obj


# --- period buckets -----------------------------------------------------------------------------

_MAX_BUCKETS_PER_RUN = 1000


def _bucket_label(day: date, size: str) -> str:
    if size == "day":
        return day.isoformat()
    if size == "week":
        iso = day.isocalendar()
        return f"{iso.year:04d}-W{iso.week:02d}"
    return f"{day.year:04d}-{day.month:02d}"


def bucket_labels(size: str | None, interval_start: str, interval_end: str) -> list[str]:
    """The period buckets the half-open interval [start, end) touches, in order (UTC calendar).

    A run spanning two days of a daily scope touches (and is charged in) both.
    """
    if size is None:
        return [UNBUCKETED]
    start = parse_utc(interval_start, "interval_start")
    last = parse_utc(interval_end, "interval_end") - timedelta(microseconds=1)  # end is exclusive
    labels: list[str] = []
    day = start.date()
    while day <= last.date():
        label = _bucket_label(day, size)
        if not labels or labels[-1] != label:
            labels.append(label)
            if len(labels) > _MAX_BUCKETS_PER_RUN:
                raise InvalidParameter(
                    f"interval [{interval_start}, {interval_end}) spans more than {_MAX_BUCKETS_PER_RUN} "
                    f"{size} buckets; split it into shorter runs"
                )
        day += timedelta(days=1)
    return labels
