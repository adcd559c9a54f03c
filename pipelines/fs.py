"""Files of the release pipeline through Beam's ``FileSystems``: local paths and URIs alike.

Why Beam's layer (and not pyarrow.fs) inside the pipeline: it is what every Beam runner configures
on its workers from the pipeline options (``--s3_endpoint_url``, GCS credentials, HDFS hosts), so a
worker on Dataflow, Flink or Spark opens ``gs://`` / ``s3://`` / ``hdfs://`` exactly as Beam's own
sources and sinks do, with nothing dpops-specific to install or configure there. Local paths go
through the same calls (Beam's ``LocalFileSystem``); ``file://`` URIs are turned into local paths
first (Beam registers no ``file`` scheme).

S3-compatible endpoints: the standard ``AWS_ENDPOINT_URL`` environment variable, which boto3
honours by itself when no endpoint is passed; ``s3_options`` also forwards it to the workers as
Beam's ``--s3_endpoint_url`` (not a secret). Credentials come from boto3's provider chain on each
worker, never from the command line or the pipeline options.

Atomic enough: a file is written to a temporary name and renamed on filesystems that rename
(local, HDFS); on object stores (``s3``, ``gs``, ``az``...) an object appears only when its single
upload completes, so it is written under its final name. Either way a reader never sees a partial
file under the final name.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Mapping
from urllib.parse import unquote, urlparse

from dpops.errors import StorageError

_SCHEME = re.compile(r"^(?P<scheme>[a-zA-Z][-a-zA-Z0-9+.]*)://")
OBJECT_STORE_SCHEMES = frozenset({"s3", "gs", "az", "azfs", "abfs", "abfss"})
ENDPOINT_ENV = "AWS_ENDPOINT_URL"


def scheme(path: str) -> str | None:
    m = _SCHEME.match(path)
    return m.group("scheme").lower() if m else None


def normalize(path: str) -> str:
    """``file://`` URIs -> local paths; every other path or URI unchanged."""
    if scheme(path) == "file":
        return unquote(urlparse(path).path)
    return path


def is_local(path: str) -> bool:
    return scheme(normalize(path)) is None


def join(base: str, *names: str) -> str:
    base = normalize(base)
    if is_local(base):
        return os.path.join(base, *names)
    return "/".join([base.rstrip("/"), *names])


def _fs():
    from apache_beam.io.filesystems import FileSystems

    return FileSystems


def write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` so that ``path`` never holds a partial file (module doc)."""
    from apache_beam.io.filesystem import CompressionTypes

    fs = _fs()
    path = normalize(path)
    renames = scheme(path) not in OBJECT_STORE_SCHEMES
    target = f"{path}.tmp-{uuid.uuid4().hex}" if renames else path
    fh = fs.create(target, compression_type=CompressionTypes.UNCOMPRESSED)
    try:
        fh.write(data)
    finally:
        fh.close()
    if renames:
        if is_local(path) and os.path.exists(path):
            os.replace(target, path)  # a retried bundle rewrites its shard: replace, as os.replace did before
        else:
            fs.rename([target], [path])


def read_bytes(path: str) -> bytes:
    from apache_beam.io.filesystem import CompressionTypes

    fh = _fs().open(normalize(path), compression_type=CompressionTypes.UNCOMPRESSED)
    try:
        return fh.read()
    finally:
        fh.close()


def open_input(path: str):
    """What pyarrow reads an input from: the local path itself (memory-mapped, as before), else a
    seekable stream from Beam's filesystem for the URI."""
    path = normalize(path)
    if is_local(path):
        return path
    from apache_beam.io.filesystem import CompressionTypes

    return _fs().open(path, compression_type=CompressionTypes.UNCOMPRESSED)


def exists(path: str) -> bool:
    return _fs().exists(normalize(path))


def list_files(prefix_dir: str) -> list[str]:
    """Paths of the files directly under ``prefix_dir`` (a directory or an object prefix)."""
    pattern = join(prefix_dir, "*")
    try:
        res = _fs().match([pattern])
    except Exception:  # noqa: BLE001 - Beam raises BeamIOError for "nothing matched" on some filesystems
        return []
    return [m.path for r in res for m in r.metadata_list]


def delete_tree(dir_: str) -> None:
    """Remove ``dir_`` and the files under it (a prefix on object stores). Missing is fine."""
    dir_ = normalize(dir_)
    if is_local(dir_):
        import shutil

        shutil.rmtree(dir_, ignore_errors=True)
        return
    files = list_files(dir_)
    if files:
        _fs().delete(files)


def delete_everything_under(dir_: str) -> None:
    """Remove ``dir_`` and every file below it, at any depth (``delete_tree`` removes its direct files only on
    object stores). Missing is fine."""
    dir_ = normalize(dir_)
    if is_local(dir_):
        delete_tree(dir_)
        return
    try:
        res = _fs().match([join(dir_, "**")])
    except Exception:  # noqa: BLE001 - Beam raises BeamIOError for "nothing matched" on some filesystems
        return
    files = [m.path for r in res for m in r.metadata_list]
    if files:
        _fs().delete(files)


def delete_files(paths: list[str]) -> None:
    """Remove these files (local paths or URIs). Missing is fine."""
    paths = [normalize(x) for x in paths]
    local = [x for x in paths if is_local(x)]
    for x in local:
        try:
            os.remove(x)
        except FileNotFoundError:
            pass
    remote = [x for x in paths if not is_local(x)]
    if remote:
        _fs().delete(remote)


def make_dirs(dir_: str) -> None:
    dir_ = normalize(dir_)
    if is_local(dir_):
        os.makedirs(dir_, exist_ok=True)
    # object stores have no directories; other filesystems create parents on write


def s3_options(options: list[str], env: Mapping[str, str] | None = None) -> list[str]:
    """``options`` plus ``--s3_endpoint_url=$AWS_ENDPOINT_URL`` when that variable is set and the
    option is not given: the workers then reach the same S3-compatible endpoint as the driver even
    where the variable is not set. An endpoint URL is not a secret; credentials are never forwarded."""
    endpoint = (os.environ if env is None else env).get(ENDPOINT_ENV)
    if endpoint and not any(o == "--s3_endpoint_url" or o.startswith("--s3_endpoint_url=") for o in options):
        return [*options, f"--s3_endpoint_url={endpoint}"]
    return list(options)


def storage_error(path: str, what: str, exc: BaseException) -> StorageError:
    """A StorageError naming the path and the failing class (the exception text may be long or foreign)."""
    return StorageError(f"{path}: {what} ({type(exc).__name__}); check that the location exists, is writable "
                        "and reachable with the configured credentials")
