"""The CSV reader parses block k+1 in a background thread while the caller works on block k (speed only).

What must hold for that to be invisible: the batches are the same, in the same order, as a read whose
blocks are so small that every line is its own block; an error in the middle of the file (a read that
fails) reaches the caller as the reader's usual ``InputDataError`` after exactly the batches before it;
and a caller that stops early leaves no thread behind and the file closed, never read again.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import pipelines.io as pio
from dpops.errors import InputDataError
from pipelines.io import ReadConfig, iter_record_batches

TYPES = {"user_id": "string", "region": "string", "amount": "float"}
CFG = ReadConfig(format="csv", types=TYPES, unit_column="user_id", partition_columns=("region",),
                 value_columns=("amount",), batch_rows=7)
LINES = [b"u%d,r%d,%d,x" % (i, i % 5, i) for i in range(400)]
LINES[17] = b'u17,"north,1,x'  # an open quote: skipped, costs only itself
LINES[250] = b"u250,too,many,fields,here"  # a wrong field count: skipped


def _write(tmp_path: Path) -> Path:
    path = tmp_path / "in.csv"
    path.write_bytes(b"user_id,region,amount,note\n" + b"\n".join(LINES) + b"\n")
    return path


def _prefetch_threads() -> list[threading.Thread]:
    # the prefetch thread and the parse pool's threads (``in_order``: "dpops-csv-parse_0", ...)
    return [t for t in threading.enumerate()
            if (t.name == "dpops-csv-prefetch" or t.name.startswith("dpops-csv-parse")) and t.is_alive()]


def _set_limits(monkeypatch: pytest.MonkeyPatch, read_bytes: int) -> None:
    monkeypatch.setattr(pio, "CSV_READ_BYTES", read_bytes)
    monkeypatch.setattr(pio, "MAX_LINE_BYTES", max(read_bytes, 64))


def _read_all(path: Path) -> tuple[pa.Table, dict[str, int], list[int]]:
    counters: dict[str, int] = {}
    batches, offsets = [], []
    for batch, offset in iter_record_batches((0, str(path), None, 0), CFG, counters):
        batches.append(batch)
        offsets.append(offset)
    return pa.Table.from_batches(batches), counters, offsets


def _decoded(t: pa.Table) -> pa.Table:
    """The table's values: string columns arrive dictionary-encoded, with one dictionary per parsed block."""
    cols = [c.cast(c.type.value_type) if pa.types.is_dictionary(c.type) else c for c in t.columns]
    return pa.table(cols, names=t.column_names)


@pytest.mark.parametrize("read_bytes", [16, 64, 1000])
def test_many_small_blocks_give_the_same_rows_in_the_same_order(tmp_path, monkeypatch, read_bytes):
    path = _write(tmp_path)
    whole, whole_counts, whole_offsets = _read_all(path)  # one block: the default 16 MiB reads
    _set_limits(monkeypatch, read_bytes)
    small, small_counts, small_offsets = _read_all(path)
    assert whole.num_rows == 398
    assert whole_counts == small_counts == {pio.MALFORMED_LINES: 2}
    assert _decoded(small).equals(_decoded(whole))
    assert small_offsets[-1] + 7 >= 398 and whole_offsets == list(range(0, 398, 7))
    assert not _prefetch_threads()


class _FailingStream:
    """A file object that fails after ``fail_after`` reads and records any use after close."""

    def __init__(self, data: bytes, chunk_reads_before_failure: int):
        self._data, self._pos = data, 0
        self.reads = 0
        self.fail_after = chunk_reads_before_failure
        self.closed = False
        self.used_after_close = False

    def read(self, n: int = -1) -> bytes:
        if self.closed:
            self.used_after_close = True
            raise ValueError("read of a closed file")
        self.reads += 1
        if self.reads > self.fail_after:
            raise OSError("connection reset while reading u123,secret-value")
        n = len(self._data) - self._pos if n < 0 else n
        out = self._data[self._pos:self._pos + n]
        self._pos += len(out)
        return out

    def close(self) -> None:
        self.closed = True


def _patch_stream(monkeypatch: pytest.MonkeyPatch, stream: Any) -> None:
    monkeypatch.setattr(pio, "open_input", lambda path: stream)


