"""The scope's budget position as a manifest records it, and its recomputation from ledger entries.

At manifest time the position is read from ``ledger.status``. ``verify`` rebuilds
the same figures independently: it replays the scope's entries up to the recorded
last entry (each run's state is the kind of its latest entry), composes each group
of runs (committed, spent-unpublished, started, reserved, and all of them) with the
scope's pinned accountant at the cap and delta in force at that entry (a later
legitimate cap change does not alter an old manifest's figures), and compares. A dropped, added or altered release in
the history changes the replay and fails verification.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dpops.events import PrivacyEvent, canonical_json

if TYPE_CHECKING:  # types only: the ledger is imported lazily, inside the functions that use it
    from dpops.accounting.base import Accountant
    from dpops.ledger.model import Entry, ScopeDefinition
    from dpops.ledger.store import Ledger

GROUPS = ("committed", "spent_unpublished", "started", "reserved")
RUN_ENTRY_KINDS = ("reserved", "started", "committed", "spent_unpublished", "released")


def _num(x: object) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def history_digest(entries: Iterable[Entry]) -> tuple[int, str]:
    """(number of entries, SHA-256 of their [id, hash] pairs): pins exactly which history a position was read from.

    The entry hashes chain, so the pairs alone identify the content; a dropped or inserted entry changes both.
    """
    pairs = [[int(e.id), str(e.hash)] for e in entries]
    return len(pairs), hashlib.sha256(canonical_json(pairs).encode()).hexdigest()


def scope_position(ledger: Ledger, scope_name: str, buckets: Sequence[str] | None = None) -> dict[str, Any]:
    """The manifest's ``privacy.scope`` block, read from the ledger now (after this run's latest transition).

    The figures are computed from the scope's entries themselves (one read), exactly as ``replay_position``
    recomputes them, so a run reserved concurrently between two reads can never make the manifest
    disagree with its own history (a false alarm at verification during a backfill).
    """
    from dpops.accounting import get_accountant

    scope = ledger.scope(scope_name)
    entries = list(ledger.history(scope_name))
    count, digest = history_digest(entries)
    in_force = scope_in_force(entries) or scope
    if buckets:
        wanted = list(buckets)
    else:
        wanted = [b.bucket for b in (ledger.status(scope_name).buckets or [])] or ["*"]
    rows = _replay_rows(ledger, entries, get_accountant(in_force.accountant), in_force, wanted)
    return {
        "name": in_force.name,
        "unit": in_force.unit,
        # The whole unit definition the release was checked against (issue 11 item 1).
        "definition": dict(in_force.unit_definition),
        "accountant": in_force.accountant,
        "cap": {"unit": in_force.cap_unit, "value": float(in_force.cap), "delta": float(in_force.delta)},
        "buckets": rows,
        "history": {
            "through_entry_id": int(entries[-1].id) if entries else None,
            "through_entry_hash": str(entries[-1].hash) if entries else None,
            "entries": count,
            "digest": digest,
        },
    }


def _replay_rows(ledger: Ledger, entries: Sequence[Entry], acct: Accountant, sdef: ScopeDefinition,
                 bucket_names: Sequence[str]) -> list[dict[str, Any]]:
    """Per bucket: each group of runs (by the kind of its latest entry among ``entries``) composed alone,
    all of them together, and what remains under ``sdef``'s cap (at ``sdef``'s delta)."""
    from dpops.ledger.budget import measure_events  # the same number the ledger compares with the cap

    state: dict[str, str] = {}
    for e in entries:
        if e.run_id and e.kind in RUN_ENTRY_KINDS:
            state[e.run_id] = e.kind
    runs = {rid: ledger.run(rid) for rid in state}
    rows = []
    for b in bucket_names:
        members: dict[str, list[PrivacyEvent]] = {g: [] for g in GROUPS}
        for rid, st in state.items():
            rec = runs.get(rid)
            if rec is None or st not in members:
                continue
            if b != "*" and b not in (rec.buckets or []):
                continue
            members[st].extend(rec.events)
        out: dict[str, Any] = {"bucket": b}
        for g in GROUPS:
            out[g] = _num(measure_events(acct, sdef, members[g]))
        every = [e for g in GROUPS for e in members[g]]
        out["total"] = _num(measure_events(acct, sdef, every))
        out["remaining"] = None if out["total"] is None else float(sdef.cap) - out["total"]
        rows.append(out)
    return rows


def scope_in_force(entries: Sequence[Entry]) -> ScopeDefinition | None:
    """The scope definition in force after ``entries`` (a scope's entries, oldest first): its creation,
    then each entry that sets a new definition (a cap change, a pinned time rule; see
    ``dpops.ledger.model.SCOPE_DEFINITION_ENTRIES``). None if the entries do not create the scope."""
    from dpops.ledger.model import ScopeDefinition, definition_set_by

    sdef: ScopeDefinition | None = None
    for e in entries:
        d = definition_set_by(e.kind, e.data)
        if d is not None and (sdef is not None or e.kind == "scope_created"):
            sdef = ScopeDefinition.from_dict(d)
    return sdef


def expected_definition(recorded: Mapping[str, Any], in_force: ScopeDefinition) -> dict[str, Any]:
    """The unit definition a manifest's ``privacy.scope.definition`` must equal: the scope's in force at the
    manifest's last scope entry. A manifest written before time rules existed has no ``time`` key; it matches
    only while the scope recorded no rule at that point (it then had none to state)."""
    want = dict(in_force.unit_definition)
    if "time" not in recorded and want["time"] is None:
        del want["time"]
    return want


def replay_position(ledger: Ledger, recorded: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Recompute ``recorded`` (a manifest's ``privacy.scope``) from the ledger's entries.

    Returns (position, problems); an empty problem list means the manifest's figures are those of the history.
    """
    problems: list[str] = []
    name = recorded["name"]
    scope = ledger.scope(name)
    through = recorded["history"]["through_entry_id"]
    entries = [e for e in ledger.history(name) if through is not None and int(e.id) <= int(through)]
    count, digest = history_digest(entries)
    hist = recorded["history"]
    if entries and str(entries[-1].hash) != hist["through_entry_hash"]:
        problems.append(f"privacy.scope.history.through_entry_hash: manifest says {hist['through_entry_hash']}, "
                        f"ledger entry {through} has {entries[-1].hash}")
    if count != hist["entries"]:
        problems.append(f"privacy.scope.history.entries: manifest counts {hist['entries']} scope entries up to "
                        f"#{through}, the ledger has {count} (a release was dropped from or added to the history)")
    elif digest != hist["digest"]:
        problems.append("privacy.scope.history.digest: the scope's entry ids/hashes up to "
                        f"#{through} differ from those the manifest was computed from")
    in_force_def = scope_in_force(entries) or scope
    if "definition" in recorded:
        want = expected_definition(recorded["definition"], in_force_def)
        if recorded["definition"] != want:
            problems.append(f"privacy.scope.definition: manifest says {recorded['definition']}, the ledger's scope "
                            f"defined its unit at entry #{through} as {want}")
    if scope.accountant != recorded["accountant"]:
        problems.append(f"privacy.scope.accountant: manifest says {recorded['accountant']}, "
                        f"the ledger's scope uses {scope.accountant}")

    # The cap and delta in force at the manifest's point of the chain, not today's: a legitimate
    # `dpops ledger cap` later must not make an older manifest fail (issue 13), while an edited cap in
    # the manifest is still compared with what the ledger recorded at that point.
    acct_scope = in_force_def
    cap = recorded.get("cap") or {}
    in_force = {"unit": acct_scope.cap_unit, "value": float(acct_scope.cap), "delta": float(acct_scope.delta)}
    for field_name in ("unit", "value", "delta"):
        if cap.get(field_name) != in_force[field_name]:
            problems.append(f"privacy.scope.cap.{field_name}: manifest says {cap.get(field_name)!r}, the ledger's "
                            f"cap in force at entry #{through} is {in_force[field_name]!r}")

    from dpops.accounting import get_accountant

    acct = get_accountant(recorded["accountant"]) if "/" in recorded["accountant"] else get_accountant(scope.accountant)
    rows = _replay_rows(ledger, entries, acct, acct_scope, [row["bucket"] for row in recorded["buckets"]])
    return {"buckets": rows}, problems
