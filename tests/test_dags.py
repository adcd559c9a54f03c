"""The Airflow DAGs: import, shape, and (in test_dags_run.py) runs through dag.test()."""

from __future__ import annotations

import airflow_support  # noqa: F401  (sets AIRFLOW_HOME etc. before airflow is imported)

import json
import logging
import shutil
from pathlib import Path

import pytest

from airflow_support import DAGS_FOLDER, REPO, SPEC_TEMPLATE


def _bag(specs_dir: Path, monkeypatch):
    from airflow.dag_processing.dagbag import DagBag

    monkeypatch.setenv("DPOPS_SPECS_DIR", str(specs_dir))
    return DagBag(dag_folder=str(DAGS_FOLDER))


def _spec(tmp: Path, name: str, scope: str = "s1", schedule: str = '"0 0 * * *"') -> Path:
    text = SPEC_TEMPLATE.format(name=name, scope=scope, epsilon=0.5, public="p0, p1")
    text = text.replace('schedule: "0 0 * * *"', f"schedule: {schedule}")
    p = tmp / f"{name}.yaml"
    p.write_text(text)
    return p


def test_dagbag_imports_the_examples_without_errors(monkeypatch):
    bag = _bag(REPO / "examples", monkeypatch)
    assert bag.import_errors == {}
    assert "dpops_daily_purchases" in bag.dag_ids
    assert not bag.captured_warnings


def test_one_dag_per_spec_with_interval_timetable_and_tasks(tmp_path, monkeypatch):
    _spec(tmp_path, "rel_a", "s1")
    _spec(tmp_path, "rel_b", "s2", schedule='"@weekly"')
    bag = _bag(tmp_path, monkeypatch)
    assert bag.import_errors == {}
    assert sorted(bag.dag_ids) == ["dpops_rel_a", "dpops_rel_b"]
    dag = bag.dags["dpops_rel_a"]
    from airflow.sdk import CronDataIntervalTimetable

    assert isinstance(dag.timetable, CronDataIntervalTimetable)
    assert dag.timetable.expression == "0 0 * * *"
    assert bag.dags["dpops_rel_b"].timetable.expression == "0 0 * * 0"
    # A data-interval timetable: a run due at D+1 covers [D, D+1), not a zero-width trigger.
    from datetime import datetime, timezone

    from airflow.serialization.encoders import coerce_to_core_timetable

    iv = coerce_to_core_timetable(dag.timetable).infer_manual_data_interval(
        run_after=datetime(2024, 1, 2, tzinfo=timezone.utc)
    )
    assert (iv.start.isoformat(), iv.end.isoformat()) == ("2024-01-01T00:00:00+00:00", "2024-01-02T00:00:00+00:00")
    assert dag.catchup is False and dag.max_active_runs >= 1
    assert {"dpops", "scope:s1", "release:rel_a"} <= set(dag.tags)
    assert dag.params["restate"] is False
    assert dag.doc_md and "adjacency `add_remove`" in dag.doc_md
    chain = ["wait_for_input", "check_input", "reserve_budget", "compute_release", "validate_output",
             "publish_release", "record_run"]
    assert sorted(dag.task_ids) == sorted(chain)
    # A linear chain: each step strictly after the previous one.
    for up, down in zip(chain, chain[1:]):
        assert down in dag.task_dict[up].downstream_task_ids
    for t in dag.tasks:
        assert t.on_failure_callback, t.task_id
        assert t.owner == "dpops"
    # Late input is waited for by a sensor in reschedule mode (no worker slot held), not by retries.
    sensor = dag.task_dict["wait_for_input"]
    assert sensor.mode == "reschedule" and sensor.retries == 0 and sensor.timeout == 6 * 3600
    # Each publication is an event of the release's asset.
    (outlet,) = dag.task_dict["publish_release"].outlets
    assert outlet.uri == "dpops://releases/rel_a" and outlet.name == "dpops_rel_a"


