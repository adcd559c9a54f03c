"""The release pipeline as composite PTransforms a Beam user can put in their own pipeline.

    items = [WorkItem(...), ...]                        # pipelines.io.work_items(paths, fmt)
    read = p | ReadPrivateBatches(ctx, items)           # {"rows", "names", "stats"}
    bounded = read["rows"] | BoundContributions(ctx.agg.l0, ctx.agg.linf)
    agg = bounded | AggregatePerPartition(ctx.agg, ctx.read.n_shards)   # {"partials", "stats"}
    noisy = {"partials": agg["partials"], "names": read["names"]} | SelectPartitionsAndNoise(ctx)
    files = noisy | WriteShards(parts_dir, ctx.read.n_shards)
    (read["stats"], agg["stats"]) | RunStats()         # Beam metrics; collect_stats(result) in the driver

Element shapes are in ``pipelines.elements`` and written after each step below. The privacy-relevant
decisions live in plain numpy functions (``pipelines.io.prepare_batch``, ``pipelines.bounding``,
``pipelines.aggregate.select_and_noise``) that the auditor runs too; these transforms only move
batches between them.

Streaming bounding (issue 10). ``BoundContributions`` is a ``CombinePerKey`` over unit-hash buckets
whose accumulator holds only bounded rows: at most L0 pairs x Linf rows per unit, plus a buffer that
is compacted (re-bounded) whenever it doubles, so its cost is amortised and no worker ever holds a
whole bucket. Beam lifts the combiner (partial combine before the shuffle, merge after), which is
exact because the bound is mergeable (``pipelines.bounding`` module doc): the result does not depend
on the number of buckets, bundle sizes, worker count, arrival order or merge order.
"""

from __future__ import annotations

import functools
import os
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np

from dpops.errors import DEBUG_ENV, DpopsError, InternalError
from pipelines import fs
from pipelines.bounding import (
    AggregationSpec,
    aggregate_bucket,
    bound_rows,
    merge_partials,
)
from pipelines.elements import (
    NoisyShard,
    PartitionNames,
    RowBlock,
    Rows,
    ShardFile,
    ShardPartial,
    WorkItem,
)
from pipelines.io import ReadDigest

# A combiner buffer is re-bounded when it exceeds max(this, 2 x its bounded size): with 256 keys at most
# ~4M buffered rows (~200 MB) per worker beyond the bounded rows themselves, whatever the input size.
COMPACT_MIN_ROWS = 16_384
EMPTY_SHARD = b"dpops: empty shard\n"  # an empty shard on an object store (a Parquet file starts with PAR1)

# --------------------------------------------------------------------------- error hygiene

_DISK_ERRNOS = (28, 30, 122)  # ENOSPC, EROFS, EDQUOT


def _disk_errno(exc: BaseException) -> int | None:
    """The errno of an OSError about the disk (full, read-only, quota), as the OS or pyarrow's writer reports
    it (pyarrow keeps only the OS's words in its text); None for any other exception."""
    if not isinstance(exc, OSError):
        return None
    if exc.errno in _DISK_ERRNOS:
        return int(exc.errno)
    return next((code for code in _DISK_ERRNOS if os.strerror(code) in str(exc)), None)


def _withhold_data_in_errors(process):
    """Wrap a DoFn's ``process`` so no foreign exception (pyarrow, numpy, a bug) leaves it with its text.

    Beam logs a failing DoFn's exception at ERROR itself (``apache_beam.runners.common``) and re-raises it
    wrapped with the original text, before dpops can see it; such text may quote a cell or a whole input
    line. dpops's own errors are written without data and pass unchanged; anything else becomes an
    ``InternalError`` naming only its class and code location, ``from None`` so no chained text follows.
    ``DPOPS_DEBUG=1`` keeps the original (a trusted terminal only).
    """

    @functools.wraps(process)
    def wrapper(self, *args, **kwargs):
        try:
            yield from process(self, *args, **kwargs)
        except DpopsError:
            raise
        except Exception as exc:
            if os.environ.get(DEBUG_ENV):
                raise
            code = _disk_errno(exc)
            if code is not None:
                # A full or read-only disk: dpops.release.computation makes it a StorageError (exit 6). Raised
                # anew with the OS's words only: the original text (a path, whatever else an OSError quotes) is
                # withheld like any other, since Beam logs it before dpops sees it.
                raise OSError(code, os.strerror(code)) from None
            last = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
            where = f" at {Path(last.filename).name}:{last.lineno}" if last else ""
            raise InternalError(f"internal error in {type(self).__name__}: {type(exc).__name__}{where} (a bug, "
                                f"please report it; the error text is withheld because it may quote input data, "
                                f"{DEBUG_ENV}=1 shows it on a trusted terminal)") from None

    return wrapper


