"""Reading the private input as Arrow record batches, row checks, and stable hashing.

One Beam element is a whole batch (or a slice of it), never one row: per-element
Python overhead is what makes naive DP pipelines slow.

Hashes must be identical in every worker process and on every run (they decide
bucket and shard placement, and the bounding randomness is drawn per bucket), so
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

from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from dpops.errors import InputDataError

ROW_ID_SHIFT = 40  # row id = file_index << 40 | row position in file: 1T rows per file
_MIX = np.uint64(0x9E3779B97F4A7C15)

ARROW_TYPES = {"string": pa.string(), "int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(),
               "timestamp": pa.timestamp("us", tz="UTC")}
DROP_REASONS = ("outside_interval", "null_unit", "null_partition", "bad_value", "wrong_type")
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
    n_buckets: int = 64
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
                meta = pq.ParquetFile(path).metadata
            except (OSError, pa.ArrowException) as exc:
                raise InputDataError(f"{path}: cannot read Parquet metadata: {exc}") from None
            offset = 0
            for rg in range(meta.num_row_groups):
                items.append((i, path, rg, offset))
                offset += meta.row_group(rg).num_rows
        elif fmt == "csv":
            items.append((i, path, None, 0))  # CSV cannot be split without a scan: one item per file
        else:
            raise InputDataError(f"unsupported input format {fmt!r} (parquet | csv)")
    return items


def iter_record_batches(item: tuple[int, str, int | None, int], cfg: ReadConfig) -> Iterator[tuple[pa.RecordBatch, int]]:
    """Yield (batch with the needed columns cast to declared types, row offset in file)."""
    _, path, rg, offset = item
    needed = cfg.needed
    if cfg.format == "parquet":
        import pyarrow.parquet as pq

        strings = [c for c in needed if cfg.types[c] == "string"]
        try:
            pf = pq.ParquetFile(path, read_dictionary=strings)
            missing = [c for c in needed if c not in pf.schema_arrow.names]
            if missing:
                raise InputDataError(f"{path}: column(s) {missing} declared in the spec are missing from the file")
            for batch in pf.iter_batches(batch_size=cfg.batch_rows, row_groups=[rg], columns=needed):
                yield _cast_parquet(batch, cfg, path), offset
                offset += batch.num_rows
        except (OSError, pa.ArrowException) as exc:
            raise InputDataError(f"{path}: cannot read row group {rg}: {exc}") from None
    else:
        import pyarrow.csv as pcsv

        try:
            reader = pcsv.open_csv(
                path,
                read_options=pcsv.ReadOptions(block_size=16 << 20),
                convert_options=pcsv.ConvertOptions(
                    include_columns=needed,
                    column_types={c: pa.string() for c in needed},  # parse ourselves: bad cells drop rows, not the file
                    strings_can_be_null=True,
                ),
            )
            for batch in reader:
                yield batch, offset
                offset += batch.num_rows
        except (OSError, pa.ArrowException) as exc:
            raise InputDataError(f"{path}: cannot read CSV (a declared column may be missing): {exc}") from None


def _cast_parquet(batch: pa.RecordBatch, cfg: ReadConfig, path: str) -> pa.RecordBatch:
    cols = []
    for name in batch.schema.names:
        arr, want = batch.column(name), cfg.types[name]
        ok_string = want == "string" and (pa.types.is_dictionary(arr.type) or pa.types.is_string(arr.type))
        if want == "timestamp" and pa.types.is_timestamp(arr.type):
            ok_string = True  # compared in its own unit by outside_window (a cast could overflow or truncate)
        if not ok_string and arr.type != ARROW_TYPES[want]:
            try:
                arr = arr.cast(ARROW_TYPES[want])
            except pa.ArrowException as exc:
                raise InputDataError(
                    f"{path}: column {name!r} has type {arr.type}, not the declared {want}: {exc}"
                ) from None
        cols.append(arr)
    return pa.RecordBatch.from_arrays(cols, names=batch.schema.names)


def _parse_text(arr: pa.Array, want: str) -> tuple[pa.Array, np.ndarray]:
    """CSV cells (strings) -> declared type; returns (array, mask of cells that did not parse)."""
    if want == "string":
        return arr, np.zeros(len(arr), bool)
    try:
        return arr.cast(ARROW_TYPES[want]), np.zeros(len(arr), bool)
    except pa.ArrowException:
        pass
    raw = pd.Series(arr.to_numpy(zero_copy_only=False), dtype=object)
    if want == "bool":
        low = raw.str.strip().str.lower()
        parsed = low.map({"true": True, "false": False, "1": True, "0": False})
    else:
        parsed = pd.to_numeric(raw, errors="coerce")
        if want == "int":
            parsed = parsed.where(parsed.isna() | (parsed == np.floor(parsed)))
    bad = (raw.notna() & parsed.isna()).to_numpy()
    out = pa.array(parsed.where(~bad, None).tolist(), type=ARROW_TYPES[want], from_pandas=True)
    return out, bad


# --------------------------------------------------------------------------- checked, hashed rows


def prepare_batch(
    batch: pa.RecordBatch, file_index: int, row_offset: int, cfg: ReadConfig, rng
) -> tuple[dict[str, np.ndarray], tuple[np.ndarray, list[list[Any]]], dict[str, int]]:
    """Check and hash one batch.

    Returns (rows, names, stats): rows = {"u", "p", "prio", "v:<col>", "c:<col>"} numpy arrays of kept
    rows (``prio``: one uniform uint64 per row from ``rng``, the bounding priority); names = (unique partition hashes, one value list per partition column) so the output can
    show partition keys; stats = internal counters (read, dropped by reason).
    """
    n = batch.num_rows
    drop = np.zeros(n, dtype=np.int8)  # 0 = keep, else 1 + index in DROP_REASONS (first reason wins)
    cols: dict[str, pa.Array] = {}
    for name in batch.schema.names:
        arr = batch.column(name)
        if cfg.format == "csv" and name != cfg.time_column:
            arr, bad = _parse_text(arr, cfg.types[name])
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
        v = cols[c].cast(pa.float64()).to_numpy(zero_copy_only=False)  # nulls become NaN
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
