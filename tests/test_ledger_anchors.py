"""Issue 14 item 4 / issue 13: the ledger against an insider with database write access.

- PostgreSQL owner/application roles: the application role can run releases but cannot
  UPDATE, DELETE or TRUNCATE entries, reset the chain head, or touch the triggers.
- Signed checkpoints of the chain head (outside the database) and --expect-head catch a
  ledger rebuilt by its owner: replayed with a raised cap, truncated and re-inserted, or
  with one run charged half. Legitimate growth after a checkpoint passes.
- ``ledger verify --export FILE`` verifies an export on its own.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import psycopg
import pytest

from dpops.cli.main import main
from dpops.errors import IntegrityError
from dpops.events import Laplace
from dpops.ledger import RunKey, ScopeBudgetExceeded, ScopeDefinition, open_ledger
from dpops.ledger.checkpoint import DIR_ENV, KEY_ENV, PUBLIC_KEY_ENV, checkpoint_ledger, load_checkpoints
from dpops.ledger.schema import GENESIS_HASH
from dpops.ledger.verify import verify_export

from pg_roles_support import install_cap_check, ledger_roles
from dpops.manifest.sign import generate_signing_key

DAY = "2024-03-{:02d}T00:00:00Z"


def scope_def(epsilon=1.0, name="s"):
    return ScopeDefinition(name=name, unit="a user's events", unit_column="user_id", epsilon=epsilon, delta=1e-6,
                           rho=None, accountant="basic")


def key(day):
    return RunKey("daily_counts", "spechash", DAY.format(day), DAY.format(day + 1), "fp", "key1")


def lap(eps):
    return [Laplace(scale=1.0 / eps, l1_sensitivity=1.0)]


def full_run(led, k, events, scope="s"):
    rec = led.reserve(k, scope, events, actor="op")
    led.start(rec.run_id, actor="op")
    return led.commit(rec.run_id, output_uri=f"file:///out/{k.interval_start[:10]}", actor="op")


def populate(led, cap=1.0, charges=(0.3, 0.3, 0.3)):
    led.create_scope(scope_def(cap), actor="op")
    for day, eps in enumerate(charges, start=1):
        full_run(led, key(day), lap(eps))


@pytest.fixture
def keys(tmp_path):
    priv, pub = tmp_path / "cp.key", tmp_path / "cp.pub"
    generate_signing_key(priv, pub)
    return str(priv), str(pub)


@pytest.fixture
def pg_schema(postgres_url):
    schema = f"t_anchor_{uuid.uuid4().hex[:12]}"
    yield schema
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


# --- PostgreSQL roles and guards -----------------------------------------------------------------------------------


@pytest.mark.postgres
def test_app_role_can_run_releases_but_not_rewrite_history(postgres_url, pg_schema, capsys, monkeypatch):
    with ledger_roles(postgres_url, "t_anchor", schema=pg_schema, app_inherit=True) as (owner_url, app_url, owner, app,
                                                                                      _admin, _schema):
        # the owner creates the schema and grants the application role through the CLI
        code, out, err = cli(capsys, "ledger", "--ledger", owner_url, "init", "--app-role", app)
        assert code == 0, err
        assert "cannot UPDATE, DELETE or TRUNCATE" in out
        with open_ledger(owner_url) as led:
            led.create_scope(scope_def(1.0), actor="owner")
        # the owner itself is refused as an app role (it could drop the triggers)
        code, _, err = cli(capsys, "ledger", "--ledger", owner_url, "init", "--app-role", owner)
        assert code != 0 and "owns the ledger tables" in err

        with open_ledger(app_url) as led:  # a normal reserve/start/commit works as the app role
            full_run(led, key(1), lap(0.3))
            rec = led.reserve(key(2), "s", lap(0.2), actor="app")
            led.release(rec.run_id, reason="test refund", actor="app")
            assert led.verify().ok
            assert led.status("s").committed == pytest.approx(0.3)
            forbidden = [
                "UPDATE entries SET actor = 'mallory' WHERE id = 2",
                "DELETE FROM entries WHERE id = 2",
                "TRUNCATE entries",
                "TRUNCATE entries CASCADE",
                "UPDATE chain_head SET last_id = 0, last_hash = '" + GENESIS_HASH + "'",
                "DELETE FROM chain_head",
                "TRUNCATE chain_head",
                "DELETE FROM runs",
                "TRUNCATE runs",
                "DROP TRIGGER entries_append_only ON entries",
                "DROP TRIGGER entries_no_truncate ON entries",
                "ALTER TABLE entries DISABLE TRIGGER USER",
                "ALTER TABLE entries DISABLE TRIGGER entries_append_only",
                "DROP TABLE entries",
                "CREATE TABLE x (a int)",
            ]
            for sql in forbidden:
                with pytest.raises(psycopg.Error):
                    led.db.conn.execute(sql)
            n = led.db.one("SELECT COUNT(*) FROM entries")[0]
            assert n == 6 and led.verify().ok
        # a dpops upgrade bringing a new migration: the app role is told to run init as the owner
        from dpops.ledger import schema as schema_mod

        upgrade = schema_mod.SCHEMA_VERSION + 1
        monkeypatch.setattr(schema_mod, "MIGRATIONS", [*schema_mod.MIGRATIONS, (upgrade, lambda db: None)])
        monkeypatch.setattr(schema_mod, "SCHEMA_VERSION", upgrade)
        code, _, err = cli(capsys, "ledger", "--ledger", app_url, "status", "s")
        assert code != 0 and "run `dpops ledger init` once as the ledger's owner role" in err
        assert cli(capsys, "ledger", "--ledger", owner_url, "init")[0] == 0
        assert cli(capsys, "ledger", "--ledger", app_url, "verify")[0] == 0


@pytest.mark.postgres
def test_truncate_refused_even_for_the_owner_while_the_trigger_stands(postgres_url, pg_schema):
    with open_ledger(f"{postgres_url}?schema={pg_schema}") as led:
        populate(led)
        for sql in ("TRUNCATE entries", "TRUNCATE entries CASCADE", "TRUNCATE chain_head"):
            with pytest.raises(psycopg.Error, match="append-only|cannot be deleted or truncated"):
                led.db.conn.execute(sql)
        with pytest.raises(psycopg.Error, match="only moves forward"):
            led.db.conn.execute("UPDATE chain_head SET last_id = 0, last_hash = %s", (GENESIS_HASH,))
        assert led.verify().ok and led.db.one("SELECT COUNT(*) FROM entries")[0] == 10


def test_sqlite_chain_head_only_moves_forward(tmp_path):
    with open_ledger(f"sqlite:///{tmp_path}/l.sqlite") as led:
        populate(led)
        for sql, params in (("UPDATE chain_head SET last_id = 0, last_hash = ?", (GENESIS_HASH,)),
                            ("UPDATE chain_head SET last_id = 8, last_hash = (SELECT hash FROM entries WHERE id = 8)",
                             ()),
                            ("DELETE FROM chain_head", ())):
            with pytest.raises(Exception, match="chain head"):
                led.db.conn.execute(sql, params)
        assert led.verify().ok


# --- signed checkpoints --------------------------------------------------------------------------------------------


def replay_history(entries, led, cap, charge=None):
    """An insider's rebuild through the Ledger API: same runs, same order, other numbers."""
    for e in entries:
        if e.kind == "scope_created":
            led.create_scope(ScopeDefinition.from_dict({**e.data["definition"], "epsilon": cap}), actor=e.actor)
        elif e.kind == "reserved":
            events = e.data["events"]
            if charge is not None and e.run_id == charge[0]:
                events = [{**ev, "scale": ev["scale"] * charge[1]} for ev in events]
            led.reserve(RunKey.from_dict(e.data["run_key"]), e.scope, events, actor=e.actor)
        elif e.kind == "started":
            led.start(e.run_id, actor=e.actor)
        elif e.kind == "committed":
            led.commit(e.run_id, output_uri=e.data["output_uri"], actor=e.actor)


