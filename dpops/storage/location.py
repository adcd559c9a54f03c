"""``Location``: one typed value for "a file or directory", local or on an object store.

dpops reads inputs and writes staged and published outputs either on a local filesystem or on an
object store (``s3://``, ``gs://``, anything ``pyarrow.fs.FileSystem.from_uri`` understands). Every
place that names such a thing (``ReleaseSpec.output_root``, ``ReleaseSpec.resolve_path``, the stores'
records, manifests) carries a ``Location``, never a bare ``str`` that might or might not be a URI.

- A local location holds an absolute, normalised POSIX path (``scheme == "file"``). ``file://`` URIs
  become local locations. ``os.fspath(loc)`` works for local locations only, so code that must stay
  local (the private state directory, ``chmod``) fails loudly on a URI instead of creating a
  ``s3:/bucket`` directory next to the working directory.
- A remote location holds ``scheme`` and ``path`` = ``bucket/key/...`` without leading or trailing
  slash; ``str(loc)`` and ``loc.uri`` give ``s3://bucket/key``.

Correctness reasons for the strict parse: locations are compared as allow-list prefixes
(``DPOPS_OUTPUT_ROOTS``, ``DPOPS_DATA_ROOTS``), so a ``..`` or ``.`` segment, a query string or a
fragment (which pyarrow would interpret as options) is refused rather than normalised, and
comparisons are made on path-segment boundaries (``s3://b/out`` does not contain ``s3://b/outside``).
S3 endpoints and credentials never appear in a location: they come from ``AWS_ENDPOINT_URL`` and the
usual provider chain.
"""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from dpops.errors import StorageError

if TYPE_CHECKING:  # pyarrow is imported lazily: loading a spec must not need it
    import pyarrow.fs

LOCAL = "file"
_URI_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.S)


def is_uri(text: str) -> bool:
    """True for ``scheme://...`` text (``file://`` included)."""
    return bool(_URI_RE.match(str(text)))


class LocationError(StorageError):
    """A path or URI that cannot name a dpops location (``..``, a query string, an empty bucket)."""


@dataclass(frozen=True, order=True)
class Location:
    scheme: str
    path: str

    # ---- construction ------------------------------------------------------------
    @classmethod
    def local(cls, path: str | os.PathLike[str]) -> Location:
        """An absolute local path (``~`` expanded, ``.``/``..`` collapsed by ``normpath``)."""
        p = os.path.normpath(os.path.abspath(os.path.expanduser(os.fspath(path))))
        return cls(LOCAL, p)

    @classmethod
    def parse(cls, text: str | os.PathLike[str] | Location, *, base: Location | str | os.PathLike[str] | None = None,
              ) -> Location:
        """A path or URI as a location; a relative path is taken below ``base`` (refused without one)."""
        if isinstance(text, Location):
            return text
        raw = os.fspath(text)
        m = _URI_RE.match(raw)
        if m is None:
            if os.path.isabs(os.path.expanduser(raw)):
                return cls.local(raw)
            if base is None:
                raise LocationError(f"{raw!r} is a relative path and no base directory is known")
            return cls.parse(base).join(raw)
        scheme, rest = m.group(1).lower(), m.group(2)
        if "?" in rest or "#" in rest:
            raise LocationError(f"{raw!r}: a location must not carry a query string or fragment (endpoints and "
                                "credentials come from AWS_ENDPOINT_URL and the provider chain)")
        if scheme == LOCAL:
            host, _, path = rest.partition("/")
            if host not in ("", "localhost"):
                raise LocationError(f"{raw!r}: a file:// URI must name a local path (file:///abs/path)")
            _refuse_dots(raw, path.split("/"))
            return cls.local("/" + path)
        segments = [s for s in rest.split("/") if s]
        _refuse_dots(raw, segments)
        if not segments:
            raise LocationError(f"{raw!r}: an object-store URI must name a bucket ({scheme}://bucket/prefix)")
        return cls(scheme, "/".join(segments))

    # ---- views -------------------------------------------------------------------
    @property
    def is_local(self) -> bool:
        return self.scheme == LOCAL

    @property
    def local_path(self) -> Path:
        if not self.is_local:
            raise LocationError(f"{self} is not a local path")
        return Path(self.path)

    @property
    def uri(self) -> str:
        return Path(self.path).as_uri() if self.is_local else f"{self.scheme}://{self.path}"

    @property
    def name(self) -> str:
        return posixpath.basename(self.path.rstrip("/"))

    @property
    def parent(self) -> Location:
        if self.is_local:
            return Location(LOCAL, os.path.dirname(self.path) or "/")
        head = posixpath.dirname(self.path)
        return Location(self.scheme, head) if head else self

    def __str__(self) -> str:
        return self.path if self.is_local else self.uri

    def __fspath__(self) -> str:
        if not self.is_local:
            raise TypeError(f"{self.uri} is an object-store location, not a local path")
        return self.path

    def join(self, *parts: str) -> Location:
        """``self / part / ...``; parts are relative (``a/b`` allowed), never ``..`` or absolute."""
        segs: list[str] = []
        for part in parts:
            text = os.fspath(part)
            if text.startswith("/") or is_uri(text):
                raise LocationError(f"cannot join {text!r} below {self}: it is not a relative path")
            pieces = [s for s in text.split("/") if s and s != "."]
            _refuse_dots(text, pieces)
            segs.extend(pieces)
        if not segs:
            return self
        if self.is_local:
            return Location(LOCAL, os.path.join(self.path, *segs))
        return Location(self.scheme, "/".join([self.path, *segs]))

    def __truediv__(self, part: str) -> Location:
        return self.join(part)

    def is_under(self, root: Location) -> bool:
        """``self`` is ``root`` or below it, compared on path-segment boundaries (no string prefix tricks)."""
        if self.scheme != root.scheme:
            return False
        if self.is_local:
            return PurePosixPath(self.path).is_relative_to(PurePosixPath(root.path))
        return self.path == root.path or self.path.startswith(root.path.rstrip("/") + "/")

    def relative_to(self, root: Location) -> str:
        if not self.is_under(root):
            raise LocationError(f"{self} is not below {root}")
        if self.path == root.path:
            return ""
        return self.path[len(root.path.rstrip("/")) + 1:]

    def realpath(self) -> Location:
        """Local: symlinks resolved (``os.path.realpath``); remote: itself (object stores have no links)."""
        return Location(LOCAL, os.path.realpath(self.path)) if self.is_local else self

    # ---- filesystem --------------------------------------------------------------
    def filesystem(self) -> tuple[pyarrow.fs.FileSystem, str]:
        """The pyarrow filesystem and the path in it. S3: ``AWS_ENDPOINT_URL`` and the provider chain."""
        import pyarrow.fs as pafs

        if self.is_local:
            return pafs.LocalFileSystem(), self.path
        return _remote_fs(self.scheme, self.path.split("/", 1)[0]), self.path


