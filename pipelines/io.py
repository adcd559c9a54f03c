"""Reading the private input as Arrow record batches, row checks, and stable hashing.

One Beam element is a whole batch (or a slice of it), never one row: per-element
Python overhead is what makes naive DP pipelines slow.

Malformed input never stops a run (it runs after the budget is charged), and one line or
row never changes how another is read (issue 19): CSV lines are cut out of the byte stream
before parsing and a malformed line (open quote, wrong field count, over 16 MiB) is skipped
(see "the CSV dialect" below); a cell that does not convert to its declared type drops its
row (``_convert_column``, ``_convert_cells``: one conversion boundary, every cell's value a
function of that cell alone); both counted only in the internal run log. No error raised
here carries a cell value or a raw line; pyarrow's own error texts (which quote them) are
never passed on.

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

import codecs
import queue
import re
import threading
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Callable, Iterator

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from dpops.errors import InputDataError, InternalError
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
    """uint64 hash per element of a column already cast to its declared type (a null's hash is some fixed value
    and never used: its row is dropped as a null unit or partition)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    if ctype == "string":
        # Hash each distinct string once: dictionaries are small compared to rows.
        if not pa.types.is_dictionary(arr.type):
            arr = pc.dictionary_encode(arr)
        # Each distinct string's UTF-8 bytes, hashed as bytes: pandas hashes a str by its UTF-8 encoding, so the
        # hash is the same as of the str (tests/test_pipeline_bounding.py), without building and encoding one
        # Python str per value (4.8 against 1.0 ms for a batch's 42k distinct units here).
        dictionary = arr.dictionary.cast(pa.string()).view(pa.binary()).to_numpy(zero_copy_only=False)
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
                        counters: dict[str, int] | None = None,
                        digest: ReadDigest | None = None) -> Iterator[tuple[pa.RecordBatch, int]]:
    """Yield (batch of the needed columns, row offset in file). Conversion to the declared types is
    ``prepare_batch``'s job, cell by cell, so a bad cell drops its row instead of failing the run.

    Malformed CSV lines (the dialect below) are skipped and counted in ``counters[MALFORMED_LINES]``
    (internal run log only); a line costs only itself. Privacy reason: this runs after the budget is
    charged, so a data-dependent abort would be an unaccounted release of one bit (semantics.md section 6);
    and pyarrow's error text quotes the line, i.e. private values, so none of it is ever passed on.

    ``digest``: for a CSV file, filled with the size and sha256 of every byte this read consumed, once it
    has read the file to its end (``ReadDigest``); a Parquet row group leaves it empty (a row group is read
    through the file's footer and its own pages, not as one byte stream).
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
        try:
            yield from _csv_batches(path, cfg, counters, digest)
        except (OSError, pa.ArrowException) as exc:
            # The exception text quotes the offending line: only its class is kept.
            # (No row count either: how many rows a private file holds is itself internal.)
            raise InputDataError(f"{path}: cannot read the CSV file ({type(exc).__name__}): the file is damaged "
                                 "or was replaced after the input check; fix the file and retry") from None


# --------------------------------------------------------------------------- the CSV dialect
#
# Privacy reason for all of it: a line of the file is one unit's row, written by whoever feeds the
# input. Whatever bytes it holds, it may cost only itself (issue 19 item 3): it must never change how
# another line is split, parsed or converted, and never abort the run (which happens after the budget
# is charged). So a line is cut out of the byte stream BEFORE any CSV parsing, and the parser only
# ever sees whole lines whose quotes close on that line.
#
# The dialect (README "The CSV dialect"; docs/decisions.md):
# - A line ends at LF, CRLF or a lone CR. Nothing, not even a quoted value, continues past it.
# - The first line is the header. A UTF-8 byte-order mark before it is ignored.
# - Fields are separated by ','. A field that starts with '"' is quoted: it ends at the next '"' not
#   doubled (``""`` is one literal quote); what follows up to the next ',' is kept literally. A '"'
#   inside an unquoted field is literal. (pyarrow's own rules, restricted to one line.)
# - A line whose quoted field is still open at its end, a line with more or fewer fields than the
#   header, and a line longer than MAX_LINE_BYTES are malformed: skipped and counted
#   (``dropped_malformed_line``). A line is never joined with the next.
# - An empty cell (nothing between the separators) is null; ``""`` is the empty string, as in Parquet.
#   No text is null: ``NA``, ``N/A``, ``null``, ``nan`` are ordinary strings (issue 19 item 4).
# - Cells are read as bytes and converted by ``_convert_cells``, one cell at a time in effect.
# - An empty line is one empty field (malformed under a header of several); a BOM after the header is data.
# ``pipelines/reference_reader.py`` is this dialect written out line by line in plain Python, sharing no
# code with this module: the differential property in tests/test_reader_isolation.py holds them equal.

MAX_LINE_BYTES = 16 << 20  # a longer line is malformed (and is never held in memory whole)
CSV_READ_BYTES = 16 << 20  # bytes read at a time (<= MAX_LINE_BYTES); blocks hold whole lines only
_BOM = b"\xef\xbb\xbf"
_CSV_DICT = pa.dictionary(pa.int32(), pa.binary())  # how the CSV parser hands over a declared string column
# A line whose quoted fields all close on it (pyarrow's quoting state machine, as a regular language):
# field = quoted part ('"', then non-quotes or doubled quotes, then '"') optionally followed by a literal
# tail that does not start with '"' (a '"' right after the closing one would have been a doubled quote),
# or an unquoted field (does not start with '"'), or empty. Possessive quantifiers and atomic groups: pyarrow
# pairs every '""' it can (maximal munch), which is exactly what they express, and they make the check
# linear in the line's length (a backtracking pattern took O(n^2) on a line of quotes: a one-line stall).
_FIELD = rb'(?>"[^"]*+(?:""[^"]*+)*+"(?:[^",][^,]*+)?+|[^",][^,]*+|)'
_CLOSED_LINE = re.compile(_FIELD + rb"(?:," + _FIELD + rb")*+", re.DOTALL)


def _line_is_closed(line: bytes) -> bool:
    return b'"' not in line or _CLOSED_LINE.fullmatch(line) is not None


def _normalise_newlines(chunk: bytes) -> bytes:
    if b"\r" in chunk:
        chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    return chunk


def _line_blocks(stream: Any, malformed: list[int]) -> Iterator[tuple[bytes, int, int]]:
    """The file's lines, as blocks of whole lines: (buffer, start, end), the block being buffer[start:end]
    (not sliced, to save a copy). The first block is the header line alone. Every block ends with b"\\n";
    newlines are normalised to LF. A line longer than MAX_LINE_BYTES is dropped (``malformed[0] += 1``)
    whatever its position: the decision depends on its own length only, never on where the reads fall. (A
    line wholly inside one read is at most CSV_READ_BYTES <= MAX_LINE_BYTES long, so only the line
    continued from the previous read needs its length checked.)"""
    if CSV_READ_BYTES > MAX_LINE_BYTES:  # pragma: no cover - a configuration error, not data
        raise InternalError("CSV_READ_BYTES must not exceed MAX_LINE_BYTES")
    carry = b""
    dropping = False  # inside a too-long line: skip to its end
    header_done = False
    cr = b""  # a CR that ended the previous read: held back, since an LF may follow it (one CRLF, one line end)
    while True:
        raw = bytes(stream.read(CSV_READ_BYTES))
        if not raw:
            if not cr:
                break
            chunk, cr = cr, b""  # the file ends with a lone CR
        else:
            chunk, cr = cr + raw, b""
            if chunk.endswith(b"\r"):  # (reading one byte more was not enough: CR CR LF across reads)
                chunk, cr = chunk[:-1], b"\r"
            if not chunk:
                continue
        chunk = _normalise_newlines(chunk)
        if dropping:
            i = chunk.find(b"\n")
            if i < 0:
                continue
            chunk, dropping = chunk[i + 1:], False
        buf = carry + chunk if carry else chunk
        start = 0
        if not header_done:
            i = buf.find(b"\n")
            if i < 0:
                if len(buf) > MAX_LINE_BYTES:
                    raise InputDataError(f"the CSV header line is longer than {MAX_LINE_BYTES} bytes")
                carry = buf
                continue
            yield buf, 0, i + 1  # the header, as its own block
            start, header_done = i + 1, True
        cut = buf.rfind(b"\n", start)
        if cut < 0:
            carry = buf[start:]
            if len(carry) > MAX_LINE_BYTES:
                malformed[0] += 1
                carry, dropping = b"", True
            continue
        end, carry = cut + 1, buf[cut + 1:]
        first = buf.find(b"\n", start, end) - start
        if first > MAX_LINE_BYTES:  # only the line continued from the previous read can be this long
            malformed[0] += 1
            start += first + 1
        if len(carry) > MAX_LINE_BYTES:
            malformed[0] += 1
            carry, dropping = b"", True
        if end > start:
            yield buf, start, end
    if carry and not dropping:  # the last line (or a header-only file) without a final newline
        yield carry + b"\n", 0, len(carry) + 1


class ReadDigest:
    """What one read of a CSV file consumed: its byte count and sha256, complete only once the read reached the
    file's end (``complete``).

    Privacy reason: the release's keyed noise is labelled by the input's fingerprint (the run key), so the
    output must be computed from exactly the bytes that fingerprint hashed; otherwise two different inputs
    get noise under one key and their difference is exact. Hashing the bytes the reader itself parsed proves
    that directly, where hashing the file again after the pipeline proved it only for a file that did not
    change in between (``dpops.release.computation.check_input_unchanged`` compares the two). The sha256 of
    private data never leaves the worker: it reports a salted tag of it (``dpops.inputs.read_digest_tag``)
    with the run's internal counters (``pipelines.transforms.read_digest_counters``), which the driver takes out
    of them before anything is written."""

    __slots__ = ("_sha", "size", "complete")

    def __init__(self) -> None:
        import hashlib

        self._sha = hashlib.sha256()
        self.size = 0
        self.complete = False

    def update(self, data: bytes) -> None:
        self._sha.update(data)  # hashlib releases the GIL on a buffer this size (the reader's 16 MiB reads)
        self.size += len(data)

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


class _DigestedStream:
    """A binary stream whose reads pass through a ``ReadDigest``; reaching the end marks it complete."""

    __slots__ = ("_stream", "_digest")

    def __init__(self, stream: Any, digest: ReadDigest) -> None:
        self._stream = stream
        self._digest = digest

    def read(self, n: int) -> bytes:
        data = self._stream.read(n)
        if data:
            self._digest.update(data)
        else:
            self._digest.complete = True
        return data

    def close(self) -> None:
        self._stream.close()


def _csv_batches(path: str, cfg: ReadConfig, counters: dict[str, int] | None,
                 digest: ReadDigest | None = None) -> Iterator[tuple[pa.RecordBatch, int]]:
    """The CSV dialect above, as record batches of the needed columns (bytes). A line costs only itself.
    ``digest``: hashes every byte read (``ReadDigest``)."""
    import pyarrow.csv as pcsv

    needed = cfg.needed
    malformed = [0]  # the too-long lines, counted by _line_blocks (in the Prefetch thread)
    parsed_malformed = 0  # the lines each block's parse skipped, added up here (in the caller's thread)
    offset = 0
    src = open_input(path)
    stream = open(src, "rb") if isinstance(src, str) else src  # a local path, or Beam's stream for a URI
    if digest is not None:
        stream = _DigestedStream(stream, digest)  # read (so hashed) in _line_blocks' thread, the Prefetch's
    blocks = _line_blocks(stream, malformed)
    try:
        hbuf, hstart, hend = next(blocks, (b"", 0, 0))
        names = _header_names(hbuf[hstart:hend], path)
        if [c for c in needed if c not in names]:
            raise InputDataError(f"{path}: a column declared in the spec is missing from the CSV header (line 1); "
                                 "fix the file or input.columns")
        # An empty line has one field: malformed under a header of several (the dialect), where pyarrow would
        # make it a row of nulls; so pyarrow skips it and _parse_block counts it. Under a one-column header it
        # is that column's null.
        ignore_empty = len(names) > 1
        convert = pcsv.ConvertOptions(
            include_columns=needed,
            # Bytes, converted by us cell by cell: a bad cell (even invalid UTF-8) drops its row, not the file.
            # String columns arrive dictionary-encoded (bytes values), so each distinct value is checked and
            # hashed once (``_convert_dictionary_cells``, ``hash_column``); a cell is still read alone.
            column_types={c: _CSV_DICT if cfg.types.get(c) == "string" else pa.binary() for c in needed},
            null_values=[""], strings_can_be_null=True, quoted_strings_can_be_null=False,
        )

        def parse_one(block: tuple[bytes, int, int]) -> tuple[pa.Table, int]:
            # Each block has its own counters (blocks are parsed PARSE_THREADS at a time, so none is shared):
            # returns its table and how many of its lines were malformed.
            skipped, bad = _LineCounter(), [0]
            parse = pcsv.ParseOptions(newlines_in_values=False, ignore_empty_lines=ignore_empty,
                                      invalid_row_handler=skipped)
            table = _parse_block(*block, names, parse, convert, skipped, bad)
            return table, skipped.count + bad[0]

        with Prefetch(in_order(parse_one, blocks, PARSE_THREADS)) as parsed:
            for table, bad in parsed:
                parsed_malformed += bad
                for batch in table.to_batches(max_chunksize=cfg.batch_rows):
                    yield batch, offset
                    offset += batch.num_rows
    finally:
        stream.close()  # after Prefetch has joined its thread: nothing reads the stream any more
        if counters is not None:
            n = malformed[0] + parsed_malformed
            if n:
                counters[MALFORMED_LINES] = counters.get(MALFORMED_LINES, 0) + n


PARSE_THREADS = 2  # CSV blocks parsed at once (pyarrow's parser holds no GIL: the machine's two cores)


def in_order(fn: Callable[[Any], Any], items: Iterator[Any], workers: int,
             name: str = "dpops-csv-parse") -> Iterator[Any]:
    """``map(fn, items)`` with up to ``workers`` calls running at once on a thread pool, results in the order of
    ``items`` (one more item is taken ahead, so a worker is never idle waiting for the next). Speed only: each
    call sees only its own item, ``items`` is consumed in this thread, and an exception is raised here at its
    item's place (the items after it are never yielded). Closing the generator waits for the running calls
    and leaves no thread behind."""
    from collections import deque
    from concurrent.futures import Future, ThreadPoolExecutor

    if workers <= 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name) as pool:
        pending: deque[Future[Any]] = deque()
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) > workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()


def _header_names(header: bytes, path: str) -> list[str]:
    """The column names of the CSV header line ``header`` (the first block of ``_line_blocks``: the line with its
    b"\\n", or b"" for an empty file), read by the dialect: a UTF-8 BOM before it is dropped, its quotes must close
    on it, it must be UTF-8, and the names are pyarrow's split of it, as written (no space trimmed).

    One owner (review 5): ``check_input`` and the GX input check read the header with Python's ``csv`` module and
    stripped the names, so `` region`` or an unclosed quote at the header's end passed the checks before the charge
    and then failed the reader after it (every retry: the run stuck started); and a file whose lines end with a lone
    CR was refused before the charge although the reader reads it. All three call this now (``csv_header_names``).
    No error names a cell or the header's text (a copy of a secret may stand where a header should)."""
    import pyarrow.csv as pcsv

    if header.startswith(_BOM):
        header = header[len(_BOM):]
    if not header.rstrip(b"\n"):
        raise InputDataError(f"{path}: empty CSV file, expected a header line naming the columns (line 1)")
    if not _line_is_closed(header[:-1]):
        raise InputDataError(f"{path}: the CSV header line has an unclosed quote; fix the header")
    try:
        header.decode("utf-8")
    except UnicodeDecodeError:  # check_input refuses it before a run; a file swapped since lands here
        raise InputDataError(f"{path}: the CSV header (line 1) is not UTF-8 text; fix the header") from None
    try:
        return list(pcsv.read_csv(pa.py_buffer(header), parse_options=pcsv.ParseOptions(newlines_in_values=False),
                                  read_options=pcsv.ReadOptions(use_threads=False)).column_names)
    except pa.ArrowException:  # its text quotes the header
        raise InputDataError(f"{path}: the CSV header (line 1) cannot be read as column names; fix the header") from None


