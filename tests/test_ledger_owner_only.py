"""Issue 19 item 10: the database itself refuses owner-only operations from the application role, and every
entry records the database role that wrote it.

On real PostgreSQL (own schema and roles per test, dropped afterwards):
- every owner-only CLI command run as the app role is refused with exit 3 naming the owner role (no traceback),
  and nothing changes;
- the same writes as raw SQL, and through the Python API with the client-side check removed, are refused by
  the database (privileges and the schema-v3 triggers), naming the owner;
- the app role still reserves, starts, commits and releases; each entry's ``writer`` is the session role;
- ``ledger verify`` flags a cap change written by another role (guard disabled by a superuser);
- a ledger written by the base commit (schema v2, no writers) migrates and keeps verifying;
- export / import keeps the writers.
On SQLite: there are no roles; verify says so, and the signed checkpoints catch a rewrite but not an append.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from dpops.cli.main import main
from dpops.events import Laplace
from dpops.ledger import RunKey, ScopeDefinition, open_ledger
from dpops.ledger import roles as roles_mod
from dpops.ledger import store as store_mod
from dpops.errors import PermissionRefused
from dpops.ledger.schema import SCHEMA_VERSION
from dpops.manifest.sign import generate_signing_key

import pg_roles_support

roles = pg_roles_support.roles  # pytest fixture: fresh owner and app roles, own schema

DAY = "2024-03-{:02d}T00:00:00Z"
BASE_COMMIT = "42476cc"  # schema v2 (no writer column): the tree the upgrade test runs
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def base_tree(tmp_path):
    """The dpops package of ``BASE_COMMIT``, extracted from this repository's own history."""
    out = tmp_path / "base"
    out.mkdir()
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", BASE_COMMIT, "dpops"], capture_output=True,
                                 check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"cannot extract {BASE_COMMIT} from the repository: {exc}")
        pytest.skip(f"no git history with {BASE_COMMIT}: {exc}")
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True, timeout=60)
    return out


def scope_def(name="s", epsilon=1.0):
    return ScopeDefinition(name=name, unit="a user's events", unit_column="user_id", epsilon=epsilon, delta=1e-6,
                           rho=None, accountant="basic", adjacency="add_remove")


def key(day):
    return RunKey("daily_counts", "spechash", DAY.format(day), DAY.format(day + 1), "fp", "key1")


def lap(eps):
    return [Laplace(scale=1.0 / eps, l1_sensitivity=1.0)]


def full_run(led, k, eps, scope="s"):
    rec = led.reserve(k, scope, lap(eps), actor="op")
    led.start(rec.run_id, actor="op")
    return led.commit(rec.run_id, output_uri=f"file:///out/{k.interval_start[:10]}", actor="op")


def cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def setup_ledger(capsys, owner_url, app_url, app):
    code, _, err = cli(capsys, "ledger", "--ledger", owner_url, "init", "--app-role", app)
    assert code == 0, err
    with open_ledger(owner_url) as led:
        led.create_scope(scope_def(), actor="owner")
    with open_ledger(app_url) as led:
        full_run(led, key(1), 0.3)


def snapshot(url):
    with open_ledger(url) as led:
        return ([tuple(r) for r in led.db.all("SELECT id, hash FROM entries ORDER BY id")],
                [tuple(r) for r in led.db.all("SELECT name, definition FROM scopes ORDER BY name")])


