"""Exact samplers against their exact distributions.

Every goodness-of-fit check uses alpha = 1e-4: with a correct sampler a fresh seed would fail
with probability 1e-4 per check; the seeds here are fixed, so the outcome is deterministic.
The "wrong scale" tests show the same statistic rejects a 10%-wrong scale (p < 1e-4).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from dpops.errors import InvalidParameter
from dpops.noise.randomness import os_random, test_random
from dpops.noise.samplers import (
    bernoulli_exp,
    bernoulli_float,
    discrete_gaussian,
    discrete_gaussian_param,
    discrete_laplace,
    discrete_laplace_param,
)

ALPHA = 1e-4
Z_ALPHA = stats.norm.isf(ALPHA / 2)  # two-sided normal threshold for alpha = 1e-4 (~3.89)
N = 100_000


def laplace_pmf(scale: float, k: np.ndarray) -> np.ndarray:
    p = math.exp(-1.0 / scale)
    return (1 - p) / (1 + p) * p ** np.abs(k)


def gaussian_pmf(sigma2: float, k: np.ndarray) -> np.ndarray:
    half = int(40 * math.sqrt(sigma2)) + 3
    support = np.arange(-half, half + 1)
    z = np.exp(-(support**2) / (2 * sigma2)).sum()
    return np.exp(-(k.astype(float) ** 2) / (2 * sigma2)) / z


def chi2_pvalue(samples: np.ndarray, pmf) -> float:
    """Chi-square goodness of fit on the integers, tails pooled so every bin expects >= 5."""
    n = samples.size
    lo, hi = int(samples.min()) - 1, int(samples.max()) + 1
    ks = np.arange(lo - 200, hi + 201)
    probs = pmf(ks)
    # central bins: consecutive integers whose expected count is >= 5; the rest pooled into two tails
    keep = np.nonzero(probs * n >= 5)[0]
    a, b = ks[keep[0]], ks[keep[-1]]
    centre = np.arange(a, b + 1)
    p_centre = pmf(centre)
    p_left = max(0.0, 1.0 - p_centre.sum()) / 2  # symmetric distributions: split the remainder
    obs = [np.sum(samples < a)] + [np.sum(samples == k) for k in centre] + [np.sum(samples > b)]
    exp = np.array([p_left] + list(p_centre) + [p_left]) * n
    obs = np.array(obs, dtype=float)
    if exp[0] < 5:  # tails too light to test on their own: fold them into the edge bins
        obs[1] += obs[0]
        obs[-2] += obs[-1]
        exp[1] += exp[0]
        exp[-2] += exp[-1]
        obs, exp = obs[1:-1], exp[1:-1]
    exp = exp * obs.sum() / exp.sum()
    return float(stats.chisquare(obs, exp).pvalue)


@pytest.mark.parametrize("scale", [0.7, 1.0, 3.5, 20.0])
def test_discrete_laplace_fits_its_distribution(scale):
    x = discrete_laplace(scale, N, test_random(11, ["dlap", str(scale)]))
    assert x.dtype == np.int64
    used = float(discrete_laplace_param(scale).scale)
    assert chi2_pvalue(x, lambda k: laplace_pmf(used, k)) > ALPHA


@pytest.mark.parametrize("sigma", [0.8, 2.0, 7.3, 50.0])
def test_discrete_gaussian_fits_its_distribution(sigma):
    x = discrete_gaussian(sigma, N, test_random(12, ["dg", str(sigma)]))
    assert x.dtype == np.int64
    s2 = float(discrete_gaussian_param(sigma).sigma2)
    assert chi2_pvalue(x, lambda k: gaussian_pmf(s2, k)) > ALPHA


@pytest.mark.parametrize("scale", [3.5, 20.0])
def test_a_ten_percent_wrong_laplace_scale_is_rejected(scale):
    wrong = discrete_laplace(scale * 1.1, N, test_random(13, ["wrong", str(scale)]))
    assert chi2_pvalue(wrong, lambda k: laplace_pmf(scale, k)) < ALPHA
    wrong = discrete_laplace(scale / 1.1, N, test_random(14, ["wrong", str(scale)]))
    assert chi2_pvalue(wrong, lambda k: laplace_pmf(scale, k)) < ALPHA


@pytest.mark.parametrize("sigma", [2.0, 7.3])
def test_a_ten_percent_wrong_gaussian_sigma_is_rejected(sigma):
    wrong = discrete_gaussian(sigma * 1.1, N, test_random(15, ["wrong", str(sigma)]))
    assert chi2_pvalue(wrong, lambda k: gaussian_pmf(sigma**2, k)) < ALPHA
    wrong = discrete_gaussian(sigma / 1.1, N, test_random(16, ["wrong", str(sigma)]))
    assert chi2_pvalue(wrong, lambda k: gaussian_pmf(sigma**2, k)) < ALPHA


@pytest.mark.parametrize("num,den", [(0, 1), (3, 10), (1, 1), (3, 2), (7, 3), (5, 1), (123456789, 100000000)])
def test_bernoulli_exp_frequencies_are_exact(num, den):
    n = 200_000
    hits = int(bernoulli_exp(np.full(n, num), np.full(n, den), test_random(17, [num, den])).sum())
    p = math.exp(-num / den)
    if p == 1.0:
        assert hits == n
        return
    z = (hits - n * p) / math.sqrt(n * p * (1 - p))
    assert abs(z) < Z_ALPHA


def test_bernoulli_exp_python_int_path_is_exact():
    # numerators and denominators far beyond int64 go through the exact Python-int path
    n = 3000
    big = 10**30
    num = np.array([big * 3 // 2] * n, dtype=object)
    den = np.array([big] * n, dtype=object)
    hits = int(bernoulli_exp(num, den, test_random(18)).sum())
    p = math.exp(-1.5)
    assert abs((hits - n * p) / math.sqrt(n * p * (1 - p))) < Z_ALPHA


def test_bernoulli_float_is_exact_for_doubles():
    src = test_random(19)
    n = 200_000
    for p in (0.0, 1.0, 0.3, 1e-3):
        hits = int(bernoulli_float(np.full(n, p), src).sum())
        if p in (0.0, 1.0):
            assert hits == n * p
        else:
            assert abs((hits - n * p) / math.sqrt(n * p * (1 - p))) < Z_ALPHA
    with pytest.raises(InvalidParameter):
        bernoulli_float(np.array([1.5]), src)


def test_parameters_are_rounded_up_and_recorded_exactly():
    for scale in (0.1, 0.7, 1 / 3, 1.0, 3.5, 1234.567, 2.0**40 + 0.5):
        p = discrete_laplace_param(scale)
        assert p.scale >= Fraction(scale)
        assert p.scale - Fraction(scale) <= Fraction(scale) * Fraction(1, 2**38)
        assert Fraction(p.scale_float) >= Fraction(scale)
    for sigma in (0.3, 0.8, 1.0, 4.2307, 100.0, 12345.678, 1e6):
        g = discrete_gaussian_param(sigma)
        s2 = Fraction(sigma) ** 2
        assert g.sigma2 >= s2
        assert g.sigma2 - s2 <= s2 * Fraction(1, 2**24)
        assert Fraction(g.sigma_float) ** 2 <= g.sigma2  # the recorded double never overstates sigma
        assert g.t == math.floor(sigma) + 1


def test_moments_match_for_large_scales():
    # mean 0 and variance of the exact distribution, 5-sigma-ish bounds derived from the 4th moment
    src = test_random(20)
    n = 200_000
    x = discrete_gaussian(1000.0, n, src).astype(float)
    assert abs(x.mean()) < Z_ALPHA * 1000.0 / math.sqrt(n)
    assert abs(x.var() / 1e6 - 1) < Z_ALPHA * math.sqrt(2 / n)
    y = discrete_laplace(1000.0, n, src).astype(float)
    var = discrete_laplace_param(1000.0).variance()
    assert abs(y.var() / var - 1) < Z_ALPHA * math.sqrt(5 / n)  # Var(X²)/Var² = 5 for Laplace


def test_same_seed_same_samples_and_os_mode_works():
    a = discrete_laplace(2.5, 1000, test_random(21, ["r"]))
    b = discrete_laplace(2.5, 1000, test_random(21, ["r"]))
    assert np.array_equal(a, b)
    assert discrete_gaussian(3.0, 10, os_random()).shape == (10,)
    assert discrete_laplace(3.0, 0, os_random()).shape == (0,)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "3", True])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(InvalidParameter):
        discrete_laplace(bad, 10, test_random(1))
    with pytest.raises(InvalidParameter):
        discrete_gaussian(bad, 10, test_random(1))


def test_bad_sample_counts_and_bernoulli_inputs():
    with pytest.raises(InvalidParameter):
        discrete_laplace(1.0, -1, test_random(1))
    with pytest.raises(InvalidParameter):
        bernoulli_exp(np.array([-1]), np.array([1]), test_random(1))
    with pytest.raises(InvalidParameter):
        bernoulli_exp(np.array([1]), np.array([0]), test_random(1))
    with pytest.raises(InvalidParameter):
        bernoulli_exp(np.array([0.5]), np.array([1]), test_random(1))