def csv_header_names(stream: Any, path: str) -> list[str]:
    """The column names of the CSV file open as the binary ``stream``, exactly as the reader takes them
    (``_header_names``): what every check before the charge must look at. Reads at most one block."""
    blocks = _line_blocks(stream, [0])
    try:
        hbuf, hstart, hend = next(blocks, (b"", 0, 0))
    finally:
        blocks.close()
    return _header_names(bytes(hbuf[hstart:hend]), path)


class Prefetch:
    """Run an iterator one item ahead in a background thread, yielding its items in order.

    Speed only: the CSV reader reads, cuts and parses block k+1 (pyarrow's parser releases the GIL) while
    the caller checks, hashes and bounds block k. 42476cc's ``pyarrow.csv.open_csv`` overlapped the same
    way; a serial read then cost ~20% of the 100M-row scale benchmark's wall time. Nothing about the result
    changes: one thread runs the whole source iterator (the CSV reader's parse calls, ``in_order``, each count
    into their own block's counters), items arrive in source order, and an exception is re-raised here, in the caller, where it
    was raised in the source (no item after it). Leaving the ``with`` block early stops the thread and
    joins it, so the source (and its open file) is never used again after ``__exit__``.
    """

    _DONE = object()

    def __init__(self, source: Iterator[Any], depth: int = 1, name: str = "dpops-csv-prefetch"):
        self._source = source
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for item in self._source:
                if not self._put((True, item)):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread, re-raised there
            self._put((False, exc))
            return
        finally:
            # A generator source is closed here, in this thread, before __exit__'s join returns: its own
            # cleanup (an inner Prefetch's thread, an open file) is done when the caller leaves the block.
            close = getattr(self._source, "close", None)
            if close is not None:
                close()
        self._put((True, self._DONE))

    def __enter__(self) -> Iterator[Any]:
        self._thread.start()
        return self._items()

    def _items(self) -> Iterator[Any]:
        while True:
            ok, item = self._queue.get()
            if not ok:
                raise item
            if item is self._DONE:
                return
            yield item

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        while self._thread.is_alive():
            try:  # unblock a pending put; its item is dropped
                self._queue.get(timeout=0.1)
            except queue.Empty:
                pass
        self._thread.join()


