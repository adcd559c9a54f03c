"""Issue 25 items 8 and 11 (database parts) and the "Roles" class property, on real PostgreSQL.

Setup: a fresh database set up by the documented procedure (``deploy/ledger-roles.sql`` with the reader, then
``dpops ledger init --app-role --reader-role`` as the owner), a scope with cap epsilon 1 (basic accountant), one
committed run (0.4) and one started run (0.2) written by the app role.

- Item 8: the app role resets every cache the cap check used to read (the ``buckets`` running states, the
  ``runs`` states and events); the database refuses each write, dpops' own reservation still refuses what does
  not fit, and the owner's status shows every charge. On the code before the fix the bucket reset was accepted
  and a 0.6 reservation was admitted on top of 0.6 (cap 1).
- The property: the attack list is built from the database's own catalog (every table, column, function of the
  ledger schema: UPDATE to forged values, INSERT, DELETE, TRUNCATE, LOCK TABLE in each of the 8 modes, direct
  calls), plus entries forged with a correct hash chain, large objects, settings, DDL and role changes. Each is
  run as the app role and as the reader role (with its read-only default turned off, the worst case) in a
  transaction that stays open -- holding whatever locks it took -- while the owner's ``status`` and ``verify``
  and the reader's budget page run. Asserted: none of them is blocked past ``LOCK_BOUND_S``; the owner's total
  equals the composition of the hashed entries (nothing hidden); dpops' reservation of "what is left + 0.05"
  is refused (no cap exceeded through dpops' check); ``verify`` passes. Hypothesis then chains attacks.
- What PostgreSQL does not let the owner restrict (documented in docs/threat-model.md): a role may change its own
  password and its own session defaults. A raw INSERT of a reservation over the cap is refused by the database
  itself (schema version 5, ``dpops.ledger.db_cap``: ``test_a_hand_written_...``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from fuzz_support import examples
from hypothesis import strategies as st

from dpops.accounting import get_accountant
from dpops.budget_view import budget_page
from dpops.cli.main import main
from dpops.errors import LedgerError
from dpops.events import Laplace, canonical_json, event_to_dict
from dpops.ledger import RunKey, ScopeDefinition, open_ledger
from dpops.ledger import backend as backend_mod
from dpops.ledger.schema import entry_hash
from dpops.ledger.cap import ScopeBudgetExceeded

pytestmark = pytest.mark.postgres

ROLES_SQL = Path(__file__).resolve().parent.parent / "deploy" / "ledger-roles.sql"
CAP = 1.0
READ_LOCK_TIMEOUT_S = 1.0  # the ledger's read lock timeout, lowered for the test (default 10 s)
LOCK_BOUND_S = READ_LOCK_TIMEOUT_S + 4.0  # "never blocked past": the timeout plus generous slack for a loaded box
READER_CONNECTION_LIMIT = 4
LOCK_MODES = ("ACCESS SHARE", "ROW SHARE", "ROW EXCLUSIVE", "SHARE UPDATE EXCLUSIVE", "SHARE",
              "SHARE ROW EXCLUSIVE", "EXCLUSIVE", "ACCESS EXCLUSIVE")


def _key(day: int) -> RunKey:
    return RunKey("daily", "spechash", f"2024-03-{day:02d}T00:00:00Z", f"2024-03-{day + 1:02d}T00:00:00Z", "fp", "k1")


def _lap(eps: float) -> list[Laplace]:
    return [Laplace(scale=1.0 / eps, l1_sensitivity=1.0)]


def _laplace_dict(scale: float) -> dict[str, Any]:
    return event_to_dict(Laplace(scale=scale, l1_sensitivity=1.0))


def _url(base: str, db: str, role: str) -> str:
    return f"{base.replace('postgres@', role + '@')}/{db}?schema=dpops"


@pytest.fixture
def deployed(postgres_url, tmp_path, monkeypatch, capsys):
    """A fresh database set up as deploy/ describes; yields (urls by role, role names, superuser connection)."""
    if shutil.which("psql") is None:
        pytest.skip("psql not installed")
    monkeypatch.setattr(backend_mod, "READ_LOCK_TIMEOUT_S", READ_LOCK_TIMEOUT_S, raising=False)
    tag = uuid.uuid4().hex[:8]
    db = f"t_rolesprop_{tag}"
    names = {"owner": f"dpops_owner_{tag}", "app": f"dpops_app_{tag}", "reader": f"dpops_reader_{tag}"}
    base = postgres_url.rsplit("/", 1)[0]
    admin = psycopg.connect(postgres_url, autocommit=True)
    admin.execute(f'CREATE DATABASE "{db}"')
    pw = tmp_path / "pw"
    pw.write_text("not-used-with-trust-auth\n")
    try:
        proc = subprocess.run(
            ["psql", "-X", "-v", "ON_ERROR_STOP=1", f"{base}/{db}", "-v", f"owner_role={names['owner']}",
             "-v", f"app_role={names['app']}", "-v", f"reader_role={names['reader']}",
             "-v", f"owner_password_file={pw}", "-v", f"app_password_file={pw}", "-v", f"reader_password_file={pw}",
             "-v", f"reader_connection_limit={READER_CONNECTION_LIMIT}", "-f", str(ROLES_SQL)],
            check=False, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        urls = {r: _url(base, db, n) for r, n in names.items()}
        # as deploy/ledger-db-init.sh does after the roles: the database's own cap check, as the superuser
        code = main(["ledger", "--ledger", _url(base, db, "postgres"), "install-cap-check",
                     "--owner-role", names["owner"]])
        assert code == 0, capsys.readouterr().err
        code = main(["ledger", "--ledger", urls["owner"], "init", "--app-role", names["app"],
                     "--reader-role", names["reader"]])
        assert code == 0, capsys.readouterr().err
        with open_ledger(urls["owner"]) as led:
            led.create_scope(ScopeDefinition(name="s", unit="a user's events", unit_column="user_id", epsilon=CAP,
                                             delta=1e-6, rho=None, accountant="basic", adjacency="add_remove"),
                             actor="owner")
        with open_ledger(urls["app"]) as led:
            for day, eps in ((1, 0.4), (2, 0.2)):
                rec = led.reserve(_key(day), "s", _lap(eps), actor="op")
                led.start(rec.run_id, actor="op")
                if day == 1:
                    led.commit(rec.run_id, output_uri="file:///out/1", actor="op")
        yield urls, names, admin
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        for role in names.values():
            admin.execute(f'DROP ROLE IF EXISTS "{role}"')
        admin.close()


def _raw(url: str) -> psycopg.Connection:
    conn = psycopg.connect(url.split("?")[0])  # not autocommit: each attack runs in a transaction left open
    conn.execute("SET search_path TO dpops")
    conn.commit()
    return conn


def _charged_from_entries(owner_url: str) -> float:
    """The oracle: epsilon charged to scope s, composed from the hashed entry bodies alone (basic: a sum of
    l1/scale over every reserved run not released), whatever any cache says."""
    with psycopg.connect(owner_url.split("?")[0]) as conn:
        rows = conn.execute("SELECT kind, run_id, body FROM dpops.entries WHERE scope = 's' ORDER BY id").fetchall()
    charged: dict[str, float] = {}
    for kind, run_id, body in rows:
        data = json.loads(body)["data"]
        if kind == "reserved":
            charged[run_id] = sum(e["l1_sensitivity"] / e["scale"] for e in data["events"])
        elif kind == "released":
            charged.pop(run_id, None)
    return sum(charged.values())


def _bounded(what: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a thread; fail if it is still blocked after LOCK_BOUND_S. A LedgerError (the lock timeout)
    is an allowed, bounded answer and is returned, not raised."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except LedgerError as exc:
            box["value"] = exc

    t0 = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(LOCK_BOUND_S)
    box["blocked"] = thread.is_alive()
    box["seconds"] = time.monotonic() - t0
    return box, thread


class Harness:
    """The owner's and the reader's long-lived sessions, and the checks run around each attack."""

    def __init__(self, urls: dict[str, str]) -> None:
        self.urls = urls
        self.owner = open_ledger(urls["owner"])
        self.reader = open_ledger(urls["reader"])
        self.app = open_ledger(urls["app"])
        self.probes = 0
        self.pending: threading.Thread | None = None  # a read still blocked when its bound passed

    def close(self) -> None:
        for led in (self.owner, self.reader, self.app):
            led.close()

    def while_held(self, label: str) -> None:
        """With the attacker's transaction open: nobody's read is blocked past the bound."""
        for what, fn in (("owner status", lambda: self.owner.status("s")),
                         ("owner verify", lambda: self.owner.verify()),
                         ("budget page (reader)", lambda: budget_page(self.reader, None, []))):
            box, thread = _bounded(what, fn)
            if box["blocked"]:
                self.pending = thread
                raise AssertionError(f"{label}: {what} blocked for more than {LOCK_BOUND_S}s")

    def after(self, label: str) -> None:
        """After the attacker committed: nothing hidden, nothing over the cap through dpops, verify passes."""
        truth = _charged_from_entries(self.urls["owner"])
        assert truth <= CAP * (1 + 1e-9), f"{label}: {truth} charged on a cap of {CAP}"
        status = self.owner.status("s")
        assert status.total == pytest.approx(truth, abs=1e-9), (label, status.total, truth)
        assert self.reader.status("s").total == pytest.approx(truth, abs=1e-9), label
        page = budget_page(self.reader, None, [])
        assert [s.total for s in page.scopes] == pytest.approx([truth], abs=1e-9), label
        report = self.owner.verify()
        assert report.ok, (label, report.problems)
        self.probes += 1
        with pytest.raises(ScopeBudgetExceeded):
            probe = RunKey(f"probe{self.probes}", "spechash", "2024-04-01T00:00:00Z", "2024-04-02T00:00:00Z", "fp", "k1")
            self.app.reserve(probe, "s", _lap(CAP - truth + 0.05), actor="probe")


def _forged_entries(conn: psycopg.Connection, role: str) -> list[tuple[str, Callable[[], None]]]:
    """Entries written by hand with a correct hash chain and writer: each breaks the state machine or the body."""
    runs = {state: (run_id, json.loads(b)) for run_id, state, b in
            conn.execute("SELECT run_id, state, buckets FROM runs").fetchall()}
    conn.rollback()

    def forge(kind: str, run_id: str | None, data: dict[str, Any], buckets: list[str] | None = None,
              column_buckets: list[str] | None = None) -> Callable[[], None]:
        def go() -> None:
            last_id, last_hash = conn.execute("SELECT last_id, last_hash FROM chain_head").fetchone()
            ts = "2024-03-20T00:00:00.000000+00:00"
            b = ["*"] if buckets is None else buckets
            body = canonical_json({"id": last_id + 1, "ts": ts, "kind": kind, "scope": "s", "run_id": run_id,
                                   "buckets": b, "actor": "mallory", "data": data, "writer": role})
            digest = entry_hash(last_hash, body)
            conn.execute("INSERT INTO entries (id, ts, kind, scope, run_id, buckets, actor, body, prev_hash, hash, "
                         "writer) VALUES (%s, %s, %s, 's', %s, %s, 'mallory', %s, %s, %s, %s)",
                         (last_id + 1, ts, kind, run_id, json.dumps(b if column_buckets is None else column_buckets),
                          body, last_hash, digest, role))
            conn.execute("UPDATE chain_head SET last_id = %s, last_hash = %s", (last_id + 1, digest))
        return go

    started, committed = runs["started"][0], runs["committed"][0]
    key = _key(1)
    reserve_data = {"run_key": key.to_dict(), "events": [_laplace_dict(1.0)],
                    "restates": None, "details": {}, "accountant": "basic/1"}
    fresh = _key(20)
    fresh_data = {**reserve_data, "run_key": fresh.to_dict(), "interval_start": fresh.start_utc,
                  "interval_end": fresh.end_utc, "epsilon": 1.0}
    return [
        ("refund a started run", forge("released", started, {"reason": "x"})),
        ("refund a committed run", forge("released", committed, {"reason": "x"})),
        ("spend-unpublish a committed run", forge("spent_unpublished", committed, {"reason": "x"})),
        ("commit a run never reserved", forge("committed", "f" * 32, {"output_uri": "x", "details": {}})),
        ("reserve an existing run id", forge("reserved", started, reserve_data)),
        ("reservation with columns unlike its body", forge("reserved", key.run_id, reserve_data, column_buckets=[])),
        ("reservation on another scope's accountant", forge("reserved", key.run_id,
                                                           {**reserve_data, "accountant": "rdp/1"})),
        ("step a run naming other buckets", forge("spent_unpublished", started, {"reason": "x"}, buckets=[])),
        # exactly what dpops would write, only too large (schema version 5: the database composes it and refuses)
        ("a well-formed reservation over the cap", forge("reserved", fresh.run_id, fresh_data)),
        ("a well-formed reservation on a forged bucket label", forge(
            "reserved", fresh.run_id, fresh_data, buckets=["2024-03-20"], column_buckets=["2024-03-20"])),
    ]


def _catalog_attacks(conn: psycopg.Connection, role: str) -> list[tuple[str, Callable[[], None]]]:
    """Every write the catalog offers on the ledger schema, plus what lies outside it."""
    empty_state = json.dumps(get_accountant("basic").empty_state())
    out: list[tuple[str, Callable[[], None]]] = []

    def sql(text: str) -> tuple[str, Callable[[], None]]:
        return text, lambda: conn.execute(text)

    tables = [r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'dpops'").fetchall()]
    for table in sorted(tables):
        cols = conn.execute("SELECT column_name, data_type FROM information_schema.columns WHERE table_schema = "
                            "'dpops' AND table_name = %s ORDER BY ordinal_position", (table,)).fetchall()
        for col, typ in cols:
            values = ["0", "-1"] if typ in ("bigint", "integer", "double precision") else [
                f"'{empty_state}'", "'[]'", "'{}'", "'released'"]
            out += [sql(f"UPDATE {table} SET {col} = {v}") for v in values]
        out += [sql(f"DELETE FROM {table}"), sql(f"TRUNCATE {table}"), sql(f"INSERT INTO {table} DEFAULT VALUES")]
        out += [sql(f"LOCK TABLE {table} IN {mode} MODE") for mode in LOCK_MODES]
    for (fn,) in conn.execute("SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace n ON "
                              "n.oid = p.pronamespace WHERE n.nspname = 'dpops'").fetchall():
        out.append(sql(f"SELECT {fn.split('(')[0]}()"))
    conn.rollback()
    out += [sql(s) for s in (
        "SELECT lo_create(0)", "SELECT lo_creat(-1)", "SELECT lo_from_bytea(0, 'x')",
        "CREATE TEMP TABLE planted (a int)", "CREATE TABLE public.planted (a int)",
        "CREATE TABLE dpops.planted (a int)", "CREATE SCHEMA planted",
        "CREATE FUNCTION public.planted() RETURNS int LANGUAGE sql AS 'SELECT 1'",
        "SELECT pg_advisory_lock(hashtext('dpops'))",
        f'ALTER ROLE "{role}" SET default_transaction_read_only = off',
        f'ALTER ROLE "{role}" SET search_path = public',
        f'ALTER ROLE "{role}" CONNECTION LIMIT -1',
        f'ALTER ROLE "{role}" PASSWORD \'changed\'',  # allowed by PostgreSQL: documented, grants nothing
        f'ALTER ROLE "{role}" SUPERUSER', f'ALTER ROLE "{role}" CREATEROLE',
        "SET ROLE NONE", "SET session_replication_role = replica",
        "ALTER TABLE entries DISABLE TRIGGER USER",
    )]
    return out + _forged_entries(conn, role)


def _attack(harness: Harness, conn: psycopg.Connection, label: str, action: Callable[[], None]) -> bool:
    """Run one attack in an open transaction; while it is open (locks held) the reads must not block. Returns
    whether the database accepted it."""
    try:
        action()
    except psycopg.Error:
        conn.rollback()
        return False
    try:
        harness.while_held(label)
    finally:
        conn.commit()
        if harness.pending is not None:  # the failing read finishes once the attacker's locks are gone
            harness.pending.join(60)
    return True


def _everything(harness: Harness, conn: psycopg.Connection, role: str) -> list[str]:
    conn.execute("SET default_transaction_read_only = off")  # what any role may do in its own session
    conn.commit()
    accepted = []
    for label, action in _catalog_attacks(conn, role):
        if _attack(harness, conn, f"{role}: {label}", action):
            accepted.append(label)
            harness.after(f"{role}: {label}")
    harness.after(f"{role}: all attacks")
    return accepted


def test_item8_the_app_role_cannot_reset_the_caches_the_cap_check_reads(deployed):
    urls, names, _admin = deployed
    attacker = _raw(urls["app"])
    empty = json.dumps(get_accountant("basic").empty_state())
    forged = []
    for text in (f"UPDATE buckets SET settled_state = '{empty}', committed_state = '{empty}', spent_state = '{empty}'",
                 "UPDATE runs SET state = 'released'", "UPDATE runs SET events = '[]'", "DELETE FROM runs"):
        try:
            attacker.execute(text)
            attacker.commit()
            forged.append(text)
        except psycopg.Error:
            attacker.rollback()
    attacker.close()
    with open_ledger(urls["app"]) as app:
        with pytest.raises(ScopeBudgetExceeded):
            app.reserve(_key(5), "s", _lap(0.6), actor="mallory")  # 0.6 charged + 0.6 > cap 1
    with open_ledger(urls["owner"]) as owner:
        assert owner.status("s").total == pytest.approx(0.6)
        assert owner.verify().ok
    assert forged == [], f"the app role could write caches: {forged}"


def test_every_write_the_database_allows_the_app_and_reader_roles_keeps_the_cap_and_the_owner_unblocked(deployed):
    urls, names, _admin = deployed
    harness = Harness(urls)
    try:
        harness.after("before any attack")
        accepted = {}
        for role in ("app", "reader"):
            conn = _raw(urls[role])
            accepted[role] = _everything(harness, conn, names[role])
            conn.close()
        # What PostgreSQL allows every role and the owner cannot revoke (docs/threat-model.md): table locks that
        # block no read (ACCESS SHARE; ROW EXCLUSIVE where it may INSERT), advisory locks, its own password and
        # its own session defaults. Everything else in the list was refused by the database.
        tables = ("chain_head", "entries", "run_charges", "runs", "schema_version", "scopes")
        allowed_everyone = {f"LOCK TABLE {t} IN ACCESS SHARE MODE" for t in tables} | {
            "SELECT pg_advisory_lock(hashtext('dpops'))", "SET ROLE NONE"}
        for role in ("app", "reader"):
            own = {f'ALTER ROLE "{names[role]}" SET default_transaction_read_only = off',
                   f'ALTER ROLE "{names[role]}" SET search_path = public',
                   f'ALTER ROLE "{names[role]}" PASSWORD \'changed\''}
            extra = {"LOCK TABLE entries IN ROW EXCLUSIVE MODE"} if role == "app" else set()
            assert set(accepted[role]) == allowed_everyone | own | extra, (role, accepted[role])
        for role, labels in accepted.items():
            strong = [x for x in labels if x.startswith("LOCK TABLE")
                      and x.split(" IN ")[1].removesuffix(" MODE") not in ("ACCESS SHARE", "ROW SHARE", "ROW EXCLUSIVE")]
            assert strong == [], (role, strong)
            assert not [x for x in labels if x.startswith(("UPDATE", "DELETE", "TRUNCATE", "INSERT", "CREATE"))
                        or "lo_" in x], (role, labels)
    finally:
        harness.close()


@settings(max_examples=examples(12), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_chained_attacks_keep_the_property(deployed, data):
    """Sequences of attacks on one attacker session (a setting changed, then a write; a forged entry after a
    lock): the same invariants after each sequence. False-failure rate: 0 (deterministic; no statistics)."""
    urls, names, _admin = deployed
    harness = Harness(urls)
    try:
        for role in ("app", "reader"):
            conn = _raw(urls[role])
            attacks = _catalog_attacks(conn, names[role])
            picks = data.draw(st.lists(st.sampled_from(range(len(attacks))), min_size=1, max_size=4), label=role)
            for i in picks:
                label, action = attacks[i]
                _attack(harness, conn, f"{role}: {label}", action)
            harness.after(f"{role}: {[attacks[i][0] for i in picks]}")
            conn.close()
    finally:
        harness.close()


def test_reads_fail_within_the_lock_timeout_when_a_session_holds_access_exclusive(deployed):
    """Whoever holds an ACCESS EXCLUSIVE lock (here a superuser: the app role no longer can), the owner's status
    and verify and the page fail after the read lock timeout with an error that says what to do, never hang."""
    urls, names, _admin = deployed
    holder = psycopg.connect(urls["owner"].replace(f"{names['owner']}@", "postgres@").split("?")[0])
    holder.execute("LOCK TABLE dpops.runs IN ACCESS EXCLUSIVE MODE")
    try:
        with open_ledger(urls["owner"]) as owner, open_ledger(urls["reader"]) as reader:
            for what, fn in (("status", lambda: owner.status("s")), ("verify", owner.verify),
                             ("page", lambda: budget_page(reader, None, []))):
                box, thread = _bounded(what, fn)
                assert not box["blocked"], what
                assert isinstance(box["value"], LedgerError), (what, box["value"])
                assert "lock timeout" in str(box["value"]) and "pg_blocking_pids" in str(box["value"]), what
                assert box["seconds"] < LOCK_BOUND_S
    finally:
        holder.rollback()
        holder.close()


def test_reader_and_app_connection_limits(deployed):
    urls, names, admin = deployed
    limits = dict(admin.execute("SELECT rolname, rolconnlimit FROM pg_roles WHERE rolname = ANY(%s)",
                                ([names["reader"], names["app"]],)).fetchall())
    assert limits == {names["reader"]: READER_CONNECTION_LIMIT, names["app"]: 64}
    conns = [psycopg.connect(urls["reader"].split("?")[0]) for _ in range(READER_CONNECTION_LIMIT)]
    try:
        with pytest.raises(psycopg.OperationalError, match="too many connections"):
            psycopg.connect(urls["reader"].split("?")[0])
    finally:
        for c in conns:
            c.close()


def _hand_written_reservation(url: str, app: str, key: RunKey, eps: float, *, buckets: list[str] | None = None,
                              recorded_eps: float | None = None) -> None:
    """INSERT, as ``app`` over a raw connection, the reservation entry dpops itself would write (correct chain,
    body and columns), for a Laplace run of ``eps``; raises what the database raises."""
    conn = _raw(url)
    try:
        last_id, last_hash = conn.execute("SELECT last_id, last_hash FROM chain_head").fetchone()
        ts = "2024-03-20T00:00:00.000000+00:00"
        labels = buckets if buckets is not None else ["*"]
        body = canonical_json({"id": last_id + 1, "ts": ts, "kind": "reserved", "scope": "s", "run_id": key.run_id,
                               "buckets": labels, "actor": "mallory", "writer": app, "data": {
                                   "run_key": key.to_dict(), "restates": None, "details": {},
                                   "accountant": "basic/1", "events": [_laplace_dict(1.0 / eps)],
                                   "interval_start": key.start_utc, "interval_end": key.end_utc,
                                   "epsilon": eps if recorded_eps is None else recorded_eps}})
        digest = entry_hash(last_hash, body)
        conn.execute("INSERT INTO entries (id, ts, kind, scope, run_id, buckets, actor, body, prev_hash, hash, writer) "
                     "VALUES (%s, %s, 'reserved', 's', %s, %s, 'mallory', %s, %s, %s, %s)",
                     (last_id + 1, ts, key.run_id, json.dumps(labels), body, last_hash, digest, app))
        conn.execute("UPDATE chain_head SET last_id = %s, last_hash = %s", (last_id + 1, digest))
        conn.commit()
    finally:
        conn.close()


def test_a_hand_written_reservation_over_the_cap_is_refused_by_the_database(deployed):
    """Issue 25 item 8, closed by construction (schema version 5): the app role INSERTs, around dpops, the exact
    reservation entry dpops would write (correct hash chain, body, columns). The database runs dpops' cap rule
    itself (``dpops.ledger.db_cap``) and refuses it when it does not fit, or when it forges what the check relies
    on (a bucket label, the recorded epsilon); one that fits is admitted (the check is not a blanket refusal).
    On schema version 4 the over-cap entry was stored (status 2.6 on a cap of 1, flagged only by verify)."""
    urls, names, _admin = deployed
    with pytest.raises(psycopg.errors.CheckViolation, match="dpops cap check: .*budget refused on scope 's'"):
        _hand_written_reservation(urls["app"], names["app"], _key(9), 2.0)
    with pytest.raises(psycopg.errors.CheckViolation, match="names buckets"):
        _hand_written_reservation(urls["app"], names["app"], _key(9), 0.1, buckets=["2024-03-09"])
    with pytest.raises(psycopg.errors.CheckViolation, match="records epsilon"):
        _hand_written_reservation(urls["app"], names["app"], _key(9), 2.0, recorded_eps=0.001)
    with open_ledger(urls["owner"]) as owner:
        assert owner.status("s").total == pytest.approx(0.6)  # nothing of the refused entries is recorded
        assert owner.verify().ok
    _hand_written_reservation(urls["app"], names["app"], _key(10), 0.3)  # fits: 0.6 + 0.3 <= 1
    with open_ledger(urls["owner"]) as owner, open_ledger(urls["reader"]) as reader:
        assert owner.status("s").total == pytest.approx(0.9)
        assert [s.total for s in budget_page(reader, None, []).scopes] == pytest.approx([0.9])
        assert owner.verify().ok
    with pytest.raises(psycopg.errors.CheckViolation, match="budget refused"):
        _hand_written_reservation(urls["app"], names["app"], _key(11), 0.2)  # 0.9 + 0.2 > 1
    with open_ledger(urls["app"]) as app, pytest.raises(ScopeBudgetExceeded):
        app.reserve(_key(12), "s", _lap(0.2), actor="op")


def test_without_the_databases_cap_check_no_app_role_reservation_is_admitted(deployed):
    """By construction: if the PL/Python function is dropped (or was never installed), the owner's trigger refuses
    every reservation a non-owner session writes, dpops' own included, with the fix named; granting an app role on
    such a database is refused up front."""
    urls, names, _admin = deployed
    superuser_url = urls["owner"].replace(f"{names['owner']}@", "postgres@").split("?")[0]
    with psycopg.connect(superuser_url, autocommit=True) as su:
        su.execute("DROP FUNCTION dpops.dpops_cap_check(text, text)")
    with open_ledger(urls["app"]) as app, pytest.raises(LedgerError, match="install-cap-check"):
        app.reserve(_key(12), "s", _lap(0.01), actor="op")
    code = main(["ledger", "--ledger", urls["owner"], "init", "--app-role", names["app"]])
    assert code != 0
    with open_ledger(urls["owner"]) as owner:
        assert owner.status("s").total == pytest.approx(0.6)
        assert owner.verify().ok


V3_COMMIT = "a842927"  # schema v3: the app role could still write the buckets and runs caches


@pytest.fixture
def v3_tree(tmp_path):
    """The dpops package of ``V3_COMMIT``, extracted from this repository's own history."""
    import os

    out = tmp_path / "v3"
    out.mkdir()
    repo = Path(__file__).resolve().parent.parent
    try:
        archive = subprocess.run(["git", "-C", str(repo), "archive", V3_COMMIT, "dpops"], capture_output=True,
                                 check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"cannot extract {V3_COMMIT} from the repository: {exc}")
        pytest.skip(f"no git history with {V3_COMMIT}: {exc}")
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True, timeout=60)
    return out


