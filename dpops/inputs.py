"""The private input of a run: which files, whether they match the spec, and a keyed fingerprint.

Everything here runs BEFORE any budget is reserved, so a missing file or a wrong
schema costs nothing. Only the schema (column names and types) is checked, never
values: deciding from the data whether to run would itself leak (semantics.md
section 6). Malformed values are the pipeline's job (dropped row by row, counted
in the internal run log).

CSV files carry no types, so for CSV only the header's names are checked; the
declared types are enforced row by row by the pipeline.

Which files may be read at all: ``input.path`` must resolve under the operator's data
roots (``$DPOPS_DATA_ROOTS``, default the spec's directory) and never to the noise key
or its directory (``dpops.dataroots``). No error here repeats what a file holds (header
names found, values): a spec author could otherwise point the input at a secret and
read it back from the error. Errors name the file and the declared column instead.

The fingerprint is an HMAC under the run's noise key, never a plain hash: a
plain hash of a small input would let anyone holding the manifest confirm a
guess of the data (semantics.md section 5).
"""

from __future__ import annotations

import glob
import hashlib
import hmac as _hmac
import os
import posixpath
import re
from dataclasses import dataclass
from datetime import date, datetime, timezone
from typing import TYPE_CHECKING, Any, Iterable, Protocol, Sequence

from dpops.dataroots import check_data_paths, check_public_path
from dpops.errors import InputDataError, InvalidParameter
from dpops.events import canonical_json
from dpops.storage import files
from dpops.storage.location import Location, is_uri

if TYPE_CHECKING:
    from dpops.ledger import TimeRule
    from dpops.spec import ReleaseSpec

# 1 MiB, read into one reused buffer: hashlib holds no GIL while it hashes a chunk (so hashing overlaps the import
# the release runs meanwhile), and a chunk that stays in the core's cache between the read's copy and the hash
# costs 0.46 CPU-s per 700 MB against 0.74 for fresh 16 MiB bytes objects (page faults, cache misses): at 100M
# rows the fingerprint pass is on the critical path before the pipeline starts.
_CHUNK = 1 << 20


# --------------------------------------------------------------------------- intervals


@dataclass(frozen=True)
class Interval:
    """A data interval [start, end) in UTC. ``start_iso``/``end_iso`` are what run keys and the ledger store."""

    start: datetime
    end: datetime

    @property
    def start_iso(self) -> str:
        return self.start.isoformat()

    @property
    def end_iso(self) -> str:
        return self.end.isoformat()

    @property
    def slug(self) -> str:
        """Directory name: ``20240101T000000Z_20240102T000000Z`` (no ':' or '+', safe on every filesystem)."""
        return f"{self.start:%Y%m%dT%H%M%SZ}_{self.end:%Y%m%dT%H%M%SZ}"

    def __str__(self) -> str:
        return f"{self.start_iso}/{self.end_iso}"


def _to_utc(value: Any, what: str) -> datetime:
    if isinstance(value, datetime):
        dt = value
    elif isinstance(value, date):
        dt = datetime(value.year, value.month, value.day)
    elif isinstance(value, str):
        text = value.strip()
        if text.endswith(("Z", "z")):
            text = text[:-1] + "+00:00"
        try:
            dt = datetime.fromisoformat(text)
        except ValueError:
            raise InvalidParameter(
                f"interval {what} {value!r} is not an ISO-8601 date or time (e.g. 2024-01-01 or 2024-01-01T00:00:00Z)"
            ) from None
    else:
        raise InvalidParameter(f"interval {what} must be an ISO-8601 string or a datetime, got {value!r}")
    # A naive time is UTC: schedules and data intervals are UTC throughout dpops.
    dt = dt.replace(tzinfo=timezone.utc) if dt.tzinfo is None else dt.astimezone(timezone.utc)
    return dt


def parse_interval(start: Any, end: Any = None) -> Interval:
    """``parse_interval("2024-01-01/2024-01-02")`` or ``parse_interval(start, end)``; start must be before end."""
    if end is None:
        if isinstance(start, Interval):
            return start
        if not isinstance(start, str) or start.count("/") != 1:
            raise InvalidParameter(f"interval must be START/END (ISO-8601, e.g. 2024-01-01/2024-01-02), got {start!r}")
        start, end = start.split("/")
    s, e = _to_utc(start, "start"), _to_utc(end, "end")
    if not s < e:
        raise InvalidParameter(f"interval start {s.isoformat()} must be before its end {e.isoformat()}")
    return Interval(s, e)


# --------------------------------------------------------------------------- paths

_GLOB_CHARS = re.compile(r"[*?\[]")


