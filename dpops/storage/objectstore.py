"""The object-store backend: staged and published outputs on S3, GCS or any ``pyarrow.fs`` filesystem.

Layout below ``output.root`` (a URI such as ``s3://bucket/dp``)::

    staged/<release>/<interval>/.tmp-<run_id>-<hex>/   where the pipeline writes (data.parquet, summary.json)
    staged/<release>/<interval>/<run_id>/data.parquet, summary.json, _STAGED.json (seal, written last)
    published/<release>/<interval>/v0001-<run_id>/data.parquet, summary.json, _PUBLISHED.json (written last)
                                  /v0002-<run_id>/...          a restatement: a new prefix, v0001 untouched
                                  /current                     pointer object, written LAST (JSON below)

An object store has no rename and no symlink, so the local backend's "write a temp directory, rename
it into place, swap a symlink" becomes:

- **Immutable version prefixes.** A version's prefix carries its run id (``v0002-<run_id>``), so two
  runs never write the same keys; its ``_PUBLISHED.json`` is written after every file of the version
  and a prefix without it is not a version (a crash mid-copy leaves an invisible, incomplete prefix
  that the retry of the same run rewrites: it was never visible). Once the marker exists nothing
  under that prefix is ever written again.
- **A ``current`` pointer object written last** (``dpops.current-pointer/1``: version, run id, the
  version's prefix name, each file's sha256). Readers (``current``, served-file checks, ``status``,
  manifest verify, the report) resolve through it; a version without the pointer is not published.
  On S3 the pointer is written with a precondition: ``If-None-Match: *`` for the first version and
  ``If-Match: <ETag read>`` to move it, through boto3 because pyarrow's filesystem API has no
  conditional write. Two concurrent publishers therefore cannot both move the pointer; the loser
  re-reads it, withdraws its never-visible version and stops with a ``StorageError`` unless the pointer
  already names its own run; a later retry moves the pointer only forward. The staging seal
  is created with ``If-None-Match: *`` too. Other schemes (``gs://``) get a check-then-write through
  pyarrow, which leaves a race window between concurrent publishers of the same interval (the
  ledger already serialises publication of one interval; the pointer is still written last).
- **Crash between ledger commit and pointer write**: every retry (``publish``, a served re-run)
  finds the committed run's complete version prefix and writes the pointer, as the local backend
  re-points its symlink.

Who may read what: object stores have no POSIX modes. ``staged/`` holds unreleased noisy values and
must be readable only by the dpops identity (a bucket policy on the ``staged/`` prefix; deploy/
documents it; ``dpops release check-staged-access`` probes it as a reader); ``published/`` is the
product. Exact counts never go to the object store: the workers report them as Beam metrics to the
driver (``pipelines.transforms.RunStats``), which writes the private run log to the local private
state directory (``PrivateRunLog``). Every ``.tmp-<run_id>-*`` prefix of a run (a killed attempt's
noisy shards) is removed on each new attempt, after sealing and at publish (``discard_run_scratch``).
Each version's ``_PUBLISHED.json`` carries the keyed (and, with a signing key, signed) binding of
``dpops.storage.published``; readers check ``current`` with ``verified_current``.

Every ``OSError`` from pyarrow or boto3 becomes a ``StorageError`` naming the URI, never file content.
"""

from __future__ import annotations

import hmac
import json
import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dpops.errors import IntegrityError, StorageError
from dpops.storage import files
from dpops.storage.base import (
    CURRENT,
    POINTER_VERSION,
    PUBLISHED_FILES,
    PUBLISHED_MARKER,
    SEAL_VERSION,
    STAGED_MARKER,
    SUMMARY_FILE,
    PublishedRun,
    Sealer,
    StagedRun,
    check_release,
    check_run_id,
    check_staged_seal,
    is_run_scratch,
    now_iso,
    require_sealer,
    seal_payload,
)
from dpops.storage.local import PrivateRunLog, private_state_dir
from dpops.storage.location import Location
from dpops.storage.published import make_binding

