"""Private selection: exponential mechanism, top-k, quantiles, partition selection.

Exponential mechanism = permute-and-flip (McKenna & Sheldon 2020): visit the candidates in a
uniformly random order and stop at the first one accepted with probability
exp(ε·(u − u*)/(2Δ)) (exp(ε·(u − u*)/Δ) for monotonic utilities). It is ε-DP and its expected
error is never worse than the classical exponential mechanism's. With integer utilities it is
exact: the rate ε/(2Δ) is rounded *down* to a dyadic rational (less ε spent, never more) and
each acceptance is an exact Bernoulli(exp(-rational)) (``samplers.bernoulli_exp``). With
non-integer utilities a documented float path is used: exp() is evaluated in double precision
(relative error ~1e-16 on each acceptance probability) and the Bernoulli is exact for that double.

Top-k peels k times with ε/k each (sequential composition: ε-DP in total).

Partition selection (which partitions to publish, from unit counts n after L0 bounding):
- ``truncated_geometric`` (Desfontaines, Voss, Gipson, Mandayam 2022): the optimal keep
  probability π(0)=0, π(n) = min(1, e^ε' π(n−1) + δ', 1 − e^−ε' (1 − π(n−1) − δ')), with
  ε' = ε/L0 and δ' = δ/L0 per partition: a unit changes at most L0 partitions' counts by one,
  so the composition over them is (ε, δ) (basic composition; the paper's Section 5 split).
- ``laplace_threshold``: keep iff n + K ≥ T with K discrete Laplace of scale ≥ L0/ε (L1 of the
  unit-count vector is L0) and T the smallest integer with L0·P(1 + K ≥ T) ≤ δ: δ is exactly the
  union bound on a 1-unit partition (present in only one of the neighbours) being released.
- ``gaussian_threshold``: keep iff n + Z ≥ T with Z discrete Gaussian calibrated to
  (ε, δ/2) for L2 = sqrt(L0), and L0·P(1 + Z ≥ T) ≤ δ/2.
Keep probabilities are doubles (relative error ~1e-15); sampling from a double is exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt

from dpops.errors import InvalidParameter
from dpops.events import ApproxDP, PrivacyEvent, PureDP
from dpops.noise.calibration import discrete_gaussian_sigma, gaussian_sigma_zcdp
from dpops.noise.randomness import RandomSource
from dpops.noise.samplers import (
    DiscreteGaussianParam,
    DiscreteLaplaceParam,
    bernoulli_exp,
    bernoulli_exp_int,
    bernoulli_float,
    compare_exact,
    discrete_gaussian,
    discrete_gaussian_param,
    discrete_laplace,
    discrete_laplace_param,
)
from dpops.param_checks import check_bounds, check_delta, check_epsilon, check_positive, check_positive_int

QUANTILE_Q_BITS = 16  # q is rounded to a multiple of 2**-16 so utilities are integers
DEFAULT_QUANTILE_CANDIDATES = 1025


# --------------------------------------------------------------------------- helpers


def _permutation(n: int, rng: RandomSource) -> np.ndarray:
    """Exactly uniform permutation (Fisher–Yates with exact uniform integers)."""
    perm = np.arange(n)
    if n < 2:
        return perm
    offsets = rng.randbelow(np.arange(n, 1, -1, dtype=np.int64))  # j_i uniform in [0, n-i)
    for i, off in enumerate(offsets.tolist()):
        j = i + off
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def _dyadic_rate_down(rate: Fraction, max_diff: int) -> tuple[int, int]:
    """(P, k) with P/2**k <= rate, P of up to 30 bits (fewer if max_diff·P would leave int64)."""
    bits = max(8, min(30, 61 - max(1, max_diff).bit_length()))
    e = math.floor(math.log2(rate.numerator) - math.log2(rate.denominator))
    k = max(0, bits - 1 - e)
    return math.floor(rate * (1 << k)), k


_INT64_SAFE = 1 << 62  # |u| below this: u.max() - u cannot leave int64


def _utilities(utilities: npt.ArrayLike) -> tuple[np.ndarray, bool]:
    """The utilities as int64 (exact), an object array of Python ints (exact, beyond int64) or float64.

    Integer utilities of any size stay exact: a utility that does not fit int64 (a large public
    penalty at a tiny epsilon, issue 25 item 6b) is computed with Python ints, never refused or
    wrapped, because the mechanism runs after the charge and must not fail on a parameter the spec
    accepted.
    """
    u = np.asarray(utilities)
    if u.ndim != 1 or u.size == 0:
        raise InvalidParameter("utilities must be a non-empty 1-D array (one score per candidate)")
    if u.dtype == object:
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in u.tolist()):
            raise InvalidParameter("utilities of dtype object must all be integers")
        exact = [int(v) for v in u.tolist()]
        if max(abs(v) for v in exact) < _INT64_SAFE:
            return np.asarray(exact, dtype=np.int64), True
        return np.array(exact, dtype=object), True
    if u.dtype == bool or not (np.issubdtype(u.dtype, np.integer) or np.issubdtype(u.dtype, np.floating)):
        raise InvalidParameter(f"utilities must be numbers, got dtype {u.dtype}")
    if np.issubdtype(u.dtype, np.floating):
        if not np.all(np.isfinite(u)):
            i = int(np.flatnonzero(~np.isfinite(u))[0])
            raise InvalidParameter(f"utilities[{i}] is {u[i]!r}; utilities must be finite")
        if np.all(u == np.floor(u)) and np.abs(u).max() < 2.0**53:
            return u.astype(np.int64), True
        return u.astype(np.float64), False
    if np.abs(u.astype(np.float64)).max() >= 2.0**62:  # exact Python ints: u.max() - u may leave int64
        return np.array([int(v) for v in u.tolist()], dtype=object), True
    return u.astype(np.int64), True


def _accept_in_order(u: np.ndarray, exact: bool, rate: Fraction, order: np.ndarray, rng: RandomSource) -> int:
    """Permute-and-flip over candidates ``order``: index (into u) of the first accepted."""
    uo = u[order]
    if exact:
        diff = uo.max() - uo  # >= 0, exact int64
        p, k = _dyadic_rate_down(rate, int(diff.max()))
        if int(diff.max()) * p < 2**62:
            num = diff.astype(np.int64) * np.int64(p)  # diff may be an object array of small Python ints
        else:  # exact Python ints for the far-away candidates
            num = np.array([int(d) * p for d in diff.tolist()], dtype=object)
        # 2**k as a Python int: k reaches 63+ for tiny rates (eps 1e-3 over a wide quantile utility), where
        # an int64 shift overflows; bernoulli_exp takes arbitrary-size ints on its exact path.
        acc = bernoulli_exp(num, 1 << k, rng)
    else:
        diff = uo.max() - uo
        acc = bernoulli_float(np.exp(-float(rate) * diff), rng)
    first = int(np.argmax(acc))  # the best candidate is accepted with probability 1
    return int(order[first])


_SEQUENTIAL_MAX = 256  # up to this many candidates a lazy scalar loop beats numpy (measured)


def _permute_and_flip(u: np.ndarray, exact: bool, rate: Fraction, candidates: np.ndarray, rng: RandomSource) -> int:
    """Permute-and-flip over ``candidates`` (indices into u)."""
    if candidates.size > _SEQUENTIAL_MAX:
        return _accept_in_order(u, exact, rate, candidates[_permutation(candidates.size, rng)], rng)
    # Draw the random order lazily (each next candidate uniform among the rest) and stop at the
    # first acceptance: the same distribution as a full permutation, with fewer draws.
    rest = [int(c) for c in candidates]
    best = max(int(u[c]) for c in rest) if exact else float(max(u[c] for c in rest))
    if exact:
        p, k = _dyadic_rate_down(rate, int(best - min(int(u[c]) for c in rest)))
    while True:
        j = rng.randbelow_int(len(rest))
        rest[j], rest[-1] = rest[-1], rest[j]
        c = rest.pop()
        if exact:
            ok = bernoulli_exp_int((int(best) - int(u[c])) * p, 1 << k, rng)  # best is an int here
        else:
            prob = Fraction(float(np.exp(-float(rate) * (best - float(u[c])))))
            ok = compare_exact(int(rng.uint64(1)[0]), prob.numerator, prob.denominator, rng)
        if ok:
            return c


def _rate(epsilon: float, sensitivity: float, monotonic: bool) -> Fraction:
    return Fraction(epsilon) / (Fraction(sensitivity) * (1 if monotonic else 2))


# --------------------------------------------------------------------------- exponential mechanism


def exponential_mechanism(utilities: npt.ArrayLike, epsilon: float, sensitivity: float, rng: RandomSource,
                          monotonic: bool = False) -> int:
    """ε-DP choice of a candidate index (permute-and-flip; exact for integer utilities)."""
    epsilon = check_epsilon(epsilon)
    sensitivity = check_positive(sensitivity, "sensitivity")
    u, exact = _utilities(utilities)
    return _permute_and_flip(u, exact, _rate(epsilon, sensitivity, monotonic), np.arange(u.size), rng)


def permute_and_flip_pmf(utilities: npt.ArrayLike, epsilon: float, sensitivity: float,
                        monotonic: bool = False) -> np.ndarray:
    """The exact output distribution of ``exponential_mechanism`` on these utilities (a prediction: it
    draws nothing and spends nothing; the utilities are whatever the caller may look at).

    Permute-and-flip accepts candidate r, when visited, with probability p_r = exp(-rate (u* - u_r)).
    Give every candidate an independent uniform arrival time T_s (a uniform random order); r is the
    output iff it is accepted and every candidate arriving before it is rejected, so
    P(r) = p_r E[prod_{s != r} (1 - p_s 1{T_s < T_r})] = p_r int_0^1 prod_{s != r} (1 - p_s t) dt.
    The integrand is a polynomial of degree C - 1 in t; Gauss-Legendre with ceil(C/2) + 1 nodes
    integrates it exactly (all weights positive, all terms in [0, 1]: no cancellation). Integer utilities
    use the dyadic rate the sampler uses (rounded down: ``_dyadic_rate_down``), others the float rate.
    """
    epsilon = check_epsilon(epsilon)
    sensitivity = check_positive(sensitivity, "sensitivity")
    u, exact = _utilities(utilities)
    rate = _rate(epsilon, sensitivity, monotonic)
    if exact:
        best = max(int(x) for x in u.tolist())
        diff_int = [best - int(x) for x in u.tolist()]
        num, k = _dyadic_rate_down(rate, max(diff_int))
        r = math.ldexp(num, -k)
        diff = np.asarray(diff_int, dtype=np.float64)
    else:
        diff = float(np.max(u)) - u.astype(np.float64)
        r = float(rate)
    p = np.exp(-r * diff)
    nodes, weights = np.polynomial.legendre.leggauss(u.size // 2 + 2)
    t = (nodes + 1.0) / 2.0
    w = weights / 2.0
    log_all = np.log1p(-np.outer(p, t)).sum(axis=0)  # log prod_s (1 - p_s t), per node
    # prod_{s != r}: divide out r's own factor (t < 1 at every node, so 1 - p_r t > 0)
    per = np.exp(log_all[None, :] - np.log1p(-np.outer(p, t)))
    return np.asarray(p * (per @ w), dtype=np.float64)


def histogram_quantile_utility(hist: npt.ArrayLike, q: float) -> tuple[np.ndarray, int]:
    """Integer utilities of the grid candidates for the q-quantile of one partition's histogram, and the
    factor d their sensitivity carries (the mechanism runs at sensitivity d·Delta).

    q = a/d exactly as written in the spec (the Fraction of its decimal form), rank(c_j) = rows in cells
    <= j (the cumulative histogram), utility -|d rank - a n|: one unit moves rank and n by at most Delta
    rows each, so the utility by at most d·Delta (|d Δrank - a Δn| <= d Delta as 0 <= a <= d and both
    moves have the same sign under add/remove). Integer utilities keep the mechanism on its exact path.
    One owner: the release (``pipelines.aggregate``) and the prediction (``dpops.analysis.accuracy``) both
    call this.

    Exact at any partition size: every |d rank - a n| is at most d n, so when d n < 2^62 the int64 arithmetic
    cannot wrap; beyond it (a quantile written with many decimals, d up to 10^9, over a partition of ~10^10
    bounded rows) the utilities are Python integers (an object array, which ``exponential_mechanism`` takes on
    its exact path). Why: a wrapped or float-rounded utility is not the spec's utility (a wrapped far cell looks
    near, so a wrong quantile is published, and float utilities leave the mechanism's exact integer path on which
    its d·Delta sensitivity is argued); refusing instead would be a data-dependent abort after the charge.
    """
    f = Fraction(repr(float(q))).limit_denominator(10**9)
    a, d = int(f.numerator), int(f.denominator)
    ranks = np.cumsum(np.asarray(hist, dtype=np.int64))
    total = int(ranks[-1])
    if d * total < _INT64_SAFE:
        return -np.abs(d * ranks - a * total), d
    return np.array([-abs(d * int(r) - a * total) for r in ranks.tolist()], dtype=object), d


def exponential_mechanism_event(epsilon: float) -> PrivacyEvent:
    """The event of one ``exponential_mechanism`` call (ε-DP)."""
    return PureDP(check_epsilon(epsilon), mechanism="exponential_mechanism/permute_and_flip")


def top_k(utilities: npt.ArrayLike, k: int, epsilon: float, sensitivity: float, rng: RandomSource,
          monotonic: bool = False) -> list[int]:
    """k distinct indices, best first, by k peels of permute-and-flip at ε/k each (ε-DP in total)."""
    epsilon = check_epsilon(epsilon)
    sensitivity = check_positive(sensitivity, "sensitivity")
    k = check_positive_int(k, "k")
    u, exact = _utilities(utilities)
    if k > u.size:
        raise InvalidParameter(f"top_k: k={k} is larger than the number of candidates ({u.size})")
    rate = _rate(epsilon, sensitivity, monotonic) / k
    remaining = np.arange(u.size)
    chosen: list[int] = []
    for _ in range(k):
        pick = _permute_and_flip(u, exact, rate, remaining, rng)
        chosen.append(pick)
        remaining = remaining[remaining != pick]
    return chosen


def top_pick_probability(gap: int, n_candidates: int, k: int, epsilon: float, sensitivity: float,
                         monotonic: bool = False) -> float:
    """Exact P(``top_k``'s first pick is the true top item) when every other candidate sits ``gap`` below it.

    Permute-and-flip accepts the best candidate whenever it is visited and each other one with
    probability q = exp(-rate·gap), rate = ε/(k·(1 or 2)·Δ) rounded down to the dyadic rational the
    exact path uses. The best is at a uniform position j of the random order and wins iff the j before
    it are rejected: P = (1/C) Σ_{j<C} (1-q)^j = (1 - (1-q)^C) / (C q). Raising any other candidate's
    utility only raises its acceptance, so this is a lower bound whenever the gap to the runner-up is
    at least ``gap``. Public parameters only: no privacy cost.
    """
    epsilon = check_epsilon(epsilon)
    sensitivity = check_positive(sensitivity, "sensitivity")
    k = check_positive_int(k, "k")
    c = check_positive_int(n_candidates, "n_candidates")
    if isinstance(gap, bool) or not isinstance(gap, (int, np.integer)) or gap < 0:
        raise InvalidParameter(f"gap must be an integer >= 0, got {gap!r}")
    if c == 1:
        return 1.0
    rate = _rate(epsilon, sensitivity, monotonic) / k
    pr, kk = _dyadic_rate_down(rate, int(gap))
    q = math.exp(-float(Fraction(pr, 1 << kk)) * int(gap))
    if q >= 1.0:
        return 1.0 / c
    return -math.expm1(c * math.log1p(-q)) / (c * q)


def top_k_event(epsilon: float, k: int = 1) -> PrivacyEvent:
    """The event of one ``top_k`` call: ε-DP in total over its k peels."""
    check_positive_int(k, "k")
    return PureDP(check_epsilon(epsilon), mechanism="top_k/peeling_permute_and_flip")


# --------------------------------------------------------------------------- quantiles


def quantile_grid(lo: float, hi: float, n_candidates: int = DEFAULT_QUANTILE_CANDIDATES) -> np.ndarray:
    """The public candidate grid: n_candidates evenly spaced points from lo to hi."""
    lo, hi = check_bounds(lo, hi, "quantile bounds")
    if not lo < hi:
        raise InvalidParameter(f"quantile bounds need lo < hi, got [{lo}, {hi}]")
    n = check_positive_int(n_candidates, "n_candidates")
    if n < 2:
        raise InvalidParameter("n_candidates must be >= 2")
    return np.linspace(lo, hi, n)


def quantile_histogram(values: npt.ArrayLike, lo: float, hi: float,
                       n_candidates: int = DEFAULT_QUANTILE_CANDIDATES) -> np.ndarray:
    """Counts per grid cell: cell j holds values in [c_j, c_{j+1}) (the last cell holds hi).

    Values are clamped to [lo, hi] first. Histograms of disjoint data add up, so a pipeline can
    pre-aggregate them; ``dp_quantile(counts, ..., histogram=True)`` consumes them.
    """
    grid = quantile_grid(lo, hi, n_candidates)
    v = np.asarray(values, dtype=np.float64)
    if v.size and not np.all(np.isfinite(v)):
        raise InvalidParameter("quantile values must be finite (drop NaN rows before aggregating)")
    v = np.clip(v, grid[0], grid[-1])
    cell = np.searchsorted(grid, v, side="right") - 1
    return np.bincount(cell, minlength=grid.size).astype(np.int64)


def dp_quantile(
    data: npt.ArrayLike,
    lo: float,
    hi: float,
    q: float,
    epsilon: float,
    rng: RandomSource,
    *,
    histogram: bool = False,
    n_candidates: int = DEFAULT_QUANTILE_CANDIDATES,
    sensitivity: float = 1.0,
) -> float:
    """ε-DP q-quantile: exponential mechanism over the public grid of [lo, hi].

    ``data`` is the values (any order; clamped to [lo, hi]) or, with histogram=True, the counts
    from ``quantile_histogram``. Utility of candidate c: −|rank(c) − q·n|, rank(c) = #{v < c};
    ``sensitivity`` is the most rows one privacy unit contributes (1 for record-level), which
    bounds the change of both rank and n. q is rounded to a multiple of 2**-16 so the utility
    (scaled by 2**16) is an integer and the mechanism exact.
    """
    epsilon = check_epsilon(epsilon)
    sensitivity = check_positive(sensitivity, "sensitivity")
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not (0.0 <= q <= 1.0):
        raise InvalidParameter(f"quantile q must be in [0, 1], got {q!r}")
    grid = quantile_grid(lo, hi, n_candidates)
    if histogram:
        counts = np.asarray(data)
        if counts.shape != grid.shape or not np.issubdtype(counts.dtype, np.integer) or (counts < 0).any():
            raise InvalidParameter(f"histogram must hold {grid.size} non-negative integer counts (quantile_histogram)")
        counts = counts.astype(np.int64)
        rank = np.concatenate([[0], np.cumsum(counts)[:-1]])
        n = int(counts.sum())
    else:
        v = np.asarray(data, dtype=np.float64).reshape(-1)
        if v.size and not np.all(np.isfinite(v)):
            raise InvalidParameter("quantile values must be finite (drop NaN rows first)")
        v = np.sort(np.clip(v, grid[0], grid[-1]))
        rank = np.searchsorted(v, grid, side="left").astype(np.int64)
        n = int(v.size)
    scale = 1 << QUANTILE_Q_BITS
    qq = round(q * scale)
    # |scale·rank − qq·n| <= scale·n: within int64 below 2^62, else exact Python ints (a wrapped far candidate
    # would look near; the bound is public, so the choice of path leaks nothing)
    if n * scale < _INT64_SAFE:
        util = -np.abs(rank * np.int64(scale) - np.int64(qq) * np.int64(n))
    else:
        util = np.array([-abs(int(r) * scale - qq * n) for r in rank.tolist()], dtype=object)
    # one unit moves rank and n by at most `sensitivity` rows: |Δ(scale·rank − qq·n)| <= scale·sensitivity
    idx = exponential_mechanism(util, epsilon, sensitivity * scale, rng)
    return float(grid[idx])


def dp_quantile_event(epsilon: float) -> PrivacyEvent:
    """The event of one ``dp_quantile`` call (ε-DP)."""
    return PureDP(check_epsilon(epsilon), mechanism="quantile/exponential_mechanism")


# --------------------------------------------------------------------------- partition selection

STRATEGIES = ("truncated_geometric", "laplace_threshold", "gaussian_threshold")
_MAX_TABLE = 10_000_000


@dataclass(frozen=True)
class PartitionSelection:
    """Private partition selection: keep a partition only if enough units are in it.

    (ε, δ)-DP when one unit is in at most ``max_partitions_per_unit`` partitions. ``strategy`` is one of
    STRATEGIES; the table, or the noise and threshold, it needs is computed once in ``__post_init__``.
    """

    strategy: str
    epsilon: float
    delta: float
    max_partitions_per_unit: int = 1
    _table: Any = field(default=None, init=False, repr=False, compare=False)
    _noise: Any = field(default=None, init=False, repr=False, compare=False)
    _threshold: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise InvalidParameter(f"partition selection strategy {self.strategy!r} is unknown; "
                                   f"use one of {STRATEGIES}")
        check_epsilon(self.epsilon)
        check_delta(self.delta, allow_zero=False)
        l0 = check_positive_int(self.max_partitions_per_unit, "max_partitions_per_unit")
        if self.strategy == "truncated_geometric":
            object.__setattr__(self, "_table", _truncated_geometric_table(self.epsilon / l0, self.delta / l0))
        elif self.strategy == "laplace_threshold":
            lat = discrete_laplace_param(Fraction(l0) / Fraction(self.epsilon))
            object.__setattr__(self, "_noise", lat)
            object.__setattr__(self, "_threshold", _threshold(lat.tail, self.delta / l0, lat.t / lat.s))
        else:
            if l0 == 1:
                sigma = discrete_gaussian_sigma(float(self.epsilon), self.delta / 2, 1.0)
            else:
                sigma = gaussian_sigma_zcdp(self.epsilon, self.delta / 2, math.sqrt(l0) * (1 + 1e-15))
            glat = discrete_gaussian_param(sigma)
            object.__setattr__(self, "_noise", glat)
            object.__setattr__(self, "_threshold",
                               _threshold(glat.tail, self.delta / 2 / l0, math.sqrt(float(glat.sigma2))))

    @property
    def threshold(self) -> int | None:
        """T for the thresholding strategies (keep iff n + noise >= T); None otherwise."""
        return None if self.strategy == "truncated_geometric" else self._threshold

    @property
    def noise(self) -> DiscreteLaplaceParam | DiscreteGaussianParam | None:
        """The lattice noise of the thresholding strategies; None for ``truncated_geometric``."""
        return self._noise

    def keep_probability(self, unit_counts: npt.ArrayLike) -> np.ndarray:
        """Exact P(keep | n units) per entry (n <= 0 is never kept)."""
        n = _counts(unit_counts)
        if self.strategy == "truncated_geometric":
            table = self._table
            return np.where(n <= 0, 0.0, table[np.clip(n, 0, table.size - 1)])
        out = np.zeros(n.shape, dtype=np.float64)
        tail = self._noise.tail
        cache: dict[int, float] = {}
        for i, c in np.ndenumerate(n):
            if c <= 0:
                continue
            d = self._threshold - int(c)  # keep iff noise >= d
            if d not in cache:
                cache[d] = tail(d) if d >= 1 else 1.0 - tail(1 - d)
            out[i] = cache[d]
        return out

    def units_for_probability(self, probability: float, limit: int = 1 << 40) -> int | None:
        """Smallest unit count n with keep_probability(n) >= ``probability`` (None if above ``limit``).

        keep_probability is non-decreasing in n for every strategy (the table is a running min of
        increasing maps; the thresholds compare n + noise), so a doubling then bisection search is exact.
        """
        if not (0.0 < probability <= 1.0):
            raise InvalidParameter(f"probability must be in (0, 1], got {probability!r}")

        def ok(n: int) -> bool:
            return float(self.keep_probability(np.array([n]))[0]) >= probability

        hi = 1
        while not ok(hi):
            hi *= 2
            if hi > limit:
                return None
        lo = hi // 2  # ok(lo) is false, or lo == 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if ok(mid):
                hi = mid
            else:
                lo = mid
        return hi

    def keep(self, unit_counts: npt.ArrayLike, rng: RandomSource) -> np.ndarray:
        """Bool mask of the partitions to publish."""
        n = _counts(unit_counts)
        if self.strategy == "truncated_geometric":
            return bernoulli_float(self.keep_probability(n).reshape(-1), rng).reshape(n.shape) & (n > 0)
        if isinstance(self._noise, DiscreteLaplaceParam):
            z = discrete_laplace(self._noise, n.size, rng)
        else:
            z = discrete_gaussian(self._noise, n.size, rng)
        return ((n.reshape(-1) + z) >= self._threshold).reshape(n.shape) & (n > 0)

    def event(self) -> ApproxDP:
        """What one run of this selection spends: (ε, δ) as configured."""
        return ApproxDP(self.epsilon, self.delta, mechanism=f"partition_selection/{self.strategy}")

    def describe(self) -> dict[str, Any]:
        """JSON for the manifest: the strategy, its (ε, δ), L0 and the noise and threshold it runs with."""
        out: dict[str, Any] = {
            "strategy": self.strategy,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "max_partitions_per_unit": self.max_partitions_per_unit,
        }
        if self.strategy != "truncated_geometric":
            out["threshold"] = self._threshold
            if isinstance(self._noise, DiscreteLaplaceParam):
                out["noise"] = {"sampler": "discrete_laplace", "lattice_scale": f"{self._noise.t}/{self._noise.s}"}
            else:
                out["noise"] = {"sampler": "discrete_gaussian",
                                "lattice_sigma2": f"{self._noise.t * self._noise.c}/{self._noise.b}"}
        return out


def _counts(unit_counts: npt.ArrayLike) -> np.ndarray:
    n = np.asarray(unit_counts)
    if n.dtype == bool or not np.issubdtype(n.dtype, np.integer):
        if np.issubdtype(n.dtype, np.floating) and np.all(np.isfinite(n)) and np.all(n == np.floor(n)):
            return n.astype(np.int64)
        raise InvalidParameter(f"unit_counts must be integers, got dtype {n.dtype}")
    return n.astype(np.int64)


_TABLE_ABS = 8 * 2.0**-53  # > the absolute rounding error of 1 - e^-eps (1 - p - delta) (a few ulps of 1)
_TABLE_REL = 8 * 2.0**-53  # > the relative rounding error of e^eps p + delta (e^eps, a product and a sum)


def _truncated_geometric_table(eps: float, delta: float) -> np.ndarray:
    """π(0..N) of the optimal partition selection, N the first n with π(n) = 1."""
    # Refuse at once (in the plan, before any reservation) a table the loop below would refuse after ten
    # million iterations. With L = log1p((e^eps - 1) / (2 delta)) / eps: pi(n) <= delta (e^(n eps) - 1)/(e^eps - 1)
    # (from pi(n) <= e^eps pi(n-1) + delta), so pi first reaches 1/2 at some n* >= L; and 1 - pi(n) + c >=
    # e^-eps (1 - pi(n-1) + c) with c = delta / (e^eps - 1), so from 1 - pi(n*-1) > 1/2 it takes >= L more steps
    # to reach pi = 1. The table then has >= 2L entries (1 subtracted for rounding).
    # And a delta per partition within a few rounding margins of 0 could not move the table's last steps at all.
    if delta < 2 * (_TABLE_ABS + _TABLE_REL) or 2 * math.log1p(math.expm1(eps) / (2 * delta)) / eps - 1 > _MAX_TABLE:
        raise InvalidParameter("partition selection: epsilon/delta per partition too small (keep table too long)")
    ee, em = math.exp(eps), math.exp(-eps)
    table = [0.0]
    p = 0.0
    while p < 1.0:
        # Both DP constraints bound pi(n) from above given the stored pi(n-1): pi(n) <= e^eps pi(n-1) + delta and
        # pi(n) <= 1 - e^-eps (1 - pi(n-1) - delta). Each is computed in floats (e^eps itself rounded), up to a
        # few ulps of the result and of 1 off, either way: rounded to nearest, 40% of the steps broke the exact
        # constraint by up to 3.5e-16, i.e. the true delta was above the charged one. So each bound is lowered
        # by more than its rounding error before the smaller is taken (the first's is relative to it, the second's
        # is a few ulps of 1), so every step holds in exact arithmetic (tests/test_selection.py checks
        # it at 200 bits).
        grow = ee * p + delta
        rest = 1.0 - em * (1.0 - p - delta)
        low = min(grow * (1.0 - _TABLE_REL), rest - _TABLE_ABS - _TABLE_REL * abs(rest))
        # At least the previous entry (the table stays non-decreasing: pi(n) = pi(n-1) meets both constraints
        # exactly, as e^eps >= 1 and delta > 0), at most 1 (a lowered bound above 1 is an exact bound above 1).
        p = min(1.0, max(p, low))
        table.append(p)
        if len(table) > _MAX_TABLE:
            raise InvalidParameter("partition selection: epsilon/delta per partition too small (keep table too long)")
    out = np.array(table)
    # read-only: plans share one selection per public parameters (release_plan.partition_selection's cache), so no
    # caller may change the keep probabilities another plan (or the run) reads
    out.flags.writeable = False
    return out


def _threshold(tail: Callable[[int], float], delta_per_partition: float, scale: float) -> int:
    """Smallest integer T with P(1 + noise >= T) = tail(T - 1) <= delta_per_partition."""
    j = max(1, int(scale))
    while tail(j) > delta_per_partition:
        j *= 2
    lo, hi = 0, j  # tail(hi) <= target; find the smallest such j >= 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if mid >= 1 and tail(mid) <= delta_per_partition:
            hi = mid
        else:
            lo = mid
    return hi + 1


__all__ = [
    "exponential_mechanism",
    "exponential_mechanism_event",
    "permute_and_flip_pmf",
    "histogram_quantile_utility",
    "top_k",
    "top_k_event",
    "top_pick_probability",
    "quantile_grid",
    "quantile_histogram",
    "dp_quantile",
    "dp_quantile_event",
    "PartitionSelection",
    "STRATEGIES",
]
