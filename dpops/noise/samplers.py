"""Exact samplers for integer noise, driven only by uniform random integers.

Canonne, Kamath, Steinke (2020), "The Discrete Gaussian for Differential Privacy":
Algorithm 1 (Bernoulli(exp(-gamma)) for rational gamma), Algorithm 2 (discrete
Laplace), Algorithm 3 (discrete Gaussian). No sampling decision uses floating point
(Mironov 2012): every comparison is between exact integers.

Parameters arrive as floats from calibration. They are rounded *up* to a rational
(never less noise than requested) by ``discrete_laplace_param`` / ``discrete_gaussian_param``,
which return the exact parameter used; record that one.

Vectorisation: each rejection loop runs on the shrinking set of still-active samples.
Integers stay exact: int64 where the bounds below prove they fit, and a per-element
Python-int path for the (astronomically rare) elements that would not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import numpy.typing as npt

from dpops.errors import InvalidParameter
from dpops.noise.randomness import RandomSource

# Fast path limits: numerators < 2**62 and denominators <= 2**55 keep den*K < 2**63 for
# every K < 2**8 in Algorithm 1 (P(K >= 256) < 1/255!, and the slow path covers it anyway).
_NUM_LIMIT = 1 << 62
_DEN_LIMIT = 1 << 55
_SCALE_BITS = 40  # significant bits of a discrete Laplace scale t/s (relative rounding <= 2**-39)
_MAX_SCALE = 2.0**50


_INT64_MAX = int(np.iinfo(np.int64).max)


def _as_int_array(x: npt.ArrayLike, name: str) -> np.ndarray:
    """``x`` as an int64 array, or as an object array of exact Python ints when a value does not fit int64.

    Why exact: these are the parameters of a sampler that runs after the budget is charged. numpy types
    a Python int in [2**63, 2**64) as uint64, and a blind ``astype(int64)`` would wrap it to a negative
    number (issue 25 item 6a: den = 2**63 from a tiny quantile rate became -2**63 and the run failed
    after the charge); any value beyond int64 keeps its exact value on the Python-int path instead.
    """
    a = np.asarray(x)
    if a.dtype == object:
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in a.reshape(-1)):
            raise InvalidParameter(f"{name} must hold integers")
        return a
    if not np.issubdtype(a.dtype, np.integer):
        raise InvalidParameter(f"{name} must be integers, got dtype {a.dtype}")
    if np.issubdtype(a.dtype, np.unsignedinteger) and a.size and int(a.max()) > _INT64_MAX:
        return np.array([int(v) for v in a.reshape(-1)], dtype=object).reshape(a.shape)
    return a.astype(np.int64)


# --------------------------------------------------------------------------- Bernoulli


_MARGIN = 2.0**-49  # far above the <= 2**-51 rounding error of the float screen below


def bernoulli_ratio(num: npt.ArrayLike, den: npt.ArrayLike, rng: RandomSource) -> np.ndarray:
    """Exact Bernoulli(num/den) for integer arrays with 0 <= num <= den (den may be a float-exact product).

    One 64-bit word U per element is compared with num/den. A double-precision screen decides
    every element whose U is more than 2**-49 away from num/den (its rounding error is below
    2**-51, so the screen's answer equals the exact comparison); the rest (probability ~2**-48)
    are decided exactly with Python integers, continuing with further words on a tie. The
    outcome is therefore exactly the comparison of a uniform real with num/den.
    """
    num_a = np.asarray(num)
    den_a = np.asarray(den)
    num_a, den_a = np.broadcast_arrays(num_a, den_a)
    n = num_a.size
    x = rng.uint64(n)
    u = x.astype(np.float64) * 2.0**-64
    p = num_a.astype(np.float64) / den_a.astype(np.float64)
    out = u < p - _MARGIN
    band = np.nonzero(~out & (u <= p + _MARGIN))[0]
    for i in band:
        out[i] = compare_exact(int(x[i]), int(num_a.flat[i]), int(den_a.flat[i]), rng)
    return out


def compare_exact(x: int, num: int, den: int, rng: RandomSource) -> bool:
    """Is 0.x1x2x3... (x the first 64-bit word, later words drawn lazily) < num/den?"""
    while True:
        scaled = num << 64
        digit, rest = divmod(scaled, den)
        if x != digit:
            return x < digit
        num = rest  # tie on this word: compare the next word with the remaining fraction
        x = int(rng.uint64(1)[0])


def _bernoulli_exp_le1(num: np.ndarray, den: np.ndarray, rng: RandomSource) -> np.ndarray:
    """Bernoulli(exp(-num/den)) for 0 <= num <= den, int64 arrays (CKS20 Alg. 1, gamma in [0,1]).

    K = 1, 2, ...: draw A ~ Bernoulli(gamma/K) until A = 0; the result is 1 iff the final K is odd.
    All pending elements share the same K (they advance together). Each Bernoulli(num/(den*K))
    is the float-screened exact comparison of ``bernoulli_ratio``, inlined to keep the float
    ratio num/den computed once.
    """
    n = num.size
    out = np.empty(n, dtype=bool)
    p0 = num.astype(np.float64) / den.astype(np.float64)
    pending = np.arange(n)
    k = 1
    while pending.size:
        x = rng.uint64(pending.size)
        u = x.astype(np.float64) * 2.0**-64
        pk = p0[pending] / k  # <= 2 roundings more than p0: error still far below _MARGIN
        a = u < pk - _MARGIN
        for i in np.nonzero(~a & (u <= pk + _MARGIN))[0]:
            j = pending[i]
            a[i] = compare_exact(int(x[i]), int(num[j]), int(den[j]) * k, rng)
        out[pending[~a]] = (k & 1) == 1
        pending = pending[a]
        k += 1
    return out


def bernoulli_exp_int(num: int, den: int, rng: RandomSource, k_start: int = 1) -> bool:
    """Scalar, arbitrary-size Python-int version of CKS20 Algorithm 1 (the slow, exact path)."""
    if k_start == 1 and num > den:
        f, num = divmod(num, den)
        for _ in range(f):
            if not bernoulli_exp_int(1, 1, rng):
                return False
    k = k_start
    while rng.randbelow_int(den * k) < num:
        k += 1
    return k % 2 == 1


_ONE = np.ones(1, dtype=np.int64)


def bernoulli_exp(num: npt.ArrayLike, den: npt.ArrayLike, rng: RandomSource) -> np.ndarray:
    """Exact Bernoulli(exp(-num/den)) per element, for integers num >= 0, den >= 1 (CKS20 Alg. 1).

    ``num``/``den`` broadcast against each other; int64 or Python-int (object) arrays.
    gamma > 1 is split as floor(gamma) independent Bernoulli(exp(-1)) draws (stopping at the
    first 0) and one Bernoulli(exp(-frac(gamma))).
    """
    num_a = _as_int_array(num, "bernoulli_exp num")
    den_a = _as_int_array(den, "bernoulli_exp den")
    num_a, den_a = np.broadcast_arrays(num_a, den_a)
    shape = num_a.shape
    num_a = num_a.reshape(-1)
    den_a = den_a.reshape(-1)
    if num_a.size == 0:
        return np.zeros(shape, dtype=bool)
    if (num_a < 0).any() or (den_a < 1).any():
        raise InvalidParameter("bernoulli_exp needs num >= 0 and den >= 1")
    small = (num_a < _NUM_LIMIT) & (den_a <= _DEN_LIMIT)
    out = np.empty(num_a.size, dtype=bool)
    big = np.nonzero(~small)[0]
    for i in big:  # exact Python-int path, only for parameters beyond the int64 proof
        out[i] = bernoulli_exp_int(int(num_a[i]), int(den_a[i]), rng)
    idx = np.nonzero(small)[0]
    if idx.size:
        nm = num_a[idx].astype(np.int64)
        dn = den_a[idx].astype(np.int64)
        whole, frac = np.divmod(nm, dn)
        alive = np.ones(idx.size, dtype=bool)
        # floor(gamma) draws of Bernoulli(exp(-1)); an element dies at its first 0.
        todo = np.nonzero(whole > 0)[0]
        while todo.size:
            ok = _bernoulli_exp_le1(np.ones(todo.size, np.int64), np.ones(todo.size, np.int64), rng)
            alive[todo[~ok]] = False
            whole[todo[ok]] -= 1
            todo = todo[ok]
            todo = todo[whole[todo] > 0]
        live = np.nonzero(alive)[0]
        res = np.zeros(idx.size, dtype=bool)
        if live.size:
            res[live] = _bernoulli_exp_le1(frac[live], dn[live], rng)
        out[idx] = res
    return out.reshape(shape)


def bernoulli_rational(num: npt.ArrayLike, den: npt.ArrayLike, rng: RandomSource) -> np.ndarray:
    """Exact Bernoulli(num/den) for int64 arrays with 0 <= num <= den."""
    num_a = _as_int_array(num, "num")
    den_a = _as_int_array(den, "den")
    if (num_a < 0).any() or (num_a > den_a).any():
        raise InvalidParameter("bernoulli_rational needs 0 <= num <= den")
    return bernoulli_ratio(num_a, den_a, rng)


def bernoulli_float(p: npt.ArrayLike, rng: RandomSource) -> np.ndarray:
    """Exact Bernoulli(p) for double-precision probabilities p (each a dyadic rational).

    A 64-bit uniform word is compared with the first 64 bits of p's binary expansion; on a tie
    (probability 2**-64) the comparison continues with further words, exactly.
    """
    p_a = np.asarray(p, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(p_a)) or (p_a < 0).any() or (p_a > 1).any():
        raise InvalidParameter("bernoulli_float needs probabilities in [0, 1]")
    out = p_a >= 1.0
    frac = np.where(out, 0.0, p_a)
    # floor(p * 2**64) exactly: ldexp is exact, and floor of an exact value is exact.
    hi = np.floor(np.ldexp(frac, 64))
    hi_u = np.where(hi >= 2.0**64, np.float64(2.0**64 - 2048), hi).astype(np.uint64)
    x = rng.uint64(p_a.size)
    out |= x < hi_u
    for i in np.nonzero(x == hi_u)[0]:
        if p_a[i] >= 1.0:
            continue
        out[i] = _bernoulli_fraction_tail(Fraction(float(p_a[i])) * 2**64 - int(hi_u[i]), rng)
    return out


def _bernoulli_fraction_tail(rest: Fraction, rng: RandomSource) -> bool:
    """Continue the bitwise comparison of U with the remaining fraction ``rest`` in [0, 1)."""
    while True:
        scaled = rest * 2**64
        digit = int(scaled)
        x = int(rng.uint64(1)[0])
        if x < digit:
            return True
        if x > digit:
            return False
        rest = scaled - digit


# --------------------------------------------------------------------------- parameters


def _fraction_of(x: object, name: str) -> Fraction:
    if isinstance(x, Fraction):
        f = x
    elif isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool):
        if not math.isfinite(float(x)):
            raise InvalidParameter(f"{name} must be finite, got {x!r}")
        f = Fraction(float(x)) if isinstance(x, (float, np.floating)) else Fraction(int(x))
    else:
        raise InvalidParameter(f"{name} must be a number, got {x!r}")
    if f <= 0:
        raise InvalidParameter(f"{name} must be > 0, got {x!r}")
    return f


def float_down(f: Fraction) -> float:
    """The largest double <= f."""
    x = float(f)
    return math.nextafter(x, -math.inf) if Fraction(x) > f else x


def float_up(f: Fraction) -> float:
    """The smallest double >= f."""
    x = float(f)
    return math.nextafter(x, math.inf) if Fraction(x) < f else x


def dg_norm(s2: float) -> float:
    sigma = math.sqrt(s2)
    if sigma >= 2.0:
        # Poisson summation: Z = sqrt(2π)σ (1 + 2 Σ exp(-2π²σ²m²)); the correction is < e^-78.
        return math.sqrt(2 * math.pi) * sigma
    k = np.arange(1, int(40 * sigma) + 3, dtype=np.float64)
    return 1.0 + 2.0 * float(np.exp(-(k * k) / (2 * s2)).sum())


_DG_TAIL_MAX_TERMS = 1 << 20


def dg_tail_unnorm(j: int, s2: float) -> float:
    """Σ_{k >= j} exp(-k²/(2σ²)) for integer j, truncated where terms fall below e^-80 of the first."""
    if j <= 0:
        # by symmetry: Σ_{k>=j} = Z - Σ_{k >= 1-j}
        return dg_norm(s2) - dg_tail_unnorm(1 - j, s2)
    top = math.isqrt(int(j * j + 160 * s2)) + 2
    if top - j > _DG_TAIL_MAX_TERMS:
        # Huge sigma (a fine grid under small epsilon: 1e9+ terms would not fit in memory). f decreasing
        # on [j, inf) gives  sum_{k>=j} f(k) <= f(j) + int_j^inf f = f(j) + sigma sqrt(pi/2) erfc(j/(sigma sqrt 2)),
        # an UPPER bound (relative excess <= f(j)/sum ~ 1/sigma < 1e-5): tails used for thresholds and
        # interval half-widths only get more conservative.
        sigma = math.sqrt(s2)
        return (math.exp(-(float(j) * j) / (2 * s2))
                + sigma * math.sqrt(math.pi / 2) * math.erfc(j / (sigma * math.sqrt(2))))
    k = np.arange(j, top + 1, dtype=np.float64)
    # factor out the first term to keep precision when the tail is tiny
    return float(np.exp(-(k * k - float(j) * j) / (2 * s2)).sum()) * math.exp(-(float(j) * j) / (2 * s2))


@dataclass(frozen=True)
class DiscreteLaplaceParam:
    """P(k) ∝ exp(-|k| * s / t): scale exactly t/s (integers)."""

    t: int
    s: int

    @property
    def scale(self) -> Fraction:
        """The exact scale t/s."""
        return Fraction(self.t, self.s)

    @property
    def scale_float(self) -> float:
        """The scale as a double (rounded up: a claim computed from it is conservative)."""
        return float_up(self.scale)  # t < 2**53 and s a power of two: exact in practice

    def variance(self) -> float:
        """Variance 2p/(1-p)² of the two-sided geometric distribution, p = exp(-s/t)."""
        # p = exp(-1/scale); Var = 2p/(1-p)^2 for the two-sided geometric distribution.
        p = math.exp(-self.s / self.t)
        return 2.0 * p / (-math.expm1(-self.s / self.t)) ** 2

    def tail(self, k: int) -> float:
        """P(X >= k) for integer k >= 1: p^k / (1 + p)."""
        p = math.exp(-self.s / self.t)
        return p**k / (1.0 + p)

    def pmf(self, k: npt.ArrayLike) -> np.ndarray:
        """P(X = k) = (1-p)/(1+p) p^|k| for integer k (doubles; used to predict accuracy, never to sample)."""
        p = math.exp(-self.s / self.t)
        kk = np.abs(np.asarray(k, dtype=np.float64))
        return (-math.expm1(-self.s / self.t)) / (1.0 + p) * np.exp(-kk * self.s / self.t)


@dataclass(frozen=True)
class DiscreteGaussianParam:
    """P(k) ∝ exp(-k^2 / (2 sigma^2)) with sigma^2 = t*c/b exactly; t = the Laplace proposal scale."""

    t: int
    c: int
    b: int

    @property
    def sigma2(self) -> Fraction:
        """The exact variance parameter t·c/b (the distribution's variance is slightly below it)."""
        return Fraction(self.t * self.c, self.b)

    @property
    def sigma_float(self) -> float:
        """A double <= the exact sigma (so a privacy claim computed from it is conservative)."""
        s2 = self.sigma2
        x = math.sqrt(float(s2))
        while Fraction(x) ** 2 > s2:
            x = math.nextafter(x, 0.0)
        return x

    def _support(self) -> np.ndarray:
        sigma = math.sqrt(float(self.sigma2))
        half = int(math.ceil(40.0 * sigma)) + 2  # exp(-800) is far below double precision
        return np.arange(-half, half + 1, dtype=np.float64)

    def variance(self) -> float:
        """The distribution's actual variance (summed over its support; sigma² when the difference underflows)."""
        s2 = float(self.sigma2)
        if s2 > 1e4:
            # |Var - sigma^2| <= sigma^2 * O(exp(-2 pi^2 sigma^2)) (Poisson summation): 0 in doubles.
            return s2
        k = self._support()
        w = np.exp(-(k * k) / (2.0 * s2))
        return float((w * k * k).sum() / w.sum())

    def tail(self, k: int) -> float:
        """P(X >= k) for integer k (numerical sum of the pmf)."""
        s2 = float(self.sigma2)
        return min(1.0, max(0.0, dg_tail_unnorm(int(k), s2) / dg_norm(s2)))

    def pmf(self, k: npt.ArrayLike) -> np.ndarray:
        """P(X = k) = exp(-k²/(2σ²)) / Z for integer k (doubles; used to predict accuracy, never to sample)."""
        s2 = float(self.sigma2)
        kk = np.asarray(k, dtype=np.float64)
        return np.exp(-(kk * kk) / (2.0 * s2)) / dg_norm(s2)


def discrete_laplace_param(scale: float | Fraction | DiscreteLaplaceParam) -> DiscreteLaplaceParam:
    """Round a scale up to t/s with s a power of two and t of at most 40 significant bits."""
    if isinstance(scale, DiscreteLaplaceParam):
        return scale
    f = _fraction_of(scale, "discrete Laplace scale")
    if f > _MAX_SCALE:
        raise InvalidParameter(f"discrete Laplace scale {float(f):.3g} is above the supported 2**50")
    e = math.floor(math.log2(f.numerator) - math.log2(f.denominator))
    m = max(0, _SCALE_BITS - 1 - e)
    s = 1 << m
    t = math.ceil(f * s)
    g = math.gcd(t, s)
    return DiscreteLaplaceParam(t // g, s // g)


def discrete_gaussian_param(sigma: float | Fraction | DiscreteGaussianParam) -> DiscreteGaussianParam:
    """Round sigma up: sigma^2 = t*c/b with t = floor(sigma)+1, b a power of two, c = ceil(sigma^2 b / t)."""
    if isinstance(sigma, DiscreteGaussianParam):
        return sigma
    f = _fraction_of(sigma, "discrete Gaussian sigma")
    if f > _MAX_SCALE:
        raise InvalidParameter(f"discrete Gaussian sigma {float(f):.3g} is above the supported 2**50")
    t = math.floor(f) + 1
    s2 = f * f
    # b = 2**m as large as keeps the acceptance denominator 2*t*c*b ~ 2*sigma^2*b^2 <= 2**54:
    # then c ~ sigma*b ~ 2**26 for sigma >= 1, i.e. sigma^2 is rounded up by a relative ~2**-26.
    m = max(0, math.floor((53 - math.log2(float(s2))) / 2))
    b = 1 << m
    c = math.ceil(s2 * b / t)
    return DiscreteGaussianParam(t, c, b)


# --------------------------------------------------------------------------- samplers


def _check_n(n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise InvalidParameter(f"number of samples must be an integer >= 0, got {n!r}")
    return int(n)


def _geometric_exp1(m: int, rng: RandomSource) -> np.ndarray:
    """V = number of successes of Bernoulli(exp(-1)) before the first failure (vectorised)."""
    v = np.zeros(m, dtype=np.int64)
    active = np.arange(m)
    one = np.ones(m, dtype=np.int64)
    while active.size:
        ok = _bernoulli_exp_le1(one[: active.size], one[: active.size], rng)
        v[active[ok]] += 1
        active = active[ok]
    return v


def _discrete_laplace_ts(t: int, s: int, n: int, rng: RandomSource) -> np.ndarray:
    """CKS20 Algorithm 2: P(y) ∝ exp(-|y| s / t)."""
    out = np.empty(n, dtype=np.int64)
    pending = np.arange(n)
    while pending.size:
        m = pending.size
        u = rng.randbelow(t, m)
        d = bernoulli_exp(u, np.int64(t), rng)  # accept U with probability exp(-U/t)
        v = np.zeros(m, dtype=np.int64)
        di = np.nonzero(d)[0]
        v[di] = _geometric_exp1(di.size, rng)
        y = (u + np.int64(t) * v) // np.int64(s)
        neg = rng.random_bits(m)
        reject = ~d | (neg & (y == 0))  # "-0" would double-count zero
        acc = ~reject
        out[pending[acc]] = np.where(neg[acc], -y[acc], y[acc])
        pending = pending[reject]
    return out


def discrete_laplace(scale: float | Fraction | DiscreteLaplaceParam, n: int, rng: RandomSource) -> np.ndarray:
    """n samples with P(k) ∝ exp(-|k|/scale), scale rounded up by ``discrete_laplace_param``."""
    p = discrete_laplace_param(scale)
    return _discrete_laplace_ts(p.t, p.s, _check_n(n), rng)


def discrete_gaussian(sigma: float | Fraction | DiscreteGaussianParam, n: int, rng: RandomSource) -> np.ndarray:
    """n samples with P(k) ∝ exp(-k^2/(2 sigma^2)) (CKS20 Algorithm 3), sigma rounded up.

    Proposal Y ~ discrete Laplace(t); accept with probability exp(-(|Y| - sigma^2/t)^2 / (2 sigma^2)).
    With sigma^2 = t c / b that exponent is (|Y| b - c)^2 / (2 t c b), all integers.
    """
    p = discrete_gaussian_param(sigma)
    n = _check_n(n)
    t, c, b = p.t, p.c, p.b
    den_int = 2 * t * c * b
    out = np.empty(n, dtype=np.int64)
    pending = np.arange(n)
    # |Y| b - c fits comfortably when |Y| < limit; beyond it (a tail event) use Python ints.
    lim = (math.isqrt(_NUM_LIMIT - 1) + c) // b if c < (1 << 31) else 0
    while pending.size:
        m = pending.size
        y = _discrete_laplace_ts(t, 1, m, rng)
        ay = np.abs(y)
        acc = np.zeros(m, dtype=bool)
        fast = ay < lim if den_int <= _DEN_LIMIT else np.zeros(m, dtype=bool)
        fi = np.nonzero(fast)[0]
        if fi.size:
            diff = ay[fi] * np.int64(b) - np.int64(c)
            acc[fi] = bernoulli_exp(diff * diff, np.int64(den_int), rng)
        for i in np.nonzero(~fast)[0]:
            diff = int(ay[i]) * b - c
            acc[i] = bernoulli_exp_int(diff * diff, den_int, rng)
        out[pending[acc]] = y[acc]
        pending = pending[~acc]
    return out


__all__ = [
    "bernoulli_exp",
    "bernoulli_rational",
    "bernoulli_float",
    "discrete_laplace",
    "discrete_gaussian",
    "discrete_laplace_param",
    "discrete_gaussian_param",
    "DiscreteLaplaceParam",
    "DiscreteGaussianParam",
    "float_up",
    "float_down",
]
