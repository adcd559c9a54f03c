"""The release DAGs in real Airflow processes (issue 12 "Airflow-native", "Refusals, logs").

api-server + scheduler + dag-processor (LocalExecutor) against a fresh PostgreSQL metadata database,
runs triggered through the REST API as an operator would:

- a spec that does not load is an import error (``airflow dags list-import-errors``,
  ``/api/v2/importErrors``) naming the file, never its content, while the good spec's DAG runs;
- ``logical_date: null`` fails at once (no retry) with a clear message;
- a past day released by a REST trigger naming it in ``conf.interval`` publishes, records an asset
  event and triggers the consumer DAG scheduled on the release's asset;
- a refused interval ends skipped with a DAG-run note ``REFUSED: ...``, one summary line, a
  ``DPOPS_ALERT`` line and no traceback in its task log;
- the task logs of check_input / validate_output carry no Great Expectations / Beam GCP noise.
"""

from __future__ import annotations

import airflow_support  # noqa: F401  (environment before airflow)

import json
import secrets
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from airflow_support import DAGS_FOLDER, airflow_cli, make_workspace, metadata_db, pg_exec, start_stack

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(900)]

SENTINEL = "SENTINEL-spec-Zq81xW"
CONSUMER = "af_stack_consumer"
# A DAG whose one task writes which modules its process has loaded before it imports anything itself: the probe of
# the preload's premise (every LocalExecutor task is a fork of the scheduler, which imported them).
PROBE = "af_stack_preload_probe"
SETTINGS = Path(__file__).resolve().parent.parent / "deploy" / "airflow_config" / "airflow_local_settings.py"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, postgres_url):
    tmp = tmp_path_factory.mktemp("af_stack")
    ws = make_workspace(tmp / "ws", release="af_stack", scope="af_stack_scope", days=4, scope_cap=1.1)
    # A spec that does not load, with a value that must never be repeated in any error text.
    (ws.specs_dir / "af_bad.yaml").write_text(f"name: af_bad\nnote: [{SENTINEL}, {{\n  x: : {SENTINEL}\n")
    (ws.specs_dir / "af_bad2.yaml").write_text(f"name: af_bad2\nsecret_note: {SENTINEL}\n")
    dags = tmp / "dags"
    dags.mkdir()
    for f in DAGS_FOLDER.glob("*.py"):
        (dags / f.name).symlink_to(f)
    (dags / f"{CONSUMER}.py").write_text(
        "from airflow.sdk import DAG, Asset\n"
        "from airflow.providers.standard.operators.empty import EmptyOperator\n"
        f"with DAG('{CONSUMER}', schedule=[Asset(name='dpops_af_stack', uri='dpops://releases/af_stack')]):\n"
        "    EmptyOperator(task_id='read_release')\n")
    (dags / f"{PROBE}.py").write_text(
        "import json, os, sys\n"
        "from airflow.sdk import DAG, task\n"
        f"with DAG('{PROBE}', schedule=None):\n"
        "    @task\n"
        "    def loaded():\n"
        "        ancestors, pid = [], os.getpid()\n"
        "        while pid > 1:\n"
        "            with open(f'/proc/{pid}/stat') as f:\n"
        "                pid = int(f.read().rsplit(')', 1)[1].split()[1])\n"
        "            ancestors.append(pid)\n"
        f"        with open({str(tmp / 'probe.json')!r}, 'w') as f:\n"
        "            json.dump({'modules': sorted(sys.modules), 'ancestors': ancestors}, f)\n"
        "    loaded()\n")
    with metadata_db(postgres_url, "airflow_dag") as meta_url, ExitStack() as es:
        yield start_stack(
            es, tmp, meta_url, ws, dags_folder=dags, more_dags=(CONSUMER, PROBE),
            DPOPS_TASK_RETRIES="2",
            # The scheduler's own run of the latest real interval has no input: it gives up after 20 s.
            DPOPS_INPUT_POKE_SECONDS="5",
            DPOPS_INPUT_TIMEOUT_SECONDS="20",
        )


def test_bad_spec_is_an_import_error_in_cli_and_rest_while_the_good_dag_runs(stack):
    proc = airflow_cli(stack.env, "dags", "list-import-errors", "--output", "json", check=False)
    assert proc.returncode == 1  # the CLI's exit code says there are import errors
    out = proc.stdout
    errors = json.loads(out[out.index("[{"):])
    (err,) = errors
    assert err["filepath"].endswith("dpops_spec_errors.py")
    assert "2 release spec(s) could not be loaded" in err["error"]
    bad_lines = [ln for ln in err["error"].splitlines() if ln.startswith("- ")]
    assert [Path(ln[2:].split(":")[0]).name for ln in bad_lines] == ["af_bad.yaml", "af_bad2.yaml"]
    with stack.client() as c:
        rest = c.get("/importErrors").json()["import_errors"]
        dags = {d["dag_id"] for d in c.get("/dags").json()["dags"]}
    assert len(rest) == 1 and "af_bad.yaml" in rest[0]["stack_trace"] and "af_bad2.yaml" in rest[0]["stack_trace"]
    assert stack.ws.dag_id in dags  # the good release is not hidden by the bad one
    for text in (out, json.dumps(rest)):
        assert SENTINEL not in text


