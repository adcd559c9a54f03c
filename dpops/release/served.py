"""Serving a published interval: make a committed run's output visible, and refuse changed files.

A re-run of a published interval is answered from the published result and charged nothing. Two
things must hold before that answer is given:

- the committed run's output is the interval's current version (``make_visible`` completes a
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
from dpops.keyref import KeyRing
from dpops.release.context import RunContext
from dpops.release.manifests import manifests_dir
from dpops.storage import Location, PublishedRun, Store, as_location

if TYPE_CHECKING:
    from dpops.ledger import Ledger, RunRecord
    from dpops.manifest.files import FileCheck


def make_visible(ctx: RunContext, record: RunRecord, ledger: Ledger) -> PublishedRun:
    """Make a committed run's output the interval's current version (idempotent; repairs a crash). The
    version's binding names ``ledger``'s id, so it verifies only against the ledger that committed it."""
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
                             extra={"spec_hash": ctx.spec.spec_hash, "randomness": ctx.randomness},
                             ledger_entry_hash=record.entry_hashes[-1] if record.entry_hashes else None,
                             ledger_id=ledger.ledger_id())


def published_file_check(store: Store, slug: str, record: RunRecord, manifest_dir: Path | Location,
                         key: HmacKey | KeyRing | None = None, *, ledger: Ledger) -> FileCheck:
    """Compare a committed run's published files with the ledger's commit entry and (with the noise
    key) the manifest's keyed fingerprints, and every version and the ``current`` pointer of the
    interval with the ledger's committed runs (``dpops.manifest.files.check_published_pointer``: a
    forged version or a moved pointer is a problem naming the version). Returns a ``FileCheck``."""
    from dpops.manifest.files import (
        FileCheck,
        check_ledger_files,
        check_manifest_files,
        check_published_pointer,
        merge,
    )

    pointer = check_published_pointer(store, slug, ledger, record, key=key)
    version = next((v for v in store.versions(slug) if v.run_id == record.run_id), None)
    if version is None:
        return merge(pointer, FileCheck(not_checked=[f"no published version of run {record.run_id} under "
                                                     f"{store.published_interval_location(slug)}"]))
    checks = [pointer, check_ledger_files(record, version.location)]
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


def check_served_files(ctx: RunContext, record: RunRecord, ledger: Ledger) -> None:
    """Refuse to serve a published interval whose files changed after publication, or whose
    ``current`` pointer names a version the ledger did not commit as the interval's newest run.

    Privacy reason: a re-run reports the interval as published (a DP release); if its files were
    edited (e.g. the noise replaced by exact values), or ``current`` was moved to a forged version,
    serving them would put dpops' name on a non-private release. Nothing is charged either way."""
    key = ctx.fingerprint_key if ctx.randomness != "test" else None
    check = published_file_check(ctx.store, ctx.interval.slug, record, manifests_dir(ctx), key, ledger=ledger)
    if check.problems:
        raise IntegrityError(
            f"{ctx.spec.name} {ctx.interval}: refusing to serve run {record.run_id}: " + "; ".join(check.problems)
            + ". Restore the published files from a backup (or the staged copy), remove any version the ledger did "
            "not commit, point current at the newest committed run's version, and investigate who changed them; "
            "nothing was charged")