_VERSION_RE = re.compile(r"^v(\d{4,})-([A-Za-z0-9_-]{1,128})$")


class PreconditionFailed(Exception):
    """A conditional write lost: the object exists (create) or changed since it was read (replace)."""


@contextmanager
def _storage_errors(action: str, where: Location | str) -> Iterator[None]:
    try:
        yield
    except (StorageError, IntegrityError, PreconditionFailed):
        raise
    except OSError as exc:
        raise StorageError(f"cannot {action} {where}: {exc}; nothing was published (check the bucket, "
                           "AWS_ENDPOINT_URL and credentials, then retry)") from None


# --------------------------------------------------------------------------- conditional writes


def _s3_client() -> Any:
    """boto3's S3 client: ``AWS_ENDPOINT_URL``, region and credentials from the standard provider chain."""
    import boto3

    return boto3.client("s3")


def s3_client() -> Any:
    """boto3's S3 client from the standard provider chain (public: ``dpops.storage.access`` probes with it)."""
    return _s3_client()


def _bucket_key(loc: Location) -> tuple[str, str]:
    bucket, _, key = loc.path.partition("/")
    return bucket, key


def read_with_tag(loc: Location) -> tuple[bytes, str | None] | None:
    """The object's bytes and a version tag for ``put_conditional(if_match=...)`` (S3 ETag); None if missing."""
    if loc.scheme == "s3":
        from botocore.exceptions import ClientError

        bucket, key = _bucket_key(loc)
        try:
            resp = _s3_client().get_object(Bucket=bucket, Key=key)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            raise OSError(f"S3 GetObject failed: {exc.response.get('Error', {}).get('Code')}") from None
        return resp["Body"].read(), str(resp.get("ETag"))
    try:
        data = files.read_bytes(loc)
    except FileNotFoundError:
        return None
    assert data is not None
    return data, None


def object_version(loc: Location) -> tuple[int, str, str, str] | None:
    """What the store says about one S3 object's current version: (size, LastModified, ETag, VersionId or "")
    from a HEAD request, or None for another scheme (pyarrow.fs exposes no ETag or version there).

    Every PUT, COPY or restore of an object gives it a new LastModified (the store's clock, which no client
    sets) and, in a versioned bucket, a new VersionId; a change of content changes the ETag. So a tuple equal
    to an earlier one means no write in between, except a rewrite in the same second in an unversioned bucket
    (S3 dates have one-second resolution). Errors are ``OSError`` naming the status, never content."""
    if loc.scheme != "s3":
        return None
    from botocore.exceptions import ClientError

    bucket, key = _bucket_key(loc)
    try:
        head = _s3_client().head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        raise OSError(f"S3 HeadObject failed: {exc.response.get('Error', {}).get('Code')}") from None
    return (int(head["ContentLength"]), head["LastModified"].isoformat(), str(head.get("ETag")),
            str(head.get("VersionId") or ""))