_QUOTED_PART = re.compile(rb'(?:^|(?<=,))"[^"]*+(?:""[^"]*+)*+"')


def _field_count(line: bytes) -> int:
    """Fields of a line whose quotes close (``_line_is_closed``), counted as pyarrow splits them."""
    return _QUOTED_PART.sub(b"", line).count(b",") + 1


def _well_formed_lines(block: bytes, n_fields: int, malformed: list[int]) -> bytes:
    """The lines of ``block`` (whole lines, each ending in b"\\n") that are well formed, each judged on its own
    bytes: its quotes close on it (``_line_is_closed``) and it has the header's field count (``_field_count``).
    The others are removed and counted (``malformed[0]``).

    Privacy reason (issue 25 item 2): what pyarrow receives from here cannot merge two lines or hand a line's
    text to ``invalid_row_handler`` (which decodes it and fails the whole block on invalid UTF-8, after the
    charge): every line it sees is one row by construction, whatever bytes its neighbours hold. A well-formed
    line that is not UTF-8 stays; its bad cells drop its row later (``_convert_cells``).
    """
    out = []
    for line in block[:-1].split(b"\n"):
        if _line_is_closed(line) and _field_count(line) == n_fields:
            out.append(line)
        else:
            malformed[0] += 1
    return b"\n".join(out) + b"\n" if out else b""


