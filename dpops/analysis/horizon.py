"""The horizon view: how long a release's schedule lasts on its scope, under every accountant dpops ships.

For the spec's per-run events (``plan_release``), the scope's cap and what the scope has already
charged, it answers: how many more intervals fit, on which date the cap is reached, and what the
total epsilon is after N intervals -- under basic, zCDP, RDP and PLD composition. N runs of the
same plan compose as ``SelfComposed(event, N)`` per event, exactly as the ledger would compose N
reservations (each accountant handles repetition itself, e.g. RDP adds orders, PLD self-convolves).
Nothing is written and no data is read: this is arithmetic on public parameters.

A period-bucketed scope (a user-day unit) gives each period its own cap: one run per period never
composes with another period's, so the schedule never reaches the cap as long as one run fits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from dpops.errors import InvalidParameter
from dpops.events import PrivacyEvent, SelfComposed

if TYPE_CHECKING:
    from dpops.release_plan import ReleasePlan
    from dpops.spec import ReleaseSpec

ACCOUNTANTS = ("basic/1", "zcdp/1", "rdp/1", "pld/1")
MAX_INTERVALS = 100_000  # the search for "how many fit" stops here ("more than")
MAX_DATE_STEPS = 20_000  # dates further than this many intervals away are not computed


@dataclass(frozen=True)
class HorizonRow:
    """One accountant's view of the schedule."""

    accountant: str
    per_interval: float | None  # one run alone (epsilon at delta, or rho for a rho cap)
    total_after: float | None  # already spent + N runs
    intervals_fit: int | None  # how many more runs fit under the cap (None: no cap known)
    more_than: bool = False  # intervals_fit is MAX_INTERVALS and more would fit
    cap_reached_on: str | None = None  # start of the first interval that would not fit
    note: str = ""


@dataclass(frozen=True)
class Horizon:
    """The horizon of one spec on its scope."""

    scope: str
    cap: float | None
    cap_unit: str  # "epsilon" | "rho"
    delta: float
    scope_accountant: str | None
    spent_source: str  # where "already spent" came from
    intervals: int  # N of total_after
    start: str
    schedule: str | None
    bucketed: str | None
    rows: list[HorizonRow] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (infinities as None)."""
        d = asdict(self)
        for r in d["rows"]:
            for k in ("per_interval", "total_after"):
                if isinstance(r[k], float) and not math.isfinite(r[k]):
                    r[k] = None
        return d


def _measure(ref: str, events: Sequence[PrivacyEvent], delta: float, unit: str) -> float:
    from dpops.accounting import get_accountant

    acct = get_accountant(ref)
    if not events:
        return 0.0
    try:
        if unit == "rho":
            from dpops.ledger.budget import state_rho

            return state_rho(acct, acct.add_events(acct.empty_state(), list(events)))
        return float(acct.epsilon(list(events), delta))
    except (ValueError, ZeroDivisionError, OverflowError):
        return math.inf


def repeated(events: Sequence[PrivacyEvent], n: int) -> list[PrivacyEvent]:
    """n runs of the same events, as the ledger composes them."""
    if n <= 0:
        return []
    return list(events) if n == 1 else [SelfComposed(e, n) for e in events]


def interval_start_after(spec: ReleaseSpec, start: datetime, k: int) -> datetime | None:
    """The start of the k-th interval (0-based) of the spec's period or schedule from the one containing ``start``."""
    from dpops.spec import aligned_bounds

    b = aligned_bounds(spec, start)
    if b is None:
        return None
    t = b[0]
    for _ in range(k):
        nb = aligned_bounds(spec, b[1])
        if nb is None:
            return None
        b = nb
        t = b[0]
    return t


