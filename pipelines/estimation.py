"""The estimation's private read as a Beam pipeline: counts on public grids, combined on the workers.

A private bound estimation (``dpops.release.estimation``) needs, per mechanism, counts on a public grid
(``dpops.analysis.estimate.GridCounts`` / ``ValueCounts``): how many units have at most k partitions, how
many have at most k rows in their largest kept pair, how many kept values lie below each grid point. This
module computes them where the data is, so the driver never holds a row:

    counts = p | EstimationCountsTransform(request)    # one element: the pass's counts, summed

``expand`` is three steps:

1. ``ReadForEstimation``: each work item (a CSV file or a Parquet row group) read and checked by the
   release's own ``pipelines.io.iter_record_batches`` / ``prepare_batch``, with the estimation's own streams
   (the driver path's: ``rng.child("estimate", "read")``, one pair salt, a stream per (file, row group,
   batch)), then reduced per batch (pairs: a ``PairTable``; values: ``bound_rows`` at (l0, linf)) and keyed
   by unit-hash bucket (``split_by_key``), so all of a unit's rows meet in one key.
2. Per key, the batches merged (a pair table's equal pairs add their rows; value rows go through the
   release's mergeable ``BoundContributions`` combiner) and counted with the same functions the driver path
   uses (``PairTable.l0_counts`` / ``linf_counts_at``, ``value_counts_of``).
3. ``CombineGlobally`` adds the buckets' counts: counts are additive over disjoint sets of units, so the sum
   equals the counts of all rows at once, bit for bit (integers), and the mechanisms choose the same bounds.

Privacy. The counts are exact functions of private data, not DP: the last step writes them to the caller's
private staging directory (created 0700, the file 0600, removed by the caller once read); they reach the
driver only to be fed to the exponential mechanisms, and no log, metric or error carries them. Workers
resolve the noise key from its reference and check its id, as the release's do. A DoFn's foreign error is
reported by class and location only (``withhold_data_in_errors``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np

from dpops.analysis.estimate import GridCounts, PairTable, PassCounts, ValueCounts, value_counts_of, value_grid
from dpops.release.pipeline_seam import EstimationCountsRequest
from pipelines.bounding import bound_rows
from pipelines.elements import RowBlock
from pipelines.transforms import BoundContributions, split_by_key, withhold_data_in_errors

COUNTS_FILE = "counts.json"
STAGES = ("pairs", "values")


# --------------------------------------------------------------------------- the counts as plain data


def _grid_json(c: GridCounts) -> dict[str, Any]:
    return {"at_or_below": [int(x) for x in c.at_or_below], "n": int(c.n)}


def _grid_of(d: dict[str, Any]) -> GridCounts:
    return GridCounts(np.asarray(d["at_or_below"], dtype=np.int64), int(d["n"]))


def _value_json(c: ValueCounts) -> dict[str, Any]:
    return {"below": [int(x) for x in c.below], "at_or_below": [int(x) for x in c.at_or_below], "n": int(c.n)}


def _value_of(d: dict[str, Any]) -> ValueCounts:
    return ValueCounts(np.asarray(d["below"], dtype=np.int64), np.asarray(d["at_or_below"], dtype=np.int64),
                       int(d["n"]))


# --------------------------------------------------------------------------- step 1: read


class _ReadForEstimation(beam.DoFn):
    """WorkItem -> (bucket, reduced batch): the driver path's read (same streams), reduced per batch."""

    def __init__(self, request: EstimationCountsRequest):
        self.request = request
        self._read_rng: Any = None
        self._salt: tuple[int, int] | None = None

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

    @withhold_data_in_errors
    def process(self, item: tuple[int, str, int | None, int]):
        import pipelines.io as pio  # module attribute lookups, as the release's reader (tests hook them)

        r = self.request
        item = (int(item[0]), str(item[1]), None if item[2] is None else int(item[2]), int(item[3]))
        for j, (batch, offset) in enumerate(pio.iter_record_batches(item, r.read)):
            rows, _, _ = pio.prepare_batch(batch, item[0], offset, r.read,
                                           self._read_rng.child("read", item[0], item[2] or 0, j), pair_salt=self._salt)
            if not len(rows["u"]):
                continue
            if r.stage == "pairs":
                t = PairTable.of(rows["u"], rows["p"], rows["pp"])
                table = {"u": t.u, "p": t.p, "pp": t.pp, "rows": t.rows}
                for key, chunk in split_by_key(table, r.n_buckets):
                    yield key, RowBlock.of(chunk)
            else:
                keep = ("u", "p", "prio", "pp", *(f"v:{c}" for c in r.columns))
                bounded, _ = bound_rows({k: rows[k] for k in keep}, r.l0, r.linf)  # pre-bound: cuts the shuffle
                for key, chunk in split_by_key(bounded, r.n_buckets):
                    yield key, RowBlock.of(chunk)


# --------------------------------------------------------------------------- step 2: per bucket


class MergePairTables(beam.CombineFn):
    """The pair tables of one bucket merged (equal pairs add their row counts); compacted as they arrive."""

    def create_accumulator(self) -> list[PairTable]:
        """No table yet."""
        return []

    def add_input(self, acc: list[PairTable], block: RowBlock) -> list[PairTable]:
        """One batch's table added; merged into one every 16 tables (memory: the bucket's distinct pairs)."""
        acc.append(PairTable(**block.rows()))
        return [PairTable.merge(acc)] if len(acc) > 4 else acc

    def merge_accumulators(self, accs: Iterable[list[PairTable]]) -> list[PairTable]:
        """Partial tables (lifted combine) merged into one."""
        tables = [t for a in accs for t in a]
        return [PairTable.merge(tables)] if tables else []

    def compact(self, acc: list[PairTable]) -> list[PairTable]:
        """One table before a partial accumulator is shuffled (no pair twice in what crosses the shuffle)."""
        return [PairTable.merge(acc)] if len(acc) > 1 else acc

    def extract_output(self, acc: list[PairTable]) -> PairTable:
        """The bucket's table."""
        return PairTable.merge(acc) if acc else PairTable.of(np.zeros(0), np.zeros(0), np.zeros(0))


