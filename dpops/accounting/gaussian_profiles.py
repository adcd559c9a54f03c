"""Exact privacy profiles delta(eps) of one Gaussian-type mechanism, computed as upper bounds.

Two profiles, each a pure function of public parameters, used by ``basic/2``:

- the discrete Gaussian on the integer lattice (Canonne, Kamath, Steinke 2020, "The Discrete Gaussian
  for Differential Privacy", Thm 7), for noise N_Z(0, s^2) on a scalar query whose value moves by an
  integer number n >= 1 of lattice steps;
- the continuous Gaussian through its Gaussian-DP parameter mu = Delta/sigma (Balle & Wang 2018, Thm 8;
  Dong, Roth & Su 2022, Cor 2.13): several continuous Gaussians compose exactly into mu = sqrt(sum mu_i^2)
  (Dong, Roth & Su, Cor 3.3), so one profile covers any number of them.

The discrete profile, derived. Let P = N_Z(0, s^2) and Q = N_Z(n, s^2) (the same normaliser Z, since
shifting by an integer permutes the lattice). The privacy loss at x is
L(x) = ln P(x)/Q(x) = (n^2 - 2 n x) / (2 s^2), decreasing in x, and

    delta(eps) = sum_x max(0, P(x) - e^eps Q(x)) = P[X < t] - e^eps P[X < t - n],   t = n/2 - s^2 eps / n,

with X ~ N_Z(0, s^2) (the set where P exceeds e^eps Q is {x < t}; Q[x < t] = P[X < t - n]). The pair is
symmetric (x -> n - x swaps P and Q), so this is the profile of both neighbouring directions. With
W(m) = sum_{x <= m} exp(-x^2 / (2 s^2)) (unnormalised) and m = ceil(t) - 1 the largest integer below t:

    delta(eps) = (W(m) - e^eps W(m - n)) / Z,   Z = 2 W(-1) + 1.

How it is computed, and why the number is never below the true delta (privacy: a profile that errs low
would certify less noise than the release needs; one that errs high only costs accuracy):

- the lattice is summed exactly from x = -K, K = ceil(37 s): every term exp(-x^2/(2s^2)) >= e^-685 is a
  normal double, so nothing underflows; the neglected tail sum_{x < -K} is at most (s^2/K) e^{-K^2/(2s^2)}
  (the sum is below the integral from K), which is ADDED to W(m); W(m - n) and Z are only lowered by it;
- the computed partial sums are within a relative ``SUM_REL_ERROR`` = 1e-9 of the exact ones: recursive
  summation of N positive terms errs by at most N u (u = 2^-53) relative, and each term's exponent
  x^2/(2s^2) <= 685 is computed with a relative error of at most 3u, i.e. at most 2.1e3 u on the term;
  with N <= 2^22 (s <= ``MAX_EXACT_SIGMA_STEPS``) the total is below 5e-10. So W(m) is multiplied by
  1 + 1e-9, W(m - n) and Z by 1 - 1e-9;
- the float t may sit on the wrong side of an integer, so when it is within 1e-6 relative of one, m is
  taken among m0 - 1, m0, m0 + 1 (m0 from the float t) as the one giving the LARGEST value: each candidate
  is P(S) - e^eps Q(S) for a set S, a lower bound on delta(eps), and the exact maximiser {x < t} is among
  them. So the value is above the exact delta by at most 4e-9 P[X <= m0 + 1] (P[X < t] when t is not
  near an integer), a margin that moves eps by about 4e-9 (d delta / d eps = -e^eps Q[X < t - n]);
- below eps = n^2/(2 s^2) (where t > 0; no release budgets there) the profile is reported as 1.

``dg_epsilon`` inverts it by bisection on eps and returns the UPPER end of the final bracket, an eps at
which the upper-bounded delta is at most the target: the reported eps is never below the true one and
above it by at most ``EPS_REL_TOL`` relative plus the 1e-9 relative delta margin (about 1e-10 in eps at
(1, 1e-7); ``tests/test_basic2_accountant.py`` checks both against an independent mpmath summation).

The continuous profile delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu) is computed with erfc,
plus an absolute bound on the float rounding of each of the two terms (their arguments' rounding amplified by
Mills' ratio, erfc's few ulps, and the log/exp of the second term), then multiplied by 1 + 1e-9 with an
absolute 1e-300. The absolute part matters where the two terms cancel (a small mu: at mu = 1e-11 they agree
to 13 digits, and the bare difference with a relative margin came out up to 93% BELOW the exact delta, i.e.
an epsilon below the true one); ``tests/test_basic2_accountant.py`` checks the bound against mpmath over
mu from 1e-12 to 40.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

SUM_REL_ERROR = 1e-9
EPS_REL_TOL = 1e-12
# Above 2**16 lattice steps of noise the lattice sum would hold more than 2**22 terms (see the module docstring);
# basic/2 then charges the event by its zCDP rho, as basic/1 does (valid, looser).
MAX_EXACT_SIGMA_STEPS = 2.0**16
_TAIL_SIGMAS = 37.0
_CONT_REL_MARGIN = 1e-9


@functools.lru_cache(maxsize=8)
def _lattice_sums(s: float) -> tuple[np.ndarray, float]:
    """(W(-K), ..., W(-1) as computed prefix sums, tail bound) for N_Z(0, s^2); K = ceil(37 s)."""
    import numpy as np  # noqa: PLC0415 - lazily: the registry lists basic/2 beside accountants without numpy

    k = int(math.ceil(_TAIL_SIGMAS * s))
    x = np.arange(-k, 0, dtype=np.float64)  # -K .. -1, increasing terms: the prefix sums add small ones first
    w = np.exp(-(x * x) / (2.0 * s * s))
    prefix = np.cumsum(w)
    tail = (s * s / k) * math.exp(-(k * k) / (2.0 * s * s))
    return prefix, tail


def clear_lattice_cache() -> None:
    """Forget the cached lattice sums (benchmarks measure the first, uncached evaluation)."""
    _lattice_sums.cache_clear()


def _w_bounds(s: float, m: int) -> tuple[float, float]:
    """(lower, upper) bounds on W(m) = sum_{x <= m} exp(-x^2/(2 s^2)) for m <= -1."""
    prefix, tail = _lattice_sums(s)
    k = len(prefix)
    if m < -k:
        return 0.0, tail
    val = float(prefix[m + k])
    return val * (1.0 - SUM_REL_ERROR), val * (1.0 + SUM_REL_ERROR) + tail


def check_lattice(s: float, n: int) -> None:
    """Refuse parameters the exact discrete profile does not cover (callers fall back to zCDP before this)."""
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"discrete Gaussian profile: lattice sensitivity must be an integer >= 1, got {n!r}")
    if not (math.isfinite(s) and 1.0 <= s <= MAX_EXACT_SIGMA_STEPS):
        raise ValueError(f"discrete Gaussian profile: sigma must be in [1, {MAX_EXACT_SIGMA_STEPS:g}] lattice steps, "
                         f"got {s!r}")


def dg_delta(s: float, n: int, eps: float) -> float:
    """Upper bound on delta(eps) of N_Z(0, s^2) against N_Z(n, s^2) (module docstring; within ~1e-9 relative)."""
    check_lattice(s, n)
    if eps < 0 or not math.isfinite(eps):
        return 1.0
    t = n / 2.0 - s * s * eps / n
    m0 = math.ceil(t) - 1
    if m0 + 1 >= 0:  # t > -1: eps is at most about n^2/(2s^2) + n/s^2, where no release budgets
        return 1.0
    z_low = (2.0 * float(_lattice_sums(s)[0][-1]) + 1.0) * (1.0 - SUM_REL_ERROR)
    best = 0.0
    near_integer = abs(t - round(t)) <= 1e-6 * max(1.0, abs(t))  # the float t's error is ~1e-15 relative
    for m in (m0 - 1, m0, m0 + 1) if near_integer else (m0,):
        _, w_hi = _w_bounds(s, m)
        w_lo, _ = _w_bounds(s, m - n)
        if w_hi <= 0.0:
            continue
        # (w_hi - e^eps w_lo) / z in log space for the second term: e^eps alone may overflow
        ratio = math.exp(min(700.0, eps + math.log(w_lo) - math.log(w_hi))) if w_lo > 0 else 0.0
        best = max(best, w_hi * max(0.0, 1.0 - ratio) / z_low)
    return min(1.0, best)


def _invert(delta_of: Callable[[float], float], delta: float, hi: float) -> float:
    """Smallest eps (to EPS_REL_TOL, upper end) with delta_of(eps) <= delta; ``hi`` must pass (a valid bound)."""
    if delta_of(0.0) <= delta:
        return 0.0
    if not delta_of(hi) <= delta:
        return math.inf
    lo = 0.0
    while hi - lo > EPS_REL_TOL * hi:
        mid = 0.5 * (lo + hi)
        if delta_of(mid) <= delta:
            hi = mid
        else:
            lo = mid
    return hi


def dg_epsilon(s: float, n: int, delta: float, hi: float) -> float:
    """The eps certified at ``delta`` by the discrete profile (upper end of the bisection; inf if even ``hi``,
    a valid bound such as the zCDP conversion, does not pass the upper-bounded profile)."""
    check_lattice(s, n)
    return _invert(lambda e: dg_delta(s, n, e), delta, hi)


def _phi_upper(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def gaussian_delta(mu: float, eps: float) -> float:
    """Upper bound on delta(eps) of mu-GDP (the continuous Gaussian, Delta/sigma = mu), relative margin 1e-9."""
    if not (mu > 0 and math.isfinite(mu)):
        raise ValueError(f"Gaussian profile: mu must be finite and > 0, got {mu!r}")
    if eps < 0 or not math.isfinite(eps):
        return 1.0
    reach = eps / mu + mu / 2.0  # |each argument| is at most this; the arguments' rounding scales with it
    xa = mu / 2.0 - eps / mu
    a = _phi_upper(xa)
    b = _phi_upper(-reach)
    log_b = math.log(b) if b > 0 else 0.0
    second = math.exp(min(700.0, eps + log_b)) if b > 0 else 0.0
    # The float rounding of a and of e^eps b, bounded ABSOLUTELY (a relative margin on their difference does not
    # cover it: for a small mu the two terms agree to many digits, e.g. mu 1e-11, where the plain difference was
    # 93% below the exact delta). Each argument x of Phi is computed with an absolute error of at most
    # 4u(reach + 1) and Phi(x) moves by a relative (|x| + 1) times that per unit of x (Mills' ratio), erfc itself
    # errs by a few u; e^eps b adds the rounding of log, the sum and exp: u (2|eps| + 2|ln b| + 4).
    u = 2.0**-53
    rel_a = 16.0 * u * (1.0 + (abs(xa) + 1.0) * (reach + 1.0))
    rel_b = 16.0 * u * (1.0 + (reach + 1.0) * (reach + 1.0)) + u * (2.0 * eps + 2.0 * abs(log_b) + 4.0)
    rounding = rel_a * a + rel_b * second
    return min(1.0, (max(0.0, a - second) + rounding) * (1.0 + _CONT_REL_MARGIN) + 1e-300)


def gaussian_epsilon(mu: float, delta: float, hi: float) -> float:
    """The eps certified at ``delta`` by mu-GDP (upper end of the bisection below the valid bound ``hi``)."""
    return _invert(lambda e: gaussian_delta(mu, e), delta, hi)
