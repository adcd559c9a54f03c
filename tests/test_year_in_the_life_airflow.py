"""Issue 28, "the year in the life, for real": eleven days of one release through real Airflow processes.

One stack for the module (tests/airflow_support.py ``start_stack``): api-server, scheduler, dag-processor and
triggerer, LocalExecutor, a fresh PostgreSQL metadata database. The ledger is PostgreSQL with its three roles,
set up the documented way: deploy/ledger-roles.sql through psql (fresh role names), then ``dpops ledger init
--app-role --reader-role`` and ``ledger scope create`` as the owner (deploy/ledger-init.sh's commands). The
tasks and the operator's ``$S dpops`` commands use the application role, cap changes the owner role, the
api-server (the Privacy budget page and tab) the reader role. Every operator step is the runbook's command.

Days D1..D11 (D11 is yesterday), 0.5 each on a basic-composition scope; the cap starts at 3:

1. scheduled days D9-D11 (the spec's ``catchup: true`` from DPOPS_START_DATE = D9); one compute task is
   SIGKILLed, its retry publishes, charged once (1.5);
2. a backfill D1-D5 across the cap: three published, two refused with a ``REFUSED:`` note (3.0);
3. the owner raises the cap to 5.5; a ``--reprocess-behavior completed`` backfill re-releases the refused days
   under the same run ids, the notes become ``PUBLISHED:`` (4.0);
4. D6's input is withheld: the REST run's wait gives up; the file is delivered, the REST fill publishes and
   settles the failed run (issue 28 item 8) (4.5);
5. D7 is spent (reserved, started, recovered): its REST run fails at once; the CLI fresh attempt publishes, and
   the runbook's REST call settles the failed run (5.5);
6. D2's input is corrected: the REST restatement is refused at the cap; the owner raises it to 7; the REST
   restatement publishes and the refused run's note names it (6.0);
7. the noise key is rotated (runbook "Key rotation": new key, DPOPS_NOISE_KEY_ID, the old key as
   DPOPS_PREVIOUS_NOISE_KEY_FILES, scheduler restarted); clearing D9 serves it across the rotation, no charge;
8. a team GX suite fails D8's validate_output; the team fixes it; the runbook's clear publishes it (6.5).

At the end ``dpops gaps``, ``ledger status``, ``release status``, every manifest's ``verify``, the report (with
the key ring), the budget page, every run's tab, the alerts and Airflow's run states tell one story.
"""

from __future__ import annotations

import airflow_support  # noqa: F401  (environment before airflow)

import json
import os
import re
import secrets
import signal
import subprocess
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from airflow_support import (REPO, VENV_BIN, Stack, airflow_cli, create_backfill, make_workspace, metadata_db, pg_exec,
                             start_airflow, start_stack, stop_process)

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(1500)]

EPS = 0.5
RELEASE, SCOPE = "af_year", "af_year_scope"
TODAY = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
DAYS = 11
DAY = {i: (TODAY - timedelta(days=DAYS + 1 - i)).date().isoformat() for i in range(1, DAYS + 2)}  # D12 = today
TEAM_SUITE = f"output.{RELEASE}.team"


def _iv(i: int) -> tuple[str, str]:
    return f"{DAY[i]}T00:00:00+00:00", f"{DAY[i + 1]}T00:00:00+00:00"


@dataclass
class Year:
    """The running stack and what the scenario recorded on the way (DAG runs per day, the key files)."""

    stack: Stack
    es: ExitStack
    owner_url: str
    app_url: str
    reader_url: str
    manifests: Path
    state_dir: Path
    alerts: Path
    gx_root: Path
    old_key: Path
    late_input: Path
    withheld: Path
    new_key: Path | None = None
    refused: list[int] = field(default_factory=list)  # the days the backfill across the cap refused
    runs: dict[int, list[str]] = field(default_factory=dict)  # day -> its DAG runs, in order
    killed_day: int | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def note(self, day: int, run_id: str) -> None:
        self.runs.setdefault(day, []).append(run_id)


