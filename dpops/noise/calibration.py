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
from functools import lru_cache

import numpy as np
from scipy.special import log_ndtr, ndtr

from dpops.errors import InvalidParameter
from dpops.noise.samplers import dg_norm as _dg_norm
from dpops.noise.samplers import dg_tail_unnorm as _dg_tail_unnorm
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


def discrete_gaussian_delta(epsilon: float, sigma2: float, l2_sensitivity: int) -> float:
    """Exact δ(ε) of the discrete Gaussian N_Z(0, σ²) with integer sensitivity Δ (CKS20 Thm 7)."""
    d = int(l2_sensitivity)
    s2 = float(sigma2)
    x1 = epsilon * s2 / d - d / 2
    x2 = epsilon * s2 / d + d / 2
    j1 = math.floor(x1) + 1  # P[X > x] = P[X >= floor(x)+1]
    j2 = math.floor(x2) + 1
    z = _dg_norm(s2)
    if j1 >= 1 and j2 - j1 < 4_000_000:
        k = np.arange(j1, j2, dtype=np.float64)
        between = float(np.exp(-(k * k) / (2 * s2)).sum())
        val = between - math.expm1(epsilon) * _dg_tail_unnorm(j2, s2)
    else:
        val = _dg_tail_unnorm(j1, s2) - math.exp(epsilon) * _dg_tail_unnorm(j2, s2)
    return max(0.0, val / z)


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
