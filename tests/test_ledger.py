"""The budget ledger, on SQLite and on PostgreSQL (every test runs on both backends).

Each PostgreSQL test gets its own schema (dropped afterwards), so tests are isolated and re-runnable.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import signal
import time
import uuid

import psycopg
import pytest

from dpops.accounting import get_accountant
from dpops.errors import BudgetExceeded, InvalidParameter, LedgerError, SpecError
from dpops.events import Gaussian, Laplace
from dpops.ledger import RunKey, ScopeBudgetExceeded, ScopeDefinition, TimeRule, bucket_labels, open_ledger
from dpops.ledger.backend import set_test_hook
from dpops.ledger.schema import SCHEMA_VERSION

DAY = "2024-03-{:02d}T00:00:00Z"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def ledger_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/ledger.sqlite"
        return
    base = request.getfixturevalue("postgres_url")
    schema = f"t_ledger_{uuid.uuid4().hex[:12]}"
    yield f"{base}?schema={schema}"
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture
def ledger(ledger_url):
    led = open_ledger(ledger_url)
    yield led
    led.close()


def scope_def(name="s", epsilon=1.0, accountant="basic", **kw):
    kw.setdefault("delta", 1e-6)
    kw.setdefault("unit", "a user's events")
    return ScopeDefinition(name=name, unit_column="user_id", epsilon=epsilon,
                           rho=kw.pop("rho", None), accountant=accountant, **kw)


def key(day=1, fp="fp", release="daily_counts", end_day=None):
    return RunKey(release, "spechash", DAY.format(day), DAY.format(end_day or day + 1), fp, "key1")


def lap(eps):  # a Laplace release of sensitivity 1 costing exactly eps under pure DP
    return [Laplace(scale=1.0 / eps, l1_sensitivity=1.0)]


def n_entries(led) -> int:
    return led.db.one("SELECT COUNT(*) FROM entries")[0]


def full_run(led, k, scope, events, uri="file:///out"):
    rec = led.reserve(k, scope, events, actor="test")
    led.start(rec.run_id, actor="test")
    return led.commit(rec.run_id, output_uri=uri, actor="test")


# --- scopes ---------------------------------------------------------------------------------------------


def test_scope_create_is_idempotent_pins_accountant_and_refuses_conflicts(ledger):
    s = ledger.create_scope(scope_def(accountant="rdp"), actor="alice")
    assert s.accountant == "rdp/1"
    assert ledger.create_scope(scope_def(accountant="rdp"), actor="bob") == s
    assert n_entries(ledger) == 1
    with pytest.raises(LedgerError, match="different definition"):
        ledger.create_scope(scope_def(accountant="rdp", epsilon=2.0), actor="alice")
    assert ledger.scope("s") == s and ledger.scopes() == [s]
    with pytest.raises(SpecError, match="unknown budget scope 'nope'"):
        ledger.scope("nope")


def test_scope_definition_refuses_bad_configs(ledger):
    with pytest.raises(SpecError, match="unit_period='day'"):
        scope_def(bucket="day")
    with pytest.raises(SpecError, match="exactly one cap"):
        scope_def(rho=0.5)
    with pytest.raises(InvalidParameter, match="1/n"):
        ledger.create_scope(scope_def(delta=1e-3, population=1000), actor="a")
    with pytest.raises(InvalidParameter, match="epsilon"):
        ledger.create_scope(scope_def(epsilon=float("nan")), actor="a")
    with pytest.raises(InvalidParameter, match="unknown accountant"):
        ledger.create_scope(scope_def(accountant="magic"), actor="a")
    with pytest.raises(SpecError, match="zcdp"):  # a rho cap needs an accountant with a rho form
        ledger.create_scope(scope_def(epsilon=None, rho=0.5, accountant="rdp"), actor="a")
    assert n_entries(ledger) == 0


def test_change_cap_is_recorded_and_applies(ledger):
    ledger.create_scope(scope_def(epsilon=0.3), actor="a")
    full_run(ledger, key(1), "s", lap(0.3))
    with pytest.raises(BudgetExceeded):
        ledger.reserve(key(2), "s", lap(0.1), actor="a")
    new = ledger.change_cap("s", epsilon=0.5, reason="annual review", actor="dpo")
    assert new.epsilon == 0.5
    ledger.reserve(key(2), "s", lap(0.1), actor="a")
    kinds = [e.kind for e in ledger.history("s")]
    assert kinds == ["scope_created", "reserved", "started", "committed", "cap_changed", "reserved"]
    assert ledger.verify().ok


def test_rho_capped_scope(ledger):
    ledger.create_scope(scope_def(epsilon=None, rho=0.1, accountant="zcdp"), actor="a")
    g = [Gaussian(sigma=5.0, l2_sensitivity=1.0)]  # rho = 1/50 = 0.02 each: 5 fit
    ok = 0
    for d in range(1, 8):
        try:
            ledger.reserve(key(d), "s", g, actor="a")
            ok += 1
        except BudgetExceeded:
            pass
    assert ok == 5
    st = ledger.status("s")
    assert st.unit == "rho" and st.total == pytest.approx(0.1)


# --- run life cycle ---------------------------------------------------------------------------------------


def test_lifecycle_and_state_machine(ledger):
    ledger.create_scope(scope_def(), actor="a")
    rec = ledger.reserve(key(1), "s", lap(0.2), actor="a", details={"dag": "d1"})
    assert rec.state == "reserved" and rec.epsilon == pytest.approx(0.2) and rec.buckets == ["*"]
    with pytest.raises(LedgerError, match="not started"):
        ledger.commit(rec.run_id, output_uri="x", actor="a")
    started = ledger.start(rec.run_id, actor="a")
    with pytest.raises(LedgerError, match="never be refunded"):
        ledger.release(rec.run_id, reason="oops", actor="a")
    done = ledger.commit(rec.run_id, output_uri="file:///o", actor="a")
    assert started.state == "started" and done.state == "committed" and done.output_uri == "file:///o"
    assert len(done.entry_ids) == 3 and len(done.entry_hashes) == 3
    with pytest.raises(LedgerError, match="never be changed"):
        ledger.mark_spent_unpublished(rec.run_id, reason="x", actor="a")
    # release refunds; spent_unpublished keeps the charge
    r2 = ledger.reserve(key(2), "s", lap(0.3), actor="a")
    ledger.release(r2.run_id, reason="input missing", actor="a")
    r3 = ledger.reserve(key(3), "s", lap(0.4), actor="a")
    ledger.start(r3.run_id, actor="a")
    ledger.mark_spent_unpublished(r3.run_id, reason="publish failed", actor="a")
    st = ledger.status("s")
    assert st.committed == pytest.approx(0.2) and st.spent_unpublished == pytest.approx(0.4)
    assert st.total == pytest.approx(0.6) and st.remaining == pytest.approx(0.4) and st.reserved == 0
    assert ledger.verify().ok
    with pytest.raises(LedgerError, match="unknown run"):
        ledger.start("deadbeef", actor="a")


def test_retries_charge_once(ledger):
    ledger.create_scope(scope_def(), actor="a")
    recs = [ledger.reserve(key(1), "s", lap(0.25), actor="a") for _ in range(5)]
    assert len({r.run_id for r in recs}) == 1
    for _ in range(3):
        ledger.start(recs[0].run_id, actor="a")
    for _ in range(3):
        done = ledger.commit(recs[0].run_id, output_uri="file:///o", actor="a")
    assert ledger.reserve(key(1), "s", lap(0.25), actor="a").state == "committed"  # whatever its state
    assert n_entries(ledger) == 4  # scope + reserved + started + committed
    assert ledger.status("s").total == pytest.approx(0.25)
    with pytest.raises(LedgerError, match="already committed"):
        ledger.commit(done.run_id, output_uri="file:///other", actor="a")
    with pytest.raises(LedgerError, match="other events"):
        ledger.reserve(key(1), "s", lap(0.5), actor="a")
    assert ledger.verify().ok


def test_published_and_restatement(ledger):
    ledger.create_scope(scope_def(), actor="a")
    first = full_run(ledger, key(1, fp="v1"), "s", lap(0.1))
    # Retry keyed with '+00:00' spelling is the same run and interval.
    same = RunKey("daily_counts", "spechash", "2024-03-01T00:00:00+00:00", "2024-03-02T00:00:00+00:00", "v1", "key1")
    assert same.run_id == first.run_id
    assert ledger.published("daily_counts", "2024-03-01T00:00:00+00:00", DAY.format(2)).run_id == first.run_id
    with pytest.raises(LedgerError, match="already published"):  # a silent restatement
        ledger.reserve(key(1, fp="v2"), "s", lap(0.1), actor="a")
    with pytest.raises(LedgerError, match="restates"):
        ledger.reserve(key(1, fp="v2"), "s", lap(0.1), actor="a", restates="nonexistent")
    second = ledger.reserve(key(1, fp="v2"), "s", lap(0.1), actor="a", restates=first.run_id)
    assert ledger.published("daily_counts", DAY.format(1), DAY.format(2)).run_id == first.run_id
    ledger.start(second.run_id, actor="a")
    ledger.commit(second.run_id, output_uri="file:///v2", actor="a")
    pub = ledger.published("daily_counts", DAY.format(1), DAY.format(2))
    assert pub.run_id == second.run_id and pub.restates == first.run_id
    assert ledger.status("s").committed == pytest.approx(0.2)  # a restatement is a fresh charge
    assert ledger.published("daily_counts", DAY.format(2), DAY.format(3)) is None
    assert [r.run_id for r in ledger.runs(release="daily_counts", states=["committed"])] == [first.run_id, second.run_id]
    assert ledger.verify().ok


def test_recover_releases_reserved_and_spends_started(ledger):
    ledger.create_scope(scope_def(), actor="a")
    r1 = ledger.reserve(key(1), "s", lap(0.1), actor="a")
    r2 = ledger.reserve(key(2), "s", lap(0.2), actor="a")
    ledger.start(r2.run_id, actor="a")
    assert ledger.recover(older_than_seconds=3600, actor="ops") == []
    time.sleep(0.05)
    out = {r.run_id: r for r in ledger.recover(older_than_seconds=0.01, actor="ops")}
    assert out[r1.run_id].state == "released" and out[r2.run_id].state == "spent_unpublished"
    st = ledger.status("s")
    assert st.total == pytest.approx(0.2) and st.spent_unpublished == pytest.approx(0.2)
    reasons = [e.data["reason"] for e in ledger.history("s") if e.kind in ("released", "spent_unpublished")]
    assert any("abandoned before any mechanism ran" in r for r in reasons)
    assert ledger.verify().ok


def test_plan_writes_nothing(ledger):
    ledger.create_scope(scope_def(epsilon=1.0), actor="a")
    full_run(ledger, key(1), "s", lap(0.5))
    before = n_entries(ledger)
    plan = ledger.plan("s", [(DAY.format(d), DAY.format(d + 1), lap(0.2)) for d in range(2, 6)])
    assert [i.fits for i in plan.items] == [True, True, False, False]
    assert plan.items[1].remaining_after == pytest.approx(0.1) and plan.admitted == 2 and not plan.fits_all
    assert n_entries(ledger) == before
    json.dumps(plan.to_dict())


# --- buckets -----------------------------------------------------------------------------------------------


def test_bucket_labels():
    assert bucket_labels(None, DAY.format(1), DAY.format(9)) == ["*"]
    assert bucket_labels("day", DAY.format(1), DAY.format(2)) == ["2024-03-01"]
    assert bucket_labels("day", "2024-03-01T12:00:00Z", "2024-03-02T12:00:00Z") == ["2024-03-01", "2024-03-02"]
    assert bucket_labels("week", "2024-03-03T00:00:00Z", "2024-03-05T00:00:00Z") == ["2024-W09", "2024-W10"]
    assert bucket_labels("month", "2024-01-31T00:00:00+02:00", "2024-02-02T00:00:00Z") == ["2024-01", "2024-02"]


def test_bucketed_backfill_charges_each_day_once(ledger):
    ledger.create_scope(scope_def(epsilon=0.5, bucket="day", unit_period="day", unit="a user-day",
                                  time_rule=TimeRule("ts")), actor="a")
    for d in range(1, 31):  # a 30-day backfill: 0.3 into each day's bucket, far more than 0.5 in total
        full_run(ledger, key(d), "s", lap(0.3))
    with pytest.raises(ScopeBudgetExceeded) as exc:
        ledger.reserve(key(5, release="other"), "s", lap(0.3), actor="a")
    assert exc.value.bucket == "2024-03-05" and exc.value.spent == pytest.approx(0.3)
    span = RunKey("other", "h", "2024-03-10T12:00:00Z", "2024-03-11T12:00:00Z", "fp", "k")
    rec = ledger.reserve(span, "s", lap(0.2), actor="a")
    assert rec.buckets == ["2024-03-10", "2024-03-11"]
    st = ledger.status("s")
    totals = {b.bucket: b.total for b in st.buckets}
    assert len(totals) == 30
    for b, t in totals.items():
        assert t == pytest.approx(0.5 if b in ("2024-03-10", "2024-03-11") else 0.3), b
    assert st.total == pytest.approx(0.5)
    assert ledger.verify().ok


# --- composition -------------------------------------------------------------------------------------------


def _fill(led, name, accountant, events):
    led.create_scope(scope_def(name=name, accountant=accountant, epsilon=1.0, delta=1e-6), actor="a")
    n = 0
    while True:
        try:
            led.reserve(key(n + 1, release=name), name, events, actor="a")
        except BudgetExceeded:
            return n
        n += 1


def test_rdp_and_pld_admit_more_gaussian_releases_than_basic(ledger):
    g = [Gaussian(sigma=20.0, l2_sensitivity=1.0)]
    counts = {name: _fill(ledger, name, name, g) for name in ("basic", "rdp", "pld")}
    assert counts["rdp"] > counts["basic"] and counts["pld"] > counts["basic"], counts
    for name, n in counts.items():
        acct = get_accountant(name)
        st = ledger.status(name)
        assert st.total == pytest.approx(acct.epsilon(g * n, 1e-6), rel=1e-9)
        assert st.total <= 1.0 < acct.epsilon(g * (n + 1), 1e-6)
    assert ledger.verify().ok


# --- bad input -----------------------------------------------------------------------------------------------


def test_bad_input_clear_errors_nothing_written(ledger):
    ledger.create_scope(scope_def(accountant="rdp"), actor="a")
    before = n_entries(ledger)
    with pytest.raises(SpecError, match="unknown budget scope 'nope'"):
        ledger.reserve(key(1), "nope", lap(0.1), actor="a")
    with pytest.raises(InvalidParameter, match="events\\[0\\]"):
        ledger.reserve(key(1), "s", [{"kind": "laplace", "scale": -1.0, "l1_sensitivity": 1.0}], actor="a")
    with pytest.raises(InvalidParameter):
        ledger.reserve(key(1), "s", [{"kind": "pure_dp", "epsilon": float("nan")}], actor="a")
    with pytest.raises(InvalidParameter, match="non-empty list"):
        ledger.reserve(key(1), "s", [], actor="a")
    with pytest.raises(SpecError, match="accountant basic/1 but scope 's' is checked by rdp/1"):
        ledger.reserve(key(1), "s", lap(0.1), actor="a", accountant="basic")
    with pytest.raises(InvalidParameter, match="empty"):
        RunKey("r", "h", DAY.format(2), DAY.format(1), "fp", "k")
    with pytest.raises(InvalidParameter, match="ISO-8601"):
        RunKey("r", "h", "yesterday", DAY.format(1), "fp", "k")
    with pytest.raises(InvalidParameter, match="actor"):
        ledger.reserve(key(1), "s", lap(0.1), actor="")
    with pytest.raises(InvalidParameter, match="details"):
        ledger.reserve(key(1), "s", lap(0.1), actor="a", details={"x": float("nan")})
    assert n_entries(ledger) == before and ledger.runs() == []
    assert ledger.verify().ok


@pytest.mark.parametrize("url, message", [
    ("postgresql://postgres@127.0.0.1:1/x", "cannot connect"),
    ("mysql://u@h/db", "unsupported ledger URL scheme"),
    ("sqlite://", "malformed"),
    ("not a url", "malformed"),
    ("sqlite:////nonexistent-dir-dpops/x.sqlite", "does not exist"),
    ("postgresql://postgres@127.0.0.1:5432/test?schema=Bad-Name", "schema"),
    ("sqlite:////tmp/x.sqlite?journal=off", "only SQLite option"),
])
def test_bad_urls(url, message):
    with pytest.raises(LedgerError, match=message):
        open_ledger(url)
    assert not os.path.exists("/nonexistent-dir-dpops")


def test_default_url_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("DPOPS_LEDGER_URL", f"sqlite:///{tmp_path}/env.sqlite")
    with open_ledger() as led:
        assert led.schema_version == SCHEMA_VERSION >= 2
    assert (tmp_path / "env.sqlite").exists()


# --- tampering ---------------------------------------------------------------------------------------------------


def _drop_guards(led):
    if led.db.dialect == "sqlite":
        led.db.execute("DROP TRIGGER entries_no_update")
        led.db.execute("DROP TRIGGER entries_no_delete")
    else:
        led.db.execute("DROP TRIGGER entries_append_only ON entries")


def _populated(led):
    led.create_scope(scope_def(), actor="a")
    for d in range(1, 4):
        full_run(led, key(d), "s", lap(0.1))  # entries 2..10
    assert led.verify().ok


def test_entries_are_append_only_by_trigger(ledger):
    _populated(ledger)
    with pytest.raises(Exception, match="append-only"):
        ledger.db.execute("UPDATE entries SET actor = 'mallory' WHERE id = 3")
    with pytest.raises(Exception, match="append-only"):
        ledger.db.execute("DELETE FROM entries WHERE id = 3")


@pytest.mark.parametrize("tamper, bad_entry, why", [
    ("UPDATE entries SET body = REPLACE(body, '\"scale\":10.0', '\"scale\":100.0') WHERE id = 2", 2, "edited"),
    ("UPDATE entries SET actor = 'mallory' WHERE id = 4", 4, "disagrees"),
    ("DELETE FROM entries WHERE id = 5", 5, "missing"),
    ("DELETE FROM entries WHERE id = 10", 10, "deleted"),
    ("SWAP 6 7", 6, "reordered"),
])
def test_tampering_is_detected_and_named(ledger, tamper, bad_entry, why):
    _populated(ledger)
    _drop_guards(ledger)
    if tamper.startswith("SWAP"):
        a, b = map(int, tamper.split()[1:])
        ledger.db.execute("UPDATE entries SET id = -1 WHERE id = ?", (a,))
        ledger.db.execute("UPDATE entries SET id = ? WHERE id = ?", (a, b))
        ledger.db.execute("UPDATE entries SET id = ? WHERE id = -1", (b,))
    else:
        assert ledger.db.execute(tamper).rowcount == 1
    report = ledger.verify()
    assert not report.ok and report.first_bad_entry == bad_entry, report
    assert f"entry {bad_entry}" in report.problems[0] and why in report.problems[0]


def test_cache_tampering_is_detected(ledger):
    _populated(ledger)
    ledger.db.execute("UPDATE runs SET events = events WHERE scope = 's'")  # no-op
    assert ledger.verify().ok
    ledger.db.execute("UPDATE runs SET events = '[]' WHERE interval_start = ?", ("2024-03-01T00:00:00Z",))
    report = ledger.verify()
    assert not report.ok and any("events is []" in p for p in report.problems), report.problems
    ledger.db.execute("UPDATE runs SET state = 'released' WHERE interval_start = ?", ("2024-03-02T00:00:00Z",))
    assert any("state is 'released'" in p for p in ledger.verify().problems)
    ledger.db.execute("UPDATE run_charges SET runs = runs + 1")  # the grouped settled runs the cap check composes
    assert any("run_charges table" in p for p in ledger.verify().problems)


# --- concurrency: 16 processes racing for the last of the budget ----------------------------------------------------

_BARRIER = None
_WORKER_LEDGERS: dict = {}


def _race_init(barrier):
    global _BARRIER
    _BARRIER = barrier
    # Forked from a pytest process where Beam/Airflow may have installed SIGTERM handlers: restore the
    # default so Pool.terminate() can always stop the workers (else the whole suite hangs in join).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _race_worker(args):
    url, scope, i = args
    led = _WORKER_LEDGERS.get(url) or _WORKER_LEDGERS.setdefault(url, open_ledger(url))
    k = RunKey("race", "h", DAY.format(i + 1), DAY.format(i + 2), f"fp-{scope}", "k")
    _BARRIER.wait(timeout=60)
    try:
        led.reserve(k, scope, lap(0.1), actor=f"worker{i}")
        return "ok"
    except BudgetExceeded:
        return "refused"


def test_race_16_processes_never_oversubscribe(ledger, ledger_url):
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(16)
    pool = ctx.Pool(16, initializer=_race_init, initargs=(barrier,))
    try:
        for rep in range(20):
            scope = f"race{rep}"
            ledger.create_scope(scope_def(name=scope, epsilon=1.0), actor="a")
            results = pool.map(_race_worker, [(ledger_url, scope, i) for i in range(16)], chunksize=1)
            assert results.count("ok") == 10 and results.count("refused") == 6, (rep, results)
            st = ledger.status(scope)
            assert st.reserved == pytest.approx(1.0, rel=1e-12) and st.total <= 1.0 * (1 + 1e-12)
        pool.close()  # normal shutdown: workers exit on the sentinel
    finally:
        pool.terminate()
        pool.join()
    assert ledger.verify().ok


# --- crashes: kill -9 inside the transaction ------------------------------------------------------------------------


def _crash_child(url, point, op, arg, ready):
    def hook(p):
        if p == point:
            ready.set()
            time.sleep(600)

    set_test_hook(hook)
    led = open_ledger(url)
    if op == "reserve":
        led.reserve(arg, "s", lap(0.1), actor="doomed")
    elif op == "start":
        led.start(arg, actor="doomed")
    else:
        led.commit(arg, output_uri="file:///doomed", actor="doomed")


def _kill_inside(url, point, op, arg):
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    proc = ctx.Process(target=_crash_child, args=(url, point, op, arg, ready))
    proc.start()
    assert ready.wait(30), "child never reached the hook"
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL


def test_sigkill_mid_transaction_leaves_no_partial_entry(ledger, ledger_url):
    ledger.create_scope(scope_def(), actor="a")
    before = n_entries(ledger)
    # 1. killed inside reserve, after the entry was appended but before COMMIT
    _kill_inside(ledger_url, "reserve:before_commit", "reserve", key(1))
    assert n_entries(ledger) == before and ledger.run(key(1).run_id) is None and ledger.verify().ok
    rec = ledger.reserve(key(1), "s", lap(0.1), actor="a")  # resumed
    # 2. killed inside start: the run stays reserved and can be released
    rec2 = ledger.reserve(key(2), "s", lap(0.1), actor="a")
    _kill_inside(ledger_url, "started:before_commit", "start", rec2.run_id)
    assert ledger.run(rec2.run_id).state == "reserved"
    assert ledger.release(rec2.run_id, reason="worker died before noise", actor="a").state == "released"
    # 3. killed inside commit: the run stays started and the commit can be retried
    ledger.start(rec.run_id, actor="a")
    n = n_entries(ledger)
    _kill_inside(ledger_url, "committed:before_commit", "commit", rec.run_id)
    assert n_entries(ledger) == n and ledger.run(rec.run_id).state == "started"
    assert ledger.commit(rec.run_id, output_uri="file:///o", actor="a").state == "committed"
    st = ledger.status("s")
    assert st.committed == pytest.approx(0.1) and st.total == pytest.approx(0.1)
    report = ledger.verify()
    assert report.ok, report
