"""Airflow-native behaviour of the release DAG, through ``dag.test()`` (issue 12 "Airflow-native"):
settings from a variable and the environment (never the ledger from a connection), the release Asset and its downstream queue, the late-input
sensor (file appears; timeout), a run without a data interval, quiet third-party loggers."""

from __future__ import annotations

import airflow_support  # noqa: F401  (sets AIRFLOW_HOME etc. before airflow is imported)

import json
import logging
import shutil
from datetime import datetime, timezone

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
    import signal

    sigs = [signal.SIGTERM, signal.SIGINT, signal.SIGUSR2]
    saved = {sig: signal.getsignal(sig) for sig in sigs}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def _dag(ws, monkeypatch, *, env: dict[str, str] | None = None, retries: int = 0):
    from airflow.dag_processing.dagbag import DagBag

    for k, v in {**ws.env(), **(env or {})}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("DPOPS_TASK_RETRIES", str(retries))
    bag = DagBag(dag_folder=str(DAGS_FOLDER))
    assert bag.import_errors == {}
    return bag.dags[ws.dag_id]


def _tis(dr) -> dict:
    return {ti.task_id: ti for ti in dr.get_task_instances()}


def _alerts(caplog, capfd=None) -> list[dict]:
    """DPOPS_ALERT payloads from caplog, else from the terminal (where Airflow's logging config may send them)."""
    found = [json.loads(r.getMessage()[len("DPOPS_ALERT "):]) for r in caplog.records
             if r.getMessage().startswith("DPOPS_ALERT ")]
    if not found and capfd is not None:
        out, err = capfd.readouterr()
        found = [json.loads(ln.split("DPOPS_ALERT ", 1)[1].rsplit("} [", 1)[0] + "}")
                 for ln in (out + err).splitlines() if "DPOPS_ALERT {" in ln]
    return found


def test_key_reference_comes_from_the_airflow_variable_and_the_ledger_from_the_environment_only(tmp_path,
                                                                                                  monkeypatch):
    """AIRFLOW_VAR_DPOPS_NOISE_KEY_REF (what a secrets backend provides) wins over DPOPS_NOISE_KEY_FILE and is
    read when the task runs. The ledger is the worker's DPOPS_LEDGER_URL only (issue 25 item 9): a Connection
    ``dpops_ledger`` naming another ledger with a cap of 1000 (an Op/Admin user or a compromised api-server
    creates it) is ignored, so the deployment's ledger, whose cap refuses the day, refuses it, and the other
    ledger is never charged."""
    from dpops.ledger import open_ledger

    from airflow_support import create_scope

    ws = make_workspace(tmp_path, release="af_conn", scope="af_conn_scope", days=1, scope_cap=0.1)
    rogue = f"sqlite:///{tmp_path / 'rogue-ledger.sqlite'}"
    create_scope(rogue, ws.scope, 1000.0)
    dag = _dag(ws, monkeypatch, env={
        "DPOPS_NOISE_KEY_FILE": str(tmp_path / "no-such.key"),  # the variable must win
    })
    # Set after parsing: resolved at task run time, never at parse time.
    monkeypatch.setenv("AIRFLOW_CONN_DPOPS_LEDGER", rogue)
    monkeypatch.setenv("AIRFLOW_VAR_DPOPS_NOISE_KEY_REF", str(ws.key_path))
    dr = dag.test(logical_date=_day(2))
    tis = _tis(dr)
    assert tis["reserve_budget"].state == "skipped", {k: t.state for k, t in tis.items()}  # refused by the cap
    assert tis["publish_release"].state != "success"
    with open_ledger(rogue) as led:
        assert led.runs(release=ws.release) == [] and led.status(ws.scope).total == 0
    with open_ledger(ws.ledger_url) as led:
        assert led.runs(release=ws.release) == [] and led.status(ws.scope).total == 0
    assert not any(ws.root.rglob("_PUBLISHED.json"))

    # Without the variable, the environment's key file is the fallback (a wrong one is refused, naming it).
    monkeypatch.delenv("AIRFLOW_VAR_DPOPS_NOISE_KEY_REF")
    dr = dag.test(logical_date=_day(2))
    assert dr.state == "failed" and _tis(dr)["check_input"].state == "failed"


