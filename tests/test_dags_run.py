"""The release DAG run through Airflow's ``dag.test()`` (SQLite metadata DB, the real pipeline).

Each test has its own release (DAG id), workspace and SQLite ledger.
"""

from __future__ import annotations

import airflow_support  # noqa: F401  (sets AIRFLOW_HOME etc. before airflow is imported)

import json
import logging
import shutil
from datetime import datetime, timezone
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from airflow_support import DAGS_FOLDER, make_workspace, migrate_sqlite_db

pytestmark = pytest.mark.slow


def _day(d: int) -> datetime:
    return datetime(2024, 1, d, tzinfo=timezone.utc)


@pytest.fixture(scope="module", autouse=True)
def _db():
    migrate_sqlite_db()


@pytest.fixture(autouse=True)
def _restore_signal_handlers():
    """In-process dag.test installs Airflow's signal handlers in the pytest process; put ours back so
    later tests (e.g. multiprocessing pools that SIGTERM their workers) see the defaults."""
    import signal

    sigs = [signal.SIGTERM, signal.SIGINT, signal.SIGUSR2]
    saved = {sig: signal.getsignal(sig) for sig in sigs}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def _dag(ws, monkeypatch, retries: int = 0):
    from airflow.dag_processing.dagbag import DagBag

    for k, v in ws.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("DPOPS_TASK_RETRIES", str(retries))
    bag = DagBag(dag_folder=str(DAGS_FOLDER))
    assert bag.import_errors == {}
    return bag.dags[ws.dag_id]


def _run(dag, day_end: int, **kw):
    """dag.test covers the interval ENDING at its logical date: day_end=2 runs [Jan 1, Jan 2)."""
    dr = dag.test(logical_date=_day(day_end), **kw)
    return dr, {ti.task_id: ti for ti in dr.get_task_instances()}


def _ledger(ws):
    from dpops.ledger import open_ledger

    return open_ledger(ws.ledger_url)


