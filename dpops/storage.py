"""Staging and publishing release outputs under a spec's ``output.root``.

Layout (``<interval>`` is ``Interval.slug``, e.g. ``20240101T000000Z_20240102T000000Z``)::

    staged/<release>/<interval>/<run_id>/data.parquet     noisy output written by the pipeline
                                        /summary.json     release, interval, plan, randomness mode, test_mode
                                        /internal.json    INTERNAL run log (rows read/dropped/clamped): never published
                                        /_STAGED.json     sha256 of every file above, written last
    published/<release>/<interval>/v1/data.parquet, summary.json, _PUBLISHED.json
                                  /v2/...                 a restatement: a new version, v1 is kept
                                  /current -> v2          symlink, moved atomically

Every published interval is versioned, the first one included, so readers always
use ``<interval>/current/`` and nothing is ever overwritten.

Atomicity: files are written into a hidden temporary directory in the same
filesystem, fsynced, and the directory is renamed into place; the ``current``
pointer is a new symlink renamed over the old one. A crash leaves at most a
``.tmp-*`` directory, which readers never look at. Any ``OSError`` (disk full,
read-only filesystem, permissions) becomes a ``StorageError`` naming the path.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import shutil
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from contextlib import contextmanager

from dpops.errors import StorageError

DATA_FILE = "data.parquet"
SUMMARY_FILE = "summary.json"
INTERNAL_FILE = "internal.json"
STAGED_MARKER = "_STAGED.json"
PUBLISHED_MARKER = "_PUBLISHED.json"
CURRENT = "current"
PUBLISHED_FILES = (DATA_FILE, SUMMARY_FILE)  # internal.json never leaves staging
_VERSION_RE = re.compile(r"^v(\d+)$")
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


# --------------------------------------------------------------------------- low-level helpers


@contextmanager
def _storage_errors(action: str, path: Path | str) -> Iterator[None]:
    try:
        yield
    except StorageError:
        raise
    except OSError as exc:
        hint = {
            errno.ENOSPC: "the disk is full",
            errno.EROFS: "the filesystem is read-only",
            errno.EACCES: "permission denied",
            errno.EPERM: "operation not permitted",
            errno.EDQUOT: "disk quota exceeded",
        }.get(exc.errno, exc.strerror or str(exc))
        raise StorageError(f"cannot {action} {path}: {hint}; nothing was published (fix the storage and retry)") from None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, doc: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2, sort_keys=True, allow_nan=False)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise StorageError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise StorageError(f"{path} must hold a JSON object")
    return doc


def _rmtree_quiet(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class StagedRun:
    run_id: str
    directory: Path
    hashes: dict[str, str]  # file name -> sha256
    test_mode: bool

    @property
    def data_file(self) -> Path:
        return self.directory / DATA_FILE

    @property
    def summary_file(self) -> Path:
        return self.directory / SUMMARY_FILE


@dataclass(frozen=True)
class PublishedRun:
    run_id: str
    version: int
    directory: Path
    hashes: dict[str, str]
    restates: str | None = None
    published_at: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def uri(self) -> str:
        return self.directory.resolve().as_uri()


# --------------------------------------------------------------------------- the store


class ReleaseStore:
    """Staged and published outputs of one release under one output root."""

    def __init__(self, root: str | os.PathLike[str], release: str):
        if not re.match(r"^[a-z0-9_-]{1,64}$", release):
            raise StorageError(f"release name {release!r} is not safe for a path")
        self.root = Path(root)
        self.release = release

    # ---- paths ------------------------------------------------------------------
    def staged_interval_dir(self, interval_slug: str) -> Path:
        return self.root / "staged" / self.release / interval_slug

    def staged_dir(self, interval_slug: str, run_id: str) -> Path:
        _check_run_id(run_id)
        return self.staged_interval_dir(interval_slug) / run_id

    def published_interval_dir(self, interval_slug: str) -> Path:
        return self.root / "published" / self.release / interval_slug

    # ---- staging ----------------------------------------------------------------
    def new_staging_dir(self, interval_slug: str, run_id: str) -> Path:
        """An empty, run-specific temporary directory for the pipeline to write into (hidden from readers)."""
        parent = self.staged_interval_dir(interval_slug)
        tmp = parent / f".tmp-{_check_run_id(run_id)}-{secrets.token_hex(4)}"
        with _storage_errors("create the staging directory", tmp):
            parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
        return tmp

    def finish_staging(self, tmp_dir: Path, interval_slug: str, run_id: str, internal: dict[str, Any], *,
                       test_mode: bool = False) -> StagedRun:
        """Seal a staging directory the pipeline filled: write internal.json and the hash marker, fsync, rename.

        If another attempt already sealed this run id (a concurrent retry), that one is kept and ``tmp_dir``
        discarded: both hold the same run, and the first one is what the ledger's start covers.
        """
        tmp_dir = Path(tmp_dir)
        final = self.staged_dir(interval_slug, run_id)
        try:
            with _storage_errors("stage the output in", tmp_dir):
                for name in PUBLISHED_FILES:
                    if not (tmp_dir / name).is_file():
                        raise StorageError(f"the pipeline did not write {name} in {tmp_dir}")
                summary = _read_json(tmp_dir / SUMMARY_FILE)
                _write_json(tmp_dir / INTERNAL_FILE, internal)
                hashes = {}
                for name in (DATA_FILE, SUMMARY_FILE, INTERNAL_FILE):
                    _fsync_file(tmp_dir / name)
                    hashes[name] = sha256_file(tmp_dir / name)
                # Either side saying "test mode" is enough: a seeded run must never look publishable.
                test_mode = bool(test_mode or summary.get("test_mode", False))
                _write_json(tmp_dir / STAGED_MARKER, {
                    "run_id": run_id, "files": hashes, "test_mode": test_mode, "staged_at": _now(),
                })
                _fsync_dir(tmp_dir)
                if final.exists():
                    _rmtree_quiet(tmp_dir)
                    return self.verify_staged(interval_slug, run_id)
                os.rename(tmp_dir, final)
                _fsync_dir(final.parent)
        except BaseException:
            _rmtree_quiet(tmp_dir)
            raise
        return StagedRun(run_id, final, hashes, test_mode)

    def find_staged(self, interval_slug: str, run_id: str) -> StagedRun | None:
        """The sealed staged output of this run if one exists and verifies, else None (never a partial one).

        A sealed directory whose files do not match their hashes is an error, not a miss: someone or
        something changed a noisy output after it was written.
        """
        d = self.staged_dir(interval_slug, run_id)
        if not (d / STAGED_MARKER).is_file():
            return None
        return self.verify_staged(interval_slug, run_id)

    def verify_staged(self, interval_slug: str, run_id: str) -> StagedRun:
        d = self.staged_dir(interval_slug, run_id)
        try:
            marker = _read_json(d / STAGED_MARKER)
        except FileNotFoundError:
            raise StorageError(f"no sealed staged output for run {run_id} in {d} (compute it first)") from None
        files = marker.get("files")
        if marker.get("run_id") != run_id or not isinstance(files, dict) or set(PUBLISHED_FILES) - set(files):
            raise StorageError(f"{d / STAGED_MARKER} does not describe run {run_id}: the staged output is corrupt")
        for name, want in files.items():
            path = d / name
            try:
                got = sha256_file(path)
            except OSError as exc:
                raise StorageError(f"staged file {path} is unreadable ({exc.strerror or exc}): the staged output is corrupt; "
                                   "recompute it with a new attempt") from None
            if got != want:
                raise StorageError(f"staged file {path} does not match its recorded sha256: the staged output is corrupt "
                                   "(changed after it was written); it will not be published")
        return StagedRun(run_id, d, dict(files), bool(marker.get("test_mode", False)))

    # ---- publishing -------------------------------------------------------------
    def versions(self, interval_slug: str) -> list[PublishedRun]:
        base = self.published_interval_dir(interval_slug)
        out = []
        if not base.is_dir():
            return out
        for child in base.iterdir():
            m = _VERSION_RE.match(child.name)
            if m and (child / PUBLISHED_MARKER).is_file():
                doc = _read_json(child / PUBLISHED_MARKER)
                out.append(PublishedRun(
                    run_id=doc.get("run_id", ""), version=int(m.group(1)), directory=child,
                    hashes=doc.get("files", {}), restates=doc.get("restates"), published_at=doc.get("published_at", ""),
                ))
        return sorted(out, key=lambda r: r.version)

    def next_version_dir(self, interval_slug: str, run_id: str) -> Path:
        """Where ``publish`` will put this run: its existing version, else the next number.

        Used to write the run manifest *before* publishing (semantics.md section 5). If a
        concurrent restatement takes that number first, ``publish`` refuses (it never
        overwrites), so a manifest can never name another run's output.
        """
        existing = self.versions(interval_slug)
        for v in existing:
            if v.run_id == run_id:
                return v.directory
        version = max((e.version for e in existing), default=0) + 1
        return self.published_interval_dir(interval_slug) / f"v{version}"

    def current(self, interval_slug: str) -> PublishedRun | None:
        """The version the ``current`` pointer names (the newest restatement), or None if unpublished."""
        base = self.published_interval_dir(interval_slug)
        link = base / CURRENT
        try:
            target = os.readlink(link)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StorageError(f"cannot read the pointer {link}: {exc.strerror or exc}") from None
        for v in self.versions(interval_slug):
            if v.directory.name == target:
                return v
        raise StorageError(f"{link} points to {target!r}, which is not a published version")

    def publish(self, staged: StagedRun, interval_slug: str, *, restates: str | None = None,
                extra: dict[str, Any] | None = None) -> PublishedRun:
        """Publish a verified staged run as the next version of the interval and move ``current`` to it.

        Idempotent per run id (a retry after a crash returns the existing version and repairs the pointer).
        A different run on an already published interval needs ``restates=<run id of the current version>``.
        """
        if staged.test_mode:
            raise StorageError(f"run {staged.run_id} was computed in test mode (seeded, non-secret noise) and can "
                               "never be published; run it again with --randomness keyed or os")
        staged = self.verify_staged(interval_slug, staged.run_id)  # hashes re-checked right before copying
        base = self.published_interval_dir(interval_slug)
        existing = self.versions(interval_slug)
        for v in existing:
            if v.run_id == staged.run_id:
                if v.version == max(e.version for e in existing):
                    self._point_current(base, v.directory.name)
                return v
        cur = self.current(interval_slug)
        if cur is not None and restates != cur.run_id:
            raise StorageError(
                f"interval {interval_slug} of {self.release} is already published (v{cur.version}, run {cur.run_id}); "
                "a changed output is published only by an explicit restatement (dpops release restate)"
            )
        if cur is None and restates is not None and existing:
            raise StorageError(f"{base}: versions exist but no current pointer; repair it before restating")
        version = (max((e.version for e in existing), default=0)) + 1
        final = base / f"v{version}"
        tmp = base / f".tmp-v{version}-{secrets.token_hex(4)}"
        hashes: dict[str, str] = {}
        published_at = _now()
        try:
            with _storage_errors("publish into", base):
                base.mkdir(parents=True, exist_ok=True)
                tmp.mkdir()
                for name in PUBLISHED_FILES:
                    shutil.copyfile(staged.directory / name, tmp / name)
                    _fsync_file(tmp / name)
                    hashes[name] = sha256_file(tmp / name)
                    if hashes[name] != staged.hashes[name]:
                        raise StorageError(f"copy of {name} to {tmp} does not match the staged file; nothing published")
                _write_json(tmp / PUBLISHED_MARKER, {
                    "release": self.release, "interval": interval_slug, "run_id": staged.run_id, "version": version,
                    "files": hashes, "restates": restates, "published_at": published_at, **(extra or {}),
                })
                _fsync_dir(tmp)
                try:
                    if final.exists():
                        raise FileExistsError(errno.EEXIST, "exists", str(final))
                    os.rename(tmp, final)  # fails on a non-empty target: never overwrites
                except OSError as exc:
                    if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                        raise
                    # A concurrent publisher won the race for this version number: if it published this
                    # very run, that is our result; otherwise nothing is overwritten and we stop.
                    _rmtree_quiet(tmp)
                    for v in self.versions(interval_slug):
                        if v.run_id == staged.run_id:
                            return v
                    raise StorageError(f"{final} was published concurrently by another run; nothing overwritten "
                                       "(check dpops release status)") from None
                _fsync_dir(base)
        except BaseException:
            _rmtree_quiet(tmp)
            raise
        self._point_current(base, final.name)
        return PublishedRun(staged.run_id, version, final, hashes, restates, published_at, dict(extra or {}))

    @staticmethod
    def _point_current(base: Path, target: str) -> None:
        link = base / CURRENT
        try:
            if os.readlink(link) == target:
                return
        except OSError:
            pass
        tmp_link = base / f".tmp-current-{secrets.token_hex(4)}"
        with _storage_errors("move the current pointer in", base):
            try:
                os.symlink(target, tmp_link)
                os.replace(tmp_link, link)  # atomic: readers see the old or the new version, never neither
                _fsync_dir(base)
            finally:
                if os.path.lexists(tmp_link):
                    os.unlink(tmp_link)


def _check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID_RE.match(run_id):
        raise StorageError(f"run id {run_id!r} is not safe for a path")
    return run_id


__all__ = ["ReleaseStore", "StagedRun", "PublishedRun", "sha256_file", "DATA_FILE", "SUMMARY_FILE", "INTERNAL_FILE"]
