"""A real backfill through Airflow's scheduler, on the PostgreSQL ledger.

api-server + scheduler + dag-processor (LocalExecutor, PARALLELISM=4) run as subprocesses
against a fresh PostgreSQL metadata database created for this test; the ledger lives in
its own schema of the test database. ``airflow backfill create --max-active-runs 2`` over
6 daily intervals with a scope cap that fits 4: the cap is never exceeded, every
published interval is charged exactly once, refused intervals stay unpublished, verify
passes. Then the same backfill with ``--reprocess-behavior completed`` charges nothing
and changes no published byte.
"""

from __future__ import annotations

import airflow_support  # noqa: F401  (environment before airflow)

import hashlib
import secrets
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from airflow_support import airflow_cli, create_backfill, make_workspace, metadata_db, pg_exec, start_stack

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(900)]

DAYS = 6
EPS_PER_RUN = 0.5
CAP = 2.0  # fits exactly 4 runs under basic composition
WAIT_RUNS_S = 420


@pytest.fixture
def airflow_pg_db(postgres_url):
    """A fresh PostgreSQL database for Airflow's metadata, dropped afterwards."""
    with metadata_db(postgres_url, "airflow_test") as url:
        yield url


@pytest.fixture
def ledger_pg_url(postgres_url):
    schema = f"af_backfill_{secrets.token_hex(4)}"
    sep = "&" if "?" in postgres_url else "?"
    try:
        yield f"{postgres_url}{sep}schema={schema}"
    finally:
        pg_exec(postgres_url, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _dag_runs(meta_url: str, dag_id: str) -> list[tuple]:
    url = meta_url.replace("postgresql+psycopg://", "postgresql://", 1)
    return pg_exec(url, "SELECT run_id, state, start_date, end_date, clear_number, data_interval_start FROM dag_run "
               "WHERE dag_id = %s AND run_type = 'backfill' ORDER BY data_interval_start", (dag_id,), fetch=True)


def _wait_runs(meta_url: str, dag_id: str, n: int, procs: list, min_clear: int = 0) -> list[tuple]:
    deadline = time.monotonic() + WAIT_RUNS_S
    rows: list[tuple] = []
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, f"{p.args[1]} died with {p.returncode}"
        rows = _dag_runs(meta_url, dag_id)
        if len(rows) == n and all(r[1] in ("success", "failed") and r[4] >= min_clear for r in rows):
            return rows
        time.sleep(1)
    raise AssertionError(f"backfill runs did not finish in {WAIT_RUNS_S} s: {[(r[0], r[1], r[4]) for r in rows]}")


def _task_durations(meta_url: str, dag_id: str) -> list[tuple]:
    url = meta_url.replace("postgresql+psycopg://", "postgresql://", 1)
    return pg_exec(url, "SELECT task_id, count(*), round(avg(duration)::numeric, 1), round(max(duration)::numeric, 1), "
               "round(avg(extract(epoch from start_date - queued_dttm))::numeric, 1) FROM task_instance "
               "WHERE dag_id = %s GROUP BY task_id", (dag_id,), fetch=True)


def _max_overlap(rows: list[tuple]) -> int:
    events = sorted([(r[2], 1) for r in rows if r[2]] + [(r[3], -1) for r in rows if r[3]])
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def _published_digests(ledger, release: str) -> dict[str, str]:
    from urllib.parse import urlparse

    out = {}
    for rec in ledger.runs(release=release, states=["committed"]):
        data = Path(urlparse(rec.output_uri).path) / "data.parquet"
        out[rec.key.interval_start] = hashlib.sha256(data.read_bytes()).hexdigest()
    return out


def test_backfill_through_scheduler_never_exceeds_cap_and_rerun_is_free(
    tmp_path, airflow_pg_db, ledger_pg_url
):
    from dpops.ledger import open_ledger

    ws = make_workspace(tmp_path / "ws", ledger_url=ledger_pg_url, release="af_backfill", scope="af_bf_scope",
                        days=DAYS, epsilon_per_run=EPS_PER_RUN, scope_cap=CAP, rows_per_day=1500)
    t0 = time.monotonic()
    phases: list[tuple[str, float]] = []

    def phase(name: str) -> None:
        phases.append((name, round(time.monotonic() - t0, 1)))
        print(f"[backfill test] {name} at {phases[-1][1]} s", flush=True)

    dag_id = ws.dag_id
    with ExitStack() as stack:
        # start_stack returns once the dag-processor has serialized the DAG (what `airflow dags reserialize`
        # did here before); DAGs are created unpaused.
        af = start_stack(stack, tmp_path, airflow_pg_db, ws,
                         # Only the backfill runs: no scheduled run of the latest real-world interval.
                         AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE="False",
                         DPOPS_TASK_RETRIES="1")
        env, procs = af.env, af.procs
        phase("stack up, DAG registered")
        airflow_cli(env, "backfill", "create", "--dag-id", dag_id, "--from-date", "2024-01-01",
             "--to-date", f"2024-01-{DAYS:02d}", "--max-active-runs", "2")
        rows = _wait_runs(airflow_pg_db, dag_id, DAYS, procs)
        phase("first backfill finished")
        print("[backfill test] task_id, count, avg s, max s, avg queue s:", _task_durations(airflow_pg_db, dag_id),
              flush=True)

        ledger = open_ledger(ws.ledger_url)
        committed = ledger.runs(release=ws.release, states=["committed"])
        status = ledger.status(ws.scope)
        reserved_entries: dict[str, int] = {}
        for e in ledger.history(ws.scope):
            if e.kind == "reserved":
                reserved_entries[e.run_id] = reserved_entries.get(e.run_id, 0) + 1

        # At least two intervals really ran at the same time.
        assert _max_overlap(rows) >= 2, rows
        # The cap is never exceeded, and it is used: exactly cap / eps runs fit.
        assert status.total <= CAP * (1 + 1e-9)
        assert len(committed) == int(CAP / EPS_PER_RUN)
        assert status.total == pytest.approx(CAP)
        # Each published interval: one committed run, reserved (charged) exactly once.
        starts = [r.key.interval_start for r in committed]
        assert len(set(starts)) == len(starts)
        assert all(reserved_entries[r.run_id] == 1 for r in committed)
        assert sum(reserved_entries.values()) == len(committed)  # refused runs charged nothing
        # Refused intervals: a refusal, not a crash (dags/dpops_dag_factory.py): reserve_budget ends skipped,
        # the DAG run completes; nothing in the ledger, nothing published.
        states = {str(r[5])[:10]: r[1] for r in rows}
        assert set(states.values()) == {"success"}
        skipped = pg_exec(airflow_pg_db.replace("postgresql+psycopg://", "postgresql://", 1),
                      "SELECT count(*) FROM task_instance WHERE dag_id = %s AND task_id = 'reserve_budget' "
                      "AND state = 'skipped'", (dag_id,), fetch=True)[0][0]
        assert skipped == DAYS - len(committed)
        published_days = {s[:10] for s in starts}
        for day, state in states.items():
            if day not in published_days:
                assert not list((ws.specs_dir / "out" / "published" / ws.release).glob(day.replace("-", "") + "*"))
        assert ledger.verify().ok
        digests = _published_digests(ledger, ws.release)
        ledger.close()

        # The same backfill again, reprocessing completed runs: served, nothing charged, nothing changed.
        # once the scheduler has marked the first backfill complete (every 30 s): one is accepted at a time
        create_backfill(env, airflow_pg_db, dag_id, "--from-date", "2024-01-01", "--to-date", f"2024-01-{DAYS:02d}",
                        "--max-active-runs", "2", "--reprocess-behavior", "completed", alive=af.alive, timeout=60)
        phase("reprocessing backfill created")
        rows2 = _wait_runs(airflow_pg_db, dag_id, DAYS, procs, min_clear=1)
        phase("reprocessing backfill finished")
        assert {str(r[5])[:10]: r[1] for r in rows2} == states

        ledger = open_ledger(ws.ledger_url)
        assert ledger.status(ws.scope).total == pytest.approx(status.total)
        assert len(ledger.runs(release=ws.release)) == len(committed)
        assert sum(1 for e in ledger.history(ws.scope) if e.kind == "reserved") == len(committed)
        assert _published_digests(ledger, ws.release) == digests
        assert ledger.verify().ok
        ledger.close()
