"""The cap rule: whether a reservation's events, on top of a scope bucket's history, fit the scope's cap.

One owner, two callers: ``Ledger.reserve`` (``store.py``) checks before it writes the reservation and, on
PostgreSQL, the database itself checks every reservation entry a non-owner role inserts (``db_cap.py``: a
superuser-installed PL/Python function runs this module's ``check_cap`` inside the server). The rule lives
apart from both so that neither imports the other: the database's check needs the rule, not the ledger's
write path, and the ledger's schema installs the check.

Privacy reason: everything read here (``runs``, ``run_charges``, ``scopes``) is derived from the hashed entries
by the owner's trigger on PostgreSQL, so nothing the application role can write feeds the comparison with the
cap (issue 25 item 8).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from dpops.accounting import Accountant
from dpops.errors import BudgetExceeded, InvalidParameter
from dpops.events import PrivacyEvent, SelfComposed, event_from_dict, event_to_dict
from dpops.ledger import budget
from dpops.ledger.backend import Backend
from dpops.ledger.budget import format_budget
from dpops.ledger.model import OPEN_STATES, UNBUCKETED, ScopeDefinition


class ScopeBudgetExceeded(BudgetExceeded):
    """A reservation refused by the cap; the numbers are in the scope's cap unit (epsilon or rho)."""

    def __init__(self, scope: str, bucket: str, unit: str, cap: float, spent: float, reserved: float,
                 requested: float, would_remain: float, left: float | None = None) -> None:
        self.scope, self.bucket, self.unit = scope, bucket, unit
        self.cap, self.spent, self.reserved = cap, spent, reserved
        self.requested, self.would_remain = requested, would_remain
        # cap - (everything charged or in flight on THIS bucket, composed): what was left before this request
        self.left = cap - spent - reserved if left is None else left
        where = f"scope {scope!r}" + (f" bucket {bucket}" if bucket != UNBUCKETED else "")
        f = lambda x: format_budget(x, cap)  # noqa: E731 - one precision for every number of the message
        super().__init__(
            f"budget refused on {where}: cap {unit}={format_budget(cap)}, spent {f(spent)}, reserved {f(reserved)}, "
            f"{f(self.left)} left, requested {format_budget(requested)}, would remain {f(would_remain)} (composed by "
            "the scope's accountant); nothing was charged"
        )


def open_runs(db: Backend, scope: str) -> list[tuple[str, str, list[str], list[PrivacyEvent]]]:
    """(run_id, state, buckets, events) of every reserved or started run of ``scope``: charged until settled."""
    rows = db.all("SELECT run_id, state, buckets, events FROM runs WHERE scope = ? AND state IN (?, ?)",
                  (scope, *OPEN_STATES))
    return [(r[0], r[1], json.loads(r[2]), [event_from_dict(d) for d in json.loads(r[3])]) for r in rows]


def bucket_states(db: Backend, scope: str, buckets: Sequence[str], acct: Accountant, parts: bool = False
                  ) -> dict[str, dict[str, Any]]:
    """Per bucket, the accountant states of its settled runs (``settled`` = ``committed`` + ``spent``), composed
    from the ``runs`` rows on every call.

    Privacy reason (issue 25 item 8): the cap check, ``status`` and ``plan`` read nothing the application role
    can write. On PostgreSQL ``runs`` is written only by the owner's trigger from the hashed entries (schema
    version 4); the running-state cache ``buckets`` that the app role could reset is gone. Rows with equal
    events are kept grouped by the database in ``run_charges`` (on PostgreSQL by the same owner trigger),
    parsed once and composed as one ``SelfComposed`` event (the n-fold
    composition, exactly what n runs charge), so the cost grows with the number of distinct event lists of
    the bucket, not with its history. The caller
    holds the scope row lock (write transactions) or a snapshot (reads). ``parts``: also ``committed`` and
    ``spent`` on their own (``status``); the cap check needs only ``settled``, one composition.
    """
    wanted = set(buckets)
    parsed: dict[str, list[PrivacyEvent]] = {}
    events: dict[str, dict[str, list[PrivacyEvent]]] = {b: {"committed": [], "spent": []} for b in wanted}
    # grouped by the database as runs settle (schema version 4: the owner's trigger on PostgreSQL)
    rows = db.all("SELECT state, buckets, events, runs FROM run_charges WHERE scope = ? ORDER BY state, digest",
                  (scope,))
    for state, bjson, ejson, n in rows:
        hit = wanted.intersection(json.loads(bjson))
        if not hit:
            continue
        if ejson not in parsed:
            parsed[ejson] = [event_from_dict(d) for d in json.loads(ejson)]
        # n runs with these same events: their n-fold composition, which every accountant composes at once
        group = parsed[ejson] if int(n) == 1 else [SelfComposed(event=e, count=int(n)) for e in parsed[ejson]]
        for b in hit:
            events[b]["committed" if state == "committed" else "spent"].extend(group)
    out = {}
    for b in sorted(wanted):
        if not parts:
            out[b] = {"settled": acct.add_events(acct.empty_state(), events[b]["committed"] + events[b]["spent"])}
            continue
        committed = acct.add_events(acct.empty_state(), events[b]["committed"])
        spent = acct.add_events(acct.empty_state(), events[b]["spent"])
        out[b] = {"settled": acct.add_events(committed, events[b]["spent"]), "committed": committed,
                  "spent": spent}
    return out


def check_cap(db: Backend, sdef: ScopeDefinition, acct: Accountant, buckets: Sequence[str],
              events: Sequence[PrivacyEvent]) -> None:
    """Raise ScopeBudgetExceeded unless ``events``, on top of every settled and open run of each of ``buckets``,
    composed by the scope's accountant, fit the scope's cap.

    The one cap rule, with two callers: ``Ledger.reserve`` (before it writes the reservation) and, on
    PostgreSQL, the database itself (``dpops.ledger.db_cap``: a trigger runs this same function on every
    reservation entry a non-owner role inserts, so a reservation written around dpops is refused too). Both read
    only what the application role cannot write (``runs`` and ``run_charges``, derived by the owner's trigger)
    under the scope row's lock, so both see the same history and reach the same answer.
    """
    states = bucket_states(db, sdef.name, buckets, acct)
    in_flight = open_runs(db, sdef.name)
    evs = list(events)
    for b in buckets:
        open_events = [e for _, _, rb, revs in in_flight if b in rb for e in revs]
        total = budget.measure(acct, sdef, acct.add_events(states[b]["settled"], open_events + evs))
        if not budget.within_cap(total, sdef.cap):
            spent = budget.measure(acct, sdef, states[b]["settled"])
            before = budget.measure(acct, sdef, acct.add_events(states[b]["settled"], open_events)) \
                if open_events else spent
            raise ScopeBudgetExceeded(
                sdef.name, b, sdef.cap_unit, sdef.cap, spent, budget.measure_events(acct, sdef, open_events),
                budget.measure_events(acct, sdef, evs), sdef.cap - total, left=sdef.cap - before,
            )


def coerce_events(events: Any) -> list[PrivacyEvent]:
    """Privacy events (objects or their JSON dicts), validated; at least one."""
    if isinstance(events, (str, bytes)) or not isinstance(events, Sequence) or not events:
        raise InvalidParameter("events must be a non-empty list of privacy events (dpops.events)")
    out = []
    for i, ev in enumerate(events):
        try:
            out.append(event_from_dict(ev) if isinstance(ev, dict) else event_from_dict(event_to_dict(ev)))
        except InvalidParameter as exc:
            raise InvalidParameter(f"events[{i}]: {exc}") from None
    return out