def _parse_block(buf: bytes, start: int, end: int, names: list[str], parse: Any, convert: Any,
                 skipped: _LineCounter, malformed: list[int]) -> pa.Table:
    """Parse the whole lines buf[start:end]; every line gives exactly one row or one skip (checked), never
    part of another's.

    pyarrow's parser lets a quoted field run over line ends even with ``newlines_in_values=False``, and
    decodes a skipped line's bytes as UTF-8 for ``invalid_row_handler``. So pyarrow parses the block as it
    is only when the block is UTF-8 (then a skipped line's text decodes); the common case then costs one
    count of b"\\n": the last line is checked (nothing follows it to merge with), the block is parsed, and
    rows + skips must equal lines. Records never outnumber lines (a record ends at a newline), so equality
    means no two lines merged. In every other case (a block that is not UTF-8, a line in the middle that
    opened a quote, any pyarrow error) every line is judged alone (``_well_formed_lines``) and only the
    well-formed ones are parsed: they cannot merge, and nothing is left for pyarrow to skip.
    """
    block_is_utf8 = buf.isascii()  # (the whole buffer: a cheap test first)
    if not block_is_utf8:
        try:
            codecs.utf_8_decode(memoryview(buf)[start:end], "strict", True)
            block_is_utf8 = True
        except UnicodeDecodeError:
            pass
    if block_is_utf8:
        # The block's tail is cut back to its last line that is non-empty and closes its quotes: trailing open
        # lines are malformed (nothing may follow them to merge with, and pyarrow would read an open quote up
        # to the end of its input as a field), and trailing empty lines are cut too, since pyarrow skips an
        # empty line without a record, so an open quote running through them would merge unseen by the count.
        fast_end, trailing_empty, open_last = end, 0, 0
        while fast_end > start:
            if parse.ignore_empty_lines and (fast_end - start == 1 or buf[fast_end - 2] == 0x0A):
                cut = _last_nonempty_end(buf, start, fast_end)  # a run of empty lines at once (numpy)
                trailing_empty += _count_newlines(buf, cut, fast_end)
                fast_end = cut
                continue
            last_start = buf.rfind(b"\n", start, fast_end - 1) + 1
            if _line_is_closed(buf[last_start:fast_end - 1]):
                break
            open_last += 1
            fast_end = last_start
        if fast_end <= start:
            malformed[0] += trailing_empty + open_last  # the block is only open and empty lines
            return _empty_table(convert)
        lines = _count_newlines(buf, start, fast_end)
        before = skipped.count
        try:
            table = _read_lines(memoryview(buf)[start:fast_end], names, parse, convert)
        except pa.ArrowException:
            table = None
        if table is not None:
            records = table.num_rows + skipped.count - before
            # A record ends at a line end, so records <= lines, and every line absorbed into another's record
            # (the block now ends in a non-empty line whose quotes close) is a non-empty one that would have
            # been a record of its own: equality means no merge. Empty lines (skipped without a record, and
            # malformed by the dialect) are counted only when the cheap test fails.
            empty = 0
            if records != lines and parse.ignore_empty_lines:
                empty = _count_empty_lines(buf, start, fast_end)
            if records + empty == lines:
                malformed[0] += empty + trailing_empty + open_last
                return table
        skipped.count = before
    # Some line left a quote open (or the block is not UTF-8): judge every line alone.
    kept = _well_formed_lines(buf[start:end], len(names), malformed)
    if not kept:
        return _empty_table(convert)
    before = skipped.count
    table = _read_lines(kept, names, parse, convert)
    if table.num_rows != _count_newlines(kept, 0, len(kept)) or skipped.count != before:
        # well-formed lines cannot merge or be skipped: a bug if they do
        raise InternalError("the CSV reader joined or skipped a line although each is well formed on its own")
    return table


