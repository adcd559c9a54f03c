"""Step 4, ``publish``: check the noisy output, write the manifest, commit, then make it visible.

Order (semantics.md section 5): post-processing checks on the noisy output (free to block a
publish); the manifest, written from the staged files BEFORE anything becomes visible; the
ledger commit; then the atomic, versioned publish of the staged files. The charge was already
final at ``start``; the commit records the decision to publish. A crash between the commit and the
file publish leaves a committed run whose output is not visible yet, which every retry (and every
served re-run) completes (``dpops.release.served``); ``dpops ledger recover`` never touches
committed runs. The opposite order would let recovery mark a run whose output is live as
spent_unpublished. Test-mode (seeded) output is never published.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from dpops.errors import LedgerError, StorageError
from dpops.release import manifests
from dpops.release.context import Progress, RunContext, RunOutcome, make_outcome, pick_attempt, report_stage
from dpops.release.output_checks import check_noisy_output
from dpops.release.served import check_served_files, make_visible
from dpops.storage import PUBLISHED_FILES, Location, StagedRun, as_location, files, location_uri
from dpops.storage.base import version_number

if TYPE_CHECKING:
    from dpops.ledger import Ledger


def publish(ctx: RunContext, ledger: Ledger, *, gx_checks: bool = False,
            progress: Progress | None = None) -> RunOutcome:
    """Check the noisy output, write the manifest, commit the run, then publish it atomically as the
    interval's next version (see the ordering note below)."""
    pick_attempt(ctx, ledger)
    record = ledger.run(ctx.run_id)
    if record is None:
        raise LedgerError(f"run {ctx.run_id} is not in the ledger: reserve and compute it first")
    if record.state == "committed":
        make_visible(ctx, record, ledger)
        check_served_files(ctx, record, ledger)
        return make_outcome(ctx, ledger, "already_published", record=record, message="nothing charged")
    if record.state != "started":
        raise LedgerError(f"run {ctx.run_id} is {record.state}; only a started (computed) run can be published")
    staged = ctx.store.verify_staged(ctx.interval.slug, ctx.run_id)
    if staged.test_mode:
        ledger.mark_spent_unpublished(ctx.run_id, reason="test-mode output is never published", actor=ctx.actor)
        raise StorageError(f"run {ctx.run_id} used test-mode (seeded) noise; it is never published. It is now "
                           "spent_unpublished; run with keyed or os randomness to publish")
    report_stage(progress, "check output")
    ctx.output_checks = [*check_noisy_output(ctx.spec, staged.data_location),
                         *output_suites(ctx, staged, gx_checks=gx_checks)]
    # The manifest is written BEFORE anything becomes visible (semantics.md section 5): it
    # fingerprints the staged files, and the published copies are verified byte-identical.
    report_stage(progress, "publish")
    target = ctx.store.next_version_location(ctx.interval.slug, ctx.run_id)
    manifest_path = manifests.write_manifest_before_publish(ctx, ledger, location_uri(target), staged.location,
                                                  ctx.output_checks)
    # Order: ledger commit, then the files become visible. The charge was already final at start;
    # the commit records the decision to publish. A crash in between leaves a committed run whose
    # output is not visible yet, which every retry (and every served re-run) completes through
    # ``make_visible``; `dpops ledger recover` never touches committed runs. The opposite order
    # would let recovery mark a run whose output is live as spent_unpublished.
    details: dict[str, object] = {"version": version_number(target),
               "files": {n: staged.hashes[n] for n in PUBLISHED_FILES if n in staged.hashes}}
    if manifest_path:
        from dpops.manifest.io import file_sha256

        details["manifest"] = {"file": as_location(manifest_path).name, "sha256": file_sha256(manifest_path)}
    record = ledger.commit(ctx.run_id, output_uri=location_uri(target), actor=ctx.actor, details=details)
    pub = make_visible(ctx, record, ledger)
    if pub.location.realpath() != target.realpath():  # pragma: no cover - publish refuses races first
        raise StorageError(f"run {ctx.run_id} was published to {pub.location}, not {target} as its ledger "
                           "entry and manifest say; investigate before publishing anything else for this interval")
    return make_outcome(ctx, ledger, "published", record=record, output_uri=pub.uri,
                    message=f"version v{pub.version}")


def output_suites(ctx: RunContext, staged: StagedRun, *, gx_checks: bool) -> list[str]:
    """The Great Expectations checks of the noisy staged output, by name; raises when one fails (post-processing:
    a failure may block the publish, semantics section 6). With the deployment's GX project
    (``$DPOPS_GX_PROJECT``) its checkpoint runs, sandboxed: dpops' own output suite and every team suite of the
    release (``dpops.gx_project``); without it, dpops' own suite in process when ``gx_checks``.

    One owner for the DAG's ``validate_output`` task and for ``publish`` (issue 28 item 6: a failing team suite
    passed validate_output and failed only in publish_release, after the charge): the validate task fails on
    exactly what publish would refuse, and publish checks again, since it is the gate."""
    project = os.environ.get("DPOPS_GX_PROJECT")
    if project:
        from dpops.gx_project import run_output_checkpoint

        with local_copy(ctx, staged) as data_file:  # an object-store output is copied privately first
            gx_result = run_output_checkpoint(project, ctx.spec, data_file, run_id=ctx.run_id)
        # The checkpoint's suite dpops.output.<release> IS the in-process output suite: not run twice.
        return [*(["great expectations output suite"] if gx_checks else []),
                *(f"great expectations checkpoint {gx_result.checkpoint}: suite {s}" for s in gx_result.suites)]
    if gx_checks:
        from dpops.release.gx_checks import check_release_output

        with local_copy(ctx, staged) as data_file:  # GX reads local files; an object-store output is copied privately
            check_release_output(str(data_file), partition_columns=ctx.spec.partitions.columns,
                                 public_partitions=ctx.spec.public_partitions(),
                                 allow_null=ctx.spec.postprocess.suppress_below is not None)
        return ["great expectations output suite"]
    return []


@contextmanager
def local_copy(ctx: RunContext, staged: StagedRun) -> Iterator[Path]:
    """The staged data file as a local path: itself (local backend) or a private temporary copy (0700 directory
    under the private state directory, removed afterwards) of an object-store one."""
    if staged.location.is_local:
        yield staged.data_file
        return
    import tempfile

    base = Path(getattr(ctx.store, "state_dir", None) or tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dpops-check-", dir=base) as d:
        os.chmod(d, 0o700)
        target = Path(d) / "data.parquet"
        files.copy(staged.data_location, Location.local(target))
        yield target
