"""Scoring ``dpops simulate``: predicted accuracy against what seeded draws of the release path produced.

Pure: every function here takes numbers -- a plan, exact per-partition aggregates, released values of draws --
and returns numbers. It reads no data, draws no noise and charges nothing; the read and the draws are in
``dpops.release.simulation``, which only runs on a public sample (``dpops.analysis.sample_access``).

The truth of a draw is the exact *bounded* aggregate of the sample (what the release noises: after contribution
bounding and clamping), because the predictions of ``dpops.analysis.accuracy`` describe the noise around that;
the bounding's own effect (bounded against unbounded truth) is reported beside it, never mixed into the noise.

What is predicted, per partition (its bounded rows n and units):
- count, unit_count, sum: std, (1 - alpha) half-width and exact coverage of the noised vector
  (``accuracy.predict``; the same at every n);
- mean: ``accuracy.mean_error`` at n and the bounded mean's offset from the midpoint (exact, clipping included);
- variance: ``accuracy.variance_error`` at n and the bounded centred moments;
- keep rate (private partitions): ``PartitionSelection.keep_probability`` at the bounded unit count.
- quantiles: the exact expected excess rank error (rows beyond what the grid forces) of the metric's picks, summed
  over its quantiles, at the partition's bounded grid histogram (``accuracy.quantile_rank_error_for_histogram``'s
  law: permute-and-flip's exact pmf on the release's own utilities), with its exact variance.
top_k is not scored (``NOT_SCORED``): its prediction is a probability at a stated lead, not a law at the sample's
category counts.

The checks, per (metric, partition-size bucket), at a family-wise false-failure rate ``alpha`` split equally
(Bonferroni) over every check made:
- coverage: draws within the predicted half-width of the truth, K of n observations; under the predictions K is a
  sum of Bernoulli(c_i) (Poisson-binomial), whose tails beyond a unit from its mean are no heavier than
  Binomial(n, mean c_i)'s (Hoeffding 1956), so the central binomial band is a conservative acceptance region;
- std: the squared errors standardised by each partition's predicted variance, summed: S, whose predicted mean
  is the number of observations N; z = (S - N) / sqrt(V) with V the observed variance of the standardised
  squares, never below the noise family's own (5 N for the Laplace, 2 N for the Gaussian). A normal
  approximation: at 1,000 draws the skew of squared Laplace errors makes its upper tail up to about 3x the
  nominal, so the stated rate is approximate there. Reported as the ratio observed RMS error / predicted std;
- keep: kept draws against Binomial(draws x partitions, mean keep probability), as for coverage;
- rank_error (quantiles): the summed excess rank error of the observations against its predicted mean, z with the
  predicted variance (independent picks; a normal approximation). With one quantile the pick is published as it
  is and the check is two-sided. With several, the release sorts the picks (they never cross), and sorting can
  only lower their summed excess (the cost |rank(x) - q n| is a convex function of a difference of two monotone
  maps, so it is Monge and the sorted matching is the cheapest), so the check is one-sided: not above.
Post-processing that clamps (counts and sums at 0, variances to [0, h^2]) can only move a value towards a truth
inside the clamp range, so for partitions whose truth lies within ``CLAMP_MARGIN`` stds of a clamp limit the
checks are one-sided (coverage not below, std not above the prediction); elsewhere two-sided. A mean's
prediction includes its clipping, so its checks are always two-sided.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from dpops.analysis.tuning import BUCKET_EDGES
from dpops.errors import InvalidParameter

if TYPE_CHECKING:
    from dpops.release_plan import MetricPlan, ReleasePlan

SCORED_TYPES = ("count", "unit_count", "sum", "mean", "variance")
RANKED_TYPES = ("quantiles",)
NOT_SCORED = ("top_k",)
CLAMP_MARGIN = 8.0  # stds: P(|Laplace| > 8 sd) = exp(-8 sqrt 2) ~ 1e-5, so a clamp this far away never matters
MIN_OBSERVATIONS = 30  # fewer observations in a group: reported, not checked
MARKER = "simulation on a public sample in test mode: not differentially private, never publishable"


def size_bucket(units: np.ndarray) -> np.ndarray:
    """Partition-size bucket labels (``dpops.analysis.tuning.BUCKET_EDGES``, by bounded units)."""
    edges = np.asarray(BUCKET_EDGES)
    idx = np.searchsorted(edges, units, side="right") - 1
    labels = ["0"] + [f"[{BUCKET_EDGES[i]},{BUCKET_EDGES[i + 1]})" for i in range(len(BUCKET_EDGES) - 1)]
    labels.append(f">={BUCKET_EDGES[-1]}")
    return np.asarray(labels, dtype=object)[np.clip(idx + 1, 0, len(labels) - 1)]


@dataclass(frozen=True)
class MetricTruth:
    """One scored metric's exact values per partition: ``bounded`` (what the release noises) and ``unbounded``
    (before contribution bounding and clamping); ``valid`` where the value is defined (a mean needs a row)."""

    key: str
    type: str
    bounded: np.ndarray
    unbounded: np.ndarray
    valid: np.ndarray
    bounded_mean: np.ndarray | None = None  # variance only: the bounded mean (its prediction needs m1 too)


def _accumulator(m: MetricPlan, vector: str) -> str:
    return next(v.accumulator for v in m.vectors if v.name == vector)


def metric_truths(plan: ReleasePlan, bounded: Mapping[str, np.ndarray], unbounded: Mapping[str, np.ndarray]
                  ) -> dict[str, MetricTruth]:
    """Each scored metric's bounded and unbounded value per partition, from the exact aggregates
    (``dpops.release.pipeline_seam.SampleTruth``: sums in fixed-point units of ``pipelines.bounding.sum_unit``)."""
    from pipelines.bounding import sum_unit

    n = np.asarray(bounded["count"], np.float64)
    n_raw = np.asarray(unbounded["count"], np.float64)
    has, has_raw = n > 0, n_raw > 0
    safe, safe_raw = np.maximum(n, 1.0), np.maximum(n_raw, 1.0)
    out: dict[str, MetricTruth] = {}
    for m in plan.metrics:
        if m.type in ("count", "unit_count"):
            out[m.key] = MetricTruth(m.key, m.type, np.asarray(bounded[m.type], np.float64),
                                     np.asarray(unbounded[m.type], np.float64), np.ones(len(n), bool))
            continue
        if m.type not in SCORED_TYPES or m.bounds is None:
            continue
        lo, hi = m.bounds
        mid, h = (lo + hi) / 2.0, (hi - lo) / 2.0
        raw_sum = np.asarray(unbounded[f"sum:{m.column}"], np.float64)
        if m.type == "sum":
            acc = _accumulator(m, "sum")
            value = np.asarray(bounded[acc], np.float64) * sum_unit("sum", lo, hi)
            out[m.key] = MetricTruth(m.key, m.type, value, raw_sum, np.ones(len(n), bool))
            continue
        m1 = np.asarray(bounded[_accumulator(m, "normalized_sum")], np.float64) * sum_unit("nsum", lo, hi) / safe
        if m.type == "mean":
            out[m.key] = MetricTruth(m.key, m.type, mid + m1, raw_sum / safe_raw, has & has_raw)
            continue
        nsq = np.asarray(bounded[_accumulator(m, "normalized_sum_squares")], np.float64) * sum_unit("nsq", lo, hi)
        m2 = nsq / safe + h * h / 2.0
        raw_var = np.asarray(unbounded[f"sq:{m.column}"], np.float64) / safe_raw - (raw_sum / safe_raw) ** 2
        out[m.key] = MetricTruth(m.key, m.type, m2 - m1 * m1, raw_var, has & has_raw, mid + m1)
    return out


@dataclass(frozen=True)
class MetricPrediction:
    """Per partition: predicted std, half-width and exact coverage of one metric; ``two_sided`` False where a
    clamp may bind (``CLAMP_MARGIN``); ``method`` names the prediction (exact or an approximation)."""

    key: str
    std: np.ndarray
    half: np.ndarray
    coverage: np.ndarray
    two_sided: np.ndarray
    method: str
    kurtosis_floor: float  # Var(e^2 / sigma^2) of the noise family: 5 (Laplace), 2 (Gaussian)


def _kurtosis_floor(m: MetricPlan) -> float:
    """Var(e^2 / sigma^2) of the metric's noise family: E X^4 / sigma^4 - 1 = 5 for the Laplace, 2 for the Gaussian
    (the discrete forms are within 1% of these at the scales released); the std check never assumes less."""
    from dpops.analysis.accuracy import distribution_name

    names = " ".join(distribution_name(v.params) for v in m.vectors)
    return 5.0 if "laplace" in names else 2.0


def predict_partitions(plan: ReleasePlan, truths: Mapping[str, MetricTruth], rows: np.ndarray, confidence: float
                       ) -> dict[str, MetricPrediction]:
    """The predictions of ``dpops.analysis.accuracy`` at each partition's bounded rows and true value (the one
    owner of every formula; this only evaluates it where the sample's partitions are). Means and variances are
    evaluated once per distinct (rows, moments)."""
    from dpops.analysis.accuracy import mean_error, predict, variance_error

    flat = {p.metric: p for p in predict(plan, confidence=confidence, at_units=1)}
    post = plan.postprocess
    nonneg = bool(post.get("non_negative", True))
    P = len(rows)
    out: dict[str, MetricPrediction] = {}
    for m in plan.metrics:
        t = truths.get(m.key)
        if t is None:
            continue
        if m.type in ("count", "unit_count", "sum"):
            p = flat[m.key]
            assert p.std is not None and p.abs_error is not None and p.coverage is not None
            std = np.full(P, float(p.std))
            clamps = nonneg and (m.type != "sum" or (m.bounds is not None and m.bounds[0] >= 0))
            two = (t.bounded > CLAMP_MARGIN * std) if clamps else np.ones(P, bool)
            out[m.key] = MetricPrediction(m.key, std, np.full(P, float(p.abs_error)), np.full(P, float(p.coverage)),
                                          two, p.method or "exact", _kurtosis_floor(m))
            continue
        assert m.bounds is not None  # mean and variance always have bounds
        lo, hi = m.bounds
        mid, h = (lo + hi) / 2.0, (hi - lo) / 2.0
        std, half, cov = np.full(P, np.nan), np.full(P, np.nan), np.full(P, np.nan)
        cache: dict[tuple[int, float, float], tuple[float, float, float, str]] = {}
        method = ""
        for i in np.flatnonzero(t.valid):
            n = int(rows[i])
            if m.type == "mean":
                k = (n, float(t.bounded[i] - mid), 0.0)
                if k not in cache:
                    cache[k] = mean_error(plan, m, n, k[1], confidence)
            else:
                # centred moments of the bounded, clamped rows: m1 = mean - mid, m2 = variance + m1^2
                # (variance_error treats m1 = 0 exactly; at |m1| below 1e-12 h it is taken as 0)
                assert t.bounded_mean is not None
                m1 = float(t.bounded_mean[i] - mid)
                m1 = 0.0 if abs(m1) < 1e-12 * max(h, 1e-300) else m1
                k = (n, m1, float(t.bounded[i] + m1 * m1))
                if k not in cache:
                    cache[k] = variance_error(plan, m, n, k[1], k[2], confidence)
            std[i], half[i], cov[i], method = cache[k]
        if m.type == "mean":
            two = np.ones(P, bool)
        else:
            two = (t.bounded > CLAMP_MARGIN * std) & (t.bounded < h * h - CLAMP_MARGIN * std)
        out[m.key] = MetricPrediction(m.key, std, half, cov, two & t.valid, method, _kurtosis_floor(m))
    return out


@dataclass
class Tally:
    """Running sums over the draws, per metric and partition (O(partitions) memory whatever the number of draws):
    observations, draws within the predicted half-width, sums of squared and fourth-power errors, suppressed
    values; per partition the draws and the kept draws."""

    n_parts: int
    keys: Sequence[str]
    draws: np.ndarray = field(init=False)
    kept: np.ndarray = field(init=False)
    n: dict[str, np.ndarray] = field(init=False)
    within: dict[str, np.ndarray] = field(init=False)
    s1: dict[str, np.ndarray] = field(init=False)
    s2: dict[str, np.ndarray] = field(init=False)
    s4: dict[str, np.ndarray] = field(init=False)
    suppressed: dict[str, np.ndarray] = field(init=False)

    def __post_init__(self) -> None:
        z = lambda: np.zeros(self.n_parts)  # noqa: E731
        self.draws, self.kept = z(), z()
        self.n = {k: z() for k in self.keys}
        self.within = {k: z() for k in self.keys}
        self.s1 = {k: z() for k in self.keys}
        self.s2 = {k: z() for k in self.keys}
        self.s4 = {k: z() for k in self.keys}
        self.suppressed = {k: z() for k in self.keys}

    def add(self, reps: int, released: np.ndarray, values: Mapping[str, np.ndarray],
            truths: Mapping[str, MetricTruth], preds: Mapping[str, MetricPrediction]) -> None:
        """One block of ``reps`` draws of every partition: ``released`` is the partition index of each released
        row, ``values`` each scored metric's released values on those rows (NaN where suppressed)."""
        P = self.n_parts
        self.draws += reps
        self.kept += np.bincount(released, minlength=P)
        for k in self.keys:
            v = np.asarray(values[k], np.float64)
            ok = ~np.isnan(v) & truths[k].valid[released]
            self.suppressed[k] += np.bincount(released[np.isnan(v)], minlength=P)
            idx = released[ok]
            err = v[ok] - truths[k].bounded[idx]
            self.n[k] += np.bincount(idx, minlength=P)
            self.within[k] += np.bincount(idx, weights=(np.abs(err) <= preds[k].half[idx]).astype(np.float64),
                                          minlength=P)
            self.s1[k] += np.bincount(idx, weights=err, minlength=P)
            self.s2[k] += np.bincount(idx, weights=err * err, minlength=P)
            self.s4[k] += np.bincount(idx, weights=err ** 4, minlength=P)


