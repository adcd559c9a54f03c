"""Accuracy targets (``accuracy:`` in the spec) checked against a release plan's predictions.

A target is met or not by the plan's public parameters alone (``dpops.analysis.accuracy``), so checking
one costs nothing. ``evaluate`` is what ``spec check``, ``plan --solve``, the manifest and ``manifest
verify`` all call: one owner for "does this budget meet that target".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dpops.analysis.accuracy import (
    first_order_mean_halfwidth,
    first_order_variance_error,
    mean_halfwidth,
    quantile_rank_error,
    quantile_typical_rank_error,
    sum_error,
    top_pick,
    variance_halfwidth,
    vector_error,
)
from dpops.errors import InvalidParameter
from dpops.spec import ErrorTarget, KeepTarget, RankTarget, TopPickTarget

# What the predictions of a version mean (a manifest records the version it was evaluated with, as
# ``accuracy.schema``, and verify recomputes with that version; a version's meaning never changes):
# 1: means at first order in 1/n, quantiles at the data-free bound on the expected rank error; 2: means exact
# at every n (the noisy count in the denominator, the clipping), quantiles at the expected rank error of data
# dense around the quantile (``accuracy.quantile_typical_rank_error``); 3: as 2, and variances exact at every n
# (``accuracy.variance_error``: the noisy count in the denominator, the squared mean noise, the clipping; 1-2
# were first order, ``accuracy.first_order_variance_error``), sums with a true value (``at_value``) the
# released value clamped at 0 where the release clamps (``accuracy.sum_error``; 1-2: the raw noise).
PREDICTION_VERSIONS = (1, 2, 3)
CURRENT_PREDICTION = 3

if TYPE_CHECKING:
    from dpops.release_plan import MetricPlan, ReleasePlan
    from dpops.spec import AccuracySpec, ReleaseSpec

PARTITION_SELECTION_KEY = "partition_selection"
Target = ErrorTarget | KeepTarget | RankTarget | TopPickTarget


@dataclass(frozen=True)
class TargetResult:
    """One target against the plan: what it asks, what the plan predicts, and by how much it misses."""

    index: int
    kind: str
    metric: str  # metric key, or "partition_selection"
    measure: str  # "abs_error", "rel_error", "keep_probability", "rank_error_fraction", "top_pick_probability"
    target: float
    predicted: float
    met: bool
    shortfall: float  # 0 when met; else how far off, relative: predicted/target - 1 (errors) or 1 - p/target
    description: str

    def to_dict(self) -> dict[str, Any]:
        """JSON form (a predicted infinity becomes None)."""
        d = asdict(self)
        for k in ("predicted", "shortfall"):
            if isinstance(d[k], float) and not math.isfinite(d[k]):
                d[k] = None
        return d


def target_key(t: Target) -> str:
    """The budget-split key a target depends on: its metric, or ``partition_selection``."""
    return PARTITION_SELECTION_KEY if isinstance(t, KeepTarget) else t.metric


def _metric(plan: ReleasePlan, key: str) -> MetricPlan:
    for m in plan.metrics:
        if m.key == key:
            return m
    raise InvalidParameter(f"accuracy target names metric {key!r}, which the release plan does not have")


def rows_at(plan: ReleasePlan, t: ErrorTarget | RankTarget) -> int:
    """Rows of the partition a target is about: ``at_units`` units with ``rows_per_unit`` rows each, of which
    bounding keeps at most Linf (``max_rows_per_unit_per_partition``: the target metric's own when it has
    per-metric bounds, ``MetricPlan.contribution``); never fewer than ``at_units``."""
    own = _metric(plan, t.metric).contribution
    linf = plan.max_rows_per_unit_per_partition if own is None else own[1]
    per_unit = min(float(t.rows_per_unit), float(linf))
    return max(int(t.at_units), int(math.floor(t.at_units * per_unit * (1 + 1e-12))))


def _rows_text(plan: ReleasePlan, t: ErrorTarget | RankTarget) -> str:
    rows = rows_at(plan, t)
    return f"{t.at_units} units" if rows == t.at_units else f"{t.at_units} units, {rows} rows"


def _default_value(plan: ReleasePlan, m: MetricPlan, t: ErrorTarget) -> float:
    """The true value a relative error is measured against when the target gives none: the partition's rows
    for a count, its units for everything else (unit_count; sums need ``at_value``, which the spec requires)."""
    if t.at_value is not None:
        return float(t.at_value)
    return float(rows_at(plan, t)) if m.type == "count" else float(t.at_units)


def evaluate_one(plan: ReleasePlan, t: Target, confidence: float, index: int = 0,
                 version: int = CURRENT_PREDICTION) -> TargetResult:
    """Evaluate one target against ``plan`` (see ``dpops.spec.ErrorTarget`` and friends for the meaning) with
    prediction ``version`` (``PREDICTION_VERSIONS``)."""
    if isinstance(t, KeepTarget):
        if plan.partition_selection is None:
            raise InvalidParameter("a keep target needs private partition selection")
        p = float(plan.partition_selection.keep_probability(np.array([t.at_units]))[0])
        return _higher(index, "keep", PARTITION_SELECTION_KEY, "keep_probability", t.min_probability, p,
                       f"P(keep a partition of {t.at_units} units) >= {t.min_probability:g}")
    m = _metric(plan, t.metric)
    if isinstance(t, RankTarget):
        if version not in PREDICTION_VERSIONS:
            raise InvalidParameter(f"unknown accuracy prediction version {version!r}; known: {PREDICTION_VERSIONS}")
        frac = (quantile_rank_error(m) if version == 1 else quantile_typical_rank_error(m)) / rows_at(plan, t)
        return _lower(index, "rank_error", m.key, "rank_error_fraction", t.max_rank_error, frac,
                      f"{m.key}: expected rank error <= {t.max_rank_error:g} of {rows_at(plan, t)} rows")
    if isinstance(t, TopPickTarget):
        p = top_pick(m, t.at_gap)
        return _higher(index, "top_pick", m.key, "top_pick_probability", t.min_probability, p,
                       f"{m.key}: P(true top first | lead {t.at_gap}) >= {t.min_probability:g}")
    conf = float(t.confidence if t.confidence is not None else confidence)
    half = error_halfwidth(plan, m, t, conf, version)
    if t.max_error is not None:
        return _lower(index, "error", m.key, "abs_error", t.max_error, half,
                      f"{m.key}: |error| <= {t.max_error:g} at {_rows_text(plan, t)} with {conf:.0%} confidence")
    value = _default_value(plan, m, t)
    rel = half / abs(value)
    return _lower(index, "error", m.key, "rel_error", float(t.max_relative_error or 0.0), rel,
                  f"{m.key}: relative error <= {t.max_relative_error:g} at true value {value:g} "
                  f"({_rows_text(plan, t)}) with {conf:.0%} confidence")


def target_met(plan: ReleasePlan, t: Target, confidence: float) -> bool:
    """``evaluate_one(...).met``, faster for single-vector error targets (what the solver bisects on).

    For count, unit_count and sum, half-width <= x holds iff the noise covers the largest lattice h with
    h·r (+ r/2 on a grid) <= x with probability >= confidence (coverage is monotone in h), which is one
    tail evaluation instead of a search for the half-width.
    """
    if isinstance(t, ErrorTarget):
        m = _metric(plan, t.metric)
        if m.type in ("count", "unit_count", "sum"):
            p = m.vectors[0].params
            conf = float(t.confidence if t.confidence is not None else confidence)
            x = t.max_error if t.max_error is not None else float(t.max_relative_error or 0.0) * abs(
                _default_value(plan, m, t))
            room = float(x) - (0.0 if p.integer_valued else p.resolution / 2)
            if room < 0:
                return False
            h = math.floor(room / p.resolution * (1 + 1e-15))
            while (h + 1) * p.resolution + (0.0 if p.integer_valued else p.resolution / 2) <= x:
                h += 1  # float rounding of the division
            while h >= 0 and h * p.resolution + (0.0 if p.integer_valued else p.resolution / 2) > x:
                h -= 1
            return h >= 0 and p.noise_coverage(h) >= conf
    return evaluate_one(plan, t, confidence).met


def error_halfwidth(plan: ReleasePlan, m: MetricPlan, t: ErrorTarget, confidence: float,
                    version: int = CURRENT_PREDICTION) -> float:
    """The (confidence) half-width an error target is compared with (worst case where the target is silent),
    as prediction ``version`` computes it."""
    if version not in PREDICTION_VERSIONS:
        raise InvalidParameter(f"unknown accuracy prediction version {version!r}; known: {PREDICTION_VERSIONS}")
    if m.type == "sum" and version >= 3:
        return sum_error(plan, m, t.at_value, confidence)[1]
    if m.type in ("count", "unit_count", "sum"):
        return vector_error(m.vectors[0].params, confidence)[1]
    lo, hi = m.bounds or (0.0, 0.0)
    mid, h = (lo + hi) / 2.0, (hi - lo) / 2.0
    if m.type == "mean":
        offset = None if t.at_value is None else t.at_value - mid
        if version == 1:
            return first_order_mean_halfwidth(plan, m, rows_at(plan, t), offset, confidence)
        return mean_halfwidth(plan, m, rows_at(plan, t), offset, confidence)[0]
    if m.type == "variance":
        m2 = h * h if t.at_value is None else max(0.0, min(h * h, float(t.at_value)))
        if version < 3:
            return first_order_variance_error(plan, m, rows_at(plan, t), 0.0, m2, confidence)[1]
        return variance_halfwidth(plan, m, rows_at(plan, t), 0.0, m2, confidence)
    raise InvalidParameter(f"an error target does not apply to a {m.type} metric")


def _lower(index: int, kind: str, key: str, measure: str, target: float, predicted: float, text: str) -> TargetResult:
    met = predicted <= target
    return TargetResult(index, kind, key, measure, float(target), float(predicted), met,
                        0.0 if met else predicted / target - 1.0, text)


def _higher(index: int, kind: str, key: str, measure: str, target: float, predicted: float, text: str) -> TargetResult:
    met = predicted >= target
    return TargetResult(index, kind, key, measure, float(target), float(predicted), met,
                        0.0 if met else 1.0 - predicted / target, text)


def evaluate(plan: ReleasePlan, accuracy: AccuracySpec | None, version: int = CURRENT_PREDICTION
             ) -> list[TargetResult]:
    """Every target of ``accuracy`` against ``plan`` (empty when the spec declares none)."""
    if accuracy is None:
        return []
    return [evaluate_one(plan, t, float(accuracy.confidence), i, version) for i, t in enumerate(accuracy.targets)]


def evaluate_spec(spec: ReleaseSpec) -> list[TargetResult]:
    """``evaluate`` for the spec's own plan and targets."""
    from dpops.release_plan import plan_release

    return evaluate(plan_release(spec), spec.accuracy)


__all__ = ["TargetResult", "Target", "CURRENT_PREDICTION", "PREDICTION_VERSIONS",
           "evaluate", "evaluate_one", "target_met", "evaluate_spec", "target_key",
           "error_halfwidth"]