@pytest.mark.postgres
def test_every_owner_only_command_is_refused_for_the_app_role(roles, capsys, tmp_path):
    owner_url, app_url, owner, app, _admin, _schema = roles
    setup_ledger(capsys, owner_url, app_url, app)
    other = f"sqlite:///{tmp_path}/other.sqlite"
    with open_ledger(other) as led:
        led.create_scope(scope_def("imported"), actor="someone")
    export = tmp_path / "other.jsonl"
    assert cli(capsys, "ledger", "--ledger", other, "export", str(export))[0] == 0
    before = snapshot(owner_url)
    create = ["scope", "create", "--unit", "u", "--unit-column", "user_id", "--epsilon", "1", "--delta", "1e-6",
              "--accountant", "basic", "--adjacency", "add_remove", "--actor", "mallory"]
    owner_only = {
        "scope create (new)": ["ledger", "--ledger", app_url, *create[:2], "appmade", *create[2:]],
        "scope create (identical, a no-op for the owner)": [
            "ledger", "--ledger", app_url, "scope", "create", "s", "--unit", "a user's events", "--unit-column",
            "user_id", "--epsilon", "1", "--delta", "1e-6", "--accountant", "basic", "--adjacency", "add_remove"],
        "cap": ["ledger", "--ledger", app_url, "cap", "s", "--epsilon", "1000", "--actor", "mallory",
                "--reason", "more"],
        "cap (delta only)": ["ledger", "--ledger", app_url, "cap", "s", "--delta", "1e-5", "--reason", "more"],
        "import": ["ledger", "--ledger", app_url, "import", str(export)],
        "init": ["ledger", "--ledger", app_url, "init"],
        "init --app-role": ["ledger", "--ledger", app_url, "init", "--app-role", app],
    }
    for what, argv in owner_only.items():
        code, out, err = cli(capsys, *argv)
        assert code == 3, (what, code, out, err)
        assert repr(owner) in err and "Traceback" not in err + out, (what, err)
        assert "psycopg" not in err, (what, err)
        code, out, _ = cli(capsys, *argv, "--json")
        doc = json.loads(out)
        assert code == 3 and doc["exit_code"] == 3 and owner in doc["error"], (what, doc)
    assert snapshot(owner_url) == before  # nothing was written
    assert cli(capsys, "ledger", "--ledger", app_url, "verify")[0] == 0
    # the owner still can
    code, out, err = cli(capsys, "ledger", "--ledger", owner_url, "cap", "s", "--epsilon", "2", "--reason", "board")
    assert code == 0, err


@pytest.mark.postgres
def test_the_database_refuses_owner_only_writes_without_the_client_check(roles, capsys, monkeypatch):
    """Raw SQL and the API with ``require_owner`` removed: privileges and the v3 triggers still refuse."""
    owner_url, app_url, owner, app, _admin, _schema = roles
    setup_ledger(capsys, owner_url, app_url, app)
    with open_ledger(app_url) as led:
        definition = led.db.one("SELECT definition FROM scopes WHERE name = 's'")[0]
        head = led.db.one("SELECT last_id, last_hash FROM chain_head")
        raw = [
            ("INSERT INTO scopes (name, definition, accountant, last_entry) VALUES ('x', %s, 'basic/1', 0)",
             (definition,), "permission denied"),
            ("UPDATE scopes SET definition = %s WHERE name = 's'", (definition.replace('"epsilon":1.0', '"epsilon":1000.0'),),
             "permission denied"),
            ("UPDATE scopes SET last_entry = 99 WHERE name = 's'", (), owner),  # the one column it may lock
            ("DELETE FROM scopes", (), "permission denied"),
            ("TRUNCATE scopes", (), "permission denied"),
            # a cap_changed entry that names the app role correctly as its writer: refused by kind
            ("INSERT INTO entries (id, ts, kind, scope, run_id, buckets, actor, body, prev_hash, hash, writer) "
             "VALUES (%s, 't', 'cap_changed', 's', NULL, '[]', 'mallory', %s, %s, 'h', %s)",
             (head[0] + 1, json.dumps({"writer": app}), head[1], app), owner),
            # a run entry that claims another writer
            ("INSERT INTO entries (id, ts, kind, scope, run_id, buckets, actor, body, prev_hash, hash, writer) "
             "VALUES (%s, 't', 'started', 's', 'r', '[]', 'op', %s, %s, 'h', %s)",
             (head[0] + 1, json.dumps({"writer": owner}), head[1], owner), "must record itself"),
            ("ALTER TABLE entries DISABLE TRIGGER entries_writer", (), "owner"),
            ("DROP TRIGGER scopes_owner_only ON scopes", (), "owner"),
        ]
        for sql, params, message in raw:
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match=message):
                led.db.conn.execute(sql, params)
    # the API without the client-side check: the database refuses, the error names the owner, nothing changes
    before = snapshot(owner_url)
    monkeypatch.setattr(store_mod, "require_owner", lambda db, action: None)
    with open_ledger(app_url) as led:
        with pytest.raises(PermissionRefused, match=f"only the ledger owner role '?{owner}'? may"):
            led.change_cap("s", epsilon=1000.0, reason="mallory", actor="mallory")
        with pytest.raises(PermissionRefused, match=owner):
            led.create_scope(scope_def("appmade"), actor="mallory")
        full_run(led, key(2), 0.2)  # and the app role still runs releases
        rec = led.reserve(key(3), "s", lap(0.1), actor="op")
        led.release(rec.run_id, reason="refund", actor="op")
        assert led.verify().ok
    after = snapshot(owner_url)
    assert after[1] == before[1] and len(after[0]) == len(before[0]) + 5