withhold_data_in_errors = _withhold_data_in_errors  # the public name, for other pipelines' DoFns


def _add(total: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    for k, v in more.items():
        total[k] = total.get(k, 0) + int(v)
    return total


def concat_rows(chunks: list[Rows]) -> Rows:
    if len(chunks) == 1:
        return chunks[0]
    return {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}


def split_by_key(rows: Rows, n_keys: int, column: str = "u") -> Iterator[tuple[int, Rows]]:
    """Rows grouped by key = hash(``column``) mod n_keys: by default the unit, so all of one unit's rows share one
    key (``column="p"``: all of one partition's rows, ``pipelines.tuning``)."""
    key = ((rows[column] >> np.uint64(40)) % np.uint64(n_keys)).astype(np.uint16 if n_keys <= 1 << 16 else np.int64)
    order = np.argsort(key, kind="stable")  # a radix sort for 16-bit keys: O(n)
    sorted_key = key[order]
    bounds = np.r_[0, np.flatnonzero(np.diff(sorted_key)) + 1, len(order)]
    # One gather per column, then each key's rows are a contiguous slice of it, copied (a memcpy): a gather
    # per key and column cost ~1,500 random-access gathers per batch. Copied, not views: a view would keep the
    # whole batch alive until every key's combiner had compacted it away. The rows and their order within a
    # key are the same as before.
    grouped = {k: v[order] for k, v in rows.items()}
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        if hi > lo:
            yield int(sorted_key[lo]), {k: v[lo:hi].copy() for k, v in grouped.items()}


def shard_of(phash: np.ndarray, n_shards: int) -> np.ndarray:
    return ((phash >> np.uint64(40)) % np.uint64(n_shards)).astype(np.int64)


def shard_name(shard: int, n_shards: int) -> str:
    """Deterministic shard file name: every shard is written, so the driver can check completeness."""
    return f"shard-{shard:05d}-of-{n_shards:05d}.parquet"


# --------------------------------------------------------------------------- read


class _ReadBatches(beam.DoFn):
    def __init__(self, ctx):
        self.ctx = ctx  # release_pipeline.PipelineContext: picklable configuration, never the key
        self._source = None
        self._salt: tuple[int, int] | None = None
        self._digest_salt: bytes | None = None

    def setup(self):
        # The worker resolves the key itself from the run's key reference (checked against the key id).
        self._source = self.ctx.randomness.source()
        self._salt = self.ctx.randomness.pair_salt(self._source)
        self._digest_salt = self.ctx.randomness.digest_salt(self._source)

    @_withhold_data_in_errors
    def process(self, item: WorkItem):
        import pipelines.io as pio  # module attribute lookups: tests hook pio.prepare_batch

        cfg = self.ctx.read
        item = WorkItem(*item)
        read_stats: dict[str, int] = {}  # the reader's own counters (malformed lines), written by its thread
        stats: dict[str, int] = {}
        raw = (item.file_index, item.path, item.row_group, item.row_offset)
        digest = pio.ReadDigest()  # the bytes read, for the driver's after-read input check (CSV only)

        def prepared() -> Iterator[tuple[Rows, tuple[np.ndarray, list[list[Any]]], dict[str, int]]]:
            for seq, (batch, offset) in enumerate(pio.iter_record_batches(raw, cfg, read_stats, digest)):
                # Linf priorities: a stream per (file, row group, batch), independent of runner order
                rng = self._source.child("bounding", item.file_index, -1 if item.row_group is None else item.row_group,
                                         seq)
                rows, names, st = pio.prepare_batch(batch, item.file_index, offset, cfg, rng, pair_salt=self._salt)
                yield rows, names, dict(st, rows_to_bounding=len(rows["u"]))

        public = self.ctx.public_names is not None

        def pre_bounded() -> Iterator[tuple[list[tuple[int, RowBlock]], list[tuple[int, PartitionNames]],
                                             dict[str, int]]]:
            with pio.Prefetch(prepared(), name="dpops-prepare") as checked:
                for rows, (uniq, values), st in checked:
                    rows, dropped = bound_rows(rows, self.ctx.agg.l0, self.ctx.agg.linf)  # pre-bound: cuts the shuffle
                    blocks = [(key, RowBlock.of(chunk)) for key, chunk in split_by_key(rows, cfg.n_buckets)]
                    names: list[tuple[int, PartitionNames]] = []
                    if len(uniq) and not public:
                        shards = shard_of(uniq, cfg.n_shards)
                        for s in np.unique(shards):
                            sel = np.flatnonzero(shards == s)
                            names.append((int(s), PartitionNames(uniq[sel], [[col[i] for i in sel] for col in values])))
                    yield blocks, names, _add(st, dropped)

        # Three stages, each one batch ahead of the next: the reader parses block k+3 (its own Prefetch), one
        # thread checks and hashes batch k+2, another pre-bounds batch k+1 and splits it by key, and this
        # thread hands batch k to Beam (numpy, pandas and Arrow release the GIL in the heavy parts). Speed
        # only: each stage runs its functions on the same batches in the same order in one thread, and the
        # priorities are drawn in the checking stage from a stream per batch, so every row's priorities, hashes
        # and bound are what a serial loop gives (tests/test_pipeline_bounding.py,
        # tests/test_reader_prefetch.py); an exception is re-raised here, after the batches before it. Leaving
        # early closes ``pre_bounded`` in its thread, which leaves the inner stage's ``with`` and so joins it
        # (and closes the reader) first.
        with pio.Prefetch(pre_bounded(), name="dpops-pre-bound") as batches:
            for blocks, names, st in batches:
                _add(stats, st)
                yield from blocks
                for shard_names in names:
                    yield beam.pvalue.TaggedOutput("names", shard_names)
        assert self._digest_salt is not None  # setup ran
        _add(stats, read_digest_counters(item.file_index, digest, self._digest_salt))
        yield beam.pvalue.TaggedOutput("stats", _add(stats, read_stats))


class ReadPrivateBatches(beam.PTransform):
    """PBegin -> {"rows": (K, RowBlock), "names": (S, PartitionNames), "stats": dict}.

    Reads each work item (a CSV file or a Parquet row group, local or any Beam filesystem URI),
    checks and hashes its rows (``prepare_batch``: malformed rows and rows outside the public
    partitions dropped), draws the rows' priorities, pre-bounds each batch and keys the rows by
    unit-hash bucket."""

    def __init__(self, ctx, items: list[WorkItem]):
        super().__init__()
        self.ctx = ctx
        self.items = [WorkItem(*it) for it in items]

    def expand(self, pbegin):
        out = (
            pbegin
            | "WorkItems" >> beam.Create(self.items)                     # WorkItem (reshuffled to workers)
            | "ReadCheckHash" >> beam.ParDo(_ReadBatches(self.ctx)).with_outputs("names", "stats", main="rows")
        )
        # rows: (K, RowBlock) pre-bounded per batch; names: (S, PartitionNames); stats: dict[str, int]
        return {"rows": out.rows, "names": out.names, "stats": out.stats}


# --------------------------------------------------------------------------- bound


class _Buffer:
    """Accumulator of ``BoundRowsFn``: row chunks of one key, ``n`` rows in all, ``floor`` of them bounded,
    and the rows its compactions dropped by reason (each dropped row is counted in exactly one
    compaction, and merges add the counts, so the internal counters stay exact)."""

    __slots__ = ("chunks", "dropped_l0", "dropped_linf", "floor", "n")

    def __init__(self, chunks: list[Rows] | None = None, n: int = 0, floor: int = 0,
                 dropped_l0: int = 0, dropped_linf: int = 0) -> None:
        self.chunks = chunks or []
        self.n = n
        self.floor = floor
        self.dropped_l0 = dropped_l0
        self.dropped_linf = dropped_linf

    def __reduce__(self):
        return (_Buffer, (self.chunks, self.n, self.floor, self.dropped_l0, self.dropped_linf))


class BoundRowsFn(beam.CombineFn):
    """Mergeable L0 / Linf bounding of the rows of one key (``pipelines.bounding.bound_rows``).

    Output: (bounded rows, {"rows_dropped_l0": .., "rows_dropped_linf": ..} dropped inside the combiner)."""

    def __init__(self, l0: int, linf: int, compact_min: int | None = None):
        self.l0, self.linf = l0, linf
        self.compact_min = COMPACT_MIN_ROWS if compact_min is None else compact_min

    def create_accumulator(self) -> _Buffer:
        return _Buffer()

    def _maybe_compact(self, acc: _Buffer) -> _Buffer:
        if acc.n > max(self.compact_min, 2 * acc.floor):
            return self.compact(acc)
        return acc

    def add_input(self, acc: _Buffer, block: RowBlock) -> _Buffer:
        rows = block.rows() if isinstance(block, RowBlock) else block
        acc.chunks.append(rows)
        acc.n += len(rows["u"])
        return self._maybe_compact(acc)

    def merge_accumulators(self, accs: Iterable[_Buffer]) -> _Buffer:
        out = _Buffer()
        for a in accs:
            out.chunks.extend(a.chunks)
            out.n += a.n
            out.floor += a.floor
            out.dropped_l0 += a.dropped_l0
            out.dropped_linf += a.dropped_linf
            out = self._maybe_compact(out)
        return out

    def compact(self, acc: _Buffer) -> _Buffer:
        if not acc.chunks or (len(acc.chunks) == 1 and acc.floor == acc.n):
            return acc
        rows, st = bound_rows(concat_rows(acc.chunks), self.l0, self.linf)
        n = len(rows["u"])
        return _Buffer([rows], n, n, acc.dropped_l0 + st["rows_dropped_l0"], acc.dropped_linf + st["rows_dropped_linf"])

    def extract_output(self, acc: _Buffer) -> tuple[Rows, dict[str, int]]:
        # The bounded rows themselves: the next step is fused with this one on every runner we know, so
        # no coder runs; if one does, Beam pickles the dict of arrays.
        acc = self.compact(acc)
        return (acc.chunks[0] if acc.chunks else {},
                {"rows_dropped_l0": acc.dropped_l0, "rows_dropped_linf": acc.dropped_linf})


class BoundContributions(beam.PTransform):
    """(K, RowBlock) -> (K, (Rows, dropped counters)): each unit's rows bounded to L0 pairs x Linf rows.

    A ``CombinePerKey`` with combiner lifting: partial bounds before the shuffle, merged after.
    Exact whatever the keys, bundles, workers or order (the bound is mergeable)."""

    def __init__(self, l0: int, linf: int, compact_min: int | None = None):
        super().__init__()
        self.l0, self.linf = l0, linf
        self.compact_min = COMPACT_MIN_ROWS if compact_min is None else compact_min

    def expand(self, pcoll):
        # (K, RowBlock) -> (K, (Rows kept by the L0 / Linf bound, {rows_dropped_l0, rows_dropped_linf}))
        return pcoll | "BoundPerUnitBucket" >> beam.CombinePerKey(BoundRowsFn(self.l0, self.linf, self.compact_min))


# --------------------------------------------------------------------------- aggregate


class _Aggregate(beam.DoFn):
    """Aggregates the bounded rows of many keys at once: rows are buffered across the bundle (up to
    ``flush_rows``) and summed in one vectorised pass, so the per-key overhead of small keys vanishes.
    Exact: all accumulators are integers, and the keys hold disjoint units (re-bounding is a no-op)."""

    def __init__(self, agg: AggregationSpec, n_shards: int, flush_rows: int = 1 << 20):
        self.agg, self.n_shards, self.flush_rows = agg, n_shards, flush_rows
        self._buf: list[Rows] = []
        self._n = 0

    def start_bundle(self):
        self._buf, self._n = [], 0

    @_withhold_data_in_errors
    def process(self, element):
        _key, (rows, dropped) = element
        if any(dropped.values()):
            yield beam.pvalue.TaggedOutput("stats", dict(dropped))
        if not rows or not len(rows["u"]):
            return
        self._buf.append(rows)
        self._n += len(rows["u"])
        if self._n >= self.flush_rows:
            yield from self._flush()

    @_withhold_data_in_errors
    def _flush(self):
        if not self._buf:
            return
        rows = concat_rows(self._buf)
        self._buf, self._n = [], 0
        parts, acc, stats = aggregate_bucket(rows, self.agg, bounded=True)  # BoundContributions bounded them
        shards = shard_of(parts, self.n_shards)
        for s in np.unique(shards):
            sel = np.flatnonzero(shards == s)
            yield int(s), ShardPartial.of(0, parts[sel], {k: v[sel] for k, v in acc.items()})
        yield beam.pvalue.TaggedOutput("stats", {k: v for k, v in stats.items() if k in ("rows_kept", "values_clamped")})

    def finish_bundle(self):
        from apache_beam.transforms.window import GlobalWindow
        from apache_beam.utils.timestamp import MIN_TIMESTAMP
        from apache_beam.utils.windowed_value import WindowedValue

        for out in self._flush():  # the release is one batch in the global window
            if isinstance(out, beam.pvalue.TaggedOutput):
                yield beam.pvalue.TaggedOutput(out.tag, WindowedValue(out.value, MIN_TIMESTAMP, [GlobalWindow()]))
            else:
                yield WindowedValue(out, MIN_TIMESTAMP, [GlobalWindow()])


class AggregatePerPartition(beam.PTransform):
    """(K, (Rows, counters)) bounded -> {"partials": (S, ShardPartial), "stats": dict}: clamped, exact integer
    per-partition accumulators of each bucket, keyed by the noise shard of the partition."""

    def __init__(self, agg: AggregationSpec, n_shards: int):
        super().__init__()
        self.agg, self.n_shards = agg, n_shards

    def expand(self, pcoll):
        out = pcoll | "ClampAndSum" >> beam.ParDo(_Aggregate(self.agg, self.n_shards)).with_outputs("stats", main="partials")
        # partials: (S, ShardPartial); stats: {"rows_kept", "values_clamped"}
        return {"partials": out.partials, "stats": out.stats}


# --------------------------------------------------------------------------- select + noise


def empty_acc(agg: AggregationSpec) -> dict[str, np.ndarray]:
    acc: dict[str, np.ndarray] = {}
    for sfx in agg.set_suffixes:  # "" alone without per-metric bound sets (pipelines.bounding.AggregationSpec)
        acc["count" + sfx] = np.zeros(0, np.int64)
        acc["unit_count" + sfx] = np.zeros(0, np.int64)
    for name, *_ in agg.sums:
        acc[name] = np.zeros(0, np.int64)  # exact fixed-point sums (pipelines.bounding)
    for name, _c, _lo, _hi, bins in agg.hists:
        acc[name] = np.zeros((0, bins + 1), np.int64)
    for name, _c, k in agg.cats:
        acc[name] = np.zeros((0, k), np.int64)
    return acc


class SelectNoise(beam.DoFn):
    def __init__(self, ctx):
        self.ctx = ctx
        self._source = None

    def setup(self):
        self._source = self.ctx.randomness.source()

    @_withhold_data_in_errors
    def process(self, element):
        import pyarrow as pa

        from pipelines.aggregate import select_and_noise

        shard, items = element
        partials, names = [], {}
        for tag, it in items:
            if tag == "agg":
                sp = ShardPartial(*it)
                partials.append((sp.bucket, *sp.unpack()))
            elif tag == "names":
                pn = PartitionNames(*it)
                for j, h in enumerate(pn.hashes):
                    names[int(h)] = tuple(col[j] for col in pn.values)
        partials.sort(key=lambda t: t[0])  # bucket order (all sums are exact integers: order-free anyway)
        parts, acc = merge_partials([(p, a) for _, p, a in partials])
        if not acc:
            acc = empty_acc(self.ctx.agg)
        pub = None
        if self.ctx.public_names is not None:
            all_pub = np.array(sorted(self.ctx.public_names), dtype=np.uint64)
            pub = all_pub[shard_of(all_pub, self.ctx.read.n_shards) == shard]
        cols = select_and_noise(shard, parts, acc, names, self.ctx.plan, pub, self.ctx.public_names, self._source)
        table = pa.table({k: (v if isinstance(v, (list, pa.Array)) else pa.array(v)) for k, v in cols.items()})
        yield NoisyShard(int(shard), table)


class SelectPartitionsAndNoise(beam.PTransform):
    """{"partials": (S, ShardPartial), "names": (S, PartitionNames)} -> NoisyShard, one per shard.

    Merges the partials of each shard (exact integers), selects partitions (private selection or the
    public list), draws noise per shard from the run's randomness and post-processes. Every shard
    yields one element, also when it has no data, so every shard file is written."""

    def __init__(self, ctx):
        super().__init__()
        self.ctx = ctx

    def expand(self, inputs):
        p = inputs["partials"].pipeline
        seeds = p | "ShardSeeds" >> beam.Create([(s, ("seed", None)) for s in range(self.ctx.read.n_shards)],
                                                reshuffle=False)
        partials = inputs["partials"] | "TagPartials" >> beam.MapTuple(lambda s, x: (s, ("agg", x)))
        names = inputs["names"] | "TagNames" >> beam.MapTuple(lambda s, x: (s, ("names", x)))
        return (
            (partials, names, seeds)
            | "FlattenShardInputs" >> beam.Flatten()                    # (S, (tag, ShardPartial | PartitionNames | None))
            | "GroupByShard" >> beam.GroupByKey()                       # (S, [...])
            | "SelectNoise" >> beam.ParDo(SelectNoise(self.ctx))       # NoisyShard
        )


# --------------------------------------------------------------------------- write


class _WriteShard(beam.DoFn):
    def __init__(self, parts_dir: str, n_shards: int):
        self.parts_dir, self.n_shards = parts_dir, n_shards

    @_withhold_data_in_errors
    def process(self, shard: NoisyShard):
        import pyarrow as pa
        import pyarrow.parquet as pq

        shard = NoisyShard(*shard)
        path = fs.join(self.parts_dir, shard_name(shard.shard, self.n_shards))
        # A shard without released partitions: an empty file (no data page on a small disk), or on an
        # object store (whose multipart upload cannot complete with no part) a fixed marker.
        data = EMPTY_SHARD if fs.scheme(path) in fs.OBJECT_STORE_SCHEMES else b""
        if shard.table.num_rows:
            buf = pa.BufferOutputStream()
            pq.write_table(shard.table, buf)
            data = buf.getvalue().to_pybytes()
        fs.write_bytes(path, data)
        yield ShardFile(shard.shard, path, shard.table.num_rows)


class WriteShards(beam.PTransform):
    """NoisyShard -> ShardFile: ``<parts_dir>/shard-NNNNN-of-MMMMM.parquet`` through Beam's filesystems
    (temp name + rename, or one atomic object PUT: ``pipelines.fs``). Every shard is written; a shard
    with no released partition is an empty (zero-byte) file, a complete one is a Parquet file. A
    partial write never appears under the final name, so neither can be mistaken for the other."""

    def __init__(self, parts_dir: str, n_shards: int):
        super().__init__()
        self.parts_dir, self.n_shards = parts_dir, n_shards

    def expand(self, pcoll):
        return pcoll | "WriteShardFiles" >> beam.ParDo(_WriteShard(self.parts_dir, self.n_shards))  # ShardFile


# --------------------------------------------------------------------------- stats


class SumStats(beam.CombineFn):
    def create_accumulator(self):
        return {}

    def add_input(self, acc, x):
        return _add(acc, x)

    def merge_accumulators(self, accs):
        out: dict[str, int] = {}
        for a in accs:
            _add(out, a)
        return out

    def extract_output(self, acc):
        return acc


STATS_NAMESPACE = "dpops.internal_counters"
STATS_REPORTED = "_reported"  # 1 per completed report: tells the driver the counters arrived (and how often)


class _ReportStats(beam.DoFn):
    """The one summed counter dict -> Beam metric counters (namespace ``STATS_NAMESPACE``), read by the driver.

    Privacy reason (issue 19 item 8): the counters are EXACT counts of the private data (with one public
    partition, published count - rows_kept is the noise). Written as a file next to the shards they
    reached the object store (``staged/.../_parts/``), where a killed attempt left them for anyone who
    can list the bucket. As metrics they travel over the runner's job API to the driver only, which
    writes them to the private state directory; no worker ever writes them anywhere."""

    def process(self, stats: dict[str, Any]):
        from apache_beam.metrics import Metrics

        for name, value in sorted(stats.items()):
            Metrics.counter(STATS_NAMESPACE, name).inc(int(value))
        Metrics.counter(STATS_NAMESPACE, STATS_REPORTED).inc(1)
        yield len(stats)


class RunStats(beam.PTransform):
    """(dict, dict, ...) -> summed internal counters, reported as Beam metrics (``collect_stats`` reads them)."""

    def expand(self, pcolls):
        return (
            pcolls
            | "FlattenStats" >> beam.Flatten()                          # dict[str, int]
            | "SumStats" >> beam.CombineGlobally(SumStats())            # one dict
            | "ReportStats" >> beam.ParDo(_ReportStats())               # metric counters, nothing written
        )


READ_DIGEST = "read_digest"  # counter names "read_digest/<file index>/size" and ".../w0".."/w7" (the tag, 32 bits each)
_DIGEST_WORDS = 8


def read_digest_counters(file_index: int, digest: ReadDigest, salt: bytes) -> dict[str, int]:
    """A complete ``ReadDigest`` of input file ``file_index`` as internal counters (nothing for an incomplete one):
    its salted tag (``dpops.inputs.read_digest_tag``, never the sha256 itself) in 32-bit words, and the size.

    It rides with the run's counters because they already travel where it must go: from the workers to the
    driver over the runner's metrics (``RunStats``), committed once per bundle and divided by the report count
    after a retry (``collect_stats``). The driver takes it out of them (``split_read_digests``) before they are
    written anywhere."""
    from dpops.inputs import read_digest_tag

    if not digest.complete:
        return {}
    hexd = read_digest_tag(salt, digest.size, digest.hexdigest())
    out = {f"{READ_DIGEST}/{file_index}/size": digest.size}
    for w in range(_DIGEST_WORDS):
        out[f"{READ_DIGEST}/{file_index}/w{w}"] = int(hexd[8 * w:8 * w + 8], 16)
    return out


def split_read_digests(counters: dict[str, int]) -> tuple[dict[str, int], dict[int, tuple[int, str]]]:
    """(the counters without the read digests, {file index: (size, tag hex)} of every complete digest).

    A file whose digest words arrived incomplete or out of range (a runner that lost or doubled a counter) has
    no entry, so the driver falls back to hashing that file again; it is never taken as a match."""
    rest: dict[str, int] = {}
    parts: dict[int, dict[str, int]] = {}
    for name, value in counters.items():
        head, _, tail = name.partition("/")
        if head != READ_DIGEST:
            rest[name] = value
            continue
        index, _, field_name = tail.partition("/")
        parts.setdefault(int(index), {})[field_name] = int(value)
    digests: dict[int, tuple[int, str]] = {}
    for index, got in parts.items():
        words = [got.get(f"w{w}") for w in range(_DIGEST_WORDS)]
        if "size" not in got or any(w is None or not 0 <= w < (1 << 32) for w in words):
            continue
        digests[index] = (got["size"], "".join(f"{w:08x}" for w in words if w is not None))
    return rest, digests


def collect_stats(result: Any) -> dict[str, int] | None:
    """The internal counters ``RunStats`` reported, from a finished pipeline's result (the driver side).

    Committed values where the runner has them (a retried bundle counts once), else attempted ones; if
    the runner reports the one report more than once (attempted metrics after a retry), every counter is
    divided by that count (each attempt reports the same sums in full). None when nothing was reported."""
    from apache_beam.metrics.metric import MetricsFilter

    found: dict[str, int] = {}
    for c in result.metrics().query(MetricsFilter().with_namespace(STATS_NAMESPACE))["counters"]:
        value = c.committed if c.committed is not None else c.attempted
        if value is not None:
            found[c.key.metric.name] = found.get(c.key.metric.name, 0) + int(value)
    times = found.pop(STATS_REPORTED, 0)
    if times < 1:
        return None
    if times > 1:
        found = {k: v // times for k, v in found.items()}
        found["internal_counter_reports"] = times
    return found
