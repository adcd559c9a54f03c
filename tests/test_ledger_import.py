"""`dpops ledger import FILE`: moving a ledger between SQLite and PostgreSQL (docs/runbook.md).

The imported ledger must be the same ledger: the same entries (same chain, same head, so old anchors
still hold), the same derived tables, the same totals, and the same refusals for the next run. Anything
that is not a verified export into an empty ledger is refused and leaves the target as it was.
Each PostgreSQL test uses its own schema (dropped afterwards); under CI=true PostgreSQL is mandatory.
"""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
import pytest

from dpops.cli.main import main
from dpops.errors import IntegrityError, LedgerError
from dpops.events import Gaussian, Laplace
from dpops.ledger import RunKey, ScopeBudgetExceeded, ScopeDefinition, TimeRule, open_ledger
from dpops.ledger import transfer
from dpops.ledger.backend import set_test_hook
from dpops.ledger.checkpoint import DIR_ENV, PUBLIC_KEY_ENV, checkpoint_ledger, load_checkpoints
from dpops.ledger.schema import GENESIS_HASH
from dpops.ledger.verify import ExportReplay
from dpops.manifest.sign import generate_signing_key

from pg_roles_support import ledger_roles

DAY = "2024-03-{:02d}T00:00:00Z"
GAUSS = Gaussian(sigma=15.0, l2_sensitivity=1.0)  # rdp at delta 1e-6: two runs 0.405, three 0.501 (cap 0.45)
TABLES = {"entries": "id", "chain_head": "singleton", "scopes": "name", "runs": "run_id"}


# --- fixtures and helpers ---------------------------------------------------------------------------------------


