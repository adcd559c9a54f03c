"""Build one Airflow DAG per dpops release spec.

The DAG is thin on purpose: every privacy decision (what to reserve, how much noise,
whether an interval is already published) lives in ``dpops.runs`` and the ledger. The
tasks only carry the data interval from Airflow to those step functions:

    check_input -> reserve_budget -> compute_release -> validate_output -> publish_release -> record_run

Every task is keyed on ``data_interval_start``/``data_interval_end`` (never ``ds`` or the
logical date, which differ from the interval under ``dag.test`` and manual triggers), and
re-derives its run context with ``dpops.runs.prepare`` (deterministic, no ledger write), so
a task retried on another worker needs nothing from the previous attempt but the ledger
and the staged files. A retry or a re-run therefore never draws fresh noise (keyed
randomness reproduces it, a staged output is reused) and never charges twice (the ledger
reserve is idempotent per run key; a published interval is served, not recomputed).

Runtime settings come from the worker's environment, read when a task runs (not when the
DAG file is parsed), so the dag-processor needs neither the key nor the ledger:

    DPOPS_LEDGER_URL        ledger database (sqlite:///... or postgresql://...)
    DPOPS_NOISE_KEY_FILE    file holding the noise key (a mounted secret; never its content)
    DPOPS_RANDOMNESS        keyed (default) | os
    DPOPS_BEAM_RUNNER       Beam runner for the in-process pipeline (default FnApiRunner)
    DPOPS_BEAM_OPTIONS      extra Beam options, whitespace separated (no secrets here: they are logged)
    DPOPS_ALERT_HOOK        optional package.module:function called with each failure alert
    DPOPS_FAULT_PUBLISH     test hook: a file path; while it exists publish fails once noise is drawn
"""

from __future__ import annotations

import logging
import os
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from airflow.sdk import DAG, CronDataIntervalTimetable, Param, get_current_context, task
from airflow.sdk.exceptions import AirflowFailException

from dpops_alerts import on_failure, summary_line

log = logging.getLogger("dpops.airflow")

SPECS_DIR_ENV = "DPOPS_SPECS_DIR"
DEFAULT_START = "2024-01-01"
ACTOR = "airflow"

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
    return f"dpops_{release}"


# ------------------------------------------------------------------ runtime helpers


def _interval(context: dict[str, Any]) -> tuple[str, str]:
    start, end = context["data_interval_start"], context["data_interval_end"]
    if start is None or end is None or start >= end:
        # A trigger timetable or a manual run without an interval: refuse, never guess.
        raise AirflowFailException(
            f"this run has no data interval ({start} .. {end}); dpops releases need a data-interval schedule"
        )
    return (
        start.astimezone(timezone.utc).isoformat(),
        end.astimezone(timezone.utc).isoformat(),
    )


def _settings() -> dict[str, Any]:
    return {
        "ledger_url": os.environ.get("DPOPS_LEDGER_URL") or None,
        "key_path": os.environ.get("DPOPS_NOISE_KEY_FILE") or None,
        "randomness": os.environ.get("DPOPS_RANDOMNESS", "keyed"),
        "runner": os.environ.get("DPOPS_BEAM_RUNNER", "FnApiRunner"),
        "runner_options": tuple(os.environ.get("DPOPS_BEAM_OPTIONS", "").split()),
    }


def _fail_fast(exc: Exception) -> None:
    """Errors a retry cannot fix become AirflowFailException (no retry); the rest propagate."""
    from dpops.errors import BudgetExceeded, IntegrityError, InvalidParameter, SpecError

    if isinstance(exc, (BudgetExceeded, SpecError, InvalidParameter, IntegrityError)):
        raise AirflowFailException(f"{type(exc).__name__}: {exc}") from exc


# -------------------------------------------------------------------- DAG factory


