"""Small file operations on a ``Location``, local or object store, through ``pyarrow.fs``.

One layer for every reader that must work on both (input files and their fingerprint, the public
partition file, manifests, published-file checks, the object-store backend). No hand-written
object-store client: pyarrow's S3/GCS filesystems do the I/O, configured the standard way
(``AWS_ENDPOINT_URL``, the AWS provider chain; see ``Location.filesystem``).

Errors are ``OSError`` (``FileNotFoundError`` for a missing object) as pyarrow raises them; callers
turn them into their own ``StorageError`` / ``InputDataError`` naming the location, never the content.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from collections.abc import Iterator
from typing import Any

from dpops.storage.location import Location

CHUNK = 1 << 20
_GLOB_CHARS = re.compile(r"[*?\[]")


def _info(loc: Location) -> Any:
    fs, path = loc.filesystem()
    return fs.get_file_info(path)


def exists(loc: Location) -> bool:
    import pyarrow.fs as pafs

    return bool(_info(loc).type != pafs.FileType.NotFound)


def is_file(loc: Location) -> bool:
    import pyarrow.fs as pafs

    return bool(_info(loc).type == pafs.FileType.File)


def size(loc: Location) -> int:
    info = _info(loc)
    if info.size is None:
        raise FileNotFoundError(f"{loc} does not exist")
    return int(info.size)


def read_bytes(loc: Location, *, limit: int | None = None) -> bytes | None:
    """The whole object; ``None`` when it is larger than ``limit`` bytes (nothing beyond is read)."""
    fs, path = loc.filesystem()
    with fs.open_input_stream(path) as fh:
        data = fh.read(limit + 1) if limit is not None else fh.read()
    if limit is not None and len(data) > limit:
        return None
    return bytes(data)


def iter_chunks(loc: Location) -> Iterator[bytes]:
    fs, path = loc.filesystem()
    with fs.open_input_stream(path) as fh:
        while True:
            chunk = fh.read(CHUNK)
            if not chunk:
                return
            yield bytes(chunk)


def sha256(loc: Location) -> str:
    h = hashlib.sha256()
    for chunk in iter_chunks(loc):
        h.update(chunk)
    return h.hexdigest()


def sha256_and_size(loc: Location) -> tuple[int, str]:
    h = hashlib.sha256()
    n = 0
    for chunk in iter_chunks(loc):
        h.update(chunk)
        n += len(chunk)
    return n, h.hexdigest()


def write_bytes(loc: Location, data: bytes) -> None:
    """Write a whole object (object stores: one PUT, visible all at once or not at all)."""
    fs, path = loc.filesystem()
    with fs.open_output_stream(path) as fh:
        fh.write(data)


def json_bytes(doc: Any) -> bytes:
    return (json.dumps(doc, indent=2, sort_keys=True, allow_nan=False) + "\n").encode()


def read_json(loc: Location) -> Any:
    data = read_bytes(loc)
    assert data is not None
    return json.loads(data)


def write_json(loc: Location, doc: Any) -> None:
    write_bytes(loc, json_bytes(doc))


def copy(src: Location, dst: Location) -> None:
    """Copy one object: server-side within one bucket (S3 CopyObject via pyarrow, objects up to 5 GB; release
    outputs are aggregates, far smaller), else by streaming (works across local and remote)."""
    sfs, spath = src.filesystem()
    dfs, dpath = dst.filesystem()
    if not src.is_local and sfs is dfs:
        sfs.copy_file(spath, dpath)
        return
    with sfs.open_input_stream(spath) as fin, dfs.open_output_stream(dpath) as fout:
        while chunk := fin.read(CHUNK):
            fout.write(chunk)


def list_dir(loc: Location) -> list[str]:
    """Names directly below ``loc`` (files and "directories"); empty when there is nothing."""
    import pyarrow.fs as pafs

    fs, path = loc.filesystem()
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True, recursive=False))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(i.base_name for i in infos)


def list_files(loc: Location) -> list[str]:
    """Every file below ``loc`` (recursive), as paths relative to ``loc``."""
    import pyarrow.fs as pafs

    fs, path = loc.filesystem()
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True, recursive=True))
    except (FileNotFoundError, NotADirectoryError):
        return []
    base = path.rstrip("/") + "/"
    return sorted(i.path[len(base):] for i in infos if i.type == pafs.FileType.File and i.path.startswith(base))


def delete_tree(loc: Location) -> None:
    """Remove ``loc`` and everything below it; missing is fine."""
    fs, path = loc.filesystem()
    try:
        fs.delete_dir(path)
    except FileNotFoundError:
        pass
    except OSError:
        try:
            fs.delete_file(path)
        except (FileNotFoundError, OSError):
            pass


def delete_file(loc: Location) -> None:
    fs, path = loc.filesystem()
    try:
        fs.delete_file(path)
    except FileNotFoundError:
        pass


def has_glob(text: str) -> bool:
    return bool(_GLOB_CHARS.search(text))


def glob(pattern: Location) -> list[Location]:
    """Files matching a glob ``pattern`` (``*``, ``?``, ``[``; ``*`` does not cross ``/``), sorted.

    Listing starts at the deepest directory without glob characters, so an object-store glob lists
    one prefix, not the bucket."""
    segments = pattern.path.split("/")
    fixed: list[str] = []
    for seg in segments:
        if has_glob(seg):
            break
        fixed.append(seg)
    if len(fixed) == len(segments):
        return [pattern] if is_file(pattern) else []
    base = Location(pattern.scheme, "/".join(fixed) or "/")
    depth = len(segments) - len(fixed)
    out = []
    for rel in list_files(base):
        parts = rel.split("/")
        if len(parts) != depth:
            continue
        if all(fnmatch.fnmatchcase(p, s) for p, s in zip(parts, segments[len(fixed):])):
            out.append(base.join(rel))
    return sorted(out)


__all__ = ["exists", "is_file", "size", "read_bytes", "iter_chunks", "sha256", "sha256_and_size", "write_bytes",
           "read_json", "write_json", "json_bytes", "copy", "list_dir", "list_files", "delete_tree", "delete_file",
           "glob", "has_glob"]