def test_a_v3_ledger_migrates_and_its_app_role_loses_every_cache_write(postgres_url, v3_tree, capsys):
    """A ledger written and granted by dpops at schema v3 (app role: INSERT/UPDATE on buckets and runs), then
    only `dpops ledger init` as the owner (no re-grant): the migration itself closes the caches; the run the
    old code left started is committed by the database's trigger; figures and verify unchanged."""
    import os
    import sys

    import pg_roles_support

    with pg_roles_support.ledger_roles(postgres_url, "t_v3mig") as r:
        script = (
            "from dpops.ledger import open_ledger, ScopeDefinition, RunKey; from dpops.events import Laplace\n"
            "from dpops.cli.main import main\n"
            f"assert main(['ledger', '--ledger', {r.owner_url!r}, 'init', '--app-role', {r.app!r}]) == 0\n"
            f"led = open_ledger({r.owner_url!r})\n"
            "led.create_scope(ScopeDefinition(name='s', unit='u', unit_column='user_id', epsilon=1.0, delta=1e-6, "
            "rho=None, accountant='basic', adjacency='add_remove'), actor='owner')\n"
            f"app = open_ledger({r.app_url!r})\n"
            "for day, eps in ((1, 0.4), (2, 0.2)):\n"
            "    k = RunKey('daily', 'spechash', f'2024-03-0{day}T00:00:00Z', f'2024-03-0{day + 1}T00:00:00Z', 'fp', 'k')\n"
            "    rec = app.reserve(k, 's', [Laplace(scale=1.0 / eps, l1_sensitivity=1.0)], actor='op')\n"
            "    app.start(rec.run_id, actor='op')\n"
            "    if day == 1: app.commit(rec.run_id, output_uri='file:///out/1', actor='op')\n"
            "assert app.db.one('SELECT has_table_privilege(current_user, to_regclass(%s), %s)', ('runs', 'UPDATE'))[0]\n"
        )
        proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(v3_tree)},
                              cwd=v3_tree, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert main(["ledger", "--ledger", r.owner_url, "init"]) == 0, capsys.readouterr().err
        attacker = psycopg.connect(r.app_url.split("?")[0])
        attacker.execute(f'SET search_path TO "{r.schema}"')
        for text in ("UPDATE runs SET state = 'released'", "UPDATE runs SET events = '[]'", "DELETE FROM runs",
                     "INSERT INTO runs (run_id) VALUES ('x')", "SELECT * FROM buckets"):
            with pytest.raises(psycopg.Error):
                attacker.execute(text)
            attacker.rollback()
        attacker.close()
        with open_ledger(r.app_url) as app:
            started = app.runs(states=["started"])[0]
            app.commit(started.run_id, output_uri="file:///out/2", actor="op")
            with pytest.raises(ScopeBudgetExceeded):
                app.reserve(_key(5), "s", _lap(0.6), actor="op")
        with open_ledger(r.owner_url) as owner:
            status = owner.status("s")
            assert (status.committed, status.total) == pytest.approx((0.6, 0.6))
            assert owner.run(started.run_id).state == "committed"
            report = owner.verify()
            assert report.ok, report.problems


