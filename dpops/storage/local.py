"""The local backend: staging and publishing release outputs under a local ``output.root``.

Layout (``<interval>`` is ``Interval.slug``, e.g. ``20240101T000000Z_20240102T000000Z``)::

    <output.root>/staged/<release>/<interval>/<run_id>/data.parquet   noisy output written by the pipeline
                                                      /summary.json   release, interval, plan, randomness, test_mode
                                                      /_STAGED.json   the seal: sha256 of each file, keyed HMAC
    <output.root>/published/<release>/<interval>/v1/data.parquet, summary.json, _PUBLISHED.json
                                                /v2/...               a restatement: a new version, v1 is kept
                                                /current -> v2        symlink, moved atomically
    <private state dir>/runs/<release>/<interval>/<run_id>.internal.json
                                  INTERNAL run log (rows read/kept/dropped/clamped): PRIVATE, never under output.root

Who may read what (issue 14, semantics.md section 6):

- ``published/`` is the product: directories 0755, files 0644, set explicitly.
- ``staged/`` holds noisy values that are not released yet (a reader who sees two staged attempts,
  or a staged output that is then refused, learns more than the release promises): every
  directory of the ``staged/`` tree is 0700 and every file 0600, set explicitly with ``chmod``,
  never left to the umask; an older, looser tree is tightened on the next run.
- The internal run log holds EXACT counts of the private data (with one public partition,
  published count - rows_kept is the noise). It never lives under ``output.root``: it goes to
  the private state directory, ``$DPOPS_STATE_DIR`` or by default ``$XDG_STATE_HOME/dpops``
  (``~/.local/state/dpops``), directories 0700 and files 0600. A state directory under
  ``output.root`` is refused.

The seal (``_STAGED.json``) names every staged file's sha256 and is authenticated with
HMAC-SHA256 under a key derived from the noise key (``NoiseKey.seal_mac``): whoever can write the
staging area but does not hold the key cannot swap the noisy values for raw ones and reseal them.
Publishing re-verifies the seal and every hash and refuses a mismatch with an ``IntegrityError``
(exit 7). keyed and os runs always load the noise key (the input fingerprint is keyed), so every
publishable run is sealed with the secret; a test-mode run is sealed with a public test key and can
never be published.

Every published interval is versioned, the first one included, so readers always
use ``<interval>/current/`` and nothing is ever overwritten.

Atomicity: files are written into a hidden temporary directory in the same
filesystem, fsynced, and the directory is renamed into place; the ``current``
pointer is a new symlink renamed over the old one. A crash leaves at most a
``.tmp-*`` directory, which readers never look at; a run's ``.tmp-<run_id>-*`` staging
directories are removed on its next attempt, after sealing and at publish.

Each version's ``_PUBLISHED.json`` carries a binding (``dpops.storage.published``: keyed MAC,
signature when a signing key is set) over release, interval, version, run id, the ledger's
commit-entry hash and the files; ``current()`` only follows the symlink, readers use
``verified_current`` and dpops' own checks compare every version with the ledger. Any ``OSError`` (disk full,
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
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dpops.errors import IntegrityError, StorageError
from dpops.storage.base import (
    CURRENT,
    DATA_FILE,
    INTERNAL_FILE,
    PUBLISHED_FILES,
    PUBLISHED_MARKER,
    SEAL_VERSION,
    STAGED_MARKER,
    SUMMARY_FILE,
    PublishedRun,
    Sealer,
    StagedRun,
    check_staged_seal,
    is_run_scratch,
    require_sealer,
)
from dpops.storage.base import check_run_id as _check_run_id
from dpops.storage.base import now_iso as _now
from dpops.storage.base import seal_payload as _seal_payload
from dpops.storage.location import Location
from dpops.storage.published import make_binding

STATE_DIR_ENV = "DPOPS_STATE_DIR"
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
PUBLIC_DIR_MODE = 0o755
PUBLIC_FILE_MODE = 0o644
_VERSION_RE = re.compile(r"^v(\d+)$")


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
        }.get(exc.errno or 0, exc.strerror or str(exc))
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


def _write_json(path: Path, doc: Any, mode: int = PRIVATE_FILE_MODE) -> None:
    """Write a new JSON file with an explicit mode (fchmod: the umask can only remove bits)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
    with open(fd, "w", encoding="utf-8") as fh:
        os.fchmod(fh.fileno(), mode)
        json.dump(doc, fh, indent=2, sort_keys=True, allow_nan=False)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())


