"""Calibration of dpops.analysis' predictions against the release's own noise and post-processing path.

For every metric type and both noise families, fixed bounded aggregates (P identical partitions) go
through ``pipelines.aggregate.select_and_noise`` -- the function the Beam job calls per shard, with the
plan's own mechanisms -- in test mode (seeded randomness), giving P independent draws per quantity.

Acceptance, at a stated false-failure rate: ALPHA = 1e-4 for the whole file, Bonferroni over the
N_CHECKS checks (ALPHA / N_CHECKS each).
- coverage: the number of draws with |released - true| <= predicted half-width is Binomial(P, c) with c
  the EXACT predicted coverage (>= the confidence; it is larger on coarse lattices); it must lie in the
  central (1 - ALPHA/N_CHECKS) binomial band.
- std: the sample variance s^2 of P draws has Var(s^2) ~= sigma^4 (2/(P-1) + kappa/P), kappa the excess
  kurtosis (0 for the discrete Gaussian, <= 3 for the discrete Laplace and for the first-order mean and
  variance errors, which are linear combinations of such noises). For the Gaussian family this is the
  chi-square(P-1) variance; |s^2/sigma^2 - 1| must stay within z(1 - ALPHA/(2 N_CHECKS)) times its sd.
- keep and top-pick probabilities: the empirical frequency is Binomial(P, p) with p predicted exactly.
- quantiles: the predicted expected rank error is an upper bound; the empirical mean excess rank error
  must lie below it (one-sided, with the same z margin on the sample mean).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dpops.analysis.accuracy import mean_error, predict, variance_error
from dpops.noise.randomness import test_random
from dpops.release_plan import plan_release
from dpops.spec import parse_spec
from pipelines.aggregate import select_and_noise
from pipelines.bounding import sum_unit

ALPHA = 1e-4
N_CHECKS = 2 * (2 * 5) + 2 + 2 + 1  # (family x metric x {coverage, std}) + quantiles + top-k + selection
A1 = ALPHA / N_CHECKS
Z = float(stats.norm.ppf(1 - A1 / 2))
P = 4000  # partitions = independent draws per quantity (selection, top-k)
DRAWS = {"laplace": 20_000, "gaussian": 5_000}  # noise metrics: enough draws to tell 0.950 from 0.937 coverage
P_QUANTILES = 1000
N = 20_000  # rows (= units) per partition: large, so the first-order mean/variance errors are exact to <1e-3
LO, HI = 0.0, 100.0
MID, H = 50.0, 50.0


def _spec(noise: str, metrics: list[dict], partitions: dict | None = None, epsilon: float = 1.0) -> object:
    doc = {
        "name": "calib", "input": {"path": "in.csv", "format": "csv",
                                   "columns": {"u": "string", "p": "string", "x": "float", "c": "string"}},
        "privacy_unit": {"column": "u", "description": "a unit", "adjacency": "add_remove"},
        "budget": {"scope": "calib", "epsilon": epsilon, "delta": 1e-7, "noise": noise},
        "contribution": {"max_partitions_per_unit": 2, "max_rows_per_unit_per_partition": 2},
        "partitions": partitions or {"columns": ["p"], "public": ["a", "b"]},
        "metrics": metrics,
        "postprocess": {"clamp_means_to_bounds": True},
    }
    return parse_spec(doc, source="<calib>")


NOISE_METRICS = [{"type": "count"}, {"type": "unit_count"}, {"type": "sum", "column": "x", "bounds": [LO, HI]},
                 {"type": "mean", "column": "x", "bounds": [LO, HI]},
                 {"type": "variance", "column": "x", "bounds": [LO, HI]}]
# True data of every partition: N rows, one per unit, half at MID - H/2 and half at MID + H/2 + D, where the
# mean is MID + D/2... kept simple: values at MID + D (mean) and at MID -+ H/2 (variance) are summarised below.
D = 12.5  # mean offset from the midpoint (the mean metric's data)
M2 = H * H / 4  # centred second moment of the variance metric's data (values at MID -+ H/2, m1 = 0)


def _accumulators(plan, P: int = P) -> dict[str, np.ndarray]:
    acc: dict[str, np.ndarray] = {"count": np.full(P, N, np.int64), "unit_count": np.full(P, N, np.int64)}
    for m in plan.metrics:
        if m.type == "sum":
            # N rows of value MID: exact sum N*MID in fixed-point units of the sum accumulator
            acc[f"sum:{m.key}"] = np.full(P, int(N * MID / sum_unit("sum", LO, HI)), np.int64)
        if m.type == "mean":
            acc[f"nsum:{m.key}"] = np.full(P, int(N * D / sum_unit("nsum", LO, HI)), np.int64)
        if m.type == "variance":
            acc[f"nsum:{m.key}"] = np.zeros(P, np.int64)  # m1 = 0
            # per-row centred square term (x - mid)^2 - h^2/2 = M2 - h^2/2
            acc[f"nsq:{m.key}"] = np.full(P, int(N * (M2 - H * H / 2) / sum_unit("nsq", LO, HI)), np.int64)
    return acc


def _run(plan, acc: dict[str, np.ndarray], seed: int, public: bool = True) -> dict:
    P = len(acc["count"])
    parts = np.arange(1, P + 1, dtype=np.uint64)
    names = {int(h): (f"p{int(h)}",) for h in parts}
    return select_and_noise(0, parts, acc, names, plan, parts if public else None, names if public else None,
                            test_random(seed, ("calibration",)))


def _band(p: float, P: int = P) -> tuple[int, int]:
    return int(stats.binom.ppf(A1 / 2, P, p)), int(stats.binom.isf(A1 / 2, P, p))


def _check_std(errors: np.ndarray, sigma: float, kurtosis: float, what: str) -> None:
    P = errors.size
    ratio = float(np.var(errors, ddof=1)) / sigma**2
    tol = Z * math.sqrt(2 / (P - 1) + kurtosis / P)
    assert abs(ratio - 1) <= tol, f"{what}: empirical/predicted variance {ratio:.4f}, tolerance +-{tol:.4f}"


def _check_coverage(errors: np.ndarray, half: float, coverage: float, what: str) -> None:
    P = errors.size
    k = int((np.abs(errors) <= half).sum())
    lo, hi = _band(coverage, P)
    assert lo <= k <= hi, f"{what}: {k}/{P} within +-{half:.6g}, predicted coverage {coverage:.5f} (band {lo}..{hi})"


@pytest.mark.parametrize("noise", ["laplace", "gaussian"])
def test_noise_metrics_std_and_interval_match_the_release_path(noise):
    spec = _spec(noise, NOISE_METRICS)
    plan = plan_release(spec)
    out = _run(plan, _accumulators(plan, DRAWS[noise]), seed=11 if noise == "laplace" else 12)
    kurt = 3.0 if noise == "laplace" else 0.0
    preds = {p.metric: p for p in predict(plan, at_units=N)}
    truth = {"count": N, "unit_count": N, "sum_x": N * MID}
    for key in ("count", "unit_count", "sum_x"):
        p = preds[key]
        err = np.asarray(out[key], np.float64) - truth[key]
        _check_std(err, p.std, kurt, f"{noise} {key} std")
        _check_coverage(err, p.abs_error, p.coverage, f"{noise} {key} interval")
    m = next(x for x in plan.metrics if x.type == "mean")
    std, half, cov, method = mean_error(plan, m, N, D, 0.95)
    assert "exact" in method
    err = np.asarray(out["mean_x"], np.float64) - (MID + D)
    _check_std(err, std, kurt, f"{noise} mean std")
    _check_coverage(err, half, cov, f"{noise} mean interval")
    v = next(x for x in plan.metrics if x.type == "variance")
    std, half, cov, method = variance_error(plan, v, N, 0.0, M2, 0.95)
    assert "exact" in method
    err = np.asarray(out["variance_x"], np.float64) - M2
    _check_std(err, std, kurt, f"{noise} variance std")
    _check_coverage(err, half, cov, f"{noise} variance interval")


def test_predicted_interval_is_the_published_interval_for_single_vector_metrics():
    """One owner: the half-width dpops predicts is the one the release publishes (ci95 columns)."""
    plan = plan_release(_spec("laplace", NOISE_METRICS[:3]))
    out = _run(plan, _accumulators(plan), seed=3)
    preds = {p.metric: p for p in predict(plan, at_units=N, confidence=0.95)}
    for key in ("count", "unit_count", "sum_x"):
        width = np.asarray(out[f"{key}_ci95_high"]) - np.asarray(out[f"{key}_ci95_low"])
        assert np.allclose(width, 2 * preds[key].abs_error)


def test_top_pick_probability_matches_the_release_path():
    spec = _spec("laplace", [{"type": "top_k", "column": "c", "k": 2, "domain": ["a", "b", "c", "d"]}], epsilon=2.0)
    plan = plan_release(spec)
    gap = 3
    cats = np.tile(np.array([100 + gap, 100, 100, 100], np.int64), (P, 1))
    out = _run(plan, {"count": np.full(P, N, np.int64), "unit_count": np.full(P, N, np.int64),
                      "cat:top_k_c": cats}, seed=5)
    p = next(x for x in predict(plan, gap=gap) if x.type == "top_k").probability
    k = sum(1 for v in out["top_k_c_rank1"] if v == "a")
    lo, hi = _band(p)
    assert 0.3 < p < 0.95  # a regime where a wrong rate would show
    assert lo <= k <= hi, f"top pick {k}/{P}, predicted {p:.4f} (band {lo}..{hi})"


def test_keep_probability_matches_the_release_path():
    parts = {"columns": ["p"], "private": {"strategy": "truncated_geometric"}}
    spec = _spec("laplace", [{"type": "count"}], partitions=parts)
    plan = plan_release(spec)
    pred = next(x for x in predict(plan, at_units=1) if x.type == "partition_selection")
    n = pred.units_50  # around 50%: the most sensitive point of the curve
    p = float(plan.partition_selection.keep_probability(np.array([n]))[0])
    acc = {"count": np.full(P, n, np.int64), "unit_count": np.full(P, n, np.int64)}
    out = _run(plan, acc, seed=7, public=False)
    k = len(out["p"])
    lo, hi = _band(p)
    assert lo <= k <= hi, f"kept {k}/{P} partitions of {n} units, predicted {p:.4f} (band {lo}..{hi})"
    assert pred.units_95 is not None and pred.units_95 > n


def test_quantile_rank_error_stays_below_its_bound():
    spec = _spec("laplace", [{"type": "quantiles", "column": "x", "bounds": [LO, HI], "quantiles": [0.5]}])
    plan = plan_release(spec)
    m = plan.metrics[0]
    n_per_bin = 2
    hist = np.full((P_QUANTILES, m.n_bins + 1), n_per_bin, np.int64)  # values spread evenly over the grid
    out = _run(plan, {"count": hist.sum(axis=1), "unit_count": hist.sum(axis=1), f"hist:{m.key}": hist}, seed=9)
    n = int(hist[0].sum())
    cand = LO + (HI - LO) * np.arange(m.n_bins + 1) / m.n_bins
    ranks = np.cumsum(hist[0])
    idx = np.searchsorted(cand, np.asarray(out[f"{m.key}_q50"]))
    excess = np.abs(ranks[idx] - 0.5 * n) - np.abs(ranks - 0.5 * n).min()
    bound = next(x for x in predict(plan, at_units=n) if x.type == "quantiles").expected_rank_error
    mean, sd = float(excess.mean()), float(excess.std(ddof=1))
    assert mean - Z * sd / math.sqrt(P_QUANTILES) <= bound, f"mean excess rank error {mean:.3g} above the bound {bound:.3g}"


SIZES = (100, 300, 1000, 20_000)  # rows per partition (issue 26 section 2: the small sizes are where it failed)
P_SIZES = 4000  # draws per (noise, size); Bonferroni below counts these checks separately
EPSILONS = (1.0, 0.2)  # a metric's whole epsilon, and its share in a five-metric release
A2 = ALPHA / (2 * len(SIZES) * len(EPSILONS) * 2)  # (noise x size x epsilon x {coverage, std}) at the file's ALPHA
Z2 = float(stats.norm.ppf(1 - A2 / 2))


def _mean_accumulators(plan, n: int, d: float, draws: int) -> dict[str, np.ndarray]:
    m = next(x for x in plan.metrics if x.type == "mean")
    return {"count": np.full(draws, n, np.int64), "unit_count": np.full(draws, n, np.int64),
            f"nsum:{m.key}": np.full(draws, int(round(n * d / sum_unit("nsum", LO, HI))), np.int64)}


@pytest.mark.parametrize("noise", ["laplace", "gaussian"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("epsilon", EPSILONS)
def test_mean_prediction_holds_at_every_partition_size(noise, n, epsilon):
    """The mean's predicted std and half-width against P_SIZES releases through select_and_noise at n rows
    (the noisy count in the denominator and the clipping matter at 100-1,000 rows). Coverage: the count of
    draws within the half-width is Binomial(P, c) with c the exact predicted coverage, inside the central
    1 - A2 band; std: |s^2/sigma^2 - 1| within Z2 * sqrt((kurt - 1 + 2/(P-1))/P) with kurt the sample's
    kurtosis (the error is bounded by the clipping, so its fourth moment is finite)."""
    spec = _spec(noise, [{"type": "mean", "column": "x", "bounds": [LO, HI]}], epsilon=epsilon)
    plan = plan_release(spec)
    m = plan.metrics[0]
    out = _run(plan, _mean_accumulators(plan, n, D, P_SIZES),
               seed=1000 + n + (0 if noise == "laplace" else 7) + int(epsilon * 10))
    std, half, cov, method = mean_error(plan, m, n, D, 0.95)
    assert method.startswith("exact")
    err = np.asarray(out["mean_x"], np.float64) - (MID + D)
    k = int((np.abs(err) <= half).sum())
    lo, hi = int(stats.binom.ppf(A2 / 2, P_SIZES, cov)), int(stats.binom.isf(A2 / 2, P_SIZES, cov))
    assert lo <= k <= hi, f"{noise} eps={epsilon} n={n}: {k}/{P_SIZES} within +-{half:.4g}, predicted {cov:.4f} ({lo}..{hi})"
    assert abs(k / P_SIZES - 0.95) <= 0.02 or cov > 0.955  # the requirement 0.95 +- 0.01, with sampling slack
    var = float(np.var(err, ddof=1))
    kurt = float(np.mean((err - err.mean()) ** 4) / np.var(err) ** 2)
    tol = Z2 * math.sqrt((kurt - 1 + 2 / (P_SIZES - 1)) / P_SIZES)
    assert abs(var / std**2 - 1) <= tol, f"{noise} n={n}: var ratio {var / std**2:.4f}, tolerance +-{tol:.4f}"


def test_the_first_order_formula_fails_at_small_partitions():
    """Why the exact distribution: at 300 rows and epsilon 0.14 (a mean's share in a seven-metric release)
    the first-order half-width (the old prediction) covers about 92% of the release path's means; the
    exact one 95%. Fixed seed; with 4,000 draws the sd of each rate is 0.0035, so the 0.94 line is 4 sd
    from the first and 3 sd from the second."""
    spec = _spec("laplace", [{"type": "mean", "column": "x", "bounds": [LO, HI]}], epsilon=0.14)
    plan = plan_release(spec)
    m = plan.metrics[0]
    n = 300
    out = _run(plan, _mean_accumulators(plan, n, D, P_SIZES), seed=4242)
    err = np.abs(np.asarray(out["mean_x"], np.float64) - (MID + D))
    from dpops.analysis.accuracy import linear_halfwidth

    ps = next(v.params for v in m.vectors if v.name == "normalized_sum")
    pc = next(v.params for v in m.vectors if v.name == "count")
    first, _, _ = linear_halfwidth((1.0, ps), (-D, pc), 0.95)
    old = float((err <= first / n).mean())
    _, half, cov, _ = mean_error(plan, m, n, D, 0.95)
    new = float((err <= half).mean())
    assert old < 0.94 < new, (old, new, cov)


@pytest.mark.parametrize("epsilon,per_bin,dense", [(1.0, 1, True), (1.0, 2, True), (1.0, 20, False),
                                                   (0.2, 2, True), (0.2, 5, True), (0.2, 80, False)])
def test_quantile_rank_error_prediction_for_dense_data(epsilon, per_bin, dense):
    """The predicted expected excess rank error (2 Delta/eps_run, issue 26 section 2) against 1,000 releases
    through select_and_noise, rows spread evenly over the grid: with cells thin compared with 2 Delta/eps_run
    (dense) the observed mean is within 1.25x of it; with thick cells it is smaller. Never above it beyond
    the sample mean's z margin (the file's ALPHA; 6 more checks, within the N_CHECKS budget's slack)."""
    from dpops.analysis.accuracy import quantile_typical_rank_error

    spec = _spec("laplace", [{"type": "quantiles", "column": "x", "bounds": [LO, HI], "quantiles": [0.5]}],
                 epsilon=epsilon)
    plan = plan_release(spec)
    m = plan.metrics[0]
    hist = np.full((P_QUANTILES, m.n_bins + 1), per_bin, np.int64)
    out = _run(plan, {"count": hist.sum(axis=1), "unit_count": hist.sum(axis=1), f"hist:{m.key}": hist},
               seed=90 + per_bin)
    n = int(hist[0].sum())
    cand = LO + (HI - LO) * np.arange(m.n_bins + 1) / m.n_bins
    ranks = np.cumsum(hist[0])
    idx = np.searchsorted(cand, np.asarray(out[f"{m.key}_q50"]))
    excess = np.abs(ranks[idx] - 0.5 * n) - np.abs(ranks - 0.5 * n).min()
    predicted = quantile_typical_rank_error(m)
    mean, sd = float(excess.mean()), float(excess.std(ddof=1))
    assert mean - Z * sd / math.sqrt(P_QUANTILES) <= predicted, (mean, predicted)
    if dense:
        assert predicted / 1.25 <= mean + Z * sd / math.sqrt(P_QUANTILES), (mean, predicted)
    pred = next(p for p in predict(plan, at_units=n) if p.type == "quantiles")
    assert pred.expected_rank_error == predicted and pred.rank_error_bound is not None
    assert pred.rank_error_bound > 6 * predicted  # the bound stays visible, and it is 6.5x the typical error


def _heavy_hist(rows: int, n_cells: int, seed: int) -> np.ndarray:
    """Lognormal(3, 1) amounts with a Pareto(1.5) tail on 5% of the rows, on the grid of [LO, HI]."""
    g = np.random.default_rng(seed)
    v = g.lognormal(3.0, 1.0, rows)
    tail = g.random(rows) < 0.05
    v[tail] = 60.0 * (1.0 + g.pareto(1.5, int(tail.sum())))
    cell = np.floor(np.clip(v, LO, HI) / (HI - LO) * (n_cells - 1)).astype(np.int64)
    return np.bincount(np.clip(cell, 0, n_cells - 1), minlength=n_cells).astype(np.int64)


RANK_CASES = [("dense", 2, 0.5, 1.0), ("dense", 80, 0.5, 0.2), ("heavy", 1000, 0.9, 0.2), ("heavy", 300, 0.5, 1.0)]
A3 = ALPHA / len(RANK_CASES)  # these checks together at the file's ALPHA
Z3 = float(stats.norm.ppf(1 - A3 / 2))


@pytest.mark.parametrize("shape,size,q,epsilon", RANK_CASES, ids=lambda c: str(c))
def test_exact_rank_error_for_the_data_matches_the_release_path(shape, size, q, epsilon):
    """``quantile_rank_error_for_histogram`` (permute-and-flip's exact law on the release's own utilities)
    against 1,000 releases through select_and_noise: the sample mean of the excess rank error within
    Z3 standard errors of the prediction, the standard error from the same exact law (two-sided)."""
    from dpops.analysis.accuracy import quantile_rank_error_for_histogram
    from dpops.noise.selection import histogram_quantile_utility, permute_and_flip_pmf

    spec = _spec("laplace", [{"type": "quantiles", "column": "x", "bounds": [LO, HI], "quantiles": [q]}],
                 epsilon=epsilon)
    plan = plan_release(spec)
    m = plan.metrics[0]
    one = np.full(m.n_bins + 1, size, np.int64) if shape == "dense" else _heavy_hist(size, m.n_bins + 1, 26 + size)
    predicted = quantile_rank_error_for_histogram(m, one, q)
    util, d = histogram_quantile_utility(one, q)
    excess = np.abs(util.astype(np.float64)) / d
    excess -= excess.min()
    pmf = permute_and_flip_pmf(util, m.per_run_epsilon, m.utility_sensitivity * d)
    sd = math.sqrt(float(pmf @ excess**2) - predicted**2)
    hist = np.tile(one, (P_QUANTILES, 1))
    out = _run(plan, {"count": hist.sum(axis=1), "unit_count": hist.sum(axis=1), f"hist:{m.key}": hist},
               seed=300 + size)
    cand = LO + (HI - LO) * np.arange(m.n_bins + 1) / m.n_bins
    idx = np.searchsorted(cand, np.asarray(out[f"{m.key}_{m.quantile_suffixes[0]}"]))
    mean = float(excess[idx].mean())
    assert abs(mean - predicted) <= Z3 * sd / math.sqrt(P_QUANTILES), (mean, predicted, sd)
    assert predicted > 0.5  # a regime where a wrong law would show


# Prediction version 3 at small partitions: variance (m1 = 0 and m1 != 0) and a sum near 0, both noises, at a
# metric's share of a five-metric release (epsilon 0.2), through select_and_noise. Each case checks the
# interval's coverage (Binomial(P_SIZES, c) with c the exact predicted coverage, central 1 - A4 band) and the
# std (the mean square error against std^2, normal approximation of its sample mean): 2 x (8 + 2) + 1 checks at
# the file's ALPHA together (false failure <= 1e-4).
V_CASES = [(noise, n, m1) for noise in ("laplace", "gaussian") for n in (100, 300) for m1 in (0.0, 10.0)]
A4 = ALPHA / (2 * (len(V_CASES) + 2) + 1)  # + the one-sided mean interval's band below
Z4 = float(stats.norm.ppf(1 - A4 / 2))
V_EPS = 0.2
V_SPREAD = H / 2  # values at mid + m1 -+ V_SPREAD: centred moments m1, m2 = m1^2 + V_SPREAD^2


def _check_interval_and_std(err: np.ndarray, low: float, high: float, cov: float, std: float, what: str) -> None:
    P = err.size
    k = int(((err >= low) & (err <= high)).sum())
    lo, hi = int(stats.binom.ppf(A4 / 2, P, cov)), int(stats.binom.isf(A4 / 2, P, cov))
    assert lo <= k <= hi, f"{what}: {k}/{P} within [{low:.5g}, {high:.5g}], predicted {cov:.4f} ({lo}..{hi})"
    assert abs(cov - 0.95) <= 0.005  # the interval is a 95% interval (issue 26: 0.95 +- 0.01)
    # std is the root mean square error (the clipping biases it): mean(err^2) against std^2, within Z4
    # standard errors of that sample mean (the error is bounded, so err^2 has a finite variance)
    sq = err**2
    ratio, tol = float(sq.mean()) / std**2, Z4 * float(sq.std(ddof=1)) / math.sqrt(P) / std**2
    assert abs(ratio - 1) <= tol, f"{what}: mean square ratio {ratio:.4f}, tolerance +-{tol:.4f}"


@pytest.mark.parametrize("noise,n,m1", V_CASES)
def test_variance_prediction_holds_at_small_partitions(noise, n, m1):
    """``variance_interval``/``variance_error`` (version 3: the noisy count in the denominator, the squared
    mean noise and the clipping to [0, h^2]) against P_SIZES releases. The first-order prediction of versions
    1-2 (``first_order_variance_error``) fails every case: planted, it covered 0.989-1.000 of these draws (at
    epsilon 1 in the bench's five-metric release it under-covers instead: 0.90 at 300 rows)."""
    from dpops.analysis.accuracy import variance_interval

    plan = plan_release(_spec(noise, [{"type": "variance", "column": "x", "bounds": [LO, HI]}], epsilon=V_EPS))
    m = plan.metrics[0]
    m2 = m1 * m1 + V_SPREAD**2
    acc = {"count": np.full(P_SIZES, n, np.int64), "unit_count": np.full(P_SIZES, n, np.int64),
           f"nsum:{m.key}": np.full(P_SIZES, int(round(n * m1 / sum_unit("nsum", LO, HI))), np.int64),
           f"nsq:{m.key}": np.full(P_SIZES, int(round(n * (m2 - H * H / 2) / sum_unit("nsq", LO, HI))), np.int64)}
    out = _run(plan, acc, seed=7000 + n + int(m1) + (0 if noise == "laplace" else 1))
    std, _, _, method = variance_error(plan, m, n, m1, m2, 0.95)
    assert method.startswith("exact")
    low, high, cov = variance_interval(plan, m, n, m1, m2, 0.95)
    err = np.asarray(out[m.key], np.float64) - V_SPREAD**2
    _check_interval_and_std(err, low, high, cov, std, f"{noise} variance n={n} m1={m1}")


@pytest.mark.parametrize("noise", ["laplace", "gaussian"])
def test_sum_prediction_holds_near_zero(noise):
    """``sum_interval``/``sum_error`` (version 3: the release's clamp at 0) for a sum of 100 rows of value 10
    against P_SIZES releases. The raw-noise interval (versions 1-2, ``vector_error``) over-covers here
    (planted: 0.976-0.977; the clamp moves every negative draw back towards the truth) and fails the band."""
    from dpops.analysis.accuracy import sum_error, sum_interval

    plan = plan_release(_spec(noise, [{"type": "sum", "column": "x", "bounds": [LO, HI]}], epsilon=V_EPS))
    m = plan.metrics[0]
    n, value = 100, 10.0
    acc = {"count": np.full(P_SIZES, n, np.int64), "unit_count": np.full(P_SIZES, n, np.int64),
           f"sum:{m.key}": np.full(P_SIZES, int(round(n * value / sum_unit("sum", LO, HI))), np.int64)}
    out = _run(plan, acc, seed=7500 + (0 if noise == "laplace" else 1))
    std, _, _, method = sum_error(plan, m, n * value, 0.95)
    assert "clamp" in method
    low, high, cov = sum_interval(plan, m, n * value, 0.95)
    err = np.asarray(out[m.key], np.float64) - n * value
    assert err.min() >= -n * value  # the clamp at 0 is in reach: the regime this is about
    _check_interval_and_std(err, low, high, cov, std, f"{noise} sum near 0")


def test_gaussian_mean_interval_is_one_sided_at_the_clip():
    """At 100 rows and epsilon 0.7 the Gaussian mean's smallest symmetric half-width reaches the upper clip,
    where its coverage jumps to 0.98 (an atom: the clipped mass):
    ``mean_interval`` (version 3) is one-sided there, and its exact coverage 0.95 holds for P_SIZES releases
    (band at A4, counted in its budget).
    Planted, the symmetric interval's predicted coverage (``mean_error``) fails the 0.95 +- 0.005 line."""
    from dpops.analysis.accuracy import mean_interval

    plan = plan_release(_spec("gaussian", [{"type": "mean", "column": "x", "bounds": [LO, HI]}], epsilon=0.7))
    m = plan.metrics[0]
    n = 100
    low, high, cov = mean_interval(plan, m, n, D, 0.95)
    _, half, sym_cov, _ = mean_error(plan, m, n, D, 0.95)
    assert high == pytest.approx(H - D) and -low < half  # one-sided at the upper clip
    assert sym_cov > 0.955  # the symmetric interval over-covers: why the rule exists
    out = _run(plan, _mean_accumulators(plan, n, D, P_SIZES), seed=7700)
    err = np.asarray(out[m.key], np.float64) - (MID + D)
    k = int(((err >= low) & (err <= high)).sum())
    lo, hi = int(stats.binom.ppf(A4 / 2, P_SIZES, cov)), int(stats.binom.isf(A4 / 2, P_SIZES, cov))
    assert lo <= k <= hi, f"{k}/{P_SIZES} within [{low:.5g}, {high:.5g}], predicted {cov:.4f} ({lo}..{hi})"
    assert abs(cov - 0.95) <= 0.005


@pytest.mark.parametrize("order", [[0.1, 0.9], [0.9, 0.1], [0.5, 0.1, 0.9]])
def test_each_quantile_column_holds_its_own_quantile_whatever_the_spec_order(order):
    """The release sorts its picks so that published quantiles never cross; the smallest pick must land in the
    smallest quantile's column, not in the first column the spec lists (a spec with [0.9, 0.1] once published
    the 10th percentile as q90). Deterministic: on heavy data at epsilon 50 every pick is within a few cells of
    its quantile, and the 10th and 90th percentiles are 60 cells apart, so the columns are ordered in every
    release, and each lies near its own quantile's cell."""
    spec = _spec("laplace", [{"type": "quantiles", "column": "x", "bounds": [LO, HI], "quantiles": order}],
                 epsilon=50.0)
    plan = plan_release(spec)
    m = plan.metrics[0]
    hist = np.tile(_heavy_hist(20_000, m.n_bins + 1, 3), (200, 1))
    out = _run(plan, {"count": hist.sum(axis=1), "unit_count": hist.sum(axis=1), f"hist:{m.key}": hist}, seed=7)
    cols = dict(zip(m.quantiles, m.quantile_suffixes, strict=True))
    cand = LO + (HI - LO) * np.arange(m.n_bins + 1) / m.n_bins
    cdf = np.cumsum(hist[0]) / hist[0].sum()
    for q, suffix in cols.items():
        got = np.asarray(out[f"{m.key}_{suffix}"], np.float64)
        true = cand[int(np.searchsorted(cdf, q))]
        assert np.all(np.abs(got - true) <= 3 * (HI - LO) / m.n_bins), (q, true, np.unique(got))
    assert np.all(np.asarray(out[f"{m.key}_{cols[0.1]}"]) < np.asarray(out[f"{m.key}_{cols[0.9]}"]))
