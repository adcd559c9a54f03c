"""Noise calibration: from a privacy target and a sensitivity to a noise scale.

- Laplace: b = Δ1/ε (pure ε-DP).
- Gaussian, analytic (Balle & Wang 2018, Thm 8): the smallest σ with
  Φ(Δ/2σ − εσ/Δ) − e^ε Φ(−Δ/2σ − εσ/Δ) ≤ δ, exact for one release. Found by bisection and
  verified before it is returned.
- Gaussian, classical (Dwork & Roth Thm A.1): σ = Δ·sqrt(2 ln(1.25/δ))/ε, valid only for ε < 1;
  kept for comparison, always ≥ the analytic σ.
- Discrete Gaussian (Canonne, Kamath, Steinke 2020, Thm 7): for integer sensitivity Δ the exact
  δ(ε) = P[X > εσ²/Δ − Δ/2] − e^ε P[X > εσ²/Δ + Δ/2], X ~ N_Z(0, σ²); we search the smallest σ.
- zCDP: σ = Δ/sqrt(2ρ); and the conversion ε = ρ + 2 sqrt(ρ ln(1/δ)) (Bun & Steinke 2016,
  Prop 1.3) that every accountant in dpops certifies.
- One scalar for a whole release (``largest_passing``): the release plan scales every Gaussian
  vector's ρ by one common factor and bisects that factor on the scope accountant's own composed
  ε (``dpops.release_plan``). The search only ever returns a factor it has checked, so whatever
  the accountant computes, the answer certifies; the tolerance only decides how close to the
  declared ε it lands.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from functools import lru_cache

import numpy as np
from scipy.special import log_ndtr, ndtr

from dpops.errors import InvalidParameter
from dpops.param_checks import check_delta, check_epsilon, check_positive


def _sens(x: float, name: str) -> float:
    return check_positive(x, name)


def laplace_scale(epsilon: float, l1_sensitivity: float) -> float:
    """b = Δ1/ε."""
    epsilon = check_epsilon(epsilon)
    return _sens(l1_sensitivity, "l1_sensitivity") / epsilon


# --------------------------------------------------------------------------- analytic Gaussian


def gaussian_delta_analytic(epsilon: float, sigma: float, l2_sensitivity: float) -> float:
    """Exact δ(ε) of the Gaussian mechanism with std σ and L2 sensitivity Δ (Balle & Wang 2018)."""
    d = l2_sensitivity
    a = d / (2 * sigma) - epsilon * sigma / d
    b = -d / (2 * sigma) - epsilon * sigma / d
    return float(ndtr(a) - math.exp(epsilon + float(log_ndtr(b))))


def _bisect_sigma(delta_of, target: float, start: float) -> float:
    """Smallest σ (to ~1e-12 relative) with delta_of(σ) <= target, for a decreasing delta_of."""
    hi = start
    while delta_of(hi) > target:
        hi *= 2.0
        if hi > 1e300:
            raise InvalidParameter("no finite noise scale reaches the requested delta")
    lo = hi / 2.0
    while delta_of(lo) <= target:
        hi = lo
        lo /= 2.0
        if lo < 1e-300:
            return hi
    while hi - lo > 1e-13 * hi:
        mid = 0.5 * (lo + hi)
        if delta_of(mid) <= target:
            hi = mid
        else:
            lo = mid
    return hi


def gaussian_sigma_analytic(epsilon: float, delta: float, l2_sensitivity: float) -> float:
    """Smallest σ with the Balle–Wang condition ≤ δ (verified)."""
    epsilon = check_epsilon(epsilon)
    delta = check_delta(delta, allow_zero=False)
    d = _sens(l2_sensitivity, "l2_sensitivity")
    start = d * math.sqrt(2 * math.log(1.25 / delta)) / epsilon
    sigma = _bisect_sigma(lambda s: gaussian_delta_analytic(epsilon, s, d), delta, start)
    if not gaussian_delta_analytic(epsilon, sigma, d) <= delta:  # pragma: no cover - bisection invariant
        raise InvalidParameter("analytic Gaussian calibration failed to verify")
    return sigma


def gaussian_sigma_classical(epsilon: float, delta: float, l2_sensitivity: float) -> float:
    """Dwork & Roth: σ = Δ sqrt(2 ln(1.25/δ))/ε; the proof needs ε < 1."""
    epsilon = check_epsilon(epsilon)
    delta = check_delta(delta, allow_zero=False)
    d = _sens(l2_sensitivity, "l2_sensitivity")
    if epsilon >= 1:
        raise InvalidParameter(
            f"the classical Gaussian calibration is only valid for epsilon < 1 (got {epsilon}); "
            "use gaussian_sigma_analytic"
        )
    return d * math.sqrt(2 * math.log(1.25 / delta)) / epsilon


# --------------------------------------------------------------------------- discrete Gaussian

_U = 2.0**-53  # unit roundoff of a double
# Relative error of one np.exp / math.exp / math.expm1 / math.erfc result, in units of _U: the libraries
# claim a few ulps at most; 16 is generous on purpose (the margin it buys is ~1e-15 of delta).
_FN_ULPS = 16
_MAX_INDEX = 2**50  # lattice indices handled exactly as doubles (k*k and k-j below)


def _sum_ulps(n: int) -> float:
    """Bound on the relative error, in units of _U, of numpy's pairwise sum of n nonnegative doubles: 8
    accumulators over blocks of at most 128, then a halving tree, so no term passes more than
    log2(n) + 19 additions."""
    return math.log2(max(n, 2)) + 24


def _up(x: float, ulps: float) -> float:
    """x moved away from the exact value's side by ``ulps`` units of its magnitude: up."""
    return x * (1 + ulps * _U) if x > 0 else x * (1 - ulps * _U)


