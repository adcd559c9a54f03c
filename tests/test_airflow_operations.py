"""Issue 21: a year of operating dpops through real Airflow processes, in one stack (module scope).

api-server + scheduler + dag-processor (LocalExecutor) on a fresh PostgreSQL metadata database; the
ledger is a schema of the PostgreSQL test database; every operator step is the documented one (README
"Releasing a given day", docs/runbook.md), through the REST API, the airflow CLI or the dpops CLI:

- item 6: publish_release fails after the commit (the published area is blocked), the DAG run fails;
  the runbook's ``airflow tasks clear ... -t publish_release --downstream`` publishes and the DAG run
  ends success with record_run run;
- item 5: a triggered run names its day in ``conf.interval`` with ``logical_date: null``: a hole is
  filled and a restatement is published although those logical dates already have runs (the
  runbook's former call with a logical date answers 409);
- item 2: ``dpops ledger recover`` refunds a reserved run; the next backfill of that day publishes
  (every task on the new attempt), charged once;
- item 3: a started run made spent_unpublished fails its DAG run at once (no retries); the one
  documented command, ``dpops release run --fresh-attempt --reason``, publishes it;
- items 4 and 6: a refused day (DAG-run note ``REFUSED:``), cap raised, reprocessed: published, the
  note replaced, and the old refusal manifest still verifies; ``dpops report`` exits 0;
- item 10: a day whose input never came: ``dpops gaps`` says "input missing (waited 10 s)".

The same stack serves a second release, ``af_backfill`` (its own scope, input folder and DAG; formerly
test_backfill.py, with a stack of its own: 24 CPU-s to start and stop): a real backfill through the scheduler
(``airflow backfill create --max-active-runs 2`` over 6 daily intervals with a scope cap that fits 4) never
exceeds the cap, charges every published interval exactly once, leaves refused intervals unpublished and the
ledger verifiable; the same backfill with ``--reprocess-behavior completed`` charges nothing and changes no
published byte. It runs last, so the operations cases see the stack as they did alone.
"""

from __future__ import annotations

import airflow_support  # noqa: F401  (environment before airflow)

import hashlib
import json
import secrets
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from airflow_support import VENV_BIN, airflow_cli, create_backfill, make_workspace, metadata_db, pg_exec, start_stack

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(1500)]

EPS = 0.5
CAP = 3.2  # D1, D2, the restatement of D1, D3, D4 spent + D4 fresh = 3.0; D5 is refused until the cap is raised
DAY = {i: f"2024-01-{i:02d}" for i in range(1, 8)}


def _iv(i: int) -> tuple[str, str]:
    return f"{DAY[i]}T00:00:00+00:00", f"{DAY[i + 1]}T00:00:00+00:00"


BF_DAYS = 6
BF_EPS = 0.5
BF_CAP = 2.0  # fits exactly 4 runs under basic composition
BF_WAIT_RUNS_S = 420