def _timetable(schedule: str | None):
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
        f"- schedule `{spec.schedule}`: a run covers [data_interval_start, data_interval_end)\n\n"
        "A retry or re-run never draws fresh noise or charges twice. Set the param `restate` "
        "to publish a corrected input as a new, charged version."
    )


def build_release_dag(spec_path: str | os.PathLike[str]) -> DAG:
    from dpops.spec import load_spec

    spec_path = str(Path(spec_path).resolve())
    spec = load_spec(spec_path)
    start = datetime.fromisoformat(os.environ.get("DPOPS_START_DATE", DEFAULT_START)).replace(tzinfo=timezone.utc)
    default_args = {
        "owner": os.environ.get("DPOPS_DAG_OWNER", "dpops"),
        "retries": int(os.environ.get("DPOPS_TASK_RETRIES", "2")),
        "retry_delay": timedelta(seconds=float(os.environ.get("DPOPS_RETRY_DELAY_SECONDS", "60"))),
        "execution_timeout": timedelta(hours=6),
        "on_failure_callback": on_failure,
    }
    with DAG(
        dag_id=dag_id_for(spec.name),
        description=spec.description or f"dpops release {spec.name}",
        doc_md=_doc(spec, spec_path),
        schedule=_timetable(spec.schedule),
        start_date=start,
        catchup=False,
        # Budget spends are serialized by the ledger, not by this number (backfills ignore it).
        max_active_runs=int(os.environ.get("DPOPS_MAX_ACTIVE_RUNS", "2")),
        default_args=default_args,
        tags=["dpops", f"scope:{spec.budget.scope}", f"release:{spec.name}"],
        params={
            "restate": Param(
                False,
                type="boolean",
                description="Publish a corrected input of an already published interval as a new, charged version.",
            )
        },
        render_template_as_native_obj=True,
    ) as dag:
        _tasks(spec_path)
    return dag


def _tasks(spec_path: str) -> None:
    @task
    def check_input() -> dict[str, Any]:
        """Input exists and matches the declared schema (metadata only). Nothing is reserved yet."""
        from dpops import runs
        from dpops.validate import check_input_schema

        ctx = get_current_context()
        start, end = _interval(ctx)
        s = _settings()
        try:
            run = runs.prepare(spec_path, start, end, randomness=s["randomness"], key_path=s["key_path"])
            report = check_input_schema(run.input_paths, run.spec.input.columns, run.spec.input.format)
        except Exception as exc:
            _fail_fast(exc)
            raise
        log.info("input checks passed for %s/%s: %s", start, end, ", ".join(report.checks))
        return {"run_id": run.run_id, "input_checks": report.as_dict()}

    @task
    def reserve_budget(checked: dict[str, Any]) -> dict[str, Any]:
        from dpops import runs

        ctx = get_current_context()
        start, end = _interval(ctx)
        s = _settings()
        restate = bool(ctx["params"].get("restate", False))
        try:
            run = runs.prepare(spec_path, start, end, randomness=s["randomness"], key_path=s["key_path"])
            with runs.open_run_ledger(s["ledger_url"]) as ledger:
                res = runs.restate(run, ledger) if restate else runs.reserve(run, ledger)
        except Exception as exc:
            _fail_fast(exc)
            raise
        return runs.step_summary(res)

    @task
    def compute_release(reserved: dict[str, Any]) -> dict[str, Any]:
        from dpops import runs

        ctx = get_current_context()
        start, end = _interval(ctx)
        s = _settings()
        try:
            run = runs.prepare(spec_path, start, end, randomness=s["randomness"], key_path=s["key_path"])
            with runs.open_run_ledger(s["ledger_url"]) as ledger:
                res = runs.compute(run, ledger, runner=s["runner"], runner_options=s["runner_options"])
        except Exception as exc:
            _fail_fast(exc)
            raise
        return runs.step_summary(res)

    # Placeholders until dpops.runs lands; replaced below.
    check = check_input()
    reserved = reserve_budget(check)
    compute_release(reserved)