def _count_newlines(buf: bytes, start: int, end: int) -> int:
    """Count of b"\\n" in buf[start:end], 1 MiB at a time into one scratch array (twice as fast as
    ``bytes.count`` here, and no 16 MiB temporary per block)."""
    a = np.frombuffer(buf, np.uint8, count=end - start, offset=start)
    step = 1 << 20
    scratch = np.empty(min(step, len(a)), bool)
    n = 0
    for i in range(0, len(a), step):
        part = a[i:i + step]
        out = scratch[:len(part)]
        np.equal(part, 10, out=out)
        n += int(np.count_nonzero(out))
    return n


def _count_empty_lines(buf: bytes, start: int, end: int) -> int:
    """Empty lines among the whole lines buf[start:end] (buf[start] starts a line): a b"\\n" right after
    another, or at ``start``."""
    a = np.frombuffer(buf, np.uint8, count=end - start, offset=start) == 10
    return int(len(a) > 0 and a[0]) + int(np.count_nonzero(a[1:] & a[:-1]))


def _last_nonempty_end(buf: bytes, start: int, end: int) -> int:
    """The end (after its b"\\n") of the last non-empty line of the whole lines buf[start:end], or ``start``."""
    a = np.frombuffer(buf, np.uint8, count=end - start, offset=start)
    other = np.flatnonzero(a != 10)
    return start if len(other) == 0 else start + int(other[-1]) + 2


def _read_lines(data: bytes | memoryview, names: list[str], parse: Any, convert: Any) -> pa.Table:
    import pyarrow.csv as pcsv

    skip = 0
    if bytes(data[:3]) == _BOM:
        # pyarrow drops a byte-order mark at the start of its input, i.e. from whichever line starts a
        # block: that line's first cell would depend on where the blocks fall. Only the file's own BOM is
        # dropped (by _csv_batches); here an empty line is put first and skipped, so the BOM stays data.
        data, skip = b"\n" + bytes(data), 1
    read = pcsv.ReadOptions(column_names=names, use_threads=False, block_size=len(data) + 1, skip_rows=skip)
    return pcsv.read_csv(pa.py_buffer(data), read_options=read, parse_options=parse, convert_options=convert)


def _empty_table(convert: Any) -> pa.Table:
    return pa.table({c: pa.array([], pa.binary()) for c in convert.include_columns})


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
    if n == 0:  # no cell, no type to check: a row-less file may store any type (dpops.inputs.columns_of_any_type)
        return pa.nulls(0, target), ok_mask
    if pa.types.is_dictionary(arr.type):
        if want == "string" and (pa.types.is_binary(arr.type.value_type) or
                                 pa.types.is_large_binary(arr.type.value_type)):
            return _convert_dictionary_cells(arr)
        arr = arr.cast(arr.type.value_type)
    if pa.types.is_string_view(arr.type):
        # A file written from string_view columns (pyarrow >= 16, Polars) reads back as string_view, which neither
        # Parquet's plain reader nor this cast checks for UTF-8 (review 5): one unit's invalid cell then failed the
        # hashing after the charge, its bytes in the error. As a plain string it gets the check below, per cell.
        arr = arr.cast(pa.string())
    if want == "string" and (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        try:
            arr.validate(full=True)  # UTF-8 check; Parquet's plain reader does not do it
        except pa.ArrowException:
            arr = arr.view(pa.binary() if pa.types.is_string(arr.type) else pa.large_binary())
    if pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type):
        return _convert_cells(arr, want)
    if arr.type == target:
        return arr, ok_mask
    if pa.types.is_null(arr.type):  # an all-null column: every row is dropped for its null, not its type
        return pa.nulls(n, target), ok_mask
    bad: pa.Array | None = None
    if pa.types.is_floating(arr.type) and want == "int":
        # (dpops.inputs.stored_type_ok: pandas writes an int column with a missing value as float64.) A cell
        # that is an integer within int64 converts exactly; any other (2.5, inf, NaN, 2^63) drops its row.
        f = arr.cast(pa.float64()).fill_null(0.0).to_numpy(zero_copy_only=False)
        with np.errstate(invalid="ignore"):
            whole = np.isfinite(f) & (np.floor(f) == f) & (f >= -(2.0 ** 63)) & (f < 2.0 ** 63)
        null = _nulls(arr)
        ok = whole & ~null
        return pa.array(np.where(ok, f, 0.0).astype(np.int64), type=pa.int64(), mask=~ok), ~whole & ~null
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


