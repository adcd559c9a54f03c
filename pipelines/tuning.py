"""A flagged private ``dpops tune`` read as a Beam pipeline: only per-partition statistics reach the driver.

``dpops tune --i-understand-this-reads-private-data`` (``dpops.release.tuning.tune_private``) scores candidates
from statistics of the sample (``dpops.analysis.tune_stats``); this module computes them where the data is:

    p | TuneStatisticsTransform(request)

``expand`` is four steps, over the same reader and bounding code as the driver path (``dpops.analysis.tuning``):

1. ``_ReadForTune``: each work item (a CSV file or a Parquet row group) read and checked by the release's own
   ``pipelines.io.iter_record_batches`` / ``prepare_batch`` with the driver path's streams (``read_stream`` of
   the ``--seed``, ``batch_stream`` per (item, batch), one pair salt), each row given its position in the read
   (``pos``: item index, then row), split by unit-hash bucket and written to the private staging location.
2. ``_RankBucket``: per unit bucket (whole units), its rows in read order ranked by the bounding's orders
   (``tune_stats.rank_rows``: ``pipelines.bounding.contribution_ranks``, a unit's ranks depend on its own rows
   only, so they equal the driver's); the bucket's unit counts (``unit_counts``, integers) go to the sum, its
   ranked rows are split by partition-hash bucket and written back.
3. ``_StatsBucket``: per partition bucket (whole partitions), its rows sorted by ``pos`` and reduced by
   ``tune_stats.partition_statistics`` (the driver path's function: each partition's sums add the same rows
   in the same order); the statistics are written as one .npz, the scratch files removed.
4. The unit counts summed (``CombineGlobally``) and written; the statistics files listed.

The driver reads the counts and the statistics files (``tune_statistics``) and merges the partitions in order
of first appearance (``merge_partition_statistics``), which gives the driver path's statistics bit for bit.

Privacy. The statistics are exact functions of private data, not DP, and so are the scratch files: both live
only under the caller's private staging location (a 0700 temporary directory, or a private prefix the
operator names for workers on other machines), the files are removed by the step that read them and the
whole location by the caller; nothing here logs a value. A DoFn's foreign error is reported by class and
location only (``withhold_data_in_errors``). The read's randomness is the ``--seed`` test stream or, without a
seed, fresh OS randomness per worker (the salt shipped by the driver): it only chooses which rows bounding
keeps, as a release's, and nothing drawn here is noise.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

import apache_beam as beam
import numpy as np

from dpops.analysis.tune_stats import (
    add_unit_counts,
    empty_unit_counts,
    merge_partition_statistics,
    partition_statistics,
    rank_rows,
    unit_counts,
)
from dpops.analysis.tuning import TuneStatistics, batch_stream, read_stream
from dpops.release.pipeline_seam import TuneStatisticsRequest
from pipelines import fs
from pipelines.scratch import Columns, concat_columns, pack_columns, unpack_columns
from pipelines.transforms import split_by_key, withhold_data_in_errors

UNITS_FILE = "units.json"
INDEX_FILE = "statistics.json"
POS_SHIFT = 40  # pos = (work item index << 40) + row within the item: 2^40 rows per item









def _by_pos(rows: Columns) -> Columns:
    order = np.argsort(rows["pos"], kind="stable")
    return {k: v[order] for k, v in rows.items()}


class _ReadForTune(beam.DoFn):
    """(item index, WorkItem) -> (unit bucket, scratch file): the driver path's read, with each row's position."""

    def __init__(self, request: TuneStatisticsRequest):
        self.request = request
        self._rng: Any = None

    def setup(self) -> None:
        self._rng = read_stream(self.request.seed)

    @withhold_data_in_errors
    def process(self, element: tuple[int, tuple[int, str, int | None, int]]) -> Iterator[tuple[int, str]]:
        import pipelines.io as pio  # module attribute lookups, as the release's reader (tests hook them)

        r = self.request
        index, raw = element
        item = (int(raw[0]), str(raw[1]), None if raw[2] is None else int(raw[2]), int(raw[3]))
        held: dict[int, list[Columns]] = {}
        n_kept = 0
        for seq, (batch, offset) in enumerate(pio.iter_record_batches(item, r.read)):
            rows, _, _ = pio.prepare_batch(batch, item[0], offset, r.read, batch_stream(self._rng, item, seq),
                                           pair_salt=r.salt)
            n = len(rows["u"])
            if not n:
                continue
            rows["pos"] = (np.int64(index) << np.int64(POS_SHIFT)) + n_kept + np.arange(n, dtype=np.int64)
            n_kept += n
            for key, chunk in split_by_key(rows, r.n_buckets):
                held.setdefault(key, []).append(chunk)
        for key in sorted(held):
            path = fs.join(r.staging_dir, "_units", f"b{key:05d}", f"i{index}.npz")
            fs.write_bytes(path, pack_columns(concat_columns(held[key])))  # private staging (module doc)
            yield key, path


class _RankBucket(beam.DoFn):
    """(unit bucket, files) -> ("units", counts) and (partition bucket, scratch file): whole units ranked."""

    def __init__(self, request: TuneStatisticsRequest):
        self.request = request

    @withhold_data_in_errors
    def process(self, element: tuple[int, Iterable[str]]) -> Iterator[Any]:
        r = self.request
        bucket, paths = element
        files = sorted(set(paths))
        # the read's order (ties in prio)
        rows = _by_pos(concat_columns([unpack_columns(fs.read_bytes(p)) for p in files]))
        ranked = rank_rows(rows, r.needs.l0_floor, r.needs.linf_floor)
        del rows
        yield beam.pvalue.TaggedOutput("units", unit_counts(ranked, r.needs))
        for key, chunk in split_by_key(ranked, r.n_buckets, column="p"):  # whole partitions per bucket
            path = fs.join(r.staging_dir, "_parts", f"b{key:05d}", f"u{bucket}.npz")
            fs.write_bytes(path, pack_columns(chunk))
            yield key, path
        fs.delete_files(files)


class _StatsBucket(beam.DoFn):
    """(partition bucket, files) -> statistics file: whole partitions, rows in the read's order."""

    def __init__(self, request: TuneStatisticsRequest):
        self.request = request

    @withhold_data_in_errors
    def process(self, element: tuple[int, Iterable[str]]) -> Iterator[str]:
        bucket, paths = element
        files = sorted(set(paths))
        rows = _by_pos(concat_columns([unpack_columns(fs.read_bytes(p)) for p in files]))
        stats = partition_statistics(rows, self.request.needs)
        del rows
        path = fs.join(self.request.staging_dir, "_stats", f"b{bucket:05d}.npz")
        fs.write_bytes(path, pack_columns(stats))  # private staging: exact statistics, not DP
        fs.delete_files(files)
        yield path