@pytest.fixture
def pg_schemas(postgres_url):
    """A factory of isolated PostgreSQL ledger URLs (one schema each), all dropped afterwards."""
    made: list[str] = []

    def new() -> str:
        schema = f"t_import_{uuid.uuid4().hex[:12]}"
        made.append(schema)
        return f"{postgres_url}?schema={schema}"

    yield new
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        for schema in made:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def target_url(request, tmp_path):
    """An initialised, empty target ledger on each backend."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/target.sqlite"
    else:
        url = request.getfixturevalue("pg_schemas")()
    assert main(["ledger", "--ledger", url, "init"]) == 0
    return url


def scope(name, *, accountant="basic", epsilon=1.0, rho=None, delta=1e-6, **kw):
    return ScopeDefinition(name=name, unit=kw.pop("unit", "a user's events"), unit_column="user_id", epsilon=epsilon,
                           rho=rho, delta=delta, accountant=accountant, adjacency="add_remove", **kw)


def key(day, release="daily_counts", fp="fp", end_day=None):
    return RunKey(release, "spechash", DAY.format(day), DAY.format(end_day or day + 1), fp, "key1")


def lap(eps):
    return [Laplace(scale=1.0 / eps, l1_sensitivity=1.0)]


def committed(led, k, scope_name, events, restates=None):
    rec = led.reserve(k, scope_name, events, actor="op", restates=restates)
    led.start(rec.run_id, actor="op")
    return led.commit(rec.run_id, output_uri=f"file:///out/{rec.run_id}", actor="op", details={"rows": 3})


def build_history(led) -> dict[str, str]:
    """Several scopes (plain, per-day buckets, a rho cap), runs in every state, a restatement, cap changes.

    Returns the ids of the runs left open (to finish them on the imported ledger)."""
    led.create_scope(scope("web", epsilon=1.0), actor="admin")
    led.create_scope(scope("daily", accountant="rdp", epsilon=0.45, bucket="day", unit_period="day",
                           unit="a user-day", time_rule=TimeRule("ts")), actor="admin")
    led.create_scope(scope("z", accountant="zcdp", epsilon=None, rho=0.1), actor="admin")
    first = committed(led, key(1), "web", lap(0.2))
    committed(led, key(1, fp="v2"), "web", lap(0.1), restates=first.run_id)  # a restatement
    released = led.reserve(key(2), "web", lap(0.3), actor="op")
    led.release(released.run_id, reason="input late", actor="op")
    spent = led.reserve(key(3), "web", lap(0.1), actor="op")
    led.start(spent.run_id, actor="op")
    led.mark_spent_unpublished(spent.run_id, reason="publish failed after noise", actor="op")
    led.change_cap("web", epsilon=0.9, delta=1e-7, reason="policy review", actor="admin")  # lower, and delta
    started = led.reserve(key(4), "web", lap(0.1), actor="op")
    led.start(started.run_id, actor="op")
    reserved = led.reserve(key(5), "web", lap(0.2), actor="op")
    # web: 0.2 + 0.1 + 0.1 settled, 0.1 started, 0.2 reserved = 0.7 of 0.9
    for d in range(1, 6):  # a backfill over day buckets, nearly filling 2024-03-02
        committed(led, key(d, release="daily"), "daily", [GAUSS])
    span = RunKey("spans", "h", "2024-03-02T12:00:00Z", "2024-03-03T12:00:00Z", "fp", "k")
    committed(led, span, "daily", [GAUSS])
    for d in range(1, 4):
        committed(led, key(d, release="z"), "z", [Gaussian(sigma=5.0, l2_sensitivity=1.0)])
    led.change_cap("z", rho=0.08, delta=1e-7, reason="tighter", actor="admin")  # per-run ε was at 1e-6
    return {"started": started.run_id, "reserved": reserved.run_id}


def export_text(led) -> str:
    buf = io.StringIO()
    led.export(buf)
    return buf.getvalue()


def tables(led) -> dict[str, list[tuple]]:
    return {t: [tuple(r) for r in led.db.all(f"SELECT * FROM {t} ORDER BY {order}")] for t, order in TABLES.items()}


def statuses(led) -> dict[str, dict]:
    return {s.name: led.status(s.name).to_dict() for s in led.scopes()}


def cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_empty(url):
    with open_ledger(url) as led:
        for t in ("entries", "scopes", "runs"):
            assert led.db.one(f"SELECT COUNT(*) FROM {t}")[0] == 0, t
        assert tuple(led.db.one("SELECT last_id, last_hash FROM chain_head")) == (0, GENESIS_HASH)
        report = led.verify()
        assert report.ok and report.entries == 0


@pytest.fixture
def source(tmp_path):
    """A SQLite ledger with a non-trivial history, its export file and head."""
    url = f"sqlite:///{tmp_path}/source.sqlite"
    with open_ledger(url) as led:
        open_runs = build_history(led)
        text = export_text(led)
    path = tmp_path / "export.jsonl"
    path.write_text(text)
    last = json.loads(text.splitlines()[-1])
    return {"url": url, "path": path, "text": text, "head": f"{last['id']}:{last['hash']}", "open": open_runs,
            "lines": text.splitlines()}


# --- the round trip --------------------------------------------------------------------------------------------


@pytest.mark.postgres
def test_round_trip_sqlite_postgres_sqlite_is_the_same_ledger(source, pg_schemas, tmp_path, capsys):
    pg = pg_schemas()
    back = f"sqlite:///{tmp_path}/back.sqlite"
    assert cli(capsys, "ledger", "--ledger", pg, "init")[0] == 0
    code, out, err = cli(capsys, "ledger", "import", str(source["path"]), "--ledger", pg,
                         "--expect-head", source["head"], "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["ok"] is True and doc["exit_code"] == 0 and doc["head"] == source["head"]
    assert doc["entries"] == len(source["lines"]) and doc["scopes"] == ["daily", "web", "z"] and doc["runs"] == 15
    assert doc["runs_by_state"] == {"committed": 11, "released": 1, "reserved": 1, "spent_unpublished": 1,
                                    "started": 1}
    assert doc["verify"]["ok"] is True and f"{source['head']}" in doc["anchors"]["expect_head"]

    pg_export = tmp_path / "from-pg.jsonl"
    assert cli(capsys, "ledger", "--ledger", pg, "export", str(pg_export))[0] == 0
    assert pg_export.read_bytes() == source["path"].read_bytes()  # identical bytes after SQLite -> PostgreSQL

    assert cli(capsys, "ledger", "--ledger", back, "init")[0] == 0
    code, out, err = cli(capsys, "--ledger", back, "ledger", "import", str(pg_export), "--expect-head", source["head"])
    assert code == 0, err
    assert f"imported {len(source['lines'])} entries" in out and "3 scope(s), 15 run(s)" in out
    assert f"ledger OK: head {source['head']}" in out
    back_export = tmp_path / "back.jsonl"
    assert cli(capsys, "ledger", "--ledger", back, "export", str(back_export))[0] == 0
    assert back_export.read_bytes() == source["path"].read_bytes()  # ... and PostgreSQL -> SQLite

    with open_ledger(source["url"]) as src, open_ledger(pg) as p, open_ledger(back) as b:
        want_tables, want_status = tables(src), statuses(src)
        for led in (p, b):
            assert tables(led) == want_tables  # every cache row, byte for byte (running states, epsilons)
            assert statuses(led) == want_status
            assert led.verify(expect_heads=[source["head"]]).ok
    by_cli = [[json.loads(cli(capsys, "ledger", "--ledger", url, "status", s, "--json")[1]) for s in ("web", "daily")]
              for url in (source["url"], pg, back)]  # `ledger status` through the CLI, too
    assert by_cli[0] == by_cli[1] == by_cli[2] and by_cli[0][0]["total"] == pytest.approx(0.7)


def test_imported_ledger_behaves_as_the_source(source, target_url, capsys):
    assert cli(capsys, "ledger", "--ledger", target_url, "import", str(source["path"]))[0] == 0
    with open_ledger(source["url"]) as src, open_ledger(target_url) as led:
        assert statuses(led) == statuses(src)
        web = led.status("web")
        assert web.total == pytest.approx(0.7) and web.remaining == pytest.approx(0.2)
        # the imported spends count: 0.3 does not fit in what is left of 0.9, on either ledger
        for ledger in (src, led):
            with pytest.raises(ScopeBudgetExceeded) as exc:
                ledger.reserve(key(6), "web", lap(0.3), actor="op")
            assert exc.value.spent == pytest.approx(0.4) and exc.value.reserved == pytest.approx(0.3)
        # per-day buckets too: 2024-03-02 holds two runs, a third refuses there but fits on a fresh day
        with pytest.raises(ScopeBudgetExceeded) as exc:
            led.reserve(key(2, release="again"), "daily", [GAUSS], actor="op")
        assert exc.value.bucket == "2024-03-02"
        committed(led, key(9, release="again"), "daily", [GAUSS])
        with pytest.raises(LedgerError, match="already published"):  # published intervals are known
            led.reserve(key(1, fp="v3"), "web", lap(0.01), actor="op")
        # the open runs carried over: the started one is finished, the reserved one refunded
        led.commit(source["open"]["started"], output_uri="file:///late", actor="op")
        led.release(source["open"]["reserved"], reason="not needed", actor="op")
        committed(led, key(7), "web", lap(0.15))
        n = len(source["lines"])
        new = [e for e in led.history() if e.id > n]
        assert new[0].prev_hash == source["head"].split(":")[1]  # new entries chain onto the imported head
        report = led.verify(expect_heads=[source["head"]])
        assert report.ok and report.entries == n + len(new)
        assert led.status("web").total == pytest.approx(0.65)


def test_subprocess_console_script_json(source, tmp_path):
    """The real console entry point, in its own process."""
    url = f"sqlite:///{tmp_path}/sub.sqlite"
    env = {**os.environ, "DPOPS_LEDGER_URL": url}
    exe = [sys.executable, "-m", "dpops.cli.main"]
    assert subprocess.run([*exe, "ledger", "init"], env=env, capture_output=True).returncode == 0
    proc = subprocess.run([*exe, "ledger", "import", str(source["path"]), "--json"], env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] and doc["head"] == source["head"] and doc["entries"] == len(source["lines"])
    proc = subprocess.run([*exe, "ledger", "import", str(source["path"]), "--json"], env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 6 and json.loads(proc.stdout)["exit_code"] == 6


# --- refusals: nothing written ---------------------------------------------------------------------------------


def test_refuses_a_target_that_is_not_empty(source, target_url, capsys):
    with open_ledger(target_url) as led:
        led.create_scope(scope("other"), actor="admin")
        before = tables(led)
    code, out, err = cli(capsys, "ledger", "--ledger", target_url, "import", str(source["path"]), "--json")
    doc = json.loads(out)
    assert code == 6 and doc["ok"] is False and doc["exit_code"] == 6
    assert "is not empty" in doc["error"] and "1 entries" in doc["error"] and "(other)" in doc["error"]
    assert "never merges" in doc["error"] and "nothing was imported" in doc["error"]
    with open_ledger(target_url) as led:
        assert tables(led) == before and led.verify().ok
    # a second import of the same export into an imported ledger is refused just the same
    fresh = target_url.replace("target.sqlite", "fresh.sqlite") if target_url.startswith("sqlite") else None
    if fresh:
        assert cli(capsys, "ledger", "--ledger", fresh, "init")[0] == 0
        assert cli(capsys, "ledger", "--ledger", fresh, "import", str(source["path"]))[0] == 0
        code, _, err = cli(capsys, "ledger", "--ledger", fresh, "import", str(source["path"]))
        assert code == 6 and f"{len(source['lines'])} entries" in err and "daily, web, z" in err


def _tamper(lines: list[str], how: str) -> tuple[list[str], str]:
    docs = [json.loads(x) for x in lines]
    if how == "byte":  # one byte of one body: 'op' -> 'oq' in entry 6's actor
        assert docs[5]["actor"] == "op"
        out = list(lines)
        out[5] = lines[5].replace('"actor":"op"', '"actor":"oq"')
        assert sum(a != b for a, b in zip(out[5], lines[5])) == 1
        return out, "at entry 6 (line 6): entry 6: hash does not recompute"
    if how == "drop":
        return lines[:6] + lines[7:], "at entry 7 (line 7): entry 7: entry 7 is missing or out of order"
    return lines[:2] + ["{not json"] + lines[3:], "line 3 is not JSON"


@pytest.mark.parametrize("how", ["byte", "drop", "not_json"])
def test_refuses_a_tampered_export_naming_the_entry(source, target_url, tmp_path, capsys, how):
    lines, why = _tamper(source["lines"], how)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    code, out, err = cli(capsys, "ledger", "--ledger", target_url, "import", str(bad))
    assert code == 7 and why in err, err
    assert "nothing was imported" in err or how == "not_json"
    assert_empty(target_url)


def test_refuses_a_wrong_or_missing_expected_head(source, target_url, tmp_path, capsys):
    n, digest = source["head"].split(":")
    for head, why in ((f"{n}:{'0' * 64}", f"expected head {'0' * 64} at entry {n}"),
                      (f"{int(n) + 1}:{digest}", f"the chain has only {n} entries")):
        code, out, err = cli(capsys, "ledger", "--ledger", target_url, "import", str(source["path"]),
                             "--expect-head", head, "--json")
        doc = json.loads(out)
        assert code == 7 and doc["exit_code"] == 7 and why in doc["error"] and "nothing was imported" in doc["error"]
    # a dropped last line is a valid shorter chain: only the head written down catches it
    short = tmp_path / "short.jsonl"
    short.write_text("\n".join(source["lines"][:-1]) + "\n")
    code, _, err = cli(capsys, "ledger", "--ledger", target_url, "import", str(short), "--expect-head", source["head"])
    assert code == 7 and "only" in err
    assert_empty(target_url)


def test_refuses_an_empty_export_and_a_missing_sqlite_target(source, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    url = f"sqlite:///{tmp_path}/t.sqlite"
    assert cli(capsys, "ledger", "--ledger", url, "init")[0] == 0
    code, _, err = cli(capsys, "ledger", "--ledger", url, "import", str(empty))
    assert code == 3 and "holds no entries" in err
    missing = tmp_path / "missing.sqlite"
    code, _, err = cli(capsys, "ledger", "import", str(source["path"]), "--ledger", f"sqlite:///{missing}")
    assert code == 6 and f"no ledger database at {missing}" in err and not missing.exists()


# --- one transaction -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("point", ["import:entries", "import:caches", "import:before_commit"])
def test_a_failure_mid_import_rolls_back_to_the_empty_ledger(source, target_url, capsys, point):
    def boom(at):
        if at == point:
            raise RuntimeError(f"injected failure at {at}")

    set_test_hook(boom)
    try:
        with open_ledger(target_url) as led, pytest.raises(RuntimeError, match="injected"):
            transfer.import_export(led, transfer.read_export(source["lines"], "export"))
    finally:
        set_test_hook(None)
    assert_empty(target_url)
    # nothing half-done is left behind: the same import then succeeds (the chain head was rolled back too)
    assert cli(capsys, "ledger", "--ledger", target_url, "import", str(source["path"]))[0] == 0


def _import_and_hang(url, lines, point, ready):
    def hang(at):
        if at == point:
            ready.set()
            time.sleep(600)

    set_test_hook(hang)
    with open_ledger(url) as led:
        transfer.import_export(led, transfer.read_export(lines, "export"))


@pytest.mark.parametrize("point", ["import:entries", "import:before_commit"])
def test_sigkill_mid_import_leaves_the_ledger_empty(source, target_url, capsys, point):
    """kill -9 of the importing process, with every row written (and verified) but not committed."""
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    proc = ctx.Process(target=_import_and_hang, args=(target_url, source["lines"], point, ready))
    proc.start()
    assert ready.wait(60), "the import never reached the hook"
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    assert_empty(target_url)
    assert cli(capsys, "ledger", "--ledger", target_url, "import", str(source["path"]))[0] == 0


def test_a_database_error_or_a_failed_verification_rolls_back(source, target_url, monkeypatch):
    real = ExportReplay.cache_rows

    def scopeless_run(self):  # a run row the database refuses (NOT NULL): the whole import rolls back
        rows = real(self)
        return type(rows)(scopes=rows.scopes, runs=rows.runs + [("zz" * 16, None, *rows.runs[0][2:])])

    monkeypatch.setattr(ExportReplay, "cache_rows", scopeless_run)
    with open_ledger(target_url) as led, pytest.raises(LedgerError, match="conflicting"):
        transfer.import_export(led, transfer.read_export(source["lines"], "export"))
    assert_empty(target_url)

    def drop_a_charge(self):  # caches that disagree with the entries: verify refuses them before the commit
        rows = real(self)
        bad = [(*r[:7], "[]", *r[8:]) if r[1] == "web" else r for r in rows.runs]  # events of web's runs dropped
        return type(rows)(scopes=rows.scopes, runs=bad)

    monkeypatch.setattr(ExportReplay, "cache_rows", drop_a_charge)
    with open_ledger(target_url) as led, pytest.raises(IntegrityError, match="does not verify before commit"):
        transfer.import_export(led, transfer.read_export(source["lines"], "export"))
    assert_empty(target_url)


# --- anchors and roles -----------------------------------------------------------------------------------------


def test_checkpoints_of_the_old_ledger_hold_on_the_imported_one(source, target_url, tmp_path, capsys, monkeypatch):
    priv, pub = tmp_path / "cp.key", tmp_path / "cp.pub"
    generate_signing_key(priv, pub)
    cps, later = tmp_path / "cps", tmp_path / "later"
    with open_ledger(source["url"]) as led:
        checkpoint_ledger(led, cps, priv)
        committed(led, key(9), "web", lap(0.01))  # the old ledger grew after the export was taken ...
        checkpoint_ledger(led, later, priv)
    # ... so the export is a truncated copy of what was signed: refused (from the reviewer's environment)
    monkeypatch.setenv(DIR_ENV, str(later))
    monkeypatch.setenv(PUBLIC_KEY_ENV, str(pub))
    code, _, err = cli(capsys, "ledger", "--ledger", target_url, "import", str(source["path"]))
    assert code == 7 and "entries were removed after the checkpoint" in err and "nothing was imported" in err
    assert_empty(target_url)
    monkeypatch.delenv(DIR_ENV)
    monkeypatch.delenv(PUBLIC_KEY_ENV)
    code, out, err = cli(capsys, "ledger", "--ledger", target_url, "import", str(source["path"]),
                         "--checkpoints", str(cps), "--public-key", str(pub))
    assert code == 0 and "extends 1 signed checkpoint(s) of the old ledger" in out, err
    with open_ledger(target_url) as led:
        committed(led, key(8), "web", lap(0.05))  # legitimate growth after the move
        assert led.verify(checkpoints=load_checkpoints(cps, pub)).ok
    code, out, _ = cli(capsys, "ledger", "--ledger", target_url, "verify", "--checkpoints", str(cps),
                       "--public-key", str(pub))
    assert code == 0 and "extends 1 signed checkpoint(s)" in out


@pytest.mark.postgres
def test_postgres_app_role_is_refused_and_told_to_use_the_owner(source, postgres_url, capsys):
    with ledger_roles(postgres_url, "t_import_roles") as (owner_url, app_url, owner, app, _admin, _schema):
        assert cli(capsys, "ledger", "--ledger", owner_url, "init", "--app-role", app)[0] == 0
        code, out, err = cli(capsys, "ledger", "--ledger", app_url, "import", str(source["path"]), "--json")
        doc = json.loads(out)
        assert code == 3 and doc["exit_code"] == 3  # PermissionRefused: not retryable (was 6 before issue 19-10)
        assert f"connected as '{app}'" in doc["error"] and f"connect as '{owner}'" in doc["error"]
        assert "owner role" in doc["error"] and "nothing was imported" in doc["error"]
        assert_empty(owner_url)
        code, out, err = cli(capsys, "ledger", "--ledger", owner_url, "import", str(source["path"]))
        assert code == 0 and f"head {source['head']}" in out, err
        with open_ledger(app_url) as led:  # the application role keeps its rights on the imported tables
            committed(led, key(8), "web", lap(0.05))
            assert led.verify(expect_heads=[source["head"]]).ok
            with pytest.raises(psycopg.Error):
                led.db.conn.execute("DELETE FROM entries WHERE id = 1")


@pytest.mark.postgres
def test_import_waits_for_a_writer_and_then_refuses_its_ledger(source, pg_schemas, capsys):
    """A writer mid-transaction when the import starts: the import waits for its lock, sees its entry, refuses."""
    import threading

    url = pg_schemas()
    assert cli(capsys, "ledger", "--ledger", url, "init")[0] == 0
    writer = open_ledger(url)
    started = threading.Event()

    def slow(at):
        if at == "reserve:locked":
            started.set()
            time.sleep(1.0)

    writer.create_scope(scope("w"), actor="admin")
    # the writer's scope makes the ledger non-empty anyway; what matters is that the import does not
    # interleave with the writer (no deadlock, no half-merged tables)
    set_test_hook(slow)
    try:
        t = threading.Thread(target=lambda: writer.reserve(key(1), "w", lap(0.1), actor="op"))
        t.start()
        assert started.wait(10)
        with open_ledger(url) as led, pytest.raises(LedgerError, match="is not empty: it holds 2 entries"):
            transfer.import_export(led, transfer.read_export(source["lines"], "export"))
        t.join()
    finally:
        set_test_hook(None)
        writer.close()
    with open_ledger(url) as led:
        assert led.verify().ok and len(led.history()) == 2


def test_ledger_option_in_every_position(source, tmp_path, capsys, monkeypatch):
    for where in ("root", "group", "command", "env"):
        url = f"sqlite:///{tmp_path}/{where}.sqlite"
        assert cli(capsys, "ledger", "init", "--ledger", url)[0] == 0
        argv = {"root": ["--ledger", url, "ledger", "import", str(source["path"])],
                "group": ["ledger", "--ledger", url, "import", str(source["path"])],
                "command": ["ledger", "import", str(source["path"]), "--ledger", url],
                "env": ["ledger", "import", str(source["path"])]}[where]
        if where == "env":
            monkeypatch.setenv("DPOPS_LEDGER_URL", url)
        code, out, err = cli(capsys, *argv)
        assert code == 0 and f"head {source['head']}" in out, (where, err)
        assert Path(url[len("sqlite:///"):]).exists()