# One conversion boundary for CSV text (issue 19 item 2). Every cell's result is a function of that cell
# alone, and no exception raised while converting a cell can leave ``_convert_cells``: whatever goes wrong
# (Python's 4,300-digit limit in int(), a huge exponent, a bug in a parser) makes that one cell malformed,
# so its row is dropped as ``wrong_type`` and the run goes on. Privacy reason: the conversion runs after
# the budget is charged; an exception there would make whether the interval publishes a function of one
# row, and a cell whose fate depended on its neighbours would let one unit change another's rows.
#
# Accepted text (README "Input files"), ASCII only, surrounding spaces and tabs ignored:
# - int: [+-]digits, or a decimal number whose value is an integer (``2.0``, ``1e3``), within int64;
# - float: a decimal number with optional exponent, or inf/infinity/nan (those drop the row as
#   ``bad_value``, like a NaN in Parquet);
# - bool: true/false/1/0, any case.
# Speed: columns whose cells all have the plain form are converted by Arrow in one vectorised cast (a
# plain int is -?[0-9]{1,18}, which Arrow and int() read alike; for floats Arrow's parser reads exactly
# the decimal forms above, correctly rounded like float(), and the non-finite words, but also NaN payload
# forms such as ``nan(1)``, which the grammar refuses: so a fast cast is kept only when every non-finite
# cell it read is one of the words (``_non_finite_cells_are_words``), else the column takes the cell-by-cell
# path. Privacy reason (review 5): only a metric column drops a NaN; a float partition, unit or top_k column
# keeps it, so ``nan(1)`` was a row in partition NaN when its batch took the fast path and a dropped row when
# another unit's padded `` 2.5`` sent the batch cell by cell). Only the other cells go through Python, one
# cell at a time.
_INT_TEXT = re.compile(r"([+-]?)0*([0-9]+)")
_DEC_TEXT = r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
_DECIMAL_TEXT = re.compile(_DEC_TEXT)
_FLOAT_TEXT = re.compile(_DEC_TEXT + r"|[+-]?(?:inf|infinity|nan)", re.IGNORECASE)
_PLAIN_INT = r"^-?[0-9]{1,18}$"  # what Arrow's cast reads exactly as int() does, and always within int64
_PLAIN_FLOAT = "^" + _DEC_TEXT + "$"
_MAX_NUMBER_TEXT = 1000  # a decimal int/float cell longer than this is malformed (bounds the work per cell)
_FLOAT_WORD = r"^[+-]?(?i:inf|infinity|nan)$"  # the grammar's non-finite float cells (Arrow: no blanks)
_BLANK = " \t"


def _non_finite_cells_are_words(text: pa.Array, fast: pa.Array) -> bool:
    """Whether every cell Arrow's float cast read as non-finite is spelled as the grammar's inf/infinity/nan
    (a cell's own text decides: the fast cast is then exactly the grammar's reading of every cell)."""
    odd = pc.invert(pc.is_finite(fast)).fill_null(False)
    if not pc.any(odd).as_py():
        return True
    return bool(pc.all(pc.match_substring_regex(text.filter(odd), _FLOAT_WORD)).as_py())


def _int_cell(text: str) -> int | None:
    t = text.strip(_BLANK)
    m = _INT_TEXT.fullmatch(t)
    if m:
        if len(m.group(2)) > 19:  # beyond int64 whatever the digits: never call int() on it
            return None
        v = int(m.group(1) + m.group(2))
    elif len(t) <= _MAX_NUMBER_TEXT and _DECIMAL_TEXT.fullmatch(t):
        d = Decimal(t)  # exact: "9007199254740993.0" is 9007199254740993, not its float
        if not (_INT64_MIN <= d <= _INT64_MAX) or d != d.to_integral_value():
            return None
        v = int(d)
    else:
        return None
    return v if _INT64_MIN <= v <= _INT64_MAX else None


def _float_cell(text: str) -> float | None:
    t = text.strip(_BLANK)
    if len(t) > _MAX_NUMBER_TEXT or not _FLOAT_TEXT.fullmatch(t):
        return None
    return float(t)