def _mkdirs(base: Path, parts: tuple[str, ...], mode: int, *, force: bool) -> Path:
    """Create ``base/parts...`` one level at a time with an explicit ``mode``.

    ``force``: also chmod levels that already exist (the staged tree, so a tree an older version
    left 0755 is tightened). ``base`` itself (e.g. ``output.root``, which readers traverse) is
    created if missing but its mode is left alone."""
    base.mkdir(parents=True, exist_ok=True)
    cur = base
    for part in parts:
        cur = cur / part
        try:
            os.mkdir(cur, mode)
            created = True
        except FileExistsError:
            created = False
        if created or force:
            if cur.is_symlink() or not cur.is_dir():
                raise StorageError(f"{cur} must be a directory, not a symlink or file: remove it and retry")
            os.chmod(cur, mode)
    return cur


def private_state_dir() -> Path:
    """Where the private run log goes: ``$DPOPS_STATE_DIR``, else ``$XDG_STATE_HOME/dpops``, else
    ``~/.local/state/dpops``. Operators point it at a directory only the dpops user can read."""
    env = os.environ.get(STATE_DIR_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "dpops"


def _is_within(path: Path, root: Path) -> bool:
    p, r = os.path.realpath(path), os.path.realpath(root)
    return p == r or p.startswith(r.rstrip(os.sep) + os.sep)


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


# --------------------------------------------------------------------------- the store


class PrivateRunLog:
    """The PRIVATE run log (exact counts of the private data) of a store: always a local file under the
    private state directory (``$DPOPS_STATE_DIR``), whatever backend holds the outputs. Mixed into both
    stores; needs ``self.state_dir`` and ``self.release``."""

    state_dir: Path
    release: str

    def internal_log_path(self, interval_slug: str, run_id: str) -> Path:
        """The PRIVATE run log of one run (exact counts): under the state directory, never output.root."""
        _check_run_id(run_id)
        return self.state_dir / "runs" / self.release / interval_slug / f"{run_id}.internal.json"

    def read_internal_log(self, interval_slug: str, run_id: str) -> dict[str, Any] | None:
        """The run's internal counters, or None if this machine has no log for it (operators only)."""
        try:
            return _read_json(self.internal_log_path(interval_slug, run_id))
        except FileNotFoundError:
            return None

    def _write_internal_log(self, interval_slug: str, run_id: str, internal: dict[str, Any]) -> Path:
        """Atomically write the run log with 0700 directories and a 0600 file (explicit, not the umask)."""
        path = self.internal_log_path(interval_slug, run_id)
        folder = self._private_log_dir(interval_slug)
        with _storage_errors("write the private run log in", self.state_dir):
            tmp = folder / f".tmp-{run_id}-{secrets.token_hex(4)}"
            try:
                _write_json(tmp, internal, PRIVATE_FILE_MODE)
                os.replace(tmp, path)
            finally:
                if os.path.lexists(tmp):
                    os.unlink(tmp)
            _fsync_dir(folder)
        return path

    def _private_log_dir(self, interval_slug: str) -> Path:
        with _storage_errors("prepare the private state directory", self.state_dir):
            self.state_dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.state_dir, PRIVATE_DIR_MODE)
            return _mkdirs(self.state_dir, ("runs", self.release, interval_slug), PRIVATE_DIR_MODE, force=True)

    # ---- scratch leases ---------------------------------------------------------------------------
    # A run's ``.tmp-<run_id>-*`` scratch is swept on each new attempt, after sealing and at publish, so a
    # killed attempt's noisy shards do not stay behind (issue 19 item 8). A LIVE attempt of the same run
    # (a scheduled run and a backfill at once) must not lose its scratch: each attempt holds an exclusive
    # ``flock`` on ``<state dir>/runs/<release>/<interval>/<scratch name>.lease`` for as long as it runs.
    # The kernel drops the lock when the process dies, so a killed attempt's scratch is swept at once.
    # Attempts on other machines do not share the state dir: their scratch is not protected (documented).

    def take_scratch_lease(self, interval_slug: str, name: str) -> None:
        """Hold the lease of scratch ``name`` until ``drop_scratch_lease`` (or this process ends)."""
        import fcntl

        path = self._private_log_dir(interval_slug) / f"{name}.lease"
        with _storage_errors("take the scratch lease in", path.parent):
            fd = os.open(path, os.O_CREAT | os.O_RDWR | getattr(os, "O_CLOEXEC", 0), PRIVATE_FILE_MODE)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh random name: never contended
        leases: dict[str, int] = self.__dict__.setdefault("_scratch_leases", {})
        leases[name] = fd

    def drop_scratch_lease(self, interval_slug: str, name: str) -> None:
        fd = self.__dict__.get("_scratch_leases", {}).pop(name, None)
        if fd is None:
            return
        try:
            os.unlink(self.state_dir / "runs" / self.release / interval_slug / f"{name}.lease")
        except OSError:
            pass
        os.close(fd)

    def scratch_is_live(self, interval_slug: str, name: str) -> bool:
        """True while another attempt (a thread or process on this machine) holds the scratch's lease."""
        import fcntl

        if name in self.__dict__.get("_scratch_leases", {}):
            return True
        path = self.state_dir / "runs" / self.release / interval_slug / f"{name}.lease"
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        return False


