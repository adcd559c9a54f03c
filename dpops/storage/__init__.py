"""Staged and published release outputs, on a local filesystem or an object store.

- ``location``: ``Location``, the one typed value for a local path or an object-store URI, and
  ``as_location`` / ``location_uri`` to convert caller paths and record URIs.
- ``base``: the ``Store`` interface the run steps use, the shared records (``StagedRun``,
  ``PublishedRun``) and the staging-seal payload.
- ``local``: ``ReleaseStore`` (alias ``LocalReleaseStore``), the local backend: 0700/0600 staging,
  ``os.replace``, fsync, a ``current`` symlink.
- ``objectstore``: ``ObjectReleaseStore``, S3/GCS through ``pyarrow.fs``: immutable version prefixes
  and a ``current`` pointer object written last (conditional write on S3).
- ``files``: small reads and writes at a ``Location`` (inputs, manifests, file checks).

``open_store(root, release, ...)`` picks the backend from the root. ``from dpops.storage import
ReleaseStore, StagedRun, ...`` keeps working for existing importers (``ReleaseStore`` is the local one).
"""

from __future__ import annotations

import os

from dpops.storage.base import (
    DATA_FILE,
    INTERNAL_FILE,
    PUBLISHED_FILES,
    SUMMARY_FILE,
    PublishedRun,
    Sealer,
    StagedRun,
    Store,
)
from dpops.storage.local import STATE_DIR_ENV, LocalReleaseStore, ReleaseStore, private_state_dir, sha256_file
from dpops.storage.location import Location, LocationError, as_location, is_uri, location_uri


def open_store(root: Location | str | os.PathLike[str], release: str, *, sealer: Sealer | None = None,
               state_dir: str | os.PathLike[str] | None = None) -> Store:
    """The store for ``root``: the local backend for a local path or ``file://``, else the object-store one."""
    loc = root if isinstance(root, Location) else (Location.parse(os.fspath(root)) if is_uri(os.fspath(root))
                                                    else Location.local(root))
    if loc.is_local:
        return ReleaseStore(loc.local_path, release, sealer=sealer, state_dir=state_dir)
    from dpops.storage.objectstore import ObjectReleaseStore

    return ObjectReleaseStore(loc, release, sealer=sealer, state_dir=state_dir)


__all__ = ["open_store", "Store", "ReleaseStore", "LocalReleaseStore", "StagedRun", "PublishedRun", "Sealer",
           "Location", "LocationError", "is_uri", "as_location", "location_uri", "sha256_file", "private_state_dir",
           "DATA_FILE", "SUMMARY_FILE", "INTERNAL_FILE", "PUBLISHED_FILES", "STATE_DIR_ENV"]
