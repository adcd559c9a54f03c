"""Reading and writing manifest files: validated, atomic, immutable.

A manifest is written once (temp file in the same directory, fsync, rename,
fsync of the directory) and never replaced: ``os.link`` publishes the temp file
under its final name and fails if that name exists, so two writers racing for
the same manifest cannot both win. A correction is a *new* document whose
``corrects`` field names the old file and its sha256.

Manifests may live under an object-store output root (``s3://.../manifests/<release>``): every
function here also takes a URI (or a ``dpops.storage.Location``) and goes through the storage layer
(pyarrow.fs); there the write-once guarantee is a conditional create (S3 ``If-None-Match: *``).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from dpops.errors import IntegrityError, InvalidParameter, StorageError
from dpops.manifest.schema import check_manifest, upgrade
from dpops.storage.location import Location, is_uri

PathOrLocation = str | os.PathLike[str] | Location


def _remote(p: PathOrLocation) -> Location | None:
    """The object-store location of ``p``, or None when it is a local path (or a file:// URI)."""
    if isinstance(p, Location):
        return None if p.is_local else p
    text = os.fspath(p)
    if is_uri(text):
        loc = Location.parse(text)
        return None if loc.is_local else loc
    return None


def _local(p: PathOrLocation) -> Path:
    if isinstance(p, Location):
        return p.local_path
    text = os.fspath(p)
    return Location.parse(text).local_path if is_uri(text) else Path(text)


def manifest_exists(directory: PathOrLocation, name: str) -> str | None:
    """The manifest ``name`` in ``directory`` as a path or URI if it exists, else None."""
    from dpops.storage import files

    remote = _remote(directory)
    if remote is not None:
        try:
            return str(remote / name) if files.is_file(remote / name) else None
        except OSError as exc:
            raise StorageError(f"cannot read the manifest directory {remote}: {exc}") from None
    p = _local(directory) / name
    return str(p) if p.exists() else None

MAX_MANIFEST_BYTES = 16 * 1024 * 1024


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """The file form: sorted keys, 2-space indent, UTF-8, trailing newline. NaN/inf refused."""
    try:
        text = json.dumps(manifest, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False)
    except ValueError as exc:
        raise InvalidParameter(f"manifest contains a non-finite number ({exc}); refusing to write it") from None
    return (text + "\n").encode("utf-8")


def manifest_filename(manifest: dict[str, Any]) -> str:
    """``<run_id>.<outcome>.json``; a correction adds the first 12 hex of the corrected file's sha256."""
    name = f"{manifest['run_id']}.{manifest['outcome']['state']}"
    if manifest.get("corrects"):
        name += f".corrects-{manifest['corrects']['sha256'][:12]}"
    return name + ".json"


def write_manifest(manifest: dict[str, Any], directory: PathOrLocation) -> str:
    """Validate, then write atomically to ``directory/<manifest_filename>``; never overwrite. Returns the path."""
    check_manifest(manifest, source=f"manifest for run {manifest.get('run_id')!r}", error=InvalidParameter)
    data = manifest_bytes(manifest)
    remote = _remote(directory)
    if remote is not None:
        return _write_remote(data, remote / manifest_filename(manifest))
    d = _local(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StorageError(f"cannot create manifest directory {d}: {exc.strerror or exc}") from None
    final = d / manifest_filename(manifest)
    if final.exists():
        raise StorageError(
            f"{final} already exists: manifests are immutable; write a correction (a new manifest whose "
            "'corrects' names the old file) instead of replacing it"
        )
    tmp_name = None
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=".manifest-", suffix=".tmp", dir=d)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp_name, 0o444)  # read-only: a reminder that nobody edits a manifest in place
        try:
            os.link(tmp_name, final)  # atomic and refuses to replace an existing name (unlike rename)
        except FileExistsError:
            raise StorageError(f"{final} was written concurrently by another process; manifests are immutable") from None
        _fsync_dir(d)
    except OSError as exc:
        raise StorageError(f"cannot write manifest {final}: {exc.strerror or exc}") from None
    finally:
        if tmp_name and os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return str(final)


def _write_remote(data: bytes, final: Location) -> str:
    from dpops.storage.objectstore import PreconditionFailed, put_conditional

    try:
        put_conditional(final, data, if_none_match=True)  # write once: a second writer's create fails
    except PreconditionFailed:
        raise StorageError(f"{final} already exists: manifests are immutable; write a correction (a new manifest "
                           "whose 'corrects' names the old file) instead of replacing it") from None
    except OSError as exc:
        raise StorageError(f"cannot write manifest {final}: {exc}") from None
    return str(final)


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the data file itself was synced
    finally:
        os.close(fd)


