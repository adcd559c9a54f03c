"""The whole run: the steps chained for ``dpops release run`` / ``restate``, and the operator actions.

The Airflow DAG calls the steps one by one (each task re-runs ``prepare``, which writes nothing);
``execute_release`` chains them:

1. ``prepare``  (``preparation``) checks everything without touching the ledger.
2. ``reserve``  (``reservation``) serves, refuses, or reserves the plan's events.
3. ``compute``  (``computation``) draws the noise after ``ledger.start``.
4. ``publish``  (``publication``) checks, writes the manifest, commits, publishes.
5. ``restate``  the explicit operator action for a published interval whose input changed:
                a new run key, a fresh charge, linked to the run it corrects.

``estimate`` chains the same steps for the estimation release kind (``estimation``: a private bound
estimation, ``dpops estimate``); ``estimate_bounds`` is its notebook form.

A failure before any noise was drawn refunds the reservation (semantics.md section 4); after
``start`` the charge stays. ``abandon`` gives up an unpublished run the same way; a publication is
never withdrawn. Every run logs ONE outcome line (the steps' own lines are DEBUG inside a run).
``status`` reads only the ledger and the storage, never private data.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypedDict, Unpack

from dpops.errors import BudgetExceeded, DpopsError, LedgerError, NeedsOperator, public_message
from dpops.inputs import HmacKey
from dpops.keyref import KeyRing
from dpops.release.computation import RunRelease, check_runner, compute_staged
from dpops.release.context import (
    QUIET_RUNS,
    IntervalBound,
    NoiseKeyLike,
    Progress,
    RunContext,
    RunOutcome,
    log,
    log_failure,
    make_outcome,
    pick_attempt,
    report_stage,
)
from dpops.release.estimation import (
    DEFAULT_ENGINE,
    EstimationEngine,
    refuse_os_randomness,
    release_estimation_engine,
    run_estimation,
)
from dpops.release.manifests import ensure_manifest, spec_manifests_dir
from dpops.release.preparation import Planner, named_interval, prepare
from dpops.release.publication import publish
from dpops.release.refusals import budget_refusal_reason, record_refusal
from dpops.release.reservation import reserve
from dpops.release.served import check_served_files, make_visible, published_file_check
from dpops.spec import load_spec
from dpops.storage import open_store

if TYPE_CHECKING:
    from dpops.analysis.estimate import Estimate, EstimateConfig
    from dpops.events import PrivacyEvent
    from dpops.inputs import Interval
    from dpops.ledger import Ledger
    from dpops.storage import Store


class _StepOptions(TypedDict, total=False):
    """``_run_steps``'s keyword arguments (those of ``_run_steps_quiet``)."""

    publish_output: bool
    runner: str
    runner_options: Sequence[str]
    run_release: RunRelease | None
    gx_checks: bool
    restates: str | None
    reserved: RunOutcome | None
    fresh_attempt: str | None
    write_manifest: bool
    progress: Progress | None


def _release_before_start(ctx: RunContext, ledger: Ledger, exc: BaseException) -> None:
    """A failure before any noise was drawn refunds the reservation (semantics.md section 4)."""
    try:
        rec = ledger.run(ctx.run_id)
        if rec is not None and rec.state == "reserved":
            reason = public_message(exc)  # the ledger and the log keep no input data (dpops.errors)
            ledger.release(ctx.run_id, reason=f"failed before any mechanism ran: {reason}"[:500], actor=ctx.actor)
            log.info("release=%s interval=%s outcome=released run=%s reason=%s", ctx.spec.name, ctx.interval,
                     ctx.run_id, reason)
    except Exception:  # noqa: BLE001 - keep the original error; `dpops ledger recover` releases it later
        log.exception("could not release the reservation of run %s", ctx.run_id)


