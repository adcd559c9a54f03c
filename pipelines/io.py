"""Reading the private input as Arrow record batches, row checks, and stable hashing.

One Beam element is a whole batch (or a slice of it), never one row: per-element
Python overhead is what makes naive DP pipelines slow.

Malformed input never stops a run (it runs after the budget is charged): a CSV line
with the wrong number of fields is skipped by the parser (``invalid_row_handler``), a
cell that does not convert to its declared type drops its row (``_convert_column``),
both counted only in the internal run log. No error raised here carries a cell value
or a raw line; pyarrow's own error texts (which quote them) are never passed on.

Hashes must be identical in every worker process and on every run (they decide
key and shard placement, and the L0 pair priority is a keyed function of the hashes), so
Python's salted ``hash`` is out. Strings use pandas' SipHash-2-4 with its fixed
key (``pandas.util.hash_array``), integers its fixed 64-bit mix. A 64-bit
collision between two units merges them into one "unit" for contribution
bounding: that only ever removes contributions (each real unit still stays
within L0/Linf), so it costs accuracy with probability ~n^2/2^65, never privacy.

Event time (``input.time_column``): rows whose time is not in the run's [start, end) are
dropped before anything else (``outside_window``), so runs over different periods read
disjoint rows whatever files they open; that is what lets a period-bucketed scope compose
them in parallel (semantics.md section 4, issue 11 item 2). The filter compares each row with
the public interval only, so it is data-independent; its count stays in the internal log.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from dpops.errors import InputDataError
from pipelines.fs import open_input

ROW_ID_SHIFT = 40  # row id = file_index << 40 | row position in file: 1T rows per file
_MIX = np.uint64(0x9E3779B97F4A7C15)

ARROW_TYPES = {"string": pa.string(), "int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(),
               "timestamp": pa.timestamp("us", tz="UTC")}
DROP_REASONS = ("outside_interval", "null_unit", "null_partition", "bad_value", "wrong_type")
MALFORMED_LINES = "dropped_malformed_line"  # CSV lines with too many/few fields, skipped by the parser
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_FLOAT_EXACT = 1 << 53  # integers beyond +-2^53 do not convert to float64 exactly: a malformed cell
_NS_PER_UNIT = {"s": 1_000_000_000, "ms": 1_000_000, "us": 1_000, "ns": 1}


@dataclass(frozen=True)
class ReadConfig:
    """Everything a worker needs to turn a file slice into checked, hashed rows (picklable)."""

    format: str  # parquet | csv
    types: dict[str, str]  # declared type of every needed column
    unit_column: str | None  # None when record_level: the row itself is the unit
    partition_columns: tuple[str, ...]
    value_columns: tuple[str, ...]  # numeric metric columns: null/NaN/inf drops the row for ALL metrics
    category_columns: dict[str, tuple[Any, ...]] = field(default_factory=dict)  # top_k column -> public domain
    public_hashes: np.ndarray | None = None  # sorted uint64 partition hashes, or None for private selection
    n_buckets: int = 256  # unit-hash keys of the bounding combiner: the result does not depend on it
    n_shards: int = 16
    batch_rows: int = 262_144
    # Event-time filter (issue 11 item 2): keep only rows with time_window_ns[0] <= time < time_window_ns[1]
    # (ns since the epoch, UTC). A row-by-row predicate on the public interval: data-independent.
    time_column: str | None = None
    time_window_ns: tuple[int, int] | None = None

    @property
    def needed(self) -> list[str]:
        cols = ([self.unit_column] if self.unit_column else []) + list(self.partition_columns)
        cols += list(self.value_columns) + list(self.category_columns)
        cols += [self.time_column] if self.time_column else []
        return list(dict.fromkeys(cols))


# --------------------------------------------------------------------------- hashing


def _splitmix(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(30))
    h = h * np.uint64(0xBF58476D1CE4E5B9)
    h = h ^ (h >> np.uint64(27))
    h = h * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


def hash_column(arr: pa.Array | pa.ChunkedArray, ctype: str) -> np.ndarray:
    """uint64 hash per element of a column already cast to its declared type (nulls hash to 0)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    if ctype == "string":
        # Hash each distinct string once: dictionaries are small compared to rows.
        if not pa.types.is_dictionary(arr.type):
            arr = pc.dictionary_encode(arr)
        dictionary = arr.dictionary.cast(pa.string()).to_numpy(zero_copy_only=False)
        dict_hash = pd.util.hash_array(dictionary.astype(object), categorize=False)
        idx = arr.indices.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        out = dict_hash[idx] if len(dict_hash) else np.zeros(len(arr), np.uint64)
    elif ctype in ("int", "bool"):
        vals = arr.cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False)
        out = pd.util.hash_array(vals.astype(np.int64, copy=False))
    elif ctype == "float":
        vals = arr.cast(pa.float64()).fill_null(0.0).to_numpy(zero_copy_only=False) + 0.0  # -0.0 -> 0.0
        out = pd.util.hash_array(vals.view(np.int64))
    else:
        raise InputDataError(f"unsupported column type {ctype!r}")
    return np.asarray(out, dtype=np.uint64)