def rebuild_sqlite(url, path, cap, charge=None):
    with open_ledger(url) as led:
        entries = led.history()
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(str(path) + suffix):
            os.unlink(str(path) + suffix)
    led = open_ledger(url)
    replay_history(entries, led, cap, charge)
    return led


def test_a_replay_with_raised_cap_is_caught_by_checkpoints(tmp_path, keys, capsys):
    path = tmp_path / "l.sqlite"
    url, cps = f"sqlite:///{path}", tmp_path / "checkpoints"
    with open_ledger(url) as led:
        populate(led)
        with pytest.raises(ScopeBudgetExceeded):
            led.reserve(key(4), "s", lap(0.3), actor="op")
        checkpoint_ledger(led, cps, keys[0])
        old_head = led.verify().head_hash
    led = rebuild_sqlite(url, path, cap=2.0)
    full_run(led, key(4), lap(0.3))  # the refused release now publishes
    assert led.verify().ok  # the insider's rebuild is self-consistent: verify alone cannot tell
    report = led.verify(checkpoints=load_checkpoints(cps, keys[1]))
    assert not report.ok and "rewritten after the checkpoint" in report.problems[0]
    assert not led.verify(expect_heads=[old_head]).ok
    led.close()
    code, out, err = cli(capsys, "ledger", "--ledger", url, "verify", "--checkpoints", str(cps), "--public-key", keys[1])
    assert code == 7 and "rewritten" in err
    code, _, err = cli(capsys, "ledger", "--ledger", url, "verify", "--expect-head", old_head)
    assert code == 7 and "expected head" in err


