"""Step 3, ``compute``: the only step that draws noise, bracketed by the ledger's ``start``.

Reuse a sealed staged output of this run (a retry: nothing drawn or charged again), else
``ledger.start`` and run the pipeline (``pipelines.release_pipeline:run_release``, imported lazily
by its dotted name: ``dpops`` never imports Beam). Everything that can fail without drawing noise
happens before ``start`` (runner and endpoints checked, input fingerprint re-checked), so such a
failure is refunded; after ``start`` the charge is final. The input's keyed fingerprint is
re-checked before sealing too: a file swapped during the computation would otherwise publish a
release of other data under this run's key.

Retries (semantics.md section 3):

- keyed mode: noise is a function of (key, run key); the run key contains the input
  fingerprint. A retry after ``start`` recomputes the same noise over the same input,
  reveals nothing new and is not charged again.
- os mode: fresh OS randomness cannot be reproduced. A run that started but left no
  sealed staged output is marked ``spent_unpublished`` (its noise may exist somewhere)
  and the next invocation reserves a NEW attempt (``key_id`` ``os/attempt-N``, so a
  new run id) with a fresh charge. The operator sees this in the error and the ledger.
- test mode: seeded noise, runs through the ledger like any other run (it did read
  private data) but its output can never be published.

A pipeline error's text may quote an input cell, so it never leaves this process: a full or
read-only disk becomes a ``StorageError``, anything else an ``InternalError`` naming only the
exception type and place (``DPOPS_DEBUG=1`` shows the text on a trusted terminal).
"""

from __future__ import annotations

import errno
import os
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dpops.errors import DEBUG_ENV, DpopsError, InputDataError, InternalError, LedgerError, NeedsOperator, StorageError
from dpops.inputs import (
    input_fingerprint,
    input_stat_snapshot,
    public_file_rows,
    read_digest_tag,
    snapshot_locations,
)
from dpops.release.context import Progress, RunContext, RunOutcome, log, make_outcome, pick_attempt, report_stage
from dpops.release.pipeline_seam import ComputeRequest, ComputeResult, import_pipeline_module, load_run_release
from dpops.spec import load_spec
from dpops.storage import Location, StagedRun, as_location, location_uri

if TYPE_CHECKING:
    from dpops.ledger import Ledger

RUNNER_CHECK = "pipelines.runner_check:check_runner"
# The pipeline entry point: ``run_release(request) -> result`` (tests and library callers inject their own).
RunRelease = Callable[[ComputeRequest], ComputeResult]


def _load_run_release() -> RunRelease:
    """The real pipeline (tests patch this name in this module: ``compute_staged`` looks it up here)."""
    return load_run_release()


def check_runner(runner: str, runner_options: Sequence[str], run_release: RunRelease | None = None) -> str:
    """Validate the Beam runner, its options and endpoints (``pipelines.runner_check``, imported lazily:
    dpops never imports Beam); returns the runner name to hand to the pipeline.

    Called before ``reserve`` and before ``ledger.start``: an os-mode run is charged once started, so a
    typo'd runner or a dead job endpoint must fail (RunnerError, exit 6, bounded connect timeout) before
    that. An injected ``run_release`` (tests, a library caller) owns its runner and is not checked.
    """
    if run_release is not None:
        return runner
    mod_name, func = RUNNER_CHECK.split(":")
    checked = getattr(import_pipeline_module(mod_name), func)(runner, tuple(runner_options))
    return str(checked.runner)


def _compute_request(ctx: RunContext, staging_dir: Location, runner: str,
                     runner_options: Sequence[str]) -> ComputeRequest:
    # expected_plan_hash: the pipeline refuses to draw noise if the plan it derives differs from the reserved one.
    return ComputeRequest(
        spec_path=ctx.spec_path, interval_start=ctx.interval.start_iso, interval_end=ctx.interval.end_iso,
        input_paths=tuple(ctx.input_paths), noise_label=ctx.noise_label, randomness=ctx.randomness,
        key_ref=ctx.key_path if ctx.randomness == "keyed" else None, test_seed=ctx.test_seed,
        key_id=ctx.key_id if ctx.randomness == "keyed" else None,
        staging_dir=str(staging_dir), runner=runner, runner_options=tuple(runner_options),
        expected_plan_hash=getattr(ctx.plan, "plan_hash", None),
        estimated_from=ctx.spec.estimated_from if ctx.estimated_bounds is not None else None,
        estimated_bounds=tuple((c, float(lo), float(hi))
                               for c, (lo, hi) in sorted((ctx.estimated_bounds or {}).items())),
    )