def test_rest_run_without_logical_date_fails_at_once(stack):
    dag_id = stack.ws.dag_id
    t0 = time.monotonic()
    with stack.client() as c:
        r = c.post(f"/dags/{dag_id}/dagRuns", json={"logical_date": None})
        assert r.status_code in (200, 201), r.text
        run_id = r.json()["dag_run_id"]
    run = stack.wait_run(dag_id, run_id, timeout=180)
    elapsed = time.monotonic() - t0
    print(f"[dag stack] logical_date null: run {run['state']} after {elapsed:.0f} s", flush=True)
    assert run["state"] == "failed"
    tis = stack.tis(dag_id, run_id)
    assert tis["wait_for_input"]["state"] == "failed" and tis["wait_for_input"]["try_number"] == 1
    log = stack.task_log(dag_id, run_id, "wait_for_input")
    assert "has no data interval" in log and "KeyError" not in log


def test_cli_trigger_with_a_past_logical_date_is_refused_not_released_for_today(stack):
    """`airflow dags trigger -l D` gives the run the interval of the trigger time, not of D: refused at once."""
    dag_id = stack.ws.dag_id
    run_id = f"cli_{secrets.token_hex(3)}"
    airflow_cli(stack.env, "dags", "trigger", dag_id, "-l", "2024-01-10T00:00:00+00:00", "--run-id", run_id)
    run = stack.wait_run(dag_id, run_id, timeout=180)
    assert run["state"] == "failed" and not run["data_interval_start"].startswith("2024-01-0")
    tis = stack.tis(dag_id, run_id)
    assert tis["wait_for_input"]["state"] == "failed" and tis["wait_for_input"]["try_number"] == 1
    log = stack.task_log(dag_id, run_id, "wait_for_input")
    assert "names the logical date 2024-01-10T00:00:00+00:00" in log
    assert f"airflow backfill create --dag-id {dag_id} --from-date D --to-date D" in log


def test_backfill_of_one_past_day_releases_that_day(stack):
    """The README's CLI call for one past day: the run's interval starts on that day."""
    from dpops.ledger import open_ledger

    dag_id = stack.ws.dag_id
    airflow_cli(stack.env, "backfill", "create", "--dag-id", dag_id, "--from-date", "2024-01-03",
                "--to-date", "2024-01-03")
    deadline = time.monotonic() + 300
    rows: list = []
    while time.monotonic() < deadline:
        stack.alive()
        rows = pg_exec(stack.meta_url, "SELECT run_id, state, data_interval_start FROM dag_run WHERE dag_id = %s "
                       "AND run_type = 'backfill'", (dag_id,), fetch=True)
        if rows and rows[0][1] in ("success", "failed"):
            break
        time.sleep(1)
    (run_id, state, start), = rows
    assert state == "success" and start.isoformat().startswith("2024-01-03T00:00:00")
    ledger = open_ledger(stack.ws.ledger_url)
    tis = stack.tis(dag_id, run_id)
    assert tis["publish_release"]["state"] == "success"
    assert ledger.published(stack.ws.release, "2024-01-03T00:00:00+00:00", "2024-01-04T00:00:00+00:00")


def test_past_day_publishes_emits_asset_event_and_triggers_the_consumer(stack):
    dag_id = stack.ws.dag_id
    with stack.client() as c:
        # README "Releasing a given day": no logical date, the day (its start) in conf.interval.
        r = c.post(f"/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": {"interval": "2024-01-01"}})
        assert r.status_code in (200, 201), r.text
        run_id = r.json()["dag_run_id"]
    run = stack.wait_run(dag_id, run_id)
    assert run["state"] == "success", stack.tis(dag_id, run_id)
    assert stack.tis(dag_id, run_id)["publish_release"]["state"] == "success"

    with stack.client() as c:
        events = c.get("/assets/events", params={"source_dag_id": dag_id}).json()["asset_events"]
        published = [r.key.interval_start for r in __import__("dpops.ledger", fromlist=["open_ledger"])
                     .open_ledger(stack.ws.ledger_url).runs(release=stack.ws.release, states=["committed"])]
        assert sorted(e["extra"]["interval_start"] for e in events) == sorted(published)
        assert "2024-01-01T00:00:00+00:00" in published
        assert {e["uri"] for e in events} == {"dpops://releases/af_stack"}
        deadline = time.monotonic() + 120
        consumer_runs: list = []
        while time.monotonic() < deadline and not consumer_runs:
            consumer_runs = c.get(f"/dags/{CONSUMER}/dagRuns").json()["dag_runs"]
            time.sleep(1)
    assert consumer_runs and consumer_runs[0]["run_type"] == "asset_triggered"

    # Task logs: one summary line; no Great Expectations INFO or Beam GCP-client noise (issue 12, logs).
    counts = {}
    for task_id in ("wait_for_input", "check_input", "reserve_budget", "compute_release", "validate_output",
                    "publish_release", "record_run"):
        lines = stack.task_log(dag_id, run_id, task_id).splitlines()
        counts[task_id] = len(lines)
        loggers = [json.loads(ln).get("logger", "") if ln.startswith("{") else "(raw)" for ln in lines]
        print(f"[dag stack] {task_id}: {len(lines)} lines, loggers {sorted(set(loggers))}", flush=True)
        noise = [ln for ln, lg in zip(lines, loggers) if lg.startswith(("great_expectations", "apache_beam.io.gcp",
                                                                        "apitools")) or "bigquery" in ln.lower()]
        assert not noise, (task_id, noise[:5])
    print(f"[dag stack] task log lines: {counts}", flush=True)
    assert counts["check_input"] <= 40 and counts["validate_output"] <= 40
    record = stack.task_log(dag_id, run_id, "record_run")
    assert sum("dpops release=af_stack " in ln for ln in record.splitlines()) == 1


