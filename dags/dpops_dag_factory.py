"""Build one Airflow DAG per dpops release spec.

The DAG only calls dpops: every privacy decision (what to reserve, how much noise, whether
an interval is already published, manifests, fingerprints) lives in ``dpops.release``, sequenced
per task by ``dpops.orchestration``. This file translates between Airflow and those functions:

    wait_for_input -> check_input -> reserve_budget -> compute_release -> validate_output
                   -> publish_release (outlet: the release's Asset) -> record_run

Every task is keyed on ``data_interval_start``/``data_interval_end`` (never ``ds`` or the
logical date), or, for a triggered run, on the ``interval`` param (REST ``logical_date: null`` with
``conf: {"interval": "2024-01-03"}``: a triggered run with a logical date would collide with the
scheduled or backfill run of that date). A run with neither fails at once, without retries. A retry or re-run never draws fresh noise (keyed randomness, staged output
reused) and never charges twice (idempotent reserve per run key; a published interval is served).

Settings resolved when a task runs (never at parse time, so the dag-processor needs neither
the key nor the ledger):

    $DPOPS_LEDGER_URL              the ledger: the worker's environment ONLY. No Airflow Connection is read
                                   for it (a Connection named dpops_ledger is ignored): Connections are
                                   editable by Op/Admin users and the api-server, and whoever picks the
                                   ledger picks the cap (issue 25 item 9)
    variable   dpops_noise_key_ref path of the noise key FILE under $DPOPS_KEY_DIR (a reference, never the key); else
                                   $DPOPS_NOISE_KEY_FILE
    connection dpops_airflow_api   http://user:password@host:port of the api-server: lets a refused run
                                   set its DAG-run note (Airflow 3 tasks have no database access)
    DPOPS_RANDOMNESS, DPOPS_BEAM_RUNNER, DPOPS_BEAM_OPTIONS, DPOPS_MANIFESTS_DIR, DPOPS_ALERT_HOOK

Read when the DAG file is parsed: DPOPS_SPECS_DIR (one DAG per *.yaml there), DPOPS_START_DATE
(default 2024-01-01), DPOPS_CATCHUP (false; a spec's ``catchup`` wins; see ``catchup_setting``), DPOPS_TASK_RETRIES (2), DPOPS_RETRY_DELAY_SECONDS (60),
DPOPS_MAX_ACTIVE_RUNS (2), DPOPS_DAG_OWNER (dpops), DPOPS_INPUT_POKE_SECONDS (300) and
DPOPS_INPUT_TIMEOUT_SECONDS (21600): how often and how long ``wait_for_input`` waits for late input.

Refusals (budget cap reached; a changed input of a published interval without ``restate``)
are outcomes, not crashes: ``reserve_budget`` ends SKIPPED with the reason (no traceback), the
DAG-run note says ``REFUSED: <reason>`` (replaced by ``PUBLISHED: ...`` if a later try of the same DAG
run publishes), the task log has the one ``dpops release=... outcome=refused``
line and a ``DPOPS_ALERT`` line (event ``dpops.refused``) goes to the alert hook. Skipped, not
failed, because a refusal is dpops working as intended (nothing charged, nothing published) and
a failed task is always rendered with a traceback; operators find refusals by the note, the
alert, and ``dpops gaps`` (intervals without publication and why). A run that publishes or serves a day
settles the day's earlier failed or refused DAG runs (``settle_earlier_runs``, ``dpops.run_notes``): a failed
one becomes success with a ``PUBLISHED:`` note (its tasks keep their states), a ``REFUSED:`` note is replaced
by one naming the ledger run that published the day. Errors a retry cannot fix
(invalid spec or parameter, an output that fails its checks) fail the task at once
(``AirflowFailException``); the rest (ledger unreachable, a worker lost) are retried.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from airflow.sdk import (
    DAG,
    Asset,
    BaseOperator,
    BaseSensorOperator,
    CronDataIntervalTimetable,
    Param,
    get_current_context,
    task,
)
from airflow.sdk.exceptions import (
    AirflowFailException,
    AirflowSensorTimeout,
    AirflowSkipException,
)
from dpops_alerts import failure_callback, refusal_alert

log = logging.getLogger("dpops.airflow")

SPECS_DIR_ENV = "DPOPS_SPECS_DIR"
DEFAULT_START = "2024-01-01"
ACTOR = "airflow"
KEY_REF_VARIABLE = "dpops_noise_key_ref"
API_CONN_ID = "dpops_airflow_api"
OUTCOME_XCOM = "dpops_outcome"  # reserve_budget's {"run_id", "state"}; the Privacy budget tab reads it
ASSET_URI_PREFIX = "dpops://releases/"

# Cron presets (Airflow's own preset table is not part of the public SDK).
_PRESETS = {
    "@hourly": "0 * * * *",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@weekly": "0 0 * * 0",
    "@monthly": "0 0 1 * *",
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
}

T = TypeVar("T")


def specs_dir() -> Path:
    """``$DPOPS_SPECS_DIR``, else ``dags/specs/`` next to this file, else the repository's ``examples/``."""
    env = os.environ.get(SPECS_DIR_ENV)
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent
    local = here / "specs"
    return local if local.is_dir() else here.parent / "examples"