def _run_steps(ctx: RunContext, ledger: Ledger, **kwargs: Unpack[_StepOptions]) -> RunOutcome:
    token = QUIET_RUNS.set(True)
    try:
        out = _run_steps_quiet(ctx, ledger, **kwargs)
    except BaseException as exc:
        QUIET_RUNS.reset(token)
        _record_failure(ctx, ledger, exc, write_manifest=kwargs.get("write_manifest", True))
        raise
    QUIET_RUNS.reset(token)
    log.info(out.line())
    return out


def _record_failure(ctx: RunContext, ledger: Ledger, exc: BaseException, *, write_manifest: bool = True) -> None:
    """What every CLI entry point leaves for a run that stopped with ``exc``: a budget refusal's manifest
    (``dpops gaps`` says "refused" and a reviewer sees what was asked; the same record the Airflow DAG
    leaves through ``dpops.orchestration.reserve_step``), the one failure line, and the outcome for ``--json``."""
    if isinstance(exc, BudgetExceeded) and write_manifest:
        record_refusal(ctx, ledger, budget_refusal_reason(ctx, ledger, exc))
    failed = log_failure(ctx, ledger, exc)
    try:
        setattr(exc, "dpops_outcome", failed)  # noqa: B010 - the CLI's --json error object shows it
    except AttributeError:  # pragma: no cover
        pass


def _run_steps_quiet(ctx: RunContext, ledger: Ledger, *, publish_output: bool, runner: str,
                     runner_options: Sequence[str], run_release: RunRelease | None, gx_checks: bool,
                     restates: str | None, reserved: RunOutcome | None = None, write_manifest: bool = True,
                     progress: Progress | None = None, fresh_attempt: str | None = None) -> RunOutcome:
    ctx.write_manifest = write_manifest
    if reserved is None:
        check_runner(runner, runner_options, run_release)  # before reserve: a bad runner costs nothing
        report_stage(progress, "reserve")
        reserved = reserve(ctx, ledger, restates=restates, fresh_attempt=fresh_attempt)
    if reserved.state == "already_published":
        if write_manifest:
            ensure_manifest(ctx, ledger, reserved)
        return reserved
    try:
        staged = compute_staged(ctx, ledger, runner=runner, runner_options=runner_options, run_release=run_release,
                                progress=progress)
    except BaseException as exc:
        _release_before_start(ctx, ledger, exc)
        raise
    if not publish_output:
        rec = ledger.run(ctx.run_id)
        return make_outcome(ctx, ledger, "staged", record=rec, charged=reserved.epsilon_charged,
                        output_uri=staged.directory.resolve().as_uri(),
                        message="computed and staged; publish with --publish (no new charge)")
    out = publish(ctx, ledger, gx_checks=gx_checks, progress=progress)
    out.epsilon_charged = reserved.epsilon_charged
    if write_manifest:
        ensure_manifest(ctx, ledger, out, ctx.output_checks)
    return out


def execute_release(spec_path: str | os.PathLike[str], interval_start: IntervalBound,
                    interval_end: IntervalBound = None, *, ledger: Ledger, randomness: str = "keyed",
                    key_path: str | None = None,
                    test_seed: int | None = None, key: NoiseKeyLike | None = None, runner: str = "FnApiRunner",
                    runner_options: Sequence[str] = (), publish_output: bool = True,
                    run_release: RunRelease | None = None, planner: Planner | None = None,
                    gx_checks: bool = False, actor: str | None = None, progress: Progress | None = None,
                    fresh_attempt: str | None = None, previous_key_paths: Sequence[str] = (),
                    estimation_staging: str | None = None) -> RunOutcome:
    """``dpops release run``: prepare, reserve, compute, publish. Safe to call again after any failure.

    ``progress`` is called with each stage name of ``STAGES`` as the run reaches it. ``fresh_attempt``
    (the operator's reason): replace the interval's spent_unpublished run by a fresh attempt, with fresh
    noise and a new charge, linked to the spent run (``dpops.release.context.pick_attempt``).
    ``previous_key_paths``: noise keys of earlier rotations (default ``$DPOPS_PREVIOUS_NOISE_KEY_FILES``): an
    interval published under one of them is served when its input is unchanged under that key.
    ``estimation_staging``: a spec with ``bounds: estimate`` estimates on ``runner`` with its scratch there
    (``dpops.release.estimation.release_estimation_engine``; None: in this process)."""
    # the pipeline's import (Beam: ~1-3 CPU-s) runs while another thread hashes the input for its fingerprint
    warm = None if run_release is not None else _import_pipeline
    ctx = prepare(spec_path, interval_start, interval_end, randomness=randomness, key_path=key_path,
                  test_seed=test_seed, key=key, planner=planner, actor=actor, progress=progress, ledger=ledger,
                  while_hashing=warm,
                  estimation_engine=release_estimation_engine(runner, runner_options, estimation_staging))
    if previous_key_paths:
        ctx.previous_key_paths = tuple(previous_key_paths)
    return _run_steps(ctx, ledger, publish_output=publish_output, runner=runner, runner_options=runner_options,
                      run_release=run_release, gx_checks=gx_checks, restates=None, progress=progress,
                      fresh_attempt=fresh_attempt)