@pytest.fixture(scope="module")
def ops(tmp_path_factory, postgres_url):
    tmp = tmp_path_factory.mktemp("af_ops")
    schema = f"af_ops_{secrets.token_hex(4)}"
    sep = "&" if "?" in postgres_url else "?"
    ledger_url = f"{postgres_url}{sep}schema={schema}"
    try:
        ws = make_workspace(tmp / "ws", ledger_url=ledger_url, release="af_ops", scope="af_ops_scope", days=5,
                            scope_cap=CAP, epsilon_per_run=EPS, rows_per_day=800)
        # test_7's release: same spec folder, ledger and key, its own input folder and scope
        bf = make_workspace(tmp / "ws", ledger_url=ledger_url, release="af_backfill", scope="af_bf_scope",
                            days=BF_DAYS, epsilon_per_run=BF_EPS, scope_cap=BF_CAP, rows_per_day=1500,
                            data="data_backfill")
        state = tmp / "state"
        state.mkdir(mode=0o700)
        manifests = tmp / "manifests"  # as deploy/ sets it: one manifests directory for the deployment
        with metadata_db(postgres_url, "airflow_ops") as meta_url, ExitStack() as es:
            stack = start_stack(
                es, tmp, meta_url, ws, more_dags=(bf.dag_id,),
                AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE="False",  # only the runs the test asks for
                DPOPS_TASK_RETRIES="1",
                DPOPS_STATE_DIR=str(state),
                DPOPS_MANIFESTS_DIR=str(manifests),
                # Not shorter: under load an Airflow 3.3 scheduler drains a reschedule poke's executor success
                # ~5 s late and, if the next poke is already queued, fails the sensor as "killed externally"
                # before its timeout (apache/airflow#71172, fix pending in #71194): no input-wait record.
                # A timeout shorter than one poke interval: the missing day (test 6) gives up at its second
                # poke, 12 s after the first, and no third poke is ever scheduled.
                DPOPS_INPUT_POKE_SECONDS="12",
                DPOPS_INPUT_TIMEOUT_SECONDS="10",
            )
            stack.state_dir, stack.manifests, stack.backfill_ws = state, manifests, bf
            yield stack
    finally:
        pg_exec(postgres_url, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def dpops(stack, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """The dpops CLI as an operator runs it next to the scheduler (same ledger, key and state directory)."""
    env = {k: v for k, v in stack.env.items() if not k.startswith("_")}
    proc = subprocess.run([str(VENV_BIN / "dpops"), *args], env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, f"dpops {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def backfill(stack, day: int, *, reprocess: str | None = None) -> tuple[str, dict]:
    """``airflow backfill create`` of one day (retried while the previous backfill is being closed); waits
    for that day's backfill run to finish and returns (run_id, run)."""
    dag_id = stack.ws.dag_id
    args = ["--from-date", DAY[day], "--to-date", DAY[day]]
    if reprocess:
        args += ["--reprocess-behavior", reprocess]
    before = _backfill_run(stack, day)
    # once the scheduler has closed the previous backfill (it does every 30 s in Airflow 3.3)
    create_backfill(stack.env, stack.meta_url, dag_id, *args, alive=stack.alive, timeout=90)
    deadline = time.monotonic() + 60
    while True:
        row = _backfill_run(stack, day)
        if row is not None and (before is None or row[1] > before[1]):
            break
        assert time.monotonic() < deadline, f"no backfill run for {DAY[day]}"
        time.sleep(0.5)
    return row[0], stack.wait_run(dag_id, row[0], min_clear=row[1])


def _backfill_run(stack, day: int):
    rows = pg_exec(stack.meta_url, "SELECT run_id, clear_number FROM dag_run WHERE dag_id = %s AND run_type = "
                   "'backfill' AND logical_date = %s", (stack.ws.dag_id, f"{DAY[day]}T00:00:00+00:00"), fetch=True)
    return rows[0] if rows else None


def trigger(stack, body: dict) -> tuple[int, str | None]:
    with stack.client() as c:
        r = c.post(f"/dags/{stack.ws.dag_id}/dagRuns", json=body)
    return r.status_code, (r.json().get("dag_run_id") if r.status_code in (200, 201) else r.text)


def _ledger(stack):
    from dpops.ledger import open_ledger

    return open_ledger(stack.ws.ledger_url)


def _published(stack, day: int):
    with _ledger(stack) as led:
        return led.published(stack.ws.release, *_iv(day))


def _reservations(stack, day: int) -> list[str]:
    with _ledger(stack) as led:
        runs = {r.run_id for r in led.runs(release=stack.ws.release, interval_start=_iv(day)[0],
                                             interval_end=_iv(day)[1])}
        return [e.run_id for e in led.history(stack.ws.scope) if e.kind == "reserved" and e.run_id in runs]


def _slug(day: int) -> str:
    from dpops.inputs import parse_interval

    return parse_interval(*_iv(day)).slug


def test_1_publish_failure_is_finished_by_the_runbooks_clear_command(ops):
    """Item 6: the runbook's clear command clears record_run too, so the DAG run ends success."""
    dag_id = ops.ws.dag_id
    # The published area of D1 cannot take a version (a stand-in for storage or the ledger being down when
    # publish_release runs): the run is committed but not visible, publish_release fails on every try.
    blocked = ops.ws.specs_dir / "out" / "published" / ops.ws.release / _slug(1) / "v1"
    blocked.parent.mkdir(parents=True)
    blocked.write_text("not a version directory")
    run_id, run = backfill(ops, 1)
    tis = ops.tis(dag_id, run_id)
    assert run["state"] == "failed", tis
    assert tis["publish_release"]["state"] == "failed" and tis["record_run"]["state"] == "upstream_failed"
    blocked.unlink()  # the outage is over
    runbook = (Path(__file__).resolve().parent.parent / "docs" / "runbook.md").read_text()
    assert "airflow tasks clear dpops_example_daily -t publish_release -s D -e D --downstream --yes" in runbook
    airflow_cli(ops.env, "tasks", "clear", dag_id, "-t", "publish_release", "-s", DAY[1], "-e", DAY[1],
                "--downstream", "--yes")
    run = ops.wait_run(dag_id, run_id, min_clear=1)
    tis = ops.tis(dag_id, run_id)
    assert run["state"] == "success", tis
    assert tis["publish_release"]["state"] == "success" and tis["record_run"]["state"] == "success"
    assert _published(ops, 1) is not None and len(_reservations(ops, 1)) == 1  # charged once


def test_2_rest_fills_a_hole_and_restates_with_the_interval_in_conf(ops):
    """Item 5: logical_date null + conf.interval (the one convention); the logical dates already have runs."""
    dag_id = ops.ws.dag_id
    # A run whose logical date is D2 but which covered D1 (the README's former "logical date = interval end"
    # form; D1 is published, so it is served): D2 is now a hole whose logical date is taken.
    code, run_id = trigger(ops, {"logical_date": f"{DAY[2]}T00:00:00Z"})
    assert code in (200, 201), run_id
    assert ops.wait_run(dag_id, run_id)["state"] == "success"
    assert ops.tis(dag_id, run_id)["reserve_budget"]["state"] == "skipped" and _published(ops, 2) is None
    old_fill = {"logical_date": f"{DAY[2]}T00:00:00Z", "data_interval_start": f"{DAY[2]}T00:00:00Z",
                "data_interval_end": f"{DAY[3]}T00:00:00Z"}
    code, text = trigger(ops, old_fill)
    assert code == 409, text
    code, run_id = trigger(ops, {"logical_date": None, "conf": {"interval": DAY[2]}})
    assert code in (200, 201), run_id
    run = ops.wait_run(dag_id, run_id)
    assert run["state"] == "success", ops.tis(dag_id, run_id)
    assert _published(ops, 2) is not None
    # restatement of D1: its logical date is taken by the backfill run above -> 409 with a logical date ...
    from dpops.testing.synthetic import generate_events

    generate_events(str(ops.ws.specs_dir / "data" / "{start:%Y-%m-%d}.parquet"), n_rows=900, n_users=200,
                    n_partitions=4, days=1, seed=99, start=DAY[1])
    old_form = {"logical_date": f"{DAY[1]}T00:00:00Z", "data_interval_start": f"{DAY[1]}T00:00:00Z",
                "data_interval_end": f"{DAY[2]}T00:00:00Z", "conf": {"restate": True}}
    code, text = trigger(ops, old_form)
    assert code == 409, text
    # ... and works with the interval in conf
    first = _published(ops, 1)
    code, run_id = trigger(ops, {"logical_date": None, "conf": {"interval": DAY[1], "restate": True}})
    assert code in (200, 201), run_id
    run = ops.wait_run(dag_id, run_id)
    assert run["state"] == "success", ops.tis(dag_id, run_id)
    now = _published(ops, 1)
    assert now.run_id != first.run_id and now.restates == first.run_id
    # a repeat of the fill-a-hole call for a published day is served, nothing charged
    code, run_id = trigger(ops, {"logical_date": None, "conf": {"interval": DAY[2]}})
    assert code in (200, 201), run_id
    assert ops.wait_run(dag_id, run_id)["state"] == "success"
    assert ops.tis(dag_id, run_id)["reserve_budget"]["state"] == "skipped"
    assert len(_reservations(ops, 2)) == 1
    # a named interval that is not a day of the spec fails at once, nothing reserved
    code, run_id = trigger(ops, {"logical_date": None, "conf": {"interval": f"{DAY[3]}T05:00:00Z"}})
    run = ops.wait_run(dag_id, run_id)
    assert run["state"] == "failed" and ops.tis(dag_id, run_id)["wait_for_input"]["try_number"] == 1


def test_3_a_refunded_run_publishes_through_the_next_dag_run(ops):
    """Item 2."""
    spec = str(ops.ws.spec_path)
    dpops(ops, "ledger", "reserve", spec, "--interval", DAY[3])
    out = dpops(ops, "ledger", "recover", "--older-than", "0").stdout
    assert "released" in out, out
    run_id, run = backfill(ops, 3)
    assert run["state"] == "success", ops.tis(ops.ws.dag_id, run_id)
    refunded, fresh = _reservations(ops, 3)
    assert _published(ops, 3).run_id == fresh != refunded
    assert ops.tis(ops.ws.dag_id, run_id)["validate_output"]["try_number"] == 1


def test_4_a_spent_run_fails_at_once_and_is_published_by_a_fresh_attempt(ops):
    """Item 3. The DAG run is the README's REST form of "Releasing a given day" (a backfill here would wait
    for the scheduler to mark test 3's backfill complete; tests 1, 3 and 5 cover the backfill form)."""
    spec = str(ops.ws.spec_path)
    dpops(ops, "ledger", "reserve", spec, "--interval", DAY[4], "--start")
    dpops(ops, "ledger", "recover", "--older-than", "0")
    code, run_id = trigger(ops, {"logical_date": None, "conf": {"interval": DAY[4]}})
    assert code in (200, 201), run_id
    run = ops.wait_run(ops.ws.dag_id, run_id)
    tis = ops.tis(ops.ws.dag_id, run_id)
    assert run["state"] == "failed"
    assert tis["reserve_budget"]["state"] == "failed" and tis["reserve_budget"]["try_number"] == 1  # no retry
    assert "--fresh-attempt --reason" in ops.task_log(ops.ws.dag_id, run_id, "reserve_budget")
    proc = dpops(ops, "release", "run", spec, "--interval", DAY[4], "--publish", "--no-progress", "--fresh-attempt",
                 "--reason", "node lost during compute, ticket OPS-7", "--json")
    doc = json.loads(proc.stdout)
    spent, fresh = _reservations(ops, 4)
    assert doc["state"] == "published" and doc["run_id"] == fresh
    with _ledger(ops) as led:
        assert led.run(spent).state == "spent_unpublished"
        assert led.run(fresh).details["replaces_spent"]["run_id"] == spent


def test_5_refused_then_cap_raised_then_reprocessed(ops):
    """Items 4 and 6: the note is replaced on publish; the refusal manifest still verifies."""
    dag_id = ops.ws.dag_id
    run_id, run = backfill(ops, 5)
    assert run["state"] == "success" and ops.tis(dag_id, run_id)["reserve_budget"]["state"] == "skipped"
    assert run["note"].startswith("REFUSED: ")
    dpops(ops, "ledger", "cap", ops.ws.scope, "--epsilon", "4", "--reason", "privacy board, ticket DP-42")
    run_id2, run = backfill(ops, 5, reprocess="completed")
    assert run_id2 == run_id and run["state"] == "success", ops.tis(dag_id, run_id)
    assert run["note"].startswith("PUBLISHED: run "), run["note"]
    published = _published(ops, 5)
    assert published is not None
    assert (ops.manifests / f"{published.run_id}.refused.json").exists()
    dpops(ops, "manifest", "verify", str(ops.manifests / f"{published.run_id}.refused.json"))
    out = dpops(ops, "manifest", "verify", published.run_id).stdout  # README's form: the published one
    assert f"verified: run {published.run_id}" in out and "skip" not in out, out


def test_6_input_that_never_came_is_named_by_gaps_and_the_report_is_clean(ops):
    """Item 10 (and the report of the whole history: zero FAILED, exit 0)."""
    dag_id = ops.ws.dag_id
    code, run_id = trigger(ops, {"logical_date": None, "conf": {"interval": DAY[6]}})  # no input for D6
    assert code in (200, 201), run_id
    run = ops.wait_run(dag_id, run_id, timeout=180)
    assert run["state"] == "failed" and ops.tis(dag_id, run_id)["wait_for_input"]["state"] == "failed"
    spec = str(ops.ws.spec_path)
    doc = json.loads(dpops(ops, "gaps", spec, "--from", DAY[1], "--to", DAY[7], "--json").stdout)
    assert [(i["interval_start"][:10], i["status"]) for i in doc["items"]] == [(DAY[6], "input_missing")], doc
    assert doc["items"][0]["detail"].startswith("input missing (waited 10 s")
    # nothing about the input's names or content in the record
    (record,) = list((ops.state_dir / "input-waits" / ops.ws.release).glob("*.json"))
    assert "data/" not in record.read_text() and ".parquet" not in record.read_text()
    report = ops.ws.root / "report.html"
    proc = dpops(ops, "report", "--scope", ops.ws.scope, "--out", str(report), "--json", check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["manifests_failed"] == []
    html = report.read_text()
    assert "Fresh attempts after a spent run (1)" in html and "verified (partly)" not in html.split("<h2>Timeline")[1]


# ------------------------------------------------------------------- test 7: the scheduler's backfill across a cap


def _bf_dag_runs(meta_url: str, dag_id: str) -> list[tuple]:
    return pg_exec(meta_url, "SELECT run_id, state, start_date, end_date, clear_number, data_interval_start FROM "
                   "dag_run WHERE dag_id = %s AND run_type = 'backfill' ORDER BY data_interval_start", (dag_id,),
                   fetch=True)


def _bf_wait_runs(stack, dag_id: str, n: int, min_clear: int = 0) -> list[tuple]:
    deadline = time.monotonic() + BF_WAIT_RUNS_S
    rows: list[tuple] = []
    while time.monotonic() < deadline:
        stack.alive()
        rows = _bf_dag_runs(stack.meta_url, dag_id)
        if len(rows) == n and all(r[1] in ("success", "failed") and r[4] >= min_clear for r in rows):
            return rows
        time.sleep(1)
    raise AssertionError(f"backfill runs did not finish in {BF_WAIT_RUNS_S} s: {[(r[0], r[1], r[4]) for r in rows]}")


def _bf_task_durations(meta_url: str, dag_id: str) -> list[tuple]:
    return pg_exec(meta_url, "SELECT task_id, count(*), round(avg(duration)::numeric, 1), "
                   "round(max(duration)::numeric, 1), round(avg(extract(epoch from start_date - queued_dttm))::numeric, "
                   "1) FROM task_instance WHERE dag_id = %s GROUP BY task_id", (dag_id,), fetch=True)


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


def test_7_backfill_through_scheduler_never_exceeds_cap_and_rerun_is_free(ops):
    """The scheduler's backfill of af_backfill (formerly test_backfill.py): two intervals at a time, on the
    PostgreSQL ledger, across a cap that fits 4 of 6; then the same backfill reprocessing completed runs."""
    from dpops.ledger import open_ledger

    ws = ops.backfill_ws
    meta = ops.meta_url
    t0 = time.monotonic()

    def phase(name: str) -> None:
        print(f"[backfill test] {name} at {round(time.monotonic() - t0, 1)} s", flush=True)

    dag_id = ws.dag_id
    airflow_cli(ops.env, "backfill", "create", "--dag-id", dag_id, "--from-date", "2024-01-01",
                "--to-date", f"2024-01-{BF_DAYS:02d}", "--max-active-runs", "2")
    rows = _bf_wait_runs(ops, dag_id, BF_DAYS)
    phase("first backfill finished")
    print("[backfill test] task_id, count, avg s, max s, avg queue s:", _bf_task_durations(meta, dag_id), flush=True)

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
    assert status.total <= BF_CAP * (1 + 1e-9)
    assert len(committed) == int(BF_CAP / BF_EPS)
    assert status.total == pytest.approx(BF_CAP)
    # Each published interval: one committed run, reserved (charged) exactly once.
    starts = [r.key.interval_start for r in committed]
    assert len(set(starts)) == len(starts)
    assert all(reserved_entries[r.run_id] == 1 for r in committed)
    assert sum(reserved_entries.values()) == len(committed)  # refused runs charged nothing
    # Refused intervals: a refusal, not a crash (dags/dpops_dag_factory.py): reserve_budget ends skipped,
    # the DAG run completes; nothing in the ledger, nothing published.
    states = {str(r[5])[:10]: r[1] for r in rows}
    assert set(states.values()) == {"success"}
    skipped = pg_exec(meta, "SELECT count(*) FROM task_instance WHERE dag_id = %s AND task_id = 'reserve_budget' "
                      "AND state = 'skipped'", (dag_id,), fetch=True)[0][0]
    assert skipped == BF_DAYS - len(committed)
    published_days = {s[:10] for s in starts}
    for day, state in states.items():
        if day not in published_days:
            assert not list((ws.specs_dir / "out" / "published" / ws.release).glob(day.replace("-", "") + "*"))
    assert ledger.verify().ok  # the whole ledger: the operations cases' entries too
    digests = _published_digests(ledger, ws.release)
    ledger.close()

    # The same backfill again, reprocessing completed runs: served, nothing charged, nothing changed.
    # once the scheduler has marked the first backfill complete (every 30 s): one is accepted at a time
    create_backfill(ops.env, meta, dag_id, "--from-date", "2024-01-01", "--to-date", f"2024-01-{BF_DAYS:02d}",
                    "--max-active-runs", "2", "--reprocess-behavior", "completed", alive=ops.alive, timeout=60)
    phase("reprocessing backfill created")
    rows2 = _bf_wait_runs(ops, dag_id, BF_DAYS, min_clear=1)
    phase("reprocessing backfill finished")
    assert {str(r[5])[:10]: r[1] for r in rows2} == states

    ledger = open_ledger(ws.ledger_url)
    assert ledger.status(ws.scope).total == pytest.approx(status.total)
    assert len(ledger.runs(release=ws.release)) == len(committed)
    assert sum(1 for e in ledger.history(ws.scope) if e.kind == "reserved") == len(committed)
    assert _published_digests(ledger, ws.release) == digests
    assert ledger.verify().ok
    ledger.close()