def resolve_input_paths(spec: Any, interval_start: Any, interval_end: Any = None, *,
                        key_path: str | None = None) -> list[str]:
    """The input files of one interval: ``input.path`` formatted with {start}/{end}, relative to the spec's
    directory; a template with glob characters (``*``, ``?``, ``[``) expands to its sorted matches.

    Every path must resolve under a data root and away from the noise key (``key_path`` and
    ``$DPOPS_NOISE_KEY_FILE``): see ``dpops.dataroots``; a refusal is a ``SpecError``.

    Only path resolution: existence and schema are ``check_input``'s job (a missing single file is reported
    there, an empty glob here since there is no name to report).
    """
    iv = parse_interval(interval_start, interval_end)
    formatted = spec.input.path.format(start=iv.start, end=iv.end)
    loc = spec.resolve_path(formatted)
    path = str(loc)
    if _GLOB_CHARS.search(formatted):
        if loc.is_local:
            matches = sorted(p for p in glob.glob(path) if os.path.isfile(p))
        else:
            try:
                matches = [str(m) for m in files.glob(loc)]
            except OSError as exc:
                raise InputDataError(f"input: cannot list {path}: {exc} (check the bucket, AWS_ENDPOINT_URL and "
                                     "credentials)") from None
        if not matches:
            raise InputDataError(f"input: no file matches {path} for interval {iv} (input.path {spec.input.path!r})")
        paths = matches
    else:
        paths = [path]
    # Only files under the operator's data roots, never the noise key (dpops.dataroots): checked here, before
    # any file is opened or any budget reserved, because a spec author chooses input.path.
    check_data_paths(paths, "input.path", source=spec.source, spec_dir=spec.base_dir, key_path=key_path)
    public_file = getattr(spec.partitions, "public_file", None)
    if public_file is not None:  # already read by load_spec; re-checked against the key path known here
        check_public_path(spec.resolve_path(public_file), "partitions.public_file", source=spec.source,
                          spec_dir=spec.base_dir, key_path=key_path)
    return paths


# --------------------------------------------------------------------------- schema check


def stored_all_missing(arrow_type: Any) -> bool:
    """Whether a Parquet column's stored type says only that every value is missing (Arrow ``null``).

    Such a column satisfies every declared type (issue 25 item 5): writers infer that type from the values
    (pandas writes an all-``None`` column as ``null``), so refusing it would make whether a day runs depend
    on whether one unit filled the column in, a check on cell values before reservation. The reader reads
    it as nulls of the declared type (``pipelines.io._convert_column``), so it drops exactly the rows a
    column of that type holding only nulls would drop.
    """
    import pyarrow as pa

    t = arrow_type.value_type if pa.types.is_dictionary(arrow_type) else arrow_type
    return bool(pa.types.is_null(t))


def columns_of_any_type(schema: Any, num_rows: int) -> set[str]:
    """The columns of a Parquet file whose stored type says nothing about its values, so that any declared
    type is accepted for them: a column of type ``null`` (``stored_all_missing``), and every column of a
    file with no rows (pandas writes an empty frame's columns as float64 whatever they would hold). Privacy
    reason: as in ``stored_all_missing``, refusing them would make whether a day runs depend on the data
    (here: on whether any unit had a row in the file); the reader reads nothing from a row-less file."""
    return {f.name for f in schema if num_rows == 0 or stored_all_missing(f.type)}


def stored_type_ok(arrow_type: Any, declared: str) -> bool:
    """Whether a Parquet column stored as ``arrow_type`` may be read as the declared type (schema only)."""
    import pyarrow as pa

    if stored_all_missing(arrow_type):
        return True
    t = arrow_type
    if pa.types.is_dictionary(t):
        t = t.value_type
    if declared == "string":
        # Bytes too (review 5): pandas and pyarrow store a string column in which one value is ``bytes`` as
        # ``binary``, so refusing it made whether the day runs depend on one unit's cell (issue 25 item 5's class).
        # The reader decodes each cell as UTF-8 and drops the row of a cell that is not (``_convert_cells``), as for
        # CSV, so a unit's id or partition is still a function of its own cell.
        return (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)
                or pa.types.is_binary(t) or pa.types.is_large_binary(t))
    if declared == "int":
        # Floats too: pandas stores an int column with one missing value as float64, so refusing floats would
        # make the outcome depend on one unit's cell (issue 25 item 5's class). The reader keeps a float cell
        # that is an integer within int64 and drops any other row as wrong_type (pipelines.io._convert_column).
        return pa.types.is_integer(t) or pa.types.is_floating(t)
    if declared == "float":
        # Integers widen to float without loss of meaning; decimals and strings do not qualify.
        return pa.types.is_floating(t) or pa.types.is_integer(t)
    if declared == "bool":
        return pa.types.is_boolean(t)
    if declared == "timestamp":  # the event-time column (input.time_column); any unit, naive = UTC
        return pa.types.is_timestamp(t)
    return False


