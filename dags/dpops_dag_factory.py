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
    DPOPS_MANIFESTS_DIR     where run manifests go (default <output root>/manifests/<release>)
    DPOPS_ALERT_HOOK        optional package.module:function called with each failure alert
    DPOPS_FAULT_PUBLISH     test hook: a file path; while it exists publish fails once noise is drawn

Read when the DAG file is parsed: DPOPS_SPECS_DIR (one DAG per *.yaml there), DPOPS_START_DATE
(default 2024-01-01), DPOPS_TASK_RETRIES (2), DPOPS_RETRY_DELAY_SECONDS (60),
DPOPS_MAX_ACTIVE_RUNS (2), DPOPS_DAG_OWNER (dpops).

Errors a retry cannot fix (budget refused, invalid spec or parameter, a noisy output that
fails its checks) fail the task at once (``AirflowFailException``); the rest (missing input,
ledger unreachable) are retried.
"""

from __future__ import annotations

import logging
import os
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from airflow.sdk import DAG, CronDataIntervalTimetable, Param, get_current_context, task
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

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
    ) as dag:
        _tasks(spec_path)
    return dag


def _prepare(spec_path: str, context: dict[str, Any]) -> Any:
    """The run context of this DAG run's interval (deterministic; writes nothing)."""
    from dpops import runs

    start, end = _interval(context)
    s = _settings()
    ti = context.get("ti")
    # The ledger records who asked: the DAG and task, so an entry leads back to its Airflow log.
    actor = f"{ACTOR}:{getattr(ti, 'dag_id', '?')}.{getattr(ti, 'task_id', '?')}"
    return runs.prepare(spec_path, start, end, randomness=s["randomness"], key_path=s["key_path"], actor=actor)


def _already_published(run: Any) -> bool:
    from dpops import runs

    with runs.open_run_ledger(_settings()["ledger_url"]) as ledger:
        rec = ledger.published(run.spec.name, run.interval.start_iso, run.interval.end_iso)
    return rec is not None and rec.run_id == run.run_id


def _refuse_silent_restatement(run: Any, ledger: Any) -> None:
    """A published interval whose input (or spec, or key) changed is only re-released on purpose.

    ``dpops.runs.reserve`` refuses it too; this says so in Airflow terms and without retries.
    """
    rec = ledger.published(run.spec.name, run.interval.start_iso, run.interval.end_iso)
    if rec is not None and rec.run_id != run.run_id:
        raise AirflowFailException(
            f"{run.spec.name} {run.interval} is already published by run {rec.run_id}, and this run's key differs "
            "(the input, the spec or the noise key changed). A re-release is a fresh, charged restatement and is "
            "never done silently: trigger this DAG run with the param restate=true (or use dpops release restate)."
        )


def _manifests_dir(run: Any) -> Path:
    env = os.environ.get("DPOPS_MANIFESTS_DIR")
    return Path(env) if env else Path(run.spec.output_root) / "manifests" / run.spec.name


def _inject_publish_fault() -> None:
    """Test hook: fail once, after the noise was drawn and staged, while the marker file exists."""
    marker = os.environ.get("DPOPS_FAULT_PUBLISH")
    if marker and os.path.exists(marker):
        os.unlink(marker)
        raise RuntimeError(f"injected publish fault ({marker}); a retry must publish the same numbers")


