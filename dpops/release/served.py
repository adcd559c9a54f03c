"""Serving a published interval: make a committed run's output visible, and refuse changed files.

A re-run of a published interval is answered from the published result and charged nothing. Two
things must hold before that answer is given:

- the committed run's output is the interval's current version (``_make_visible`` completes a
  publish interrupted between the ledger commit and the file publish: the commit comes first, so
  recovery never marks a run whose output is live as spent_unpublished);
- the published files are the ones the ledger and the manifest recorded (``check_served_files``):
  serving edited files (e.g. the noise replaced by exact values) would put dpops' name on a
  non-private release.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dpops.errors import IntegrityError, StorageError
from dpops.inputs import HmacKey
from dpops.release.context import RunContext
from dpops.release.manifests import manifests_dir
from dpops.storage import Location, PublishedRun, Store, as_location

if TYPE_CHECKING:
    from dpops.ledger import RunRecord
    from dpops.manifest.files import FileCheck


def _make_visible(ctx: RunContext, record: RunRecord) -> PublishedRun:
    """Make a committed run's output the interval's current version (idempotent; repairs a crash)."""
    slug = ctx.interval.slug
    current = ctx.store.current(slug)
    if current is not None and current.run_id == record.run_id:
        return current
    staged = ctx.store.find_staged(slug, record.run_id)
    if staged is None:
        raise StorageError(
            f"run {record.run_id} of {ctx.spec.name} {ctx.interval} is committed in the ledger but its staged "
            f"output is missing under {ctx.store.staged_interval_location(slug)}: restore the staging area from "
            "backup; nothing was charged again"
        )
    return ctx.store.publish(staged, slug, restates=record.restates,
                             extra={"spec_hash": ctx.spec.spec_hash, "randomness": ctx.randomness})


def published_file_check(store: Store, slug: str, record: RunRecord, manifest_dir: Path | Location,
                         key: HmacKey | None = None) -> FileCheck:
    """Compare a committed run's published files with the ledger's commit entry and (with the noise
    key) the manifest's keyed fingerprints. Returns a ``dpops.manifest.files.FileCheck``."""
    from dpops.manifest.files import FileCheck, check_ledger_files, check_manifest_files, merge

    version = next((v for v in store.versions(slug) if v.run_id == record.run_id), None)
    if version is None:
        return FileCheck(not_checked=[f"no published version of run {record.run_id} under "
                                      f"{store.published_interval_location(slug)}"])
    checks = [check_ledger_files(record, version.location)]
    from dpops.manifest.io import manifest_exists, read_manifest

    name = f"{record.run_id}.published.json"
    mpath = manifest_exists(manifest_dir, name)
    if key is not None and mpath is not None:
        checks.append(check_manifest_files(read_manifest(mpath), key=key, directory=version.location))
    elif key is None:
        checks.append(FileCheck(not_checked=["no noise key given: the manifest's keyed fingerprints were not checked"]))
    else:
        checks.append(FileCheck(not_checked=[f"no manifest {as_location(manifest_dir) / name}"]))
    return merge(*checks)


def check_served_files(ctx: RunContext, record: RunRecord) -> None:
    """Refuse to serve a published interval whose files changed after publication.

    Privacy reason: a re-run reports the interval as published (a DP release); if its files were
    edited (e.g. the noise replaced by exact values) serving them would put dpops' name on a
    non-private release. Nothing is charged either way."""
    key = ctx.fingerprint_key if ctx.randomness != "test" else None
    check = published_file_check(ctx.store, ctx.interval.slug, record, manifests_dir(ctx), key)
    if check.problems:
        raise IntegrityError(
            f"{ctx.spec.name} {ctx.interval}: refusing to serve run {record.run_id}: " + "; ".join(check.problems)
            + ". Restore the published files from a backup (or the staged copy) and investigate who changed them; "
            "nothing was charged")
