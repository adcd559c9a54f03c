"""Issue 21 item 1: the read-only ledger role of the Airflow api-server's Privacy budget page, on real PostgreSQL.

The documented setup, in a fresh database: ``deploy/ledger-roles.sql`` as it ran before the reader existed
(owner and app roles only), ``dpops ledger init --app-role`` as the owner, a scope and a published run; then
the upgrade of deploy/README.md: the same roles file again with ``reader_password_file`` (existing roles left
alone, the reader created) and ``dpops ledger init --app-role ... --reader-role ...`` as ``ledger-init.sh``
runs it. As the reader:

- ``dpops ledger status --json`` and ``ledger runs --json`` answer with the owner's figures, and the page model
  (``dpops.budget_view.budget_page``) shows the same scope with no warning;
- every INSERT, UPDATE, DELETE and TRUNCATE on every ledger table is refused by PostgreSQL: first because its
  transactions are read-only (``default_transaction_read_only``), and still, by privilege, after the reader
  turns that off itself (the grant is the control, the setting is defence in depth);
- a reservation through the Python API and ``dpops ledger reserve``-style writes are refused (exit 3, the
  reader named), nothing written;
- the page model connected as the application role warns that its role may write.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path

import psycopg
import pytest

from dpops.budget_view import budget_page
from dpops.cli.main import main
from dpops.errors import PermissionRefused
from dpops.events import Laplace
from dpops.ledger import RunKey, ScopeDefinition, open_ledger
from dpops.ledger.roles import READER_TABLES, session_write_privileges

from pg_roles_support import install_cap_check

pytestmark = pytest.mark.postgres

ROLES_SQL = Path(__file__).resolve().parent.parent / "deploy" / "ledger-roles.sql"
WRITES = {
    "entries": ["INSERT INTO entries DEFAULT VALUES", "UPDATE entries SET actor = 'x'", "DELETE FROM entries",
                "TRUNCATE entries"],
    "chain_head": ["UPDATE chain_head SET last_id = last_id + 1", "INSERT INTO chain_head DEFAULT VALUES"],
    "scopes": ["UPDATE scopes SET last_entry = last_entry", "DELETE FROM scopes", "INSERT INTO scopes DEFAULT VALUES"],
    "runs": ["UPDATE runs SET state = 'released'", "DELETE FROM runs"],
    "run_charges": ["UPDATE run_charges SET runs = 0", "DELETE FROM run_charges", "TRUNCATE run_charges"],
    "schema_version": ["INSERT INTO schema_version VALUES (99, 'x')", "DELETE FROM schema_version"],
}


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _psql(url: str, pw: Path, roles: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    """deploy/ledger-db-init.sh: the roles SQL, then (when it succeeded) the database's cap check."""
    proc = subprocess.run(
        ["psql", "-X", "-v", "ON_ERROR_STOP=1", url, "-v", f"owner_role={roles['owner']}",
         "-v", f"app_role={roles['app']}", "-v", f"reader_role={roles['reader']}",
         "-v", f"owner_password_file={pw}", "-v", f"app_password_file={pw}", *extra, "-f", str(ROLES_SQL)],
        check=False, capture_output=True, text=True, timeout=60)
    if proc.returncode == 0:
        install_cap_check(f"{url}?schema=dpops", roles["owner"])
    return proc


@pytest.fixture
def deployed(postgres_url, tmp_path):
    """A fresh database set up by the documented procedure; yields the three roles' ledger URLs."""
    if shutil.which("psql") is None:
        pytest.skip("psql not installed")
    tag = uuid.uuid4().hex[:8]
    db = f"t_reader_{tag}"
    roles = {"owner": f"dpops_owner_{tag}", "app": f"dpops_app_{tag}", "reader": f"dpops_reader_{tag}"}
    base = postgres_url.rsplit("/", 1)[0]
    admin = psycopg.connect(postgres_url, autocommit=True)
    admin.execute(f'CREATE DATABASE "{db}"')
    pw = tmp_path / "pw"
    pw.write_text("not-used-with-trust-auth\n")
    try:
        yield base, db, roles, pw, admin
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        for role in roles.values():
            admin.execute(f'DROP ROLE IF EXISTS "{role}"')
        admin.close()


def _url(base: str, db: str, role: str) -> str:
    return f"{base.replace('postgres@', role + '@')}/{db}?schema=dpops"


def _key(day: int) -> RunKey:
    return RunKey("daily", "spechash", f"2024-03-{day:02d}T00:00:00Z", f"2024-03-{day + 1:02d}T00:00:00Z", "fp", "k1")