def _reservation_sql(conn: psycopg.Connection, app: str, key: RunKey, eps: float, entry_id: int,
                     prev_hash: str) -> None:
    """INSERT, on ``conn`` (its transaction left open), the reservation entry dpops would write at ``entry_id``."""
    ts = "2024-03-20T00:00:00.000000+00:00"
    body = canonical_json({"id": entry_id, "ts": ts, "kind": "reserved", "scope": "s", "run_id": key.run_id,
                           "buckets": ["*"], "actor": "mallory", "writer": app, "data": {
                               "run_key": key.to_dict(), "restates": None, "details": {}, "accountant": "basic/1",
                               "events": [_laplace_dict(1.0 / eps)], "interval_start": key.start_utc,
                               "interval_end": key.end_utc, "epsilon": eps}})
    conn.execute("INSERT INTO entries (id, ts, kind, scope, run_id, buckets, actor, body, prev_hash, hash, writer) "
                 "VALUES (%s, %s, 'reserved', 's', %s, %s, 'mallory', %s, %s, %s, %s)",
                 (entry_id, ts, key.run_id, json.dumps(["*"]), body, prev_hash, entry_hash(prev_hash, body), app))


@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
def test_a_snapshot_transaction_cannot_race_a_reservation_past_the_databases_cap_check(deployed, level):
    """The database's cap check locks the scope row, then composes the history it reads. In READ COMMITTED each
    of its queries sees what committed before the lock was granted; in a REPEATABLE READ or SERIALIZABLE
    transaction it reads the transaction's snapshot instead. So the app role took a snapshot, let a second
    reservation (0.3 of the 0.4 left) commit, then inserted its own 0.3: the check, locking a scope row the other
    transaction had only locked (not changed), saw 0.6 charged and admitted it -- 1.2 on a cap of 1 (fails on the
    old code). The check now refuses to run outside READ COMMITTED."""
    urls, names, _admin = deployed
    late = _raw(urls["app"])
    try:
        late.execute(f"SET TRANSACTION ISOLATION LEVEL {level}")
        last_id, last_hash = late.execute("SELECT last_id, last_hash FROM chain_head").fetchone()  # the snapshot
        _hand_written_reservation(urls["app"], names["app"], _key(10), 0.3)  # commits: 0.9 of 1
        with pytest.raises(psycopg.errors.CheckViolation, match="dpops cap check: .*READ COMMITTED"):
            _reservation_sql(late, names["app"], _key(11), 0.3, last_id + 2, last_hash)
            late.commit()
    finally:
        late.close()
    with open_ledger(urls["owner"]) as owner:
        assert owner.status("s").total == pytest.approx(0.9)