def _down(x: float, ulps: float) -> float:
    """x moved down by ``ulps`` units of its magnitude."""
    return x * (1 - ulps * _U) if x > 0 else x * (1 + ulps * _U)


def _gauss_int_upper_tail(t: float, sigma: float) -> float:
    """∫_t^∞ exp(-x²/(2σ²)) dx = σ sqrt(π/2) erfc(t/(σ sqrt 2)) (as computed; callers widen it)."""
    return sigma * math.sqrt(math.pi / 2) * math.erfc(t / (sigma * math.sqrt(2)))


def _dg_tail_bounds(j: int, s2: float) -> tuple[float, float]:
    """(lower, upper) bounds of T(j) = Σ_{k>=j} exp(-k²/(2 s2)) for an integer j >= 1, every rounding included."""
    assert j >= 1
    sigma = math.sqrt(s2)
    first_arg = float(j * j) / (2 * s2)  # two roundings of j²/(2 s2): 2u relative
    first = math.exp(-first_arg)
    first_ulps = 2.01 * first_arg + _FN_ULPS
    top = math.isqrt(int(j * j + 160 * s2)) + 2
    if top - j > (1 << 20):
        # f decreasing on [j, inf):  ∫_j^∞ f  <=  T(j)  <=  f(j) + ∫_j^∞ f
        integral = _gauss_int_upper_tail(float(j), sigma)
        ulps = 3 * _FN_ULPS + 2.01 * (j / sigma) ** 2
        return _down(integral, ulps), _up(first, first_ulps) + _up(integral, ulps)
    m = np.arange(0, top - j + 1, dtype=np.float64)
    # exponent (k² - j²)/(2 s2) = m(m + 2j)/(2 s2) <= 80 + ...: m(m+2j) exact below 2**53, else 1u
    arg = m * (m + 2.0 * j) / (2 * s2)
    amax = float(arg[-1])
    part = float(np.exp(-arg).sum())
    ulps = 3.01 * amax + _FN_ULPS + _sum_ulps(len(m)) + first_ulps + 2
    lo = _down(part * first, ulps)  # the terms beyond ``top`` are dropped: a lower bound
    rest = _gauss_int_upper_tail(float(top), sigma)  # Σ_{k>top} f(k) <= ∫_top^∞ f
    hi = _up(part * first, ulps) + _up(rest, 3 * _FN_ULPS + 2.01 * (top / sigma) ** 2)
    return lo, hi


