"""The ledger itself: every state change is one transaction that appends a hash-chained entry
and updates the derived tables (scopes, runs) together.

Run life cycle (semantics.md section 4)::

    reserved --start--> started --commit--> committed
        |                   \\--mark_spent_unpublished--> spent_unpublished
        \\--release--> released          (refund: only before any mechanism ran)

One global hash chain: every entry's ``prev_hash`` is the hash of the entry with the
previous id, whatever its scope. It is the simplest to verify and makes a deleted or
reordered entry anywhere visible; the price is that writers serialize on the chain
head for the last few statements of each transaction (a few milliseconds).

Lock order in every write transaction: scope row, chain head (then, on PostgreSQL, the run row the owner's
trigger steps). Nothing the cap check reads is a cache the application role can write (issue 25 item 8):
``runs`` is derived from the entries by the database on PostgreSQL (schema version 4).
"""

from __future__ import annotations

import json
import math
import os
import threading
from contextlib import contextmanager
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import Any, Iterator, Sequence

from dpops.accounting import get_accountant
from dpops.errors import DpopsError, InvalidParameter, LedgerError, SpecError
from dpops.events import PrivacyEvent, canonical_json, event_from_dict, event_to_dict
from dpops.ledger import budget
from dpops.ledger.backend import Backend, connect, hook
from dpops.ledger.cap import bucket_states, check_cap, coerce_events, open_runs
from dpops.ledger.model import (
    CHARGED_STATES,
    OPEN_STATES,
    TRANSITIONS,
    UNBUCKETED,
    BucketStatus,
    Entry,
    PlanItem,
    PlanResult,
    RunKey,
    RunRecord,
    ScopeDefinition,
    ScopeStatus,
    TimeRule,
    VerifyReport,
    bucket_labels,
    check_scope_name,
    normalize_utc,
    utc_now,
)
from dpops.ledger.roles import require_owner
from dpops.ledger.schema import entry_hash, migrate
from dpops.ledger.text import check_free_text, printable
from dpops.param_checks import check_delta_for_population, check_epsilon, check_positive

_RUN_COLS = (
    "run_id, scope, release, interval_start, interval_end, run_key, state, events, buckets, restates, "
    "output_uri, details, entry_ids, entry_hashes, created_at, updated_at, epsilon, last_entry"
)
_ENTRY_COLS = "id, ts, kind, scope, run_id, buckets, actor, body, prev_hash, hash, writer"

# Connections inherited over fork() must never be closed by the child (a PostgreSQL
# terminate message would kill the parent's session): the child keeps them here, unused.
_ORPHANED: list[Backend] = []


def _check_actor(actor: Any) -> str:
    if not isinstance(actor, str) or not actor.strip():
        raise InvalidParameter(f"actor must name who asks (a user or a DAG/task id), got {printable(repr(actor))}")
    return check_free_text(actor, "actor")


def _check_reason(reason: Any) -> str:
    if not isinstance(reason, str) or not reason.strip():
        raise InvalidParameter(f"reason must say why (it is kept in the ledger forever), got {printable(repr(reason))}")
    return check_free_text(reason, "reason")


# Free-text fields of a scope definition an operator reads in `scope show`, `history` and the report.
_SCOPE_TEXT_FIELDS = ("unit", "unit_column", "description", "owner")


def _check_details(details: Any, what: str = "details") -> dict[str, Any]:
    if details is None:
        return {}
    if not isinstance(details, dict):
        raise InvalidParameter(f"{what} must be a JSON object (dict), got {type(details).__name__}")
    try:
        canonical_json(details)
    except (TypeError, ValueError) as exc:
        raise InvalidParameter(f"{what} must be JSON-serialisable without NaN/infinity: {exc}") from None
    return details


def _require_time_rule(scope: ScopeDefinition) -> None:
    """A new bucketed scope states which timestamp puts a row in a period (issue 19 item 1)."""
    if scope.bucket is not None and scope.time_rule is None:
        raise SpecError(
            f"scope {scope.name!r} is bucketed by {scope.bucket}: its buckets compose in parallel only if every "
            f"release puts each row in the same {scope.bucket}, so the scope records which column's time does "
            f"that: give the time column (dpops ledger scope create ... --time-column ts), the one every "
            f"release's input.time_column must name"
        )