def _refuse_dots(raw: str, segments: list[str]) -> None:
    if any(s in ("..", ".") for s in segments if s):
        raise LocationError(f"{raw!r} must not contain '.' or '..' segments")


def _remote_fs(scheme: str, bucket: str) -> pyarrow.fs.FileSystem:
    """One filesystem object per (scheme, bucket, endpoint) in this process.

    ``FileSystem.from_uri`` resolves the bucket's region on S3 with a network call; caching keeps
    that to once. The endpoint is part of the key so a test that changes ``AWS_ENDPOINT_URL``
    gets a fresh client."""
    key = (scheme, bucket, os.environ.get("AWS_ENDPOINT_URL", ""), os.environ.get("AWS_ACCESS_KEY_ID", ""))
    fs = _FS_CACHE.get(key)
    if fs is None:
        import pyarrow.fs as pafs

        try:
            # pyarrow's from_uri honours AWS_ENDPOINT_URL (measured with pyarrow 25 against moto; a bare
            # S3FileSystem() does not) and the AWS provider chain for credentials.
            fs, _ = pafs.FileSystem.from_uri(f"{scheme}://{bucket}")
        except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for an unknown scheme or a missing SDK
            raise StorageError(f"cannot open the filesystem for {scheme}://{bucket}: {exc}") from None
        _FS_CACHE[key] = fs
    return fs


_FS_CACHE: dict[tuple[str, str, str, str], pyarrow.fs.FileSystem] = {}


def as_location(p: str | os.PathLike[str] | Location) -> Location:
    """A path or URI the pipeline or a caller gave as a ``Location`` (relative paths: the working directory)."""
    if isinstance(p, Location):
        return p
    text = os.fspath(p)
    return Location.parse(text) if is_uri(text) else Location.local(text)


def location_uri(loc: Location) -> str:
    """The URI recorded in the ledger and the manifest: ``file://`` of the resolved local path, or the object URI."""
    return loc.local_path.resolve().as_uri() if loc.is_local else loc.uri


__all__ = ["Location", "LocationError", "is_uri", "as_location", "location_uri", "LOCAL"]