def test_dpops_writes_in_read_committed_whatever_the_roles_default_isolation(deployed):
    """A role may set its own session defaults (``ALTER ROLE ... SET default_transaction_isolation``), and a server
    may default to REPEATABLE READ: dpops' write transactions said plain BEGIN, so its reservations then composed a
    snapshot too (and the database's check now refuses that). They name READ COMMITTED: dpops' own reservations
    still work under such a default, and still refuse what does not fit."""
    urls, names, admin = deployed
    admin.execute(f"ALTER ROLE \"{names['app']}\" SET default_transaction_isolation = 'repeatable read'")
    try:
        with open_ledger(urls["app"]) as app:
            app.reserve(_key(12), "s", _lap(0.3), actor="op")  # 0.4 committed + 0.2 started + 0.3 <= 1
            with pytest.raises(ScopeBudgetExceeded):
                app.reserve(_key(13), "s", _lap(0.2), actor="op")
    finally:
        admin.execute(f"ALTER ROLE \"{names['app']}\" RESET default_transaction_isolation")


@pytest.mark.parametrize("how", ["insert", "copy"])
def test_one_statement_inserting_two_reservations_cannot_pass_the_cap_together(deployed, how):
    """Row-level AFTER triggers fire at the end of the statement: in one multi-row INSERT (or one COPY) the derived
    ``runs`` row of the first reservation did not exist yet when the second one's cap check ran, so two
    reservations that fit only one at a time (0.3 + 0.3 with 0.4 left) were both admitted. Refused now."""
    urls, names, _admin = deployed
    conn = _raw(urls["app"])
    try:
        last_id, last_hash = conn.execute("SELECT last_id, last_hash FROM chain_head").fetchone()
        rows, prev = [], last_hash
        for i, day in enumerate((14, 15), start=1):
            key = _key(day)
            ts = "2024-03-20T00:00:00.000000+00:00"
            body = canonical_json({"id": last_id + i, "ts": ts, "kind": "reserved", "scope": "s", "run_id": key.run_id,
                                   "buckets": ["*"], "actor": "mallory", "writer": names["app"], "data": {
                                       "run_key": key.to_dict(), "restates": None, "details": {},
                                       "accountant": "basic/1", "events": [_laplace_dict(1.0 / 0.3)],
                                       "interval_start": key.start_utc, "interval_end": key.end_utc,
                                       "epsilon": 0.3}})
            digest = entry_hash(prev, body)
            rows.append((last_id + i, ts, key.run_id, json.dumps(["*"]), body, prev, digest, names["app"]))
            prev = digest
        with pytest.raises(psycopg.errors.CheckViolation, match="dpops cap check"):
            if how == "insert":
                conn.execute("INSERT INTO entries (id, ts, kind, scope, run_id, buckets, actor, body, prev_hash, hash, "
                             "writer) VALUES (%s, %s, 'reserved', 's', %s, %s, 'mallory', %s, %s, %s, %s), "
                             "(%s, %s, 'reserved', 's', %s, %s, 'mallory', %s, %s, %s, %s)", rows[0] + rows[1])
            else:
                with conn.cursor().copy("COPY entries (id, ts, kind, scope, run_id, buckets, actor, body, prev_hash, "
                                        "hash, writer) FROM STDIN") as cp:
                    for r in rows:
                        cp.write_row((r[0], r[1], "reserved", "s", r[2], r[3], "mallory", *r[4:]))
            conn.commit()
        conn.rollback()
        # one reservation per statement, two statements in one transaction of the same session: both checked
        _reservation_sql(conn, names["app"], _key(16), 0.3, last_id + 1, last_hash)
        _reservation_sql(conn, names["app"], _key(17), 0.05, last_id + 2, rows[0][6])
        conn.commit()
    finally:
        conn.close()
    with open_ledger(urls["owner"]) as owner:
        assert owner.status("s").total == pytest.approx(0.95)