@pytest.mark.postgres
def test_entries_record_the_session_role_and_verify_flags_a_cap_change_by_another_role(roles, capsys, monkeypatch):
    owner_url, app_url, owner, app, admin, schema = roles
    setup_ledger(capsys, owner_url, app_url, app)
    code, out, _ = cli(capsys, "ledger", "--ledger", app_url, "history", "--json")
    writers = [(e["kind"], e["writer"]) for e in json.loads(out)["entries"]]
    assert writers == [("scope_created", owner), ("reserved", app), ("started", app), ("committed", app)]
    code, out, _ = cli(capsys, "ledger", "--ledger", app_url, "verify")
    assert code == 0 and f"owner role {owner}: scope and cap entries written by {owner} 1" in out
    # A superuser disables the guards and lets the app role write a cap change: verify names it.
    admin.execute(f'ALTER TABLE "{schema}".entries DISABLE TRIGGER entries_writer')
    admin.execute(f'ALTER TABLE "{schema}".scopes DISABLE TRIGGER scopes_owner_only')
    admin.execute(f'GRANT UPDATE ON "{schema}".scopes TO "{app}"')
    monkeypatch.setattr(store_mod, "require_owner", lambda db, action: None)
    with open_ledger(app_url) as led:
        led.change_cap("s", epsilon=1000.0, reason="mallory", actor="alice")  # a typed actor proves nothing
    admin.execute(f'ALTER TABLE "{schema}".entries ENABLE TRIGGER entries_writer')
    monkeypatch.undo()
    code, out, err = cli(capsys, "ledger", "--ledger", owner_url, "verify")
    assert code == 7
    assert f"cap_changed on scope 's' was written by role '{app}', not by the ledger owner role '{owner}'" in out + err


