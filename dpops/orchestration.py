"""One function per orchestrator task, taking plain values (no Airflow, no Beam imports here).

The Airflow DAG (``dags/dpops_dag_factory.py``) only translates between Airflow and these
functions: it resolves settings from connections/variables, passes the run's data interval as
ISO strings and maps the returned ``RunOutcome`` states to task states. Every rule (what is
reserved, when a changed input is refused, how manifests and output fingerprints are made)
has one owner, the ``dpops.release`` package; this module only sequences its steps the way a task-per-step
orchestrator needs them:

    wait_for_input -> check_input_step -> reserve_step -> compute_step -> validate_step
                   -> publish_step -> record_step

Each step re-runs ``release.prepare`` (deterministic, writes nothing), so a task retried on
another worker needs nothing from the previous attempt but the ledger and the staged files.

A *refusal* (budget cap reached, or a changed input of a published interval without an
explicit restatement) is an outcome, not an error: ``reserve_step`` returns a ``RunOutcome``
with state ``refused`` and the reason, nothing is charged, and the orchestrator decides how
to show it. Errors a retry cannot fix are ``FATAL_ERRORS``; everything else may be retried.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from dpops import release
from dpops.dag_ids import DAG_ID_PREFIX, dag_id_for, release_of_dag  # noqa: F401 - the naming rule's owner
from dpops.errors import (
    BudgetExceeded,
    IntegrityError,
    InvalidParameter,
    LedgerError,
    NeedsOperator,
    SpecError,
    public_message,
)
from dpops.release.context import pick_attempt
from dpops.release.refusals import budget_refusal_reason, record_refusal
from dpops.release.reservation import refuse_changed_input, served_across_rotation
from dpops.third_party_logs import quiet_third_party_loggers  # its one owner; re-exported for the DAG factory

log = logging.getLogger("dpops.orchestration")

LEDGER_URL_ENV = "DPOPS_LEDGER_URL"
KEY_FILE_ENV = "DPOPS_NOISE_KEY_FILE"


# Errors a retry cannot fix: the orchestrator fails the task at once instead of retrying it.
FATAL_ERRORS: tuple[type[BaseException], ...] = (BudgetExceeded, SpecError, InvalidParameter, IntegrityError,
                                                NeedsOperator)

# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    """Where the ledger is and which key file to use; resolved when a task runs, not at parse time.

    ``key_path`` is a reference (a file path), never the key: environments and orchestrator
    metadata leak (process listings, task metadata), so the key value only lives in its file.
    """

    ledger_url: str | None
    key_path: str | None
    randomness: str = "keyed"
    runner: str = "FnApiRunner"
    runner_options: tuple[str, ...] = field(default=())
    estimation_staging: str | None = None

    @classmethod
    def resolve(cls, key_ref: str | None = None) -> Settings:
        """The ledger from the deployment's environment (``$DPOPS_LEDGER_URL``) only; the key reference from
        the orchestrator's variable (confined to ``$DPOPS_KEY_DIR``), else the environment.

        Privacy reason for the ledger rule: the ledger is what enforces the cap, so whoever chooses it
        chooses the cap. Orchestrator metadata (an Airflow Connection) is writable by Op/Admin users and
        by the api-server; a Connection that named the ledger let them point the tasks at a ledger with
        a cap of their own and publish a day the deployment's ledger had refused (issue 25 item 9). The
        worker's environment is set by whoever deploys the workers, the same party that owns the ledger,
        so it is the only source; there is no parameter through which a caller could pass another one.
        """
        if key_ref:
            # From orchestrator metadata (an editable Variable): only a key file under the operator's
            # $DPOPS_KEY_DIR, never any path (issue 19 item 9; dpops.keyref.key_ref_under_key_dir).
            from dpops.keyref import key_ref_under_key_dir

            key_ref = key_ref_under_key_dir(key_ref, "the noise key reference (Airflow variable dpops_noise_key_ref)")
        key = key_ref or os.environ.get(KEY_FILE_ENV) or None
        return cls(
            ledger_url=os.environ.get(LEDGER_URL_ENV) or None,
            key_path=key,
            randomness=os.environ.get("DPOPS_RANDOMNESS", "keyed"),
            runner=os.environ.get("DPOPS_BEAM_RUNNER", "FnApiRunner"),
            runner_options=tuple(os.environ.get("DPOPS_BEAM_OPTIONS", "").split()),
            # set by whoever deploys the workers, like the runner: where a bounds: estimate pass's private scratch
            # goes so it runs on the workers (unset: in the task's process; release_estimation_engine)
            estimation_staging=os.environ.get("DPOPS_ESTIMATION_STAGING") or None,
        )


@dataclass(frozen=True)
class Step:
    """One task's call: the spec, the interval (ISO strings) and the settings."""

    spec_path: str
    interval_start: str
    interval_end: str
    settings: Settings
    actor: str = "orchestrator"

    def prepare(self, ledger: Any = None, *, run_estimation: bool = False, restate: bool = False) -> release.RunContext:
        """``release.prepare``; a spec with ``bounds: estimate`` gets the ledger (``ledger``, or one opened
        here) for its estimation. Only the reserve task runs it (``run_estimation``); every other task,
        and a failure line, is served the committed one and never charges (none committed: LedgerError)."""
        from dpops.release.estimation import release_estimation_engine
        from dpops.spec import load_spec

        s = self.settings
        mode = "run" if run_estimation else "serve"
        engine = release_estimation_engine(s.runner, s.runner_options, s.estimation_staging)
        if ledger is not None or not load_spec(self.spec_path).estimated_metric_keys:
            return release.prepare(self.spec_path, self.interval_start, self.interval_end, randomness=s.randomness,
                                   key_path=s.key_path, actor=self.actor, ledger=ledger, estimation=mode,
                                   restate=restate, estimation_engine=engine)
        with self.ledger() as led:
            return release.prepare(self.spec_path, self.interval_start, self.interval_end, randomness=s.randomness,
                                   key_path=s.key_path, actor=self.actor, ledger=led, estimation=mode,
                                   restate=restate, estimation_engine=engine)

    def ledger(self) -> Any:
        return release.open_run_ledger(self.settings.ledger_url)

    def current(self, ledger: Any) -> release.RunContext:
        """``prepare``, then the attempt the ledger knows (``pick_attempt``, the one owner of that choice):
        every task works on the run id ``reserve_step`` reserved, also after a refund or a fresh attempt."""
        ctx = self.prepare(ledger)
        pick_attempt(ctx, ledger)
        return ctx