@pytest.mark.postgres
def test_b_truncate_and_head_reset_by_the_owner_is_caught(postgres_url, pg_schema, keys, tmp_path):
    url, cps = f"{postgres_url}?schema={pg_schema}", tmp_path / "checkpoints"
    with open_ledger(url) as led:
        populate(led)
        checkpoint_ledger(led, cps, keys[0])
        entries = led.history()
        conn = led.db.conn  # the owner: disables its own triggers, truncates, resets the head
        for table in ("entries", "chain_head"):
            conn.execute(f"ALTER TABLE {table} DISABLE TRIGGER USER")
        conn.execute("TRUNCATE entries, runs, run_charges, scopes")
        conn.execute("UPDATE chain_head SET last_id = 0, last_hash = %s", (GENESIS_HASH,))
        for table in ("entries", "chain_head"):
            conn.execute(f"ALTER TABLE {table} ENABLE TRIGGER USER")
        replay_history(entries, led, cap=5.0)
        full_run(led, key(4), lap(0.3))
        assert led.verify().ok  # undetectable from inside the database
        report = led.verify(checkpoints=load_checkpoints(cps, keys[1]))
        assert not report.ok and "rewritten" in report.problems[0]


def test_c_rebuild_with_one_run_charged_half_is_caught(tmp_path, keys):
    path = tmp_path / "l.sqlite"
    url, cps = f"sqlite:///{path}", tmp_path / "checkpoints"
    with open_ledger(url) as led:
        populate(led)
        checkpoint_ledger(led, cps, keys[0])
        victim = led.runs()[1].run_id
    led = rebuild_sqlite(url, path, cap=1.0, charge=(victim, 2.0))  # scale doubled: epsilon halved
    assert led.verify().ok and led.status("s").committed == pytest.approx(0.75)
    report = led.verify(checkpoints=load_checkpoints(cps, keys[1]))
    assert not report.ok and "rewritten" in report.problems[0]
    led.close()