def _dg_norm_bounds(s2: float) -> tuple[float, float]:
    """(lower, upper) bounds of Z = Σ_k exp(-k²/(2 s2))."""
    sigma = math.sqrt(s2)
    if sigma >= 2.0:
        # Poisson summation: Z = sqrt(2π)σ (1 + 2 Σ_{m>=1} exp(-2π²σ²m²)), the sum < 2e-34 here
        z = math.sqrt(2 * math.pi) * sigma
        return _down(z, 8), _up(z, 8)
    lo, hi = _dg_tail_bounds(1, s2)
    return _down(1 + 2 * lo, 2), _up(1 + 2 * hi, 2)


def discrete_gaussian_delta(epsilon: float, sigma2: float, l2_sensitivity: int) -> float:
    """δ(ε) of the discrete Gaussian N_Z(0, σ²) with integer sensitivity Δ (CKS20 Thm 7), rounded UP: never
    below the exact value, and above it by about 1e-11 of it at most (tests/test_calibration.py checks both
    against 60-digit arithmetic).

    Privacy reason: the exact calibration bisects σ on this value and verifies the recorded σ with it, so a
    value rounded below the exact δ would certify a σ whose true δ exceeds the charged one. The formula is a
    difference of two close sums, where plain double arithmetic lost up to ~1.5e-13 of δ downwards; every
    rounding (the exponents, np.exp, the pairwise sums, the subtraction, the normaliser Z) is now bounded and
    added in the conservative direction, the lattice thresholds are floors of exact rationals, and a tail is
    bounded from below where it is subtracted (its truncation and the integral bound of huge σ included)."""
    d = int(l2_sensitivity)
    s2 = float(sigma2)
    # The thresholds ε s2/Δ ∓ Δ/2 in exact arithmetic: a floor computed from a rounded double can pick the
    # neighbouring lattice point, and the formula at another point gives a smaller value than δ(ε).
    j1 = math.floor(Fraction(epsilon) * Fraction(s2) / d - Fraction(d, 2)) + 1  # P[X > x] = P[X >= floor(x)+1]
    j2 = j1 + d  # x2 = x1 + Δ, Δ an integer
    if j2 >= _MAX_INDEX:
        raise InvalidParameter(f"sigma2={s2!r}: the discrete Gaussian is too wide for the exact calibration "
                               "(lattice indices beyond 2**50); use a coarser resolution")
    z_lo, _ = _dg_norm_bounds(s2)
    t2_lo, _ = _dg_tail_bounds(j2, s2)
    if j1 >= 1 and d < 4_000_000:
        k = np.arange(j1, j2, dtype=np.float64)
        arg = (k * k) / (2 * s2)
        amax = float(arg[-1])  # bound every term's exponent by the largest one
        between = float(np.exp(-arg).sum())
        b_hi = _up(between, 2.01 * amax + _FN_ULPS + _sum_ulps(d) + 1)
        sub = _down(_down(math.expm1(epsilon), _FN_ULPS) * t2_lo, 1)
        num = b_hi - sub
        num += 2 * _U * b_hi  # the subtraction's rounding (|result| <= b_hi)
    else:
        if j1 >= 1:
            _, t1_hi = _dg_tail_bounds(j1, s2)
        else:  # Σ_{k>=j1} = Z - Σ_{k>=1-j1}
            _, z_hi = _dg_norm_bounds(s2)
            lo, _ = _dg_tail_bounds(1 - j1, s2)
            t1_hi = _up(z_hi - lo, 1) + 2 * _U * z_hi
        sub = _down(_down(math.exp(epsilon), _FN_ULPS) * t2_lo, 1)
        num = t1_hi - sub + 2 * _U * t1_hi
    return max(0.0, _up(num / z_lo, 2))


def _integer_sensitivity(x: float, name: str) -> int:
    x = _sens(x, name)
    if x != math.floor(x):
        raise InvalidParameter(
            f"{name}={x!r}: the exact discrete Gaussian calibration needs an integer sensitivity "
            "(in lattice units); round it up with math.ceil"
        )
    return int(x)