@dataclass(frozen=True)
class QuantilePrediction:
    """Per partition, one quantiles metric: the excess rank error (rows) of every grid candidate for each of its
    quantiles (``excess``: partitions x quantiles x candidates, quantiles in ascending order as the release's sorted
    columns hold them), and the predicted mean and variance of their sum over the quantiles (independent picks)."""

    key: str
    columns: tuple[str, ...]  # released columns, in ascending quantile order
    candidates: np.ndarray
    excess: np.ndarray
    mean: np.ndarray
    var: np.ndarray
    valid: np.ndarray  # partitions with at least one bounded row

    @property
    def sorted_picks(self) -> bool:
        """Several quantiles: the release sorts the picks, so the check is one-sided (module docstring)."""
        return len(self.columns) > 1


def predict_quantiles(plan: ReleasePlan, bounded: Mapping[str, np.ndarray]) -> dict[str, QuantilePrediction]:
    """For each quantiles metric, at each partition's bounded grid histogram (the ``hist:`` accumulator the release
    picks from): the exact law of each pick (``selection.permute_and_flip_pmf`` on
    ``selection.histogram_quantile_utility``, the owners the release and ``accuracy`` share). A public sample's
    histograms: this is about the sample, never a plan or a manifest."""
    from dpops.noise.selection import histogram_quantile_utility, permute_and_flip_pmf
    from pipelines.bounding import quantile_candidates

    out: dict[str, QuantilePrediction] = {}
    for m in plan.metrics:
        if m.type not in RANKED_TYPES or m.bounds is None:
            continue
        hist = np.asarray(bounded[f"hist:{m.key}{m.bound_suffix}"], np.int64)
        order = np.argsort(np.asarray(m.quantiles, np.float64), kind="stable")
        qs = [float(m.quantiles[int(j)]) for j in order]
        P, C = hist.shape
        excess = np.zeros((P, len(qs), C))
        mean, var = np.zeros(P), np.zeros(P)
        valid = hist.sum(axis=1) > 0
        eps, sens = float(m.per_run_epsilon or 0.0), float(m.utility_sensitivity or 1.0)
        for i in np.flatnonzero(valid):
            for jq, q in enumerate(qs):
                util, d = histogram_quantile_utility(hist[i], q)
                err = np.abs(util.astype(np.float64)) / d
                ex = err - err.min()
                pmf = permute_and_flip_pmf(util, eps, sens * d)
                mu = float(pmf @ ex)
                excess[i, jq] = ex
                mean[i] += mu
                var[i] += max(float(pmf @ (ex * ex)) - mu * mu, 0.0)
        lo, hi = m.bounds
        out[m.key] = QuantilePrediction(m.key, tuple(f"{m.key}_{m.quantile_suffixes[int(j)]}" for j in order),
                                        quantile_candidates(lo, hi, m.n_bins), excess, mean, var, valid)
    return out


