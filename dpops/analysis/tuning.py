"""Tuning on a sample: many candidate settings, one read of the data, the pipeline's own bounding.

``tune(spec, sample)`` evaluates a grid of candidates -- contribution bounds (L0, Linf), value bounds
per column and the epsilon split -- on a sample and recommends the one minimising a declared loss.

One pass. The sample is read and checked once (``pipelines.io.prepare_batch``: the release's own type
checks, hashing and drop rules), and the bounding's two orders are ranked once by the release's own
``pipelines.bounding.contribution_ranks`` -- the rank of each row among its (unit, partition) pair's rows
and of each pair among its unit's pairs, under the run's keyed priorities. ``bound_contributions`` is
that same ranking filtered at one (L0, Linf), so there is one implementation of the bounding rule and no
second one here. Every candidate's (L0, Linf) is then the vectorised filter ``pair_rank < L0 & row_rank
< Linf`` (the same rows bound_contributions keeps: a property test compares them for random bounds).
Everything else a candidate changes (value bounds, epsilon split) is derived from those bounded rows
without re-reading or re-bounding: clipping is ``numpy.clip`` on the bounded values (what
``aggregate_bucket`` does before its fixed-point sum; the fixed-point snap moves a sum by at most rows x
2^-31 of the bound, ignored), the noise of each candidate
is the prediction of ``dpops.analysis.accuracy.predict`` on the candidate's own ``plan_release`` (the
mechanisms the pipeline would draw), and keep probabilities are the plan's
``PartitionSelection.keep_probability``.

What is reported, per candidate, metric and partition-size bucket (partitions bucketed by their
true number of units in the sample): expected RMSE = sqrt(noise variance + squared bias), the bias
from bounding (bounded unclipped minus true) and from clipping (clipped minus bounded), the relative
RMSE, and, per candidate: the share of rows and of units dropped by the L0 and by the Linf step and
the expected number of partitions kept. count, unit_count, sum and mean use the plan's noise (a mean's
at 1,000 rows, scaled by 1/n); variance uses ``accuracy.first_order_variance_error`` (first order, fast) at
each partition's bounded rows and clipped moments; quantiles the noiseless grid pick on the bounded, clipped
rows (bias) and the plan's expected rank error (noise, in rows, as a fraction of the partition, and in value units
on the sample's histogram); top_k whether bounding changed the leader and the plan's probability of returning
the true leader first at its bounded lead (no RMSE: the output is a category). ``TuneResult.not_evaluated``
lists any metric type tune cannot judge (none of today's types).

Privacy. Nothing here is differentially private: the output is a function of the sample's exact
values. That is why the sample must be public or synthetic data (``dpops.analysis.sample_access``
enforces the operator's allow-list for paths and records a ledger event when private data is read
on purpose), and why the recommendation says where it came from.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dpops.analysis.tune_stats import StatNeeds, bound_prefix, clip_key, q_key
from dpops.errors import InputDataError, InvalidParameter
from dpops.spec import refuse_metric_contributions

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa

    from dpops.analysis.sample_access import SampleAccess
    from dpops.noise.randomness import RandomSource
    from dpops.release_plan import MetricPlan, ReleasePlan
    from dpops.spec import ReleaseSpec
    from pipelines.io import ReadConfig

EVALUATED_TYPES = ("count", "unit_count", "sum", "mean", "variance", "quantiles", "top_k")
BUCKET_EDGES = (1, 10, 100, 1000, 10_000, 100_000)
_REF_UNITS = 1000  # the partition size at which a mean's noise is predicted, then scaled by 1/n (first order)
LOSSES = ("targets", "mean_relative_rmse", "max_relative_rmse")


DROP_WARN = 0.10  # share of the sample's rows a recommendation may drop before tune warns


@dataclass(frozen=True)
class Candidate:
    """One setting to try: contribution bounds, value bounds per column and the epsilon split weights."""

    l0: int
    linf: int
    bounds: tuple[tuple[str, float, float], ...] = ()  # (column, lo, hi); columns not named keep the spec's
    split: tuple[tuple[str, float], ...] | None = None  # None keeps the spec's budget.split

    @property
    def label(self) -> str:
        """A short readable name, unique within a grid (used as the candidate's key in every output)."""
        b = ",".join(f"{c}:[{_num(lo)},{_num(hi)}]" for c, lo, hi in self.bounds)
        s = "" if self.split is None else " split=" + ",".join(f"{k}:{_num(w)}" for k, w in self.split)
        return f"L0={self.l0} Linf={self.linf}" + (f" {b}" if b else "") + s


def _num(x: float) -> str:
    return f"{x:g}"


@dataclass
class TuneResult:
    """What ``tune`` found. ``rows``: one dict per (candidate, metric, bucket); ``candidates``: one dict
    per candidate (drops, partitions kept, loss); ``best``: index of the recommended candidate."""

    spec: ReleaseSpec
    grid: list[Candidate]
    rows: list[dict[str, Any]]
    candidates: list[dict[str, Any]]
    best: int
    loss: str
    not_evaluated: list[str]
    sample_rows: int
    boundings: int  # ranking passes over the rows (always 1: every (L0, Linf) filters the same ranks)
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def recommended(self) -> Candidate:
        """The candidate of least loss."""
        return self.grid[self.best]

    def warnings(self) -> list[str]:
        """What a user must know before applying the recommendation (issue 26 section 4): that no candidate
        meets every target (and which target binds), and that it drops a large share of the sample's rows
        (more than ``DROP_WARN``): contributions beyond the bounds are lost, a bias the noise figures do
        not show. Figures of the sample (tune is not DP; they stay in the operator's output)."""
        best = self.candidates[self.best]
        out: list[str] = []
        ratio = best.get("target_ratio")
        if self.loss == "targets" and ratio is not None and ratio > 1:
            out.append(f"no candidate meets every accuracy target: the best, {self.recommended.label}, reaches "
                       f"{ratio:.3g}x the allowed error on its binding target {best.get('binding_target')}; relax "
                       "that target, raise the budget (dpops plan --solve), or widen the grid")
        dropped = float(best.get("rows_dropped_l0", 0.0)) + float(best.get("rows_dropped_linf", 0.0))
        if dropped > DROP_WARN:
            out.append(f"the recommendation drops {dropped:.0%} of the sample's rows (L0 "
                       f"{float(best.get('rows_dropped_l0', 0.0)):.0%}, Linf "
                       f"{float(best.get('rows_dropped_linf', 0.0)):.0%}): their contributions are not in any "
                       "released value; check that the targets are the ones you mean before applying it")
        return out

    def frame(self) -> pd.DataFrame:
        """``rows`` as a pandas DataFrame (needs pandas)."""
        import pandas as pd

        return pd.DataFrame(self.rows)

    def candidate_frame(self) -> pd.DataFrame:
        """``candidates`` as a pandas DataFrame."""
        import pandas as pd

        return pd.DataFrame(self.candidates)


# --------------------------------------------------------------------------- the grid


def candidate_spec(spec: ReleaseSpec, cand: Candidate) -> ReleaseSpec:
    """The spec with the candidate applied (validated by the ordinary spec parser)."""
    return load_patched(spec, spec_patch(spec, cand))


def spec_patch(spec: ReleaseSpec, cand: Candidate) -> dict[str, Any]:
    """The candidate as a patch of the spec document: ``contribution``, ``budget.split`` and the whole
    ``metrics`` list with the new bounds (lists are replaced, not merged)."""
    patch: dict[str, Any] = {"contribution": {"max_partitions_per_unit": int(cand.l0),
                                              "max_rows_per_unit_per_partition": int(cand.linf)}}
    if cand.split is not None:
        patch["budget"] = {"split": {k: float(w) for k, w in cand.split}}
    if cand.bounds:
        bmap = {c: [float(lo), float(hi)] for c, lo, hi in cand.bounds}
        metrics = []
        for m in spec.model_dump(mode="json", exclude_none=True)["metrics"]:
            if "bounds" in m and m.get("column") in bmap:
                m = {**m, "bounds": bmap[m["column"]]}
            metrics.append(m)
        patch["metrics"] = metrics
    return patch


def apply_patch(doc: dict[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge ``patch`` into a spec document: mappings merge, everything else (lists too) replaces."""
    out = dict(doc)
    for k, v in patch.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = apply_patch(dict(out[k]), v)
        else:
            out[k] = v
    return out


def load_patched(spec: ReleaseSpec, patch: Mapping[str, Any]) -> ReleaseSpec:
    """``spec`` with ``patch`` applied (``apply_patch``), validated by ``dpops.spec.parse_spec``."""
    from dpops.spec import parse_spec

    doc = apply_patch(spec.model_dump(mode="json", exclude_none=True), patch)
    return parse_spec(doc, source=f"{spec.source} (patched by dpops tune)", base_dir=spec.base_dir)


def default_grid(spec: ReleaseSpec) -> list[Candidate]:
    """A grid around the spec's values: L0 and Linf at half, equal and double (at least 1), and each
    bounded column's upper bound at half, equal and double (lower bound kept), with the spec's split.
    At most 27 candidates; duplicates removed."""
    l0, linf = spec.contribution.max_partitions_per_unit, spec.contribution.max_rows_per_unit_per_partition
    l0s = sorted({max(1, l0 // 2), l0, 2 * l0})
    linfs = sorted({max(1, linf // 2), linf, 2 * linf})
    cols = spec.declared_value_bounds()
    scales = (0.5, 1.0, 2.0) if cols else (1.0,)
    out: list[Candidate] = []
    for a in l0s:
        for b in linfs:
            for s in scales:
                bounds = tuple((c, lo, lo + (hi - lo) * s) for c, (lo, hi) in cols.items())
                out.append(Candidate(a, b, bounds if s != 1.0 else ()))
    return list(dict.fromkeys(out))


def grid_from_doc(spec: ReleaseSpec, doc: Mapping[str, Any], source: str = "--grid") -> list[Candidate]:
    """A grid from a document: ``{l0: [..], linf: [..], bounds: {column: [[lo, hi], ..]}, split: [{..}, ..]}``.

    The cartesian product of the lists; an absent key keeps the spec's value. Errors name the key."""
    allowed = {"l0", "linf", "bounds", "split"}
    extra = set(doc) - allowed
    if extra:
        raise InvalidParameter(f"{source}: unknown grid key(s) {sorted(extra)}; allowed: {sorted(allowed)}")

    def ints(key: str, default: int) -> list[int]:
        vals = doc.get(key, [default])
        if not isinstance(vals, list) or not vals or not all(isinstance(v, int) and not isinstance(v, bool)
                                                             and v >= 1 for v in vals):
            raise InvalidParameter(f"{source}: {key} must be a non-empty list of integers >= 1, got {vals!r}")
        return list(dict.fromkeys(vals))

    l0s = ints("l0", spec.contribution.max_partitions_per_unit)
    linfs = ints("linf", spec.contribution.max_rows_per_unit_per_partition)
    cols = spec.declared_value_bounds()
    raw_bounds = doc.get("bounds", {})
    if not isinstance(raw_bounds, Mapping):
        raise InvalidParameter(f"{source}: bounds must map a column to a list of [lo, hi] pairs")
    per_col: list[list[tuple[str, float, float]]] = []
    for col, pairs in raw_bounds.items():
        if col not in cols:
            raise InvalidParameter(f"{source}: bounds.{col}: no bounded metric of the spec uses column {col!r} "
                                   f"(bounded columns: {sorted(cols)})")
        if not isinstance(pairs, list) or not pairs:
            raise InvalidParameter(f"{source}: bounds.{col} must be a non-empty list of [lo, hi] pairs")
        opts = []
        for pr in pairs:
            if (not isinstance(pr, list) or len(pr) != 2 or not all(isinstance(x, (int, float)) and
                                                                   not isinstance(x, bool) for x in pr)
                    or not math.isfinite(pr[0]) or not math.isfinite(pr[1]) or not pr[0] < pr[1]):
                raise InvalidParameter(f"{source}: bounds.{col}: {pr!r} is not a pair [lo, hi] of finite numbers "
                                       "with lo < hi")
            opts.append((str(col), float(pr[0]), float(pr[1])))
        per_col.append(opts)
    combos: list[tuple[tuple[str, float, float], ...]] = [()]
    for opts in per_col:
        combos = [c + (o,) for c in combos for o in opts]
    raw_splits = doc.get("split")
    splits: list[tuple[tuple[str, float], ...] | None] = [None]
    if raw_splits is not None:
        if not isinstance(raw_splits, list) or not raw_splits or not all(isinstance(s, Mapping) for s in raw_splits):
            raise InvalidParameter(f"{source}: split must be a non-empty list of {{metric key: weight}} mappings")
        splits = [tuple((str(k), float(v)) for k, v in s.items()) for s in raw_splits]
    return list(dict.fromkeys(Candidate(a, b, bd, sp) for a in l0s for b in linfs for bd in combos for sp in splits))


# --------------------------------------------------------------------------- reading the sample


def read_config(spec: ReleaseSpec, plan: ReleasePlan) -> ReadConfig:
    """The release's reader configuration for a tune sample: the spec's declared types and columns, its public
    partitions (no time filter: a sample is read whole). One builder for the driver and the Beam path."""
    from pipelines.bounding import metric_layout
    from pipelines.io import ReadConfig, hash_partition_tuples

    value_cols, cats, _, _, _ = metric_layout(plan)
    types: dict[str, str] = {k: str(v) for k, v in spec.input.columns.items()}
    unit_col = None if spec.privacy_unit.record_level else spec.privacy_unit.column
    pub = None
    if plan.public_partitions is not None:
        pub = np.sort(hash_partition_tuples(list(plan.public_partitions), tuple(plan.partition_columns), types))
    return ReadConfig(format=spec.input.format, types=types, unit_column=unit_col,
                      partition_columns=tuple(plan.partition_columns), value_columns=value_cols,
                      category_columns=cats, public_hashes=pub)


def sample_table(spec: ReleaseSpec, sample: pa.Table | pd.DataFrame, columns: Sequence[str]) -> pa.Table:
    """An in-memory sample (an Arrow table or a pandas DataFrame) as an Arrow table of ``columns``.

    A path is not read here: ``_prepare`` reads it with the release's own reader."""
    import pyarrow as pa

    if isinstance(sample, pa.Table):
        table = sample
    else:
        try:
            import pandas as pd
        except ImportError:  # pragma: no cover
            raise InvalidParameter("a sample is a path, a pyarrow.Table or a pandas.DataFrame") from None
        if not isinstance(sample, pd.DataFrame):
            raise InvalidParameter(f"a sample is a path, a pyarrow.Table or a pandas.DataFrame, "
                                   f"got {type(sample).__name__}")
        table = pa.Table.from_pandas(sample, preserve_index=False)
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise InputDataError(f"tune: the sample has no column(s) {missing} that the spec's metrics need")
    return table.select(list(columns))


def read_stream(seed: int | None) -> RandomSource:
    """The read's randomness: the test stream of ``seed`` (``--seed``: reproducible bounding choices) or fresh
    OS randomness, as a release's. Its children give the pair salt (``pipelines.bounding.pair_salt``) and each
    batch's row priorities (``batch_stream``); the Beam path rebuilds them on every worker from the seed."""
    from dpops.noise.randomness import os_random, test_random

    return os_random() if seed is None else test_random(int(seed), ("tune",))


def batch_stream(rng: RandomSource, item: tuple[int, str, int | None, int], seq: int) -> RandomSource:
    """The row-priority stream of batch ``seq`` of work item ``item`` (``pipelines.io.work_items``): one owner of
    the label, so the driver and the Beam path draw the same priorities for the same rows."""
    return rng.child("bounding", item[0], -1 if item[2] is None else item[2], seq)


def sample_format(spec: ReleaseSpec, path: str | os.PathLike[str]) -> str:
    """The reader format of a sample file: by its suffix (``.csv``, ``.parquet``), else the spec's input format."""
    p = os.fspath(path)
    return "csv" if p.endswith(".csv") else "parquet" if p.endswith(".parquet") else spec.input.format


def _prepare(spec: ReleaseSpec, cfg: ReadConfig, sample: str | os.PathLike[str] | pa.Table | pd.DataFrame,
             seed: int | None, fmt: str | None = None) -> dict[str, np.ndarray]:
    """Checked, hashed rows of the whole sample (``prepare_batch`` per record batch, one pair salt).

    A path is read by the release's own reader (``pipelines.io.work_items`` and ``iter_record_batches``:
    the same row groups, batches and CSV dialect as a release), streamed batch by batch so that only the
    prepared numeric rows are held, never the sample's Arrow table; a table or DataFrame is cut into
    batches of the same size."""
    import dataclasses

    from pipelines.bounding import pair_salt
    from pipelines.io import iter_record_batches, prepare_batch, work_items

    rng = read_stream(seed)
    salt = pair_salt(rng)
    parts: list[dict[str, np.ndarray]] = []
    if isinstance(sample, (str, os.PathLike)):
        path = os.fspath(sample)
        fmt = fmt or sample_format(spec, path)  # given for a pinned sample, whose path has no suffix
        cfg = dataclasses.replace(cfg, format=fmt)
        for item in work_items([path], fmt):
            for seq, (batch, offset) in enumerate(iter_record_batches(item, cfg)):
                rows, _, _ = prepare_batch(batch, item[0], offset, cfg, batch_stream(rng, item, seq), pair_salt=salt)
                parts.append(rows)
    else:
        table = sample_table(spec, sample, list(dict.fromkeys(cfg.needed)))
        offset = 0
        for i, batch in enumerate(table.to_batches(max_chunksize=cfg.batch_rows)):
            rows, _, _ = prepare_batch(batch, 0, offset, cfg, batch_stream(rng, (0, "", None, 0), i), pair_salt=salt)
            parts.append(rows)
            offset += batch.num_rows
    if not parts:
        raise InputDataError("tune: the sample has no rows")
    out: dict[str, np.ndarray] = {}
    for k in list(parts[0]):
        out[k] = np.concatenate([p.pop(k) for p in parts])  # one column at a time: the batches go as it grows
    return out


# --------------------------------------------------------------------------- evaluation


def _bucket_labels(units: np.ndarray) -> np.ndarray:
    idx = np.searchsorted(np.asarray(BUCKET_EDGES), units, side="right") - 1
    labels = [f"[{BUCKET_EDGES[i]},{BUCKET_EDGES[i + 1]})" for i in range(len(BUCKET_EDGES) - 1)]
    labels.append(f">={BUCKET_EDGES[-1]}")
    return np.asarray(labels, dtype=object)[np.clip(idx, 0, len(labels) - 1)]


def _bucket_order(labels: np.ndarray) -> list[str]:
    present = set(labels.tolist())
    return [str(b) for b in _bucket_labels(np.asarray(BUCKET_EDGES)).tolist() if b in present]


@dataclass
class TuneStatistics:
    """What scoring reads of a sample (``dpops.analysis.tune_stats``): per-partition statistics (one array per
    key, partitions in order of first appearance) and the unit-level drop counts. Computed in this process
    from a public sample (``sample_statistics``) or on Beam workers from a flagged private read
    (``dpops.release.tuning``); the scoring (``score``) is the same function of them either way."""

    partitions: dict[str, np.ndarray]
    units: dict[str, list[int]]

    @property
    def n_rows(self) -> int:
        """Rows that survived the release's input checks."""
        return int(self.units["rows"][0])


@dataclass
class _Truth:
    """What every candidate shares: the sample's exact per-partition values (computed once)."""

    n_parts: int  # partitions present in the sample
    stats: Mapping[str, np.ndarray]
    count: np.ndarray
    units: np.ndarray
    bucket: np.ndarray

    def get(self, key: str) -> np.ndarray:
        """The statistic ``key`` (``tune_stats.partition_statistics``' names)."""
        return self.stats[key]


@dataclass
class _Bounded:
    """The statistics of the rows bounding keeps at one (L0, Linf), and what each step dropped."""

    stats: Mapping[str, np.ndarray]
    prefix: str
    count: np.ndarray
    units: np.ndarray
    drops: dict[str, float]

    def get(self, key: str) -> np.ndarray:
        """The statistic ``key`` at this (L0, Linf)."""
        return self.stats[self.prefix + key]

    def bounded_sum(self, col: str) -> np.ndarray:
        """Per partition: the sum of the kept rows' unclipped values of ``col``."""
        return self.get(f"sum|{col}")

    def clipped_sum(self, col: str, lo: float, hi: float) -> np.ndarray:
        """Per partition: the sum of the kept rows' values of ``col`` clipped to [lo, hi]."""
        return self.get(f"csum|{clip_key(col, lo, hi)}")


def _truth(stats: TuneStatistics) -> _Truth:
    t = stats.partitions
    return _Truth(len(t["count"]), t, t["count"], t["units"], _bucket_labels(t["units"]))


def _bound(stats: TuneStatistics, l0: int, linf: int) -> _Bounded:
    """The statistics at (l0, linf) and the drop shares (``bound_contributions``' own counters over the rows:
    L0 drops whole (unit, partition) pairs, Linf rows of kept pairs)."""
    pre = bound_prefix(l0, linf)
    n_rows, n_units = stats.units["rows"][0], stats.units["units"][0]
    r_l0, r_linf, u_l0, u_linf = stats.units[pre]
    drops = {"rows_dropped_l0": float(r_l0) / max(1, n_rows), "rows_dropped_linf": float(r_linf) / max(1, n_rows),
             "units_dropped_l0": int(u_l0) / max(1, n_units), "units_dropped_linf": int(u_linf) / max(1, n_units)}
    t = stats.partitions
    return _Bounded(t, pre, t[pre + "count"], t[pre + "units"], drops)


def _noise(plan: ReleasePlan, confidence: float) -> dict[str, tuple[float, float]]:
    """(std, (1-alpha) half-width) per evaluated metric key, from the plan's predictions.

    count, unit_count, sum: of the released vector. mean: at _REF_UNITS rows (scaled by _REF_UNITS / n
    per bucket: at first order a mean's error is (E_nsum - d E_count) / n; ``accuracy.mean_error`` is exact
    at _REF_UNITS, and this scaling is tune's approximation for other sizes)."""
    from dpops.analysis.accuracy import predict

    out: dict[str, tuple[float, float]] = {}
    for p in predict(plan, confidence=confidence, at_units=_REF_UNITS):
        if p.type in EVALUATED_TYPES and p.std is not None and p.abs_error is not None:
            out[p.metric] = (float(p.std), float(p.abs_error))
    return out


def _keep_prob(plan: ReleasePlan, units: np.ndarray) -> np.ndarray:
    ps = plan.partition_selection
    if ps is None:
        return np.ones(len(units))
    return np.asarray(ps.keep_probability(units.astype(np.int64)), dtype=np.float64)


def evaluate_candidate(spec: ReleaseSpec, cand: Candidate, plan: ReleasePlan, truth: _Truth, bounded: _Bounded,
                       confidence: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows of one candidate (``plan``: its ``plan_release``) from the sample's truth and its (L0, Linf)
    statistics."""
    noise = _noise(plan, confidence)
    keep_p = _keep_prob(plan, bounded.units)
    n = truth.n_parts
    out: list[dict[str, Any]] = []
    target_errs: dict[str, dict[str, np.ndarray]] = {}
    for m in plan.metrics:
        if m.type in _OTHER_TYPES:
            extra, errs = _OTHER_TYPES[m.type](plan, m, truth, bounded, confidence)
            for r in extra:
                out.append({"candidate": cand.label, "l0": cand.l0, "linf": cand.linf, **r,
                            "expected_partitions_kept": float(np.sum(keep_p[truth.bucket == r["bucket"]]))})
            if errs is not None:
                target_errs[m.key] = errs
            continue
        if m.type not in EVALUATED_TYPES or m.key not in noise:
            continue
        std, half = noise[m.key]
        if m.type == "count":
            true, est_b, est_c = truth.count, bounded.count, bounded.count
        elif m.type == "unit_count":
            true, est_b, est_c = truth.units, bounded.units, bounded.units
        else:
            assert m.bounds is not None and m.column is not None  # sum and mean are bounded metrics
            col = m.column
            lo, hi = float(m.bounds[0]), float(m.bounds[1])
            sum_b = bounded.bounded_sum(col)
            sum_c = bounded.clipped_sum(col, lo, hi)
            if m.type == "sum":
                true, est_b, est_c = truth.get(f"sum|{col}"), sum_b, sum_c
            else:
                with np.errstate(invalid="ignore", divide="ignore"):
                    true = truth.get(f"sum|{col}") / truth.count
                    est_b = np.where(bounded.count > 0, sum_b / np.maximum(bounded.count, 1), (lo + hi) / 2)
                    est_c = np.where(bounded.count > 0, sum_c / np.maximum(bounded.count, 1), (lo + hi) / 2)
        if m.type == "mean":
            scale = _REF_UNITS / np.maximum(bounded.count, 1.0)
            std_p, half_p = std * scale, half * scale
        else:
            std_p, half_p = np.full(n, std), np.full(n, half)
        bias_bound = est_b - true
        bias_clip = est_c - est_b
        bias = est_c - true
        rmse = np.sqrt(std_p ** 2 + bias ** 2)
        denom = np.maximum(np.abs(true), 1e-12)
        rel = rmse / denom
        err = half_p + np.abs(bias)
        target_errs[m.key] = {"abs": err, "rel": err / denom, "units": truth.units}
        for b in _bucket_order(truth.bucket):
            sel = truth.bucket == b
            out.append({
                "candidate": cand.label, "l0": cand.l0, "linf": cand.linf, "metric": m.key, "type": m.type,
                "bounds": None if m.bounds is None else [float(m.bounds[0]), float(m.bounds[1])],
                "bucket": b, "partitions": int(np.count_nonzero(sel)),
                "noise_std": float(np.mean(std_p[sel])), "bias_bounding": float(np.mean(bias_bound[sel])),
                "bias_clipping": float(np.mean(bias_clip[sel])), "rmse": float(np.sqrt(np.mean(rmse[sel] ** 2))),
                "relative_rmse": float(np.mean(rel[sel])),
                "expected_partitions_kept": float(np.sum(keep_p[sel])),
            })
    rels = [r["relative_rmse"] for r in out if r.get("relative_rmse") is not None]  # top_k has none
    summary = {"candidate": cand.label, "l0": cand.l0, "linf": cand.linf,
               "bounds": {c: [lo, hi] for c, lo, hi in cand.bounds} or None,
               "split": dict(cand.split) if cand.split is not None else None,
               **bounded.drops, "partitions": n, "expected_partitions_kept": float(np.sum(keep_p)),
               "mean_relative_rmse": float(np.mean(rels)) if rels else math.inf,
               "max_relative_rmse": float(np.max(rels)) if rels else math.inf}
    summary["target_ratio"], summary["binding_target"] = _target_ratio(spec, plan, target_errs)
    return out, summary


def _buckets(truth: _Truth, m: MetricPlan, quantity: str, cols: Mapping[str, np.ndarray | None],
             rms: Sequence[str] = ("rmse",)) -> list[dict[str, Any]]:
    """Per size bucket: the mean of each per-partition array in ``cols`` (root mean square for ``rms``)."""
    out = []
    for b in _bucket_order(truth.bucket):
        sel = truth.bucket == b
        row: dict[str, Any] = {"metric": m.key, "type": m.type, "quantity": quantity,
                               "bounds": None if m.bounds is None else [float(m.bounds[0]), float(m.bounds[1])],
                               "bucket": b, "partitions": int(np.count_nonzero(sel))}
        for k, arr in cols.items():
            if arr is None:
                row[k] = None
            elif k in rms:
                row[k] = float(np.sqrt(np.mean(arr[sel] ** 2)))
            else:
                row[k] = float(np.mean(arr[sel]))
        out.append(row)
    return out


def _variance_rows(plan: ReleasePlan, m: MetricPlan, truth: _Truth, bounded: _Bounded, confidence: float
                   ) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
    """Variance: bias from bounding and clipping on the sample's exact per-partition moments; the noise of
    each partition from ``accuracy.first_order_variance_error`` at its bounded row count and clipped centred moments
    (the release's three noisy vectors, first order in 1/n). The released value is clamped to [0, h^2]."""
    from dpops.analysis.accuracy import first_order_variance_error

    assert m.bounds is not None and m.column is not None
    col, lo, hi = m.column, float(m.bounds[0]), float(m.bounds[1])
    n, mid, h = truth.n_parts, (lo + hi) / 2.0, (hi - lo) / 2.0
    t2 = truth.get(f"sq|{col}")
    b1 = bounded.bounded_sum(col)
    b2 = bounded.get(f"sq|{col}")
    c1 = bounded.clipped_sum(col, lo, hi)
    c2 = bounded.get(f"csq|{clip_key(col, lo, hi)}")
    tc, bc = np.maximum(truth.count, 1.0), np.maximum(bounded.count, 1.0)
    true = np.maximum(t2 / tc - (truth.get(f"sum|{col}") / tc) ** 2, 0.0)
    var_b = np.maximum(b2 / bc - (b1 / bc) ** 2, 0.0)
    var_c = np.clip(c2 / bc - (c1 / bc) ** 2, 0.0, h * h)
    m1 = c1 / bc - mid
    m2 = c2 / bc - 2 * mid * c1 / bc + mid * mid
    std = np.empty(n)
    half = np.empty(n)
    # one partition at a time: the owner of the formula is accuracy.first_order_variance_error. Tuning keeps the
    # first-order noise (prediction versions 1-2): the exact one (accuracy.variance_error, version 3) costs about
    # a second per distinct partition, too slow for a search over candidate bounds on every partition.
    for i in range(n):
        std[i], half[i], _, _ = first_order_variance_error(plan, m, int(bc[i]), float(m1[i]), float(m2[i]),
                                                           confidence)
    bias = var_c - true
    rmse = np.sqrt(std ** 2 + bias ** 2)
    denom = np.maximum(np.abs(true), 1e-12)
    err = half + np.abs(bias)
    rows_out = _buckets(truth, m, "variance", {"noise_std": std, "bias_bounding": var_b - true,
                                               "bias_clipping": var_c - var_b, "rmse": rmse,
                                               "relative_rmse": rmse / denom})
    return rows_out, {"abs": err, "rel": err / denom, "units": truth.units}


def _quantile_rows(plan: ReleasePlan, m: MetricPlan, truth: _Truth, bounded: _Bounded, confidence: float
                   ) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
    """Quantiles: per partition and quantile, the noiseless pick of the release's histogram utility on the
    bounded, clipped rows (``pipelines.bounding.quantile_bins``: the grid candidate of least |rank - q n|)
    against the true quantile of the raw rows (inverted CDF), split into the bias from bounding (the bounded
    rows' raw quantile minus the true one) and from clipping and the grid (the pick minus that). The
    noise is the plan's expected rank error E (``accuracy.quantile_typical_rank_error``, rows, the prediction
    targets are judged by): reported as is, as a
    fraction of the partition's bounded rows (what a rank_error target judges), and in value units as half
    the span of grid candidates within E ranks of the pick on the sample's own histogram."""
    from dpops.analysis.accuracy import quantile_typical_rank_error
    from pipelines.bounding import quantile_candidates

    assert m.bounds is not None and m.column is not None and m.n_bins is not None
    col, lo, hi, nb = m.column, float(m.bounds[0]), float(m.bounds[1]), int(m.n_bins)
    n = truth.n_parts
    cand = quantile_candidates(lo, hi, nb)
    hist = bounded.get(f"hist|{clip_key(col, lo, hi)}|{nb}")
    ranks = np.cumsum(hist, axis=1)
    total = ranks[:, -1].astype(np.float64)
    e_rank = quantile_typical_rank_error(m)
    bcount = bounded.count.astype(np.int64)
    out: list[dict[str, Any]] = []
    worst_rank = np.zeros(n)
    for q, suffix in zip(m.quantiles, m.quantile_suffixes, strict=True):
        pick = np.argmin(np.abs(ranks - q * total[:, None]), axis=1)
        est_c = cand[pick]
        true = truth.get(f"q|{q_key(col, q)}")  # the raw rows' inverted-CDF quantile (tune_stats)
        has = bcount > 0
        bnd = np.where(has, bounded.get(f"q|{q_key(col, q)}"), est_c)  # every row dropped: all the error is bounding's
        r0 = ranks[np.arange(n), pick][:, None]
        lo_j = np.sum(ranks < r0 - e_rank, axis=1)
        hi_j = np.minimum(np.sum(ranks < r0 + e_rank, axis=1), nb)
        noise_v = (cand[hi_j] - cand[lo_j]) / 2.0
        bias = est_c - true
        rmse = np.sqrt(noise_v ** 2 + bias ** 2)
        denom = np.maximum(np.abs(true), 1e-12)
        frac = e_rank / np.maximum(bcount, 1)
        worst_rank = np.maximum(worst_rank, frac)
        out.extend(_buckets(truth, m, suffix, {
            "noise_std": None, "noise_value_error": noise_v, "expected_rank_error": np.full(n, e_rank),
            "rank_error_fraction": frac, "bias_bounding": bnd - true, "bias_clipping": est_c - bnd, "rmse": rmse,
            "relative_rmse": rmse / denom}))
    return out, {"rank": worst_rank, "units": truth.units}


def _top_k_rows(plan: ReleasePlan, m: MetricPlan, truth: _Truth, bounded: _Bounded, confidence: float
                ) -> tuple[list[dict[str, Any]], None]:
    """top_k: whether bounding changed a partition's top category (true counts on all rows against counts on
    the bounded rows, values outside the declared domain not counted, as in the release), and the plan's
    probability of returning the true top category first at the lead it has in the bounded counts
    (``accuracy.top_pick``; 0 where bounding made another category lead: a lower bound). No RMSE: the output
    is a category, not a number, so top_k rows take no part in the RMSE losses."""
    from dpops.analysis.accuracy import top_pick

    assert m.column is not None and m.domain is not None
    col, k, n = m.column, len(m.domain), truth.n_parts
    tc = truth.get(f"cat|{col}")
    bc = bounded.get(f"cat|{col}")
    top = np.argmax(tc, axis=1)
    lead = bc[np.arange(n), top]
    others = bc.copy()
    others[np.arange(n), top] = -1
    gap = lead - (others.max(axis=1) if k > 1 else np.zeros(n, np.int64))
    cache: dict[int, float] = {}
    prob = np.array([cache.setdefault(int(g), top_pick(m, int(g))) if g >= 0 else 0.0 for g in gap])
    changed = (np.argmax(bc, axis=1) != top).astype(np.float64)
    return _buckets(truth, m, "rank1", {"top_pick_probability": prob, "top_changed_by_bounding": changed,
                                        "noise_std": None, "rmse": None, "relative_rmse": None}), None


_OTHER_TYPES: dict[str, Callable[..., tuple[list[dict[str, Any]], dict[str, np.ndarray] | None]]] = {
    "variance": _variance_rows, "quantiles": _quantile_rows, "top_k": _top_k_rows}


def _target_ratio(spec: ReleaseSpec, plan: ReleasePlan, errs: Mapping[str, Mapping[str, np.ndarray]]
                  ) -> tuple[float | None, str | None]:
    """Worst (achieved / allowed) over the spec's targets: <= 1 means every target is met on the sample; and
    which target that worst ratio is (the binding one, in words: what a user must relax or pay for).

    An error target on metric m at n units is judged on the sample's partitions in the size bucket of n
    (all partitions if that bucket is empty): achieved = mean of (noise half-width + |bias|), absolute or
    relative to the partition's true value. A rank_error target compares the expected rank error as a
    fraction of the bucket's bounded rows with max_rank_error. A keep target compares P(not kept at n) with
    the allowed 1 - min_probability. top_pick targets are not judged here (None if no target is left)."""
    if spec.accuracy is None:
        return None, None
    worst: float | None = None
    binding: str | None = None
    for i, t in enumerate(spec.accuracy.targets):
        ratio: float | None = None
        if t.kind == "error" and t.metric in errs:
            e = errs[t.metric]
            lab = _bucket_labels(np.asarray([t.at_units]))[0]
            sel = _bucket_labels(e["units"]) == lab
            if not sel.any():
                sel = np.ones(len(e["units"]), bool)
            if t.max_error is not None:
                ratio = float(np.mean(e["abs"][sel])) / float(t.max_error)
            if t.max_relative_error is not None:
                r2 = float(np.mean(e["rel"][sel])) / float(t.max_relative_error)
                ratio = r2 if ratio is None else max(ratio, r2)
        elif t.kind == "rank_error" and t.metric in errs and "rank" in errs[t.metric]:
            e = errs[t.metric]
            lab = _bucket_labels(np.asarray([t.at_units]))[0]
            sel = _bucket_labels(e["units"]) == lab
            if not sel.any():
                sel = np.ones(len(e["units"]), bool)
            ratio = float(np.mean(e["rank"][sel])) / float(t.max_rank_error)
        elif t.kind == "keep":
            p = float(_keep_prob(plan, np.asarray([t.at_units]))[0])
            ratio = (1.0 - p) / (1.0 - float(t.min_probability))
        if ratio is not None and (worst is None or ratio > worst):
            worst = ratio
            metric = getattr(t, "metric", None)
            binding = (f"accuracy.targets[{i}] ({t.kind}" + (f" on {metric}" if metric else "")
                       + f" at {getattr(t, 'at_units', '?')} units)")
    return worst, binding


@dataclass
class TuneSetup:
    """A tune run before any data is read: the spec, the grid, each candidate's plan, what the scoring will read
    of the sample (``needs``, public: a function of spec and grid), the read's configuration and the loss."""

    spec: ReleaseSpec
    grid: list[Candidate]
    plans: list[ReleasePlan]
    needs: StatNeeds
    read: ReadConfig
    confidence: float
    loss: str | None
    not_evaluated: list[str]


def prepare_tune(spec: ReleaseSpec | str | os.PathLike[str] | Mapping[str, Any], *,
                 grid: Sequence[Candidate] | None = None, loss: str | None = None,
                 confidence: float | None = None) -> TuneSetup:
    """Everything checkable before the read: the spec (a spec with ``metrics[].contribution`` is refused), the
    grid (default ``default_grid``), the loss's name, and each candidate's ``plan_release``. A private read
    (``dpops.release.tuning``) runs this before the ledger records the access, so a bad grid costs no entry."""
    from dpops.analysis.loading import load
    from dpops.release_plan import plan_release

    s = load(spec)
    refuse_metric_contributions(s, "dpops tune", "tune a copy without metrics[].contribution, or choose those "
                                                 "metrics' bounds with dpops plan")
    cands = list(default_grid(s) if grid is None else grid)
    if not cands:
        raise InvalidParameter("tune: the grid is empty")
    if loss is not None and loss not in LOSSES:
        raise InvalidParameter(f"tune: loss must be one of {LOSSES}, got {loss!r}")
    conf = float(confidence if confidence is not None else (s.accuracy.confidence if s.accuracy else 0.95))
    plan0 = plan_release(s)
    plans = [plan_release(candidate_spec(s, c)) for c in cands]
    not_eval = [m.key for m in plan0.metrics if m.type not in EVALUATED_TYPES]
    return TuneSetup(s, cands, plans, statistic_needs(plan0, cands, plans), read_config(s, plan0), conf, loss,
                     not_eval)


def statistic_needs(plan0: ReleasePlan, grid: Sequence[Candidate], plans: Sequence[ReleasePlan]) -> StatNeeds:
    """What the scoring reads of the sample for ``grid`` (candidate i's plan is ``plans[i]``): per metric type,
    the statistics ``evaluate_candidate`` looks up, at each distinct (L0, Linf) of the grid."""
    from dpops.analysis.tune_stats import BoundNeeds
    from pipelines.bounding import metric_layout

    squares: dict[str, None] = {}
    tq: dict[tuple[str, float], None] = {}
    cats: dict[tuple[str, int], None] = {}
    per: dict[tuple[int, int], dict[str, dict[Any, None]]] = {}
    for cand, plan in zip(grid, plans, strict=True):
        b = per.setdefault((cand.l0, cand.linf), {k: {} for k in ("clipped", "squares", "clipped_squares", "hists",
                                                                   "quantiles", "categories")})
        for m in plan.metrics:
            if m.type in ("sum", "mean", "variance"):
                assert m.bounds is not None and m.column is not None
                b["clipped"][(m.column, float(m.bounds[0]), float(m.bounds[1]))] = None
            if m.type == "variance":
                assert m.bounds is not None and m.column is not None
                squares[m.column] = None
                b["squares"][m.column] = None
                b["clipped_squares"][(m.column, float(m.bounds[0]), float(m.bounds[1]))] = None
            if m.type == "quantiles":
                assert m.bounds is not None and m.column is not None and m.n_bins is not None
                b["hists"][(m.column, float(m.bounds[0]), float(m.bounds[1]), int(m.n_bins))] = None
                for q in m.quantiles:
                    tq[(m.column, float(q))] = None
                    b["quantiles"][(m.column, float(q))] = None
            if m.type == "top_k":
                assert m.column is not None and m.domain is not None
                cats[(m.column, len(m.domain))] = None
                b["categories"][(m.column, len(m.domain))] = None
    bounds = tuple(BoundNeeds(l0, linf, **{k: tuple(v) for k, v in d.items()}) for (l0, linf), d in per.items())
    return StatNeeds(value_columns=tuple(metric_layout(plan0)[0]), l0_floor=min(c.l0 for c in grid),
                     linf_floor=min(c.linf for c in grid), squares=tuple(squares), quantiles=tuple(tq),
                     categories=tuple(cats), bounds=bounds)


def sample_statistics(setup: TuneSetup, sample: str | os.PathLike[str] | pa.Table | pd.DataFrame,
                      seed: int | None, fmt: str | None = None) -> TuneStatistics:
    """The driver path: a PUBLIC sample read into this process (``_prepare``), ranked once and reduced to the
    statistics the scoring reads (``tune_stats``; the Beam path of a private read computes the same on workers).
    The caller has checked that the sample is public (``tune``)."""
    from dpops.analysis.tune_stats import partition_statistics, rank_rows, unit_counts

    rows = _prepare(setup.spec, setup.read, sample, seed, fmt)  # the ONE read
    if not len(rows["u"]):
        raise InputDataError("tune: no row of the sample survives the release's input checks (types, nulls, "
                             "public partitions)")
    rows["pos"] = np.arange(len(rows["u"]), dtype=np.int64)  # the read's order
    ranked = rank_rows(rows, setup.needs.l0_floor, setup.needs.linf_floor)
    del rows
    return TuneStatistics(partition_statistics(ranked, setup.needs), unit_counts(ranked, setup.needs))


def score(setup: TuneSetup, stats: TuneStatistics) -> TuneResult:
    """Every candidate scored from the sample's statistics alone (no row is read here) and the recommendation:
    the least loss (``setup.loss``; default ``targets`` when a candidate has a target ratio, else
    ``mean_relative_rmse``)."""
    if not stats.n_rows:
        raise InputDataError("tune: no row of the sample survives the release's input checks (types, nulls, "
                             "public partitions)")
    s, grid = setup.spec, setup.grid
    truth = _truth(stats)
    per_cand: list[tuple[list[dict[str, Any]], dict[str, Any]] | None] = [None] * len(grid)
    by_key: dict[tuple[int, int], list[int]] = {}
    for i, cand in enumerate(grid):
        by_key.setdefault((cand.l0, cand.linf), []).append(i)
    for (l0, linf), idxs in by_key.items():
        bounded = _bound(stats, l0, linf)
        for i in idxs:
            per_cand[i] = evaluate_candidate(s, grid[i], setup.plans[i], truth, bounded, setup.confidence)
    all_rows: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    for item in per_cand:
        assert item is not None
        all_rows.extend(item[0])
        summaries.append(item[1])
    loss = setup.loss
    if loss is None:
        loss = "targets" if any(x["target_ratio"] is not None for x in summaries) else "mean_relative_rmse"
    key_name = "target_ratio" if loss == "targets" else loss
    losses = [x[key_name] if x[key_name] is not None else math.inf for x in summaries]
    for x, lv in zip(summaries, losses, strict=True):
        x["loss"] = lv
    best = int(np.argmin(np.asarray(losses)))
    return TuneResult(s, grid, all_rows, summaries, best, loss, list(setup.not_evaluated), stats.n_rows, 1)


def tune(spec: ReleaseSpec | str | os.PathLike[str] | Mapping[str, Any],
         sample: str | os.PathLike[str] | pa.Table | pd.DataFrame | SampleAccess, *,
         grid: Sequence[Candidate] | None = None,
         loss: str | None = None, confidence: float | None = None, seed: int | None = None) -> TuneResult:
    """Evaluate ``grid`` (default ``default_grid``) on a PUBLIC ``sample`` in one pass; recommend the least loss.

    ``loss``: ``targets`` (worst achieved/allowed ratio over the spec's accuracy targets; the default
    when the spec has targets tune can judge), ``mean_relative_rmse`` (the default otherwise) or
    ``max_relative_rmse``. ``seed`` makes the bounding's random choices reproducible (tests).

    A *path* is checked by ``dpops.analysis.sample_access.check_public_sample`` as a public sample (issue 25
    item 7a: a path under a data root, or a link or copy of the spec's private input, is refused here). A
    private read is not this function's: it is recorded in the ledger first and computed by Beam workers, so
    that only the statistics reach this process (``dpops.release.tuning.tune_private``, what the CLI's private
    flag runs); a private ``SampleAccess`` is refused here. A caller passing a table, or a public
    ``SampleAccess`` it built, vouches that it is public data.
    """
    from dpops.analysis.sample_access import SampleAccess, check_public_sample, pinned_sample

    setup = prepare_tune(spec, grid=grid, loss=loss, confidence=confidence)
    if isinstance(sample, (str, os.PathLike)):
        sample = check_public_sample(setup.spec, sample)  # public only: never a private read without its ledger entry
    if isinstance(sample, SampleAccess):
        if sample.private:
            raise InvalidParameter(f"tune: {sample.location} is private data (ledger entry {sample.entry_id}): a "
                                   "private read runs on Beam workers; call dpops.release.tuning.tune_private(spec, "
                                   "access, ...) (what dpops tune --i-understand-this-reads-private-data runs)")
        # the file that passed the checks, opened once: no symlink or rename after the check is followed
        with pinned_sample(setup.spec, sample) as held:
            stats = sample_statistics(setup, held, seed, fmt=sample_format(setup.spec, sample.location))
        return score(setup, stats)
    return score(setup, sample_statistics(setup, sample, seed))


__all__ = ["Candidate", "TuneResult", "TuneSetup", "TuneStatistics", "tune", "prepare_tune", "sample_statistics",
           "score", "statistic_needs", "read_config", "read_stream", "batch_stream", "default_grid", "grid_from_doc",
           "spec_patch", "apply_patch", "load_patched", "candidate_spec", "evaluate_candidate", "sample_table",
           "EVALUATED_TYPES", "LOSSES"]