@lru_cache(maxsize=1024)
def discrete_gaussian_sigma(epsilon: float, delta: float, l2_sensitivity: float) -> float:
    """Smallest σ (to 1e-12) whose discrete Gaussian is (ε, δ)-DP for integer sensitivity (CKS20 Thm 7)."""
    epsilon = check_epsilon(epsilon)
    delta = check_delta(delta, allow_zero=False)
    d = _integer_sensitivity(l2_sensitivity, "l2_sensitivity")
    start = gaussian_sigma_analytic(epsilon, delta, d)
    return _bisect_sigma(lambda s: discrete_gaussian_delta(epsilon, s * s, d), delta, start)


def discrete_gaussian_sigma_zcdp(rho: float, l2_sensitivity: float) -> float:
    """σ = Δ/sqrt(2ρ): ρ-zCDP for the discrete Gaussian as for the continuous one (CKS20 Thm 4)."""
    rho = check_positive(rho, "rho")
    return _sens(l2_sensitivity, "l2_sensitivity") / math.sqrt(2 * rho)


def zcdp_epsilon(rho: float, delta: float) -> float:
    """ρ-zCDP ⇒ (ρ + 2 sqrt(ρ ln(1/δ)), δ)-DP (Bun & Steinke 2016, Prop 1.3)."""
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def zcdp_rho_for(epsilon: float, delta: float) -> float:
    """Largest ρ whose conversion above gives at most ε: ρ = (sqrt(L + ε) − sqrt(L))², L = ln(1/δ)."""
    epsilon = check_epsilon(epsilon)
    delta = check_delta(delta, allow_zero=False)
    L = math.log(1.0 / delta)
    # (sqrt(L+ε) - sqrt(L))² written without cancellation: ε² / (sqrt(L+ε) + sqrt(L))²
    rho = epsilon**2 / (math.sqrt(L + epsilon) + math.sqrt(L)) ** 2
    while zcdp_epsilon(rho, delta) > epsilon:  # floating point: step down until it verifies
        rho = math.nextafter(rho, 0.0)
    return rho


def gaussian_sigma_zcdp(epsilon: float, delta: float, l2_sensitivity: float) -> float:
    """σ such that ρ = Δ²/(2σ²) converts to at most (ε, δ) by Prop 1.3 (certified by every accountant)."""
    d = _sens(l2_sensitivity, "l2_sensitivity")
    return discrete_gaussian_sigma_zcdp(zcdp_rho_for(epsilon, delta), d) * (1 + 1e-12)


def largest_passing(ok: Callable[[float], bool], start: float, rel_tol: float, *, max_doublings: int = 64) -> float:
    """Largest t >= ``start`` (to relative ``rel_tol``) with ``ok(t)``, by doubling then bisection.

    ``ok(start)`` must hold (else InvalidParameter). ``ok`` is expected to be true below some point and
    false above it; if it is not monotone (a discretised accountant can wobble by its discretisation) the
    answer is still a value where ``ok`` was evaluated true: the returned t is always the checked, safe
    end of the bracket (for a release, the smaller ρ, i.e. the larger σ). When ``ok`` stays true for
    ``max_doublings`` doublings (e.g. every σ sits on its floor) the last checked value is returned.
    """
    if not (math.isfinite(start) and start > 0):
        raise InvalidParameter(f"largest_passing needs a finite start > 0, got {start!r}")
    if not (0 < rel_tol < 1):
        raise InvalidParameter(f"rel_tol must be in (0, 1), got {rel_tol!r}")
    if not ok(start):
        raise InvalidParameter("largest_passing: the starting point does not pass")
    lo, hi = start, 2.0 * start
    for _ in range(max_doublings):
        if not ok(hi):
            break
        lo, hi = hi, 2.0 * hi
    else:
        return lo
    while hi - lo > rel_tol * lo:
        mid = 0.5 * (lo + hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


__all__ = [
    "largest_passing",
    "laplace_scale",
    "gaussian_sigma_analytic",
    "gaussian_sigma_classical",
    "gaussian_delta_analytic",
    "discrete_gaussian_sigma",
    "discrete_gaussian_delta",
    "discrete_gaussian_sigma_zcdp",
    "gaussian_sigma_zcdp",
    "zcdp_epsilon",
    "zcdp_rho_for",
]