def test_a_key_value_in_the_key_reference_variable_is_refused_without_echoing_it(tmp_path, monkeypatch, caplog,
                                                                                 capfd):
    ws = make_workspace(tmp_path, release="af_keyvar", scope="af_keyvar_scope", days=1)
    hexkey = ws.key_path.read_text().split()[-1]  # the key material line of the v1 file
    dag = _dag(ws, monkeypatch, retries=2)
    monkeypatch.setenv("AIRFLOW_VAR_DPOPS_NOISE_KEY_REF", hexkey)
    caplog.set_level(logging.DEBUG)
    dr = dag.test(logical_date=_day(2))
    out, err = capfd.readouterr()
    tis = _tis(dr)
    assert dr.state == "failed" and tis["check_input"].state == "failed" and tis["check_input"].try_number == 1
    # dag.test's task logs go to the terminal or to caplog, depending on how Airflow configured logging first.
    alerts = _alerts(caplog) or [json.loads(ln.split("DPOPS_ALERT ", 1)[1].rsplit("} [", 1)[0] + "}")
                                 for ln in (out + err).splitlines() if "DPOPS_ALERT {" in ln]
    (alert,) = alerts
    assert alert["message"].startswith("InvalidParameter: the noise key reference")
    assert "must be the absolute path" in alert["message"] and "its value is not shown" in alert["message"]
    logged = out + err + "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    assert hexkey not in logged and hexkey[:16] not in logged


