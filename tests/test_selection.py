"""Selection: permute-and-flip distribution, top-k, quantiles, partition selection.

Statistical checks use alpha = 1e-4 (false-failure rate per check with a fresh seed; seeds fixed).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from fuzz_support import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from dpops.errors import InvalidParameter
from dpops.events import ApproxDP, PureDP
from dpops.noise.randomness import test_random
from dpops.noise.selection import (
    STRATEGIES,
    PartitionSelection,
    dp_quantile,
    dp_quantile_event,
    exponential_mechanism,
    exponential_mechanism_event,
    quantile_histogram,
    top_k,
    top_k_event,
)

ALPHA = 1e-4
Z_ALPHA = stats.norm.isf(ALPHA / 2)


def pf_distribution(u, rate):
    """Exact output distribution of permute-and-flip, by enumerating every order."""
    u = np.asarray(u, dtype=float)
    p = np.exp(rate * (u - u.max()))
    out = np.zeros(u.size)
    perms = list(itertools.permutations(range(u.size)))
    for perm in perms:
        survive = 1.0
        for i in perm:
            out[i] += survive * p[i]
            survive *= 1 - p[i]
    return out / len(perms)


def pf_distribution_formula(u, rate):
    """Same distribution for any n: P(i) = p_i · Σ_m m!(n-1-m)!/n! · e_m({1 - p_j : j != i})."""
    u = np.asarray(u, dtype=float)
    p = np.exp(rate * (u - u.max()))
    n = u.size
    weights = np.array([math.factorial(m) * math.factorial(n - 1 - m) / math.factorial(n) for m in range(n)])
    out = np.zeros(n)
    for i in range(n):
        e = np.zeros(n)
        e[0] = 1.0  # elementary symmetric polynomials of the others' rejection probabilities
        for j in range(n):
            if j != i:
                e[1:] = e[1:] + e[:-1] * (1 - p[j])
        out[i] = p[i] * float(weights @ e)
    return out


def test_pf_formula_matches_enumeration():
    assert np.allclose(pf_distribution(U, 0.7), pf_distribution_formula(U, 0.7), rtol=1e-12)


@pytest.mark.parametrize("sequential_max", [8, 256], ids=["vectorised", "sequential"])
def test_both_pf_paths_have_the_exact_distribution(sequential_max, monkeypatch):
    import dpops.noise.selection as sel

    monkeypatch.setattr(sel, "_SEQUENTIAL_MAX", sequential_max)
    u = np.arange(40) // 4  # 40 candidates, ties included
    n = 1500
    src = test_random(11, ["pf", sequential_max])
    counts = np.bincount([exponential_mechanism(u, 2.0, 1.0, src) for _ in range(n)], minlength=u.size)
    expected = pf_distribution_formula(u, 1.0) * n
    keep = expected >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    assert stats.chisquare(obs, exp).pvalue > ALPHA


def draw(u, eps, sens, seed, n, monotonic=False):
    src = test_random(seed, ["pf"])
    return np.bincount([exponential_mechanism(u, eps, sens, src, monotonic=monotonic) for _ in range(n)], minlength=len(u))


U = [10, 9, 5, 0, 10]
N_DRAWS = 6000


def test_permute_and_flip_has_the_exact_distribution():
    counts = draw(U, 1.0, 1.0, 1, N_DRAWS)
    expected = pf_distribution(U, 1.0 / 2) * N_DRAWS
    pooled = np.array([counts[0], counts[1], counts[2] + counts[3], counts[4]])
    exp_pooled = np.array([expected[0], expected[1], expected[2] + expected[3], expected[4]])
    assert stats.chisquare(pooled, exp_pooled).pvalue > ALPHA
    # the same statistic rejects a 50% wrong epsilon (shows the test can fail)
    wrong = pf_distribution(U, 1.5 / 2) * N_DRAWS
    exp_wrong = np.array([wrong[0], wrong[1], wrong[2] + wrong[3], wrong[4]])
    assert stats.chisquare(pooled, exp_wrong).pvalue < ALPHA


def test_monotonic_and_float_paths():
    counts = draw(U, 1.0, 1.0, 2, N_DRAWS, monotonic=True)
    expected = pf_distribution(U, 1.0) * N_DRAWS
    keep = expected >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    assert stats.chisquare(obs, exp).pvalue > ALPHA
    # non-integer utilities go through the documented float path with the same distribution
    uf = [u + 0.25 for u in U]
    counts = draw(uf, 1.0, 1.0, 3, N_DRAWS)
    expected = pf_distribution(uf, 0.5) * N_DRAWS
    pooled = np.array([counts[0], counts[1], counts[2] + counts[3], counts[4]])
    exp_pooled = np.array([expected[0], expected[1], expected[2] + expected[3], expected[4]])
    assert stats.chisquare(pooled, exp_pooled).pvalue > ALPHA


def test_huge_utilities_stay_exact():
    u = np.array([0, 10**15, 10**15 - 1, -(10**15)], dtype=np.int64)
    picks = {exponential_mechanism(u, 1.0, 1.0, test_random(4)) for _ in range(50)}
    assert picks <= {1, 2}


def test_top_k():
    u = np.array([5, 100, 3, 90, 80, 1, 70])
    assert top_k(u, 3, 1000.0, 1.0, test_random(5)) == [1, 3, 4]
    picks = top_k(u, 7, 0.01, 1.0, test_random(6))
    assert sorted(picks) == list(range(7))
    with pytest.raises(InvalidParameter, match="larger than the number"):
        top_k(u, 8, 1.0, 1.0, test_random(6))
    assert top_k_event(1.0, 3) == PureDP(1.0, mechanism="top_k/peeling_permute_and_flip")
    assert exponential_mechanism_event(0.5).epsilon == 0.5


def test_quantiles_are_accurate_with_plenty_of_budget_and_histograms_agree():
    vals = np.random.default_rng(0).uniform(0, 100, 20_001)
    for q in (0.1, 0.5, 0.9):
        est = dp_quantile(vals, 0, 100, q, 50.0, test_random(7, [str(q)]))
        assert abs(est - np.quantile(vals, q)) < 0.5
        hist = quantile_histogram(vals, 0, 100)
        assert dp_quantile(hist, 0, 100, q, 50.0, test_random(7, [str(q)]), histogram=True) == est
    assert dp_quantile_event(0.3) == PureDP(0.3, mechanism="quantile/exponential_mechanism")


def test_quantile_with_little_budget_is_noisy_but_in_range():
    vals = np.array([50.0] * 10)
    outs = [dp_quantile(vals, 0, 100, 0.5, 0.1, test_random(8, [i])) for i in range(20)]
    assert all(0 <= o <= 100 for o in outs)
    assert len(set(outs)) > 1


def test_quantile_bad_input():
    with pytest.raises(InvalidParameter):
        dp_quantile([1.0], 0, 100, 1.5, 1.0, test_random(1))
    with pytest.raises(InvalidParameter):
        dp_quantile([1.0, np.nan], 0, 100, 0.5, 1.0, test_random(1))
    with pytest.raises(InvalidParameter):
        dp_quantile([1.0], 100, 0, 0.5, 1.0, test_random(1))
    with pytest.raises(InvalidParameter):
        dp_quantile(np.ones(3, dtype=int), 0, 100, 0.5, 1.0, test_random(1), histogram=True)


@pytest.mark.parametrize("l0", [1, 4])
@pytest.mark.parametrize("eps,delta", [(1.0, 1e-6), (0.1, 1e-8), (3.0, 1e-5)])
def test_truncated_geometric_is_optimal_and_dp(l0, eps, delta):
    ps = PartitionSelection("truncated_geometric", eps, delta, l0)
    n = np.arange(0, 5000)
    p = ps.keep_probability(n)
    e, d = eps / l0, delta / l0
    assert p[0] == 0.0 and p[1] == pytest.approx(d, rel=1e-12)
    assert np.all(np.diff(p) >= 0) and p[-1] == 1.0
    tol = 1e-15
    # neighbouring unit counts n-1, n (add/remove one unit): both DP inequalities, per partition
    assert np.all(p[1:] <= math.exp(e) * p[:-1] + d + tol)
    assert np.all(1 - p[:-1] <= math.exp(e) * (1 - p[1:]) + d + tol)
    # optimal: each step is as large as the constraints allow
    bound = np.minimum.reduce([np.ones(n.size - 1), math.exp(e) * p[:-1] + d, 1 - math.exp(-e) * (1 - p[:-1] - d)])
    assert np.allclose(p[1:], bound, rtol=1e-12, atol=1e-300)
    assert ps.event() == ApproxDP(eps, delta, mechanism="partition_selection/truncated_geometric")


@pytest.mark.parametrize("strategy", ["laplace_threshold", "gaussian_threshold"])
@pytest.mark.parametrize("l0", [1, 3])
def test_thresholds_charge_the_one_unit_partition_in_delta(strategy, l0):
    eps, delta = 1.0, 1e-6
    ps = PartitionSelection(strategy, eps, delta, l0)
    budget = delta if strategy == "laplace_threshold" else delta / 2
    p1 = float(ps.keep_probability(np.array([1]))[0])
    assert 0 < l0 * p1 <= budget
    # the threshold is the smallest that works: one less would leak more than the budget
    tail = ps.noise.tail
    assert l0 * tail(ps.threshold - 1) <= budget < l0 * tail(ps.threshold - 2)
    if strategy == "laplace_threshold":
        assert ps.noise.t / ps.noise.s >= l0 / eps  # L1 of the unit-count vector is L0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_keep_probability_is_exact_and_empirical_rate_matches(strategy):
    ps = PartitionSelection(strategy, 1.0, 1e-6, 2)
    n = np.arange(0, 200)
    p = ps.keep_probability(n)
    assert np.all(np.diff(p) >= -1e-15)
    if strategy != "truncated_geometric":
        # independent computation from the noise pmf: P(n + Z >= T)
        lat = ps.noise
        ks = np.arange(-3000, 3001)
        if strategy == "laplace_threshold":
            q = math.exp(-lat.s / lat.t)
            pmf = (1 - q) / (1 + q) * q ** np.abs(ks)
        else:
            w = np.exp(-(ks.astype(float) ** 2) / (2 * float(lat.sigma2)))
            pmf = w / w.sum()
        direct = np.array([pmf[ks >= ps.threshold - c].sum() for c in n[1:]])
        assert np.allclose(p[1:], direct, rtol=1e-9, atol=1e-15)
    # pick the count whose keep probability is closest to 1/2 and sample it
    c = int(n[np.argmin(np.abs(p - 0.5))])
    trials = 40_000
    kept = int(ps.keep(np.full(trials, c), test_random(9, [strategy])).sum())
    pc = float(p[c])
    assert abs(kept - trials * pc) < Z_ALPHA * math.sqrt(trials * pc * (1 - pc))
    assert not ps.keep(np.zeros(1000, dtype=int), test_random(10)).any()


@pytest.mark.parametrize(
    "args",
    [
        ("median", 1.0, 1e-6, 1),
        ("truncated_geometric", 0.0, 1e-6, 1),
        ("truncated_geometric", float("nan"), 1e-6, 1),
        ("laplace_threshold", 1.0, 0.0, 1),
        ("laplace_threshold", 1.0, 1.0, 1),
        ("gaussian_threshold", 1.0, 1e-6, 0),
    ],
)
def test_partition_selection_bad_input(args):
    with pytest.raises(InvalidParameter):
        PartitionSelection(*args)


def test_exponential_mechanism_bad_input():
    src = test_random(1)
    for bad in ([], [1.0, np.nan], [[1, 2]], ["a"]):
        with pytest.raises(InvalidParameter):
            exponential_mechanism(bad, 1.0, 1.0, src)
    with pytest.raises(InvalidParameter):
        exponential_mechanism([1, 2], 0.0, 1.0, src)
    with pytest.raises(InvalidParameter):
        exponential_mechanism([1, 2], 1.0, -1.0, src)


# --------------------------------------------------------------------------- the exact pmf (a prediction)


@pytest.mark.parametrize("u,eps,sens", [([0, -1, -3, -3, -10], 1.0, 1.0), ([5, 5, 4, 0, -2, 7], 0.3, 2.0),
                                        ([0.0, -0.5, -2.25, -7.0], 2.0, 1.0), ([3], 1.0, 1.0)])
def test_permute_and_flip_pmf_is_the_enumerated_distribution(u, eps, sens):
    """``permute_and_flip_pmf`` (Gauss-Legendre over arrival times) against every order enumerated, on integer
    (exact, dyadic-rounded rate: 30 bits, so 1e-7 relative) and float utilities."""
    from dpops.noise.selection import permute_and_flip_pmf

    got = permute_and_flip_pmf(np.asarray(u), eps, sens)
    assert np.allclose(got, pf_distribution(u, eps / (2 * sens)), rtol=1e-7, atol=1e-15)
    assert got.sum() == pytest.approx(1.0, abs=1e-12)


def test_permute_and_flip_pmf_over_a_full_quantile_grid():
    """257 candidates with ties (the quantile grid): against the elementary-symmetric formula."""
    from dpops.noise.selection import permute_and_flip_pmf

    u = -np.abs(np.arange(257) // 3 - 40)
    got = permute_and_flip_pmf(u, 0.5, 4.0)
    assert np.allclose(got, pf_distribution_formula(u, 0.5 / 8.0), rtol=1e-7, atol=1e-15)


@settings(max_examples=examples(60))
@given(u=st.lists(st.integers(-50, 50), min_size=1, max_size=6), eps=st.floats(0.01, 5.0), sens=st.integers(1, 8))
def test_permute_and_flip_pmf_property(u, eps, sens):
    """Any integer utilities the data could give: the pmf is the enumerated permute-and-flip law."""
    from dpops.noise.selection import permute_and_flip_pmf

    got = permute_and_flip_pmf(np.asarray(u, dtype=np.int64), eps, float(sens))
    assert np.allclose(got, pf_distribution(u, eps / (2 * sens)), rtol=1e-6, atol=1e-12)


@settings(max_examples=examples(40), deadline=None)
@given(st.floats(0.01, 4.0), st.sampled_from([1e-5, 1e-7, 1e-9, 1e-12, 3e-6]), st.integers(1, 8))
def test_truncated_geometric_steps_hold_in_exact_arithmetic(eps, delta, l0):
    """Review 5 lead: the keep table was computed rounded to nearest, and 40% of its steps broke the exact DP
    constraints by up to 3.5e-16, i.e. the selection's true delta was above the one charged. Every step must
    hold exactly (200-bit arithmetic on the stored floats and e^eps), with no tolerance."""
    import mpmath as mp

    ps = PartitionSelection("truncated_geometric", eps, delta, l0)
    table = ps.keep_probability(np.arange(0, 200_000))
    last = int(np.argmax(table == 1.0))
    assert table[last] == 1.0
    with mp.workprec(200):
        e, d = mp.e ** (mp.mpf(eps) / l0), mp.mpf(delta) / l0
        for a, b in zip(table[:last].tolist(), table[1:last + 1].tolist(), strict=True):
            a, b = mp.mpf(a), mp.mpf(b)
            assert b <= e * a + d and 1 - a <= e * (1 - b) + d
