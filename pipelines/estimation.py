"""The estimation's private read as a Beam pipeline: public-grid counts per unit bucket, summed on the workers.

A private bound estimation (``dpops.release.estimation``) needs, per mechanism, counts on a public grid: for
quantile/1 (``dpops.analysis.estimate.GridCounts`` / ``ValueCounts``) how many units have at most k
partitions, how many have at most k rows in their largest kept pair, how many kept values lie below each grid
point; for error/1 the exact histograms of ``dpops.analysis.bound_choice`` (units per partition count, pairs
per (partition count, rows), weight per public partition, weight per value cell). This module computes them
where the data is, so the driver never holds a row:

    out = p | EstimationCountsTransform(request)    # out["counts"]: one element, the pass's counts, summed

``expand`` is three steps:

1. ``_ReadForEstimation``: each work item (a CSV file or a Parquet row group) read and checked by the
   release's own ``pipelines.io.iter_record_batches`` / ``prepare_batch``, with the estimation's own streams
   (the driver path's: ``rng.child("estimate", "read")``, one pair salt, a stream per (file, row group,
   batch)), then reduced per batch to what the pass needs (``pairs``: a ``PairTable``; ``values``: the rows
   ``bound_rows`` keeps at (l0, linf), each value replaced by its two cells on the public grid,
   ``value_codes``; ``error``: unit, partition and the estimated columns' values), split by unit-hash bucket
   (``split_by_key``, so all of a unit's rows meet in one bucket) and written to the request's private
   staging location, one file per (work item, bucket); only (bucket, file name) pairs cross the shuffle.
2. ``_CountBucket``: per bucket, its files read, merged and counted with the functions the driver path uses
   (``PairTable.l0_counts`` / ``linf_counts_at``, ``value_counts_of``, ``exact_histograms_of_rows``), then
   the files removed.
3. ``CombineGlobally(SumCounts)`` adds the buckets' counts: every count and histogram cell is a sum over
   units of a function of that unit's own rows, so over disjoint buckets of units the sum equals the counts
   of all rows at once, bit for bit (integers), and the mechanisms choose the same bounds.

Beside the counts, step 1 reports what each CSV file's read consumed (``pipelines.io.ReadDigest``) as a salted
tag (``dpops.inputs.read_digest_tag`` under ``dpops.release.pipeline_seam.estimation_digest_salt``), joined by
``ReadDigestsOf``: the driver's check after the estimation compares them with the run key's fingerprint, so
counts of bytes other than those the key names are never committed (the release's rule, ``ReadDigest``).

Memory. The shuffle of the in-process runners (FnApiRunner, and the job server of the isolated-worker
PortableRunner) holds what crosses it in memory; the first version of this pass sent every kept row
through a ``CombinePerKey`` and held them all ("the values pass still holds the kept rows"). Here the rows
cross through files, so a worker holds one work item's reduced batches (step 1) or one bucket's rows (step
2), about 1/``n_buckets`` of the input, and the driver holds grid-sized counts. A bucket is a set of whole
units, and bounding genuinely needs all of a unit's rows before it can decide which it keeps (a later row
may have a smaller priority); a bucket is the smallest such state.

Privacy. The counts are exact functions of private data, not DP, and so are the scratch files (unit and
partition hashes, row priorities, value cells): both live only under the caller's private staging location
(``dpops.release.estimation.PipelineCounts``: a 0700 temporary directory, or a private prefix the operator
names for workers that cannot see this machine), the files are removed by the bucket that read them and the
whole location by the caller; the counts reach the driver only to be fed to the mechanisms, and no log,
metric or error carries them. Workers resolve the noise key from its reference and check its id, as the
release's do. A DoFn's foreign error is reported by class and location only (``withhold_data_in_errors``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import apache_beam as beam
import numpy as np

from dpops.analysis.bound_choice import BoundHistograms
from dpops.analysis.estimate import (
    GridCounts,
    PairTable,
    PassCounts,
    ValueCounts,
    exact_histograms_of_rows,
    value_codes,
    value_counts_of,
    value_grid,
)
from dpops.release.pipeline_seam import (
    CONFLICTING_READS,
    CountedPass,
    EstimationCountsRequest,
    estimation_digest_salt,
)
from pipelines import fs
from pipelines.bounding import bound_rows
from pipelines.scratch import Columns, concat_columns, pack_columns, unpack_columns
from pipelines.transforms import split_by_key, withhold_data_in_errors

COUNTS_FILE = "counts.json"
READ_DIGESTS = "read_digests"  # the read's tagged output: (file index, size, salted tag) of each CSV file read whole
PARTS_DIR = "_parts"  # scratch under the staging location: <staging>/_parts/b<bucket>/<item>.npz
STAGES = ("pairs", "values", "error")
FLUSH_ROWS = 1 << 21  # a work item's reduced rows are written out per bucket at least this often (memory)



# --------------------------------------------------------------------------- the counts as plain data


def _grid_json(c: GridCounts) -> dict[str, Any]:
    return {"at_or_below": [int(x) for x in c.at_or_below], "n": int(c.n)}


def _grid_of(d: Mapping[str, Any]) -> GridCounts:
    return GridCounts(np.asarray(d["at_or_below"], dtype=np.int64), int(d["n"]))


def _value_json(c: ValueCounts) -> dict[str, Any]:
    return {"below": [int(x) for x in c.below], "at_or_below": [int(x) for x in c.at_or_below], "n": int(c.n)}


def _value_of(d: Mapping[str, Any]) -> ValueCounts:
    return ValueCounts(np.asarray(d["below"], dtype=np.int64), np.asarray(d["at_or_below"], dtype=np.int64),
                       int(d["n"]))








# --------------------------------------------------------------------------- step 1: read, reduce, write


def reduce_batch(request: EstimationCountsRequest, rows: Columns) -> Columns:
    """One checked batch reduced to what the pass counts (module docstring, step 1). Every reduction is a
    function of each unit's own rows that the bucket's count repeats exactly: a pair table merges by adding
    equal pairs' rows, bounding is idempotent and mergeable (``pipelines.bounding``), value cells are exact."""
    if request.stage == "pairs":
        t = PairTable.of(rows["u"], rows["p"], rows["pp"])
        return {"u": t.u, "p": t.p, "pp": t.pp, "rows": t.rows}
    if request.stage == "values":
        bounded, _ = bound_rows({k: rows[k] for k in ("u", "p", "prio", "pp", *(f"v:{c}" for c in request.columns))},
                                request.l0, request.linf)  # pre-bound: cuts what is written
        out = {k: bounded[k] for k in ("u", "p", "prio", "pp")}
        grid = value_grid()
        for c in request.columns:
            out[f"c:lo:{c}"], out[f"c:hi:{c}"] = value_codes(bounded[f"v:{c}"], grid)
        return out
    return {"u": rows["u"], "p": rows["p"], **{f"v:{c}": rows[f"v:{c}"] for c in request.columns}}