def test_a_key_reference_variable_outside_the_key_dir_is_refused(tmp_path, monkeypatch, caplog, capfd):
    """Issue 19 item 9: whoever can edit the Variable dpops_noise_key_ref could point the task at any readable
    file (another valid key, the Airflow DB URL). Only a key file under the operator's $DPOPS_KEY_DIR is
    accepted; the run is refused in check_input, nothing is reserved or charged, and it is not retried."""
    from dpops.ledger import open_ledger
    from dpops.noise.randomness import NoiseKey

    ws = make_workspace(tmp_path / "ws", release="af_keydir", scope="af_keydir_scope", days=1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    NoiseKey.generate(elsewhere / "noise.key")  # a perfectly valid key, in the wrong directory
    (elsewhere / "airflow_db_url").write_text("postgresql://airflow:Zq8vR2xLw9Tt4Kp7@postgres/airflow\n")
    (elsewhere / "airflow_db_url").chmod(0o600)
    dag = _dag(ws, monkeypatch, retries=2)
    caplog.set_level(logging.DEBUG)
    for target in (elsewhere / "noise.key", elsewhere / "airflow_db_url"):
        monkeypatch.setenv("AIRFLOW_VAR_DPOPS_NOISE_KEY_REF", str(target))
        dr = dag.test(logical_date=_day(2))
        tis = _tis(dr)
        assert dr.state == "failed" and tis["check_input"].state == "failed" and tis["check_input"].try_number == 1
        alert = _alerts(caplog, capfd)[-1]
        assert alert["message"].startswith("InvalidParameter: the noise key reference"), alert
        assert "under the operator's key directory $DPOPS_KEY_DIR" in alert["message"]
        assert str(target) not in alert["message"]
        caplog.clear()
    with open_ledger(ws.ledger_url) as led:
        assert led.runs(release=ws.release) == [] and led.status(ws.scope).total == 0
    # (the Variable naming a key inside $DPOPS_KEY_DIR publishes: the first test of this file)


def test_publication_is_an_asset_event_that_queues_a_downstream_dag(tmp_path, monkeypatch):
    from airflow.dag_processing.dagbag import BundleDagBag, sync_bag_to_db
    from airflow.models.asset import AssetDagRunQueue, AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    ws = make_workspace(tmp_path, release="af_asset", scope="af_asset_scope", days=2)
    dag = _dag(ws, monkeypatch)
    dr = dag.test(logical_date=_day(2))  # registers the release's DAG and asset
    assert dr.state == "success"
    # A consumer DAG, scheduled on the release's asset, written to the metadata DB like the dag-processor does.
    consumer = tmp_path / "consumer_dags"
    consumer.mkdir()
    (consumer / "af_asset_consumer.py").write_text(
        "from airflow.sdk import DAG, Asset\n"
        "from airflow.providers.standard.operators.empty import EmptyOperator\n"
        "with DAG('af_asset_consumer', schedule=[Asset(name='dpops_af_asset', uri='dpops://releases/af_asset')]):\n"
        "    EmptyOperator(task_id='read_release')\n")
    bag = BundleDagBag(dag_folder=str(consumer), bundle_path=consumer, bundle_name="dags-folder")
    assert bag.import_errors == {} and "af_asset_consumer" in bag.dags
    sync_bag_to_db(bag, "dags-folder", None)
    with create_session() as session:
        from airflow.models.dag import DagModel

        session.execute(DagModel.__table__.update().where(DagModel.dag_id == "af_asset_consumer")
                        .values(is_paused=False))

    dr = dag.test(logical_date=_day(3))  # [Jan 2, Jan 3): a new publication
    assert dr.state == "success"
    with create_session() as session:
        asset = session.scalar(select(AssetModel).where(AssetModel.uri == "dpops://releases/af_asset"))
        assert asset is not None and asset.name == "dpops_af_asset"
        events = session.scalars(select(AssetEvent).where(AssetEvent.asset_id == asset.id)
                                 .order_by(AssetEvent.timestamp)).all()
        assert [e.extra["interval_start"] for e in events] == ["2024-01-01T00:00:00+00:00",
                                                               "2024-01-02T00:00:00+00:00"]
        assert all(e.source_task_id == "publish_release" and e.extra["output_uri"].startswith("file://")
                   for e in events)
        queued = session.scalars(select(AssetDagRunQueue.target_dag_id)
                                 .where(AssetDagRunQueue.asset_id == asset.id)).all()
        assert queued == ["af_asset_consumer"]

    # A served re-run publishes nothing: no new event.
    dr = dag.test(logical_date=_day(3))
    assert dr.state == "success" and _tis(dr)["publish_release"].state == "skipped"
    with create_session() as session:
        assert len(session.scalars(select(AssetEvent).where(AssetEvent.asset_id == asset.id)).all()) == 2


def test_late_input_is_waited_for_by_the_sensor(tmp_path, monkeypatch):
    from dpops import orchestration

    ws = make_workspace(tmp_path, release="af_late", scope="af_late_scope", days=1)
    data = ws.specs_dir / "data" / "2024-01-01.parquet"
    held = tmp_path / "held.parquet"
    shutil.move(data, held)
    dag = _dag(ws, monkeypatch, env={"DPOPS_INPUT_POKE_SECONDS": "1", "DPOPS_INPUT_TIMEOUT_SECONDS": "120"})
    assert dag.task_dict["wait_for_input"].poke_interval == 1

    real = orchestration.missing_inputs
    pokes: list[list[str]] = []

    def missing(*a, **k):
        out = real(*a, **k)
        pokes.append(out)
        if len(pokes) == 1:  # the file is delivered right after the first poke found it missing
            shutil.move(held, data)
        return out

    monkeypatch.setattr(orchestration, "missing_inputs", missing)
    dr = dag.test(logical_date=_day(2))
    tis = _tis(dr)
    assert dr.state == "success", {k: t.state for k, t in tis.items()}
    assert pokes[0] == [str(data)] and pokes[-1] == [] and len(pokes) >= 2
    assert tis["wait_for_input"].try_number == 1  # rescheduled, not retried
    assert tis["check_input"].try_number == 1 and tis["publish_release"].state == "success"


def test_input_that_never_comes_times_out_with_a_clear_message(tmp_path, monkeypatch, caplog, capfd):
    from dpops.ledger import open_ledger

    ws = make_workspace(tmp_path, release="af_never", scope="af_never_scope", days=1)
    data = ws.specs_dir / "data" / "2024-01-01.parquet"
    data.unlink()
    dag = _dag(ws, monkeypatch, retries=2,
               env={"DPOPS_INPUT_POKE_SECONDS": "1", "DPOPS_INPUT_TIMEOUT_SECONDS": "3"})
    caplog.set_level(logging.INFO)
    dr = dag.test(logical_date=_day(2))
    tis = _tis(dr)
    assert dr.state == "failed"
    assert tis["wait_for_input"].state == "failed" and tis["wait_for_input"].try_number == 1
    assert tis["check_input"].state == "upstream_failed"
    (alert,) = [a for a in _alerts(caplog, capfd) if a["task_id"] == "wait_for_input"]
    msg = alert["message"]
    assert "input of af_never 2024-01-01T00:00:00+00:00/2024-01-02T00:00:00+00:00 still missing after waiting 3 s" in msg
    assert str(data) in msg and "Nothing was read or reserved" in msg
    assert open_ledger(ws.ledger_url).runs(release=ws.release) == []


def test_run_without_data_interval_fails_at_once_with_a_clear_message(tmp_path, monkeypatch, caplog, capfd):
    ws = make_workspace(tmp_path, release="af_nointerval", scope="af_nointerval_scope", days=1)
    dag = _dag(ws, monkeypatch, retries=2)
    caplog.set_level(logging.INFO)
    dr = dag.test(logical_date=None)  # what REST logical_date: null creates: no data interval
    tis = _tis(dr)
    assert dr.state == "failed"
    assert tis["wait_for_input"].state == "failed" and tis["wait_for_input"].try_number == 1  # not retried
    (alert,) = _alerts(caplog, capfd)
    assert alert["error"] == "AirflowFailException" and "KeyError" not in alert["message"]
    assert "has no data interval" in alert["message"] and "airflow backfill create --dag-id dpops_af_nointerval" \
        in alert["message"]


def test_third_party_loggers_are_quieted_but_dpops_warnings_are_not(caplog):
    from dpops.orchestration import quiet_third_party_loggers

    root_before = logging.getLogger().level
    quiet_third_party_loggers()
    caplog.set_level(logging.DEBUG, logger="dpops")
    with caplog.at_level(logging.NOTSET):
        logging.getLogger("great_expectations.data_context.x").info("gx chatter")
        logging.getLogger("apache_beam.io.gcp.bigquery").warning("no bigquery client")
        logging.getLogger("dpops.release").warning("a dpops warning")
        logging.warning("a root warning from elsewhere")
        import apache_beam.io.gcp.internal.clients.bigquery  # noqa: F401  (logs through the root logger)
        import importlib

        importlib.reload(apache_beam.io.gcp.internal.clients.bigquery)
    msgs = [r.getMessage() for r in caplog.records]
    assert "a dpops warning" in msgs
    assert "gx chatter" not in msgs and "no bigquery client" not in msgs
    assert "a root warning from elsewhere" in msgs and not any("apitools" in m for m in msgs)
    assert logging.getLogger().level == root_before  # no global filter
    assert logging.getLogger("dpops").getEffectiveLevel() <= logging.WARNING


def _slow(x: int) -> int:
    import time

    time.sleep(20)  # longer than the test waits for the cancel; the in-process worker finishes it later
    return x


def test_killing_compute_cancels_its_running_beam_job(tmp_path):
    """ComputeOperator.on_kill (called by Airflow on SIGTERM and on execution_timeout) cancels the Beam job the
    step started: a portable job on a real job service, here the local one (what Flink/Spark/Dataflow expose)."""
    import socket
    import subprocess
    import sys
    import time

    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    sys.path.insert(0, str(DAGS_FOLDER))
    from dpops import orchestration
    from dpops_dag_factory import ComputeOperator, tracking_beam_jobs

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    js = subprocess.Popen([sys.executable, "-m", "apache_beam.runners.portability.local_job_service_main",
                           "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60  # the job service answers on its port once it is up
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert js.poll() is None and time.monotonic() < deadline, "the job service did not start"
                time.sleep(0.2)
        op = ComputeOperator(task_id="compute_release", spec_path=str(tmp_path / "unused.yaml"))
        p = beam.Pipeline(options=PipelineOptions(["--runner=PortableRunner", f"--job_endpoint=127.0.0.1:{port}",
                                                   "--environment_type=LOOPBACK"]))
        _ = p | beam.Create([1, 2]) | beam.Map(_slow)
        with tracking_beam_jobs() as ids:
            result = p.run()
            assert len(ids) == 1 and list(orchestration.running_jobs()) == [result]
            time.sleep(3)  # the job is running its elements (a cancel during its start-up ends FAILED, not CANCELLED)
            assert str(result.state) == "RUNNING"
            t0 = time.monotonic()
            op.on_kill()
            try:
                result.wait_until_finish(duration=30000)
            except Exception:  # noqa: BLE001 - a cancelled portable job raises on wait
                pass
            assert str(result.state) == "CANCELLED" and time.monotonic() - t0 < 30
            assert list(orchestration.running_jobs()) == []
        assert beam.Pipeline.run is not None and "tracking" not in beam.Pipeline.run.__qualname__
    finally:
        js.terminate()
        js.wait(timeout=20)
