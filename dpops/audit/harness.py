"""Run a release plan on a synthetic dataset through the pipeline's own numpy code path.

The Beam DoFns of ``pipelines/release_pipeline.py`` are thin shells around three functions:
``pipelines.io.prepare_batch`` (row checks: null/NaN/inf rows dropped, hashing, bounding
priorities), ``pipelines.bounding.aggregate_bucket`` (exact L0/Linf bounding, clamping,
per-partition accumulators) and ``pipelines.aggregate.select_and_noise`` (partition
selection, noise from the plan, post-processing). The auditor calls exactly those, with the
randomness source a run would use, so a bug in any of them shows up in the audit; it skips
only Beam's shuffles, which move data but compute nothing. (None of these modules imports
Beam; they are imported lazily so ``import dpops`` stays light.)

Trials are vectorised: one call processes T independent "groups" of partitions, each group
holding its own copy of the neighbouring datasets' difference. The noise of distinct
partitions is drawn independently, so the T groups are T independent trials of the mechanism.

Free post-processing is switched off (non-negative clamping, mean clamping, suppression):
the auditor then observes the raw noisy values, a stronger adversary than a reader of the
published table, and post-processing can never raise ε.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dpops.errors import DpopsError, SpecError
from dpops.spec import refuse_metric_contributions

if TYPE_CHECKING:
    from dpops.noise.randomness import RandomSource
    from dpops.release_plan import ReleasePlan

AUDIT_POSTPROCESS = {"non_negative": False, "integer_counts": True, "clamp_means_to_bounds": False,
                     "suppress_below": None}


@dataclass
class Rows:
    """A synthetic dataset: one entry per input row (unit id, partition index, value, category code)."""

    unit: np.ndarray  # int64 unit ids
    part: np.ndarray  # int64 partition index (group * J + j)
    value: np.ndarray  # float64 (NaN allowed: the row checks must drop it)
    cat: np.ndarray  # int64 category code in the metric's domain, -1 = none

    @staticmethod
    def concat(parts: list[Rows]) -> Rows:
        """The rows of ``parts`` one after another (an empty list gives an empty dataset)."""
        parts = [p for p in parts if p.unit.size] or [Rows.empty()]
        return Rows(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("unit", "part", "value", "cat")))

    @staticmethod
    def empty() -> Rows:
        """A dataset with no rows (the neighbour that lacks the target under add/remove)."""
        return Rows(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros(0, np.int64))


def block(units: np.ndarray, parts: np.ndarray, value: float, cat: int = -1) -> Rows:
    """``units.size`` rows of ``value`` (and category ``cat``, -1 for none), unit and partition given per row."""
    units = np.asarray(units, np.int64)
    parts = np.asarray(parts, np.int64)
    return Rows(units, parts, np.full(units.size, float(value)), np.full(units.size, int(cat), np.int64))


class Harness:
    """Everything needed to push synthetic rows through the pipeline functions for one plan."""

    # spec: a dpops.spec.ReleaseSpec; left untyped until pipelines.io takes Mapping[str, str] column types
    def __init__(self, spec: Any, plan: ReleasePlan, *, category_column: str | None = None,
                 category_domain: tuple = ()):
        from pipelines.bounding import aggregation_spec, metric_layout
        from pipelines.io import ReadConfig

        # The scenarios build neighbours at the release's (L0, Linf); a metric with its own bounds would be
        # audited at bounds it does not use, so the audit refuses it rather than report a meaningless pass.
        refuse_metric_contributions(spec, "the planted-bug audit", "audit each bound set as its own release "
                                                                   "(a spec whose contribution is that metric's)")
        self.spec = spec
        self.plan = dataclasses.replace(plan, postprocess={**plan.postprocess, **AUDIT_POSTPROCESS})
        self.types = dict(spec.input.columns)
        self.record_level = bool(spec.privacy_unit.record_level)
        self.unit_col = None if self.record_level else spec.privacy_unit.column
        self.part_cols = tuple(plan.partition_columns)
        self.public = plan.public_partitions is not None
        if self.types[self.part_cols[0]] == "bool":
            raise SpecError(f"{spec.source}: audit needs a non-bool first partition column to lay out trials, "
                            f"{self.part_cols[0]!r} is bool")
        value_cols, cats, _, _, _ = metric_layout(plan)  # the pipeline's own layout
        self.value_cols = value_cols
        self.cat_cols = cats
        self.read = ReadConfig(format="parquet", types=self.types, unit_column=self.unit_col,
                               partition_columns=self.part_cols, value_columns=self.value_cols,
                               category_columns=cats, public_hashes=None)
        self.agg = aggregation_spec(plan)

    # ------------------------------------------------------------------ layout
    def partition_values(self, n_parts: int) -> list[list[Any]]:
        """Partition column values of partition index 0..n-1 (first column carries the index)."""
        idx = np.arange(n_parts)
        out: list[list[Any]] = []
        for i, c in enumerate(self.part_cols):
            t = self.types[c]
            if i == 0:
                out.append([f"p{k}" for k in idx] if t == "string" else
                           [int(k) for k in idx] if t == "int" else [float(k) for k in idx])
            else:
                out.append(["x"] * n_parts if t == "string" else [0] * n_parts if t == "int"
                           else [0.0] * n_parts if t == "float" else [False] * n_parts)
        return out

    def partition_index(self, first_col_values: list[Any]) -> np.ndarray:
        """Partition index of each released row, from its first partition column (inverse of ``partition_values``)."""
        t = self.types[self.part_cols[0]]
        if t == "string":
            return np.array([int(v[1:]) for v in first_col_values], np.int64)
        return np.array([int(v) for v in first_col_values], np.int64)

    def to_batch(self, rows: Rows, n_parts: int):
        """An Arrow batch with the declared column types (Arrow casts and takes: no per-row Python)."""
        import pyarrow as pa
        import pyarrow.compute  # noqa: F401 - pa.compute below

        from pipelines.io import ARROW_TYPES

        cols: dict[str, Any] = {}
        if self.unit_col is not None:
            cols[self.unit_col] = pa.array(rows.unit, pa.int64())
        pvals = self.partition_values(n_parts)
        take = pa.array(rows.part, pa.int64())
        for c, vals in zip(self.part_cols, pvals, strict=True):
            cols[c] = pa.array(vals, ARROW_TYPES[self.types[c]]).take(take)
        for c in self.value_cols:
            cols[c] = pa.array(rows.value, pa.float64(), from_pandas=False)
        for c, domain in self.cat_cols.items():
            dom = pa.array(list(domain) + [None], ARROW_TYPES[self.types[c]])
            cols[c] = dom.take(pa.array(np.where(rows.cat >= 0, rows.cat, len(domain)), pa.int64()))
        needed = self.read.needed
        arrays = []
        for c in needed:
            a = cols[c]
            t = ARROW_TYPES[self.types[c]]
            if c == self.unit_col and self.types[c] == "string":
                a = pa.compute.binary_join_element_wise("u", a.cast(pa.string()), "")
            arrays.append(a if a.type == t else a.cast(t))
        return pa.RecordBatch.from_arrays(arrays, names=needed)

    # ------------------------------------------------------------------ run
    def run(self, rows: Rows, n_parts: int, rng: RandomSource) -> dict[str, Any]:
        """Released columns (before free post-processing) plus ``_part``: the partition index of each row."""
        from pipelines.aggregate import select_and_noise

        parts, acc, names, pub_hashes, pub_names = self.accumulate(rows, n_parts, rng)
        cols = select_and_noise(0, parts, acc, names, self.plan, pub_hashes, pub_names, rng)
        first = cols.get(self.part_cols[0], [])
        cols["_part"] = self.partition_index(list(first))
        return cols

    def accumulate(self, rows: Rows, n_parts: int, rng: RandomSource):
        """The pipeline's exact per-partition accumulators before noise: (partition hashes,
        accumulators, names, public hashes, public names). Never published: audit use only."""
        from pipelines.bounding import aggregate_bucket
        from pipelines.io import hash_partition_tuples, prepare_batch

        read = self.read
        pub_hashes = pub_names = None
        if self.public:
            tuples = list(zip(*self.partition_values(n_parts), strict=True))
            hashes = hash_partition_tuples(tuples, self.part_cols, self.types)
            pub_names = {int(h): t for h, t in zip(hashes, tuples, strict=True)}
            pub_hashes = np.array(sorted(pub_names), dtype=np.uint64)
            read = dataclasses.replace(read, public_hashes=pub_hashes)
        batch = self.to_batch(rows, n_parts)
        # same stream labels as the DoFns: bounding per (file, row group, batch), noise per shard
        prows, (uniq, name_vals), _ = prepare_batch(batch, 0, 0, read, rng.child("bounding", 0, -1, 0))
        parts, acc, _ = aggregate_bucket(prows, self.agg)
        names = {int(h): tuple(col[j] for col in name_vals) for j, h in enumerate(uniq)}
        return parts, acc, names, pub_hashes, pub_names


def safe_run(h: Harness, rows: Rows, n_parts: int, rng: RandomSource) -> dict[str, Any] | Exception:
    """A run that raises on some input is an observable outcome (a data-dependent abort leaks)."""
    try:
        return h.run(rows, n_parts, rng)
    except (DpopsError, ValueError, FloatingPointError) as exc:
        return exc


__all__ = ["Rows", "block", "Harness", "safe_run", "AUDIT_POSTPROCESS"]