def combine_hashes(hashes: list[np.ndarray]) -> np.ndarray:
    """One uint64 per row for a tuple of columns (order matters)."""
    h = hashes[0].copy()
    for nxt in hashes[1:]:
        h = _splitmix(h * _MIX + nxt)
    return h


def hash_partition_tuples(tuples: list[tuple[Any, ...]], columns: tuple[str, ...], types: dict[str, str]) -> np.ndarray:
    """Hashes of public partition keys, computed exactly as for input rows of the declared types."""
    if not tuples:
        return np.zeros(0, np.uint64)
    hashes = []
    for j, col in enumerate(columns):
        arr = pa.array([t[j] for t in tuples], type=ARROW_TYPES[types[col]])
        hashes.append(hash_column(arr, types[col]))
    return combine_hashes(hashes)


# --------------------------------------------------------------------------- reading


def work_items(paths: list[str] | tuple[str, ...], fmt: str) -> list[tuple[int, str, int | None, int]]:
    """(file index, path, row group or None, row offset of the row group): the read parallelism unit."""
    items: list[tuple[int, str, int | None, int]] = []
    for i, path in enumerate(paths):
        if fmt == "parquet":
            import pyarrow.parquet as pq

            try:
                meta = pq.ParquetFile(open_input(path)).metadata
            except (OSError, pa.ArrowException) as exc:
                raise InputDataError(f"{path}: cannot read Parquet metadata ({type(exc).__name__}); fix or "
                                     "replace the file") from None
            offset = 0
            for rg in range(meta.num_row_groups):
                items.append((i, path, rg, offset))
                offset += meta.row_group(rg).num_rows
        elif fmt == "csv":
            items.append((i, path, None, 0))  # CSV cannot be split without a scan: one item per file
        else:
            raise InputDataError(f"unsupported input format {fmt!r} (parquet | csv)")
    return items