def test_reader_role_reads_the_budget_and_postgres_refuses_its_writes(deployed, capsys):
    base, db, roles, pw, admin = deployed
    # 1. The setup of a stack made before the reader existed: owner and app roles, schema, scope, runs.
    first = _psql(f"{base}/{db}", pw, roles)
    assert first.returncode == 0, first.stderr
    assert admin.execute("SELECT count(*) FROM pg_roles WHERE rolname = %s", (roles["reader"],)).fetchone() == (0,)
    owner_url, app_url, reader_url = (_url(base, db, roles[r]) for r in ("owner", "app", "reader"))
    code, _, err = _cli(capsys, "ledger", "--ledger", owner_url, "init", "--app-role", roles["app"])
    assert code == 0, err
    with open_ledger(owner_url) as led:
        led.create_scope(ScopeDefinition(name="s", unit="a user's events", unit_column="user_id", epsilon=1.0,
                                         delta=1e-6, rho=None, accountant="basic", adjacency="add_remove"),
                         actor="owner")
    with open_ledger(app_url) as led:
        for day, eps in ((1, 0.3), (2, 0.2)):
            rec = led.reserve(_key(day), "s", [Laplace(scale=1.0 / eps, l1_sensitivity=1.0)], actor="op")
            led.start(rec.run_id, actor="op")
            if day == 1:
                led.commit(rec.run_id, output_uri="file:///out/1", actor="op")

    # 2. The upgrade (deploy/README.md): the roles file again, now with the reader; existing roles untouched.
    again = _psql(f"{base}/{db}", pw, roles, "-v", f"reader_password_file={pw}")
    assert again.returncode == 0, again.stderr
    assert f"role {roles['owner']} exists: left as it is" in again.stdout
    assert f"role {roles['app']} exists: left as it is" in again.stdout
    row = admin.execute("SELECT rolsuper, rolcreaterole, rolinherit, rolconfig FROM pg_roles WHERE rolname = %s",
                        (roles["reader"],)).fetchone()
    assert row == (False, False, False, ["default_transaction_read_only=on"]), row
    # Before the grant the reader sees nothing; ledger-init.sh's command grants it SELECT only.
    with pytest.raises(Exception):
        with open_ledger(reader_url) as led:
            led.status("s")
    code, out, err = _cli(capsys, "ledger", "--ledger", owner_url, "init", "--app-role", roles["app"],
                          "--reader-role", roles["reader"], "--print-sql")
    assert code == 0, err
    assert 'GRANT SELECT ON "dpops"."entries"' in out and f"role {roles['reader']}: may read the ledger" in out

    # 3. The reader reads what the owner reads.
    code, owner_status, err = _cli(capsys, "ledger", "--ledger", owner_url, "status", "s", "--json")
    assert code == 0, err
    code, reader_status, err = _cli(capsys, "ledger", "--ledger", reader_url, "status", "s", "--json")
    assert code == 0, err
    assert json.loads(reader_status) == json.loads(owner_status)
    assert json.loads(reader_status)["committed"] == pytest.approx(0.3)
    assert json.loads(reader_status)["total"] == pytest.approx(0.5)
    code, runs, err = _cli(capsys, "ledger", "--ledger", reader_url, "runs", "--json")
    assert code == 0 and len(json.loads(runs)["runs"]) == 2, err
    with open_ledger(reader_url) as led:
        assert session_write_privileges(led.db) == []
        page = budget_page(led, None, [])
        (st,) = page.scopes
        assert (st.committed, st.started, st.total) == pytest.approx((0.3, 0.2, 0.5))
        assert not [p for p in page.problems if "may write" in p], page.problems
        assert [round(t, 9) for t in (p.total for p in page.spend["s"])] == [0.3, 0.5]
        n_entries = led.db.row("SELECT count(*) FROM entries")[0]

        # 4. The Python API's writes are refused (exit-3 class), naming the reader; nothing written.
        with pytest.raises(PermissionRefused, match=f"{roles['reader']}.*may only read the ledger"):
            led.reserve(_key(5), "s", [Laplace(scale=10.0, l1_sensitivity=1.0)], actor="mallory")
        assert led.db.row("SELECT count(*) FROM entries")[0] == n_entries
    code, _, err = _cli(capsys, "ledger", "--ledger", reader_url, "cap", "s", "--epsilon", "100", "--reason", "x")
    assert code == 3 and "Traceback" not in err, err
    code, _, err = _cli(capsys, "ledger", "--ledger", reader_url, "init", "--reader-role", roles["reader"])
    assert code != 0, "the reader cannot grant itself anything"

    # 5. Raw SQL: refused as read-only transactions, and by privilege once the reader turns that off itself.
    conn = psycopg.connect(reader_url.split("?")[0], autocommit=True)
    try:
        conn.execute("SET search_path TO dpops")
        assert set(READER_TABLES) == set(WRITES)
        for table, statements in WRITES.items():
            assert conn.execute(f"SELECT count(*) >= 0 FROM {table}").fetchone() == (True,)
            for sql in statements:
                with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
                    conn.execute(sql)
        conn.execute("SET default_transaction_read_only = off")
        for table, statements in WRITES.items():
            for sql in statements:
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    conn.execute(sql)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("CREATE TABLE dpops.planted (a int)")
    finally:
        conn.close()
    with open_ledger(owner_url) as led:
        assert led.db.row("SELECT count(*) FROM entries")[0] == n_entries
        assert led.verify().ok

    # 6. Connected as the application role instead, the page says its role may write.
    with open_ledger(app_url) as led:
        assert any(w.startswith("entries: INSERT") for w in session_write_privileges(led.db))
        assert any("may write" in p for p in budget_page(led, None, []).problems)


def test_reader_role_must_be_a_separate_ordinary_role(deployed, capsys):
    base, db, roles, pw, _admin = deployed
    assert _psql(f"{base}/{db}", pw, roles, "-v", f"reader_password_file={pw}").returncode == 0
    owner_url = _url(base, db, roles["owner"])
    assert _cli(capsys, "ledger", "--ledger", owner_url, "init", "--app-role", roles["app"])[0] == 0
    code, _, err = _cli(capsys, "ledger", "--ledger", owner_url, "init", "--app-role", roles["app"],
                        "--reader-role", roles["app"])
    assert code != 0 and "both --app-role and --reader-role" in err
    code, _, err = _cli(capsys, "ledger", "--ledger", owner_url, "init", "--reader-role", roles["owner"])
    assert code != 0 and "owns the ledger tables" in err
    code, _, err = _cli(capsys, "ledger", "--ledger", owner_url, "init", "--reader-role", "postgres")
    assert code != 0 and "superuser" in err
    code, _, err = _cli(capsys, "ledger", "--ledger", owner_url, "init", "--reader-role", "no_such_role_x")
    assert code != 0 and "does not exist" in err and "--reader-role no_such_role_x" in err