@dataclass
class RankTally:
    """Running sums over the draws of each quantiles metric's summed excess rank error, per partition."""

    n_parts: int
    keys: Sequence[str]
    n: dict[str, np.ndarray] = field(init=False)
    s1: dict[str, np.ndarray] = field(init=False)
    suppressed: dict[str, np.ndarray] = field(init=False)

    def __post_init__(self) -> None:
        self.n = {k: np.zeros(self.n_parts) for k in self.keys}
        self.s1 = {k: np.zeros(self.n_parts) for k in self.keys}
        self.suppressed = {k: np.zeros(self.n_parts) for k in self.keys}

    def add(self, released: np.ndarray, values: Mapping[str, np.ndarray],
            preds: Mapping[str, QuantilePrediction]) -> None:
        """One block: ``values`` holds each released quantile column (NaN where suppressed) on the released rows."""
        P = self.n_parts
        for k in self.keys:
            p = preds[k]
            cols = [np.asarray(values[c], np.float64) for c in p.columns]
            blank = np.zeros(len(released), bool)
            for v in cols:
                blank |= np.isnan(v)
            self.suppressed[k] += np.bincount(released[blank], minlength=P)
            ok = ~blank & p.valid[released]
            idx = released[ok]
            total = np.zeros(len(idx))
            for jq, v in enumerate(cols):
                cell = np.searchsorted(p.candidates, v[ok])  # a pick is a candidate exactly (cand[pick])
                total += p.excess[idx, jq, np.minimum(cell, len(p.candidates) - 1)]
            self.n[k] += np.bincount(idx, minlength=P)
            self.s1[k] += np.bincount(idx, weights=total, minlength=P)


