"""Review 5: the ledger's guard functions resolve names in the catalog and the ledger's schema only (schema v6).

The guards of schema versions 1-3 ran with the inserting session's ``search_path``, and PostgreSQL searches a
session's temporary schema first, even before ``pg_catalog``, for tables. An application role with the default
TEMP right made itself the owner of ``entries`` to the writer guard through a temporary ``pg_class``, appended a
hash-chained ``cap_changed`` entry with the owner as its writer, and ``ledger export`` + ``import`` rebuilt the scope
with the raised cap (verified OK). A temporary ``entries`` moved the chain head onto an entry that does not exist.

On real PostgreSQL, as the app role of ``dpops ledger init --app-role`` (TEMP is PUBLIC's default right there).
"""

from __future__ import annotations

import json

import psycopg
import pytest

import pg_roles_support
from dpops.events import canonical_json
from dpops.ledger import open_ledger
from dpops.ledger import schema as schema_mod
from dpops.ledger.model import utc_now
from dpops.ledger.schema import entry_hash
from test_ledger_owner_only import setup_ledger

roles = pg_roles_support.roles  # pytest fixture: fresh owner and app roles, own schema


def _shadow_pg_class(conn: psycopg.Connection) -> None:
    """A temporary ``pg_class`` that names the session's own role the owner of ``entries`` and ``scopes``."""
    me = conn.execute("SELECT oid FROM pg_roles WHERE rolname = session_user").fetchone()[0]
    conn.execute("DROP TABLE IF EXISTS pg_temp.pg_class")
    conn.execute("CREATE TEMP TABLE pg_class (oid oid, relowner oid)")
    for table in ("entries", "scopes"):
        oid = conn.execute("SELECT %s::regclass::oid", (table,)).fetchone()[0]
        conn.execute("INSERT INTO pg_temp.pg_class VALUES (%s, %s)", (oid, me))


@pytest.mark.postgres
def test_a_temporary_pg_class_does_not_make_the_app_role_the_owner(roles, capsys, tmp_path):
    owner_url, app_url, owner, app, _admin, _schema = roles
    setup_ledger(capsys, owner_url, app_url, app)
    with open_ledger(app_url) as led:
        conn = led.db.conn
        old = json.loads(conn.execute("SELECT definition FROM scopes WHERE name = 's'").fetchone()[0])
        last_id, last_hash = conn.execute("SELECT last_id, last_hash FROM chain_head").fetchone()
        _shadow_pg_class(conn)
        nid, ts = last_id + 1, utc_now()
        body = {"id": nid, "ts": ts, "kind": "cap_changed", "scope": "s", "run_id": None, "buckets": [],
                "actor": "board", "data": {"before": old, "after": dict(old, epsilon=1000.0), "reason": "board"},
                "writer": owner}
        text = canonical_json(body)
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match=f"only the ledger owner role {owner}"):
            conn.execute(
                "INSERT INTO entries (id, ts, kind, scope, run_id, buckets, actor, body, prev_hash, hash, writer) "
                "VALUES (%s, %s, 'cap_changed', 's', NULL, '[]', 'board', %s, %s, %s, %s)",
                (nid, ts, text, last_hash, entry_hash(last_hash, text), owner))
        conn.rollback()
        # nor may it lock-write a scope row it may only lock
        _shadow_pg_class(conn)
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match=owner):
            conn.execute("UPDATE scopes SET last_entry = 99 WHERE name = 's'")
        conn.rollback()
    with open_ledger(owner_url) as led:
        assert [r[0] for r in led.db.all("SELECT kind FROM entries ORDER BY id")] == [
            "scope_created", "reserved", "started", "committed"]
        assert led.verify().ok


@pytest.mark.postgres
def test_a_temporary_entries_table_does_not_move_the_chain_head(roles, capsys):
    owner_url, app_url, _owner, app, _admin, _schema = roles
    setup_ledger(capsys, owner_url, app_url, app)
    with open_ledger(app_url) as led:
        conn = led.db.conn
        last_id, _ = conn.execute("SELECT last_id, last_hash FROM chain_head").fetchone()
        conn.execute("CREATE TEMP TABLE entries (id bigint, hash text)")
        conn.execute("INSERT INTO pg_temp.entries VALUES (%s, 'f' || repeat('0', 63))", (last_id + 1,))
        with pytest.raises(psycopg.errors.RaiseException, match="only moves forward"):
            conn.execute("UPDATE chain_head SET last_id = last_id + 1, last_hash = 'f' || repeat('0', 63)")
        conn.rollback()
    with open_ledger(owner_url) as led:
        assert led.db.one("SELECT last_id FROM chain_head")[0] == last_id
        assert led.verify().ok


def _unpinned(conn: psycopg.Connection, schema: str) -> list[str]:
    """Functions of ``schema`` whose search_path is not pinned with pg_temp last (or not pinned at all)."""
    bad = []
    for name, config in conn.execute(
            "SELECT p.proname, p.proconfig FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = %s ORDER BY p.proname", (schema,)).fetchall():
        paths = [c.split("=", 1)[1] for c in (config or []) if c.startswith("search_path=")]
        parts = [p.strip().strip('"') for p in paths[0].split(",")] if paths else []
        if not parts or parts[-1] != "pg_temp" or "pg_temp" in parts[:-1]:
            bad.append(f"{name}: {paths or 'no search_path'}")
    return bad


@pytest.mark.postgres
def test_every_function_of_the_ledger_schema_pins_its_search_path(roles, capsys):
    """By construction: a guard added later without a pinned search_path fails here."""
    owner_url, app_url, _owner, app, admin, schema = roles
    setup_ledger(capsys, owner_url, app_url, app)
    names = [r[0] for r in admin.execute(
        "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %s",
        (schema,)).fetchall()]
    assert {"dpops_entries_writer", "dpops_chain_head_forward_only", "dpops_cap_check"} <= set(names)
    assert _unpinned(admin, schema) == []


@pytest.mark.postgres
def test_a_version_5_ledger_is_pinned_by_its_migration(roles, capsys, monkeypatch):
    owner_url, _app_url, _owner, _app, admin, schema = roles
    with monkeypatch.context() as m:
        m.setattr(schema_mod, "MIGRATIONS", schema_mod.MIGRATIONS[:5])
        m.setattr(schema_mod, "SCHEMA_VERSION", 5)
        with open_ledger(owner_url) as led:
            assert led.schema_version == 5
    assert _unpinned(admin, schema)  # version 5 left the session's search_path to the old guards
    with open_ledger(owner_url) as led:
        assert led.schema_version == schema_mod.SCHEMA_VERSION
    assert _unpinned(admin, schema) == []