def horizon(spec: ReleaseSpec, plan: ReleasePlan, *, cap: float | None, cap_unit: str = "epsilon",
            delta: float | None = None, spent: Sequence[PrivacyEvent] = (), spent_source: str = "",
            intervals: int = 365, start: datetime | None = None, accountants: Sequence[str] = ACCOUNTANTS,
            scope_accountant: str | None = None, bucket: str | None = None) -> Horizon:
    """The horizon of ``plan``'s schedule on a scope with ``cap`` (see the module docstring).

    ``spent``: the events the scope has already charged (the ledger's runs), composed under each
    accountant with the new runs. ``delta``: the scope's delta (default the spec's).
    """
    if cap_unit not in ("epsilon", "rho"):
        raise InvalidParameter(f"cap unit must be 'epsilon' or 'rho', got {cap_unit!r}")
    if isinstance(intervals, bool) or not isinstance(intervals, int) or intervals < 1:
        raise InvalidParameter(f"the number of intervals must be an integer >= 1, got {intervals!r}")
    d = float(spec.budget.delta if delta is None else delta)
    t0 = (start or datetime.now(UTC)).astimezone(UTC)
    from dpops.analysis.estimate import option_events

    per_run = list(plan.events) + option_events(spec)  # bounds: estimate: each interval's estimation too
    rows: list[HorizonRow] = []
    from dpops.accounting import get_accountant

    for ref in [get_accountant(a).ref for a in accountants]:  # "rdp" -> "rdp/1": rows name the pinned version
        if cap_unit == "rho" and not ref.startswith("zcdp"):
            rows.append(HorizonRow(ref, None, None, None, note="the scope caps zCDP rho: only a zcdp accountant "
                                                                  "measures it"))
            continue
        one = _measure(ref, per_run, d, cap_unit)
        if math.isinf(one):
            # The accountant cannot certify even one run at this delta (zCDP or RDP at delta = 0: a pure-DP
            # scope): say so, instead of "0 intervals fit, cap reached today" (issue 28 item 12).
            why = ("the scope is pure DP (delta = 0), which this accountant cannot certify: its (epsilon, delta) "
                   "conversion needs delta > 0" if d == 0 else f"this accountant cannot measure one run at delta {d:g}")
            rows.append(HorizonRow(ref, None, None, None, note=why))
            continue
        if bucket is not None:
            total = _measure(ref, list(spent) + per_run, d, cap_unit)
            fits = cap is None or total <= cap * (1 + 1e-12)
            rows.append(HorizonRow(ref, one, total, None if cap is None else (MAX_INTERVALS if fits else 0),
                                   more_than=fits and cap is not None,
                                   note=f"each {bucket} is its own bucket with its own cap: runs of different "
                                        f"{bucket}s do not compose" + ("" if fits else "; one run exceeds the cap")))
            continue
        total = _measure(ref, list(spent) + repeated(per_run, intervals), d, cap_unit)
        fit: int | None = None
        more = False
        when: str | None = None
        if cap is not None:
            def ok(k: int, ref: str = ref, cap: float = cap) -> bool:
                return _measure(ref, list(spent) + repeated(per_run, k), d, cap_unit) <= cap * (1 + 1e-12)

            if not ok(0):
                fit = 0
            else:
                lo, hi = 0, 1
                while ok(hi):
                    lo, hi = hi, hi * 2
                    if hi > MAX_INTERVALS:
                        more = True
                        break
                while not more and hi - lo > 1:
                    mid = (lo + hi) // 2
                    if ok(mid):
                        lo = mid
                    else:
                        hi = mid
                fit = MAX_INTERVALS if more else lo
            if fit is not None and not more and fit <= MAX_DATE_STEPS:
                t = interval_start_after(spec, t0, fit)
                when = None if t is None else t.strftime("%Y-%m-%dT%H:%M:%SZ")
        rows.append(HorizonRow(ref, one, total, fit, more_than=more, cap_reached_on=when))
    return Horizon(scope=spec.budget.scope, cap=cap, cap_unit=cap_unit, delta=d, scope_accountant=scope_accountant,
                   spent_source=spent_source, intervals=intervals, start=t0.strftime("%Y-%m-%dT%H:%M:%SZ"),
                   schedule=spec.schedule or (f"one run per {spec.privacy_unit.period}" if spec.privacy_unit.period
                                              else None),
                   bucketed=bucket, rows=rows)


__all__ = ["ACCOUNTANTS", "Horizon", "HorizonRow", "horizon", "repeated", "interval_start_after"]