def merge_reduced(request: EstimationCountsRequest, parts: list[Columns]) -> Columns:
    """Reduced batches of the same units merged into one (the pair tables merged, the rows re-bounded)."""
    rows = concat_columns(parts)
    if request.stage == "pairs" and len(parts) > 1:
        t = PairTable.merge([PairTable(**p) for p in parts])
        return {"u": t.u, "p": t.p, "pp": t.pp, "rows": t.rows}
    if request.stage == "values" and len(parts) > 1:
        return bound_rows(rows, request.l0, request.linf)[0]
    return rows


def part_path(request: EstimationCountsRequest, bucket: int, item: tuple[int, str, int | None, int],
              flush: int) -> str:
    """The scratch file of one (bucket, work item, flush): a retried bundle rewrites the same names."""
    return fs.join(request.staging_dir, PARTS_DIR, f"b{bucket:05d}",
                   f"f{item[0]}-g{item[2] if item[2] is not None else 'all'}-{flush}.npz")


class _ReadForEstimation(beam.DoFn):
    """WorkItem -> (bucket, scratch file): the driver path's read (same streams), reduced, written per bucket."""

    def __init__(self, request: EstimationCountsRequest):
        self.request = request
        self._read_rng: Any = None
        self._salt: tuple[int, int] | None = None
        self._digest_salt = b""

    def setup(self) -> None:
        from dpops.noise import randomness
        from pipelines.bounding import pair_salt

        r = self.request
        label = dict(r.label)
        if r.randomness == "keyed":
            from dpops.keyref import resolve_key_for_run

            assert r.key_ref is not None and r.key_id is not None
            source = randomness.keyed_random(resolve_key_for_run(r.key_ref, r.key_id), label)
        else:
            assert r.test_seed is not None
            source = randomness.test_random(int(r.test_seed), label)
        self._read_rng = source.child("estimate", "read")  # dpops.release.estimation.compute_estimation's stream
        self._salt = pair_salt(self._read_rng)
        self._digest_salt = estimation_digest_salt(source)

    @withhold_data_in_errors
    def process(self, item: tuple[int, str, int | None, int]) -> Iterator[Any]:
        import pipelines.io as pio  # module attribute lookups, as the release's reader (tests hook them)
        from dpops.inputs import read_digest_tag

        r = self.request
        item = (int(item[0]), str(item[1]), None if item[2] is None else int(item[2]), int(item[3]))
        held: dict[int, list[Columns]] = {}
        n_held = flush = 0
        digest = pio.ReadDigest()  # the bytes this pass read, for the estimation's after-read check (CSV only)
        for j, (batch, offset) in enumerate(pio.iter_record_batches(item, r.read, None, digest)):
            rows, _, _ = pio.prepare_batch(batch, item[0], offset, r.read,
                                           self._read_rng.child("read", item[0], item[2] or 0, j), pair_salt=self._salt)
            if not len(rows["u"]):
                continue
            for key, chunk in split_by_key(reduce_batch(r, rows), r.n_buckets):
                held.setdefault(key, []).append(chunk)
                n_held += len(chunk["u"])
            if n_held >= FLUSH_ROWS:  # a large CSV file is one work item: its reduced rows go out in pieces
                yield from self._write(held, item, flush)
                held, n_held, flush = {}, 0, flush + 1
        yield from self._write(held, item, flush)
        if digest.complete:  # the salted tag only (dpops.inputs.read_digest_tag): the sha256 stays here
            yield beam.pvalue.TaggedOutput(READ_DIGESTS, (item[0], digest.size,
                                                          read_digest_tag(self._digest_salt, digest.size,
                                                                          digest.hexdigest())))

    def _write(self, held: dict[int, list[Columns]], item: tuple[int, str, int | None, int],
               flush: int) -> Iterator[tuple[int, str]]:
        for key in sorted(held):
            path = part_path(self.request, key, item, flush)
            fs.write_bytes(path, pack_columns(merge_reduced(self.request, held[key])))  # private staging (module doc)
            yield key, path