def _reservations(ledger, scope: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in ledger.history(scope):
        if e.kind == "reserved":
            counts[e.run_id] = counts.get(e.run_id, 0) + 1
    return counts


def _published_rows(uri: str) -> list[dict]:
    from urllib.parse import urlparse

    return pq.read_table(Path(urlparse(uri).path) / "data.parquet").to_pylist()


def test_one_interval_publishes_commits_and_a_rerun_is_free(tmp_path, monkeypatch):
    ws = make_workspace(tmp_path, release="af_e2e", scope="af_e2e_scope", days=1)
    dag = _dag(ws, monkeypatch)
    dr, tis = _run(dag, 2)
    assert dr.state == "success", {k: t.state for k, t in tis.items()}
    ledger = _ledger(ws)
    (rec,) = ledger.runs(release=ws.release)
    assert rec.state == "committed" and rec.key.interval_start.startswith("2024-01-01T00:00:00")
    assert rec.key.interval_end.startswith("2024-01-02T00:00:00")
    assert rec.output_uri and len(_published_rows(rec.output_uri)) == 4  # every public partition
    total = ledger.status(ws.scope).total
    assert total == pytest.approx(0.5)
    manifests = list((ws.specs_dir / "out" / "manifests" / ws.release).glob("*.published.json"))
    assert [m.name for m in manifests] == [f"{rec.run_id}.published.json"]
    assert json.loads(manifests[0].read_text())["run_id"] == rec.run_id
    # Each task's outcome is one XCom: a task returning a dict pushed every key as an XCom of its own too
    # (Airflow infers multiple outputs from the -> dict annotation), ~90 rows and API calls per run nobody read.
    assert _xcom_keys(ws.dag_id, dr.run_id) == {
        "check_input": ["return_value"], "reserve_budget": ["dpops_outcome", "return_value"],
        "compute_release": ["return_value"], "validate_output": ["return_value"],
        "publish_release": ["return_value"], "record_run": ["return_value"]}

    # A plain re-run of the completed interval serves the published result: no charge, same numbers.
    before = _published_rows(rec.output_uri)
    dr2, tis2 = _run(dag, 2)
    assert dr2.state == "success"
    assert tis2["reserve_budget"].state == "skipped"  # served: nothing computed, published or charged
    assert {tis2[t].state for t in ("compute_release", "validate_output", "publish_release", "record_run")} == {"skipped"}
    assert ledger.status(ws.scope).total == pytest.approx(total)
    assert _reservations(ledger, ws.scope) == {rec.run_id: 1}
    assert _published_rows(ledger.run(rec.run_id).output_uri) == before
    assert ledger.verify().ok


def _xcom_keys(dag_id: str, run_id: str) -> dict[str, list[str]]:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.execute(select(XComModel.task_id, XComModel.key).where(
            XComModel.dag_id == dag_id, XComModel.run_id == run_id)).all()
    out: dict[str, list[str]] = {}
    for task_id, key in rows:
        out.setdefault(task_id, []).append(key)
    return {t: sorted(k) for t, k in out.items()}


def _fail_once_after_manifest(monkeypatch):
    """The one fault-hook mechanism (dpops.testing.faults): ``manifest.after`` fires inside publish, after the noise
    was drawn and staged and the manifest written, before the ledger commit; ``raise`` = a crash a retry heals."""
    from dpops.testing import faults
    from dpops.release import manifests
    from fault_support import _after

    monkeypatch.setattr(faults, "_hits", {})
    monkeypatch.setattr(manifests, "write_manifest_before_publish",
                        _after("manifest.after", manifests.write_manifest_before_publish))
    monkeypatch.setenv("DPOPS_FAULT", "manifest.after=raise")


def test_publish_fault_after_noise_then_retry_publishes_same_numbers_with_one_charge(tmp_path, monkeypatch):
    ws = make_workspace(tmp_path, release="af_fault", scope="af_fault_scope", days=2)

    # 1. In-run Airflow retry: publish fails once after the noise was drawn and staged, the retry publishes.
    dag = _dag(ws, monkeypatch, retries=1)
    _fail_once_after_manifest(monkeypatch)
    dr, tis = _run(dag, 2)
    assert dr.state == "success"
    assert tis["publish_release"].try_number == 2 and tis["compute_release"].try_number == 1
    ledger = _ledger(ws)
    (rec,) = ledger.runs(release=ws.release)
    assert rec.state == "committed" and _reservations(ledger, ws.scope) == {rec.run_id: 1}

    # 2. No retries left: the run fails after the noise was drawn; the staged output is then lost (another
    #    worker, a wiped disk). Re-running recomputes with keyed noise: the very same numbers, one charge.
    dag = _dag(ws, monkeypatch, retries=0)
    _fail_once_after_manifest(monkeypatch)
    dr, tis = _run(dag, 3)
    assert dr.state == "failed" and tis["publish_release"].state == "failed"
    (day2,) = [r for r in ledger.runs(release=ws.release) if r.key.interval_start.startswith("2024-01-02")]
    assert day2.state == "started"  # the charge is final: noise was drawn
    staged_root = ws.specs_dir / "out" / "staged" / ws.release
    (staged,) = [p for p in staged_root.glob(f"*/{day2.run_id}") if p.is_dir()]
    drawn = pq.read_table(staged / "data.parquet").to_pylist()
    shutil.rmtree(staged)
    spent = ledger.status(ws.scope).total

    dr, tis = _run(dag, 3)
    assert dr.state == "success"
    rec2 = ledger.run(day2.run_id)
    assert rec2.state == "committed"
    assert _published_rows(rec2.output_uri) == drawn
    assert ledger.status(ws.scope).total == pytest.approx(spent) == pytest.approx(1.0)
    assert _reservations(ledger, ws.scope) == {rec.run_id: 1, day2.run_id: 1}
    assert ledger.verify().ok


def test_budget_refusal_is_a_refusal_not_a_crash(tmp_path, monkeypatch, capfd, caplog):
    # A cap below one run's cost: the very first interval is refused before any data is touched.
    ws = make_workspace(tmp_path, release="af_refuse", scope="af_refuse_scope", days=1, scope_cap=0.3)
    alerts = tmp_path / "alerts.jsonl"
    hook_mod = tmp_path / "hookmod"
    hook_mod.mkdir()
    (hook_mod / "af_test_hook.py").write_text(
        "import json, os\n"
        "def record(payload):\n"
        f"    open({str(alerts)!r}, 'a').write(json.dumps(payload) + '\\n')\n"
    )
    monkeypatch.syspath_prepend(str(hook_mod))
    monkeypatch.setenv("DPOPS_ALERT_HOOK", "af_test_hook:record")
    dag = _dag(ws, monkeypatch, retries=2)

    capfd.readouterr()
    caplog.set_level(logging.INFO)
    dr, tis = _run(dag, 2)
    out, err = capfd.readouterr()
    records = [r.getMessage() for r in caplog.records]
    # Skipped with its reason, not failed: no retry, no traceback; nothing downstream runs.
    assert tis["reserve_budget"].state == "skipped" and tis["reserve_budget"].try_number == 1
    assert all(tis[t].state == "skipped" for t in ("compute_release", "publish_release", "record_run"))
    assert "Traceback" not in out + err and not any(r.exc_info for r in caplog.records)
    (alert,) = [json.loads(line) for line in alerts.read_text().splitlines()]
    assert alert["task_id"] == "reserve_budget" and alert["event"] == "dpops.refused"
    msg = alert["message"]
    assert "scope 'af_refuse_scope' has epsilon 0.3 left" in msg and "this run asked epsilon 0.5" in msg
    assert "stays unpublished" in msg
    (refused_file,) = (ws.specs_dir / "out" / "manifests" / ws.release).glob("*.refused.json")
    refused_run = refused_file.name[:32]
    # Issue 28 items 2 and 5: the reserve task records the run it refused (the Privacy budget tab reads it), and
    # the alert names the day
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        row = session.scalar(select(XComModel).where(
            XComModel.dag_id == ws.dag_id, XComModel.run_id == dr.run_id, XComModel.task_id == "reserve_budget",
            XComModel.key == "dpops_outcome"))
        assert row is not None
        value = XComModel.deserialize_value(row)
    assert value == {"run_id": refused_run, "state": "refused"}
    assert alert["interval_start"] == "2024-01-01T00:00:00+00:00"
    # The one summary line every outcome emits (dpops.release.RunOutcome.line).
    lines = [m for m in records if m.startswith("dpops release=af_refuse ")]
    assert len(lines) == 1 and "outcome=refused" in lines[0], lines

    ledger = _ledger(ws)
    assert ledger.runs(release=ws.release) == []  # nothing reserved, nothing charged
    assert ledger.published(ws.release, "2024-01-01T00:00:00+00:00", "2024-01-02T00:00:00+00:00") is None
    assert not (ws.specs_dir / "out" / "published" / ws.release).exists()
    assert not (ws.specs_dir / "out" / "staged" / ws.release).exists()  # no noise was ever drawn
    assert ledger.status(ws.scope).total == pytest.approx(0.0)
    refused = list((ws.specs_dir / "out" / "manifests" / ws.release).glob("*.refused.json"))
    assert len(refused) == 1 and "budget refused" in json.loads(refused[0].read_text())["outcome"]["reason"]


def test_changed_input_needs_explicit_restate_param(tmp_path, monkeypatch):
    from dpops.testing.synthetic import generate_events

    ws = make_workspace(tmp_path, release="af_restate", scope="af_restate_scope", days=1)
    dag = _dag(ws, monkeypatch, retries=0)
    assert _run(dag, 2)[0].state == "success"
    ledger = _ledger(ws)
    (v1,) = ledger.runs(release=ws.release)
    v1_rows = _published_rows(v1.output_uri)

    # Late/corrected data for the same day: a plain re-run never restates silently.
    generate_events(str(ws.specs_dir / "data" / "{start:%Y-%m-%d}.parquet"), n_rows=2100, n_users=400,
                    n_partitions=4, days=1, seed=99, start="2024-01-01")
    dag = _dag(ws, monkeypatch, retries=2)
    dr, tis = _run(dag, 2)
    assert tis["reserve_budget"].state == "skipped"  # refused (restate=true needed), not retried
    assert tis["reserve_budget"].try_number == 1 and tis["publish_release"].state == "skipped"
    assert [r.run_id for r in ledger.runs(release=ws.release)] == [v1.run_id]
    assert ledger.status(ws.scope).total == pytest.approx(0.5)

    # The explicit restatement: a new, charged run linked to the one it corrects; v1 stays on disk.
    dr, _ = _run(dag, 2, run_conf={"restate": True})
    assert dr.state == "success"
    new = ledger.published(ws.release, v1.key.interval_start, v1.key.interval_end)
    assert new.run_id != v1.run_id and new.restates == v1.run_id and new.state == "committed"
    assert new.output_uri != v1.output_uri and _published_rows(v1.output_uri) == v1_rows
    assert ledger.status(ws.scope).total == pytest.approx(1.0)
    assert ledger.verify().ok