def _role_sql(postgres_url: str, db: str, tmp: Path, owner: str, app: str, reader: str) -> None:
    """deploy/ledger-roles.sql as deploy/ledger-db-init.sh runs it (passwords from files; trust auth here)."""
    pw = tmp / "pw"
    pw.mkdir(mode=0o700)
    for name in ("owner", "app", "reader"):
        (pw / name).write_text(secrets.token_urlsafe(16))
    base = postgres_url.rsplit("/", 1)[0]
    proc = subprocess.run(
        ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", f"{base}/{db}", "-v", f"owner_role={owner}",
         "-v", f"app_role={app}", "-v", f"reader_role={reader}", "-v", f"owner_password_file={pw / 'owner'}",
         "-v", f"app_password_file={pw / 'app'}", "-v", f"reader_password_file={pw / 'reader'}",
         "-f", str(REPO / "deploy" / "ledger-roles.sql")], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # ... then the database's own cap check, as the superuser (schema version 5: without it the database refuses
    # every app-role reservation); this tree's dpops is what the server imports (it runs on this machine)
    proc = subprocess.run(
        [str(VENV_BIN / "dpops"), "ledger", "--ledger", f"{base}/{db}?schema=dpops", "install-cap-check",
         "--owner-role", owner], capture_output=True, text=True, timeout=120, check=False,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout + proc.stderr


def cli(year: Year, *args: str, owner: bool = False, check: bool = True, **env_over: str) -> subprocess.CompletedProcess:
    """``$S dpops ...`` (the scheduler's environment: application role, key, state and manifests), or ``$OWNER
    dpops ...`` (the ledger owner's URL) with ``owner``."""
    env = {k: v for k, v in year.stack.env.items() if not k.startswith("_")}
    if owner:
        env["DPOPS_LEDGER_URL"] = year.owner_url
    env.update(env_over)
    proc = subprocess.run([str(VENV_BIN / "dpops"), *args], env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, f"dpops {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def cli_here(year: Year, *args: str, **env_over: str) -> str:
    """``cli`` run in this process (``dpops.cli.main.main``, the same entry point): the end-of-story loops run
    tens of read-only checks, and a fresh interpreter per check (imports) costs seconds each on a loaded machine.
    Asserts exit 0 and returns stdout."""
    import io
    from contextlib import redirect_stderr, redirect_stdout
    from unittest import mock

    from dpops.cli.main import main

    env = {k: v for k, v in year.stack.env.items() if not k.startswith("_")}
    env.update(env_over)
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, env), redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    assert code == 0, f"dpops {' '.join(args)} exited {code}:\n{out.getvalue()}\n{err.getvalue()}"
    return out.getvalue()


def trigger(year: Year, day: int, **conf: object) -> str:
    """README "Releasing a given day": REST, ``logical_date: null``, the day in ``conf.interval``."""
    with year.stack.client() as c:
        r = c.post(f"/dags/dpops_{RELEASE}/dagRuns", json={"logical_date": None, "conf": {"interval": DAY[day], **conf}})
    assert r.status_code in (200, 201), r.text
    run_id = r.json()["dag_run_id"]
    year.note(day, run_id)
    return run_id


def wait(year: Year, run_id: str, *, min_clear: int = 0, timeout: float = 300) -> dict:
    return year.stack.wait_run(f"dpops_{RELEASE}", run_id, timeout=timeout, min_clear=min_clear)


def backfill(year: Year, first: int, last: int, *extra: str) -> dict[int, dict]:
    """The runbook's ``airflow backfill create`` of D<first>..D<last> (retried while the scheduler still closes an
    earlier backfill); waits for every run of it and returns them by day."""
    dag_id = f"dpops_{RELEASE}"
    meta = year.stack.meta_url
    before = pg_exec(meta, "SELECT coalesce(max(id), 0) FROM backfill WHERE dag_id = %s", (dag_id,), fetch=True)[0][0]
    # once the scheduler has closed the earlier backfill (Airflow 3.3 does on a 30 s loop)
    create_backfill(year.stack.env, meta, dag_id, "--from-date", DAY[first], "--to-date", DAY[last], *extra,
                    alive=year.stack.alive, timeout=90)
    (bid,) = pg_exec(meta, "SELECT id FROM backfill WHERE dag_id = %s AND id > %s", (dag_id, before), fetch=True)[0]
    rows = pg_exec(meta, "SELECT run_id, logical_date, clear_number FROM dag_run WHERE backfill_id = %s", (bid,),
                   fetch=True)
    out = {}
    for run_id, logical, clear in rows:
        day = next(i for i, d in DAY.items() if d == logical.date().isoformat())
        if run_id not in year.runs.get(day, []):
            year.note(day, run_id)
        out[day] = wait(year, run_id, min_clear=clear)
    assert sorted(out) == list(range(first, last + 1)), out
    return out


def tis(year: Year, run_id: str) -> dict[str, dict]:
    return year.stack.tis(f"dpops_{RELEASE}", run_id)


def ledger(year: Year):
    from dpops.ledger import open_ledger

    return open_ledger(year.app_url)


def reservations(year: Year, day: int) -> list[str]:
    with ledger(year) as led:
        ids = {r.run_id for r in led.runs(release=RELEASE, interval_start=_iv(day)[0], interval_end=_iv(day)[1])}
        return [e.run_id for e in led.history(SCOPE) if e.kind == "reserved" and e.run_id in ids]


def published(year: Year, day: int):
    with ledger(year) as led:
        return led.published(RELEASE, *_iv(day))


def total(year: Year) -> float:
    with ledger(year) as led:
        return float(led.status(SCOPE).total)


@pytest.fixture(scope="module")
def year(tmp_path_factory, postgres_url):
    from dpops.testing.synthetic import generate_events

    t0 = time.monotonic()
    tmp = tmp_path_factory.mktemp("year_af")
    tag = secrets.token_hex(4)
    owner, app, reader = f"dpops_ledger_owner_{tag}", f"dpops_app_{tag}", f"dpops_reader_{tag}"
    ledger_db = f"year_ledger_{tag}"
    base = postgres_url.rsplit("/", 1)[0]
    urls = {r: f"{base.replace('postgres@', f'{r}@')}/{ledger_db}?schema=dpops" for r in (owner, app, reader)}
    pg_exec(postgres_url, f'CREATE DATABASE "{ledger_db}"')
    try:
        with metadata_db(postgres_url, "year_meta") as meta_url, ExitStack() as es:
            _role_sql(postgres_url, ledger_db, tmp, owner, app, reader)
            ws = make_workspace(tmp / "ws", ledger_url=urls[app], release=RELEASE, scope=SCOPE, days=DAYS,
                                start=DAY[1], epsilon_per_run=EPS, scope_cap=None, rows_per_day=400)
            # The scheduler releases every day since DPOPS_START_DATE itself (the runbook's catchup for a release).
            ws.spec_path.write_text(ws.spec_path.read_text() + "catchup: true\n")
            generate_events(str(ws.specs_dir / "data" / "{start:%Y-%m-%d}.parquet"), n_rows=400, n_users=80,
                            n_partitions=4, days=DAYS, seed=7, start=DAY[1])
            withheld = ws.specs_dir / "data" / f"{DAY[6]}.parquet"
            withheld.rename(tmp / "late-D6.parquet")  # D6's input is late (step 4)
            manifests, state, gx_root = tmp / "manifests", tmp / "state", tmp / "gx"
            state.mkdir(mode=0o700)
            hooks = tmp / "hooks"
            hooks.mkdir()
            alerts = tmp / "alerts.jsonl"
            (hooks / "year_alert_hook.py").write_text(
                "import json\n\ndef record(payload):\n"
                f"    with open({str(alerts)!r}, 'a') as f:\n        f.write(json.dumps(payload) + '\\n')\n")
            # deploy/ledger-init.sh's commands, as the owner role.
            env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
            env["DPOPS_LEDGER_URL"] = urls[owner]
            for args in (["ledger", "init", "--app-role", app, "--reader-role", reader],
                         ["ledger", "scope", "create", SCOPE, "--unit", "a synthetic user's events on one day",
                          "--unit-column", "user_id", "--adjacency", "add_remove", "--epsilon", "3", "--delta", "0",
                          "--accountant", "basic", "--actor", "ledger-init"]):
                proc = subprocess.run([str(VENV_BIN / "dpops"), *args], env=env, capture_output=True, text=True,
                                      timeout=120, check=False)
                assert proc.returncode == 0, proc.stdout + proc.stderr
            stack = start_stack(
                es, tmp, meta_url, ws, triggerer=True,
                api_env={"DPOPS_LEDGER_URL": urls[reader]},  # the page reads the ledger as the reader role only
                AIRFLOW__CORE__PLUGINS_FOLDER=str(REPO / "plugins"),
                DPOPS_START_DATE=DAY[9],
                DPOPS_TASK_RETRIES="1",
                DPOPS_STATE_DIR=str(state),
                DPOPS_MANIFESTS_DIR=str(manifests),
                DPOPS_ALERT_HOOK="year_alert_hook:record",
                PYTHONPATH=f"{hooks}{os.pathsep}{REPO}",
                # See tests/test_airflow_operations.py: a timeout shorter than one poke (apache/airflow#71172).
                DPOPS_INPUT_POKE_SECONDS="12",
                DPOPS_INPUT_TIMEOUT_SECONDS="10",
            )
            y = Year(stack, es, urls[owner], urls[app], urls[reader], manifests, state, alerts, gx_root, ws.key_path,
                     late_input=tmp / "late-D6.parquet", withheld=withheld)
            y.timings["stack up"] = round(time.monotonic() - t0, 1)
            yield y
            print(f"[year in the life, Airflow] timings (s since start): {y.timings}", flush=True)
    finally:
        pg_exec(postgres_url, f'DROP DATABASE IF EXISTS "{ledger_db}" WITH (FORCE)')
        for role in (app, reader, owner):
            pg_exec(postgres_url, f'DROP ROLE IF EXISTS "{role}"')


def _mark(year: Year, what: str, t0: float) -> None:
    year.timings[what] = round(time.monotonic() - t0, 1)


T0 = time.monotonic()


def test_1_scheduled_days_and_a_killed_compute_task(year):
    """The scheduler's own runs of D9-D11; the first compute task seen running is SIGKILLed (its process group,
    as the OOM killer or a lost node would); its retry publishes under the same ledger run, charged once."""
    dag_id = f"dpops_{RELEASE}"
    meta = year.stack.meta_url
    deadline = time.monotonic() + 240
    killed = None
    while killed is None:
        assert time.monotonic() < deadline, "no compute task of a scheduled run was seen running"
        year.stack.alive()
        rows = pg_exec(meta, "SELECT run_id, pid, state FROM task_instance WHERE dag_id = %s AND task_id = "
                             "'compute_release' AND state = 'running' AND pid IS NOT NULL", (dag_id,), fetch=True)
        for run_id, pid, _ in rows:
            try:
                os.killpg(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed = run_id
            break
        time.sleep(0.2)
    deadline = time.monotonic() + 120
    while len(runs := pg_exec(meta, "SELECT run_id, logical_date FROM dag_run WHERE dag_id = %s AND run_type = "
                                    "'scheduled' ORDER BY logical_date", (dag_id,), fetch=True)) < 3:
        assert time.monotonic() < deadline, runs
        time.sleep(1)
    assert [r[1].date().isoformat() for r in runs] == [DAY[9], DAY[10], DAY[11]]
    for (run_id, logical), day in zip(runs, (9, 10, 11)):
        year.note(day, run_id)
        assert wait(year, run_id)["state"] == "success", tis(year, run_id)
        assert len(reservations(year, day)) == 1 and published(year, day) is not None  # charged once
        if run_id == killed:
            year.killed_day = day
            assert tis(year, run_id)["compute_release"]["try_number"] == 2
    assert year.killed_day is not None
    assert total(year) == pytest.approx(1.5)
    _mark(year, "1 scheduled", T0)


def test_2_a_backfill_across_the_cap_refuses_what_does_not_fit(year):
    runs = backfill(year, 1, 5, "--max-active-runs", "2")
    refused = [d for d, r in runs.items() if (r.get("note") or "").startswith("REFUSED: ")]
    assert len(refused) == 2 and all(runs[d]["state"] == "success" for d in runs), runs
    for d in refused:
        assert tis(year, year.runs[d][-1])["reserve_budget"]["state"] == "skipped"
        assert published(year, d) is None and reservations(year, d) == []
    year.refused = refused
    assert total(year) == pytest.approx(3.0)
    _mark(year, "2 backfill", T0)


def test_3_the_owner_raises_the_cap_and_the_refused_days_are_re_released(year):
    """Runbook "Raising a cap" (the owner role; the application role is refused), then the backfill of the refused
    days with ``--reprocess-behavior completed``: same DAG runs, the notes become ``PUBLISHED:``."""
    app_try = cli(year, "ledger", "cap", SCOPE, "--epsilon", "50", "--reason", "not mine", check=False)
    assert app_try.returncode == 3 and "may change caps" in app_try.stderr + app_try.stdout
    cli(year, "ledger", "cap", SCOPE, "--epsilon", "5.5", "--reason", "approved by the privacy board, ticket DP-42",
        "--actor", "alice", owner=True)
    before = {d: list(year.runs[d]) for d in range(1, 6)}
    runs = backfill(year, 1, 5, "--reprocess-behavior", "completed")
    for d in range(1, 6):
        assert year.runs[d] == before[d], "a reprocess reuses the day's DAG run"
        assert runs[d]["state"] == "success" and published(year, d) is not None and len(reservations(year, d)) == 1
    for d in year.refused:
        assert runs[d]["note"].startswith("PUBLISHED: run "), runs[d]["note"]
    assert total(year) == pytest.approx(4.0)
    _mark(year, "3 cap raise", T0)


def test_4_a_withheld_input_then_delivered_and_filled(year):
    first = trigger(year, 6)
    assert wait(year, first, timeout=180)["state"] == "failed"
    assert tis(year, first)["wait_for_input"]["state"] == "failed"
    spec = str(year.stack.ws.spec_path)
    doc = json.loads(cli(year, "gaps", spec, "--from", DAY[1], "--to", DAY[12], "--json").stdout)
    assert [(i["interval_start"][:10], i["status"]) for i in doc["items"]] == [
        (DAY[6], "input_missing"), (DAY[7], "never_run"), (DAY[8], "never_run")], doc
    year.late_input.rename(year.withheld)  # the files arrive
    fill = trigger(year, 6)
    assert wait(year, fill)["state"] == "success" and published(year, 6) is not None
    # Issue 28 item 8: the run that gave up waiting is settled by the fill.
    run = wait(year, first)
    assert run["state"] == "success", run
    assert run["note"].startswith("PUBLISHED: the interval was published by ledger run "
                                  f"{published(year, 6).run_id}, DAG run {fill}"), run["note"]
    assert tis(year, first)["wait_for_input"]["state"] == "failed", "the failure stays on record"
    assert total(year) == pytest.approx(4.5)
    _mark(year, "4 withheld input", T0)


def test_5_a_spent_run_and_its_fresh_attempt(year):
    """Runbook "Recover": started -> spent_unpublished; the DAG run fails at once; the fresh attempt from the CLI;
    then the REST call of "Earlier runs of a day that is now published" settles the failed run."""
    spec = str(year.stack.ws.spec_path)
    cli(year, "ledger", "reserve", spec, "--interval", DAY[7], "--start")
    cli(year, "ledger", "recover", "--older-than", "0")
    failed = trigger(year, 7)
    assert wait(year, failed)["state"] == "failed"
    assert tis(year, failed)["reserve_budget"]["try_number"] == 1
    doc = json.loads(cli(year, "release", "run", spec, "--interval", DAY[7], "--publish", "--no-progress",
                         "--fresh-attempt", "--reason", "node lost during compute, ticket OPS-7", "--json").stdout)
    assert doc["state"] == "published"
    assert wait(year, failed)["state"] == "failed", "a CLI fill is not seen by Airflow until the runbook's call"
    served = trigger(year, 7)
    assert wait(year, served)["state"] == "success"
    assert tis(year, served)["reserve_budget"]["state"] == "skipped"  # served: nothing computed or charged
    run = wait(year, failed)
    assert run["state"] == "success" and run["note"].startswith(
        f"PUBLISHED: the interval was published by ledger run {doc['run_id']} at "), run
    assert len(reservations(year, 7)) == 2 and total(year) == pytest.approx(5.5)
    _mark(year, "5 spent + fresh", T0)


def test_6_a_rest_restatement_refused_at_the_cap_then_released(year):
    from dpops.testing.synthetic import generate_events

    generate_events(str(year.stack.ws.specs_dir / "data" / "{start:%Y-%m-%d}.parquet"), n_rows=420, n_users=80,
                    n_partitions=4, days=1, seed=99, start=DAY[2])  # the corrected input
    old = published(year, 2)
    refused = trigger(year, 2, restate=True)
    run = wait(year, refused)
    assert run["state"] == "success" and run["note"].startswith("REFUSED: "), run
    cli(year, "ledger", "cap", SCOPE, "--epsilon", "7", "--reason", "restatement of D2 approved, ticket DP-43",
        "--actor", "alice", owner=True)
    restated = trigger(year, 2, restate=True)
    assert wait(year, restated)["state"] == "success"
    new = published(year, 2)
    assert new.run_id != old.run_id and new.restates == old.run_id
    run = wait(year, refused)
    assert run["note"].startswith(f"PUBLISHED: the interval was published by ledger run {new.run_id}, DAG run "
                                  f"{restated}") and "this run was refused then: " in run["note"], run["note"]
    assert total(year) == pytest.approx(6.0)
    _mark(year, "6 restatement", T0)


def _restart_scheduler(year: Year, **env: str) -> None:
    """Runbook "Key rotation" step 3: recreate the scheduler with its new environment (only it holds the key)."""
    stack = year.stack
    sched = stack.procs[1]
    stop_process(sched)
    stack.env.update(env)
    stack.procs[1] = start_airflow(stack.env, stack.home, year.es, "scheduler")


def test_7_a_key_rotation_and_a_reprocess_after_it(year):
    """Runbook "Key rotation", then clearing a day published under the old key: served, nothing charged."""
    new_key = year.stack.ws.root / "noise_key.new"
    cli(year, "key", "generate", str(new_key))
    new_id = cli(year, "key", "id", str(new_key)).stdout.strip().split()[-1]
    assert cli(year, "ledger", "runs", "--state", "reserved").stdout.count(RELEASE) == 0
    assert cli(year, "ledger", "runs", "--state", "started").stdout.count(RELEASE) == 0
    _restart_scheduler(year, DPOPS_NOISE_KEY_FILE=str(new_key), DPOPS_NOISE_KEY_ID=new_id,
                       DPOPS_PREVIOUS_NOISE_KEY_FILES=str(year.old_key), DPOPS_GX_PROJECT=str(year.gx_root))
    year.new_key = new_key
    assert new_id in cli(year, "key", "id", str(new_key)).stdout
    run_id = year.runs[9][0]
    airflow_cli(year.stack.env, "tasks", "clear", f"dpops_{RELEASE}", "-s", DAY[9], "-e", DAY[9], "--yes")
    run = wait(year, run_id, min_clear=1)
    assert run["state"] == "success" and tis(year, run_id)["reserve_budget"]["state"] == "skipped", tis(year, run_id)
    assert len(reservations(year, 9)) == 1 and total(year) == pytest.approx(6.0)
    _mark(year, "7 rotation", T0)


def _team_suite(year: Year, **bounds: float) -> None:
    import great_expectations as gx
    import great_expectations.expectations as gxe

    from dpops.gx_project import open_project

    ctx = open_project(year.gx_root)
    ctx.suites.add_or_update(gx.ExpectationSuite(name=TEAM_SUITE, expectations=[
        gxe.ExpectColumnValuesToBeBetween(column="count", **bounds)]))


def test_8_a_failing_team_suite_then_fixed_and_cleared(year):
    """Runbook "A failed output validation": validate_output fails naming the suite, the run stays started, the
    team fixes the suite, the runbook's clear with --downstream publishes it, charged once."""
    _team_suite(year, max_value=-1)  # impossible: every count is >= 0
    runs = backfill(year, 8, 8)
    run_id = year.runs[8][0]
    assert runs[8]["state"] == "failed"
    assert tis(year, run_id)["validate_output"]["state"] == "failed"
    assert TEAM_SUITE in year.stack.task_log(f"dpops_{RELEASE}", run_id, "validate_output")
    with ledger(year) as led:
        assert [led.run(r).state for r in reservations(year, 8)] == ["started"]
    _team_suite(year, min_value=0)
    runbook = (REPO / "docs" / "runbook.md").read_text()
    assert "airflow tasks clear DAG_ID -t validate_output -s D -e D\n   --downstream --yes" in runbook
    airflow_cli(year.stack.env, "tasks", "clear", f"dpops_{RELEASE}", "-t", "validate_output", "-s", DAY[8],
                "-e", DAY[8], "--downstream", "--yes")
    run = wait(year, run_id, min_clear=1)
    assert run["state"] == "success", tis(year, run_id)
    assert len(reservations(year, 8)) == 1 and total(year) == pytest.approx(6.5)
    _mark(year, "8 team suite", T0)


def _page(year: Year, path: str) -> str:
    import httpx

    r = httpx.get(f"http://127.0.0.1:{year.stack.port}{path}",
                  headers={"Authorization": f"Bearer {year.stack.token()}"}, timeout=60)
    assert r.status_code == 200, (path, r.status_code, r.text[:2000])
    return r.text


def test_9_every_view_tells_the_same_story(year):
    spec = str(year.stack.ws.spec_path)
    keys = {"DPOPS_PREVIOUS_NOISE_KEY_FILES": str(year.old_key)}
    # dpops gaps: every day published.
    doc = json.loads(cli(year, "gaps", spec, "--from", DAY[1], "--to", DAY[12], "--json", "--check").stdout)
    assert doc["items"] == [], doc
    # ledger status: 12 publications (11 days + 1 restatement) and one spent run, at 0.5 each.
    status = json.loads(cli(year, "ledger", "status", SCOPE, "--json").stdout)
    assert status["committed"] == pytest.approx(6.0) and status["spent_unpublished"] == pytest.approx(0.5)
    assert status["total"] == pytest.approx(6.5) and status["cap"] == pytest.approx(7.0)
    assert status["reserved"] == 0 and status["started"] == 0
    cli(year, "ledger", "verify")
    with ledger(year) as led:
        committed = led.runs(release=RELEASE, states=["committed"])
    assert len(committed) == 12
    # release status of every day, checked with the key ring.
    for d in range(1, DAYS + 1):
        st = json.loads(cli_here(year, "release", "status", spec, "--interval", DAY[d], "--json", **keys))
        assert st["ok"] and st["exit_code"] == 0, st
    # every manifest verifies (published and refusal manifests), with the key ring.
    files = sorted(year.manifests.rglob("*.json"))
    assert len([f for f in files if f.name.endswith(".published.json")]) == 12
    assert len([f for f in files if f.name.endswith(".refused.json")]) == 3
    for f in files:
        out = cli_here(year, "manifest", "verify", str(f), **keys)
        assert "FAILED" not in out, (f, out)
    # The report: no FAILED, the one true warning (the rotation), the ε column = what each run charged.
    report = year.stack.ws.root / "report.html"
    rep = json.loads(cli(year, "report", "--scope", SCOPE, "--out", str(report), "--json", **keys).stdout)
    assert rep["manifests_failed"] == [] and rep["ledger_verified"] and rep["gaps"] == [], rep
    assert len(rep["warnings"]) == 1 and "the noise key changed" in rep["warnings"][0], rep["warnings"]
    html = report.read_text()
    # Provenance: every manifest fully verified (none "with checks that could not run"), every file checked.
    assert re.search(r"data-verified='15' data-partly='0' data-failed='0'", html), html[html.find("provenance"):][:2000]
    files_row = re.search(r"(\d+) match, <span class=''>0 CHANGED</span>, 0 not checked", html)
    assert files_row and int(files_row.group(1)) >= 12, html[html.find("fingerprints"):][:500]
    rows = re.findall(r"<tr data-kind='run' data-run='([0-9a-f]+)'>.*?data-field='state'>([a-z_]+).*?"
                      r"data-field='epsilon'><span data-value='([0-9.e+-]+)'.*?data-field='verification'>([^<]*)<", html)
    # 12 publications, 3 refusals, the spent run (no manifest: it never reached publish).
    assert sorted((st, v) for _, st, _, v in rows) == sorted(
        [("committed", "verified")] * 12 + [("refused", "verified")] * 3 + [("spent_unpublished", "no manifest")]), rows
    # The ε column adds up to what the ledger composed (basic composition: a sum), refusals at 0.
    assert sum(float(e) for _, _, e, _ in rows) == pytest.approx(status["total"]), rows
    assert all(float(e) == 0 for _, st, e, _ in rows if st == "refused")
    # The budget page (reader role) shows the figures of ledger status.
    from dpops.ledger.budget import format_budget

    page = _page(year, "/dpops-budget/")
    row = re.search(rf'<tr data-scope="{SCOPE}">(.*?)</tr>', page, re.S)
    assert row, page[:3000]
    cells = dict(re.findall(r'data-field="([a-z_]+)">([^<]*)<', row.group(1)))
    for f in ("committed", "spent_unpublished", "total", "remaining"):
        assert cells[f] == format_budget(status[f], status["cap"]), (f, cells, status)
    assert "Not shown" not in page
    # Every DAG run: Airflow says success (item 8: no red run for a published day), its note agrees with the
    # ledger, and its tab names the ledger run it worked on.
    with ledger(year) as led:
        for d, run_ids in sorted(year.runs.items()):
            for run_id in run_ids:
                run = wait(year, run_id)
                assert run["state"] == "success", (d, run_id, run)
                note = run.get("note") or ""
                assert not note.startswith("REFUSED: "), (d, run_id, note)
                tab = _page(year, f"/dpops-budget/runs/dpops_{RELEASE}/{run_id}")
                shown = dict(re.findall(r'data-field="([^"]+)">([^<]*)<', tab))
                assert shown.get("interval", "").startswith(_iv(d)[0][:10]), (d, run_id, shown)
                assert shown.get("run") and led.run(shown["run"]) is not None, (d, run_id, tab[:2000])
                assert 'class=bad' not in tab, (d, run_id, tab[:3000])
    # The alerts: every one names its day; the refusals are the three refused runs.
    alerts = [json.loads(line) for line in year.alerts.read_text().splitlines()]
    assert alerts and all(a["interval_start"] for a in alerts), alerts
    refusals = sorted(a["interval_start"][:10] for a in alerts if a["event"] == "dpops.refused")
    assert refusals == sorted([DAY[d] for d in year.refused] + [DAY[2]]), refusals
    failed_days = {a["interval_start"][:10] for a in alerts if a["event"] == "dpops.task_failed"}
    assert {DAY[6], DAY[7], DAY[8]} <= failed_days, alerts
    _mark(year, "9 story", T0)