class SumUnitCounts(beam.CombineFn):
    """The buckets' unit counts added (integers); no bucket: the counts of no rows."""

    def __init__(self, request: TuneStatisticsRequest):
        self.request = request

    def create_accumulator(self) -> dict[str, list[int]] | None:
        """No bucket counted yet."""
        return None

    def add_input(self, acc: dict[str, list[int]] | None, counts: dict[str, list[int]]) -> dict[str, list[int]]:
        """One bucket's counts added."""
        return counts if acc is None else add_unit_counts(acc, counts)

    def merge_accumulators(self, accs: Iterable[dict[str, list[int]] | None]) -> dict[str, list[int]] | None:
        """Partial sums added."""
        out = None
        for a in accs:
            if a is not None:
                out = a if out is None else add_unit_counts(out, a)
        return out

    def extract_output(self, acc: dict[str, list[int]] | None) -> dict[str, list[int]]:
        """The sum, or the counts of no rows."""
        return empty_unit_counts(self.request.needs) if acc is None else acc


class _WriteJson(beam.DoFn):
    def __init__(self, path: str):
        self.path = path

    @withhold_data_in_errors
    def process(self, doc: Any) -> Iterator[str]:
        fs.write_bytes(self.path, json.dumps(doc).encode("utf-8"))  # private staging
        yield self.path


class TuneStatisticsTransform(beam.PTransform):
    """PBegin -> (unit counts, statistics file paths): see the module docstring."""

    def __init__(self, request: TuneStatisticsRequest):
        super().__init__()
        self.request = request

    def expand(self, pbegin):
        """Read per work item, rank per unit bucket, reduce per partition bucket."""
        r = self.request
        ranked = (pbegin
                  | "WorkItems" >> beam.Create(list(enumerate(r.work_items)))
                  | "ReshuffleItems" >> beam.Reshuffle()
                  | "ReadForTune" >> beam.ParDo(_ReadForTune(r))
                  | "FilesPerUnitBucket" >> beam.GroupByKey()
                  | "RankBucket" >> beam.ParDo(_RankBucket(r)).with_outputs("units", main="parts"))
        units = ranked.units | "SumUnitCounts" >> beam.CombineGlobally(SumUnitCounts(r))
        stats = (ranked.parts
                 | "FilesPerPartitionBucket" >> beam.GroupByKey()
                 | "StatsBucket" >> beam.ParDo(_StatsBucket(r))
                 | "ListStats" >> beam.combiners.ToList())
        return units, stats


def tune_statistics(request: TuneStatisticsRequest) -> TuneStatistics:
    """Run the pass (``dpops.release.pipeline_seam.TUNE_STATISTICS``) and return the sample's statistics.

    The pipeline is made first: it points Beam's FileSystems at the run's options (the S3 endpoint), which
    listing the input's row groups (``work_items``) and reading the statistics back need on this side too."""
    import dataclasses

    from apache_beam.options.pipeline_options import PipelineOptions

    from pipelines.io import work_items

    opts = fs.s3_options(list(request.runner_options))
    units_path, index_path = fs.join(request.staging_dir, UNITS_FILE), fs.join(request.staging_dir, INDEX_FILE)
    with beam.Pipeline(runner=request.runner, options=PipelineOptions(opts)) as p:
        if not request.work_items:
            request = dataclasses.replace(request, work_items=tuple(
                work_items([fs.normalize(request.sample_path)], request.read.format)))
        units, stats = p | "TuneStatistics" >> TuneStatisticsTransform(request)
        _ = units | "WriteUnits" >> beam.ParDo(_WriteJson(units_path))
        _ = stats | "WriteIndex" >> beam.ParDo(_WriteJson(index_path))
    counts = json.loads(fs.read_bytes(units_path).decode("utf-8"))
    paths = json.loads(fs.read_bytes(index_path).decode("utf-8"))
    parts = [unpack_columns(fs.read_bytes(x)) for x in sorted(paths)]
    fs.delete_files([units_path, index_path, *paths])
    if not parts or not int(counts["rows"][0]):
        from dpops.errors import InputDataError

        raise InputDataError(f"tune: no row of {request.sample_path} survives the release's input checks (types, "
                             "nulls, public partitions)")
    return TuneStatistics(merge_partition_statistics(parts), {k: [int(x) for x in v] for k, v in counts.items()})


__all__ = ["SumUnitCounts", "TuneStatisticsTransform", "tune_statistics"]