# --------------------------------------------------------------------------- step 2: count per bucket


def count_rows(request: EstimationCountsRequest, rows: Columns) -> dict[str, Any]:
    """The pass's counts of the reduced rows of whole units (one bucket, or no rows), as JSON-shaped data."""
    if request.stage == "pairs":
        table = PairTable(rows["u"], rows["p"], rows["pp"], rows["rows"])
        linf = table.linf_counts_at(list(request.grid_l0), np.asarray(request.grid_linf, dtype=np.int64))
        return {"l0": _grid_json(table.l0_counts(np.asarray(request.grid_l0, dtype=np.int64))),
                "linf": {str(k): _grid_json(c) for k, c in linf.items()}}
    if request.stage == "values":
        counts = value_counts_of(rows, request.l0, request.linf, request.columns, value_grid())
        return {"values": {c: _value_json(v) for c, v in counts.items()}}
    h = exact_histograms_of_rows(rows, np.asarray(request.public_hashes, dtype=np.uint64), request.histograms,
                                 request.max_linf)
    return {"error": h.to_dict()["histograms"]}


def empty_rows(request: EstimationCountsRequest) -> Columns:
    """The reduced columns of no rows (an interval without data is data: every count is zero)."""
    z = np.zeros(0, np.uint64)
    if request.stage == "pairs":
        return {"u": z, "p": z, "pp": z, "rows": np.zeros(0, np.int64)}
    if request.stage == "values":
        return {"u": z, "p": z, "prio": z, "pp": z,
                **{f"c:{s}:{c}": np.zeros(0, np.int16) for c in request.columns for s in ("lo", "hi")}}
    return {"u": z, "p": z, **{f"v:{c}": np.zeros(0) for c in request.columns}}