@dataclass(frozen=True)
class Check:
    """One statistical check: ``what`` (coverage, std_ratio, keep, rank_error) of ``metric`` in a size bucket, the
    observed and predicted statistic, the acceptance region [low, high] and whether the observation lies in it."""

    metric: str
    bucket: str
    what: str
    sides: str  # "two-sided" | "lower" (observed may only be larger) | "upper" (may only be smaller)
    observed: float
    predicted: float
    low: float
    high: float
    passed: bool


@dataclass(frozen=True)
class ScoreRow:
    """One (metric, size bucket) row of the table: predicted and observed std, coverage and keep rate, and the
    bounding's effect (mean bias of the bounded truth against the unbounded one, absolute and relative)."""

    metric: str
    bucket: str
    partitions: int
    observations: int
    predicted_std: float | None
    observed_std: float | None
    predicted_coverage: float | None
    observed_coverage: float | None
    predicted_keep: float | None
    observed_keep: float | None
    bounding_bias: float | None
    bounding_relative_bias: float | None
    suppressed: int
    method: str
    predicted_rank_error: float | None = None  # quantiles: mean summed excess rank error (rows) per observation
    observed_rank_error: float | None = None


@dataclass(frozen=True)
class SimulationScore:
    """Every row and check; ``holds`` when every check passed at the family-wise ``alpha``."""

    rows: list[ScoreRow]
    checks: list[Check]
    alpha: float
    confidence: float
    not_scored: list[str]

    @property
    def holds(self) -> bool:
        """True when every prediction held within its statistical band."""
        return all(c.passed for c in self.checks)

    def failed(self) -> list[Check]:
        """The checks outside their band."""
        return [c for c in self.checks if not c.passed]

    def to_dict(self) -> dict[str, object]:
        """JSON-ready (NaN-free: ``None`` where a figure is undefined)."""
        return {"holds": self.holds, "alpha": self.alpha, "confidence": self.confidence, "not_scored": self.not_scored,
                "rows": [asdict(r) for r in self.rows], "checks": [asdict(c) for c in self.checks]}