def test_refused_interval_is_skipped_with_note_summary_and_alert(stack):
    dag_id = stack.ws.dag_id
    # The cap (1.1) fits two runs of 0.5: [Jan 3, Jan 4) by the backfill test, [Jan 1, Jan 2) here (served
    # if the test above published it); then [Jan 4, Jan 5) is refused. (A backfill run's logical date is its
    # interval start, a REST run has no logical date and names its day in conf.interval.)
    with stack.client() as c:
        r = c.post(f"/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": {"interval": "2024-01-01"}})
        assert r.status_code in (200, 201), r.text
        first = r.json()["dag_run_id"]
    stack.wait_run(dag_id, first)
    with stack.client() as c:
        r = c.post(f"/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": {"interval": "2024-01-04"}})
        assert r.status_code in (200, 201), r.text
        run_id = r.json()["dag_run_id"]
    run = stack.wait_run(dag_id, run_id)
    tis = stack.tis(dag_id, run_id)
    assert "2024-01-04T00:00:00+00:00/2024-01-05T00:00:00+00:00" in run["note"]
    assert tis["reserve_budget"]["state"] == "skipped" and tis["reserve_budget"]["try_number"] == 1
    assert tis["publish_release"]["state"] == "skipped"
    assert run["note"] and run["note"].startswith("REFUSED: budget refused for af_stack")
    assert "scope 'af_stack_scope' has epsilon 0.1 left" in run["note"]
    log = stack.task_log(dag_id, run_id, "reserve_budget")
    assert "Traceback" not in log
    assert sum("dpops release=af_stack " in ln and "outcome=refused" in ln for ln in log.splitlines()) == 1
    assert sum("DPOPS_ALERT" in ln and "dpops.refused" in ln for ln in log.splitlines()) == 1
    # An operator finds refusals through the API: the note is on the run.
    with stack.client() as c:
        runs_ = c.get(f"/dags/{dag_id}/dagRuns").json()["dag_runs"]
    assert [r["dag_run_id"] for r in runs_ if (r.get("note") or "").startswith("REFUSED")] == [run_id]


def _mapped_files(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps", encoding="utf-8") as fh:
        return {line.split(maxsplit=5)[5].strip() for line in fh if len(line.split(maxsplit=5)) == 6}


def test_the_scheduler_preloads_the_task_code_and_the_api_server_does_not(stack):
    """deploy/airflow_config/airflow_local_settings.py: the scheduler (which every LocalExecutor task is forked
    from) has Beam's compiled modules loaded; the api-server and the dag-processor do not pay for them."""
    api, scheduler, dag_processor = stack.procs
    beam = "/apache_beam/"
    assert any(beam in f for f in _mapped_files(scheduler.pid)), "the scheduler did not preload apache_beam"
    assert not any(beam in f for f in _mapped_files(api.pid))
    assert not any(beam in f for f in _mapped_files(dag_processor.pid))


def test_a_task_process_starts_with_the_preloaded_modules_loaded(stack):
    """The premise of the preload: a LocalExecutor task is forked (not a fresh interpreter) from a worker forked from
    the scheduler, so what the scheduler imported is loaded in the task before it imports anything. Airflow 3.3 on
    Linux: the executor's workers are ``multiprocessing`` processes (``fork`` unless ``mp_start_method`` says
    otherwise, the default before Python 3.14) and the task supervisor uses a bare ``os.fork`` (fork + exec only on
    macOS). A spawned or fork-server task would re-import GX and Beam (5-6 CPU s each task) and fail here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("dpops_test_local_settings", SETTINGS)
    assert spec is not None and spec.loader is not None
    settings = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(settings)  # argv is pytest's: nothing is preloaded here
    with stack.client() as c:
        r = c.post(f"/dags/{PROBE}/dagRuns", json={"logical_date": None})
        assert r.status_code in (200, 201), r.text
        run_id = r.json()["dag_run_id"]
    assert stack.wait_run(PROBE, run_id, timeout=180)["state"] == "success", stack.tis(PROBE, run_id)
    probe = json.loads((stack.home.parent / "probe.json").read_text())
    assert stack.procs[1].pid in probe["ancestors"], probe["ancestors"]  # procs[1]: the scheduler
    missing = [m for m in settings.PRELOAD_MODULES if m not in probe["modules"]]
    assert missing == [], f"the task process had not loaded {missing}"
