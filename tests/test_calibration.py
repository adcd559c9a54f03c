"""Calibration: exact conditions hold at the returned sigma and fail just below it."""

from __future__ import annotations

import math

import pytest
from fuzz_support import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from dp_accounting.pld import privacy_loss_distribution as pld

from dpops.noise.calibration import (
    discrete_gaussian_delta,
    discrete_gaussian_sigma,
    discrete_gaussian_sigma_zcdp,
    gaussian_delta_analytic,
    gaussian_sigma_analytic,
    gaussian_sigma_classical,
    gaussian_sigma_zcdp,
    laplace_scale,
    zcdp_epsilon,
    zcdp_rho_for,
)
from dpops.errors import InvalidParameter

CASES = [(1.0, 1e-6, 1.0), (0.5, 1e-5, 1.0), (0.1, 1e-6, 3.0), (5.0, 1e-9, 2.0), (0.01, 1e-8, 1.0), (20.0, 1e-12, 1.0)]


def test_laplace_scale():
    assert laplace_scale(0.5, 2.0) == 4.0
    assert laplace_scale(1.0, 1.0) == 1.0


@pytest.mark.parametrize("eps,delta,sens", CASES)
def test_analytic_gaussian_is_the_smallest_sigma(eps, delta, sens):
    sigma = gaussian_sigma_analytic(eps, delta, sens)
    assert gaussian_delta_analytic(eps, sigma, sens) <= delta
    assert gaussian_delta_analytic(eps, sigma * (1 - 1e-6), sens) > delta


@pytest.mark.parametrize("eps,delta,sens", CASES[:4])
def test_analytic_matches_dp_accounting(eps, delta, sens):
    # independent implementation: dp_accounting's exact Gaussian privacy loss distribution
    sigma = gaussian_sigma_analytic(eps, delta, sens)
    ref = pld.from_gaussian_mechanism(sigma, sensitivity=sens, value_discretization_interval=1e-4)
    assert ref.get_delta_for_epsilon(eps) == pytest.approx(delta, rel=0.05)