def put_conditional(loc: Location, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> None:
    """Write ``data`` at ``loc`` only if it does not exist (``if_none_match``) or still has tag ``if_match``.

    S3: a real precondition (``If-None-Match`` / ``If-Match``), through boto3 since pyarrow.fs has none.
    Other schemes: check then write (see the module docstring for the race this leaves)."""
    if loc.scheme == "s3":
        from botocore.exceptions import ClientError

        bucket, key = _bucket_key(loc)
        kwargs: dict[str, str] = {}
        if if_none_match:
            kwargs["IfNoneMatch"] = "*"
        if if_match is not None:
            kwargs["IfMatch"] = if_match
        try:
            _s3_client().put_object(Bucket=bucket, Key=key, Body=data, **kwargs)
        except ClientError as exc:
            err = exc.response.get("Error", {}).get("Code")
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if err in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                raise PreconditionFailed(str(loc)) from None
            raise OSError(f"S3 PutObject failed: {err}") from None
        return
    if if_none_match and files.exists(loc):
        raise PreconditionFailed(str(loc))
    if if_match is not None:
        current = read_with_tag(loc)
        if current is None:
            raise PreconditionFailed(str(loc))
    files.write_bytes(loc, data)


# --------------------------------------------------------------------------- the store


class ObjectReleaseStore(PrivateRunLog):
    """Staged and published outputs of one release under an object-store output root (the ``Store`` interface)."""

    def __init__(self, root: Location | str, release: str, *, sealer: Sealer | None = None,
                 state_dir: str | os.PathLike[str] | None = None):
        from pathlib import Path

        self.root_location = Location.parse(root)
        if self.root_location.is_local:
            raise StorageError(f"{root} is a local path: use the local store (dpops.storage.open_store picks it)")
        self.root = self.root_location
        self.release = check_release(release)
        self.sealer = sealer
        # The private run log is local whatever the output root: an object store is never "under" it.
        self.state_dir = Path(state_dir) if state_dir is not None else private_state_dir()

    # ---- locations --------------------------------------------------------------
    def staged_interval_location(self, interval_slug: str) -> Location:
        return self.root_location.join("staged", self.release, interval_slug)

    def staged_location(self, interval_slug: str, run_id: str) -> Location:
        return self.staged_interval_location(interval_slug) / check_run_id(run_id)

    def published_interval_location(self, interval_slug: str) -> Location:
        return self.root_location.join("published", self.release, interval_slug)

    # names the local store uses in messages (dpops.release formats them with str())
    staged_interval_dir = staged_interval_location
    published_interval_dir = published_interval_location

    def _require_sealer(self, what: str) -> Sealer:
        return require_sealer(self.sealer, what)

    # ---- staging ----------------------------------------------------------------
    def new_staging(self, interval_slug: str, run_id: str) -> Location:
        """A fresh, run-specific prefix for the pipeline (hidden from readers by its ``.tmp-`` name)."""
        loc = self.staged_interval_location(interval_slug) / f".tmp-{check_run_id(run_id)}-{secrets.token_hex(4)}"
        self.take_scratch_lease(interval_slug, loc.name)
        self.discard_run_scratch(interval_slug, run_id)  # a killed attempt's leftovers (issue 19 item 8)
        # Before ledger.start: a state directory that cannot be written fails while the reservation is refundable.
        self._private_log_dir(interval_slug)
        return loc

    def discard_staging(self, staging: Location) -> None:
        try:
            files.delete_tree(staging)
        except OSError:
            pass
        self.drop_scratch_lease(staging.parent.name, staging.name)

    def discard_run_scratch(self, interval_slug: str, run_id: str, *, keep: Location | None = None) -> list[str]:
        """Remove the run's other ``.tmp-<run_id>-*`` prefixes: a killed attempt's noisy shards (and, from a
        dpops older than issue 19 item 8, its exact counters) never stay in the bucket past the next attempt."""
        parent = self.staged_interval_location(interval_slug)
        check_run_id(run_id)
        try:
            names = files.list_dir(parent)
        except OSError:
            return []
        removed = []
        for name in names:
            if (is_run_scratch(name, run_id) and (keep is None or keep.name != name)
                    and not self.scratch_is_live(interval_slug, name)):
                self.discard_staging(parent / name)
                removed.append(name)
        return removed

    def finish_staging(self, tmp_dir: Location | str, interval_slug: str, run_id: str, internal: dict[str, Any], *,
                       test_mode: bool = False) -> StagedRun:
        """Seal what the pipeline wrote: copy to ``staged/<release>/<interval>/<run_id>/``, seal written last.

        If another attempt already sealed this run id, that one is kept (as in the local backend)."""
        tmp = Location.parse(tmp_dir)
        final = self.staged_location(interval_slug, run_id)
        try:
            sealer = self._require_sealer("seal the staged output")
            with _storage_errors("stage the output in", tmp):
                for name in PUBLISHED_FILES:
                    if not files.is_file(tmp / name):
                        raise StorageError(f"the pipeline did not write {name} in {tmp}")
                try:
                    summary = files.read_json(tmp / SUMMARY_FILE)
                except ValueError:
                    raise StorageError(f"{tmp / SUMMARY_FILE} is not readable JSON") from None
                if not isinstance(summary, dict):
                    raise StorageError(f"{tmp / SUMMARY_FILE} must hold a JSON object")
                self._write_internal_log(interval_slug, run_id, internal)
                hashes = {name: files.sha256(tmp / name) for name in PUBLISHED_FILES}
                test_mode = bool(test_mode or summary.get("test_mode", False))
                if files.is_file(final / STAGED_MARKER):
                    self.discard_staging(tmp)
                    return self.verify_staged(interval_slug, run_id)
                for name in PUBLISHED_FILES:
                    files.copy(tmp / name, final / name)
                    if files.sha256(final / name) != hashes[name]:
                        raise StorageError(f"copy of {name} to {final} does not match the pipeline's file")
                payload = seal_payload(self.release, interval_slug, run_id, hashes, test_mode)
                marker = {"run_id": run_id, "files": hashes, "test_mode": test_mode, "staged_at": now_iso(),
                          "seal": {"version": SEAL_VERSION, "key_id": getattr(sealer, "key_id", None),
                                   "mac": sealer.seal_mac(payload)}}
                try:
                    put_conditional(final / STAGED_MARKER, files.json_bytes(marker), if_none_match=True)
                except PreconditionFailed:  # a concurrent attempt sealed first: keep its result
                    self.discard_staging(tmp)
                    return self.verify_staged(interval_slug, run_id)
        except BaseException:
            self.discard_staging(tmp)
            raise
        self.discard_staging(tmp)
        self.discard_run_scratch(interval_slug, run_id)
        return StagedRun(run_id, final, hashes, test_mode)

    def find_staged(self, interval_slug: str, run_id: str) -> StagedRun | None:
        with _storage_errors("look for the staged output in", self.staged_interval_location(interval_slug)):
            if not files.is_file(self.staged_location(interval_slug, run_id) / STAGED_MARKER):
                return None
        return self.verify_staged(interval_slug, run_id)

    def verify_staged(self, interval_slug: str, run_id: str) -> StagedRun:
        """The seal (HMAC under the noise key) and then every object's sha256; a mismatch is an IntegrityError."""
        d = self.staged_location(interval_slug, run_id)
        remedy = f"remove {d} and run again (keyed randomness recomputes the same noise at no new charge)"
        try:
            marker = files.read_json(d / STAGED_MARKER)
        except FileNotFoundError:
            raise StorageError(f"no sealed staged output for run {run_id} in {d} (compute it first)") from None
        except (OSError, ValueError):
            raise IntegrityError(f"{d / STAGED_MARKER} is not a readable seal: the staged output is corrupt and will "
                                 f"not be published; {remedy}") from None
        files_doc, test_mode = check_staged_seal(
            marker, str(d / STAGED_MARKER), release=self.release, interval_slug=interval_slug, run_id=run_id,
            sealer=self._require_sealer("verify the staged output"), published_files=PUBLISHED_FILES, remedy=remedy)
        for name, want in files_doc.items():
            try:
                got = files.sha256(d / name)
            except OSError as exc:
                raise IntegrityError(f"staged object {d / name} is unreadable ({type(exc).__name__}): the staged "
                                     f"output is corrupt; {remedy}") from None
            if not hmac.compare_digest(got, want):
                raise IntegrityError(f"staged object {d / name} does not match the sealed sha256: the staged output "
                                     f"was changed after it was written; it will not be published; {remedy}")
        return StagedRun(run_id, d, dict(files_doc), test_mode)

    # ---- publishing -------------------------------------------------------------
    def versions(self, interval_slug: str) -> list[PublishedRun]:
        """Complete versions (their ``_PUBLISHED.json`` exists), oldest first."""
        base = self.published_interval_location(interval_slug)
        out = []
        with _storage_errors("list the published versions in", base):
            for name in files.list_dir(base):
                m = _VERSION_RE.match(name)
                if not m:
                    continue
                try:
                    doc = files.read_json(base / name / PUBLISHED_MARKER)
                except FileNotFoundError:
                    continue  # an incomplete prefix (crash mid-copy): never visible, rewritten by the retry
                except ValueError:
                    raise StorageError(f"{base / name / PUBLISHED_MARKER} is not readable JSON") from None
                if not isinstance(doc, dict) or doc.get("run_id") != m.group(2):
                    raise StorageError(f"{base / name / PUBLISHED_MARKER} does not describe the run its prefix names")
                out.append(PublishedRun(run_id=m.group(2), version=int(m.group(1)), location=base / name,
                                        hashes=doc.get("files", {}), restates=doc.get("restates"),
                                        published_at=doc.get("published_at", "")))
        return sorted(out, key=lambda r: (r.version, r.location.name))

    def _pointer(self, interval_slug: str) -> tuple[dict[str, Any] | None, str | None]:
        loc = self.published_interval_location(interval_slug) / CURRENT
        with _storage_errors("read the pointer", loc):
            got = read_with_tag(loc)
        if got is None:
            return None, None
        data, tag = got
        try:
            doc = json.loads(data)
        except ValueError:
            raise StorageError(f"the pointer {loc} is not readable JSON: repair it from the newest version's "
                               "_PUBLISHED.json") from None
        if not isinstance(doc, dict) or doc.get("pointer") != POINTER_VERSION or not isinstance(doc.get("prefix"), str):
            raise StorageError(f"the pointer {loc} is not a {POINTER_VERSION} document")
        return doc, tag

    def current(self, interval_slug: str) -> PublishedRun | None:
        """The version the ``current`` pointer names, or None if the interval is unpublished."""
        doc, _ = self._pointer(interval_slug)
        if doc is None:
            return None
        for v in self.versions(interval_slug):
            if v.location.name == doc["prefix"] and v.run_id == doc.get("run_id"):
                return v
        raise StorageError(f"{self.published_interval_location(interval_slug) / CURRENT} points to "
                           f"{doc['prefix']!r}, which is not a published version")

    def next_version_location(self, interval_slug: str, run_id: str) -> Location:
        """Where ``publish`` will put this run: its existing version, else the next number (with its run id)."""
        existing = self.versions(interval_slug)
        for v in existing:
            if v.run_id == run_id:
                return v.location
        version = max((e.version for e in existing), default=0) + 1
        return self.published_interval_location(interval_slug) / f"v{version:04d}-{check_run_id(run_id)}"

    next_version_dir = next_version_location

    def publish(self, staged: StagedRun, interval_slug: str, *, restates: str | None = None,
                extra: dict[str, Any] | None = None, ledger_entry_hash: str | None = None,
                ledger_id: str | None = None) -> PublishedRun:
        """Publish a verified staged run as the interval's next version, then write the pointer (last).

        Idempotent per run id: a retry after a crash returns the existing version and writes the pointer."""
        if staged.test_mode:
            raise StorageError(f"run {staged.run_id} was computed in test mode (seeded, non-secret noise) and can "
                               "never be published; run it again with --randomness keyed or os")
        staged = self.verify_staged(interval_slug, staged.run_id)  # hashes re-checked right before copying
        base = self.published_interval_location(interval_slug)
        self.discard_run_scratch(interval_slug, staged.run_id)  # after publish nothing of the run stays in scratch
        existing = self.versions(interval_slug)
        cur = self.current(interval_slug)
        for v in existing:
            if v.run_id == staged.run_id:
                # A retry: point to this version only if nothing newer is current (a crash between the
                # ledger commit and the pointer write). Two complete versions may share a number after a
                # race; the pointer, moved only forward, decides which one is published.
                if cur is None or (cur.run_id != v.run_id and v.version > cur.version):
                    self._point_current(interval_slug, v)
                return v
        if cur is not None and restates != cur.run_id:
            raise StorageError(
                f"interval {interval_slug} of {self.release} is already published (v{cur.version}, run {cur.run_id}); "
                "a changed output is published only by an explicit restatement (dpops release restate)"
            )
        if cur is None and restates is not None and existing:
            raise StorageError(f"{base}: versions exist but no current pointer; repair it before restating")
        version = max((e.version for e in existing), default=0) + 1
        final = base / f"v{version:04d}-{staged.run_id}"
        published_at = now_iso()
        with _storage_errors("publish into", final):
            for name in PUBLISHED_FILES:
                files.copy(staged.location / name, final / name)
                if files.sha256(final / name) != staged.hashes[name]:
                    raise StorageError(f"copy of {name} to {final} does not match the staged file; nothing published")
            binding = make_binding(self.sealer, release=self.release, interval=interval_slug, version=version,
                                   run_id=staged.run_id, ledger_entry_hash=ledger_entry_hash, files=staged.hashes,
                                   output_root=self.root_location.uri, ledger_id=ledger_id)
            marker = {**(extra or {}), "release": self.release, "interval": interval_slug, "run_id": staged.run_id,
                      "version": version, "files": dict(staged.hashes), "restates": restates,
                      "published_at": published_at, "binding": binding}
            try:  # the version's marker, after all of its files: from here on the prefix is immutable
                put_conditional(final / PUBLISHED_MARKER, files.json_bytes(marker), if_none_match=True)
            except PreconditionFailed:
                for v in self.versions(interval_slug):
                    if v.run_id == staged.run_id:
                        return v
                raise StorageError(f"{final} was published concurrently; nothing overwritten") from None
        pub = PublishedRun(staged.run_id, version, final, dict(staged.hashes), restates, published_at,
                           dict(extra or {}))
        try:
            self._point_current(interval_slug, pub)
        except StorageError:
            # Another publisher moved the pointer first: this version was never visible; withdraw it (marker
            # first, so it stops being a version at once) rather than leave a second complete v<N>.
            again, _ = self._pointer(interval_slug)
            if again is None or again.get("prefix") != final.name:
                try:
                    files.delete_file(final / PUBLISHED_MARKER)
                    files.delete_tree(final)
                except OSError:
                    pass
            raise
        return pub

    def _point_current(self, interval_slug: str, pub: PublishedRun) -> None:
        """Write the ``current`` pointer to ``pub`` with a precondition on what was read (never backwards)."""
        loc = self.published_interval_location(interval_slug) / CURRENT
        doc, tag = self._pointer(interval_slug)
        if doc is not None and doc.get("prefix") == pub.location.name:
            return
        if doc is not None and int(doc.get("version", 0)) >= pub.version:
            # Strictly forward only: two first publications of an interval both compute v1 (different
            # prefixes); the one that reads the other's pointer must lose, not replace it at the same number.
            raise StorageError(f"{loc} already names v{doc.get('version')} ({doc.get('prefix')!r}); not moved to "
                               f"v{pub.version} of run {pub.run_id} (check dpops release status)")
        new = {"pointer": POINTER_VERSION, "release": self.release, "interval": interval_slug,
               "version": pub.version, "run_id": pub.run_id, "prefix": pub.location.name, "files": dict(pub.hashes),
               "published_at": pub.published_at}
        try:
            with _storage_errors("move the current pointer", loc):
                if doc is None:
                    put_conditional(loc, files.json_bytes(new), if_none_match=True)
                else:
                    put_conditional(loc, files.json_bytes(new), if_match=tag)
        except PreconditionFailed:
            again, _ = self._pointer(interval_slug)
            if again is not None and again.get("prefix") == pub.location.name:
                return
            raise StorageError(f"{loc} was moved concurrently by another publisher (it names "
                               f"{(again or {}).get('prefix')!r}); nothing overwritten (check dpops release status)"
                               ) from None


__all__ = ["ObjectReleaseStore", "PreconditionFailed", "put_conditional", "read_with_tag", "s3_client"]