def restate(ctx: RunContext, ledger: Ledger) -> RunOutcome:
    """The restatement's reserve step: explicitly re-release a published interval whose input (or spec)
    changed. A new run key, a fresh charge, linked (``restates``) to the run it corrects; ``compute`` and
    ``publish`` then publish it as the interval's next version."""
    pick_attempt(ctx, ledger)
    published = ledger.published(ctx.spec.name, ctx.interval.start_iso, ctx.interval.end_iso)
    if published is None:
        rec = ledger.run(ctx.run_id)
        if rec is not None and rec.state == "spent_unpublished":
            from dpops.release.reservation import spent_message

            raise NeedsOperator(f"{ctx.spec.name} {ctx.interval} has not been published, so there is nothing to "
                                f"restate; {spent_message(ctx)}")
        raise NeedsOperator(f"{ctx.spec.name} {ctx.interval} has not been published: nothing to restate; "
                            "use dpops release run")
    if published.run_id == ctx.run_id:
        make_visible(ctx, published, ledger)  # completes a restatement killed between its commit and the file publish
        check_served_files(ctx, published, ledger)
        return make_outcome(ctx, ledger, "already_published", record=published,
                        message="input, spec and key unchanged: the published result stands, nothing charged")
    ctx.restates = published.run_id  # a refusal of this reservation records the link (RunContext.restates)
    return reserve(ctx, ledger, restates=published.run_id)


def _import_pipeline() -> None:
    """Import the release pipeline and the runner check (what ``compute_staged`` and ``check_runner`` load), the
    planner's noise modules and the manifest's schema validator: code and public schema only, nothing of the run
    (speed: at 10M rows the hashing outlasted the pipeline's import by ~0.25 s, which this fills)."""
    from dpops.manifest.schema import manifest_validator
    from dpops.noise import mechanisms, selection  # noqa: F401 - imported for plan_release, which imports them late
    from dpops.release.computation import RUNNER_CHECK
    from dpops.release.pipeline_seam import import_pipeline_module, load_run_release

    load_run_release()
    import_pipeline_module(RUNNER_CHECK.split(":")[0])
    manifest_validator()