# --------------------------------------------------------------------------- late input


def missing_inputs(spec_path: str, interval_start: str, interval_end: str) -> list[str]:
    """The interval's input files that do not exist yet (empty: all there). Reads no data.

    Used by the orchestrator's sensor to wait for late input instead of failing and retrying the whole run
    (``dpops.inputs.missing_input_files``, which ``dpops gaps`` uses too)."""
    from dpops.inputs import missing_input_files
    from dpops.spec import load_spec

    return missing_input_files(load_spec(spec_path), interval_start, interval_end)


def input_timed_out(spec_path: str, interval_start: str, interval_end: str, *, waited_seconds: float,
                    missing_files: int) -> None:
    """The sensor gave up waiting for the interval's input: leave the record ``dpops gaps`` reads
    ("input missing (waited N s)"; ``dpops.gaps.record_input_wait``). Best effort: the task fails anyway."""
    from dpops.gaps import record_input_wait
    from dpops.spec import load_spec
    from dpops.storage import private_state_dir

    try:
        record_input_wait(load_spec(spec_path), interval_start, interval_end, waited_seconds=waited_seconds,
                          missing_files=missing_files)
    except Exception as exc:  # noqa: BLE001 - the timeout itself is the task's error
        # Logged at ERROR with its reason so it shows in the task log: without the record ``dpops gaps`` says
        # "never run" for an interval a run did wait for. An OSError's reason (errno, strerror) names no data.
        why = (f"{type(exc).__name__} [{errno.errorcode.get(exc.errno or 0, exc.errno)}] {exc.strerror}"
               if isinstance(exc, OSError) and exc.strerror else public_message(exc))
        log.error("could not record the input wait for dpops gaps under %s (dpops gaps will say never_run for "
                  "%s/%s): %s", private_state_dir(), interval_start, interval_end, why)


def requested_interval(spec_path: str, text: str) -> tuple[str, str]:
    """The interval an operator named for a triggered run (the DAG's ``interval`` param, as
    ``dpops release run --interval`` takes it: ``2024-01-03`` or ``START/END``), as ISO strings."""
    iv = release.requested_interval(spec_path, text)
    return iv.start_iso, iv.end_iso


# --------------------------------------------------------------------------- steps