def _decode_cells(arr: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """Bytes -> UTF-8 text; a cell that is not valid UTF-8 becomes null and is marked bad. Arrow's check
    and Python's decoder refuse the same sequences (overlong forms, surrogates, > U+10FFFF)."""
    n = len(arr)
    bad = np.zeros(n, bool)
    try:
        return arr.cast(pa.string() if pa.types.is_binary(arr.type) else pa.large_string()), bad
    except pa.ArrowException:
        pass
    out: list[str | None] = []
    for i, b in enumerate(arr.to_pylist()):
        if b is None:
            out.append(None)
            continue
        try:
            out.append(b.decode("utf-8"))
        except UnicodeDecodeError:
            out.append(None)
            bad[i] = True
    return pa.array(out, type=pa.string()), bad


def _convert_dictionary_cells(arr: pa.DictionaryArray) -> tuple[pa.Array, np.ndarray]:
    """Dictionary-encoded CSV cells of a declared string column (bytes values, null index = empty cell) ->
    the same cells as UTF-8 text, still dictionary-encoded; returns (array, mask of cells that do not decode).

    Each distinct byte string is decoded once (``_decode_cells``) and every cell takes its own value's result,
    so a cell's text, or its being dropped as ``wrong_type``, is a function of its own bytes alone, exactly as
    when every cell is decoded on its own: the dictionary only saves repeating the work (speed), it never
    lets one line's bytes change how another is read. A value that is not UTF-8 becomes a null dictionary
    entry; its rows are dropped by the caller (``wrong_type`` is marked before any other reason)."""
    text, bad_values = _decode_cells(arr.dictionary)
    idx = arr.indices
    if not len(bad_values) or not bad_values.any():
        return pa.DictionaryArray.from_arrays(idx, text), np.zeros(len(arr), bool)
    valid = idx.is_valid().to_numpy(zero_copy_only=False)
    bad = bad_values[idx.fill_null(0).to_numpy(zero_copy_only=False)] & valid
    return pa.DictionaryArray.from_arrays(idx, text), bad


def _convert_cells(arr: pa.Array, want: str) -> tuple[pa.Array, np.ndarray]:
    """CSV cells (bytes, nulls for empty cells) -> the declared type; returns (array, mask of cells that do
    not convert). THE conversion boundary: never raises because of a cell (see the comment above)."""
    n = len(arr)
    try:
        text, bad = _decode_cells(arr)
        if want == "string":
            return text, bad
        if want == "bool":
            low = pc.utf8_lower(pc.utf8_trim(text, _BLANK))
            true = pc.is_in(low, pa.array(["true", "1"])).to_numpy(zero_copy_only=False)
            false = pc.is_in(low, pa.array(["false", "0"])).to_numpy(zero_copy_only=False)
            bad |= ~(true | false) & ~_nulls(text)
            return pa.array(true, mask=~(true | false)), bad
        target = ARROW_TYPES[want]
        plain_re = _PLAIN_INT if want == "int" else _PLAIN_FLOAT
        null = _nulls(text)
        if want == "float" and not bad.any():
            try:  # the fast path (see above): Arrow reads every decimal form exactly as float() does
                fast = text.cast(target)
            except pa.ArrowException:
                fast = None
            if fast is not None and _non_finite_cells_are_words(text, fast):
                return fast, bad
        plain = pc.match_substring_regex(text, plain_re).fill_null(False).to_numpy(zero_copy_only=False)
        if plain.all():
            return text.cast(target), bad
        dtype = np.int64 if want == "int" else np.float64
        values = np.zeros(n, dtype)
        ok = np.zeros(n, bool)
        idx = np.flatnonzero(plain)
        if len(idx):
            values[idx] = text.take(pa.array(idx)).cast(target).to_numpy(zero_copy_only=False)
            ok[idx] = True
        parse = _int_cell if want == "int" else _float_cell
        others = np.flatnonzero(~plain & ~null & ~bad)
        cells = text.take(pa.array(others)).to_pylist() if len(others) else []
        for i, cell in zip(others.tolist(), cells, strict=True):
            try:
                v = parse(cell)
            except Exception:  # noqa: BLE001 - the boundary: any failure on one cell is that cell's
                v = None
            if v is None:
                bad[i] = True
            else:
                values[i] = v
                ok[i] = True
        return pa.array(values, type=target, mask=~ok), bad
    except pa.ArrowException:  # pragma: no cover - defence in depth: a column-level failure drops the column's rows
        return pa.nulls(n, ARROW_TYPES[want]), np.ones(n, bool)


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
        _mark(drop, _missing_keys(cols[cfg.unit_column]), "null_unit")
    for c in cfg.partition_columns:
        _mark(drop, _missing_keys(cols[c]), "null_partition")
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

    uniq, first = _first_occurrences(rows["p"])
    take = pa.array(idx[first])
    name_values = [_values_list(cols[c].take(take)) for c in cfg.partition_columns]
    return rows, (uniq, name_values), stats


def _values_list(arr: pa.Array) -> list[Any]:
    """``arr.to_pylist()``, the same values: a dictionary array is decoded first, since its own ``to_pylist``
    looks each value up in Python (3.0 against 0.1 ms for a batch's 1,000 partition names)."""
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    return arr.to_pylist()


def _first_occurrences(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct values, index of each one's first occurrence): ``np.unique(values, return_index=True)``
    computed by hashing (``pd.factorize``, O(n)) instead of sorting all n values; only the few distinct
    partition hashes are sorted. Speed only: the result is the same arrays."""
    if not len(values):
        return values[:0].copy(), np.zeros(0, np.int64)
    codes, uniq = pd.factorize(values, sort=False)
    first = np.empty(len(uniq), np.int64)
    first[codes[::-1]] = np.arange(len(values) - 1, -1, -1)  # the last write per code is its first row
    order = np.argsort(uniq, kind="stable")
    return np.asarray(uniq, dtype=values.dtype)[order], first[order]


def outside_window(arr: pa.Array, window_ns: tuple[int, int] | None) -> np.ndarray:
    """Mask of rows whose event time is NOT in [start, end): null, unparseable or out of the interval.

    Parquet timestamps (any unit; naive ones are UTC) are compared as integers in their own unit
    against ceil(bound / unit), which is exact: ``v*f >= lo  <=>  v >= ceil(lo/f)``. CSV cells are
    ISO-8601 text (no offset = UTC), each read alone by ``time_text_ns``. A row whose time cannot be
    read cannot be shown to belong to this period, so it is dropped like any malformed row; the count
    goes to the internal log only.
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
        v, readable = time_text_ns(arr)
        return ~readable | (v < lo) | (v >= hi)
    # check_input refuses any other type before a run; a file swapped since is malformed row by row
    return np.ones(len(arr), dtype=bool)


# Event-time text (README "The CSV dialect"; issue 25 item 1). Privacy reason: which period a row's time
# puts it in decides which bucket of a period-bucketed scope it is charged to, so that decision must be a
# function of the row's own cell. pandas' ``to_datetime(format="ISO8601")`` over a column is not: it carried
# the last zone offset it saw forward to the naive strings after it (pandas issue 61389), so one unit's
# ``+12:00`` moved 2,000 other users' rows to the previous day. So no inference-based parser is ever handed
# a column: the accepted text is this fixed grammar, and each cell is read by Arrow's elementwise cast of
# its class (naive cells as ``timestamp[ns]`` = UTC, cells with an offset as ``timestamp[ns, UTC]``), which
# holds no state between cells. The grammar (ASCII, nothing before or after it):
#   date:   YYYY-MM-DD
#   time:   optional, after 'T' or ' ': hh, hh:mm, hh:mm:ss or hh:mm:ss.f (f: 1 to 9 digits)
#   offset: optional, only after a time: 'Z', or '+'/'-' then hh, hhmm or hh:mm; none means UTC
# Field values must exist (no 2024-02-30, no hour 24, no second 60, offsets below 24:00), and the instant
# must lie within int64 nanoseconds (years 1677-2262): any other cell is unreadable and drops its row.
# This is exactly the text Arrow's two casts accept, and they accept disjoint sets (the naive cast refuses
# an offset, the other requires one), so a cell's class is read off its own bytes: an offset is a 'Z', '+'
# or '-' after the date's 10 characters.
_NAIVE_NS, _AWARE_NS = pa.timestamp("ns"), pa.timestamp("ns", tz="UTC")


def time_text_ns(text: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(nanoseconds since the epoch, UTC, as int64; mask of readable cells) for event-time text cells, each
    cell read alone by the grammar above (nulls and unreadable cells: False in the mask, 0 in the values).

    Speed: the class of the first cell is tried on the whole column first, one Arrow cast (~0.1 us/cell):
    that is the whole cost when every cell has the same class. Otherwise (a failing cast costs ~3 us per
    cell, as pandas did) three substring tests classify the cells and each class costs one cast. A class
    whose cast fails (some cell is not of the grammar) is cut in halves until each failing cell is alone,
    so k bad cells cost O(k log n) casts, and a cell's value never depends on another's."""
    n = len(text)
    ns = np.zeros(n, np.int64)
    ok = np.zeros(n, bool)
    null = _nulls(text)
    present = np.flatnonzero(~null)
    if len(present) == 0:
        return ns, ok
    first = int(present[0])
    guess = _AWARE_NS if _casts(text.slice(first, 1), _AWARE_NS) else _NAIVE_NS
    try:
        parsed = text.cast(guess)  # every cell of the first one's class (any null stays null)
        return parsed.view(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False), ~null
    except pa.ArrowException:
        pass
    tail = pc.utf8_slice_codeunits(text, 10)
    aware = np.zeros(n, bool)
    for mark in ("Z", "+", "-"):
        aware |= pc.match_substring(tail, mark).fill_null(False).to_numpy(zero_copy_only=False)
    for mask, typ in ((aware & ~null, _AWARE_NS), (~aware & ~null, _NAIVE_NS)):
        idx = np.flatnonzero(mask)
        if len(idx):
            _cast_times(text.take(pa.array(idx)), typ, idx, ns, ok)
    return ns, ok


def _casts(cells: pa.Array, typ: pa.DataType) -> bool:
    try:
        cells.cast(typ)
        return True
    except pa.ArrowException:
        return False


def _cast_times(cells: pa.Array, typ: pa.DataType, idx: np.ndarray, ns: np.ndarray, ok: np.ndarray) -> None:
    try:
        parsed = cells.cast(typ)
    except pa.ArrowException:  # some cell names no instant: bisect down to it (its text is never shown)
        if len(cells) > 1:
            half = len(cells) // 2
            _cast_times(cells.slice(0, half), typ, idx[:half], ns, ok)
            _cast_times(cells.slice(half), typ, idx[half:], ns, ok)
        return
    ns[idx] = parsed.view(pa.int64()).to_numpy(zero_copy_only=False)
    ok[idx] = True


def _nulls(arr: pa.Array) -> np.ndarray:
    return arr.is_null().to_numpy(zero_copy_only=False)


def _missing_keys(arr: pa.Array) -> np.ndarray:
    """Cells that cannot key a unit or a partition: nulls, and NaN in a float column. A NaN equals nothing, not
    even itself, its bits vary (so its hash does), and the output check refuses a NaN partition key: kept, a
    few units' ``nan`` cells could hold back a day's publication after the charge. A per-cell rule."""
    if pa.types.is_floating(arr.type):
        return pc.is_null(arr, nan_is_null=True).to_numpy(zero_copy_only=False)
    return _nulls(arr)


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