def execute_restatement(spec_path: str | os.PathLike[str], interval_start: IntervalBound,
                        interval_end: IntervalBound = None, *, ledger: Ledger, randomness: str = "keyed",
                        key_path: str | None = None, key: NoiseKeyLike | None = None,
                        runner: str = "FnApiRunner", runner_options: Sequence[str] = (),
                        run_release: RunRelease | None = None,
                        planner: Planner | None = None,
                        gx_checks: bool = False, actor: str | None = None,
                        progress: Progress | None = None, estimation_staging: str | None = None) -> RunOutcome:
    """``dpops release restate``: prepare, restate (reserve linked to the published run), compute, publish.
    ``estimation_staging`` as ``execute_release``."""
    ctx = prepare(spec_path, interval_start, interval_end, randomness=randomness, key_path=key_path, key=key,
                  planner=planner, actor=actor, progress=progress, ledger=ledger, restate=True,
                  estimation_engine=release_estimation_engine(runner, runner_options, estimation_staging))
    token = QUIET_RUNS.set(True)
    report_stage(progress, "reserve")
    try:
        first = restate(ctx, ledger)
    except BaseException as exc:
        QUIET_RUNS.reset(token)
        # A refused restatement leaves the refusal manifest `dpops release run` and the DAG leave (issue 28 item 1)
        _record_failure(ctx, ledger, exc)
        raise
    QUIET_RUNS.reset(token)
    if first.state == "already_published":
        log.info(first.line())
        return first
    return _run_steps(ctx, ledger, publish_output=True, runner=runner, runner_options=runner_options,
                      run_release=run_release, gx_checks=gx_checks, restates=first.restates, reserved=first,
                      progress=progress)


def abandon(ctx: RunContext, ledger: Ledger, *, reason: str) -> RunOutcome:
    """Explicitly give up an unpublished run: a reservation is refunded (no noise was drawn), a started
    run is marked spent_unpublished (its noise may exist, so the charge stays). Published runs are final."""
    pick_attempt(ctx, ledger)
    rec = ledger.run(ctx.run_id)
    if rec is None:
        raise LedgerError(f"run {ctx.run_id} of {ctx.spec.name} {ctx.interval} is not in the ledger: "
                          "nothing to abandon")
    if rec.state == "reserved":
        rec = ledger.release(ctx.run_id, reason=f"abandoned by operator: {reason}", actor=ctx.actor)
    elif rec.state == "started":
        rec = ledger.mark_spent_unpublished(ctx.run_id, reason=f"abandoned by operator: {reason}", actor=ctx.actor)
    elif rec.state == "committed":
        raise LedgerError(f"run {ctx.run_id} is published; a publication is never withdrawn (restate it instead)")
    return make_outcome(ctx, ledger, rec.state, record=rec, message=f"abandoned: {reason}")


def status(spec_path: str | os.PathLike[str], interval_start: IntervalBound, interval_end: IntervalBound = None, *,
           ledger: Ledger, key: HmacKey | KeyRing | None = None) -> dict[str, object]:
    """What the ledger and the storage say about a release's interval. Reads no private data.

    ``published_files``: the published run's files compared with the ledger's commit entry and, given
    the noise ``key``, with the manifest's keyed fingerprints (``ok`` False names each changed file)."""
    spec = load_spec(spec_path)
    iv = named_interval(spec, interval_start, interval_end)  # one START, as the CLI takes it
    store = open_store(spec.output_root, spec.name)
    runs = ledger.runs(release=spec.name, interval_start=iv.start_iso, interval_end=iv.end_iso)
    published = ledger.published(spec.name, iv.start_iso, iv.end_iso)
    try:
        remaining = float(ledger.status(spec.budget.scope).remaining)
    except DpopsError:
        remaining = None
    return {
        "release": spec.name, "interval": str(iv), "scope": spec.budget.scope, "scope_remaining": remaining,
        "ledger_id": ledger.ledger_id(),  # what readers pin (dpops release check-pointer --ledger-id)
        "published_run": published.run_id if published else None,
        "output_uri": published.output_uri if published else None,
        "versions": [{"version": v.version, "run_id": v.run_id, "restates": v.restates, "published_at": v.published_at}
                     for v in store.versions(iv.slug)],
        "runs": [{"run_id": r.run_id, "state": r.state, "epsilon": r.epsilon, "restates": r.restates,
                  "key_id": r.key.key_id, "created_at": r.created_at, "updated_at": r.updated_at} for r in runs],
        "published_files": published_file_check(
            store, iv.slug, published, spec_manifests_dir(spec), key, ledger=ledger).to_dict()
        if published is not None else _uncommitted_versions(store, iv, spec.name, ledger),
    }