def test_truncated_tail_and_forged_checkpoint_are_caught(tmp_path, keys, capsys):
    path = tmp_path / "l.sqlite"
    url, cps = f"sqlite:///{path}", tmp_path / "checkpoints"
    with open_ledger(url) as led:
        populate(led)
        cp = checkpoint_ledger(led, cps, keys[0])
    # the insider replays only the first two runs: a shorter, valid chain
    with open_ledger(url) as led:
        entries = led.history()
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(f"{path}{suffix}"):
            os.unlink(f"{path}{suffix}")
    with open_ledger(url) as led:
        replay_history(entries[:4], led, cap=1.0)
        assert led.verify().ok
    code, _, err = cli(capsys, "ledger", "--ledger", url, "verify", "--checkpoints", str(cps), "--public-key", keys[1])
    assert code == 7 and "only 4" in err
    # ... and cannot re-sign: editing the checkpoint breaks its signature
    doc = json.loads(cp.read_text())
    doc["entries"] = 4
    cp.write_text(json.dumps(doc))
    with pytest.raises(IntegrityError, match="signature does not match"):
        load_checkpoints(cps, keys[1])
    # a checkpoint signed by another key is refused too
    other = tmp_path / "other"
    other.mkdir()
    generate_signing_key(other / "k", other / "p")
    with pytest.raises(IntegrityError, match="not by the given public key"):
        load_checkpoints(cps, str(other / "p"))
    code, _, err = cli(capsys, "ledger", "--ledger", url, "verify", "--checkpoints", str(cps))
    assert code == 3 and "--public-key" in err


def test_d_legitimate_growth_after_checkpoints_passes(tmp_path, keys, capsys, monkeypatch):
    url, cps = f"sqlite:///{tmp_path}/l.sqlite", tmp_path / "checkpoints"
    monkeypatch.setenv(DIR_ENV, str(cps))
    monkeypatch.setenv(KEY_ENV, keys[0])
    with open_ledger(url) as led:
        populate(led, cap=3.0)  # three commits: three automatic checkpoints
        assert len(list(cps.glob("checkpoint-*.json"))) == 3
        first_head = led.verify().head_hash
        led.change_cap("s", epsilon=4.0, reason="raise", actor="op")
        full_run(led, key(5), lap(0.5))
        rec = led.reserve(key(6), "s", lap(0.5), actor="op")  # still open: fine
        report = led.verify(checkpoints=load_checkpoints(cps, keys[1]), expect_heads=[first_head, f"10:{first_head}"])
        assert report.ok, report.problems
        assert report.anchors["checkpoints"] == 4 and report.anchors["latest_entries"] == 14
    code, out, err = cli(capsys, "ledger", "--ledger", url, "verify", "--checkpoints", str(cps), "--public-key",
                         keys[1], "--expect-head", first_head)
    assert code == 0 and "extends 4 signed checkpoint(s)" in out, err
    code, out, err = cli(capsys, "ledger", "--ledger", url, "checkpoint", "--json")  # dir and key from env
    assert code == 0 and json.loads(out)["entries"] == 15
    code, _, err = cli(capsys, "ledger", "--ledger", url, "verify", "--expect-head", f"3:{first_head}")
    assert code == 7
    monkeypatch.setenv(PUBLIC_KEY_ENV, keys[1])  # a reviewer's environment: anchored without flags
    code, out, err = cli(capsys, "ledger", "--ledger", url, "verify")
    assert code == 0 and "extends 5 signed checkpoint(s)" in out, err
    assert rec.state == "reserved"


def test_a_failed_checkpoint_never_fails_the_commit(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "cps"))
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "missing.key"))
    with open_ledger(f"sqlite:///{tmp_path}/l.sqlite") as led:
        populate(led, charges=(0.3,))
        assert led.runs()[0].state == "committed"
    assert "could not write a ledger checkpoint" in caplog.text


# --- export verification ---------------------------------------------------------------------------------------------


def _export(tmp_path, capsys):
    url = f"sqlite:///{tmp_path}/l.sqlite"
    with open_ledger(url) as led:
        populate(led)
        led.change_cap("s", epsilon=2.0, delta=1e-7, reason="raise", actor="op")
        full_run(led, key(4), lap(0.3))
    out = tmp_path / "export.jsonl"
    assert cli(capsys, "ledger", "--ledger", url, "export", str(out))[0] == 0
    return out, out.read_text().splitlines()