def _pair_counts(request: EstimationCountsRequest, table: PairTable) -> dict[str, Any]:
    grid_l0 = np.asarray(request.grid_l0, dtype=np.int64)
    grid_linf = np.asarray(request.grid_linf, dtype=np.int64)
    linf = table.linf_counts_at([int(k) for k in grid_l0], grid_linf)
    return {"l0": _grid_json(table.l0_counts(grid_l0)), "linf": {str(k): _grid_json(c) for k, c in linf.items()}}


def _value_counts(request: EstimationCountsRequest, rows: dict[str, np.ndarray]) -> dict[str, Any]:
    if not rows:
        return _empty_counts(request)
    counts = value_counts_of(rows, request.l0, request.linf, request.columns, value_grid())
    return {"values": {c: _value_json(v) for c, v in counts.items()}}


def _empty_counts(request: EstimationCountsRequest) -> dict[str, Any]:
    """The counts of no rows (an interval without data is data: every count is zero)."""
    if request.stage == "pairs":
        return _pair_counts(request, PairTable.of(np.zeros(0), np.zeros(0), np.zeros(0)))
    z = np.zeros(0, np.uint64)
    rows = {"u": z, "p": z, "prio": z, "pp": z, **{f"v:{c}": np.zeros(0) for c in request.columns}}
    return {"values": {c: _value_json(v) for c, v in value_counts_of(rows, 1, 1, request.columns,
                                                                      value_grid()).items()}}


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
        return counts if acc is None else _add_counts(acc, counts)

    def merge_accumulators(self, accs: Iterable[dict[str, Any] | None]) -> dict[str, Any] | None:
        """Partial sums added (integers: any order gives the same sum)."""
        out = None
        for a in accs:
            if a is not None:
                out = a if out is None else _add_counts(out, a)
        return out

    def extract_output(self, acc: dict[str, Any] | None) -> dict[str, Any]:
        """The sum, or the counts of no rows when no bucket had any."""
        return _empty_counts(self.request) if acc is None else acc


def _add_counts(a: Any, b: Any) -> Any:
    if isinstance(a, dict):
        return {k: _add_counts(a[k], b[k]) for k in a}
    if isinstance(a, list):
        return [int(x) + int(y) for x, y in zip(a, b, strict=True)]
    return int(a) + int(b)


class _WriteCounts(beam.DoFn):
    def __init__(self, staging_dir: str):
        self.staging_dir = staging_dir

    @withhold_data_in_errors
    def process(self, counts: dict[str, Any]):
        path = Path(self.staging_dir) / COUNTS_FILE
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # private: exact counts, not DP
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(counts, f)
        os.replace(tmp, path)
        yield str(path)


class EstimationCountsTransform(beam.PTransform):
    """PBegin -> one dict: the pass's public-grid counts over the whole input (see the module docstring)."""

    def __init__(self, request: EstimationCountsRequest):
        super().__init__()
        if request.stage not in STAGES:
            raise ValueError(f"estimation counting stage must be one of {STAGES}, got {request.stage!r}")
        self.request = request

    def expand(self, pbegin):
        """Read and reduce per batch, merge and count per unit bucket, sum the buckets (module docstring)."""
        r = self.request
        keyed = (pbegin
                 | "WorkItems" >> beam.Create(list(r.work_items))
                 | "ReadForEstimation" >> beam.ParDo(_ReadForEstimation(r)))           # (bucket, RowBlock)
        if r.stage == "pairs":
            per_bucket = (keyed
                          | "MergePairTables" >> beam.CombinePerKey(MergePairTables())  # (bucket, PairTable)
                          | "CountPairs" >> beam.Map(lambda kv: _pair_counts(r, kv[1])))
        else:
            per_bucket = (keyed
                          | "BoundContributions" >> BoundContributions(r.l0, r.linf)    # (bucket, (rows, stats))
                          | "CountValues" >> beam.Map(lambda kv: _value_counts(r, kv[1][0])))
        return per_bucket | "SumBuckets" >> beam.CombineGlobally(SumCounts(r))


def count_estimation(request: EstimationCountsRequest) -> PassCounts:
    """Run one counting pass (``dpops.release.pipeline_seam.COUNT_ESTIMATION``) and return its counts."""
    from apache_beam.options.pipeline_options import PipelineOptions

    from pipelines import fs

    opts = fs.s3_options(list(request.runner_options))
    with beam.Pipeline(runner=request.runner, options=PipelineOptions(opts)) as p:
        (p | "EstimationCounts" >> EstimationCountsTransform(request)
           | "WriteCounts" >> beam.ParDo(_WriteCounts(request.staging_dir)))
    path = Path(request.staging_dir) / COUNTS_FILE
    doc = json.loads(path.read_text(encoding="utf-8"))
    path.unlink()
    if request.stage == "pairs":
        return PassCounts(l0=_grid_of(doc["l0"]), linf={int(k): _grid_of(v) for k, v in doc["linf"].items()})
    return PassCounts(values={c: _value_of(v) for c, v in doc["values"].items()})


__all__ = ["COUNTS_FILE", "EstimationCountsTransform", "MergePairTables", "SumCounts", "count_estimation"]