def _check_readable(path: str) -> None:
    if is_uri(path):  # an object-store input (pyarrow.fs): it exists as an object and can be opened
        loc = Location.parse(path)
        try:
            if not files.is_file(loc):
                raise InputDataError(f"input file {path} does not exist: check input.path and the interval")
            next(files.iter_chunks(loc), b"")
        except OSError as exc:
            raise InputDataError(f"input file {path} is not readable: {type(exc).__name__} (check the bucket, "
                                 "AWS_ENDPOINT_URL and credentials)") from None
        return
    if not os.path.exists(path):
        raise InputDataError(f"input file {path} does not exist: check input.path and the interval")
    if not os.path.isfile(path):
        raise InputDataError(f"input {path} is not a regular file")
    try:
        with open(path, "rb") as fh:
            fh.read(1)
    except OSError as exc:
        raise InputDataError(f"input file {path} is not readable: {exc.strerror or exc} (check its permissions)") from None


def _check_parquet(spec: Any, path: str) -> None:
    import pyarrow.parquet as pq

    try:
        if is_uri(path):
            fs, inner = Location.parse(path).filesystem()
            meta = pq.read_metadata(inner, filesystem=fs)
        else:
            meta = pq.read_metadata(path)
        schema = meta.schema.to_arrow_schema()
    except Exception as exc:  # pyarrow raises ArrowInvalid/OSError variants for a damaged or foreign file
        raise InputDataError(f"input file {path} is not a readable Parquet file ({type(exc).__name__}); "
                             "fix or replace it") from None
    names = schema.names
    any_type = columns_of_any_type(schema, meta.num_rows)
    for col, declared in spec.input.columns.items():
        n = names.count(col)
        if n == 0:
            raise InputDataError(
                f"input file {path}: column {col!r} declared in input.columns is missing from the file; "
                "add it or fix input.columns"
            )
        if n > 1:
            raise InputDataError(f"input file {path}: column {col!r} appears {n} times")
        actual = schema.field(col).type
        if col not in any_type and not stored_type_ok(actual, declared):
            raise InputDataError(
                f"input file {path}: column {col!r} has type {actual} but input.columns declares {declared}"
            )


def _check_csv(spec: Any, path: str) -> None:
    """The header as the reader reads it (``pipelines.io.csv_header_names``: one owner), so a file passes here only if
    the reader, after the charge, finds the same columns (review 5: names were stripped here and not there)."""
    from pipelines.io import csv_header_names

    try:
        if is_uri(path):
            fs, inner = Location.parse(path).filesystem()
            with fs.open_input_stream(inner) as stream:
                header = csv_header_names(stream, f"input file {path}")
        else:
            with open(path, "rb") as fh:
                header = csv_header_names(fh, f"input file {path}")
    except OSError as exc:
        raise InputDataError(f"input file {path} is not readable: {exc.strerror or exc}") from None
    for col in spec.input.columns:
        n = header.count(col)
        if n == 0:
            raise InputDataError(
                f"input file {path}: column {col!r} declared in input.columns is missing from the CSV header "
                "(line 1; names are read as written, spaces included); add it or fix input.columns"
            )
        if n > 1:
            raise InputDataError(f"input file {path}: column {col!r} appears {n} times in the CSV header")


def check_input(spec: Any, paths: Sequence[str]) -> None:
    """Every file exists, is readable and has the declared columns (names and, for Parquet, types).

    Extra columns are ignored. Raises ``InputDataError`` naming the file and the column.
    """
    if not paths:
        raise InputDataError(f"input: no input files for input.path {spec.input.path!r}")
    for path in paths:
        _check_readable(path)
        if spec.input.format == "parquet":
            _check_parquet(spec, path)
        else:
            _check_csv(spec, path)


# --------------------------------------------------------------------------- keyed fingerprint


class HmacKey(Protocol):
    key_id: str

    def hmac(self, data: bytes) -> bytes: ...


class TestFingerprintKey:
    """The fixed key of test mode. Test-mode outputs are never publishable, so a public key is harmless here."""

    __test__ = False  # not a pytest class
    key_id = "test-mode"
    _KEY = b"dpops/test-mode/fingerprint-key/v1"

    def hmac(self, data: bytes) -> bytes:
        return _hmac.new(self._KEY, data, hashlib.sha256).digest()

    def __repr__(self) -> str:
        return "TestFingerprintKey()"