class _CountBucket(beam.DoFn):
    """(bucket, scratch files) -> the bucket's counts; the files are removed once read."""

    def __init__(self, request: EstimationCountsRequest):
        self.request = request

    @withhold_data_in_errors
    def process(self, element: tuple[int, Iterable[str]]) -> Iterator[dict[str, Any]]:
        _bucket, paths = element
        files = sorted(set(paths))
        rows = merge_reduced(self.request, [unpack_columns(fs.read_bytes(p)) for p in files])
        counts = count_rows(self.request, rows)
        del rows
        fs.delete_files(files)
        yield counts


# --------------------------------------------------------------------------- step 3: the sum


class SumCounts(beam.CombineFn):
    """Element-wise sum of bucket counts (JSON-shaped dicts of int lists); no input: the counts of no rows."""

    def __init__(self, request: EstimationCountsRequest):
        self.request = request

    def create_accumulator(self) -> dict[str, Any] | None:
        """No bucket counted yet."""
        return None

    def add_input(self, acc: dict[str, Any] | None, counts: dict[str, Any]) -> dict[str, Any]:
        """One bucket's counts added."""
        return counts if acc is None else add_counts(acc, counts)

    def merge_accumulators(self, accs: Iterable[dict[str, Any] | None]) -> dict[str, Any] | None:
        """Partial sums added (integers: any order gives the same sum)."""
        out = None
        for a in accs:
            if a is not None:
                out = a if out is None else add_counts(out, a)
        return out

    def extract_output(self, acc: dict[str, Any] | None) -> dict[str, Any]:
        """The sum, or the counts of no rows when no bucket had any."""
        return count_rows(self.request, empty_rows(self.request)) if acc is None else acc


def add_counts(a: Any, b: Any) -> Any:
    """Two counts documents added leaf by leaf (dicts by key, lists element-wise, nested lists too)."""
    if isinstance(a, dict):
        if set(a) != set(b):
            raise ValueError("estimation counts of two buckets have different fields")  # no data in the text
        return {k: add_counts(a[k], b[k]) for k in a}
    if isinstance(a, list):
        return [add_counts(x, y) for x, y in zip(a, b, strict=True)]
    return int(a) + int(b)


class ReadDigestsOf(beam.CombineFn):
    """(file index, size, tag) of each complete read -> {file index: [size, tag]}. Two reads of one file that
    disagree give ``CONFLICTING_READS`` as its tag, which matches no fingerprint: such a pass counted bytes
    other than one file's, so its counts must never be taken as the run key's (the check refuses)."""

    def create_accumulator(self) -> dict[int, list[Any]]:
        """No read reported yet."""
        return {}

    def add_input(self, acc: dict[int, list[Any]], read: tuple[int, int, str]) -> dict[int, list[Any]]:
        """One complete read added."""
        return self.merge_accumulators([acc, {int(read[0]): [int(read[1]), str(read[2])]}])

    def merge_accumulators(self, accs: Iterable[dict[int, list[Any]]]) -> dict[int, list[Any]]:
        """Reads of distinct files joined; equal reads of one file kept once, unequal ones marked conflicting."""
        out: dict[int, list[Any]] = {}
        for a in accs:
            for index, got in a.items():
                if index in out and out[index] != list(got):
                    out[index] = [out[index][0], CONFLICTING_READS]
                else:
                    out.setdefault(index, list(got))
        return out

    def extract_output(self, acc: dict[int, list[Any]]) -> dict[int, list[Any]]:
        """The joined reads (empty: no file was read whole, e.g. Parquet)."""
        return acc


class _WriteCounts(beam.DoFn):
    def __init__(self, staging_dir: str):
        self.staging_dir = staging_dir

    @withhold_data_in_errors
    def process(self, counts: dict[str, Any], read_digests: dict[int, list[Any]]) -> Iterator[str]:
        path = fs.join(self.staging_dir, COUNTS_FILE)
        # private staging: exact counts, not DP; beside them the reads' salted tags (never a file's sha256)
        doc = {"counts": counts, READ_DIGESTS: {str(k): v for k, v in sorted(read_digests.items())}}
        fs.write_bytes(path, json.dumps(doc).encode("utf-8"))
        yield path


