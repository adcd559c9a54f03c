"""The storage interface the run steps use, and what both backends share (records, seal payload, names).

Two backends implement ``Store``:

- ``local.LocalReleaseStore`` (``ReleaseStore``): a local filesystem; staging 0700/0600, atomic
  ``rename``, fsync, a ``current`` symlink.
- ``objectstore.ObjectReleaseStore``: any ``pyarrow.fs`` filesystem (S3, GCS); no rename and no
  symlink, so immutable version prefixes plus a ``current`` pointer object written last.

``open_store(root, release, ...)`` picks one from the root's ``Location``. The run steps
(``dpops.release``) only call what ``Store`` declares, plus ``dpops.storage.files`` to read files at
a ``Location``; the guarantees (manifest first, ledger commit before visibility, immutable versions,
a crash between commit and visibility healed by any retry) are each backend's job, documented there.
"""

from __future__ import annotations

import hmac
import json
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from dpops.errors import IntegrityError, StorageError
from dpops.storage.location import Location

DATA_FILE = "data.parquet"
SUMMARY_FILE = "summary.json"
INTERNAL_FILE = "internal.json"
STAGED_MARKER = "_STAGED.json"
PUBLISHED_MARKER = "_PUBLISHED.json"
CURRENT = "current"
SEAL_VERSION = "dpops.staging-seal/1"
POINTER_VERSION = "dpops.current-pointer/1"
PUBLISHED_FILES = (DATA_FILE, SUMMARY_FILE)  # the internal run log is never under output.root
RUN_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
RELEASE_RE = re.compile(r"^[a-z0-9_-]{1,64}$")


class Sealer(Protocol):
    """The run's noise key as the stores need it: a keyed MAC for the staging seal."""

    key_id: str

    def seal_mac(self, data: bytes) -> str: ...


@dataclass(frozen=True)
class StagedRun:
    run_id: str
    location: Location
    hashes: dict[str, str]  # file name -> sha256
    test_mode: bool

    @property
    def directory(self) -> Path:
        """The local staged directory (local backend only; use ``location`` for either)."""
        return self.location.local_path

    @property
    def data_file(self) -> Path:
        return self.directory / DATA_FILE

    @property
    def summary_file(self) -> Path:
        return self.directory / SUMMARY_FILE

    @property
    def data_location(self) -> Location:
        return self.location / DATA_FILE


@dataclass(frozen=True)
class PublishedRun:
    run_id: str
    version: int
    location: Location
    hashes: dict[str, str]
    restates: str | None = None
    published_at: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def directory(self) -> Path:
        """The local version directory (local backend only; use ``location`` for either)."""
        return self.location.local_path

    @property
    def uri(self) -> str:
        if self.location.is_local:
            return self.location.local_path.resolve().as_uri()
        return self.location.uri


@runtime_checkable
class Store(Protocol):
    """Staged and published outputs of one release under one output root."""

    root_location: Location
    release: str

    def staged_interval_location(self, interval_slug: str) -> Location: ...

    def published_interval_location(self, interval_slug: str) -> Location: ...

    def published_interval_dir(self, interval_slug: str) -> Path | Location:
        """The published interval as the backend names it in messages (a local ``Path`` or a ``Location``)."""

    def new_staging(self, interval_slug: str, run_id: str) -> Location:
        """An empty, run-specific place the pipeline writes ``data.parquet`` and ``summary.json`` into."""

    def discard_staging(self, staging: Location) -> None: ...

    def discard_run_scratch(self, interval_slug: str, run_id: str, *, keep: Location | None = None) -> list[str]:
        """Remove every ``.tmp-<run_id>-*`` staging prefix of the run but ``keep`` (a killed attempt's shards);
        return the names removed. Called on every new attempt, after sealing and after publishing."""

    def finish_staging(self, tmp_dir: Any, interval_slug: str, run_id: str, internal: dict[str, Any], *,
                       test_mode: bool = False) -> StagedRun:
        """Seal what the pipeline wrote (HMAC under the noise key); the run log goes to the private state dir."""

    def find_staged(self, interval_slug: str, run_id: str) -> StagedRun | None: ...

    def verify_staged(self, interval_slug: str, run_id: str) -> StagedRun: ...

    def versions(self, interval_slug: str) -> list[PublishedRun]: ...

    def current(self, interval_slug: str) -> PublishedRun | None: ...

    def next_version_location(self, interval_slug: str, run_id: str) -> Location: ...

    def publish(self, staged: StagedRun, interval_slug: str, *, restates: str | None = None,
                extra: dict[str, Any] | None = None, ledger_entry_hash: str | None = None,
                ledger_id: str | None = None) -> PublishedRun:
        """Publish as the next version; its ``_PUBLISHED.json`` carries the keyed binding
        (``dpops.storage.published``) over the run id, ``ledger_entry_hash`` (the run's commit entry), the
        files, the store's root and ``ledger_id`` (the committing ledger's ``Ledger.ledger_id``)."""

    def read_internal_log(self, interval_slug: str, run_id: str) -> dict[str, Any] | None: ...