@pytest.mark.parametrize("eps", [0.01, 0.1, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("delta", [1e-5, 1e-10])
def test_classical_is_never_below_analytic(eps, delta):
    assert gaussian_sigma_classical(eps, delta, 1.0) >= gaussian_sigma_analytic(eps, delta, 1.0)


def test_classical_refuses_large_epsilon():
    with pytest.raises(InvalidParameter, match="epsilon < 1"):
        gaussian_sigma_classical(1.0, 1e-6, 1.0)


@pytest.mark.parametrize("eps,delta,sens", [(1.0, 1e-6, 1), (0.5, 1e-5, 1), (0.1, 1e-6, 3), (5.0, 1e-9, 2)])
def test_discrete_gaussian_exact_condition(eps, delta, sens):
    sigma = discrete_gaussian_sigma(eps, delta, sens)
    assert discrete_gaussian_delta(eps, sigma**2, sens) <= delta
    assert discrete_gaussian_delta(eps, (sigma * (1 - 1e-6)) ** 2, sens) > delta
    # independent check: dp_accounting's discrete Gaussian PLD (pessimistic, so >= the exact delta)
    ref = pld.from_discrete_gaussian_mechanism(sigma, sensitivity=sens, value_discretization_interval=1e-4)
    assert ref.get_delta_for_epsilon(eps) == pytest.approx(delta, rel=0.05)


def test_discrete_gaussian_needs_integer_sensitivity():
    with pytest.raises(InvalidParameter, match="integer"):
        discrete_gaussian_sigma(1.0, 1e-6, 1.5)


def test_zcdp_calibrations():
    assert discrete_gaussian_sigma_zcdp(0.5, 1.0) == pytest.approx(1.0)
    for eps, delta in [(1.0, 1e-6), (0.3, 1e-9), (8.0, 1e-5)]:
        rho = zcdp_rho_for(eps, delta)
        assert zcdp_epsilon(rho, delta) <= eps
        assert zcdp_epsilon(rho * (1 + 1e-9), delta) > eps
        sigma = gaussian_sigma_zcdp(eps, delta, 2.0)
        assert zcdp_epsilon(4.0 / (2 * sigma**2), delta) <= eps
        assert sigma >= gaussian_sigma_analytic(eps, delta, 2.0)  # the universal conversion is looser


@pytest.mark.parametrize(
    "call",
    [
        lambda: laplace_scale(0.0, 1.0),
        lambda: laplace_scale(-1.0, 1.0),
        lambda: laplace_scale(float("nan"), 1.0),
        lambda: laplace_scale(float("inf"), 1.0),
        lambda: laplace_scale(1.0, -1.0),
        lambda: laplace_scale(1.0, float("nan")),
        lambda: gaussian_sigma_analytic(1.0, 0.0, 1.0),
        lambda: gaussian_sigma_analytic(1.0, 1.0, 1.0),
        lambda: gaussian_sigma_analytic(1.0, -1e-6, 1.0),
        lambda: gaussian_sigma_analytic(1.0, float("nan"), 1.0),
        lambda: gaussian_sigma_analytic(1.0, 1e-6, 0.0),
        lambda: discrete_gaussian_sigma(0.0, 1e-6, 1.0),
        lambda: discrete_gaussian_sigma_zcdp(0.0, 1.0),
        lambda: discrete_gaussian_sigma_zcdp(math.nan, 1.0),
        lambda: gaussian_sigma_classical(0.5, 1.5, 1.0),
    ],
)
def test_bad_input_is_refused(call):
    with pytest.raises(InvalidParameter):
        call()


def _exact_discrete_gaussian_delta(eps: float, s2: float, d: int):
    """CKS20 Thm 7's δ(ε) in 60-digit arithmetic (mpmath, which dp_accounting brings), from the exact values
    of the doubles ``eps`` and ``s2``: the reference the rounded-up double is checked against."""
    from fractions import Fraction

    import mpmath

    with mpmath.workdps(60):
        q = Fraction(s2)
        s2m = mpmath.mpf(q.numerator) / q.denominator
        j1 = math.floor(Fraction(eps) * q / d - Fraction(d, 2)) + 1
        j2 = j1 + d
        lim = int(60 * math.sqrt(s2)) + abs(j2) + 10  # terms beyond are below e^-1800 of the largest

        def f(k: int):
            return mpmath.exp(-mpmath.mpf(k) ** 2 / (2 * s2m))

        z = 1 + 2 * mpmath.fsum(f(k) for k in range(1, lim))

        def tail(j: int):
            return mpmath.fsum(f(k) for k in range(j, lim))

        t1 = tail(j1) if j1 >= 1 else z - tail(1 - j1)
        return (t1 - mpmath.exp(mpmath.mpf(eps)) * tail(j2)) / z


@settings(max_examples=examples(60), deadline=None)
@given(eps=st.floats(0.01, 8.0), ratio=st.floats(0.2, 10.0), d=st.sampled_from([1, 2, 3, 7, 64, 1025]))
def test_the_discrete_gaussian_delta_is_never_below_the_exact_value(eps, ratio, d):
    """The exact calibration's δ (``discrete_gaussian_delta``) against 60-digit arithmetic: never below (a
    value below would certify a σ whose true δ exceeds the charged one; plain doubles were below by up to
    ~1.5e-13 of δ), and above by less than 1e-10 of δ (the price in σ is negligible)."""
    import mpmath

    sigma = min(d * ratio / eps, 400.0)  # the reference sums every lattice point up to 60σ
    s2 = sigma * sigma
    exact = _exact_discrete_gaussian_delta(eps, s2, d)
    got = discrete_gaussian_delta(eps, s2, d)
    if exact <= mpmath.mpf(2) ** -1000:  # δ = 0 to the double's precision: only its sign matters
        assert got >= 0
        return
    assert mpmath.mpf(got) >= exact
    assert mpmath.mpf(got) <= exact * (1 + mpmath.mpf(1e-10)) + mpmath.mpf(2) ** -1070