def iter_record_batches(item: tuple[int, str, int | None, int], cfg: ReadConfig,
                        counters: dict[str, int] | None = None) -> Iterator[tuple[pa.RecordBatch, int]]:
    """Yield (batch of the needed columns, row offset in file). Conversion to the declared types is
    ``prepare_batch``'s job, cell by cell, so a bad cell drops its row instead of failing the run.

    CSV lines with more or fewer fields than the header are skipped and counted in
    ``counters[MALFORMED_LINES]`` (internal run log only). Privacy reason: this runs after the budget is
    charged, so a data-dependent abort would be an unaccounted release of one bit (semantics.md section 6);
    and pyarrow's error text quotes the line, i.e. private values, so none of it is ever passed on.
    """
    _, path, rg, offset = item
    needed = cfg.needed
    if cfg.format == "parquet":
        import pyarrow.parquet as pq

        try:
            # No read_dictionary: pyarrow's dictionary reader fails the whole row group on one invalid UTF-8
            # cell (quoting it); the plain reader does not, and _convert_column drops that row instead.
            pf = pq.ParquetFile(open_input(path))
            missing = [c for c in needed if c not in pf.schema_arrow.names]
            if missing:
                raise InputDataError(f"{path}: column(s) {missing} declared in the spec are missing from the file")
            for batch in pf.iter_batches(batch_size=cfg.batch_rows, row_groups=[rg], columns=needed):
                yield batch, offset
                offset += batch.num_rows
        except (OSError, pa.ArrowException) as exc:
            raise InputDataError(f"{path}: cannot read row group {rg} ({type(exc).__name__}): the file is "
                                 "damaged or was replaced after the input check; restore it and retry") from None
    else:
        import pyarrow.csv as pcsv

        skipped = _LineCounter()
        try:
            reader = pcsv.open_csv(
                open_input(path),
                read_options=pcsv.ReadOptions(block_size=16 << 20),
                parse_options=pcsv.ParseOptions(invalid_row_handler=skipped),
                convert_options=pcsv.ConvertOptions(
                    include_columns=needed,
                    # Bytes, parsed by us: a bad cell (even invalid UTF-8) drops its row, not the file.
                    column_types={c: pa.binary() for c in needed},
                    strings_can_be_null=True,
                ),
            )
            for batch in reader:
                yield batch, offset
                offset += batch.num_rows
        except (OSError, pa.ArrowException) as exc:
            # The exception text quotes the offending line: only its class is kept.
            # (No row count either: how many rows a private file holds is itself internal.)
            raise InputDataError(f"{path}: cannot read the CSV file ({type(exc).__name__}): a declared column may "
                                 "be missing, or the file is damaged or was replaced after the input check; fix "
                                 "the file and retry") from None
        finally:
            if counters is not None and skipped.count:
                counters[MALFORMED_LINES] = counters.get(MALFORMED_LINES, 0) + skipped.count