def _tasks(spec_path: str) -> None:
    @task
    def check_input() -> dict[str, Any]:
        """Input exists and matches the declared schema (metadata only). Nothing is reserved yet."""
        context = get_current_context()
        try:
            run = _prepare(spec_path, context)
            if _already_published(run):
                # Same keyed fingerprint => byte-identical input, which passed these checks when it was
                # published; a served re-run skips GX (seconds of import) and reads no data.
                return {"run_id": run.run_id, "checks": None, "state": "already_published"}
            from dpops.validate import check_input_schema

            report = check_input_schema(run.input_paths, run.spec.input.columns, run.spec.input.format)
        except Exception as exc:
            _fail_fast(exc)
            raise
        log.info("input checks passed for %s: %s", run.interval, ", ".join(report.checks))
        return {"run_id": run.run_id, "checks": report.as_dict()}

    @task
    def reserve_budget(checked: dict[str, Any]) -> dict[str, Any]:
        """Reserve the plan's events in the ledger, or find the interval already published (no charge)."""
        from dpops import runs
        from dpops.errors import BudgetExceeded

        context = get_current_context()
        restate = bool(context["params"].get("restate", False))
        run = _prepare(spec_path, context)
        try:
            with runs.open_run_ledger(_settings()["ledger_url"]) as ledger:
                if not restate:
                    _refuse_silent_restatement(run, ledger)
                try:
                    res = runs.restate(run, ledger) if restate else runs.reserve(run, ledger)
                except BudgetExceeded as exc:
                    _record_refusal(run, ledger, exc)
                    raise AirflowFailException(_refusal_message(run, ledger, exc)) from exc
                if res.state == "already_published":
                    # Served: nothing to compute, publish or charge. Skipping the rest (rather than
                    # running pass-through tasks) keeps a reprocessed backfill cheap.
                    summary = _summary(run, ledger, runs.step_summary(res), _existing_manifest(run), 0.0)
                    log.info(summary_line({**summary, "outcome": "served"}))
                    raise AirflowSkipException(f"{run.interval} is already published by run {res.run_id}: "
                                               "served, nothing computed or charged")
        except (AirflowFailException, AirflowSkipException):
            raise
        except Exception as exc:
            _fail_fast(exc)
            raise
        return runs.step_summary(res)

    @task
    def compute_release(reserved: dict[str, Any]) -> dict[str, Any]:
        """Draw the noise (keyed: a retry reproduces it) and stage the output; reuse a staged output."""
        from dpops import runs

        context = get_current_context()
        s = _settings()
        run = _prepare(spec_path, context)
        try:
            with runs.open_run_ledger(s["ledger_url"]) as ledger:
                res = runs.compute(run, ledger, runner=s["runner"], runner_options=s["runner_options"])
        except Exception as exc:
            _fail_fast(exc)
            raise
        return runs.step_summary(res)

    @task
    def validate_output(computed: dict[str, Any]) -> dict[str, Any]:
        """GX checks on the NOISY staged output: post-processing, so it may block the publish."""
        from dpops.validate import check_release_output  # GX takes seconds to import: only when needed

        run = _prepare(spec_path, get_current_context())
        staged = run.store.find_staged(run.interval.slug, run.run_id)
        if staged is None:
            raise AirflowFailException(f"run {run.run_id}: no staged output to validate; clear compute_release")
        try:
            report = check_release_output(
                str(staged.data_file),
                partition_columns=run.spec.partitions.columns,
                public_partitions=run.spec.public_partitions(),
                allow_null=run.spec.postprocess.suppress_below is not None,
            )
        except Exception as exc:
            _fail_fast(exc)
            raise
        return {**computed, "checks": report.as_dict()}

    @task
    def publish_release(validated: dict[str, Any]) -> dict[str, Any]:
        """Publish atomically, then commit the run in the ledger (the charge becomes final)."""
        from dpops import runs

        run = _prepare(spec_path, get_current_context())
        _inject_publish_fault()
        try:
            with runs.open_run_ledger(_settings()["ledger_url"]) as ledger:
                res = runs.publish(run, ledger)
        except Exception as exc:
            _fail_fast(exc)
            raise
        return {**runs.step_summary(res), "checks": validated.get("checks")}

    @task
    def record_run(published: dict[str, Any], checked: dict[str, Any], reserved: dict[str, Any]) -> dict[str, Any]:
        """Write the run manifest (once; a served re-run points at the existing one) and the summary line."""
        from dpops import runs

        run = _prepare(spec_path, get_current_context())
        with runs.open_run_ledger(_settings()["ledger_url"]) as ledger:
            manifest = _write_manifest(run, ledger, published, [checked.get("checks"), published.get("checks")])
            summary = _summary(run, ledger, published, manifest, reserved.get("epsilon_charged"))
        log.info(summary_line(summary))
        return summary

    checked = check_input()
    reserved = reserve_budget(checked)
    computed = compute_release(reserved)
    validated = validate_output(computed)
    published = publish_release(validated)
    record_run(published, checked, reserved)