def discover_specs(folder: Path | None = None) -> list[Path]:
    folder = specs_dir() if folder is None else Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())


def dag_id_for(release: str) -> str:
    """``dpops.dag_ids.dag_id_for``, the one owner of the naming rule (a module light enough for parse time)."""
    from dpops.dag_ids import dag_id_for as owner

    return owner(release)


def release_asset(release: str) -> Asset:
    """The Asset a release's publications are events of.

    One asset per release (not per interval or output path): downstream DAGs schedule on the
    release, each publication is one asset event whose ``extra`` names the interval, run id,
    version and output URI. The URI is ``dpops://releases/<release>`` rather than the output
    location, so moving the output root (another disk, an object store) does not silently cut
    every downstream schedule, and no filesystem path is exposed in the asset catalogue.
    """
    return Asset(name=dag_id_for(release), uri=f"{ASSET_URI_PREFIX}{release}", group="dpops")


def build_all(paths: list[Path], *, register: bool = True) -> tuple[list[DAG], list[str]]:
    """Every spec's DAG, and one public line per spec that could not be built. ``register=False`` builds
    without Airflow's auto-registration (a file that only checks the specs must not claim their DAGs)."""
    from dpops.errors import public_message

    dags: list[DAG] = []
    errors: list[str] = []
    for path in paths:
        try:
            dags.append(build_release_dag(path, register=register))
        except Exception as exc:  # noqa: BLE001 - reported per spec; never a file's content
            errors.append(f"{path}: " + "; ".join(ln.strip() for ln in public_message(exc).splitlines() if ln.strip()))
    return dags, errors


# ------------------------------------------------------------------ runtime helpers (task side)


def _interval(context: Any, spec_path: str) -> tuple[str, str]:
    """The run's data interval as ISO strings: ``dpops.run_interval.resolve_run_interval`` (its one owner,
    shared with the Privacy budget tab and the alerts) on what Airflow gave the run.

    Scheduled and backfill runs: Airflow's data interval (logical date D covers [D, D + period)). A
    triggered run names its interval in the ``interval`` param (``conf: {"interval": "2024-01-03"}`` with
    ``logical_date: null``; the same text ``dpops release run --interval`` takes): a triggered run with a
    logical date would collide (HTTP 409) with the scheduled or backfill run of that date."""
    from dpops.errors import DpopsError
    from dpops.run_interval import resolve_run_interval

    try:
        return resolve_run_interval(spec_path, data_interval_start=context.get("data_interval_start"),
                                    data_interval_end=context.get("data_interval_end"),
                                    logical_date=context.get("logical_date"),
                                    named=(context.get("params") or {}).get("interval"),
                                    dag_id=getattr(context.get("dag"), "dag_id", "DAG_ID"))
    except DpopsError as exc:  # its text names no data (dpops.errors); kept as the task's message, as before
        raise AirflowFailException(str(exc)) from None


def _settings() -> Any:
    """Key reference from the ``dpops_noise_key_ref`` variable (so a secrets backend works; confined to
    ``$DPOPS_KEY_DIR``), else the environment; the ledger only from the worker's ``$DPOPS_LEDGER_URL``
    (``dpops.orchestration.Settings.resolve``). Airflow metadata never chooses the ledger: a Connection is
    writable by Op/Admin users and a compromised api-server, and the ledger it named would enforce its own cap."""
    from airflow.sdk import Variable

    from dpops.orchestration import Settings

    key_ref = Variable.get(KEY_REF_VARIABLE, default=None)
    return Settings.resolve(key_ref=key_ref)