class Ledger:
    """The global privacy-budget ledger. Open with ``dpops.ledger.open_ledger(url)``."""

    def __init__(self, url: str | None = None) -> None:
        self._url = url
        self._backend = connect(url)
        self.url = self._backend.url
        self._pid = os.getpid()
        # One connection per Ledger: threads sharing a Ledger take turns for whole transactions.
        self._lock = threading.RLock()
        self.schema_version = migrate(self._backend)

    # --- connection -----------------------------------------------------------------------------
    @property
    def db(self) -> Backend:
        if os.getpid() != self._pid:  # forked: the parent's connection is not ours to use
            _ORPHANED.append(self._backend)
            self._backend = connect(self._url)
            self._pid = os.getpid()
        return self._backend

    def close(self) -> None:
        if os.getpid() == self._pid:
            self._backend.close()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[Backend]:
        with self._lock:
            db = self.db
            with db.transaction(write=True):
                yield db

    @contextmanager
    def snapshot(self) -> Iterator[Backend]:
        """One consistent read transaction (under the Ledger's lock): what status, plan, verify and checkpoints read."""
        with self._lock:
            db = self.db
            with db.transaction(write=False):
                yield db

    # --- the chain ------------------------------------------------------------------------------
    def _append(self, db: Backend, kind: str, scope: str | None, run_id: str | None, buckets: list[str],
                actor: str, data: dict[str, Any]) -> tuple[int, str, str]:
        """Append one entry; call last in a write transaction (it locks the chain head)."""
        last_id, last_hash = db.one("SELECT last_id, last_hash FROM chain_head WHERE singleton = 1" + db.for_update)
        new_id, ts = int(last_id) + 1, utc_now()
        body: dict[str, Any] = {"id": new_id, "ts": ts, "kind": kind, "scope": scope, "run_id": run_id,
                                "buckets": buckets, "actor": actor, "data": data}
        # The database role that writes it (PostgreSQL session_user), in the hashed body and its own column; the
        # database refuses a row whose writer is not this session's role (schema.py version 3), so the client
        # cannot claim to be someone else. SQLite: no roles, no writer (the body stays as before).
        writer = db.session_role()
        if writer is not None:
            body["writer"] = writer
        body_text = canonical_json(body)
        digest = entry_hash(last_hash, body_text)
        db.execute(
            f"INSERT INTO entries ({_ENTRY_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (new_id, ts, kind, scope, run_id, json.dumps(buckets), actor, body_text, last_hash, digest, writer),
        )
        db.execute("UPDATE chain_head SET last_id = ?, last_hash = ? WHERE singleton = 1", (new_id, digest))
        return new_id, digest, ts

    # --- scopes ---------------------------------------------------------------------------------
    @staticmethod
    def _validated(scope: ScopeDefinition) -> ScopeDefinition:
        if not isinstance(scope, ScopeDefinition):
            raise SpecError(f"expected a ScopeDefinition, got {type(scope).__name__}")
        for name in _SCOPE_TEXT_FIELDS:
            check_free_text(getattr(scope, name, ""), f"scope {scope.name!r} {name}")
        ref = get_accountant(scope.accountant).ref  # pin "rdp" -> "rdp/1"
        scope = replace(scope, accountant=ref)
        if scope.epsilon is not None:
            check_epsilon(scope.epsilon, f"scope {scope.name!r} epsilon")
            scope = replace(scope, epsilon=float(scope.epsilon))
        if scope.rho is not None:
            check_positive(scope.rho, f"scope {scope.name!r} rho")
            scope = replace(scope, rho=float(scope.rho))
            acct = get_accountant(ref)
            budget.state_rho(acct, acct.empty_state())  # refuses accountants without a rho form
        check_delta_for_population(scope.delta, scope.population, f"scope {scope.name!r} delta")
        return replace(scope, delta=float(scope.delta))

    def normalized_scope(self, scope: ScopeDefinition) -> ScopeDefinition:
        """``scope`` validated and pinned as ``create_scope`` would store it (accountant ``rdp`` -> ``rdp/1``)."""
        return self._validated(scope)

    def create_scope(self, scope: ScopeDefinition, *, actor: str) -> ScopeDefinition:
        """Create a scope; returns the scope's definition in force.

        Creating it again is a no-op when the request equals the definition in force, or the definition it was
        created with and only its cap changed since (``change_cap``): initialisation scripts that run on every
        start (deploy/ledger-init.sh) stay idempotent after a cap raise, and the cap is left alone (issue 21
        item 1). Any other difference is a conflict (LedgerError).

        A new bucketed scope must record its time rule (issue 19 item 1): the parallel composition of
        its buckets holds only if every release puts a row in the same period. The one difference
        accepted against an existing scope is a time rule the existing scope never recorded (a scope
        from before time rules existed): it is pinned, as ``pin_time_rule`` does, with its own entry.
        That keeps an idempotent ``scope create`` (deploy/ledger-init.sh) working on an upgraded ledger.
        """
        _check_actor(actor)
        scope = self._validated(scope)
        definition = canonical_json(scope.to_dict())
        with self._write() as db:
            require_owner(db, "create budget scopes (`dpops ledger scope create`)")
            existing = db.one("SELECT definition FROM scopes WHERE name = ?" + db.for_update, (scope.name,))
            if existing is None:
                _require_time_rule(scope)
                cur = db.execute(
                    "INSERT INTO scopes (name, definition, accountant, last_entry) VALUES (?, ?, ?, 0) "
                    "ON CONFLICT (name) DO NOTHING",
                    (scope.name, definition, scope.accountant),
                )
                if cur.rowcount == 1:
                    eid, _, _ = self._append(db, "scope_created", scope.name, None, [], actor,
                                             {"definition": scope.to_dict()})
                    db.execute("UPDATE scopes SET last_entry = ? WHERE name = ?", (eid, scope.name))
                    return scope
                existing = db.one("SELECT definition FROM scopes WHERE name = ?", (scope.name,))
            elif existing[0] != definition and scope.time_rule is not None:
                old = ScopeDefinition.from_dict(json.loads(existing[0]))
                if old.time_rule is None and replace(old, time_rule=scope.time_rule) == scope:
                    return self._pin(db, old, scope.time_rule, actor=actor,
                                     reason="time rule pinned by scope create (scope recorded before time rules)")
        if existing[0] == definition:
            return scope
        current = ScopeDefinition.from_dict(json.loads(existing[0]))
        original = self._created_definition(scope.name)
        if original is not None and canonical_json(original.to_dict()) == definition:
            # Created exactly as asked; its cap (or delta) was changed since through `dpops ledger cap` (the only
            # way a definition changes, each change an entry): creating what exists is a no-op, the cap stays.
            return current
        base = (original or current).to_dict()  # what it was created with: cap changes are not the difference
        differs = sorted(k for k, v in scope.to_dict().items() if base.get(k) != v)
        raise LedgerError(
            f"scope {scope.name!r} already exists with a different definition (differs in: {', '.join(differs)}; "
            f"see `dpops ledger scope show {scope.name}`): scopes are never redefined; a cap changes with "
            f"`dpops ledger cap {scope.name} --epsilon E --reason ...` (as the owner role), anything else needs a "
            "scope with a new name; nothing was changed"
        )

    def _created_definition(self, name: str) -> ScopeDefinition | None:
        """The definition ``name`` was created with (its ``scope_created`` entry), before any cap change."""
        row = self.db.one("SELECT body FROM entries WHERE kind = 'scope_created' AND scope = ? ORDER BY id LIMIT 1",
                          (name,))
        if row is None:
            return None
        try:
            return self._validated(ScopeDefinition.from_dict(json.loads(row[0])["data"]["definition"]))
        except (DpopsError, KeyError, TypeError, ValueError):
            return None  # a legacy definition that no longer validates: only an identical request is a no-op

    def pin_time_rule(self, name: str, rule: TimeRule, *, reason: str, actor: str) -> ScopeDefinition:
        """Record the time rule of a scope that has none (issue 19 item 1); an entry ``scope_time_pinned``.

        Only ever from "not recorded" to a rule: a recorded rule is never changed (the scope's buckets
        were charged for rows placed by it; another rule would place the same rows in other buckets).
        Pinning the rule it already has is a no-op. It narrows which releases the scope admits, never
        widens it; it says nothing about runs charged before it (the owner reviews those: their
        manifests name each release's spec and time column).
        """
        _check_actor(actor)
        _check_reason(reason)
        if not isinstance(rule, TimeRule):
            raise SpecError(f"expected a TimeRule, got {type(rule).__name__}")
        with self._write() as db:
            require_owner(db, "pin a scope's time rule (`dpops ledger scope pin-time`)")
            old = self._scope_row(db, name, lock=True)
            return self._pin(db, old, rule, actor=actor, reason=reason)

    def _pin(self, db: Backend, old: ScopeDefinition, rule: TimeRule, *, actor: str, reason: str) -> ScopeDefinition:
        if old.time_rule == rule:
            return old
        if old.time_rule is not None:
            raise LedgerError(
                f"scope {old.name!r} already records the time rule {old.time_rule.describe()}; a scope's time rule "
                f"is never changed (its buckets were charged for rows placed by it, and {rule.describe()} would "
                "place the same rows in other buckets): create a new scope for releases that use another one"
            )
        new = replace(old, time_rule=rule)
        eid, _, _ = self._append(db, "scope_time_pinned", old.name, None, [], actor,
                                 {"before": old.to_dict(), "after": new.to_dict(), "reason": reason})
        db.execute("UPDATE scopes SET definition = ?, last_entry = ? WHERE name = ?",
                   (canonical_json(new.to_dict()), eid, old.name))
        return new

    def _scope_row(self, db: Backend, name: str, lock: bool) -> ScopeDefinition:
        check_scope_name(name)
        row = db.one("SELECT definition FROM scopes WHERE name = ?" + (db.for_update if lock else ""), (name,))
        if row is None:
            raise SpecError(f"unknown budget scope {name!r}: create it first (dpops ledger scope create {name} ...)")
        return ScopeDefinition.from_dict(json.loads(row[0]))

    def scope(self, name: str) -> ScopeDefinition:
        return self._scope_row(self.db, name, lock=False)

    def scopes(self) -> list[ScopeDefinition]:
        rows = self.db.all("SELECT definition FROM scopes ORDER BY name")
        return [ScopeDefinition.from_dict(json.loads(r[0])) for r in rows]

    def change_cap(self, name: str, *, epsilon: float | None = None, delta: float | None = None,
                   rho: float | None = None, reason: str, actor: str) -> ScopeDefinition:
        """Set a new cap (epsilon or rho, and/or delta). Lowering it below what is spent only blocks new runs."""
        _check_actor(actor)
        _check_reason(reason)
        if epsilon is not None and rho is not None:
            raise SpecError("give either a new epsilon cap or a new rho cap, not both")
        if epsilon is None and rho is None and delta is None:
            raise SpecError("nothing to change: give epsilon, rho and/or delta")
        with self._write() as db:
            require_owner(db, "change caps (`dpops ledger cap`)")
            old = self._scope_row(db, name, lock=True)
            new = old
            if epsilon is not None:
                new = replace(new, epsilon=epsilon, rho=None)
            if rho is not None:
                new = replace(new, rho=rho, epsilon=None)
            if delta is not None:
                new = replace(new, delta=delta)
            new = self._validated(new)
            if new == old:
                return old
            eid, _, _ = self._append(db, "cap_changed", name, None, [], actor,
                                     {"before": old.to_dict(), "after": new.to_dict(), "reason": reason})
            db.execute("UPDATE scopes SET definition = ?, last_entry = ? WHERE name = ?",
                       (canonical_json(new.to_dict()), eid, name))
        return new

    def record_private_access(self, scope: str, *, actor: str, fingerprint: str, reason: str,
                              purpose: str) -> int:
        """Record that ``actor`` read private data of ``scope`` outside any DP mechanism (entry ``private_access``).

        Nothing is charged and no cap moves: a non-DP look at the data (``dpops tune`` on a private root)
        cannot be expressed as an epsilon, so the ledger keeps the fact instead -- who, when (the entry's
        timestamp), which input (``fingerprint``: the keyed input fingerprint, never a plain hash of the
        content), why, and for what (``purpose``). Replay (``verify``) accepts the entry on an existing scope
        and leaves every budget as it was. Returns the entry id."""
        _check_actor(actor)
        _check_reason(reason)
        if not isinstance(fingerprint, str) or not fingerprint:
            raise InvalidParameter("a private access names its keyed input fingerprint")
        if not isinstance(purpose, str) or not purpose.strip():
            raise InvalidParameter("a private access names its purpose (e.g. 'tune')")
        with self._write() as db:
            self._scope_row(db, scope, lock=True)  # an unknown scope is refused (SpecError naming it)
            eid, _, _ = self._append(db, "private_access", scope, None, [], actor,
                                     {"fingerprint": fingerprint, "reason": reason, "purpose": purpose})
        return eid

    # --- runs: rows -----------------------------------------------------------------------------
    def _run_row(self, db: Backend, run_id: str, lock: bool = False) -> tuple | None:
        return db.one(f"SELECT {_RUN_COLS} FROM runs WHERE run_id = ?", (run_id,))

    @staticmethod
    def _record(row: tuple) -> RunRecord:
        (run_id, scope, _release, _s, _e, key, state, events, buckets, restates, output_uri, details,
         entry_ids, entry_hashes, created_at, updated_at, eps, _last) = row
        return RunRecord(
            run_id=run_id, key=RunKey.from_dict(json.loads(key)), scope=scope, state=state,
            events=[event_from_dict(d) for d in json.loads(events)], buckets=json.loads(buckets),
            restates=restates, output_uri=output_uri, entry_ids=json.loads(entry_ids),
            entry_hashes=json.loads(entry_hashes), created_at=created_at, updated_at=updated_at,
            epsilon=math.inf if eps is None else float(eps), details=json.loads(details),
        )

    def _published_row(self, db: Backend, release: str, start: str, end: str) -> tuple | None:
        return db.one(
            f"SELECT {_RUN_COLS} FROM runs WHERE release = ? AND interval_start = ? AND interval_end = ? "
            "AND state = 'committed' ORDER BY last_entry DESC LIMIT 1",
            (release, start, end),
        )

    # --- runs: reservation --------------------------------------------------------------------------
    def reserve(self, key: RunKey, scope: str, events: Sequence[PrivacyEvent], *, actor: str,
                restates: str | None = None, details: dict | None = None,
                accountant: str | None = None) -> RunRecord:
        """Charge ``events`` to ``scope`` for the run ``key``, or refuse with BudgetExceeded.

        Idempotent: the same run key again returns the existing record (whatever its state)
        without a second charge, provided scope and events are the same (else LedgerError).
        ``accountant``, if given, must be the scope's. A run for an interval that is already
        published must say which publication it restates (``restates=<run_id>``).
        """
        _check_actor(actor)
        if not isinstance(key, RunKey):
            raise InvalidParameter(f"key must be a dpops.ledger.RunKey, got {type(key).__name__}")
        evs = coerce_events(events)
        ev_dicts = [event_to_dict(e) for e in evs]
        details = _check_details(details)
        check_scope_name(scope)
        if restates is not None and (not isinstance(restates, str) or not restates):
            raise InvalidParameter(f"restates must be the run_id of the published run it corrects, got {restates!r}")
        run_id = key.run_id
        existing = self._run_row(self.db, run_id)
        if existing is not None:
            return self._same_run(existing, scope, ev_dicts)
        with self._write() as db:
            sdef = self._scope_row(db, scope, lock=True)
            acct = budget.accountant_for(sdef)
            if accountant is not None and get_accountant(accountant).ref != acct.ref:
                raise SpecError(
                    f"run {run_id} was planned with accountant {get_accountant(accountant).ref} but scope {scope!r} "
                    f"is checked by {acct.ref}: plan the release with the scope's accountant"
                )
            existing = self._run_row(db, run_id)
            if existing is not None:  # reserved concurrently by a twin retry
                return self._same_run(existing, scope, ev_dicts)
            start, end = key.start_utc, key.end_utc
            self._check_restatement(db, key, start, end, restates)
            buckets = bucket_labels(sdef.bucket, start, end)
            check_cap(db, sdef, acct, buckets, evs)
            hook("reserve:locked")
            eps = budget.epsilon_of(acct, sdef, evs)
            # interval_start/end (normalised) and epsilon: what the run cache holds, in the hashed body, so the
            # database derives the cache row from the entry alone (schema version 4) and verify checks them.
            data = {"run_key": key.to_dict(), "events": ev_dicts, "restates": restates, "details": details,
                    "accountant": acct.ref, "interval_start": start, "interval_end": end,
                    "epsilon": eps if math.isfinite(eps) else None}
            eid, digest, ts = self._append(db, "reserved", scope, run_id, buckets, actor, data)
            if db.dialect == "sqlite":  # PostgreSQL: the owner's trigger wrote the row from the entry
                db.execute(
                    f"INSERT INTO runs ({_RUN_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (run_id, scope, key.release, start, end, canonical_json(key.to_dict()), "reserved",
                     canonical_json(ev_dicts), json.dumps(buckets), restates, None, canonical_json(details),
                     json.dumps([eid]), json.dumps([digest]), ts, ts, eps if math.isfinite(eps) else None, eid),
                )
            hook("reserve:before_commit")
            row = self._run_row(db, run_id)
        return self._record(row)

    def _same_run(self, row: tuple, scope: str, ev_dicts: list[dict]) -> RunRecord:
        record = self._record(row)
        if record.scope != scope:
            raise LedgerError(f"run {record.run_id} is already reserved on scope {record.scope!r}, not {scope!r}; "
                              "one run key belongs to one scope")
        if json.loads(row[7]) != ev_dicts:
            raise LedgerError(
                f"run {record.run_id} is already reserved with other events; the same run key must always mean "
                "the same release plan (a changed plan needs a new spec hash)"
            )
        return record

    def _check_restatement(self, db: Backend, key: RunKey, start: str, end: str, restates: str | None) -> None:
        published = self._published_row(db, key.release, start, end)
        if restates is None:
            if published is not None:
                raise LedgerError(
                    f"release {key.release!r} interval [{start}, {end}) is already published as run {published[0]}: "
                    f"serve that result, or restate it explicitly with restates={published[0]!r}"
                )
            return
        old = self._run_row(db, restates)
        if old is None or old[6] != "committed" or (old[2], old[3], old[4]) != (key.release, start, end):
            raise LedgerError(
                f"restates={restates!r} must name the published (committed) run of release {key.release!r} "
                f"interval [{start}, {end})"
            )
        if published is not None and published[0] != restates:
            raise LedgerError(
                f"run {restates} was already restated; the current publication is run {published[0]}: restate that"
            )

    # --- runs: transitions --------------------------------------------------------------------------
    def start(self, run_id: str, *, actor: str) -> RunRecord:
        """reserved -> started, right before the first noise is drawn. From now on no refund."""
        return self._transition(run_id, "started", actor, {})

    def commit(self, run_id: str, *, output_uri: str, actor: str, details: dict | None = None) -> RunRecord:
        """started -> committed: the result is published at ``output_uri``."""
        if not isinstance(output_uri, str) or not output_uri:
            raise InvalidParameter(f"output_uri must say where the result is published, got {output_uri!r}")
        record = self._transition(run_id, "committed", actor,
                                  {"output_uri": output_uri, "details": _check_details(details)})
        from dpops.ledger.checkpoint import auto_checkpoint

        auto_checkpoint(self)  # a signed anchor outside the database, when configured (see checkpoint.py)
        return record

    def mark_spent_unpublished(self, run_id: str, *, reason: str, actor: str) -> RunRecord:
        """started -> spent_unpublished: noise was (or may have been) drawn; the charge stays."""
        return self._transition(run_id, "spent_unpublished", actor, {"reason": _check_reason(reason)})

    def release(self, run_id: str, *, reason: str, actor: str) -> RunRecord:
        """reserved -> released: refund, allowed only while no mechanism has run."""
        return self._transition(run_id, "released", actor, {"reason": _check_reason(reason)})

    def _transition(self, run_id: str, to: str, actor: str, data: dict[str, Any],
                    only_from: str | None = None, updated_before: str | None = None) -> RunRecord | None:
        _check_actor(actor)
        row = self._run_row(self.db, run_id) if isinstance(run_id, str) else None
        if row is None:
            raise LedgerError(f"unknown run {run_id!r}: reserve it first")
        with self._write() as db:
            self._scope_row(db, row[1], lock=True)  # the scope row lock serialises every writer of the scope
            row = self._run_row(db, run_id)
            state = row[6]
            if only_from is not None and (state != only_from or row[15] >= updated_before):
                return None  # recover(): the run moved on meanwhile
            if state == to:
                if to == "committed" and row[10] != data["output_uri"]:
                    raise LedgerError(f"run {run_id} is already committed with output {row[10]}; a committed run "
                                      "can never be changed (restate it with a new run key)")
                return self._record(row)
            if (state, to) not in TRANSITIONS:
                raise LedgerError(_refusal(run_id, state, to))
            record = self._record(row)
            if to == "committed":
                published = self._published_row(db, record.key.release, row[3], row[4])
                if published is not None and published[0] != record.restates:
                    raise LedgerError(
                        f"run {run_id}: interval already published as run {published[0]} and this run does not "
                        f"restate it; mark this run spent_unpublished instead (its noise was drawn)"
                    )
            hook(f"{to}:locked")
            eid, digest, ts = self._append(db, to, record.scope, run_id, record.buckets, actor, data)
            details = record.details
            if to == "committed" and data.get("details"):
                details = {**details, "commit": data["details"]}
            if db.dialect == "sqlite":  # PostgreSQL: the owner's trigger stepped the row from the entry
                db.execute(
                    "UPDATE runs SET state = ?, output_uri = ?, details = ?, entry_ids = ?, entry_hashes = ?, "
                    "updated_at = ?, last_entry = ? WHERE run_id = ?",
                    (to, data.get("output_uri", row[10]), canonical_json(details),
                     json.dumps(record.entry_ids + [eid]), json.dumps(record.entry_hashes + [digest]), ts, eid,
                     run_id),
                )
            hook(f"{to}:before_commit")
            row = self._run_row(db, run_id)
        return self._record(row)

    def recover(self, *, older_than_seconds: float, actor: str) -> list[RunRecord]:
        """Close runs abandoned for longer than ``older_than_seconds``.

        Reserved, never started -> released ("abandoned before any mechanism ran": refunded).
        Started, never finished -> spent_unpublished (noise may have been drawn: the charge stays).
        """
        _check_actor(actor)
        if isinstance(older_than_seconds, bool) or not isinstance(older_than_seconds, (int, float)) \
                or not math.isfinite(older_than_seconds) or older_than_seconds < 0:
            raise InvalidParameter(f"older_than_seconds must be a finite number >= 0, got {older_than_seconds!r}")
        cutoff = (datetime.now(timezone.utc) - timedelta(seconds=older_than_seconds)).isoformat(timespec="microseconds")
        rows = self.db.all("SELECT run_id, state FROM runs WHERE state IN (?, ?) AND updated_at < ? ORDER BY last_entry",
                           (*OPEN_STATES, cutoff))
        out = []
        for run_id, state in rows:
            if state == "reserved":
                to, reason = "released", "abandoned before any mechanism ran"
            else:
                to, reason = "spent_unpublished", "started but never finished: noise may have been drawn, the charge stays"
            rec = self._transition(run_id, to, actor, {"reason": f"recovered: {reason} (idle > {older_than_seconds}s)"},
                                   only_from=state, updated_before=cutoff)
            if rec is not None:
                out.append(rec)
        return out

    # --- reads ----------------------------------------------------------------------------------------
    def run(self, run_id: str) -> RunRecord | None:
        row = self._run_row(self.db, run_id)
        return None if row is None else self._record(row)

    def runs(self, *, scope: str | None = None, release: str | None = None, interval_start: str | None = None,
             interval_end: str | None = None, states: Sequence[str] | None = None) -> list[RunRecord]:
        where, params = [], []
        for col, value in (("scope", scope), ("release", release)):
            if value is not None:
                where.append(f"{col} = ?")
                params.append(value)
        for col, value in (("interval_start", interval_start), ("interval_end", interval_end)):
            if value is not None:
                where.append(f"{col} = ?")
                params.append(normalize_utc(value, col))
        if states:
            where.append(f"state IN ({', '.join('?' for _ in states)})")
            params.extend(states)
        sql = f"SELECT {_RUN_COLS} FROM runs" + (" WHERE " + " AND ".join(where) if where else "")
        return [self._record(r) for r in self.db.all(sql + " ORDER BY created_at, run_id", params)]

    def published(self, release: str, interval_start: str, interval_end: str) -> RunRecord | None:
        """The committed run for that interval (the newest restatement), if any."""
        row = self._published_row(self.db, release, normalize_utc(interval_start, "interval_start"),
                                  normalize_utc(interval_end, "interval_end"))
        return None if row is None else self._record(row)

    def status(self, scope: str) -> ScopeStatus:
        with self.snapshot() as db:
            sdef = self._scope_row(db, scope, lock=False)
            acct = budget.accountant_for(sdef)
            # Runs per bucket and state; the buckets any run of the scope ever named are the status's rows.
            counts: dict[str, dict[str, int]] = {}
            for state, bjson, n in db.all("SELECT state, buckets, COUNT(*) FROM runs WHERE scope = ? "
                                          "GROUP BY state, buckets", (scope,)):
                for b in json.loads(bjson):
                    counts.setdefault(b, {})[state] = counts.get(b, {}).get(state, 0) + int(n)
            names = sorted(counts)
            if not names and sdef.bucket is None:
                names = [UNBUCKETED]
                counts[UNBUCKETED] = {}
            states = bucket_states(db, scope, names, acct, parts=True)
            in_flight = open_runs(db, scope)
        m = lambda st: budget.measure(acct, sdef, st)  # noqa: E731
        rows = []
        for b in names:
            by_state = {s: [e for _, st, rb, evs in in_flight if st == s and b in rb for e in evs] for s in OPEN_STATES}
            total = m(acct.add_events(states[b]["settled"], by_state["reserved"] + by_state["started"]))
            rows.append(BucketStatus(
                bucket=b, committed=m(states[b]["committed"]), spent_unpublished=m(states[b]["spent"]),
                started=budget.measure_events(acct, sdef, by_state["started"]),
                reserved=budget.measure_events(acct, sdef, by_state["reserved"]),
                total=total, remaining=sdef.cap - total, runs=counts[b],
            ))
        top = max(rows, key=lambda r: r.total) if rows else BucketStatus(UNBUCKETED, 0, 0, 0, 0, 0, sdef.cap, {})
        return ScopeStatus(
            scope=scope, accountant=sdef.accountant, unit=sdef.cap_unit, cap=sdef.cap, delta=sdef.delta,
            committed=top.committed, spent_unpublished=top.spent_unpublished, started=top.started,
            reserved=top.reserved, total=top.total, remaining=top.remaining, buckets=rows,
        )

    def totals_after(self, scope: str) -> list[tuple[RunRecord, float]]:
        """Each charged run of ``scope`` with the scope total right after it, in the ledger's order of charges.

        The order is each run's first entry (its reservation): two runs committed in the same second keep their
        order, where their manifests' snapshots (read at commit) both saw the other's charge and show the same
        total. The total is ``status``'s: each bucket's charged runs composed by the scope's accountant, the
        fullest bucket's figure, in the cap's unit; the last one equals ``status(scope).total`` up to float
        summation order. Privacy reason: "how much of the promise was used when this was released" must be one
        figure, the same on the Privacy budget page, in the report and in ``ledger status``."""
        sdef = self.scope(scope)
        acct = budget.accountant_for(sdef)
        runs = sorted(self.runs(scope=scope, states=CHARGED_STATES),
                      key=lambda r: (min(r.entry_ids) if r.entry_ids else 0, r.created_at, r.run_id))
        states: dict[str, Any] = {}
        out: list[tuple[RunRecord, float]] = []
        top = 0.0
        for r in runs:
            for b in r.buckets or [UNBUCKETED]:
                states[b] = acct.add_events(states.get(b, acct.empty_state()), list(r.events))
                top = max(top, budget.measure(acct, sdef, states[b]))
            out.append((r, top))
        return out

    def plan(self, scope: str, runs: Sequence[tuple[str, str, Sequence[PrivacyEvent]]]) -> PlanResult:
        """What these future runs would cost, in order, and which would fit. Writes nothing.

        A planned run that fits is assumed charged for the runs after it; one that does not is skipped.
        """
        with self.snapshot() as db:
            sdef = self._scope_row(db, scope, lock=False)
            acct = budget.accountant_for(sdef)
            parsed = []
            for i, item in enumerate(runs):
                try:
                    start, end, events = item
                except (TypeError, ValueError):
                    raise InvalidParameter(f"planned run #{i}: expected (interval_start, interval_end, events)") from None
                s, e = normalize_utc(start, f"planned run #{i} interval_start"), normalize_utc(end, f"planned run #{i} interval_end")
                if not s < e:
                    raise InvalidParameter(f"planned run #{i}: interval [{start}, {end}) is empty")
                try:
                    evs = coerce_events(events)
                except InvalidParameter as exc:
                    raise InvalidParameter(f"planned run #{i}: {exc}") from None
                parsed.append((start, end, bucket_labels(sdef.bucket, s, e), evs))
            all_buckets = sorted({b for *_, bs, _ in parsed for b in bs})
            states = bucket_states(db, scope, all_buckets, acct)
            in_flight = open_runs(db, scope)
        pending = {b: [e for _, _, rb, evs in in_flight if b in rb for e in evs] for b in all_buckets}
        items = []
        for start, end, buckets, evs in parsed:
            totals = {b: budget.measure(acct, sdef, acct.add_events(states[b]["settled"], pending[b] + evs))
                      for b in buckets}
            fits = all(budget.within_cap(t, sdef.cap) for t in totals.values())
            worst = max(totals.values())
            if fits:
                for b in buckets:
                    pending[b] = pending[b] + evs
            items.append(PlanItem(
                interval_start=start, interval_end=end, buckets=buckets, cost=budget.measure_events(acct, sdef, evs),
                fits=fits, total_after=worst, remaining_after=sdef.cap - worst,
                reason="" if fits else f"would exceed the cap {sdef.cap_unit}={budget.format_budget(sdef.cap)}",
            ))
        return PlanResult(scope=scope, unit=sdef.cap_unit, cap=sdef.cap, delta=sdef.delta, items=items)

    @staticmethod
    def _entry(row: tuple) -> Entry:
        body = json.loads(row[7])
        return Entry(id=int(row[0]), ts=row[1], kind=row[2], scope=row[3], run_id=row[4], buckets=json.loads(row[5]),
                     actor=row[6], data=body.get("data", {}), prev_hash=row[8], hash=row[9], writer=row[10])

    def ledger_id(self) -> str | None:
        """This ledger's stable identity: the hash of its first (genesis) entry, None while it has none.

        Why (issue 25 item 10): a published version's binding names the ledger it was committed in, so a
        version signed by another deployment (same signing key, another ledger) does not verify here. The
        first entry's hash needs no schema change, never changes (the chain is append-only), and survives
        ``dpops ledger import`` (the same chain on another database keeps its identity)."""
        row = self.db.one("SELECT hash FROM entries ORDER BY id LIMIT 1", ())
        return None if row is None else str(row[0])

    def history(self, scope: str | None = None) -> list[Entry]:
        if scope is None:
            rows = self.db.all(f"SELECT {_ENTRY_COLS} FROM entries ORDER BY id")
        else:
            self.scope(scope)
            rows = self.db.all(f"SELECT {_ENTRY_COLS} FROM entries WHERE scope = ? ORDER BY id", (scope,))
        return [self._entry(r) for r in rows]

    def export(self, fp) -> int:
        """Write every entry as one canonical JSON line; an auditor can recompute each hash:
        sha256(prev_hash + canonical_json({id, ts, kind, scope, run_id, buckets, actor, data[, writer]})),
        ``writer`` in the body only when the entry has one (PostgreSQL, schema version 3 on)."""
        n = 0
        for row in self.db.all(f"SELECT {_ENTRY_COLS} FROM entries ORDER BY id"):
            doc = self._entry(row).to_dict()
            if doc["writer"] is None:  # SQLite or pre-v3 entries: the line stays what older dpops wrote and reads
                del doc["writer"]
            fp.write(canonical_json(doc) + "\n")
            n += 1
        return n

    def verify(self, *, checkpoints=None, expect_heads=()) -> VerifyReport:
        """Chain, state machine and caches; with ``checkpoints`` (``checkpoint.load_checkpoints``) or
        ``expect_heads`` also that the chain still extends those anchors (an owner's rewrite is caught)."""
        from dpops.ledger.verify import verify_ledger

        return verify_ledger(self, checkpoints=checkpoints, expect_heads=expect_heads)


def _refusal(run_id: str, state: str, to: str) -> str:
    if state == "committed":
        return (f"run {run_id} is committed (published) and can never be changed; a correction is a new run key "
                f"reserved with restates={run_id!r}")
    if to == "released":
        return (f"run {run_id} is {state}: its mechanism may have run, so its charge can never be refunded"
                + ("; mark it spent_unpublished (or commit it)" if state == "started" else ""))
    if state == "reserved":
        return f"run {run_id} is reserved but not started: call start() right before drawing noise, then {to}"
    if state == "released":
        return f"run {run_id} was released (refunded); reserve it again under a new run key"
    return f"run {run_id} is {state}; it cannot become {to}"