def compute(ctx: RunContext, ledger: Ledger, *, runner: str = "FnApiRunner", runner_options: Sequence[str] = (),
            run_release: RunRelease | None = None) -> RunOutcome:
    """Produce (or find) the sealed staged output of this run. Needs a reservation (``reserve`` first)."""
    staged = compute_staged(ctx, ledger, runner=runner, runner_options=runner_options, run_release=run_release)
    return make_outcome(ctx, ledger, "staged", record=ledger.run(ctx.run_id),
                    output_uri=location_uri(staged.location), message="noisy output staged, not yet published")


def compute_staged(ctx: RunContext, ledger: Ledger, *, runner: str = "FnApiRunner", runner_options: Sequence[str] = (),
                   run_release: RunRelease | None = None, progress: Progress | None = None) -> StagedRun:
    """``compute`` returning the ``StagedRun`` itself."""
    pick_attempt(ctx, ledger)
    record = ledger.run(ctx.run_id)
    if record is None:
        raise LedgerError(f"run {ctx.run_id} of {ctx.spec.name} {ctx.interval} is not reserved: reserve it first")
    staged = ctx.store.find_staged(ctx.interval.slug, ctx.run_id)
    if staged is not None and record.state == "reserved":
        # Sealed output exists only after ``start``, so this ledger never started this run: another ledger
        # (sharing this output root) or a ledger restored from an older backup computed it. No mechanism ran
        # under this reservation, so it is refunded rather than left stuck (issue 13).
        msg = (f"run {ctx.run_id} of {ctx.spec.name} {ctx.interval}: "
               f"{ctx.store.staged_interval_location(ctx.interval.slug)} "
               "holds a staged output of this run that this ledger never started: another ledger shares this "
               "output root (or this ledger was restored from an older backup). The reservation was refunded. "
               "Use one ledger per output root: run with the ledger that computed it, or give this release "
               "its own output.root")
        ledger.release(ctx.run_id, reason="staged output computed under another ledger; nothing drawn here",
                       actor=ctx.actor)
        raise LedgerError(msg)
    if staged is not None:
        return staged  # a retry: the noisy output exists; reuse it, nothing drawn or charged again
    if record.state == "spent_unpublished":
        from dpops.release.reservation import spent_message

        raise NeedsOperator(spent_message(ctx))
    if record.state in ("committed", "released"):
        raise LedgerError(f"run {ctx.run_id} is {record.state}; it cannot be computed again")
    if record.state == "started" and ctx.randomness == "os":
        # Fresh noise may have been drawn and cannot be reproduced: the charge stays, the attempt is closed.
        ledger.mark_spent_unpublished(ctx.run_id, reason="os-mode run started but left no staged output; "
                                      "fresh noise cannot be recomputed under the same charge", actor=ctx.actor)
        raise LedgerError(
            f"os-mode run {ctx.run_id} (attempt {ctx.attempt}) of {ctx.spec.name} {ctx.interval} had started but "
            "left no staged output; it is now spent_unpublished (the charge stays). Run again to reserve a new "
            "attempt with a fresh charge, or use keyed randomness, whose retries are free"
        )
    # Everything that can fail without drawing noise happens before start, so such a failure is refunded.
    fn = run_release or _load_run_release()
    runner = check_runner(runner, runner_options, run_release)
    if record.state == "reserved":
        check_input_unchanged(ctx, "before the computation started; nothing was drawn, the reservation is refunded",
                               snapshot_suffices=True)
    # The staging location is a local directory or an object-store prefix; the pipeline gets it as a str
    # (ComputeRequest.staging_dir) and writes data.parquet + summary.json there through Beam FileSystems.
    tmp = ctx.store.new_staging(ctx.interval.slug, ctx.run_id)
    try:
        if record.state == "reserved":
            # right before the first noise is drawn: no refund after this
            ctx.note_ledger(ledger.start(ctx.run_id, actor=ctx.actor))
    except BaseException:
        ctx.store.discard_staging(tmp)
        raise
    try:
        try:
            report_stage(progress, "read, bound and noise")
            result = fn(_compute_request(ctx, tmp, runner, runner_options))
        except DpopsError:
            raise
        except Exception as exc:  # Beam wraps worker errors; a full or read-only disk is not a bug
            storage = storage_error_from(exc, tmp)
            if storage is not None:
                raise storage from None
            if os.environ.get(DEBUG_ENV):
                raise
            # A bug inside the pipeline: its text (and its chained causes, which Airflow prints) may quote
            # a cell, so neither leaves this process (dpops.errors.public_message).
            last = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
            where = f" at {Path(last.filename).name}:{last.lineno}" if last else ""
            raise InternalError(f"internal error in the release pipeline: {type(exc).__name__}{where} (a bug, "
                                f"please report it; the error text is withheld because it may quote input data, "
                                f"{DEBUG_ENV}=1 shows it on a trusted terminal)") from None
        for f in (result.output_file, result.summary_file):
            if as_location(f).realpath().parent != tmp.realpath():
                raise StorageError(f"the pipeline wrote {f} outside its staging directory {tmp}")
        # The output is sealed only if the input is still the one the run was reserved with (its
        # fingerprint is in the run key and the noise label): a file swapped during the computation
        # would publish a release of other data under this run's key.
        checked = check_input_unchanged(
            ctx, "while the pipeline read it; noise was drawn, so the run stays charged and its output is discarded",
            read_digests=[result.read_digests], read_digest_salt=result.read_digest_salt)
        report_stage(progress, "write")
        internal = {**(result.internal or {}), "input_check_after_read": checked}
        staged = ctx.store.finish_staging(tmp, ctx.interval.slug, ctx.run_id, internal,
                                          test_mode=ctx.randomness == "test")
    except BaseException:
        ctx.store.discard_staging(tmp)
        if ctx.randomness == "os":
            try:
                ledger.mark_spent_unpublished(ctx.run_id, reason="os-mode computation failed after start",
                                              actor=ctx.actor)
            except Exception:  # noqa: BLE001 - keep the original error; recover() will close the run
                log.exception("could not mark run %s spent_unpublished", ctx.run_id)
        raise
    return staged