def estimate(spec_path: str | os.PathLike[str], interval_start: IntervalBound, interval_end: IntervalBound = None, *,
             config: EstimateConfig, ledger: Ledger, randomness: str = "keyed", key_path: str | None = None,
             test_seed: int | None = None, actor: str | None = None,
             then_charges: Sequence[PrivacyEvent] = (), serve_only: bool = False,
             for_release: bool = False, engine: str | EstimationEngine = DEFAULT_ENGINE) -> Estimate:
    """``dpops estimate``: prepare the spec as written (``for_estimation``), then reserve, start, compute and
    commit the estimation (``dpops.release.estimation.run_estimation``; keywords as ``reserve_estimation``;
    ``engine``: ``beam`` (default) or ``driver``, or an ``EstimationEngine``, as ``compute_estimation``).

    os randomness is refused before anything is read: its noise cannot be reproduced, so a retry would be
    charged again."""
    refuse_os_randomness(randomness)
    ctx = prepare(spec_path, interval_start, interval_end, randomness=randomness, key_path=key_path,
                  test_seed=test_seed, actor=actor, for_estimation=True)
    return run_estimation(ctx, config, ledger, then_charges=then_charges, serve_only=serve_only,
                          for_release=for_release, engine=engine)


def estimate_bounds(spec_path: str | os.PathLike[str], interval: str, *, epsilon: float,
                    ledger: Ledger | str | None = None, quantile: float = 0.99, contribution: bool = True,
                    columns: Sequence[str] | None = None, randomness: str = "keyed", key_path: str | None = None,
                    test_seed: int | None = None, actor: str | None = None, method: str = "error/1") -> Estimate:
    """The notebook form of ``dpops estimate``: L0, Linf and value bounds under DP over one interval of the spec's
    input, charged to its scope like a release (``estimate``, the function the CLI calls). ``method``: ``error/1``
    (the bounds minimising the release's predicted error, the CLI's default) or ``quantile/1`` (each bound at
    ``quantile``).

    ``interval``: ``START/END`` or the start of one period; ``ledger``: a ``Ledger``, a URL, or None for
    ``$DPOPS_LEDGER_URL`` / the default file. ``Estimate.patch()`` is the spec patch (with ``estimated_from``).
    It lives here, not in ``dpops.analysis``, because it reads private data and charges the ledger; the
    analysis package keeps the pure mechanisms (``dpops.analysis.estimate_l0``, ``EstimateConfig``)."""
    from dpops.analysis.estimate import EstimateConfig
    from dpops.ledger import Ledger as LedgerClass
    from dpops.release.context import open_run_ledger
    from dpops.release.preparation import requested_interval

    iv = requested_interval(spec_path, interval)
    config = EstimateConfig(epsilon=epsilon, quantile=quantile, contribution=contribution,
                            columns=tuple(columns) if columns is not None else None, method=method)
    if isinstance(ledger, LedgerClass):
        return estimate(spec_path, iv.start, iv.end, config=config, ledger=ledger, randomness=randomness,
                        key_path=key_path, test_seed=test_seed, actor=actor)
    with open_run_ledger(ledger) as led:
        return estimate(spec_path, iv.start, iv.end, config=config, ledger=led, randomness=randomness,
                        key_path=key_path, test_seed=test_seed, actor=actor)


def _uncommitted_versions(store: Store, iv: Interval, release: str, ledger: Ledger) -> dict[str, object] | None:
    """``published_files`` of an interval the ledger never committed: None when storage holds nothing for it,
    else the pointer check's findings (every version there is a forgery: ``check_interval_pointer``).

    Privacy reason (issue 25 item 10): a version written on a never-committed (refused, never run) day must
    fail ``release status`` (exit 7) like any other forgery, not pass because there was no run to compare."""
    from dpops.manifest.files import check_interval_pointer

    check = check_interval_pointer(store, iv.slug, ledger, release, iv.start_iso, iv.end_iso)
    return check.to_dict() if check.problems else None