class EstimationCountsTransform(beam.PTransform):
    """PBegin -> {"counts": one dict, the pass's public-grid counts over the whole input (see the module
    docstring); "read_digests": one dict, {file index: [size, salted tag]} of the files read whole
    (``ReadDigestsOf``)}."""

    def __init__(self, request: EstimationCountsRequest):
        super().__init__()
        if request.stage not in STAGES:
            raise ValueError(f"estimation counting stage must be one of {STAGES}, got {request.stage!r}")
        self.request = request

    def expand(self, pbegin):
        """Read, reduce and write per bucket; count per bucket; sum the buckets (module docstring)."""
        r = self.request
        read = (pbegin
                | "WorkItems" >> beam.Create(list(r.work_items))
                | "ReshuffleItems" >> beam.Reshuffle()          # spread the work items over the workers
                | "ReadForEstimation" >> beam.ParDo(_ReadForEstimation(r)).with_outputs(READ_DIGESTS, main="files"))
        counts = (read.files                                                     # (bucket, scratch file)
                  | "FilesPerBucket" >> beam.GroupByKey()
                  | "CountBucket" >> beam.ParDo(_CountBucket(r))                 # the bucket's counts
                  | "SumBuckets" >> beam.CombineGlobally(SumCounts(r)))
        # The bytes each file's read consumed, joined over the workers: the data path (not metrics) carries them,
        # so a retried bundle's output counts once (the runner drops a failed attempt's), as the counts do.
        digests = read[READ_DIGESTS] | "JoinReadDigests" >> beam.CombineGlobally(ReadDigestsOf())
        return {"counts": counts, READ_DIGESTS: digests}


def counts_of_document(request: EstimationCountsRequest, doc: Mapping[str, Any]) -> PassCounts:
    """The ``PassCounts`` of a counts document (the pass's output, or ``count_rows`` of some rows)."""
    if request.stage == "pairs":
        return PassCounts(l0=_grid_of(doc["l0"]), linf={int(k): _grid_of(v) for k, v in doc["linf"].items()})
    if request.stage == "values":
        return PassCounts(values={c: _value_of(v) for c, v in doc["values"].items()})
    empty = exact_histograms_of_rows(empty_rows(request), np.asarray(request.public_hashes, dtype=np.uint64),
                                     request.histograms, request.max_linf)
    return PassCounts(histograms=BoundHistograms.from_dict({**empty.to_dict(), "histograms": doc["error"]},
                                                           value_grid()))


def count_estimation(request: EstimationCountsRequest) -> CountedPass:
    """Run one counting pass (``dpops.release.pipeline_seam.COUNT_ESTIMATION``) and return its counts and the
    tags of the bytes it read (``CountedPass``).

    The pipeline is made first: it points Beam's FileSystems at the run's options (the S3 endpoint), which
    listing the input's row groups (``work_items``) and reading the counts back need on this side too."""
    import dataclasses

    from apache_beam.options.pipeline_options import PipelineOptions

    from pipelines.io import work_items

    opts = fs.s3_options(list(request.runner_options))
    with beam.Pipeline(runner=request.runner, options=PipelineOptions(opts)) as p:
        if request.input_paths:
            request = dataclasses.replace(request, work_items=tuple(
                work_items([fs.normalize(x) for x in request.input_paths], request.input_format)))
        out = p | "EstimationCounts" >> EstimationCountsTransform(request)
        _ = out["counts"] | "WriteCounts" >> beam.ParDo(_WriteCounts(request.staging_dir),
                                                       read_digests=beam.pvalue.AsSingleton(out[READ_DIGESTS]))
    path = fs.join(request.staging_dir, COUNTS_FILE)
    doc = json.loads(fs.read_bytes(path).decode("utf-8"))
    fs.delete_files([path])
    digests: dict[str, tuple[int, str]] = {}
    for index, (size, tag) in doc[READ_DIGESTS].items():
        if 0 <= int(index) < len(request.input_paths):
            digests[request.input_paths[int(index)]] = (int(size), str(tag))
    return CountedPass(counts_of_document(request, doc["counts"]), digests)


__all__ = ["COUNTS_FILE", "READ_DIGESTS", "EstimationCountsTransform", "ReadDigestsOf", "SumCounts", "add_counts",
           "count_estimation", "count_rows", "counts_of_document", "empty_rows", "merge_reduced", "reduce_batch"]