def check_input_unchanged(ctx: RunContext, when: str, snapshot_suffices: bool = False,
                          read_digests: Sequence[Mapping[str, tuple[int, str]]] = (), read_digest_salt: bytes = b"",
                          ) -> str:
    """Fail (InputDataError) if the input files no longer have the keyed fingerprint of the run key; else say
    what the check compared (``"snapshot"``, ``"reader_digests"`` or ``"hashed_again"``: the release keeps it in
    its internal run log as ``input_check_after_read``).

    One rule for every charged read of an interval's input: the release (``compute_staged``) and the estimation
    (``dpops.release.estimation``), each before its ``ledger.start`` (``snapshot_suffices``) and after its read.

    ``snapshot_suffices`` (the check before ``start`` only): when this process's ``prepare`` took a stat
    snapshot of local inputs and they still show the same one (device, inode, size, mtime, ctime), the second
    hashing pass is skipped (at 10M CSV rows it is 0.7 s of a 6 s release). Why that is safe there and only
    there: this check decides between a refund and a charge, nothing is published on it; the check after the
    computation always compares bytes (the reader's digests or a second hash), and it alone guards against a
    run key naming other data (the keyed noise of two different inputs under one key). A public file is re-read
    as before (its rows are in the fingerprint). After the computation the snapshot is compared TOO (not
    instead): a file swapped during the pipeline's read and put back before the hash hashes as the key's but
    moved its ctime.

    ``read_digests`` (the check after the computation only): one mapping per read of the input (the release's
    pipeline: one; the estimation: each counting pass, or its driver read), the (size, salted tag) of the bytes
    that read consumed, per input file (``ComputeResult.read_digests``, ``CountedPass.read_digests``: CSV files
    read to their end; the tag is ``dpops.inputs.read_digest_tag`` under ``read_digest_salt``). Every digest
    given is compared with the digests of this process's fingerprint pass (``RunContext.input_digests``), and
    any difference refuses: the output was computed from other bytes than the run key names, even if the file
    at the path hashes as the key's (a file changed and restored while the pipeline read it, a view that
    changed under the reader). When every read has a digest of every input file and the spec has no public
    file, equal digests prove the output was computed from exactly the bytes the run key names, which is what
    the hash after the read stood in for, and the input is not hashed again. Otherwise (Parquet, a context
    prepared in another process, a digest a runner lost) it is hashed again as before; the snapshot is
    compared first either way."""
    assert ctx.fingerprint_key is not None  # prepare always sets it
    moved = (ctx.input_stats is not None
             and input_stat_snapshot(snapshot_locations(ctx.spec, ctx.input_paths)) != ctx.input_stats)
    if (snapshot_suffices and ctx.input_stats is not None and ctx.spec.partitions.public_file is None
            and not moved):
        return "snapshot"
    if not snapshot_suffices and moved:
        # After the computation the hash alone cannot see a file swapped while the pipeline read it and put back
        # before this check (rename the checked file aside, another in its place, then back): the bytes hash as the
        # key's, but the pipeline read other data, and its output would be published under this run's key (so
        # with the noise a release of the key's own data draws: their difference is exact). Any such write, rename
        # or truncation moves the ctime, which no user can set back, so a changed snapshot refuses too.
        raise InputDataError(
            f"{ctx.spec.name} {ctx.interval}: the input files changed since the run was prepared ({when}); "
            f"nothing is published. Run again when the input is final: a new input is a new run (and charge)"
        )
    if not snapshot_suffices and read_digests and read_digest_salt:
        def expected(p: str) -> tuple[int, str] | None:
            if p not in ctx.input_digests:
                return None
            size, sha = ctx.input_digests[p]
            return size, read_digest_tag(read_digest_salt, size, sha)

        known = {p: expected(p) for p in ctx.input_paths}  # None: no fingerprint digest here (another process)
        for read in read_digests:
            # A digest of a path the run was not prepared with, or one that differs: that read consumed other
            # bytes than the run key names (never excused by the file hashing as the key's now).
            if any(p not in known or (known[p] is not None and tuple(d) != known[p]) for p, d in read.items()):
                raise InputDataError(
                    f"{ctx.spec.name} {ctx.interval}: the pipeline read input bytes other than those the run was "
                    f"prepared with ({when}); nothing is published. Run again when the input is final: a new "
                    "input is a new run (and charge)"
                )
        if (ctx.spec.partitions.public_file is None and ctx.input_paths
                and all(known[p] is not None and p in read for read in read_digests for p in ctx.input_paths)):
            return "reader_digests"
    try:
        # The public file is read again (the pipeline re-loads the spec): for a file the operator did not mark
        # publishable, spec_hash holds only its row count, so only this keyed fingerprint sees a changed list.
        public = public_file_rows(load_spec(ctx.spec_path)) if ctx.spec.partitions.public_file is not None else None
        now = input_fingerprint(ctx.input_paths, ctx.fingerprint_key, public)
    except DpopsError as exc:
        raise InputDataError(f"{ctx.spec.name} {ctx.interval}: the input cannot be re-read to check its fingerprint "
                             f"({when}): {exc}") from None
    if now != ctx.input_fingerprint:
        raise InputDataError(
            f"{ctx.spec.name} {ctx.interval}: the input files changed since the run was prepared ({when}); "
            f"nothing is published. Run again when the input is final: a new input is a new run (and charge)"
        )
    return "hashed_again"


_DISK_ERRORS = {errno.ENOSPC: "the disk is full", errno.EROFS: "the file system is read-only",
                errno.EDQUOT: "the disk quota is exceeded"}


def storage_error_from(exc: BaseException, where: Path | Location) -> StorageError | None:
    """A StorageError (exit 6) if ``exc`` is, or wraps, a full/read-only disk error; else None."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    found = None
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in _DISK_ERRORS:
            found = _DISK_ERRORS[cur.errno]
            break
        cur = cur.__cause__ or cur.__context__
    if found is None:  # Beam re-raises worker errors as RuntimeError with only the text kept
        text = str(exc)
        for code, words in _DISK_ERRORS.items():
            if os.strerror(code) in text:
                found = words
                break
    if found is None:
        return None
    return StorageError(f"the pipeline could not write its staged output under {where}: {found}. Noise was drawn, "
                        "so the run stays charged (started); fix the disk and run again: keyed noise reproduces "
                        "the same output at no new charge")
