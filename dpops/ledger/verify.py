"""Verify a ledger from its entries alone.

1. The chain: ids are 1..N without gaps, each entry's ``prev_hash`` is the hash of
   the entry before, each hash recomputes from its stored body, the body agrees with
   the indexed columns, and the chain head names the last entry (a truncated tail is
   caught). The first broken entry is named with the reason.
2. The state machine: every transition is allowed from the run's state at that
   point, every reservation was within the cap in force when it was made, and
   every run key hashes to its run id.
3. The caches: scopes and runs are rebuilt by replaying the entries and must equal
   the stored tables (JSON columns compared as values: on PostgreSQL the database
   writes ``runs`` from the entries, schema version 4); each bucket's running state
   must also agree with a one-shot composition of its history.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dpops.errors import DpopsError
from dpops.events import canonical_json, event_from_dict
from dpops.ledger import budget
from dpops.ledger.model import TRANSITIONS, RunKey, ScopeDefinition, VerifyReport, bucket_labels
from dpops.ledger.schema import GENESIS_HASH, entry_hash

if TYPE_CHECKING:
    from dpops.ledger.backend import Backend, OpenLedger
    from dpops.ledger.checkpoint import Checkpoint

_REL_TOL = 1e-9
_ONE_SHOT_REL_TOL = 1e-6  # incremental vs one-shot composition may differ by accountant numerics


class _Broken(Exception):
    def __init__(self, entry_id: int | None, why: str) -> None:
        super().__init__(why)
        self.entry_id, self.why = entry_id, why


def _close(a: float, b: float, rel: float = _REL_TOL) -> bool:
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= rel * max(1.0, abs(a), abs(b))


class _Replay:
    def __init__(self) -> None:
        self.scopes: dict[str, ScopeDefinition] = {}
        self.scope_last: dict[str, int] = {}
        self.buckets: dict[tuple[str, str], dict[str, Any]] = {}
        self.history: dict[tuple[str, str], list] = {}  # settled events per bucket, for the one-shot check
        self.runs: dict[str, dict[str, Any]] = {}
        self.open: dict[str, dict[str, dict[str, Any]]] = {}  # scope -> open (reserved/started) runs

    def apply(self, eid: int, ts: str, kind: str, scope: str | None, run_id: str | None, buckets: list[str],
              data: dict[str, Any]) -> None:
        if kind == "scope_created":
            if scope in self.scopes:
                raise _Broken(eid, f"scope {scope!r} created twice")
            sdef = ScopeDefinition.from_dict(data["definition"])
            if sdef.name != scope:
                raise _Broken(eid, f"scope_created body names {sdef.name!r} but the entry's scope is {scope!r}")
            self.scopes[scope] = sdef
            self.scope_last[scope] = eid
            return
        if scope not in self.scopes:
            raise _Broken(eid, f"{kind} on scope {scope!r} that was never created")
        sdef = self.scopes[scope]
        acct = budget.accountant_for(sdef)
        if kind == "cap_changed":
            if data["before"] != sdef.to_dict():
                raise _Broken(eid, f"cap_changed 'before' does not match the definition of scope {scope!r} in force")
            after = ScopeDefinition.from_dict(data["after"])
            # A cap change moves the cap only (Ledger.change_cap): the unit definition, time rule included,
            # is never changed by one (issue 19 item 1), so a forged one cannot re-place rows in buckets.
            if dataclasses.replace(sdef, epsilon=after.epsilon, rho=after.rho, delta=after.delta) != after:
                raise _Broken(eid, f"cap_changed on scope {scope!r} changes more than the cap (epsilon, rho, delta)")
            self.scopes[scope] = after
            self.scope_last[scope] = eid
            return
        if kind == "scope_time_pinned":
            self._pin(eid, scope, sdef, data)
            return
        if kind == "private_access":
            # a non-DP access event (Ledger.record_private_access): recorded, charges nothing, moves no cap
            if run_id is not None or buckets:
                raise _Broken(eid, "private_access entry names a run or buckets")
            return  # the scopes table's last_entry is not moved by it either
        if kind == "reserved":
            self._reserve(eid, ts, sdef, acct, run_id, buckets, data)
            return
        run = self.runs.get(run_id) if run_id is not None else None
        if run is None or run_id is None:
            raise _Broken(eid, f"{kind} for run {run_id} that was never reserved")
        if (run["state"], kind) not in TRANSITIONS:
            raise _Broken(eid, f"run {run_id}: transition {run['state']} -> {kind} is not allowed")
        if run["scope"] != scope or run["buckets"] != buckets:
            raise _Broken(eid, f"run {run_id}: {kind} entry names scope/buckets other than its reservation")
        if kind in ("committed", "spent_unpublished"):
            which = "committed" if kind == "committed" else "spent"
            for b in buckets:
                st = self.buckets[(scope, b)]
                st["settled"] = acct.add_events(st["settled"], run["events"])
                st[which] = acct.add_events(st[which], run["events"])
                self.history[(scope, b)].extend(run["events"])
        if kind == "committed":
            run["output_uri"] = data["output_uri"]
            if data.get("details"):
                run["details"] = {**run["details"], "commit": data["details"]}
        run["state"] = kind
        if kind != "started":
            self.open[scope].pop(run_id, None)
        run["entry_ids"].append(eid)
        run["updated_at"] = ts
        run["last_entry"] = eid

    def _pin(self, eid: int, scope: str, sdef: ScopeDefinition, data: dict[str, Any]) -> None:
        """A time rule pinned on a scope that had none (``Ledger.pin_time_rule``): nothing else may change."""
        if data["before"] != sdef.to_dict():
            raise _Broken(eid, f"scope_time_pinned 'before' does not match the definition of scope {scope!r} in force")
        after = ScopeDefinition.from_dict(data["after"])
        if sdef.time_rule is not None or after.time_rule is None:
            raise _Broken(eid, f"scope_time_pinned on scope {scope!r} must set a time rule where none was recorded")
        if dataclasses.replace(sdef, time_rule=after.time_rule) != after:
            raise _Broken(eid, f"scope_time_pinned on scope {scope!r} changes more than the time rule")
        self.scopes[scope] = after
        self.scope_last[scope] = eid

    def _reserve(self, eid, ts, sdef, acct, run_id, buckets, data) -> None:
        if run_id in self.runs:
            raise _Broken(eid, f"run {run_id} reserved twice")
        key = RunKey.from_dict(data["run_key"])
        if key.run_id != run_id:
            raise _Broken(eid, f"run key hashes to {key.run_id}, not to the entry's run id {run_id}")
        if data["accountant"] != sdef.accountant:
            raise _Broken(eid, f"reserved with accountant {data['accountant']} on a scope checked by {sdef.accountant}")
        if buckets != bucket_labels(sdef.bucket, key.start_utc, key.end_utc):
            raise _Broken(eid, f"run {run_id}: buckets {buckets} do not match its interval")
        events = [event_from_dict(d) for d in data["events"]]
        # Reservations from schema version 4 on also carry what the run cache holds (the database derives the row
        # from them): they must say what the run key and events say.
        if "interval_start" in data and (data["interval_start"], data.get("interval_end")) != (key.start_utc,
                                                                                                 key.end_utc):
            raise _Broken(eid, f"run {run_id}: its interval fields differ from its run key")
        if "epsilon" in data:
            eps = budget.epsilon_of(acct, sdef, events)
            stated = math.inf if data["epsilon"] is None else float(data["epsilon"])
            if not _close(stated, eps):
                raise _Broken(eid, f"run {run_id}: its stated epsilon {stated!r} is not its events' {eps!r}")
        for b in buckets:
            empty = acct.empty_state()
            st = self.buckets.setdefault((sdef.name, b), {"settled": empty, "committed": empty, "spent": empty})
            self.history.setdefault((sdef.name, b), [])
            open_events = [e for r in self.open.get(sdef.name, {}).values() if b in r["buckets"] for e in r["events"]]
            total = budget.measure(acct, sdef, acct.add_events(st["settled"], open_events + events))
            if not budget.within_cap(total, sdef.cap):
                raise _Broken(eid, f"run {run_id} was reserved over the cap of scope {sdef.name!r} bucket {b}: "
                                   f"{sdef.cap_unit} {total:.6g} > {sdef.cap:.6g}")
        self.runs[run_id] = {
            "scope": sdef.name, "release": key.release, "interval_start": key.start_utc,
            "interval_end": key.end_utc, "run_key": canonical_json(key.to_dict()), "state": "reserved",
            "events": events, "events_json": canonical_json(data["events"]), "buckets": buckets,
            "restates": data["restates"], "output_uri": None, "details": data["details"], "entry_ids": [eid],
            "created_at": ts, "updated_at": ts, "last_entry": eid, "scope_def": sdef,
        }
        self.open.setdefault(sdef.name, {})[run_id] = self.runs[run_id]

    def cache_rows(self, hashes: Sequence[str]) -> CacheRows:
        """The derived tables as ``Ledger`` writes them, rebuilt from this replay; ``hashes[i]`` is entry i+1's.

        Why here: ``dpops ledger import`` fills an empty ledger's caches from these rows, and ``verify``
        rebuilds the caches with this same replay, so one piece of code owns what the caches must hold
        (a second replay could drift and import a budget that verify then reads differently).
        A run's ``epsilon`` is that run alone at the delta of the scope definition in force when it was
        reserved, as ``Ledger.reserve`` computed it.
        """
        scopes = [(name, canonical_json(sdef.to_dict()), sdef.accountant, self.scope_last[name])
                  for name, sdef in sorted(self.scopes.items())]
        runs = []
        for run_id, run in sorted(self.runs.items(), key=lambda item: item[1]["entry_ids"][0]):
            sdef = run["scope_def"]
            eps = budget.epsilon_of(budget.accountant_for(sdef), sdef, run["events"])
            runs.append((run_id, run["scope"], run["release"], run["interval_start"], run["interval_end"],
                         run["run_key"], run["state"], run["events_json"], json.dumps(run["buckets"]),
                         run["restates"], run["output_uri"], canonical_json(run["details"]),
                         json.dumps(run["entry_ids"]), json.dumps([hashes[i - 1] for i in run["entry_ids"]]),
                         run["created_at"], run["updated_at"], eps if math.isfinite(eps) else None,
                         run["last_entry"]))
        return CacheRows(scopes=scopes, runs=runs)


@dataclass(frozen=True)
class CacheRows:
    """Rows of the derived tables, column for column as ``dpops.ledger.store`` writes them.

    ``scopes``: (name, definition, accountant, last_entry); ``runs``: the columns of ``store._RUN_COLS`` in that
    order. (The running-state cache ``buckets`` is gone since schema version 4: nothing the cap check reads is a
    cache the application role could write.)
    """

    scopes: list[tuple]
    runs: list[tuple]


def _verify_chain(entries, head) -> tuple[VerifyReport, _Replay, list[str]]:
    """Chain and state machine over ``entries`` rows (id, ts, kind, scope, run_id, buckets_json, actor, body,
    prev_hash, hash, writer); ``head`` is (last_id, last_hash) or None when there is no head to compare (an export)."""
    replay = _Replay()
    hashes: list[str] = []
    prev, expected = GENESIS_HASH, 1
    report = VerifyReport(ok=True, entries=len(entries), head_hash=head[1] if head else (
        entries[-1][9] if entries else GENESIS_HASH))
    try:
        for eid, ts, kind, scope, run_id, bjson, actor, body_text, prev_hash, digest, writer in entries:
            eid = int(eid)
            if eid != expected:
                raise _Broken(expected, f"entry {expected} is missing or out of order (found entry {eid} in its place)")
            if prev_hash != prev:
                raise _Broken(eid, "prev_hash does not match the hash of the entry before: an entry was deleted, "
                                   "inserted or reordered")
            if entry_hash(prev_hash, body_text) != digest:
                raise _Broken(eid, "hash does not recompute from the stored body: the entry was edited")
            try:
                body = json.loads(body_text)
            except json.JSONDecodeError:
                raise _Broken(eid, "body is not valid JSON") from None
            columns = {"id": eid, "ts": ts, "kind": kind, "scope": scope, "run_id": run_id,
                       "buckets": json.loads(bjson), "actor": actor, "writer": writer}
            for name, value in columns.items():
                if body.get(name) != value:
                    raise _Broken(eid, f"column {name}={value!r} disagrees with the hashed body ({body.get(name)!r})")
            try:
                replay.apply(eid, ts, kind, scope, run_id, columns["buckets"], body["data"])
            except _Broken:
                raise
            except (DpopsError, KeyError, TypeError, ValueError) as exc:
                raise _Broken(eid, f"{kind} entry cannot be replayed: {exc}") from None
            hashes.append(digest)
            prev, expected = digest, expected + 1
        if head is not None and (int(head[0]) != expected - 1 or head[1] != prev):
            raise _Broken(expected, f"chain head names entry {head[0]} but the entries end at "
                                    f"{expected - 1}: entries at the end were deleted, or the head was edited")
    except _Broken as broken:
        report.ok = False
        report.first_bad_entry = broken.entry_id
        report.problems.append(f"entry {broken.entry_id}: {broken.why}")
    return report, replay, hashes


def _totals(replay: _Replay) -> dict[str, Any]:
    """Per scope and bucket: the cap in force at the end and the settled composition (committed + spent)."""
    out: dict[str, Any] = {}
    for (scope, b), states in sorted(replay.buckets.items()):
        sdef = replay.scopes[scope]
        acct = budget.accountant_for(sdef)
        total = budget.measure(acct, sdef, states["settled"])
        row = out.setdefault(scope, {"cap": sdef.cap, "unit": sdef.cap_unit, "delta": sdef.delta,
                                     "accountant": sdef.accountant, "buckets": {}})
        row["buckets"][b] = {"settled": total if math.isfinite(total) else None,
                             "open_runs": sum(1 for r in replay.open.get(scope, {}).values() if b in r["buckets"])}
    return out


def _anchor(report: VerifyReport, hashes: list[str], checkpoints: Sequence[Checkpoint] | None,
            expect_heads: Sequence[str]) -> VerifyReport:
    from dpops.ledger.checkpoint import check_anchors, summary

    if not report.ok or (not checkpoints and not expect_heads):
        return report
    problems = check_anchors(hashes, checkpoints or (), expect_heads or ())
    if checkpoints:
        report.anchors = summary(list(checkpoints))
    if expect_heads:
        report.anchors["expect_head"] = list(expect_heads)
    if problems:
        report.ok = False
        report.problems = problems + report.problems
    return report


def verify_ledger(ledger: OpenLedger, checkpoints: Sequence[Checkpoint] | None = None,
                  expect_heads: Sequence[str] = ()) -> VerifyReport:
    """Chain, state machine, caches; then (if given) that the chain extends every signed checkpoint and head."""
    with ledger.snapshot() as db:  # one consistent snapshot
        return verify_tables(db, checkpoints, expect_heads)


def verify_tables(db: Backend, checkpoints: Sequence[Checkpoint] | None = None,
                  expect_heads: Sequence[str] = ()) -> VerifyReport:
    """``verify_ledger`` on the transaction already open on ``db``.

    Why separate: ``dpops ledger import`` verifies what it wrote *before* it commits, on its own
    uncommitted transaction, so a ledger that would not verify is rolled back rather than left behind.
    """
    head = db.one("SELECT last_id, last_hash FROM chain_head WHERE singleton = 1")
    entries = db.all("SELECT id, ts, kind, scope, run_id, buckets, actor, body, prev_hash, hash, writer FROM entries "
                     "ORDER BY id")
    scope_rows = db.all("SELECT name, definition, accountant, last_entry FROM scopes")
    run_rows = db.all("SELECT run_id, scope, release, interval_start, interval_end, run_key, state, events, "
                      "buckets, restates, output_uri, details, entry_ids, entry_hashes, created_at, updated_at, "
                      "last_entry FROM runs")
    charge_rows = db.all("SELECT scope, state, buckets, events, runs FROM run_charges")
    if head is None:
        head = (-1, "")  # no chain head row: reported as a broken head below
    report, replay, hashes = _verify_chain(entries, head)
    if not report.ok:
        return report
    report.problems.extend(_compare_caches(replay, dict(enumerate(hashes, start=1)), scope_rows, run_rows))
    report.problems.extend(_compare_charges(replay, charge_rows))
    report.writers, writer_problems = check_writers(db, entries)
    report.problems.extend(writer_problems)
    report.ok = not report.problems
    report.totals = _totals(replay)
    return _anchor(report, hashes, checkpoints, expect_heads)


def writer_summary(entries: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """Who wrote what, from entry rows alone: entries per writer role, and owner-only entries per writer."""
    from dpops.ledger.schema import OWNER_ONLY_KINDS

    by_writer: dict[str, int] = {}
    owner_only: dict[str, int] = {}
    unrecorded = 0
    for row in entries:
        kind, writer = row[2], row[10]
        if writer is None:
            unrecorded += 1
            continue
        by_writer[writer] = by_writer.get(writer, 0) + 1
        if kind in OWNER_ONLY_KINDS:
            owner_only[writer] = owner_only.get(writer, 0) + 1
    return {"by_writer": dict(sorted(by_writer.items())), "owner_only_by_writer": dict(sorted(owner_only.items())),
            "unrecorded": unrecorded}


def check_writers(db: Backend, entries: Sequence[Sequence[Any]]) -> tuple[dict[str, Any], list[str]]:
    """The writers summary and a problem for each owner-only entry written by a role other than the owner.

    PostgreSQL only: "owner" is the rule the database's guard enforces (``schema.py`` version 3): a member of
    the role owning the tables (``pg_has_role(writer, owner, 'MEMBER')``). A writer role that no longer exists in
    this database (history imported from another cluster) cannot be judged and is listed, not failed: a false
    alarm on every imported ledger would teach operators to ignore verify. Entries without a writer were written
    on SQLite or before schema version 3 and are counted. SQLite: there are no roles; whoever can write the file
    is the owner (``access`` says so), so nothing is judged.
    """
    from dpops.ledger.schema import OWNER_ONLY_KINDS

    summary = writer_summary(entries)
    if db.dialect != "postgresql":
        summary["access"] = ("SQLite ledger: no database roles; whoever can write the file is its owner (may create "
                             "scopes, change caps and rewrite history); only signed checkpoints catch a rewrite")
        return summary, []
    from dpops.ledger.roles import table_owner

    owner = table_owner(db)
    summary["owner"] = owner
    if owner is None:
        return summary, []
    verdicts: dict[str, bool | None] = {}
    for writer in summary["owner_only_by_writer"]:
        exists = db.one("SELECT 1 FROM pg_roles WHERE rolname = ?", (writer,))
        verdicts[writer] = None if exists is None else bool(db.row("SELECT pg_has_role(?, ?, 'MEMBER')",
                                                                  (writer, owner))[0])
    summary["unknown_roles"] = sorted(w for w, v in verdicts.items() if v is None)
    problems = []
    for row in entries:
        eid, kind, scope, writer = int(row[0]), row[2], row[3], row[10]
        if kind in OWNER_ONLY_KINDS and writer is not None and verdicts.get(writer) is False:
            problems.append(f"entry {eid}: {kind} on scope {scope!r} was written by role {writer!r}, not by the "
                            f"ledger owner role {owner!r}: only the owner may create scopes or change caps (was "
                            "the writer guard disabled?)")
    return summary, problems


_EXPORT_FIELDS = ("id", "ts", "kind", "scope", "run_id", "buckets", "actor", "data", "prev_hash", "hash")
_EXPORT_OPTIONAL = ("writer",)  # exports of entries written on PostgreSQL from schema version 3 on


@dataclass
class ExportReplay:
    """An export file parsed and replayed: its verification report and what an import needs.

    ``rows`` are the entries in the ``entries`` table's column order (the hashed body rebuilt exactly as the
    ledger built it), ``lines[i]`` the file line of ``rows[i]``, ``hashes[i]`` the verified hash of entry i+1
    (empty when the chain is broken), ``replay`` the state the entries build.
    """

    report: VerifyReport
    source: str = "export"
    rows: list[tuple] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    hashes: list[str] = field(default_factory=list)
    replay: _Replay = field(default_factory=_Replay)

    def line_of(self, entry_id: int | None) -> int | None:
        """The file line holding entry ``entry_id`` (or standing where it should be), None if past the end."""
        if entry_id is None or not 1 <= entry_id <= len(self.lines):
            return None
        return self.lines[entry_id - 1]

    def cache_rows(self) -> CacheRows:
        """The derived tables these entries build (see ``_Replay.cache_rows``)."""
        return self.replay.cache_rows(self.hashes)


def replay_export(lines: Iterable[str], source: str = "export", checkpoints: Sequence[Checkpoint] | None = None,
                  expect_heads: Sequence[str] = ()) -> ExportReplay:
    """Parse, verify and replay a ``dpops ledger export`` file (``verify_export`` keeps only the report).

    A line that is not an export line raises IntegrityError naming the line (never quoting it).
    """
    rows, numbers = [], []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            raise _export_error(source, n, "is not JSON") from None
        if not isinstance(doc, dict) or not set(_EXPORT_FIELDS) <= set(doc) <= {*_EXPORT_FIELDS, *_EXPORT_OPTIONAL}:
            raise _export_error(source, n, f"must be an object with exactly the fields {list(_EXPORT_FIELDS)} "
                                           f"(and optionally {list(_EXPORT_OPTIONAL)})")
        if isinstance(doc["id"], bool) or not isinstance(doc["id"], int) or not isinstance(doc["buckets"], list):
            raise _export_error(source, n, "has a malformed id or buckets field")
        writer = doc.get("writer")
        if writer is not None and not isinstance(writer, str):
            raise _export_error(source, n, "has a malformed writer field")
        body = {k: doc[k] for k in ("id", "ts", "kind", "scope", "run_id", "buckets", "actor", "data")}
        if writer is not None:  # the body as the ledger hashed it: writer only where one was recorded
            body["writer"] = writer
        try:
            body_text = canonical_json(body)
        except (TypeError, ValueError):
            raise _export_error(source, n, "holds a value JSON cannot hash (NaN or infinity)") from None
        rows.append((doc["id"], doc["ts"], doc["kind"], doc["scope"], doc["run_id"], json.dumps(doc["buckets"]),
                     doc["actor"], body_text, doc["prev_hash"], doc["hash"], writer))
        numbers.append(n)
    report, replay, hashes = _verify_chain(rows, None)
    if report.ok:
        report.totals = _totals(replay)
        report.writers = writer_summary(rows)  # roles are judged by the database an export is imported into
    report = _anchor(report, hashes, checkpoints, expect_heads)
    return ExportReplay(report=report, source=source, rows=rows, lines=numbers,
                        hashes=hashes if report.ok else [], replay=replay)


def verify_export(lines: Iterable[str], source: str = "export", checkpoints: Sequence[Checkpoint] | None = None,
                  expect_heads: Sequence[str] = ()) -> VerifyReport:
    """Verify a ``dpops ledger export`` file alone: chain, state machine (every reservation within the cap
    in force), totals. Each hashed body is rebuilt from the line exactly as the ledger built it.

    A removed *last* entry leaves a valid shorter chain: only an anchor (``checkpoints`` or ``expect_heads``)
    catches that, as for the database.
    """
    return replay_export(lines, source, checkpoints, expect_heads).report


def _export_error(source: str, line: int, what: str):
    from dpops.errors import IntegrityError

    return IntegrityError(f"{source} line {line} {what}: it is not a dpops ledger export (dpops ledger export)")


def _compare_charges(replay: _Replay, charge_rows: Sequence[Sequence[Any]]) -> list[str]:
    """``run_charges`` (what the cap check composes) against the replay: per scope, settled state,
    buckets and events (compared as JSON values), the number of runs."""
    from collections import Counter

    expected: Counter[tuple[str, str, str, str]] = Counter()
    for run in replay.runs.values():
        if run["state"] in ("committed", "spent_unpublished"):
            expected[(run["scope"], run["state"], canonical_json(run["buckets"]),
                      canonical_json(json.loads(run["events_json"])))] += 1
    stored: Counter[tuple[str, str, str, str]] = Counter()
    for scope, state, bjson, ejson, n in charge_rows:
        stored[(scope, state, canonical_json(json.loads(bjson)), canonical_json(json.loads(ejson)))] += int(n)
    if stored == expected:
        return []
    differ = sorted({k[0] for k in set(stored) ^ set(expected)} | {k[0] for k in stored if stored[k] != expected[k]})
    return [f"run_charges table (the settled runs the cap check composes) differs from the entries for scope(s) "
            f"{differ}"]


def _compare_caches(replay: _Replay, hashes, scope_rows, run_rows) -> list[str]:
    problems = []
    stored_scopes = {r[0]: r for r in scope_rows}
    if set(stored_scopes) != set(replay.scopes):
        problems.append(f"scopes table holds {sorted(stored_scopes)} but the entries create {sorted(replay.scopes)}")
    for name, sdef in replay.scopes.items():
        row = stored_scopes.get(name)
        if row and (row[1] != canonical_json(sdef.to_dict()) or row[2] != sdef.accountant
                    or int(row[3]) != replay.scope_last[name]):
            problems.append(f"scopes table row {name!r} differs from its entries (definition or cap edited?)")
    for (scope, b), states in replay.buckets.items():
        sdef = replay.scopes[scope]
        acct = budget.accountant_for(sdef)
        one_shot = budget.measure_events(acct, sdef, replay.history[(scope, b)])
        if not _close(one_shot, budget.measure(acct, sdef, states["settled"]), _ONE_SHOT_REL_TOL):
            problems.append(f"scope {scope!r} bucket {b}: running state disagrees with a one-shot composition "
                            f"of its history ({one_shot!r}): accountant {acct.ref} is inconsistent")
    stored_runs = {r[0]: r for r in run_rows}
    if set(stored_runs) != set(replay.runs):
        problems.append(f"runs table has runs {sorted(set(stored_runs) ^ set(replay.runs))[:5]} "
                        "not matching the entries")
    for run_id, run in replay.runs.items():
        row = stored_runs.get(run_id)
        if row is None:
            continue
        expect = (run_id, run["scope"], run["release"], run["interval_start"], run["interval_end"],
                  json.loads(run["run_key"]), run["state"], json.loads(run["events_json"]), run["buckets"],
                  run["restates"], run["output_uri"], run["details"],
                  run["entry_ids"], [hashes[i] for i in run["entry_ids"]], run["created_at"], run["updated_at"],
                  run["last_entry"])
        got = (row[0], row[1], row[2], row[3], row[4], json.loads(row[5]), row[6], json.loads(row[7]),
               json.loads(row[8]), row[9], row[10],
               json.loads(row[11]), json.loads(row[12]), json.loads(row[13]), row[14], row[15], int(row[16]))
        names = ("run_id", "scope", "release", "interval_start", "interval_end", "run_key", "state", "events",
                 "buckets", "restates", "output_uri", "details", "entry_ids", "entry_hashes", "created_at",
                 "updated_at", "last_entry")
        for name, e, g in zip(names, expect, got, strict=True):
            if e != g:
                problems.append(f"runs table row {run_id}: {name} is {g!r} but the entries say {e!r}")
    return problems
