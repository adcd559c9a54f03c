"""The scope's budget position as a manifest records it, and its recomputation from ledger entries.

At manifest time the position is read from ``ledger.status``. ``verify`` rebuilds
the same figures independently: it replays the scope's entries up to the recorded
last entry (each run's state is the kind of its latest entry), composes each group
of runs (committed, spent-unpublished, started, reserved, and all of them) with the
scope's pinned accountant, and compares. A dropped, added or altered release in
the history changes the replay and fails verification.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Iterable, Mapping, Sequence

from dpops.events import canonical_json

GROUPS = ("committed", "spent_unpublished", "started", "reserved")
RUN_ENTRY_KINDS = ("reserved", "started", "committed", "spent_unpublished", "released")


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def history_digest(entries: Iterable[Any]) -> tuple[int, str]:
    pairs = [[int(e.id), str(e.hash)] for e in entries]
    return len(pairs), hashlib.sha256(canonical_json(pairs).encode()).hexdigest()


def scope_position(ledger: Any, scope_name: str, buckets: Sequence[str] | None = None) -> dict[str, Any]:
    """The manifest's ``privacy.scope`` block, read from the ledger now (after this run's latest transition)."""
    scope = ledger.scope(scope_name)
    status = ledger.status(scope_name)
    entries = list(ledger.history(scope_name))
    count, digest = history_digest(entries)
    by_bucket = {b.bucket: b for b in (status.buckets or [])}
    wanted = list(buckets) if buckets else (list(by_bucket) or ["*"])
    rows = []
    for b in wanted:
        src = by_bucket.get(b, status if not by_bucket or b == "*" else None)
        if src is None:  # a bucket the status does not list has nothing charged yet
            rows.append({"bucket": b, **{g: 0.0 for g in GROUPS}, "total": 0.0, "remaining": _num(scope.cap)})
            continue
        rows.append({"bucket": b, **{g: _num(getattr(src, g)) for g in GROUPS},
                     "total": _num(src.total), "remaining": _num(src.remaining)})
    return {
        "name": scope.name,
        "unit": scope.unit,
        # The whole unit definition the release was checked against (issue 11 item 1).
        "definition": dict(scope.unit_definition),
        "accountant": scope.accountant,
        "cap": {"unit": scope.cap_unit, "value": float(scope.cap), "delta": float(scope.delta)},
        "buckets": rows,
        "history": {
            "through_entry_id": int(entries[-1].id) if entries else None,
            "through_entry_hash": str(entries[-1].hash) if entries else None,
            "entries": count,
            "digest": digest,
        },
    }


def replay_position(ledger: Any, recorded: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Recompute ``recorded`` (a manifest's ``privacy.scope``) from the ledger's entries; return (position, problems)."""
    from dpops.ledger.budget import measure_events  # the same number the ledger compares with the cap

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
    if "definition" in recorded and recorded["definition"] != scope.unit_definition:
        problems.append(f"privacy.scope.definition: manifest says {recorded['definition']}, the ledger's scope "
                        f"defines its unit as {scope.unit_definition}")
    if scope.accountant != recorded["accountant"]:
        problems.append(f"privacy.scope.accountant: manifest says {recorded['accountant']}, "
                        f"the ledger's scope uses {scope.accountant}")

    state: dict[str, str] = {}
    for e in entries:
        if e.run_id and e.kind in RUN_ENTRY_KINDS:
            state[e.run_id] = e.kind
    runs = {rid: ledger.run(rid) for rid in state}
    acct_scope = scope
    from dpops.accounting import get_accountant

    acct = get_accountant(recorded["accountant"]) if "/" in recorded["accountant"] else get_accountant(scope.accountant)
    rows = []
    for row in recorded["buckets"]:
        b = row["bucket"]
        members = {g: [] for g in GROUPS}
        for rid, st in state.items():
            rec = runs.get(rid)
            if rec is None or st not in members:
                continue
            if b != "*" and b not in (rec.buckets or []):
                continue
            members[st].extend(rec.events)
        out = {"bucket": b}
        for g in GROUPS:
            out[g] = _num(measure_events(acct, acct_scope, members[g]))
        every = [e for g in GROUPS for e in members[g]]
        out["total"] = _num(measure_events(acct, acct_scope, every))
        out["remaining"] = None if out["total"] is None else float(scope.cap) - out["total"]
        rows.append(out)
    return {"buckets": rows}, problems