def _validation(reports: list[dict[str, Any] | None]) -> dict[str, Any]:
    checks = [
        {"name": f"{r['name']}: {c}", "passed": bool(r["success"])} for r in reports if r for c in r.get("checks", [])
    ]
    return {"checks": checks, "proceeded": True}


def _output_fingerprints(run: Any, output_uri: str | None) -> dict[str, str]:
    """Keyed (HMAC) fingerprints of the published files: a plain hash would let a manifest reader
    confirm a guess (semantics.md section 5)."""
    from urllib.parse import urlparse
    from urllib.request import url2pathname

    if not output_uri or not run.key_path:
        return {}
    key = run.fingerprint_key  # loaded once by _prepare (never re-read from the file)
    folder = Path(url2pathname(urlparse(output_uri).path))
    out = {}
    for f in sorted(folder.iterdir()) if folder.is_dir() else []:
        if f.is_file() and not f.name.startswith("_"):
            out[f.name] = "hmac-sha256:" + key.hmac(f.read_bytes()).hex()
    return out


def _existing_manifest(run: Any) -> str | None:
    path = _manifests_dir(run) / f"{run.run_id}.published.json"
    return str(path) if path.exists() else None


def _write_manifest(run: Any, ledger: Any, published: dict[str, Any], reports: list[Any]) -> str | None:
    from dpops.manifest.run_hook import write_run_manifest

    existing = _existing_manifest(run)
    if existing:  # a retry, or a served re-run: the manifest is immutable and already states the claim
        return existing
    folder = _manifests_dir(run)
    rec = ledger.run(run.run_id)
    if rec is None or rec.state != "committed":
        return None
    # "already_published" here means a publish retry found its own earlier commit: still this run's manifest.
    return write_run_manifest(
        run,
        ledger,
        "published",
        manifests_dir=folder,
        validation=_validation(reports),
        output_fingerprints=_output_fingerprints(run, published.get("output_uri")),
    )


def _record_refusal(run: Any, ledger: Any, exc: Exception) -> None:
    """A refused run gets a manifest too (nothing spent); best effort, never masks the refusal."""
    try:
        from dpops.manifest.run_hook import write_run_manifest

        folder = _manifests_dir(run)
        if not (folder / f"{run.run_id}.refused.json").exists():
            write_run_manifest(run, ledger, {"state": "refused", "reason": str(exc)}, manifests_dir=folder)
    except Exception:  # noqa: BLE001
        log.exception("could not write the refusal manifest of run %s", run.run_id)


def _refusal_message(run: Any, ledger: Any, exc: Exception) -> str:
    """Which scope, how much is left, what was asked; the interval stays unpublished."""
    scope = getattr(exc, "scope", run.spec.budget.scope)
    try:
        left = f"{float(ledger.status(scope).remaining):.6g}"
    except Exception:  # noqa: BLE001
        left = "?"
    unit = getattr(exc, "unit", "epsilon")
    asked = getattr(exc, "requested", None)
    return (
        f"budget refused for {run.spec.name} {run.interval}: scope {scope!r} has {unit} {left} left "
        f"(cap {getattr(exc, 'cap', '?')}), this run asked {unit} {asked if asked is None else f'{asked:.6g}'}; "
        f"nothing was charged and the interval stays unpublished. Ledger: {exc}"
    )


def _summary(run: Any, ledger: Any, published: dict[str, Any], manifest: str | None,
             charged_now: float | None) -> dict[str, Any]:
    rec = ledger.run(run.run_id)
    try:
        remaining = float(ledger.status(run.spec.budget.scope).remaining)
    except Exception:  # noqa: BLE001 - the summary must not fail on a status read
        remaining = None
    return {
        "release": run.spec.name,
        "interval_start": run.interval.start_iso,
        "interval_end": run.interval.end_iso,
        "outcome": published.get("state"),
        "run_id": run.run_id,
        "ledger_state": getattr(rec, "state", None),
        "epsilon_charged": charged_now,
        "run_epsilon": getattr(rec, "epsilon", None),
        "scope": run.spec.budget.scope,
        "scope_remaining_epsilon": remaining,
        "output_uri": published.get("output_uri") or getattr(rec, "output_uri", None),
        "manifest": manifest,
    }