def _f(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def score(plan: ReleasePlan, truths: Mapping[str, MetricTruth], preds: Mapping[str, MetricPrediction],
          tally: Tally, units: np.ndarray, *, alpha: float, confidence: float,
          ranks: tuple[Mapping[str, QuantilePrediction], RankTally] | None = None) -> SimulationScore:
    """The table and the checks (module docstring) from a finished ``Tally`` (and ``RankTally`` with its
    predictions, for quantiles metrics)."""
    from scipy import stats

    if not (0.0 < alpha < 1.0):
        raise InvalidParameter(f"alpha (the false-failure rate) must be in (0, 1), got {alpha!r}")
    buckets = size_bucket(units)
    order = [b for b in dict.fromkeys(size_bucket(np.asarray((0,) + BUCKET_EDGES)).tolist()) if b in set(buckets)]
    private = plan.partition_selection is not None
    keep_p = (np.asarray(plan.partition_selection.keep_probability(units.astype(np.int64)), np.float64)
              if plan.partition_selection is not None else np.ones(len(units)))
    pending: list[tuple[str, str, str, str, float, float, float, float]] = []  # kind-specific raw figures
    rows: list[ScoreRow] = []
    keys = list(tally.keys)
    for k in keys:
        t, p = truths[k], preds[k]
        for b in order:
            sel = (buckets == b) & t.valid
            if not sel.any():
                continue
            n_i = tally.n[k][sel]
            n = float(n_i.sum())
            sup = int(tally.suppressed[k][sel].sum())
            checked = sel & (tally.suppressed[k] == 0)  # a partition suppressed in any draw: reported, not checked
            pred_var = float((n_i * p.std[sel] ** 2).sum() / n) if n else math.nan
            obs_var = float(tally.s2[k][sel].sum() / n) if n else math.nan
            cov_pred = float((n_i * p.coverage[sel]).sum() / n) if n else math.nan
            cov_obs = float(tally.within[k][sel].sum() / n) if n else math.nan
            bias = t.bounded[sel] - t.unbounded[sel]
            denom = np.abs(t.unbounded[sel])
            rel = float(np.mean(np.abs(bias[denom > 0]) / denom[denom > 0])) if (denom > 0).any() else math.nan
            rows.append(ScoreRow(k, b, int(sel.sum()), int(n), _f(math.sqrt(pred_var)) if n else None,
                                 _f(math.sqrt(obs_var)) if n else None, _f(cov_pred), _f(cov_obs),
                                 None, None, _f(float(bias.mean())), _f(rel), sup, p.method))
            for sides, mask in (("two-sided", checked & p.two_sided), ("one-sided", checked & ~p.two_sided)):
                ni = tally.n[k][mask]
                N = float(ni.sum())
                if N < MIN_OBSERVATIONS:
                    continue
                pc = float((ni * p.coverage[mask]).sum() / N)
                pending.append((k, b, "coverage", "two-sided" if sides == "two-sided" else "lower",
                                float(tally.within[k][mask].sum()), N, pc, 0.0))
                # squared errors standardised by each partition's predicted variance, so that partitions of
                # different sizes pool into one ratio (a few draws of a small, noisy partition cannot dominate)
                var_i = p.std[mask] ** 2
                s2, s4 = tally.s2[k][mask] / var_i, tally.s4[k][mask] / var_i ** 2
                v = float(np.sum(s4 - np.where(ni > 0, s2 * s2 / np.maximum(ni, 1), 0.0)))
                v = max(v, p.kurtosis_floor * N)  # never below the noise family's own variance of e^2/sigma^2
                pending.append((k, b, "std_ratio", "two-sided" if sides == "two-sided" else "upper", float(s2.sum()),
                                N, N, v))
    if ranks is not None:
        qpreds, rt = ranks
        for k in rt.keys:
            qp = qpreds[k]
            for b in order:
                sel = (buckets == b) & qp.valid
                if not sel.any():
                    continue
                n_i = rt.n[k][sel]
                n = float(n_i.sum())
                pm = float((n_i * qp.mean[sel]).sum() / n) if n else math.nan
                om = float(rt.s1[k][sel].sum() / n) if n else math.nan
                rows.append(ScoreRow(k, b, int(sel.sum()), int(n), None, None, None, None, None, None, None, None,
                                     int(rt.suppressed[k][sel].sum()),
                                     "exact permute-and-flip law at the bounded histogram", _f(pm), _f(om)))
                mask = sel & (rt.suppressed[k] == 0)
                ni = rt.n[k][mask]
                N = float(ni.sum())
                if N < MIN_OBSERVATIONS:
                    continue
                pending.append((k, b, "rank_error", "upper" if qp.sorted_picks else "two-sided",
                                float(rt.s1[k][mask].sum()), N, float((ni * qp.mean[mask]).sum()),
                                float((ni * qp.var[mask]).sum())))
    if private:
        for b in order:
            sel = buckets == b
            d = float(tally.draws[sel].sum())
            kp = float((tally.draws[sel] * keep_p[sel]).sum() / d) if d else math.nan
            ko = float(tally.kept[sel].sum() / d) if d else math.nan
            rows.append(ScoreRow("partition_selection", b, int(sel.sum()), int(d), None, None, None, None, _f(kp),
                                 _f(ko), None, None, 0, "exact keep probability at the bounded unit count"))
            if d >= MIN_OBSERVATIONS:
                pending.append(("partition_selection", b, "keep", "two-sided", float(tally.kept[sel].sum()), d, kp,
                                0.0))
    a = alpha / max(1, len(pending))
    z = float(stats.norm.ppf(1 - a / 2))
    z1 = float(stats.norm.ppf(1 - a))
    checks: list[Check] = []
    for metric, b, what, sides, obs, N, pred, var in pending:
        n_int = int(round(N))
        if what in ("coverage", "keep"):
            if sides == "two-sided":
                lo = float(stats.binom.ppf(a / 2, n_int, pred))
                hi = float(stats.binom.isf(a / 2, n_int, pred))
            else:
                lo, hi = float(stats.binom.ppf(a, n_int, pred)), float(n_int)
            checks.append(Check(metric, b, what, sides, obs / N, pred, lo / N, hi / N, lo <= obs <= hi))
            continue
        if what == "rank_error":  # the summed excess against its predicted mean; shown per observation
            sd = math.sqrt(var)
            zz = z if sides == "two-sided" else z1
            lo = pred - zz * sd if sides == "two-sided" else 0.0
            hi = pred + zz * sd
            checks.append(Check(metric, b, what, sides, obs / N, pred / N, max(lo, 0.0) / N, hi / N,
                                lo <= obs <= hi))
            continue
        sd = math.sqrt(var)
        zz = z if sides == "two-sided" else z1
        lo = pred - zz * sd if sides == "two-sided" else 0.0
        hi = pred + zz * sd
        # as a ratio of stds: observed root mean square error over the predicted std, 1 when they agree
        checks.append(Check(metric, b, what, sides, math.sqrt(obs / N), 1.0, math.sqrt(max(lo, 0.0) / N),
                            math.sqrt(hi / N), lo <= obs <= hi))
    not_scored = [m.key for m in plan.metrics if m.type in NOT_SCORED]
    return SimulationScore(rows, checks, alpha, confidence, not_scored)


__all__ = ["CLAMP_MARGIN", "MARKER", "MIN_OBSERVATIONS", "NOT_SCORED", "RANKED_TYPES", "SCORED_TYPES", "Check",
           "MetricPrediction", "MetricTruth", "QuantilePrediction", "RankTally", "ScoreRow", "SimulationScore", "Tally",
           "metric_truths", "predict_partitions", "predict_quantiles", "score", "size_bucket"]