class ReleaseStore(PrivateRunLog):
    """Staged and published outputs of one release under one local output root (the ``Store`` interface)."""

    def __init__(self, root: str | os.PathLike[str], release: str, *, sealer: Any = None,
                 state_dir: str | os.PathLike[str] | None = None):
        """``sealer``: the run's noise key (anything with ``seal_mac(bytes) -> str`` and ``key_id``);
        needed to seal and to verify staged output, not to list published versions.
        ``state_dir``: the private state directory (default ``private_state_dir()``), refused when it
        lies under ``root``, where readers could reach the exact counts in the run log."""
        if not re.match(r"^[a-z0-9_-]{1,64}$", release):
            raise StorageError(f"release name {release!r} is not safe for a path")
        self.root = Path(root)
        self.root_location = Location.local(self.root)
        self.release = release
        self.sealer = sealer
        self.state_dir = Path(state_dir) if state_dir is not None else private_state_dir()
        if _is_within(self.state_dir, self.root):
            raise StorageError(
                f"the private state directory {self.state_dir} (${STATE_DIR_ENV}) lies under output.root {self.root}: "
                "the internal run log holds exact counts of the private data and must not be where readers of the "
                f"output can reach it; set {STATE_DIR_ENV} to a directory outside output.root"
            )

    # ---- paths ------------------------------------------------------------------
    def staged_interval_dir(self, interval_slug: str) -> Path:
        return self.root / "staged" / self.release / interval_slug

    def staged_dir(self, interval_slug: str, run_id: str) -> Path:
        _check_run_id(run_id)
        return self.staged_interval_dir(interval_slug) / run_id

    def published_interval_dir(self, interval_slug: str) -> Path:
        return self.root / "published" / self.release / interval_slug

    def staged_interval_location(self, interval_slug: str) -> Location:
        return Location.local(self.staged_interval_dir(interval_slug))

    def published_interval_location(self, interval_slug: str) -> Location:
        return Location.local(self.published_interval_dir(interval_slug))

    def new_staging(self, interval_slug: str, run_id: str) -> Location:
        """``new_staging_dir`` as a ``Location`` (the ``Store`` interface)."""
        return Location.local(self.new_staging_dir(interval_slug, run_id))

    def discard_staging(self, staging: Location) -> None:
        _rmtree_quiet(staging.local_path)
        self.drop_scratch_lease(staging.parent.name, staging.name)

    def discard_run_scratch(self, interval_slug: str, run_id: str, *, keep: Location | None = None) -> list[str]:
        """Remove the run's other ``.tmp-<run_id>-*`` staging directories (a killed attempt's noisy shards)."""
        parent = self.staged_interval_dir(interval_slug)
        _check_run_id(run_id)
        try:
            names = os.listdir(parent)
        except OSError:
            return []
        removed = []
        for name in names:
            if (is_run_scratch(name, run_id) and (keep is None or keep.local_path != parent / name)
                    and not self.scratch_is_live(interval_slug, name)):
                _rmtree_quiet(parent / name)
                removed.append(name)
        return removed

    def next_version_location(self, interval_slug: str, run_id: str) -> Location:
        return Location.local(self.next_version_dir(interval_slug, run_id))

    def _require_sealer(self, what: str) -> Sealer:
        return require_sealer(self.sealer, what)

    # ---- staging ----------------------------------------------------------------
    def new_staging_dir(self, interval_slug: str, run_id: str) -> Path:
        """An empty, run-specific temporary directory for the pipeline to write into (hidden from readers)."""
        parent = self.staged_interval_dir(interval_slug)
        tmp = parent / f".tmp-{_check_run_id(run_id)}-{secrets.token_hex(4)}"
        # The lease lives in the private state directory: taking it first also checks, before ledger.start
        # (while the reservation is still refundable), that the state directory can be written.
        self.take_scratch_lease(interval_slug, tmp.name)
        try:
            self.discard_run_scratch(interval_slug, run_id)  # a killed attempt's leftovers (issue 19 item 8)
            with _storage_errors("create the staging directory", tmp):
                # Every level of staged/ is 0700, set explicitly: unreleased noisy values are not for readers.
                _mkdirs(self.root, ("staged", self.release, interval_slug), PRIVATE_DIR_MODE, force=True)
                os.mkdir(tmp, PRIVATE_DIR_MODE)
                os.chmod(tmp, PRIVATE_DIR_MODE)
        except BaseException:
            self.discard_staging(Location.local(tmp))
            raise
        return tmp

    def finish_staging(self, tmp_dir: Path | Location, interval_slug: str, run_id: str, internal: dict[str, Any], *,
                       test_mode: bool = False) -> StagedRun:
        """Seal a staging directory the pipeline filled: private run log, 0600 files, keyed seal, fsync, rename.

        The internal counters go to the private run log (``internal_log_path``), never next to the
        output. If another attempt already sealed this run id (a concurrent retry), that one is kept and
        ``tmp_dir`` discarded: both hold the same run, and the first one is what the ledger's start covers.
        """
        tmp_dir = Path(tmp_dir.local_path if isinstance(tmp_dir, Location) else tmp_dir)
        final = self.staged_dir(interval_slug, run_id)
        try:
            sealer = self._require_sealer("seal the staged output")
            with _storage_errors("stage the output in", tmp_dir):
                os.chmod(tmp_dir, PRIVATE_DIR_MODE)
                for name in PUBLISHED_FILES:
                    st = os.lstat(tmp_dir / name) if os.path.lexists(tmp_dir / name) else None
                    if st is None or not stat.S_ISREG(st.st_mode):
                        raise StorageError(f"the pipeline did not write {name} as a regular file in {tmp_dir}")
                    os.chmod(tmp_dir / name, PRIVATE_FILE_MODE)
                for extra in os.listdir(tmp_dir):  # scratch (e.g. shard files with counters) never stays behind
                    if extra not in PUBLISHED_FILES:
                        path = tmp_dir / extra
                        if path.is_dir() and not path.is_symlink():
                            shutil.rmtree(path)
                        else:
                            os.unlink(path)
                summary = _read_json(tmp_dir / SUMMARY_FILE)
                self._write_internal_log(interval_slug, run_id, internal)
                hashes = {}
                for name in PUBLISHED_FILES:
                    _fsync_file(tmp_dir / name)
                    hashes[name] = sha256_file(tmp_dir / name)
                # Either side saying "test mode" is enough: a seeded run must never look publishable.
                test_mode = bool(test_mode or summary.get("test_mode", False))
                payload = _seal_payload(self.release, interval_slug, run_id, hashes, test_mode)
                _write_json(tmp_dir / STAGED_MARKER, {
                    "run_id": run_id, "files": hashes, "test_mode": test_mode, "staged_at": _now(),
                    "seal": {"version": SEAL_VERSION, "key_id": getattr(sealer, "key_id", None),
                             "mac": sealer.seal_mac(payload)},
                })
                _fsync_dir(tmp_dir)
                if final.exists():
                    self.discard_staging(Location.local(tmp_dir))
                    return self.verify_staged(interval_slug, run_id)
                os.rename(tmp_dir, final)
                _fsync_dir(final.parent)
        except BaseException:
            self.discard_staging(Location.local(tmp_dir))
            raise
        self.drop_scratch_lease(interval_slug, tmp_dir.name)
        self.discard_run_scratch(interval_slug, run_id)
        return StagedRun(run_id, Location.local(final), hashes, test_mode)

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
        """Check the seal (HMAC under the noise key) and then every file's sha256.

        Any mismatch is an ``IntegrityError`` (exit 7): the staged output was changed, or sealed by
        someone without the key, and is never published. The remedy is to remove the run's staged
        directory and run again (keyed noise is recomputed under the same charge)."""
        d = self.staged_dir(interval_slug, run_id)
        remedy = f"remove {d} and run again (keyed randomness recomputes the same noise at no new charge)"
        try:
            marker = _read_json(d / STAGED_MARKER)
        except FileNotFoundError:
            raise StorageError(f"no sealed staged output for run {run_id} in {d} (compute it first)") from None
        except StorageError:
            raise IntegrityError(f"{d / STAGED_MARKER} is not a readable seal: the staged output is corrupt and will "
                                 f"not be published; {remedy}") from None
        files, test_mode = check_staged_seal(
            marker, str(d / STAGED_MARKER), release=self.release, interval_slug=interval_slug, run_id=run_id,
            sealer=self._require_sealer("verify the staged output"), published_files=PUBLISHED_FILES, remedy=remedy)
        for name, want in files.items():
            path = d / name
            try:
                st = os.lstat(path)
                if not stat.S_ISREG(st.st_mode):
                    raise IntegrityError(f"staged file {path} is not a regular file; it will not be published; "
                                         f"{remedy}")
                got = sha256_file(path)
            except OSError as exc:
                raise IntegrityError(f"staged file {path} is unreadable ({exc.strerror or exc}): the staged output is "
                                     f"corrupt; {remedy}") from None
            if got != want:
                raise IntegrityError(f"staged file {path} does not match the sealed sha256: the staged output was "
                                     f"changed after it was written; it will not be published; {remedy}")
        return StagedRun(run_id, Location.local(d), dict(files), test_mode)

    # ---- publishing -------------------------------------------------------------
    def versions(self, interval_slug: str) -> list[PublishedRun]:
        base = self.published_interval_dir(interval_slug)
        out: list[PublishedRun] = []
        if not base.is_dir():
            return out
        for child in base.iterdir():
            m = _VERSION_RE.match(child.name)
            if m and (child / PUBLISHED_MARKER).is_file():
                doc = _read_json(child / PUBLISHED_MARKER)
                out.append(PublishedRun(
                    run_id=doc.get("run_id", ""), version=int(m.group(1)), location=Location.local(child),
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
            if v.location.name == target:
                return v
        raise StorageError(f"{link} points to {target!r}, which is not a published version")

    def publish(self, staged: StagedRun, interval_slug: str, *, restates: str | None = None,
                extra: dict[str, Any] | None = None, ledger_entry_hash: str | None = None,
                ledger_id: str | None = None) -> PublishedRun:
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
        self.discard_run_scratch(interval_slug, staged.run_id)  # after publish nothing of the run stays in scratch
        for v in existing:
            if v.run_id == staged.run_id:
                if v.version == max(e.version for e in existing):
                    self._point_current(base, v.location.name)
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
                # The product is for readers: explicit modes, not the umask (staged copies are 0600).
                _mkdirs(self.root, ("published", self.release, interval_slug), PUBLIC_DIR_MODE, force=False)
                os.mkdir(tmp, PUBLIC_DIR_MODE)
                os.chmod(tmp, PUBLIC_DIR_MODE)
                for name in PUBLISHED_FILES:
                    shutil.copyfile(staged.directory / name, tmp / name)
                    os.chmod(tmp / name, PUBLIC_FILE_MODE)
                    _fsync_file(tmp / name)
                    hashes[name] = sha256_file(tmp / name)
                    if hashes[name] != staged.hashes[name]:
                        raise StorageError(f"copy of {name} to {tmp} does not match the staged file; nothing published")
                binding = make_binding(self.sealer, release=self.release, interval=interval_slug, version=version,
                                       run_id=staged.run_id, ledger_entry_hash=ledger_entry_hash, files=hashes,
                                       output_root=self.root_location.uri, ledger_id=ledger_id)
                _write_json(tmp / PUBLISHED_MARKER, mode=PUBLIC_FILE_MODE, doc={
                    **(extra or {}), "release": self.release, "interval": interval_slug, "run_id": staged.run_id,
                    "version": version, "files": hashes, "restates": restates, "published_at": published_at,
                    "binding": binding,
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
        return PublishedRun(staged.run_id, version, Location.local(final), hashes, restates, published_at,
                            dict(extra or {}))

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



LocalReleaseStore = ReleaseStore

__all__ = ["ReleaseStore", "PrivateRunLog", "LocalReleaseStore", "PUBLISHED_FILES", "StagedRun", "PublishedRun", "sha256_file", "private_state_dir", "DATA_FILE",
           "SUMMARY_FILE", "INTERNAL_FILE", "STATE_DIR_ENV"]