def read_manifest(path: PathOrLocation) -> dict[str, Any]:
    """Read, upgrade to the current version and validate. Any problem is an ``IntegrityError`` naming file and field."""
    return parse_manifest(read_manifest_bytes(path), source=str(path))


def read_manifest_and_digest(path: PathOrLocation) -> tuple[dict[str, Any], str]:
    """``read_manifest`` and the sha256 of the bytes it parsed (one read): what a verifier compares with the
    ledger's commit entry is then the document whose claims it checks, even if the file is replaced meanwhile."""
    raw = read_manifest_bytes(path)
    return parse_manifest(raw, source=str(path)), hashlib.sha256(raw).hexdigest()


def read_manifest_bytes(path: PathOrLocation) -> bytes:
    """A manifest file's bytes (at most ``MAX_MANIFEST_BYTES``), local or on an object store. A caller that compares
    their sha256 with the ledger's commit entry and then acts on the content (serving a committed estimation)
    parses these same bytes (``parse_manifest``): one read, so a file replaced between two reads cannot slip in."""
    remote = _remote(path)
    p: Path | Location = remote if remote is not None else _local(path)
    try:
        if isinstance(p, Location):
            from dpops.storage import files

            got = files.read_bytes(p, limit=MAX_MANIFEST_BYTES)
            if got is None:
                raise IntegrityError(f"{p}: larger than any manifest ({MAX_MANIFEST_BYTES} bytes)")
            return got
        size = p.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise IntegrityError(f"{p}: {size} bytes is larger than any manifest ({MAX_MANIFEST_BYTES} bytes)")
        return p.read_bytes()
    except OSError as exc:
        raise StorageError(f"cannot read manifest {p}: {exc.strerror or exc}") from None


def parse_manifest(raw: bytes, *, source: str) -> dict[str, Any]:
    """A manifest's bytes parsed (no NaN or infinity), upgraded to the current version and validated; ``source``
    names the file in an ``IntegrityError``."""
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise IntegrityError(f"{source}: not a JSON manifest ({exc})") from None
    if not isinstance(doc, dict):
        raise IntegrityError(f"{source}: a manifest must be a JSON object")
    doc = upgrade(doc, source=source)
    return check_manifest(doc, source=source)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in a manifest")


def file_sha256(path: PathOrLocation) -> str:
    """sha256 of a manifest file's bytes (used by ``corrects`` to pin the corrected document)."""
    remote = _remote(path)
    if remote is not None:
        from dpops.storage import files

        return files.sha256(remote)
    return hashlib.sha256(_local(path).read_bytes()).hexdigest()


def find_manifest(run_or_path: str, directory: PathOrLocation | None) -> Path | Location:
    """A path as given, or the manifest of ``run_id`` in ``directory`` (the latest correction wins)."""
    remote = _remote(run_or_path)
    if remote is not None:
        return remote
    if directory is not None and _remote(directory) is not None:
        return _find_remote(run_or_path, _remote(directory))  # type: ignore[arg-type]
    p = Path(run_or_path)
    if p.suffix == ".json" or p.exists():
        if not p.exists():
            raise StorageError(f"manifest file {p} does not exist")
        return p
    if directory is None:
        raise InvalidParameter(
            f"{run_or_path!r} is not a file, and no manifests directory is known to look a run id up in: give "
            "--manifests DIR or set DPOPS_MANIFESTS_DIR (the deploy/ stack sets it), or --spec SPEC to look in that "
            "release's default directory <output.root>/manifests/<release>")
    d = _local(directory)
    hits = sorted(d.glob(f"{run_or_path}.*.json"), key=lambda q: (q.stat().st_mtime_ns, q.name))
    if not hits:
        raise StorageError(f"no manifest for run {run_or_path!r} in {d}")
    return hits[-1]


def _find_remote(run_id: str, directory: Location) -> Location:
    import pyarrow.fs as pafs

    fs, path = directory.filesystem()
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    except OSError as exc:
        raise StorageError(f"cannot list manifests in {directory}: {exc}") from None
    hits = [i for i in infos if i.type == pafs.FileType.File and i.base_name.startswith(f"{run_id}.")
            and i.base_name.endswith(".json")]
    if not hits:
        raise StorageError(f"no manifest for run {run_id!r} in {directory}")
    best = max(hits, key=lambda i: (i.mtime_ns or 0, i.base_name))
    return directory / best.base_name