def test_export_verifies_alone(tmp_path, capsys):
    path, lines = _export(tmp_path, capsys)
    report = verify_export(lines)
    assert report.ok and report.entries == len(lines) == 14
    assert report.totals["s"]["buckets"]["*"]["settled"] == pytest.approx(1.2)
    assert report.totals["s"]["cap"] == 2.0
    code, out, err = cli(capsys, "ledger", "verify", "--export", str(path))
    assert code == 0 and "export OK: 14 entries" in out and "settled *: 1.2" in out, err


@pytest.mark.parametrize("tamper, why", [
    ("drop", "missing or out of order"),
    ("epsilon", "hash does not recompute"),
    ("epsilon_rehash", "reserved over the cap"),
    ("reorder", "missing or out of order"),
])
def test_export_tampering_is_caught(tmp_path, capsys, tamper, why):
    path, lines = _export(tmp_path, capsys)
    docs = [json.loads(x) for x in lines]
    if tamper == "drop":
        del docs[4]
    elif tamper == "reorder":
        docs[4], docs[5] = docs[5], docs[4]
    else:
        created = docs[0]
        assert created["kind"] == "scope_created"
        created["data"]["definition"]["epsilon"] = 0.5  # a lower original cap
        if tamper == "epsilon_rehash":  # even with every hash recomputed, the state machine refuses it
            from dpops.events import canonical_json
            from dpops.ledger.schema import entry_hash

            prev = GENESIS_HASH
            for d in docs:
                body = {k: d[k] for k in ("id", "ts", "kind", "scope", "run_id", "buckets", "actor", "data")}
                d["prev_hash"], d["hash"] = prev, entry_hash(prev, canonical_json(body))
                prev = d["hash"]
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    report = verify_export(path.read_text().splitlines())
    assert not report.ok and why in report.problems[0], report.problems
    code, _, err = cli(capsys, "ledger", "verify", "--export", str(path))
    assert code == 7 and why in err


def test_export_tail_drop_needs_an_anchor(tmp_path, capsys, keys):
    path, lines = _export(tmp_path, capsys)
    head = json.loads(lines[-1])["hash"]
    path.write_text("\n".join(lines[:-1]) + "\n")
    assert verify_export(path.read_text().splitlines()).ok  # a prefix is a valid chain ...
    code, _, err = cli(capsys, "ledger", "verify", "--export", str(path), "--expect-head", head)
    assert code == 7 and "expected head" in err  # ... that no longer contains the recorded head
    assert cli(capsys, "ledger", "verify", "--export", str(path))[0] == 0
    path.write_text("SENTINEL-4242 private\n")
    code, out, err = cli(capsys, "ledger", "verify", "--export", str(path))
    assert code == 7 and "line 1 is not JSON" in err and "SENTINEL" not in out + err  # never echoes content