def test_a_read_error_mid_file_reaches_the_caller_after_the_earlier_batches(tmp_path, monkeypatch):
    data = _write(tmp_path).read_bytes()
    _set_limits(monkeypatch, 256)
    stream = _FailingStream(data, chunk_reads_before_failure=5)
    _patch_stream(monkeypatch, stream)
    got = []
    with pytest.raises(InputDataError) as err:
        for batch, _offset in iter_record_batches((0, "in.csv", None, 0), CFG, {}):
            got.append(batch)
    assert "OSError" in str(err.value) and "secret" not in str(err.value)
    # the rows before the failing read arrived, in file order, and nothing after it
    ids = pa.Table.from_batches(got).column("user_id").to_pylist()
    assert 0 < len(ids) < 398
    assert ids == [b"u%d" % i for i in range(400) if i not in (17, 250)][:len(ids)]
    assert stream.closed and not stream.used_after_close
    assert not _prefetch_threads()


def test_a_caller_that_stops_early_leaves_no_thread_and_the_file_closed(tmp_path, monkeypatch):
    data = _write(tmp_path).read_bytes()
    _set_limits(monkeypatch, 64)
    stream = _FailingStream(data, chunk_reads_before_failure=10**6)
    _patch_stream(monkeypatch, stream)
    gen = iter_record_batches((0, "in.csv", None, 0), CFG, {})
    first, _ = next(gen)
    assert first.num_rows >= 1
    gen.close()
    assert stream.closed and not stream.used_after_close
    reads = stream.reads
    assert reads < len(data) // 64  # it stopped reading, well before the end of the file
    assert not _prefetch_threads()


def test_a_stage_over_the_reader_stopped_early_closes_the_reader_and_leaves_no_thread(tmp_path):
    """The release's read DoFn runs checking, hashing and pre-bounding in a second Prefetch stage over the reader
    (``pipelines.transforms._ReadBatches``): leaving it early must close the reader (its file and its own thread)
    before the ``with`` block ends, not whenever the garbage collector gets to it."""
    path = _write(tmp_path)
    closed: list[bool] = []

    def stage():
        try:
            for batch, _offset in iter_record_batches((0, str(path), None, 0), CFG, {}):
                yield batch.num_rows
        finally:
            closed.append(True)

    with pio.Prefetch(stage(), name="dpops-prepare") as items:
        assert next(items) == 7
    assert closed == [True]
    assert not _prefetch_threads()
    assert not [t for t in threading.enumerate() if t.name == "dpops-prepare" and t.is_alive()]
    del items


def test_blocks_parsed_side_by_side_give_the_rows_and_counts_of_one_at_a_time(tmp_path, monkeypatch):
    """Blocks are parsed PARSE_THREADS at a time, each with its own line counters: the rows, their order and the
    malformed-line count are those of a serial parse, at any number of threads, and no parse thread stays."""
    path = _write(tmp_path)
    _set_limits(monkeypatch, 64)
    results = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(pio, "PARSE_THREADS", threads)
        table, counts, offsets = _read_all(path)
        results.append((_decoded(table), counts, offsets))
        assert not _prefetch_threads()
    assert all(r[0].equals(results[0][0]) and r[1:] == results[0][1:] for r in results)
    assert results[0][1] == {pio.MALFORMED_LINES: 2} and results[0][0].num_rows == 398


def test_in_order_keeps_the_order_raises_at_its_item_and_leaves_no_thread():
    """``in_order``: results in the items' order whatever order the calls finish in; an exception at its item's
    place, after the results before it; closing it early stops its threads."""
    import time

    def slow_first(i: int) -> int:
        time.sleep(0.02 if i % 3 == 0 else 0)
        if i == 7:
            raise ValueError("item 7")
        return i * i

    got = []
    with pytest.raises(ValueError, match="item 7"):
        for v in pio.in_order(slow_first, iter(range(20)), 3):
            got.append(v)
    assert got == [i * i for i in range(7)]
    gen = pio.in_order(slow_first, iter(range(5)), 2)
    assert next(gen) == 0
    gen.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("dpops-csv-parse") and t.is_alive()]