@pytest.mark.postgres
def test_export_import_keeps_writers_and_legacy_entries_verify(roles, capsys, tmp_path):
    """SQLite history (no writers) imported into PostgreSQL by the owner, then app-role runs; round trip back."""
    owner_url, app_url, owner, app, _admin, _schema = roles
    legacy = f"sqlite:///{tmp_path}/legacy.sqlite"
    with open_ledger(legacy) as led:
        led.create_scope(scope_def(), actor="owner")
        full_run(led, key(1), 0.3)
    first = tmp_path / "legacy.jsonl"
    assert cli(capsys, "ledger", "--ledger", legacy, "export", str(first))[0] == 0
    assert all("writer" not in json.loads(line) for line in first.read_text().splitlines())  # format unchanged
    assert cli(capsys, "ledger", "--ledger", owner_url, "init", "--app-role", app)[0] == 0
    code, _, err = cli(capsys, "ledger", "--ledger", owner_url, "import", str(first))
    assert code == 0, err
    with open_ledger(app_url) as led:
        full_run(led, key(2), 0.3)
    code, out, _ = cli(capsys, "ledger", "--ledger", app_url, "verify", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["writers"]["unrecorded"] == 4 and doc["writers"]["by_writer"] == {app: 3}
    second = tmp_path / "pg.jsonl"
    assert cli(capsys, "ledger", "--ledger", app_url, "export", str(second))[0] == 0
    assert cli(capsys, "ledger", "verify", "--export", str(second))[0] == 0
    back = f"sqlite:///{tmp_path}/back.sqlite"
    assert cli(capsys, "ledger", "--ledger", back, "init")[0] == 0
    code, _, err = cli(capsys, "ledger", "--ledger", back, "import", str(second))
    assert code == 0, err
    with open_ledger(back) as led:
        assert [e.writer for e in led.history()] == [None] * 4 + [app] * 3
    # an export whose writer was edited no longer verifies (the writer is in the hashed body)
    lines = second.read_text().splitlines()
    doc = json.loads(lines[-1])
    doc["writer"] = owner
    (tmp_path / "edited.jsonl").write_text("\n".join(lines[:-1] + [json.dumps(doc)]) + "\n")
    code, out, err = cli(capsys, "ledger", "verify", "--export", str(tmp_path / "edited.jsonl"))
    assert code == 7 and "hash does not recompute" in out + err


@pytest.mark.postgres
def test_a_ledger_of_the_base_commit_migrates_and_the_app_role_loses_cap_changes(roles, capsys, base_tree):
    """Schema v2 written by dpops at 42476cc (no writer column) -> v3 by the owner's `ledger init`."""
    BASE = base_tree
    assert "_V3" not in (BASE / "dpops/ledger/schema.py").read_text()
    owner_url, app_url, owner, app, _admin, _schema = roles
    script = (
        "import sys; from dpops.ledger import open_ledger, ScopeDefinition, RunKey; from dpops.events import Laplace\n"
        "from dpops.cli.main import main\n"
        f"assert main(['ledger', '--ledger', {owner_url!r}, 'init', '--app-role', {app!r}]) == 0\n"
        f"led = open_ledger({owner_url!r})\n"
        "led.create_scope(ScopeDefinition(name='s', unit='u', unit_column='user_id', epsilon=1.0, delta=1e-6, "
        "rho=None, accountant='basic', adjacency='add_remove'), actor='owner')\n"
        f"app = open_ledger({app_url!r})\n"
        "r = app.reserve(RunKey('daily_counts', 'spechash', '2024-03-01T00:00:00Z', '2024-03-02T00:00:00Z', 'fp', "
        "'key1'), 's', [Laplace(scale=4.0, l1_sensitivity=1.0)], actor='op')\n"
        "app.start(r.run_id, actor='op')\n"
        "app.change_cap('s', epsilon=5.0, reason='the old hole', actor='mallory')\n"  # what v2 allowed
    )
    env = {**os.environ, "PYTHONPATH": str(BASE)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=BASE, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    code, out, err = cli(capsys, "ledger", "--ledger", app_url, "status", "s")
    assert code == 3 and "run `dpops ledger init` once as the ledger's owner role" in err
    assert cli(capsys, "ledger", "--ledger", owner_url, "init", "--app-role", app)[0] == 0
    with open_ledger(app_url) as led:
        assert led.schema_version == SCHEMA_VERSION
        led.commit(led.runs()[0].run_id, output_uri="file:///out/1", actor="op")
        with pytest.raises(PermissionRefused, match=owner):
            led.change_cap("s", epsilon=50.0, reason="again", actor="mallory")
    code, out, err = cli(capsys, "ledger", "--ledger", app_url, "verify")
    # the v2 cap change has no recorded writer: counted, not judged (no false alarm on legacy history)
    assert code == 0 and "4 entries have no recorded writer" in out, out + err


def test_sqlite_has_no_roles_and_checkpoints_catch_a_rewrite_not_an_append(tmp_path, capsys, monkeypatch):
    """Whoever can write a SQLite file is its owner: a cap raise through the API is an append (history shows it,
    checkpoints still extend); a rewrite of the original cap is caught by the signed checkpoints."""
    url = f"sqlite:///{tmp_path}/l.sqlite"
    priv, pub = tmp_path / "cp.key", tmp_path / "cp.pub"
    generate_signing_key(priv, pub)
    cps = tmp_path / "cps"
    with open_ledger(url) as led:
        led.create_scope(scope_def(epsilon=1.0), actor="owner")
        full_run(led, key(1), 0.5)
        from dpops.ledger.checkpoint import checkpoint_ledger

        checkpoint_ledger(led, cps, priv)
    # any process that can write the file may raise the cap: the appended entry is in the history
    code, _, err = cli(capsys, "ledger", "--ledger", url, "cap", "s", "--epsilon", "1000", "--reason", "more",
                       "--actor", "mallory")
    assert code == 0, err
    code, out, _ = cli(capsys, "ledger", "--ledger", url, "verify", "--checkpoints", str(cps), "--public-key", str(pub))
    assert code == 0 and "whoever can write the file is its owner" in out
    code, out, _ = cli(capsys, "ledger", "--ledger", url, "history", "--json")
    assert json.loads(out)["entries"][-1]["actor"] == "mallory"
    # a rewrite (the scope "always" had cap 1000, history replayed) breaks the signed chain
    path = Path(str(tmp_path / "l.sqlite"))
    os.remove(path)
    for suffix in ("-wal", "-shm"):
        if os.path.exists(str(path) + suffix):
            os.remove(str(path) + suffix)
    with open_ledger(url) as led:
        led.create_scope(scope_def(epsilon=1000.0), actor="owner")
        full_run(led, key(1), 0.5)
    code, out, err = cli(capsys, "ledger", "--ledger", url, "verify", "--checkpoints", str(cps), "--public-key", str(pub))
    assert code == 7 and "checkpoint" in (out + err).lower()


def test_require_owner_is_a_no_op_on_sqlite(tmp_path):
    with open_ledger(f"sqlite:///{tmp_path}/x.sqlite") as led:
        roles_mod.require_owner(led.db, "anything")
        assert led.db.session_role() is None