@pytest.mark.postgres
def test_deploy_roles_sql_then_init_app_role(postgres_url, capsys, tmp_path):
    """deploy/ledger-roles.sql + `dpops ledger init --app-role` give a working, restricted app role."""
    import shutil
    import subprocess

    if shutil.which("psql") is None:
        pytest.skip("psql not installed")
    tag = uuid.uuid4().hex[:8]
    db, owner, app = f"t_roles_{tag}", f"dpops_owner_{tag}", f"dpops_app_{tag}"
    base = postgres_url.rsplit("/", 1)[0]
    admin = psycopg.connect(postgres_url, autocommit=True)
    admin.execute(f'CREATE DATABASE "{db}"')
    sql = Path(__file__).resolve().parent.parent / "deploy" / "ledger-roles.sql"
    pw = tmp_path / "pw"
    pw.write_text("not-used-with-trust-auth\n")
    try:
        subprocess.run(["psql", f"{base}/{db}", "-q", "-v", f"owner_role={owner}", "-v", f"app_role={app}",
                        "-v", f"owner_password_file={pw}", "-v", f"app_password_file={pw}", "-f", str(sql)],
                       check=True, capture_output=True, timeout=60)
        install_cap_check(f"{base}/{db}?schema=dpops", owner)  # deploy/ledger-db-init.sh's second step
        for role in (owner, app):  # the passwords were read from the files
            assert admin.execute("SELECT rolpassword IS NOT NULL AND NOT rolsuper FROM pg_authid WHERE rolname = %s",
                                 (role,)).fetchone() == (True,)
        owner_url, app_url = f"{base.replace('postgres@', owner + '@')}/{db}?schema=dpops", \
            f"{base.replace('postgres@', app + '@')}/{db}?schema=dpops"
        code, out, err = cli(capsys, "ledger", "--ledger", owner_url, "init", "--app-role", app, "--print-sql")
        assert code == 0 and "GRANT SELECT, INSERT ON" in out, err
        code, _, err = cli(capsys, "ledger", "--ledger", app_url, "init", "--app-role", app)
        assert code != 0  # the app role cannot grant itself anything
        with open_ledger(owner_url) as led:
            led.create_scope(scope_def(), actor="owner")
        with open_ledger(app_url) as led:
            full_run(led, key(1), lap(0.3))
            assert led.verify().ok
            for stmt in ("TRUNCATE entries", "DELETE FROM entries", "DROP TRIGGER entries_no_truncate ON entries",
                         "CREATE TABLE dpops.x (a int)", "CREATE TABLE public.x (a int)"):
                with pytest.raises(psycopg.Error):
                    led.db.conn.execute(stmt)
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        for role in (app, owner):
            admin.execute(f'DROP ROLE IF EXISTS "{role}"')
        admin.close()


def test_forged_cache_lets_a_reservation_through_but_verify_names_it(tmp_path):
    """SQLite (no roles: whoever writes the file owns the ledger): forging the settled-runs cache admits an
    over-cap reservation, which verify's replay then refuses (detected, not prevented: docs/threat-model.md). On
    PostgreSQL the app role cannot write the run cache at all (tests/test_ledger_roles_property.py)."""
    with open_ledger(f"sqlite:///{tmp_path}/l.sqlite") as led:
        populate(led)
        with pytest.raises(ScopeBudgetExceeded):
            led.reserve(key(4), "s", lap(0.3), actor="op")
        led.db.execute("DELETE FROM run_charges WHERE scope = 's'")
        led.reserve(key(4), "s", lap(0.3), actor="op")  # admitted against the forged cache
        report = led.verify()
        assert not report.ok and report.first_bad_entry == 11 and "over the cap" in report.problems[0]


def test_report_provenance_shows_the_checkpoint_and_fails_a_rebuilt_chain(tmp_path, keys, capsys, monkeypatch):
    """The reviewer's report names the external anchor on its first screen and exits 7 once the chain no
    longer extends it (a ledger rebuilt with one run charged half)."""
    path = tmp_path / "l.sqlite"
    url, cps = f"sqlite:///{path}", tmp_path / "checkpoints"
    monkeypatch.setenv(DIR_ENV, str(cps))
    monkeypatch.setenv(PUBLIC_KEY_ENV, keys[1])
    with open_ledger(url) as led:
        populate(led)
        checkpoint_ledger(led, cps, keys[0])
        victim = led.runs()[1].run_id
    out = tmp_path / "report.html"
    code, _, _ = cli(capsys, "report", "--scope", "s", "--ledger", url, "--out", str(out))
    assert code == 0
    html = out.read_text()
    assert "1 signed checkpoint(s), latest at entry 10" in html and "the chain extends them" in html
    rebuild_sqlite(url, path, cap=1.0, charge=(victim, 2.0)).close()
    code, _, _ = cli(capsys, "report", "--scope", "s", "--ledger", url, "--out", str(out))
    assert code == 7
    assert "FAILED: checkpoint" in out.read_text()
    monkeypatch.delenv(DIR_ENV)
    code, _, _ = cli(capsys, "report", "--scope", "s", "--ledger", url, "--out", str(out))
    assert code == 0 and "none configured" in out.read_text()  # without the anchor the rebuild passes