def seal_payload(release: str, interval_slug: str, run_id: str, files: dict[str, str], test_mode: bool) -> bytes:
    return json.dumps({"version": SEAL_VERSION, "release": release, "interval": interval_slug, "run_id": run_id,
                       "files": files, "test_mode": bool(test_mode)}, sort_keys=True, separators=(",", ":")).encode()


def require_sealer(sealer: object, what: str) -> Sealer:
    """The noise key as a sealer, or a StorageError saying the staging seal needs it (every backend)."""
    if sealer is None or not callable(getattr(sealer, "seal_mac", None)):
        raise StorageError(f"cannot {what} without the noise key: the staging seal is an HMAC under it "
                           "(pass --key-file / DPOPS_NOISE_KEY_FILE)")
    return sealer  # type: ignore[return-value]  # checked structurally just above


def check_staged_seal(marker: object, where: str, *, release: str, interval_slug: str, run_id: str,
                      sealer: Sealer, published_files: tuple[str, ...], remedy: str) -> tuple[dict[str, str], bool]:
    """Check a staged marker's shape and its keyed seal; return (file name -> sha256, test_mode).

    The one owner of this rule for every backend: the seal is an HMAC under the noise key over the
    release, interval, run id, file hashes and test-mode flag, so a staged output changed or sealed by
    someone without the key (or a test-mode run relabelled as real) is never published. The caller then
    checks each file's sha256 against the returned hashes through its own storage."""
    doc = marker if isinstance(marker, dict) else {}
    files = doc.get("files")
    seal = doc.get("seal")
    if (doc.get("run_id") != run_id or not isinstance(files, dict) or set(files) != set(published_files)
            or not all(isinstance(v, str) for v in files.values())):
        raise IntegrityError(f"{where} does not describe run {run_id}: the staged output is corrupt "
                             f"and will not be published; {remedy}")
    if not isinstance(seal, dict) or seal.get("version") != SEAL_VERSION or not isinstance(seal.get("mac"), str):
        raise IntegrityError(f"{where} carries no keyed seal (written by an older dpops or by hand): it will not "
                             f"be published; {remedy}")
    test_mode = doc.get("test_mode", False)
    if not isinstance(test_mode, bool):
        raise IntegrityError(f"{where}: test_mode is not a boolean; {remedy}")
    want_mac = sealer.seal_mac(seal_payload(release, interval_slug, run_id, files, test_mode))
    if not hmac.compare_digest(want_mac, seal["mac"]):
        raise IntegrityError(
            f"{where}: the seal does not verify under the noise key (key id {getattr(sealer, 'key_id', '?')}): "
            f"the staged output was changed or resealed without the key; it will not be published; {remedy}")
    return dict(files), test_mode


def is_run_scratch(name: str, run_id: str) -> bool:
    """Is ``name`` one of ``run_id``'s staging scratch prefixes (``.tmp-<run_id>-<8 hex>``, ``new_staging``)?

    Exact, so that run ``abc``'s sweep never matches run ``abc-a2``'s scratch."""
    return re.fullmatch(r"\.tmp-" + re.escape(run_id) + r"-[0-9a-f]{8}", name) is not None


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id):
        raise StorageError(f"run id {run_id!r} is not safe for a path")
    return run_id


def check_release(release: str) -> str:
    if not RELEASE_RE.match(release):
        raise StorageError(f"release name {release!r} is not safe for a path")
    return release


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def version_number(location: Location) -> int:
    """``v3`` (local) or ``v0003-<run id>`` (object store) -> 3."""
    m = re.match(r"^v(\d+)(?:-|$)", location.name)
    if not m:
        raise StorageError(f"{location} is not a published version")
    return int(m.group(1))


__all__ = ["Store", "Sealer", "StagedRun", "PublishedRun", "seal_payload", "check_run_id", "is_run_scratch",
           "check_release",
           "now_iso", "version_number", "DATA_FILE", "SUMMARY_FILE", "INTERNAL_FILE", "STAGED_MARKER",
           "PUBLISHED_MARKER", "CURRENT", "SEAL_VERSION", "POINTER_VERSION", "PUBLISHED_FILES"]
