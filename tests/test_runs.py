"""Run orchestration against the real ledger (SQLite) with a stand-in pipeline and plan.

The stand-in pipeline draws "noise" as a deterministic function of the noise label, like keyed
randomness does, and counts its calls, so the tests can see when noise would be drawn again.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from dpops import release
from dpops.release.pipeline_seam import ComputeResult
from dpops.errors import (BudgetExceeded, InputDataError, IntegrityError, InternalError, LedgerError, SpecError,
                          StorageError)
from dpops.events import Laplace
from dpops.ledger import ScopeDefinition, open_ledger

IV = ("2024-01-01", "2024-01-02")
SLUG = "20240101T000000Z_20240102T000000Z"


class FakeKey:
    key_id = "k-test-0001"

    def hmac(self, data: bytes) -> bytes:
        return hmac.new(b"0123456789abcdef0123456789abcdef", data, hashlib.sha256).digest()

    def seal_mac(self, data: bytes) -> str:  # the staging seal (dpops.storage)
        return "hmac-sha256:" + hmac.new(b"seal-key-0123456789abcdef0123456", data, hashlib.sha256).hexdigest()

    def binding_mac(self, data: bytes) -> str:  # the published binding (dpops.storage.published)
        return "hmac-sha256:" + hmac.new(b"bind-key-0123456789abcdef0123456", data, hashlib.sha256).hexdigest()


class FakePlan:
    """Charges eps 0.5 per run (one Laplace event)."""

    events = [Laplace(scale=2.0, l1_sensitivity=1.0)]
    plan_hash = "p" * 64

    def describe(self):
        return {"mechanisms": ["laplace"]}


def planner(spec):
    return FakePlan()


class FakePipeline:
    def __init__(self):
        self.calls = 0
        self.fail_after_start = False
        self.nan = False
        self.requests = []

    def __call__(self, req):
        self.calls += 1
        self.requests.append(req)
        if self.fail_after_start:
            raise RuntimeError("worker lost")
        seed = hashlib.sha256(json.dumps(req.noise_label, sort_keys=True).encode()).digest()
        noise = [seed[0] / 10.0, seed[1] / 10.0]
        count = [10 + noise[0], 20 + noise[1]]
        if self.nan:
            count[1] = float("nan")
        cols = {"region": ["north", "south"]}
        for key, vals in (("count", count), ("sum_amount", [100 + noise[1], 200 + noise[0]])):
            cols[key] = vals
            cols[f"{key}_std"] = [1.0, 1.0]
            cols[f"{key}_ci95_low"] = [v - 2 for v in vals]
            cols[f"{key}_ci95_high"] = [v + 2 for v in vals]
        out = Path(req.staging_dir)
        pq.write_table(pa.table(cols), out / "data.parquet")
        (out / "summary.json").write_text(json.dumps({"release": "purchases_test", "test_mode": req.randomness == "test"}))
        return ComputeResult(str(out / "data.parquet"), str(out / "summary.json"), 2,
                             internal={"rows_read": 4, "rows_dropped": {"null_unit": 1}})


def write_input(tmp_path: Path, day: str = "2024-01-01", amounts=(1.0, 2.0, 3.0, 4.0)):
    p = tmp_path / "data" / f"{day}.parquet"
    p.parent.mkdir(exist_ok=True)
    pq.write_table(pa.table({
        "user_id": ["a", "b", "c", None], "region": ["north", "south", "north", "south"],
        "amount": list(amounts), "category": ["x"] * 4,
    }), p)
    return p


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def ledger_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.sqlite'}"
        return
    import uuid

    import psycopg

    base = request.getfixturevalue("postgres_url")
    schema = f"t_runs_{uuid.uuid4().hex[:12]}"
    yield f"{base}?schema={schema}"
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture
def env(tmp_path, ledger_url):
    doc = {
        "name": "purchases_test",
        "input": {"path": "data/{start:%Y-%m-%d}.parquet", "format": "parquet",
                  "columns": {"user_id": "string", "region": "string", "amount": "float"}},
        "privacy_unit": {"column": "user_id", "description": "a user's purchases on one day",
                         "adjacency": "add_remove", "period": "day"},
        "budget": {"scope": "shop", "epsilon": 0.5, "delta": 0},
        "contribution": {"max_partitions_per_unit": 1, "max_rows_per_unit_per_partition": 2},
        "partitions": {"columns": ["region"], "public": ["north", "south"]},
        "metrics": [{"type": "count"}, {"type": "sum", "column": "amount", "bounds": [0, 10]}],
    }
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(doc))
    write_input(tmp_path)
    ledger = open_ledger(ledger_url)
    ledger.create_scope(ScopeDefinition(name="shop", unit="a user's purchases", unit_column="user_id",
                                        epsilon=1.2, delta=1e-6, rho=None, accountant="basic/1",
                                        adjacency="add_remove", unit_period="day"), actor="test")
    pipe = FakePipeline()

    class Env:
        pass

    e = Env()
    e.tmp, e.spec, e.ledger, e.pipe = tmp_path, spec, ledger, pipe
    e.run = lambda **kw: release.execute_release(spec, *IV, ledger=ledger, key=FakeKey(), run_release=pipe,
                                              planner=planner, **kw)
    yield e
    ledger.close()


def charged(ledger) -> float:
    st = ledger.status("shop")
    return st.total


def published_bytes(tmp_path: Path) -> bytes:
    return (tmp_path / "out/published/purchases_test" / SLUG / "current/data.parquet").read_bytes()


def test_publish_and_commit_once(env):
    out = env.run()
    assert out.state == "published" and out.epsilon_charged == pytest.approx(0.5)
    assert out.scope_remaining == pytest.approx(0.7)
    rec = env.ledger.run(out.run_id)
    assert rec.state == "committed" and rec.output_uri == out.output_uri
    assert env.ledger.published("purchases_test", "2024-01-01T00:00:00Z", "2024-01-02T00:00:00Z").run_id == out.run_id
    assert env.pipe.calls == 1
    staged = env.tmp / "out/staged/purchases_test" / SLUG / out.run_id
    assert not (staged / "internal.json").exists()  # the run log is private: outside output.root
    from dpops.storage import ReleaseStore

    assert ReleaseStore(env.tmp / "out", "purchases_test").read_internal_log(SLUG, out.run_id)["rows_dropped"] == \
        {"null_unit": 1}
    pub = env.tmp / "out/published/purchases_test" / SLUG / "v1"
    assert "internal.json" not in {p.name for p in pub.iterdir()}
    assert "rows_dropped" not in (pub / "summary.json").read_text()
    assert "release=purchases_test" in out.line() and "epsilon_charged=0.5" in out.line()
    # the manifest: written once, reviewer-safe (keyed fingerprints, no internal counters)
    from dpops.manifest import read_manifest

    mpath = env.tmp / "out/manifests/purchases_test" / f"{out.run_id}.published.json"
    text = mpath.read_text()
    m = read_manifest(mpath)
    assert m["outcome"]["state"] == "published" and "rows_dropped" not in text and "rows_read" not in text
    assert all(v.startswith("hmac-sha256:") for v in m["output"]["fingerprints"].values())
    assert set(m["output"]["fingerprints"]) == {"data.parquet", "summary.json"}


def test_rerun_of_published_interval_charges_nothing(env):
    first = env.run()
    before = charged(env.ledger)
    again = env.run()
    assert again.state == "already_published" and again.epsilon_charged == 0
    assert again.run_id == first.run_id and charged(env.ledger) == before and env.pipe.calls == 1
    assert env.ledger.verify().ok


def test_retry_after_failure_post_start_same_numbers_one_charge(env):
    env.pipe.fail_after_start = True
    # The pipeline's own error text is withheld (it may quote input data): only its class is named.
    with pytest.raises(InternalError, match="RuntimeError"):
        env.run()
    rec = env.ledger.runs(release="purchases_test")[0]
    assert rec.state == "started"  # noise may have been drawn: no refund
    assert not list((env.tmp / "out/staged").rglob("data.parquet"))  # the half-written staging dir is gone
    env.pipe.fail_after_start = False
    out = env.run()
    assert out.state == "published" and out.run_id == rec.run_id
    assert out.epsilon_charged == 0  # charged by the first attempt only
    assert charged(env.ledger) == pytest.approx(0.5)
    # the retry drew the same noise: same label => same output as a clean run elsewhere
    assert env.pipe.requests[0].noise_label == env.pipe.requests[1].noise_label


def test_publish_failure_after_compute_is_retried_without_recompute(env, monkeypatch):
    from dpops.storage import ReleaseStore

    real = ReleaseStore.publish

    def broken(self, *a, **k):
        raise StorageError("cannot publish into /x: the disk is full")

    monkeypatch.setattr(ReleaseStore, "publish", broken)
    with pytest.raises(StorageError, match="disk is full"):
        env.run()
    # the ledger commits before the files become visible: committed, nothing visible yet
    assert env.ledger.runs(release="purchases_test")[0].state == "committed"
    assert not (env.tmp / "out/published/purchases_test" / SLUG / "current").exists()
    monkeypatch.setattr(ReleaseStore, "publish", real)
    out = env.run()  # the retry completes the publication from the sealed staged output
    assert out.state == "already_published" and env.pipe.calls == 1
    assert published_bytes(env.tmp)
    assert charged(env.ledger) == pytest.approx(0.5)


def test_changed_input_without_restate_refused_then_restated(env):
    first = env.run()
    write_input(env.tmp, amounts=(1.0, 2.0, 3.0, 5.0))  # late/corrected data
    with pytest.raises(LedgerError, match="already published .*input changed.*dpops release restate"):
        env.run()
    assert charged(env.ledger) == pytest.approx(0.5) and env.pipe.calls == 1
    old_bytes = published_bytes(env.tmp)
    out = release.execute_restatement(env.spec, *IV, ledger=env.ledger, key=FakeKey(), run_release=env.pipe,
                                   planner=planner)
    assert out.state == "published" and out.restates == first.run_id and out.run_id != first.run_id
    assert out.epsilon_charged == pytest.approx(0.5) and charged(env.ledger) == pytest.approx(1.0)
    assert env.ledger.published("purchases_test", *IV).run_id == out.run_id
    v1 = env.tmp / "out/published/purchases_test" / SLUG / "v1/data.parquet"
    assert v1.read_bytes() == old_bytes  # the old version is kept
    assert published_bytes(env.tmp) != old_bytes
    # restating again with the same corrected input changes nothing
    again = release.execute_restatement(env.spec, *IV, ledger=env.ledger, key=FakeKey(), run_release=env.pipe,
                                     planner=planner)
    assert again.state == "already_published" and charged(env.ledger) == pytest.approx(1.0)


def test_restate_needs_a_publication(env):
    with pytest.raises(LedgerError, match="has not been published: nothing to restate"):
        release.execute_restatement(env.spec, *IV, ledger=env.ledger, key=FakeKey(), run_release=env.pipe,
                                 planner=planner)


def test_budget_refusal_leaves_nothing(env):
    env.run()  # 0.5
    write_input(env.tmp, "2024-01-02")
    release.execute_release(env.spec, "2024-01-02", "2024-01-03", ledger=env.ledger, key=FakeKey(),
                         run_release=env.pipe, planner=planner)  # 1.0 of 1.2
    write_input(env.tmp, "2024-01-03")
    with pytest.raises(BudgetExceeded) as info:
        release.execute_release(env.spec, "2024-01-03", "2024-01-04", ledger=env.ledger, key=FakeKey(),
                             run_release=env.pipe, planner=planner)
    assert info.value.exit_code == 5
    assert charged(env.ledger) == pytest.approx(1.0) and env.pipe.calls == 2
    assert not (env.tmp / "out/published/purchases_test/20240103T000000Z_20240104T000000Z").exists()
    assert not (env.tmp / "out/staged/purchases_test/20240103T000000Z_20240104T000000Z").exists()


def test_failure_before_start_releases_reservation(env):
    def no_pipeline():
        raise ModuleNotFoundError("No module named 'apache_beam'")

    from dpops.release import computation as r

    orig = r._load_run_release
    r._load_run_release = no_pipeline
    try:
        with pytest.raises(ModuleNotFoundError):
            release.execute_release(env.spec, *IV, ledger=env.ledger, key=FakeKey(), planner=planner)
    finally:
        r._load_run_release = orig
    rec = env.ledger.runs(release="purchases_test")[0]
    assert rec.state == "released"
    assert charged(env.ledger) == 0
    # The failure was transient: a retry must not be blocked by the refunded run key. It reserves a new
    # attempt (no noise was ever drawn under the first), publishes, and is charged exactly once.
    out = release.execute_release(env.spec, *IV, ledger=env.ledger, key=FakeKey(), run_release=env.pipe,
                               planner=planner)
    assert out.state == "published" and out.run_id != rec.run_id
    assert charged(env.ledger) == pytest.approx(0.5)
    states = sorted(r.state for r in env.ledger.runs(release="purchases_test"))
    assert states == ["committed", "released"]
    # and a later re-run serves the published attempt without a charge
    again = release.execute_release(env.spec, *IV, ledger=env.ledger, key=FakeKey(), run_release=env.pipe,
                                 planner=planner)
    assert again.state == "already_published" and again.run_id == out.run_id
    assert charged(env.ledger) == pytest.approx(0.5)


def test_bad_input_touches_no_ledger(env):
    (env.tmp / "data/2024-01-01.parquet").unlink()
    with pytest.raises(InputDataError, match="2024-01-01.parquet does not exist"):
        env.run()
    pq.write_table(pa.table({"user_id": ["a"], "region": ["n"]}), env.tmp / "data/2024-01-01.parquet")
    with pytest.raises(InputDataError, match="column 'amount' .* is missing"):
        env.run()
    assert env.ledger.runs() == [] and env.pipe.calls == 0


def test_missing_scope_is_clear(env, tmp_path):
    other = open_ledger(f"sqlite:///{tmp_path / 'empty.sqlite'}")
    # a spec naming a scope the ledger lacks is a spec problem (exit 3, as `dpops spec check` says; issue 28 item 9)
    with pytest.raises(SpecError, match="budget scope 'shop' .* is not in the ledger.*dpops ledger scope create"):
        release.execute_release(env.spec, *IV, ledger=other, key=FakeKey(), run_release=env.pipe, planner=planner)
    assert other.runs() == []
    other.close()


def test_noisy_output_checks_block_publish(env):
    env.pipe.nan = True
    with pytest.raises(IntegrityError, match="column 'count' has NaN values"):
        env.run()
    assert env.ledger.runs(release="purchases_test")[0].state == "started"  # charge stays; nothing published
    assert not (env.tmp / "out/published").exists() or not list((env.tmp / "out/published").rglob("data.parquet"))


def test_test_mode_never_published(env):
    with pytest.raises(StorageError, match="test-mode .*never published"):
        release.execute_release(env.spec, *IV, ledger=env.ledger, randomness="test", test_seed=7,
                             run_release=env.pipe, planner=planner)
    rec = env.ledger.runs(release="purchases_test")[0]
    assert rec.state == "spent_unpublished" and rec.key.key_id == "test/seed-7"
    assert env.pipe.requests[0].randomness == "test" and env.pipe.requests[0].test_seed == 7


def test_os_mode_retry_takes_a_new_attempt(env):
    env.pipe.fail_after_start = True
    with pytest.raises(InternalError, match="RuntimeError"):
        env.run(randomness="os")
    first = env.ledger.runs(release="purchases_test")[0]
    assert first.state == "spent_unpublished" and first.key.key_id == "os/attempt-1"
    env.pipe.fail_after_start = False
    out = env.run(randomness="os")
    assert out.state == "published" and out.run_id != first.run_id
    assert env.ledger.run(out.run_id).key.key_id == "os/attempt-2"
    assert charged(env.ledger) == pytest.approx(1.0)  # the lost attempt's charge stays
    assert env.pipe.requests[-1].key_path is None


def test_steps_one_by_one_are_idempotent(env):
    ctx = release.prepare(env.spec, *IV, key=FakeKey(), planner=planner)
    a = release.reserve(ctx, env.ledger)
    b = release.reserve(ctx, env.ledger)
    assert a.state == "reserved" and b.state == "reserved" and b.epsilon_charged == 0
    s1 = release.compute(ctx, env.ledger, run_release=env.pipe)
    s2 = release.compute(ctx, env.ledger, run_release=env.pipe)
    assert s1.state == s2.state == "staged" and env.pipe.calls == 1
    p1 = release.publish(ctx, env.ledger)
    p2 = release.publish(ctx, env.ledger)
    assert p1.state == "published" and p2.state == "already_published"
    assert release.step_summary(p1)["run_id"] == ctx.run_id
    json.dumps(release.step_summary(s1))
    assert charged(env.ledger) == pytest.approx(0.5)


def test_status(env):
    out = env.run()
    st = release.status(env.spec, *IV, ledger=env.ledger)
    assert st["published_run"] == out.run_id and st["versions"][0]["version"] == 1
    assert st["runs"][0]["state"] == "committed"


# --------------------------------------------------------------------------- with the real plan and pipeline


def test_end_to_end_keyed_retry_reproduces_noise_with_one_charge(tmp_path):
    """Real release plan + Beam pipeline (FnApiRunner): a started run whose staged output was lost is
    recomputed under the same key and input to the very same numbers, and charged once."""
    import numpy as np

    from dpops.noise.randomness import NoiseKey

    doc = {
        "name": "e2e",
        "input": {"path": "data/{start:%Y-%m-%d}.parquet", "format": "parquet",
                  "columns": {"user_id": "string", "region": "string", "amount": "float"}},
        "privacy_unit": {"column": "user_id", "description": "a user's purchases on one day",
                         "adjacency": "add_remove"},
        "budget": {"scope": "shop", "epsilon": 1.0, "delta": 0},
        "contribution": {"max_partitions_per_unit": 2, "max_rows_per_unit_per_partition": 2},
        "partitions": {"columns": ["region"], "public": ["north", "south", "east", "west"]},
        "metrics": [{"type": "count"}, {"type": "sum", "column": "amount", "bounds": [0, 100]}],
    }
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(doc))
    rng = np.random.default_rng(3)
    n = 500
    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({
        "user_id": [f"u{i}" for i in rng.integers(0, 100, n)],
        "region": rng.choice(["north", "south", "east"], n).tolist(),
        "amount": rng.uniform(0, 120, n),
    }), tmp_path / "data/2024-01-01.parquet")
    key = tmp_path / "noise.key"
    NoiseKey.generate(key)
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    ledger.create_scope(ScopeDefinition(name="shop", unit="a user's purchases", unit_column="user_id",
                                        epsilon=3.0, delta=1e-6, rho=None, accountant="basic/1",
                                        adjacency="add_remove"), actor="test")
    try:
        ctx = release.prepare(spec, *IV, key_path=str(key))
        assert release.reserve(ctx, ledger).state == "reserved"
        first = release.compute_staged(ctx, ledger)
        table1 = pq.read_table(first.data_file)
        import shutil

        shutil.rmtree(first.directory)  # the worker's disk is lost after noise was drawn
        again = release.execute_release(spec, *IV, ledger=ledger, key_path=str(key))
        assert again.state == "published" and again.epsilon_charged == 0
        table2 = pq.read_table(tmp_path / "out/published/e2e" / SLUG / "current/data.parquet")
        assert table2.equals(table1)  # same key + same input => the same noise, nothing new revealed
        assert ledger.status("shop").total == pytest.approx(ledger.run(again.run_id).epsilon)
        assert ledger.run(again.run_id).epsilon == pytest.approx(1.0, rel=1e-6)
        assert set(table2.column("region").to_pylist()) == {"north", "south", "east", "west"}
        assert ledger.verify().ok
    finally:
        ledger.close()


def test_concurrent_runs_of_one_interval_charge_once_and_publish_once(env, ledger_url):
    """A scheduled run and a backfill of the same interval at the same moment (two threads, two ledger
    connections, both inside the pipeline together): one charge, one published version."""
    import threading

    barrier = threading.Barrier(2, timeout=20)
    inner = env.pipe

    def pipeline(req):
        try:
            barrier.wait()  # both attempts are computing at the same time
        except threading.BrokenBarrierError:
            pass
        return inner(req)

    results, errors = [], []

    def worker():
        led = open_ledger(ledger_url)
        try:
            results.append(release.execute_release(env.spec, *IV, ledger=led, key=FakeKey(), run_release=pipeline,
                                                planner=planner))
        except (LedgerError, StorageError) as exc:  # a lost race is a retryable error, never a double spend
            errors.append(exc)
        finally:
            led.close()

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) + len(errors) == 2 and results
    retry = env.run()  # whoever lost the race retries and is served
    assert retry.state == "already_published"
    assert charged(env.ledger) == pytest.approx(0.5)
    from dpops.storage import ReleaseStore

    store = ReleaseStore(env.tmp / "out", "purchases_test")
    assert [v.version for v in store.versions(SLUG)] == [1]
    assert env.ledger.verify().ok


def test_one_log_line_per_run(env, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="dpops.release"):
        env.run()
    lines = [r.getMessage() for r in caplog.records if r.name == "dpops.release" and r.levelno >= logging.INFO]
    assert len(lines) == 1 and "outcome=published" in lines[0] and "remaining=0.7" in lines[0]
    caplog.clear()
    write_input(env.tmp, amounts=(7.0, 7.0, 7.0, 7.0))
    with caplog.at_level(logging.INFO, logger="dpops.release"), pytest.raises(LedgerError):
        env.run()
    lines = [r.getMessage() for r in caplog.records if r.name == "dpops.release" and r.levelno >= logging.INFO]
    assert len(lines) == 1 and "outcome=failed" in lines[0] and "restate" in lines[0]


def test_abandon(env):
    ctx = release.prepare(env.spec, *IV, key=FakeKey(), planner=planner)
    release.reserve(ctx, env.ledger)
    assert release.abandon(ctx, env.ledger, reason="wrong day").state == "released"
    assert charged(env.ledger) == 0
    write_input(env.tmp, amounts=(5.0, 5.0, 5.0, 5.0))
    ctx = release.prepare(env.spec, *IV, key=FakeKey(), planner=planner)
    release.reserve(ctx, env.ledger)
    release.compute(ctx, env.ledger, run_release=env.pipe)
    assert release.abandon(ctx, env.ledger, reason="bad output").state == "spent_unpublished"
    assert charged(env.ledger) == pytest.approx(0.5)  # noise was drawn: the charge stays
    with pytest.raises(LedgerError, match="never computed again.*--fresh-attempt"):
        release.reserve(ctx, env.ledger)