def test_bad_specs_are_import_errors_without_hiding_good_ones(tmp_path, monkeypatch):
    _spec(tmp_path, "good")
    (tmp_path / "broken.yaml").write_text("name: Not A Valid Name\n")
    (tmp_path / "broken2.yaml").write_text("name: x\n")
    bag = _bag(tmp_path, monkeypatch)
    assert bag.dag_ids == ["dpops_good"]
    (where, err), = bag.import_errors.items()
    assert where.endswith("dpops_spec_errors.py")
    assert "2 release spec(s) could not be loaded" in err and "release name" in err
    lines = [ln for ln in err.splitlines() if ln.startswith("- ")]
    assert [ln.split(":")[0] for ln in lines] == [f"- {tmp_path / 'broken.yaml'}", f"- {tmp_path / 'broken2.yaml'}"]
    assert "input: required key is missing" in lines[1]  # one line per spec, every problem on it


def test_a_bad_spec_is_not_in_other_dags_task_logs(tmp_path):
    """A task parses dpops_releases.py again: it must print nothing about another, bad spec (the bad
    spec is dpops_spec_errors.py's import error, which the previous test checks)."""
    import os
    import subprocess
    import sys

    _spec(tmp_path, "good")
    (tmp_path / "broken.yaml").write_text("name: Not A Valid Name\n")
    code = (
        "import sys, json, logging, runpy, warnings\n"
        "said = []\n"
        "class H(logging.Handler):\n"
        "    def emit(self, r): said.append(r.getMessage())\n"
        "logging.getLogger().addHandler(H()); logging.getLogger().setLevel(logging.WARNING)\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    g = runpy.run_path(sys.argv[1])\n"
        "print(json.dumps({'dags': sorted(k for k in g if k.startswith('dpops_')),\n"
        "                  'said': said + [str(x.message) for x in w]}))\n"
    )
    env = dict(os.environ, DPOPS_SPECS_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code, str(DAGS_FOLDER / "dpops_releases.py")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = __import__("json").loads(proc.stdout.splitlines()[-1])
    assert doc["dags"] == ["dpops_good"]
    assert not [m for m in doc["said"] if "broken" in m or "invalid release spec" in m], doc["said"]
    # Airflow's structlog prints captured warnings itself (stdout or stderr), past the handler above
    printed = "\n".join(proc.stdout.splitlines()[:-1]) + proc.stderr
    assert "broken" not in printed and "invalid release spec" not in printed, printed[-2000:]


def test_only_good_specs_have_no_import_error(tmp_path, monkeypatch):
    _spec(tmp_path, "good")
    bag = _bag(tmp_path, monkeypatch)
    assert bag.import_errors == {} and bag.dag_ids == ["dpops_good"]


def test_dag_module_never_imports_privacy_heavy_modules_at_parse_time(tmp_path, monkeypatch):
    """Parsing must stay cheap and secret-free: no Beam, no GX, no ledger, no key at parse time."""
    import subprocess
    import sys

    _spec(tmp_path, "rel_p")
    code = (
        "import sys, runpy; runpy.run_path(sys.argv[1]);"
        "bad=[m for m in ('apache_beam','great_expectations','dpops.ledger','dpops.release','dpops.noise.randomness') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    env = dict(__import__("os").environ, DPOPS_SPECS_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code, str(DAGS_FOLDER / "dpops_releases.py")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


def test_failure_callback_logs_one_structured_alert_and_calls_the_hook(monkeypatch, caplog, capfd):
    import sys

    sys.path.insert(0, str(DAGS_FOLDER))
    import dpops_alerts

    seen = []
    mod = type(sys)("fake_pager")
    mod.page = seen.append
    monkeypatch.setitem(sys.modules, "fake_pager", mod)
    monkeypatch.setenv("DPOPS_ALERT_HOOK", "fake_pager:page")

    class TI:
        task_id, dag_id, try_number = "reserve_budget", "dpops_x", 1

    from airflow.sdk.exceptions import AirflowFailException

    # what reserve_budget raises on a refusal (dags/dpops_dag_factory.py: _refusal_message)
    ctx = {"ti": TI(), "run_id": "r1", "exception": AirflowFailException("budget refused: scope s left 0.1 asked 0.5"),
           "data_interval_start": None, "data_interval_end": None}
    with caplog.at_level(logging.ERROR, logger="dpops.airflow"):
        dpops_alerts.on_failure(ctx)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("DPOPS_ALERT ")]
    if not lines:  # Airflow's logging config (set by an earlier Airflow import) may route it to the terminal
        out, err = capfd.readouterr()
        lines = ["DPOPS_ALERT " + ln.split("DPOPS_ALERT ", 1)[1].rsplit("} [", 1)[0] + "}"
                 for ln in (out + err).splitlines() if "DPOPS_ALERT {" in ln]
    assert len(lines) == 1
    payload = json.loads(lines[0][len("DPOPS_ALERT "):])
    assert payload["task_id"] == "reserve_budget" and "asked 0.5" in payload["message"]
    assert seen == [payload]
    # A refusal (which ends the task skipped, not failed) alerts too, with its own event name.
    import dpops_alerts as da

    da.refusal_alert({"ti": TI(), "run_id": "r2"}, "budget refused for x: scope s has epsilon 0 left")
    assert seen[-1]["event"] == "dpops.refused" and seen[-1]["message"].startswith("budget refused")
    # A broken hook never masks the failure being reported.
    monkeypatch.setenv("DPOPS_ALERT_HOOK", "no_such_module_xyz:f")
    dpops_alerts.on_failure(ctx)


@pytest.mark.parametrize("deployment", ["false", "true"])
def test_catchup_per_spec_overrides_the_deployment_default(tmp_path, monkeypatch, deployment):
    """Issue 21 item 7: a spec's ``catchup`` wins over ``DPOPS_CATCHUP``; a spec that says nothing follows the
    deployment. The setting is not part of the spec hash (it changes no run)."""
    from dpops.spec import load_spec

    for name, line in (("rel_default", ""), ("rel_yes", "catchup: true\n"), ("rel_no", "catchup: false\n")):
        p = _spec(tmp_path, name)
        p.write_text(line + p.read_text())
    monkeypatch.setenv("DPOPS_CATCHUP", deployment)
    bag = _bag(tmp_path, monkeypatch)
    assert bag.import_errors == {}
    got = {d: bag.dags[d].catchup for d in ("dpops_rel_default", "dpops_rel_yes", "dpops_rel_no")}
    assert got == {"dpops_rel_default": deployment == "true", "dpops_rel_yes": True, "dpops_rel_no": False}
    plain = tmp_path / "plain"
    plain.mkdir()
    base = _spec(plain, "rel_yes")
    assert load_spec(tmp_path / "rel_yes.yaml").spec_hash == load_spec(base).spec_hash
    bad = _spec(plain, "rel_bad")
    bad.write_text("catchup: sometimes\n" + bad.read_text())
    bag = _bag(plain, monkeypatch)
    assert any("catchup" in str(e) for e in bag.import_errors.values()), bag.import_errors


def test_alerts_of_a_rest_triggered_run_name_its_interval(tmp_path):
    """Issue 28 item 5: a run triggered the documented way (REST ``logical_date: null``, ``conf.interval``) has
    no data interval; its alerts carry the day the tasks release (``dpops.run_interval``), not null. A run
    whose interval cannot be resolved keeps Airflow's values and says what it asked for."""
    import sys

    sys.path.insert(0, str(DAGS_FOLDER))
    import dpops_alerts

    from airflow.sdk.exceptions import AirflowFailException

    spec = str(_spec(tmp_path, "rel_alert"))

    class TI:
        task_id, dag_id, try_number = "compute_release", "dpops_rel_alert", 1

    ctx = {"ti": TI(), "run_id": "manual__x", "exception": AirflowFailException("ledger unreachable"),
           "data_interval_start": None, "data_interval_end": None, "logical_date": None,
           "params": {"interval": "2024-01-03", "restate": False}}
    payload = dpops_alerts.alert_payload(ctx, spec)
    assert (payload["interval_start"], payload["interval_end"]) == ("2024-01-03T00:00:00+00:00",
                                                                    "2024-01-04T00:00:00+00:00")
    assert dpops_alerts.alert_payload({**ctx, "params": {"interval": "2024-01-03/2024-01-04"}}, spec)[
        "interval_start"] == "2024-01-03T00:00:00+00:00"
    bad = dpops_alerts.alert_payload({**ctx, "params": {"interval": "not a day"}}, spec)
    assert bad["interval_start"] is None and bad["interval_requested"] == "not a day"
    # the DAG hands its spec to the callback: the factory's callback is the one that knows the day
    seen = []
    import dpops_alerts as da

    orig = da._emit
    try:
        da._emit = seen.append
        da.failure_callback(spec)(ctx)
        da.refusal_alert(ctx, "budget refused", spec)
    finally:
        da._emit = orig
    assert [p["interval_start"] for p in seen] == ["2024-01-03T00:00:00+00:00"] * 2