class _LineCounter:
    """pyarrow's ``invalid_row_handler``: skip a line whose field count differs from the header's, count it,
    and never look at (or keep) its text."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, row: Any) -> str:
        self.count += 1
        return "skip"


def _int_mask(arr: pa.Array, lo: int, hi: int) -> pa.Array:
    """Cells of an integer array outside [lo, hi] (nulls: False)."""
    bits = arr.type.bit_width
    signed = pa.types.is_signed_integer(arr.type)
    tmin, tmax = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    out = pa.array(np.zeros(len(arr), bool))
    if lo > tmin:
        out = pc.or_(out, pc.less(arr, pa.scalar(lo, arr.type)))
    if hi < tmax:
        out = pc.or_(out, pc.greater(arr, pa.scalar(hi, arr.type)))
    return out.fill_null(False)


def _convert_column(arr: pa.Array, want: str) -> tuple[pa.Array, np.ndarray]:
    """A column of any stored type -> the declared type; returns (array, mask of cells that do not convert).

    A cell that does not convert (a uint64 >= 2^63 declared int, an int64 beyond +-2^53 declared float, ...)
    becomes null and its row is dropped by the caller as ``wrong_type``: a per-row, data-independent rule,
    so one unit's bad cell never changes another unit's rows and never aborts the run (semantics.md
    section 6). Nothing here raises with a cell's value in its text.
    """
    n = len(arr)
    ok_mask = np.zeros(n, bool)
    target = ARROW_TYPES[want]
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    if want == "string" and (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        try:
            arr.validate(full=True)  # UTF-8 check; Parquet's plain reader does not do it
        except pa.ArrowException:
            arr = arr.view(pa.binary() if pa.types.is_string(arr.type) else pa.large_binary())
    if pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type):
        return _parse_text(arr, want)
    if arr.type == target:
        return arr, ok_mask
    if pa.types.is_null(arr.type):  # an all-null column: every row is dropped for its null, not its type
        return pa.nulls(n, target), ok_mask
    bad: pa.Array | None = None
    if pa.types.is_integer(arr.type) and want == "int":
        bad = _int_mask(arr, _INT64_MIN, _INT64_MAX)
    elif pa.types.is_integer(arr.type) and want == "float":
        bad = _int_mask(arr, -_FLOAT_EXACT, _FLOAT_EXACT)
    elif want == "string" and (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)
                               or pa.types.is_string_view(arr.type)):
        bad = None
    elif want == "float" and pa.types.is_floating(arr.type):
        bad = None
    else:
        # A type the input check refuses: the file changed after the check. Fail without any value.
        raise InputDataError(f"a column has stored type {arr.type}, which does not convert to the declared "
                             f"{want}: the file was replaced after the input check; restore it and retry")
    if bad is not None and pc.any(bad).as_py():
        arr = pc.if_else(bad, pa.scalar(None, arr.type), arr)
        ok_mask = bad.to_numpy(zero_copy_only=False)
    try:
        return arr.cast(target), ok_mask
    except pa.ArrowException:
        raise InputDataError(f"a column of stored type {arr.type} does not convert to the declared {want}; "
                             "restore the input and retry") from None


_INT_TEXT = re.compile(r"[+-]?[0-9]+")


def _parse_int_cell(text: str) -> int | None:
    """One CSV cell declared ``int``: an integer (or an integral float such as ``1e3`` or ``2.0``) within
    int64; anything else (``1e20``, ``9223372036854775808``, ``1.5``, ``abc``) is None."""
    t = text.strip()
    if _INT_TEXT.fullmatch(t):
        v = int(t)
    else:
        try:
            f = float(t)
        except ValueError:
            return None
        if not (f == f and abs(f) != float("inf") and f == int(f)):
            return None
        v = int(f)
    return v if _INT64_MIN <= v <= _INT64_MAX else None


def _parse_float_cell(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:
        return None


_BOOLS = {"true": True, "false": False, "1": True, "0": False}


def _parse_text(arr: pa.Array, want: str) -> tuple[pa.Array, np.ndarray]:
    """CSV cells (bytes) -> declared type; returns (array, mask of cells that did not parse).

    Fast path: Arrow's own vectorised cast of the whole column. Only when it fails (one or more bad cells)
    is the column parsed cell by cell, exactly (no detour through float for integers), and the bad cells
    become null. Never raises because of a cell, and never puts a cell's text in an exception.
    """
    n = len(arr)
    bad = np.zeros(n, bool)
    try:
        text = arr.cast(pa.string())
    except pa.ArrowException:  # invalid UTF-8 somewhere: decode cell by cell
        cells = arr.to_pylist()
        out = []
        for i, b in enumerate(cells):
            if b is None:
                out.append(None)
                continue
            try:
                out.append(b.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(None)
                bad[i] = True
        text = pa.array(out, type=pa.string())
    if want == "string":
        return text, bad
    if not bad.any():
        try:
            return text.cast(ARROW_TYPES[want]), bad
        except pa.ArrowException:
            pass
    parse = {"int": _parse_int_cell, "float": _parse_float_cell,
             "bool": lambda t: _BOOLS.get(t.strip().lower())}[want]
    values = []
    for i, cell in enumerate(text.to_pylist()):
        v = None if cell is None or bad[i] else parse(cell)
        if v is None and cell is not None:
            bad[i] = True
        values.append(v)
    return pa.array(values, type=ARROW_TYPES[want]), bad


# --------------------------------------------------------------------------- checked, hashed rows


def prepare_batch(
    batch: pa.RecordBatch, file_index: int, row_offset: int, cfg: ReadConfig, rng,
    pair_salt: tuple[int, int] | None = None,
) -> tuple[dict[str, np.ndarray], tuple[np.ndarray, list[list[Any]]], dict[str, int]]:
    """Check and hash one batch.

    Returns (rows, names, stats): rows = {"u", "p", "prio", "pp", "v:<col>", "c:<col>"} numpy arrays of
    kept rows (``prio``: one uniform uint64 per row from ``rng``, the Linf priority; ``pp``: the pair's
    L0 priority ``pipelines.bounding.pair_priority`` under the run's ``pair_salt``); names = (unique
    partition hashes, one value list per partition column) so the output can show partition keys;
    stats = internal counters (read, dropped by reason).

    ``pair_salt`` must be the run's salt (``pipelines.bounding.pair_salt(source)``) whenever the rows of
    a unit may come from more than one batch. Without it the salt is drawn from ``rng`` itself, which
    is only right for a caller whose whole input is this one batch (the auditor's harness).
    """
    from pipelines.bounding import pair_priority
    from pipelines.bounding import pair_salt as run_pair_salt

    if pair_salt is None:
        # a RandomSource always has child(); a bare test double drawing only uint64 gets a fixed salt
        pair_salt = run_pair_salt(rng) if hasattr(rng, "child") else (0, 0)
    n = batch.num_rows
    drop = np.zeros(n, dtype=np.int8)  # 0 = keep, else 1 + index in DROP_REASONS (first reason wins)
    cols: dict[str, pa.Array] = {}
    for name in batch.schema.names:
        arr = batch.column(name)
        if name == cfg.time_column:
            # Compared as stored, in its own unit, by outside_window (a cast could overflow or truncate).
            cols[name] = arr
            continue
        arr, bad = _convert_column(arr, cfg.types[name])
        _mark(drop, bad, "wrong_type")
        cols[name] = arr

    if cfg.time_column is not None:
        _mark(drop, outside_window(cols[cfg.time_column], cfg.time_window_ns), "outside_interval")
    if cfg.unit_column is not None:
        _mark(drop, _nulls(cols[cfg.unit_column]), "null_unit")
    for c in cfg.partition_columns:
        _mark(drop, _nulls(cols[c]), "null_partition")
    values = {}
    for c in cfg.value_columns:
        # An int beyond +-2^53 rounds to the nearest float (safe=False) instead of raising with its value in the
        # text: it is clamped to the metric's public bounds next, so the rounding never matters.
        v = pc.cast(cols[c], pa.float64(), safe=False).to_numpy(zero_copy_only=False)  # nulls become NaN
        _mark(drop, ~np.isfinite(v), "bad_value")
        values[c] = v

    if cfg.unit_column is not None:
        u = hash_column(cols[cfg.unit_column], cfg.types[cfg.unit_column])
    else:  # record level: every row is its own unit, identified by (file, position)
        rid = (np.int64(file_index) << np.int64(ROW_ID_SHIFT)) + row_offset + np.arange(n, dtype=np.int64)
        u = _splitmix(rid.view(np.uint64))
    p = combine_hashes([hash_column(cols[c], cfg.types[c]) for c in cfg.partition_columns])

    keep = drop == 0
    stats = {"rows_read": n}
    for i, reason in enumerate(DROP_REASONS):
        stats[f"dropped_{reason}"] = int(np.count_nonzero(drop == i + 1))
    if cfg.public_hashes is not None:
        # Rows outside the public list are dropped BEFORE bounding so they never use up a unit's L0.
        public = np.isin(p, cfg.public_hashes)
        stats["rows_outside_public_partitions"] = int(np.count_nonzero(keep & ~public))
        keep &= public

    idx = np.flatnonzero(keep)
    rows = {"u": u[idx], "p": p[idx], "prio": np.asarray(rng.uint64(n), dtype=np.uint64)[idx]}
    rows["pp"] = pair_priority(rows["u"], rows["p"], pair_salt)
    for c, v in values.items():
        rows[f"v:{c}"] = v[idx]
    for c, domain in cfg.category_columns.items():
        arr = cols[c]
        if pa.types.is_dictionary(arr.type):
            arr = arr.cast(arr.type.value_type)
        codes = pc.index_in(arr, value_set=pa.array(list(domain), type=ARROW_TYPES[cfg.types[c]]))
        # int32: a domain may exceed int16 (32,767 values); index_in returns int32 codes already
        rows[f"c:{c}"] = codes.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int32)[idx]

    kept_p = rows["p"]
    uniq, first = np.unique(kept_p, return_index=True)
    take = pa.array(idx[first])
    name_values = [cols[c].take(take).to_pylist() for c in cfg.partition_columns]
    return rows, (uniq, name_values), stats


def outside_window(arr: pa.Array, window_ns: tuple[int, int] | None) -> np.ndarray:
    """Mask of rows whose event time is NOT in [start, end): null, unparseable or out of the interval.

    Parquet timestamps (any unit; naive ones are UTC) are compared as integers in their own unit
    against ceil(bound / unit), which is exact: ``v*f >= lo  <=>  v >= ceil(lo/f)``. CSV cells are
    ISO-8601 text (no offset = UTC). A row whose time cannot be read cannot be shown to belong to
    this period, so it is dropped like any malformed row; the count goes to the internal log only.
    """
    if window_ns is None:
        raise InputDataError("a time column is set but the run has no interval to filter by")
    lo, hi = window_ns
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    if pa.types.is_timestamp(arr.type):
        f = _NS_PER_UNIT[arr.type.unit]
        lo_u, hi_u = -(-lo // f), -(-hi // f)
        null = arr.is_null().to_numpy(zero_copy_only=False)
        v = arr.view(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False)
        return null | (v < lo_u) | (v >= hi_u)
    if pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type):
        # CSV cells arrive as bytes (see iter_record_batches); a cell that is not UTF-8 is unreadable
        # and drops its row like any other unreadable time.
        try:
            arr = arr.cast(pa.string() if pa.types.is_binary(arr.type) else pa.large_string())
        except pa.ArrowException:
            cells = []
            for b in arr.to_pylist():
                try:
                    cells.append(None if b is None else b.decode("utf-8"))
                except UnicodeDecodeError:
                    cells.append(None)
            arr = pa.array(cells, pa.string())
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        try:  # fast path: every cell is ISO-8601 with an offset ("...Z"); Arrow parses it natively
            return outside_window(arr.cast(pa.timestamp("ns", tz="UTC")), window_ns)
        except pa.ArrowException:
            pass  # naive times, other ISO forms or bad cells: parse cell by cell (bad ones drop the row)
        raw = pd.Series(arr.to_numpy(zero_copy_only=False), dtype=object)
        t = pd.to_datetime(raw, utc=True, errors="coerce", format="ISO8601")
        null = t.isna().to_numpy()
        v = t.to_numpy(dtype="datetime64[ns]").view(np.int64)
        return null | (v < lo) | (v >= hi)
    # check_input refuses any other type before a run; a file swapped since is malformed row by row
    return np.ones(len(arr), dtype=bool)


def _nulls(arr: pa.Array) -> np.ndarray:
    return arr.is_null().to_numpy(zero_copy_only=False)


def _mark(drop: np.ndarray, mask: np.ndarray, reason: str) -> None:
    drop[(drop == 0) & mask] = DROP_REASONS.index(reason) + 1


def split_by_bucket(rows: dict[str, np.ndarray], n_buckets: int) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """Group rows by bucket = hash(unit) mod B, so all of one unit's rows meet in one bucket."""
    bucket = ((rows["u"] >> np.uint64(40)) % np.uint64(n_buckets)).astype(np.int64)
    order = np.argsort(bucket, kind="stable")
    sorted_b = bucket[order]
    bounds = np.flatnonzero(np.diff(sorted_b)) + 1
    for chunk in np.split(order, bounds):
        if len(chunk):
            yield int(bucket[chunk[0]]), {k: v[chunk] for k, v in rows.items()}


def shard_of(phash: np.ndarray, n_shards: int) -> np.ndarray:
    return ((phash >> np.uint64(40)) % np.uint64(n_shards)).astype(np.int64)