def _file_digest(path: str) -> tuple[int, str]:
    if is_uri(path):
        try:
            return files.sha256_and_size(Location.parse(path))
        except OSError as exc:
            raise InputDataError(f"input file {path} is not readable: {type(exc).__name__}") from None
    h = hashlib.sha256()
    size = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    try:
        with open(path, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                h.update(view[:n])
                size += n
    except OSError as exc:
        raise InputDataError(f"input file {path} is not readable: {exc.strerror or exc}") from None
    return size, h.hexdigest()


def _canonical_names(paths: Sequence[str]) -> list[str]:
    # Names relative to the files' common directory: moving the data root keeps the fingerprint,
    # while two files with the same base name in different sub-directories stay distinct. Object-store
    # inputs use the key below the bucket ("bucket/a/b.csv"), so a local copy and an S3 copy of the same
    # files get the same names.
    absolute = [Location.parse(p).path if is_uri(p) else os.path.abspath(p) for p in paths]
    if len(absolute) == 1:
        return [posixpath.basename(absolute[0])]
    root = posixpath.commonpath([posixpath.dirname(p) for p in absolute])
    return [posixpath.relpath(p, root) for p in absolute]


def missing_input_files(spec: ReleaseSpec, interval_start: Any, interval_end: Any = None) -> list[str]:
    """The interval's input files that do not exist yet (empty: all there). Reads no data, only whether the
    files are there: the orchestrator's sensor waits on it, ``dpops gaps`` tells a day whose input arrived
    after a run gave up from one still missing it. For a glob template, the pattern itself while nothing
    matches; an object-store input is listed through the storage layer, never ``os.path``."""
    iv = parse_interval(interval_start, interval_end)
    formatted = spec.input.path.format(start=iv.start, end=iv.end)
    where = spec.resolve_path(formatted)
    if not where.is_local:
        found = files.glob(where) if files.has_glob(formatted) else ([where] if files.is_file(where) else [])
        return [] if found else [str(where)]
    path = str(where.local_path)
    if _GLOB_CHARS.search(formatted):
        return [] if any(os.path.isfile(p) for p in glob.glob(path)) else [path]
    return [] if os.path.isfile(path) else [path]


def public_file_rows(spec: ReleaseSpec) -> list[list[Any]] | None:
    """The rows of the spec's ``partitions.public_file`` as lists (None without a public file): they are part
    of the run's input, so they enter its keyed fingerprint (``input_fingerprint``)."""
    if getattr(spec.partitions, "public_file", None) is None:
        return None
    return [list(p) for p in (spec.public_partitions() or [])]


def snapshot_locations(spec: ReleaseSpec, input_paths: Sequence[str]) -> list[str]:
    """What a run's stat snapshot covers: the input files and the spec's ``partitions.public_file`` (resolved),
    i.e. every file the keyed fingerprint covers, so a public list swapped while the pipeline read it and put
    back before the closing check is caught as an input file is (``input_stat_snapshot``)."""
    if getattr(spec.partitions, "public_file", None) is None:
        return list(input_paths)
    return [*input_paths, str(spec.resolve_path(spec.partitions.public_file))]


# one entry per input: (path, device, inode, size, mtime_ns, ctime_ns) for a local file, (uri, size, LastModified,
# ETag, VersionId) for an S3 object
InputStats = tuple[tuple[str | int, ...], ...]


def input_stat_snapshot(paths: Iterable[str]) -> InputStats | None:
    """What the file system says about each local input (path, device, inode, size, mtime_ns, ctime_ns) and what
    S3 says about each object (``dpops.storage.objectstore.object_version``: size, LastModified, ETag,
    VersionId), or None when an input is on another object store (no version to trust there) or cannot be
    stat'ed. On S3 every write or restore of an object moves its LastModified (the store's clock) and, when
    versioned, its VersionId; what a snapshot can miss there is a rewrite in the same second in an unversioned
    bucket, under the same rule as below.

    Taken by ``prepare`` BEFORE the fingerprint pass, so a write during that pass shows in the next snapshot.
    A write, truncation, rename over the file or ``utime`` changes the inode, the size or the ctime, and a user
    cannot set a ctime back; what a snapshot can miss is a write in the same coarse clock tick as the snapshot
    (Linux timestamps move in jiffies) that keeps the size, or a clock set back by root. So a snapshot may only
    stand in for a full keyed fingerprint where a miss cannot publish the wrong data: the check before ``start``
    (a refund or not), never the check after the computation (``dpops.release.computation``)."""
    out: list[tuple[str | int, ...]] = []
    for p in paths:
        if is_uri(p):
            from dpops.storage.objectstore import object_version

            loc = Location.parse(p)
            if loc.is_local:
                p = str(loc.local_path)
            else:
                try:
                    version = object_version(loc)
                except OSError:
                    return None
                if version is None:
                    return None
                out.append((loc.uri, *version))
                continue
        try:
            st = os.stat(p)
        except OSError:
            return None
        out.append((os.path.realpath(p), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(out)


def input_fingerprint(paths: Iterable[str], key: HmacKey,
                      public_partitions: Sequence[Sequence[Any]] | None = None, *,
                      digests: dict[str, tuple[int, str]] | None = None) -> str:
    """HMAC-SHA256 (under ``key``) of the canonical list of (name, size, sha256 of content), sorted by name,
    and of the public file's parsed rows when the spec has one (``public_file_rows``).

    Only the keyed result is ever written or shown. The per-file (size, sha256) go to ``digests`` ({path as
    given: (size, hex)}) when the caller passes one: the release keeps them in memory to compare with the
    bytes its reader consumed (``dpops.release.computation.check_input_unchanged``); an unkeyed hash of a
    private file would let whoever reads it confirm a guess of the file. A public file that the operator did
    not mark publishable is recorded in the manifest by its row count only (``dpops.dataroots``), so a
    changed list must change the run key through this keyed value: a plain hash of the rows in the manifest
    would let a reader confirm a guess of them.
    """
    paths = list(paths)
    if not paths:
        raise InputDataError("input: cannot fingerprint an empty list of input files")
    names = _canonical_names(paths)
    if len(set(names)) != len(names):
        raise InputDataError(f"input: the same file is listed twice in {paths}")
    entries = []
    for name, path in sorted(zip(names, paths)):
        size, digest = _file_digest(path)
        entries.append([name, size, digest])
        if digests is not None:
            digests[path] = (size, digest)
    content: dict[str, Any] = {"v": "dpops.input-fingerprint/1", "files": entries}
    if public_partitions is not None:
        content["public_file"] = [list(p) for p in public_partitions]
    doc = canonical_json(content).encode()
    return key.hmac(doc).hex()


READ_DIGEST_TAG = b"dpops.read-digest/1\0"


def read_digest_tag(salt: bytes, size: int, sha256_hex: str) -> str:
    """What a reader reports of the bytes it read: HMAC-SHA256 under the run's read-digest ``salt`` of the size
    and sha256 of those bytes (hex). The worker computes it from its own digest, the driver from the
    fingerprint pass's (``dpops.release.computation.check_input_unchanged``): equal tags, equal bytes.

    Why a tag and not the sha256 itself: the reader's report travels with the run's internal counters as
    runner metrics, which a runner may show to more people than the driver (a monitoring console); an unkeyed
    hash of a private file there would let any of them confirm a guess of the whole file. The salt is drawn from
    the run's randomness (the noise key or the test seed; in os mode the driver draws it and it rides in the job
    graph), never from the data."""
    import hmac

    return hmac.new(salt, READ_DIGEST_TAG + f"{int(size)}:{sha256_hex}".encode(), hashlib.sha256).hexdigest()


def time_rule_of(spec: ReleaseSpec) -> TimeRule | None:
    """The time rule ``spec``'s run applies (None: it filters no rows by time).

    The one place that turns a spec into the rule a scope records: the column ``input.time_column``,
    its declared type, and the zone rule and row filter this code implements (``pipelines.io.outside_window``:
    naive times are UTC, keep ``start <= t < end``, an unreadable time drops its row). It lives with the input
    rules because it says which rows a run reads; the reservation (before anything is reserved) and
    ``manifest verify`` (the manifest's recorded scope definition) both apply it from here.
    """
    from dpops.ledger.model import CURRENT_TIME_FILTER, CURRENT_TIME_ZONE_RULE, TimeRule

    tc = spec.input.time_column
    if tc is None:
        return None
    return TimeRule(column=tc, type=spec.input.columns.get(tc, "timestamp"), zone=CURRENT_TIME_ZONE_RULE,
                    filter=CURRENT_TIME_FILTER)


__all__ = [
    "Interval", "parse_interval", "resolve_input_paths", "check_input", "input_fingerprint", "TestFingerprintKey",
    "public_file_rows", "missing_input_files", "stored_type_ok", "stored_all_missing", "columns_of_any_type",
    "time_rule_of", "read_digest_tag",
]