def _step(spec_path: str, context: Any) -> Any:
    from dpops.orchestration import Step, quiet_third_party_loggers

    quiet_third_party_loggers()
    start, end = _interval(context, spec_path)
    ti = context.get("ti")
    # The ledger records who asked: the DAG and task, so an entry leads back to its Airflow log.
    actor = f"{ACTOR}:{getattr(ti, 'dag_id', '?')}.{getattr(ti, 'task_id', '?')}"
    from dpops.errors import public_message
    from dpops.orchestration import is_fatal

    try:
        settings = _settings()
    except Exception as exc:
        if is_fatal(exc):  # e.g. a key value where its path belongs: a retry cannot fix it
            raise AirflowFailException(public_message(exc)) from None
        raise
    return Step(spec_path, start, end, settings, actor)


def _call(step: Any, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run one dpops step; an error a retry cannot fix fails the task at once (no retry), and a failure
    logs the run's one ``dpops release=... outcome=failed`` line."""
    from dpops import orchestration
    from dpops.errors import public_message

    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        out = orchestration.failure_outcome(step, exc)
        if out is not None:
            log.warning(orchestration.summary_line(out))
        if orchestration.is_fatal(exc):
            raise AirflowFailException(public_message(exc)) from None
        raise


REFUSED_NOTE = "REFUSED: "


def replace_refused_note(context: Any, note: str) -> bool:
    """A DAG run that publishes after an earlier try of it was refused (cap raised, then the run cleared or
    reprocessed) must not keep saying ``REFUSED:``: replace that note (and only that one: an operator's own
    note stays). The task context does not carry the note, so it is read through the REST API."""
    return _dag_run_note(context, note, only_if_prefix=REFUSED_NOTE)


def set_dag_run_note(context: Any, note: str) -> bool:
    """Set this DAG run's note through the api-server's REST API (connection ``dpops_airflow_api``).

    Airflow 3 tasks cannot write the metadata database, and the task SDK has no note call, so the public
    API is the supported path. Best effort: a missing connection or an unreachable server is logged,
    never raised (the refusal itself is already in the ledger, the log and the alert)."""
    return _dag_run_note(context, note)


@contextmanager
def _api_client() -> Iterator[Any]:
    """An ``httpx.Client`` logged in to the api-server as connection ``dpops_airflow_api`` (Airflow 3 tasks have
    no metadata-database access; the public REST API is the supported path), or None when there is no such
    connection or the login fails (logged: notes are best effort, the ledger, log and alert hold the facts)."""
    from airflow.sdk import Connection

    try:
        conn = Connection.get(API_CONN_ID)
    except Exception as exc:  # noqa: BLE001
        log.warning("DAG-run note not set: no Airflow connection %r (%s)", API_CONN_ID, type(exc).__name__)
        yield None
        return
    import httpx

    scheme = "https" if (conn.conn_type or "").lower() == "https" else "http"
    base = f"{scheme}://{conn.host}" + (f":{conn.port}" if conn.port else "") + (f"/{conn.schema}" if conn.schema else "")
    with httpx.Client(base_url=base, timeout=20) as client:
        try:
            tok = client.post("/auth/token", json={"username": conn.login, "password": conn.password})
            tok.raise_for_status()
        except Exception as exc:  # noqa: BLE001
            log.warning("DAG-run note not set: the api-server at %s answered %s", base, type(exc).__name__)
            yield None
            return
        client.headers["Authorization"] = f"Bearer {tok.json()['access_token']}"
        yield client


def _run_ids(context: Any) -> tuple[str | None, str | None]:
    dag_run = context.get("dag_run")
    dag_id = getattr(dag_run, "dag_id", None) or getattr(context.get("dag"), "dag_id", None)
    return dag_id, getattr(dag_run, "run_id", None) or context.get("run_id")


def _dag_run_note(context: Any, note: str, *, only_if_prefix: str | None = None) -> bool:
    dag_id, run_id = _run_ids(context)
    with _api_client() as client:
        if client is None:
            return False
        try:
            url = f"/api/v2/dags/{dag_id}/dagRuns/{run_id}"
            if only_if_prefix is not None:
                got = client.get(url)
                got.raise_for_status()
                current = got.json().get("note")
                if not (isinstance(current, str) and current.startswith(only_if_prefix)):
                    return False
            resp = client.patch(url, json={"note": note[:1000]}, params={"update_mask": "note"})
            resp.raise_for_status()
        except Exception as exc:  # noqa: BLE001
            log.warning("DAG-run note not set: the api-server answered %s", type(exc).__name__)
            return False
    return True


def _when(value: Any) -> datetime | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if isinstance(value, str) and value else None


def settle_earlier_runs(context: Any, spec_path: str, interval: tuple[str, str], *, ledger_run_id: str,
                        committed_at: str, publisher: str | None) -> list[str]:
    """Mark the earlier DAG runs of ``interval`` that the publication ``ledger_run_id`` settles (issue 28 item 8):
    a failed one becomes ``success`` with a ``PUBLISHED:`` note (its tasks keep their states), a ``REFUSED:``
    note is replaced by one naming the run that published the day (``dpops.run_notes.settled_runs`` decides
    which, from the ledger's commit). Runs are listed through the REST API: those whose logical date is the
    interval's start (scheduled, backfill) and those whose conf names it (REST ``conf.interval``). Best effort,
    like every note: returns the DAG-run ids marked."""
    from dpops.run_notes import OrchestratorRun, settled_runs

    dag_id, own = _run_ids(context)
    marked: list[str] = []
    with _api_client() as client:
        if client is None:
            return marked
        try:
            url = f"/api/v2/dags/{dag_id}/dagRuns"
            seen: dict[str, dict[str, Any]] = {}
            for params in ({"logical_date_gte": interval[0], "logical_date_lte": interval[0], "limit": 100},
                           {"conf_contains": interval[0][:10], "limit": 100}):
                got = client.get(url, params=params)
                got.raise_for_status()
                seen.update({r["dag_run_id"]: r for r in got.json().get("dag_runs", [])})
            runs = [OrchestratorRun(run_id=r["dag_run_id"], state=str(r.get("state")), note=r.get("note"),
                                    started=_when(r.get("start_date")),
                                    data_interval_start=r.get("data_interval_start"),
                                    data_interval_end=r.get("data_interval_end"), logical_date=r.get("logical_date"),
                                    named_interval=(r.get("conf") or {}).get("interval"))
                    for r in seen.values()]
            for s in settled_runs(runs, spec_path=spec_path, interval=interval, ledger_run_id=ledger_run_id,
                                  committed_at=datetime.fromisoformat(committed_at), own_run_id=str(own),
                                  publisher=publisher):
                body: dict[str, Any] = {"note": s.note}
                mask = ["note"]
                if s.mark_success:  # Airflow 3.3 keeps every finished task's state: the failure stays visible
                    body["state"] = "success"
                    mask.append("state")
                resp = client.patch(f"{url}/{s.run_id}", json=body, params={"update_mask": mask})
                resp.raise_for_status()
                marked.append(s.run_id)
                log.info("DAG run %s of %s settled: %s", s.run_id, dag_id, s.note)
        except Exception as exc:  # noqa: BLE001
            log.warning("earlier DAG runs of %s/%s not marked: the api-server answered %s", *interval,
                        type(exc).__name__)
    return marked


def _settle(context: Any, step: Any, *, publisher: str | None) -> None:
    """``settle_earlier_runs`` for the interval's committed publication, as the ledger records it."""
    from dpops.orchestration import committed_publication

    pub = committed_publication(step)
    if pub is not None:
        settle_earlier_runs(context, step.spec_path, (step.interval_start, step.interval_end), ledger_run_id=pub[0],
                            committed_at=pub[1], publisher=publisher)


# -------------------------------------------------------------------- operators


class InputSensor(BaseSensorOperator):
    """Wait (reschedule mode: no worker slot held) until the interval's input files exist.

    Late input is waited for here, with a timeout, rather than failing ``check_input`` and
    retrying the whole run: nothing is read or reserved while waiting."""

    def __init__(self, *, spec_path: str, release: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spec_path = spec_path
        self.release = release
        self._missing: list[str] = []

    def poke(self, context: Any) -> bool:
        from dpops.orchestration import missing_inputs

        start, end = _interval(context, self.spec_path)
        self._missing = missing_inputs(self.spec_path, start, end)
        if self._missing:
            log.info("input of %s %s/%s not there yet (%d file(s) missing: %s); next check in %.0f s",
                     self.release, start, end, len(self._missing), ", ".join(self._missing[:3]), self.poke_interval)
            return False
        return True

    def execute(self, context: Any) -> Any:
        try:
            return super().execute(context)
        except AirflowSensorTimeout:
            from dpops.orchestration import input_timed_out

            start, end = _interval(context, self.spec_path)
            input_timed_out(self.spec_path, start, end, waited_seconds=float(self.timeout),
                            missing_files=len(self._missing))
            raise AirflowFailException(
                f"input of {self.release} {start}/{end} still missing after waiting {self.timeout:.0f} s "
                f"(DPOPS_INPUT_TIMEOUT_SECONDS): {', '.join(self._missing[:5]) or '?'}. Nothing was read or "
                "reserved. Deliver the files and clear this task (or the run) to release the interval"
            ) from None


@contextmanager
def tracking_beam_jobs() -> Iterator[list[str]]:
    """Register every Beam job this task process starts (``dpops.orchestration.track_job``) so ``on_kill``
    can cancel it, and log its job id (the handle of a Dataflow/Flink/portable job).

    The pipeline (``pipelines.release_pipeline``) calls ``Pipeline.run`` itself and does not hand its
    ``PipelineResult`` out, so for the duration of the compute step this task process wraps
    ``Pipeline.run``; the task process runs only this task, and the wrapper is removed afterwards. Why not
    ``BeamRunPythonPipelineOperator`` (apache-airflow-providers-apache-beam): it cannot be constructed
    without the Google provider (+1.5 GB), it runs a pipeline *file* in a subprocess so the dpops privacy
    steps around the job (input fingerprint re-check, ledger ``start`` right before the first noise,
    sealing after) could not stay in one dpops step, and it logs the whole command line (key path, ledger
    URL with credentials) to the task log."""
    from dpops.orchestration import track_job, untrack_job

    ids: list[str] = []
    try:
        import apache_beam as beam
    except ImportError:  # pragma: no cover - compute needs Beam anyway
        yield ids
        return
    real_run = beam.Pipeline.run
    started: list[Any] = []

    def run(pipeline: Any, *args: Any, **kwargs: Any) -> Any:
        result = real_run(pipeline, *args, **kwargs)
        job_id = getattr(result, "job_id", None)
        ident = str(job_id()) if callable(job_id) else type(result).__name__
        ids.append(ident)
        started.append(result)
        track_job(result)
        log.info("Beam job %s started on %s", ident, type(getattr(pipeline, "runner", None)).__name__)
        return result

    beam.Pipeline.run = run
    try:
        yield ids
    finally:
        beam.Pipeline.run = real_run
        for result in started:
            untrack_job(result)


class ComputeOperator(BaseOperator):
    """``compute_release``: the dpops compute step, with ``on_kill`` cancelling its Beam job.

    The privacy steps stay in dpops (``dpops.release.compute``: ledger ``start`` right before the first noise
    is drawn, sealing after). Killing the task (timeout, mark failed, worker shutdown) cancels every
    Beam job the step registered (``dpops.orchestration.track_job``), so a non-local runner does not
    keep drawing noise on a cluster after Airflow gave up on it."""

    def __init__(self, *, spec_path: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spec_path = spec_path

    def execute(self, context: Any) -> dict[str, Any]:
        from dpops import orchestration

        step = _step(self.spec_path, context)
        with tracking_beam_jobs() as jobs:
            out = _call(step, orchestration.compute_step, step)
        return {**out, "beam_jobs": jobs}

    def on_kill(self) -> None:
        from dpops.orchestration import cancel_running_jobs

        cancelled = cancel_running_jobs()
        log.warning("compute_release killed: cancelled Beam job(s) %s", ", ".join(cancelled) or "(none running)")


# -------------------------------------------------------------------- DAG factory


def _timetable(schedule: str | None) -> CronDataIntervalTimetable | None:
    if schedule is None:
        return None
    return CronDataIntervalTimetable(_PRESETS.get(schedule, schedule), timezone="UTC")


def _doc(spec: Any, spec_path: str) -> str:
    unit = spec.privacy_unit
    b = spec.budget
    return (
        f"### dpops release `{spec.name}`\n\n{spec.description}\n\n"
        f"- spec: `{spec_path}` (hash `{spec.spec_hash[:12]}`)\n"
        f"- privacy unit: `{unit.column}` ({unit.description}), adjacency `{unit.adjacency}`\n"
        f"- budget scope `{b.scope}`: epsilon {b.epsilon}, delta {b.delta}, noise {b.noise} per interval\n"
        f"- schedule `{spec.schedule}`: a run covers [data_interval_start, data_interval_end)\n"
        f"- publications are events of the asset `{ASSET_URI_PREFIX}{spec.name}`\n\n"
        "A retry or re-run never draws fresh noise or charges twice. Set the param `restate` "
        "to publish a corrected input as a new, charged version."
    )


CATCHUP_ENV = "DPOPS_CATCHUP"


def catchup_setting(spec_value: bool | None = None) -> bool:
    """The DAG's catchup: the spec's ``catchup`` when it says, else ``$DPOPS_CATCHUP`` (true/false, default
    false): whether the scheduler creates a run for every interval since ``DPOPS_START_DATE`` that has none.
    A release that says ``catchup: false`` never catches up, whatever the deployment's default.

    Default false: each such run reserves budget, so a new deployment (or a DAG unpaused after weeks)
    would spend the scope on old intervals in whatever order the scheduler picks, up to the cap, before
    anyone looked at ``dpops plan``. Old intervals are released on purpose with a backfill instead
    (``dpops plan`` first). Set it true for a deployment whose start date is the first day it must
    release, so the scheduler itself fills every interval since then."""
    if spec_value is not None:
        return spec_value
    value = os.environ.get(CATCHUP_ENV, "false").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{CATCHUP_ENV}={value!r}: use true or false")


def build_release_dag(spec_path: str | os.PathLike[str], *, register: bool = True) -> DAG:
    from dpops.spec import load_spec

    spec_path = str(Path(spec_path).resolve())
    spec = load_spec(spec_path)
    start = datetime.fromisoformat(os.environ.get("DPOPS_START_DATE", DEFAULT_START)).replace(tzinfo=UTC)
    default_args = {
        "owner": os.environ.get("DPOPS_DAG_OWNER", "dpops"),
        "retries": int(os.environ.get("DPOPS_TASK_RETRIES", "2")),
        "retry_delay": timedelta(seconds=float(os.environ.get("DPOPS_RETRY_DELAY_SECONDS", "60"))),
        "execution_timeout": timedelta(hours=6),
        "on_failure_callback": failure_callback(spec_path),
    }
    with DAG(
        dag_id=dag_id_for(spec.name),
        description=spec.description or f"dpops release {spec.name}",
        doc_md=_doc(spec, spec_path),
        schedule=_timetable(spec.schedule),
        start_date=start,
        catchup=catchup_setting(spec.catchup),
        # Budget spends are serialized by the ledger, not by this number (backfills ignore it).
        max_active_runs=int(os.environ.get("DPOPS_MAX_ACTIVE_RUNS", "2")),
        default_args=default_args,
        tags=["dpops", f"scope:{spec.budget.scope}", f"release:{spec.name}"],
        params={
            "restate": Param(
                False,
                type="boolean",
                description="Publish a corrected input of an already published interval as a new, charged version.",
            ),
            "interval": Param(
                None,
                type=["null", "string"],
                description="For a triggered run (logical date empty): the interval to release, e.g. 2024-01-03 "
                            "(the day starting there) or START/END, as dpops release run --interval takes it.",
            ),
        },
        auto_register=register,
    ) as dag:
        _tasks(spec_path, spec.name)
    return dag


def _tasks(spec_path: str, release: str) -> None:
    # Every task returns its step's outcome as ONE XCom (``multiple_outputs=False``): Airflow infers multiple
    # outputs from a ``-> dict`` annotation and then also pushes each key as an XCom of its own, ~20 rows and
    # API calls per task that nothing reads (the next task takes the whole dict; the Privacy budget tab reads
    # only ``dpops_outcome``). That was ~90 XComs per DAG run; a published demo interval took 1.6 s in
    # ``dag.test`` with them and 1.1 s without.
    asset = release_asset(release)

    wait = InputSensor(
        task_id="wait_for_input", spec_path=spec_path, release=release, mode="reschedule",
        poke_interval=float(os.environ.get("DPOPS_INPUT_POKE_SECONDS", "300")),
        timeout=float(os.environ.get("DPOPS_INPUT_TIMEOUT_SECONDS", str(6 * 3600))),
        retries=0,  # the timeout is the decision; a retry would restart the wait
    )

    @task(multiple_outputs=False)
    def check_input() -> dict[str, Any]:
        """Input matches the declared schema (metadata only). Nothing is reserved yet."""
        # lazy: parsing imports no privacy modules
        from dpops import orchestration as orch

        step = _step(spec_path, get_current_context())
        return _call(step, orch.check_input_step, step)

    @task(multiple_outputs=False)
    def reserve_budget(checked: dict[str, Any]) -> dict[str, Any]:
        """Reserve the plan's events; serve an already published interval (skip the rest, no charge);
        a refusal skips the rest with its reason (see the module docstring)."""
        # lazy: parsing imports no privacy modules
        from dpops import orchestration as orch

        context = get_current_context()
        step = _step(spec_path, context)
        restate = bool(context["params"].get("restate", False))
        out = _call(step, orch.reserve_step, step, restate=restate)
        # The ledger run THIS DAG run worked on and what became of it: the Privacy budget tab describes this
        # run, not the interval's latest (a refused run must not show a later restatement as its own).
        context["ti"].xcom_push(key=OUTCOME_XCOM, value={"run_id": out.run_id, "state": out.state})
        if out.state == "refused":
            log.warning(orch.summary_line(out))
            refusal_alert(context, out.message, spec_path)
            set_dag_run_note(context, f"{REFUSED_NOTE}{out.message}")
            raise AirflowSkipException(f"REFUSED: {out.message}")
        if out.state == "already_published":
            log.info(orch.summary_line(out))
            _settle(context, step, publisher=None)  # e.g. the runbook's REST trigger after a CLI fill
            raise AirflowSkipException(f"{out.interval} is already published by run {out.run_id}: "
                                       "served, nothing computed or charged")
        return out.as_dict()

    @task(multiple_outputs=False)
    def validate_output(computed: dict[str, Any]) -> dict[str, Any]:
        """Checks and the GX suite on the NOISY staged output: post-processing, so it may block the publish."""
        # lazy: parsing imports no privacy modules
        from dpops import orchestration as orch

        step = _step(spec_path, get_current_context())
        return {**computed, **_call(step, orch.validate_step, step)}

    @task(outlets=[asset], multiple_outputs=False)
    def publish_release(validated: dict[str, Any]) -> dict[str, Any]:
        """Manifest, ledger commit, atomic publish; then one event of the release's Asset."""
        # lazy: parsing imports no privacy modules
        from dpops import orchestration as orch

        context = get_current_context()
        step = _step(spec_path, context)
        out = _call(step, orch.publish_step, step)
        # A retry finding its own earlier commit ("already_published") still owes the asset event: the
        # attempt that published failed before Airflow recorded one.
        context["outlet_events"][asset].extra = {
            "release": release, "interval_start": step.interval_start, "interval_end": step.interval_end,
            "run_id": out.run_id, "output_uri": out.output_uri, "restates": out.restates,
        }
        replace_refused_note(context, f"PUBLISHED: run {out.run_id} ({out.message or out.state}); an earlier try "
                                      "of this DAG run was refused")
        _settle(context, step, publisher=_run_ids(context)[1] if out.state == "published" else None)
        return {**out.as_dict(), "checks": validated.get("checks")}

    @task(multiple_outputs=False)
    def record_run(published: dict[str, Any], reserved: dict[str, Any]) -> dict[str, Any]:
        """The run's one summary line (and its manifest, written once)."""
        # lazy: parsing imports no privacy modules
        from dpops import orchestration as orch

        step = _step(spec_path, get_current_context())
        out = _call(step, orch.record_step, step, charged=float(reserved.get("epsilon_charged") or 0.0))
        log.info(orch.summary_line(out))
        return out.as_dict()

    checked = check_input()
    wait >> checked
    reserved = reserve_budget(checked)
    compute = ComputeOperator(task_id="compute_release", spec_path=spec_path)
    reserved >> compute
    validated = validate_output(compute.output)
    published = publish_release(validated)
    record_run(published, reserved)