def check_input_step(step: Step) -> dict[str, Any]:
    """Input exists and matches the declared schema (metadata only). Nothing is reserved yet.

    An interval this very run already published skips the checks: the same keyed fingerprint
    means byte-identical input, which passed them when it was published."""
    with step.ledger() as ledger:
        ctx = step.current(ledger)
        rec = ledger.published(ctx.spec.name, ctx.interval.start_iso, ctx.interval.end_iso)
    if rec is not None and rec.run_id == ctx.run_id:
        return {"run_id": ctx.run_id, "checks": None, "state": "already_published"}
    from dpops.release.gx_checks import check_input_schema

    quiet_third_party_loggers()
    report = check_input_schema(ctx.input_paths, ctx.spec.input.columns, ctx.spec.input.format)
    log.info("input checks passed for %s %s: %s", ctx.spec.name, ctx.interval, ", ".join(report.checks))
    return {"run_id": ctx.run_id, "checks": report.as_dict(), "state": "checked"}


def _refused(ctx: release.RunContext, ledger: Any, reason: str) -> release.RunOutcome:
    # The scope's whole position (total, cap, remaining, accountant: ``scope_position``, the one owner and
    # never raising), so the line never says "total unknown" beside a known remaining (issue 28 item 9).
    pos = release.scope_position(ledger, ctx.spec.budget.scope)
    return release.RunOutcome(release=ctx.spec.name, interval=str(ctx.interval), state="refused", run_id=ctx.run_id,
                           scope=ctx.spec.budget.scope, message=reason, **pos)


def reserve_step(step: Step, *, restate: bool = False) -> release.RunOutcome:
    """Reserve the plan's events, serve an interval this run already published (state
    ``already_published``, no charge), or return a ``refused`` outcome saying why."""
    ctx = step.prepare(run_estimation=True, restate=restate)
    with step.ledger() as ledger:
        if not restate:
            pick_attempt(ctx, ledger)  # the run key the ledger knows (a refunded attempt is skipped)
            published = ledger.published(ctx.spec.name, ctx.interval.start_iso, ctx.interval.end_iso)
            if served_across_rotation(ctx, published, None):
                return release.reserve(ctx, ledger)  # serves it (already_published), nothing charged
            try:
                # The one owner of the "never restate silently" rule (attempt 1 = the run key the ledger saw).
                refuse_changed_input(ctx, published, None)
            except LedgerError as exc:
                reason = (f"{public_message(exc)}. In Airflow: trigger this interval with the param "
                          "restate=true")
                return _refused(ctx, ledger, reason)
        try:
            return release.restate(ctx, ledger) if restate else release.reserve(ctx, ledger)
        except BudgetExceeded as exc:
            reason = budget_refusal_reason(ctx, ledger, exc)
            record_refusal(ctx, ledger, reason)
            return _refused(ctx, ledger, reason)


def compute_step(step: Step) -> dict[str, Any]:
    """Draw the noise (keyed: a retry reproduces it) and stage the output; reuse a staged output."""
    s = step.settings
    ctx = step.prepare()
    with step.ledger() as ledger:
        out = release.compute(ctx, ledger, runner=s.runner, runner_options=s.runner_options)
    return release.step_summary(out)


def validate_step(step: Step) -> dict[str, Any]:
    """The noisy output's checks (post-processing: may block the publish): dpops' GX output suite and, with
    the deployment's GX project, the team suites (``release.output_suites``, the checks publish applies)."""
    with step.ledger() as ledger:
        ctx = step.current(ledger)
    staged = ctx.store.find_staged(ctx.interval.slug, ctx.run_id)
    if staged is None:
        raise LedgerError(f"run {ctx.run_id} of {ctx.spec.name} {ctx.interval}: no staged output to validate; "
                          "clear the compute task to compute it again (keyed noise: same numbers, no new charge)")
    checks = release.check_noisy_output(ctx.spec, staged.data_file)
    from dpops.release.gx_checks import check_release_output
    from dpops.release.publication import output_suites

    quiet_third_party_loggers()
    report = check_release_output(str(staged.data_file), partition_columns=ctx.spec.partitions.columns,
                                  public_partitions=ctx.spec.public_partitions(),
                                  allow_null=ctx.spec.postprocess.suppress_below is not None)
    team = output_suites(ctx, staged, gx_checks=False) if os.environ.get("DPOPS_GX_PROJECT") else []
    return {"run_id": ctx.run_id, "checks": [*checks, "great expectations output suite", *team],
            "gx": report.as_dict()}


def publish_step(step: Step) -> release.RunOutcome:
    """Write the manifest, commit in the ledger and publish atomically (``release.publish``). The GX suite
    already ran in ``validate_step``; ``release.publish`` repeats the cheap structural checks."""
    ctx = step.prepare()
    with step.ledger() as ledger:
        return release.publish(ctx, ledger)


def record_step(step: Step, *, charged: float) -> release.RunOutcome:
    """The run's final outcome: its manifest (written by publish; found, or written once for a run
    committed by an older version) and the ledger position, for the one summary line."""
    with step.ledger() as ledger:
        ctx = step.current(ledger)
        rec = ledger.run(ctx.run_id)
        state = "published" if rec is not None and rec.state == "committed" else getattr(rec, "state", "unknown")
        pos = release.scope_position(ledger, ctx.spec.budget.scope, getattr(rec, "buckets", None))  # never raises
        # Built here rather than by dpops.release.context.make_outcome, which would log the summary line twice.
        out = release.RunOutcome(release=ctx.spec.name, interval=str(ctx.interval), state=state, run_id=ctx.run_id,
                              output_uri=getattr(rec, "output_uri", None), epsilon_charged=charged,
                              run_epsilon=getattr(rec, "epsilon", None), scope=ctx.spec.budget.scope,
                              restates=getattr(rec, "restates", None), **pos)
        release.ensure_manifest(ctx, ledger, out)
    return out


def committed_publication(step: Step) -> tuple[str, str] | None:
    """(ledger run id, commit time ISO) of the interval's committed publication (the newest version), or None.

    What ``dpops.run_notes.settled_runs`` decides from: the ledger's record, never the orchestrator's metadata.
    Reads only the ledger (no data); None also when the ledger cannot be read (the notes are best effort)."""
    try:
        with step.ledger() as ledger:
            from dpops.spec import load_spec

            spec_name = load_spec(step.spec_path).name
            rec = ledger.published(spec_name, step.interval_start, step.interval_end)
    except Exception as exc:  # noqa: BLE001 - display only; the run's own outcome is already decided
        log.warning("the interval's publication could not be read for the DAG-run notes: %s", public_message(exc))
        return None
    return None if rec is None else (rec.run_id, rec.updated_at)


def summary_line(outcome: release.RunOutcome) -> str:
    """The one ``dpops release=...`` line every outcome (published, served, refused, failed) emits."""
    return f"dpops {outcome.line()}"


def failure_outcome(step: Step, exc: BaseException) -> release.RunOutcome | None:
    """The outcome line of a step that failed with ``exc`` (best effort: None if even prepare fails)."""
    try:
        ctx = step.prepare()
    except Exception:  # noqa: BLE001
        return None
    rec = None
    pos: release.ScopePosition = {}
    unreadable = True
    try:
        with step.ledger() as ledger:
            pick_attempt(ctx, ledger)
            rec = ledger.run(ctx.run_id)
            pos = release.scope_position(ledger, ctx.spec.budget.scope, getattr(rec, "buckets", None))
            unreadable = not pos
    except Exception as read_exc:  # noqa: BLE001 - the line is best effort; the step's error propagates
        log.debug("ledger not readable for the failure line: %s", type(read_exc).__name__)
    return release.RunOutcome(release=ctx.spec.name, interval=str(ctx.interval), state="failed", run_id=ctx.run_id,
                           run_epsilon=getattr(rec, "epsilon", None), scope=ctx.spec.budget.scope,
                           ledger_state=getattr(rec, "state", None), ledger_unreadable=unreadable,
                           message=public_message(exc), **pos)


def is_fatal(exc: BaseException) -> bool:
    """Whether a retry cannot fix ``exc`` (the orchestrator should fail at once)."""
    return isinstance(exc, FATAL_ERRORS)


# --------------------------------------------------------------------------- running Beam jobs


_RUNNING_JOBS: list[Any] = []


def track_job(result: Any) -> None:
    """Remember a running Beam ``PipelineResult`` so ``cancel_running_jobs`` can cancel it on kill."""
    _RUNNING_JOBS.append(result)


def untrack_job(result: Any) -> None:
    if result in _RUNNING_JOBS:
        _RUNNING_JOBS.remove(result)


def running_jobs() -> Iterator[Any]:
    return iter(list(_RUNNING_JOBS))


def cancel_running_jobs() -> list[str]:
    """Cancel every tracked Beam job of this process (a killed task must not leave a job running on a
    cluster that keeps drawing noise and writing staged files). Returns what was cancelled."""
    done = []
    for result in _RUNNING_JOBS:
        try:
            result.cancel()
            done.append(str(getattr(result, "job_id", lambda: "?")()))
        except Exception as exc:  # noqa: BLE001 - cancel the others anyway
            log.warning("could not cancel Beam job %r: %s", result, public_message(exc))
        untrack_job(result)
    return done


__all__ = ["FATAL_ERRORS", "Settings", "Step", "cancel_running_jobs", "check_input_step", "committed_publication",
           "compute_step",
           "failure_outcome", "input_timed_out", "is_fatal", "missing_inputs",
           "requested_interval", "publish_step", "quiet_third_party_loggers",
           "record_step", "reserve_step", "summary_line", "track_job", "validate_step"]
