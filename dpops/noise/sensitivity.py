"""Sensitivities derived from declared, public contribution bounds (semantics.md section 1).

Model. The input is rows (unit, partition, value). After contribution bounding
a unit has rows in at most L0 = ``max_partitions`` partitions and at most
Linf = ``max_rows_per_partition`` rows in each; values are clamped to [lo, hi].
A query returns one coordinate per partition (over a public partition list).

Every per-partition query here is a sum over the unit's rows of a bounded
per-row term t(v) in [a, b] (count: t = 1; sum: t = v; normalized sum:
t = v - mid; ...). A unit's contribution to one partition is therefore some
S in [s_lo, s_hi] with s_lo = min(0, Linf·a), s_hi = max(0, Linf·b): 0 is
included because a unit may have no rows in a partition. Write
M = max(|s_lo|, |s_hi|) (largest contribution) and W = s_hi - s_lo (largest
change of a contribution). Then, with d the difference of the two query vectors:

add_remove (the unit's rows are present or absent): only the unit's <= L0
  partitions change, each by its whole contribution, |d_p| <= M:
  L1 = L0·M, L2 = sqrt(L0)·M, Linf = M, max_coords = L0.

replace, general (the unit's rows are swapped for another unit's, which may lie
  in other partitions): old partitions P, new partitions Q, |P|, |Q| <= L0.
  On P∩Q |d_p| <= W; on P xor Q |d_p| <= M. With k = |P∩Q| the worst case is
  k·W + 2(L0-k)·M (L1) and k·W² + 2(L0-k)·M² (squared L2), linear in k, so the
  maximum is at k = 0 or k = L0. Since W <= 2M:
  L1 = 2·L0·M, L2 = sqrt(L0·max(2M², W²)), Linf = W, max_coords = 2·L0.

replace, partitions fixed per unit (``partitions_fixed_per_unit``: a unit's
  partitions are public and the replacement's rows lie in the same ones; its
  number of rows there may still be anything in 0..Linf): only P∩Q = P changes,
  L1 = L0·W, L2 = sqrt(L0)·W, Linf = W, max_coords = L0.

Specialisations (M, W per partition):
- count (t = 1): M = W = Linf. add_remove L1 = L0·Linf, L2 = sqrt(L0)·Linf;
  replace L1 = 2·L0·Linf, L2 = sqrt(2·L0)·Linf; fixed replace = add_remove.
- unit_count (distinct units; contribution 0 or 1, Linf irrelevant): M = W = 1.
- sum (t = v in [lo, hi]): M = Linf·max(|lo|, |hi|); W = Linf·(max(hi,0) - min(lo,0)).
  add_remove L1 = L0·Linf·max(|lo|,|hi|); replace L1 = 2·L0·Linf·max(|lo|,|hi|);
  fixed replace L1 = L0·Linf·(hi - lo) when lo <= 0 <= hi. When 0 is outside
  [lo, hi] the honest fixed bound is L0·Linf·max(|lo|,|hi|) (a unit may drop to
  zero rows), larger than (hi - lo): the module uses W, never less.
- normalized_sum (t = v - mid in [-H, H], H = (hi-lo)/2): M = Linf·H, W = 2·Linf·H.
  This is what makes DP means cheaper: the bound is half the range, not max|v|.
- normalized sum of squares for variances: t = (v - mid)² - H²/2 in [-H²/2, H²/2]
  (the squares lie in [0, H²]; centring them halves the sensitivity).

Everything is computed from the declared bounds only: never from the data.

These Δ are for exact sums. The pipeline's sums are exact: each row's term is snapped to a
power-of-two grid and clipped *inside* the term range [a, b] above (``pipelines.bounding``),
so the integer sum is a sum of per-row terms in [a, b] and the same Δ holds for it unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dpops.errors import InvalidParameter
from dpops.param_checks import check_bounds, check_positive_int

ADJACENCIES = ("add_remove", "replace")


@dataclass(frozen=True)
class ContributionBounds:
    """How much one privacy unit may contribute: at most L0 partitions and Linf rows in each, under an adjacency."""

    adjacency: str  # "add_remove" | "replace"
    max_partitions: int  # L0 >= 1
    max_rows_per_partition: int  # Linf >= 1
    partitions_fixed_per_unit: bool = False  # a unit's partitions are public and fixed: tightens replace

    def __post_init__(self) -> None:
        if self.adjacency not in ADJACENCIES:
            raise InvalidParameter(
                f"contribution bounds: adjacency must be one of {list(ADJACENCIES)}, got {self.adjacency!r}"
            )
        check_positive_int(self.max_partitions, "contribution bounds: max_partitions (L0)")
        check_positive_int(self.max_rows_per_partition, "contribution bounds: max_rows_per_partition (Linf)")
        if not isinstance(self.partitions_fixed_per_unit, bool):
            raise InvalidParameter(
                "contribution bounds: partitions_fixed_per_unit must be true or false, "
                f"got {self.partitions_fixed_per_unit!r}"
            )


@dataclass(frozen=True)
class Sensitivity:
    """Sensitivities of one output vector: the L1, L2 and L∞ change one unit causes, over ``max_coords`` coordinates."""

    l1: float
    l2: float
    linf: float  # max change of one output coordinate
    max_coords: int  # how many output coordinates one unit can change


def _check(b: ContributionBounds) -> ContributionBounds:
    if not isinstance(b, ContributionBounds):
        raise InvalidParameter(f"expected ContributionBounds, got {type(b).__name__}")
    return b


def _bounded_sum(b: ContributionBounds, t_lo: float, t_hi: float, rows: int) -> Sensitivity:
    """Sensitivity of per-partition sums of a per-row term in [t_lo, t_hi], <= ``rows`` rows per unit and partition."""
    s_lo, s_hi = min(0.0, rows * t_lo), max(0.0, rows * t_hi)
    m, w = max(abs(s_lo), abs(s_hi)), s_hi - s_lo
    l0 = b.max_partitions
    if b.adjacency == "add_remove":
        return Sensitivity(l1=l0 * m, l2=math.sqrt(l0) * m, linf=m, max_coords=l0)
    if b.partitions_fixed_per_unit:
        return Sensitivity(l1=l0 * w, l2=math.sqrt(l0) * w, linf=w, max_coords=l0)
    return Sensitivity(l1=2 * l0 * m, l2=math.sqrt(l0 * max(2 * m * m, w * w)), linf=w, max_coords=2 * l0)


def count(b: ContributionBounds) -> Sensitivity:
    """Rows per partition."""
    b = _check(b)
    return _bounded_sum(b, 1.0, 1.0, b.max_rows_per_partition)


def unit_count(b: ContributionBounds) -> Sensitivity:
    """Distinct units per partition: a unit adds 0 or 1 to each of its partitions, whatever Linf."""
    b = _check(b)
    return _bounded_sum(b, 1.0, 1.0, 1)


def sum_(b: ContributionBounds, lo: float, hi: float) -> Sensitivity:
    """Sum of values clamped to [lo, hi]."""
    b = _check(b)
    lo, hi = check_bounds(lo, hi, "value bounds")
    return _bounded_sum(b, lo, hi, b.max_rows_per_partition)


def normalized_sum(b: ContributionBounds, lo: float, hi: float) -> Sensitivity:
    """Sum of (v - (lo+hi)/2) over values clamped to [lo, hi]: each term in [-(hi-lo)/2, (hi-lo)/2]."""
    b = _check(b)
    lo, hi = check_bounds(lo, hi, "value bounds")
    h = (hi - lo) / 2.0
    return _bounded_sum(b, -h, h, b.max_rows_per_partition)


def mean(b: ContributionBounds, lo: float, hi: float) -> dict[str, Sensitivity]:
    """A DP mean is mid + noisy normalized_sum / noisy count; both are released (and charged)."""
    return {"normalized_sum": normalized_sum(b, lo, hi), "count": count(b)}


def variance(b: ContributionBounds, lo: float, hi: float) -> dict[str, Sensitivity]:
    """var = E[(v-mid)²] - E[v-mid]², with E[(v-mid)²] = H²/2 + nss/count and E[v-mid] = nsum/count.

    ``normalized_sum_of_squares`` sums (v - mid)² - H²/2, H = (hi - lo)/2, each term in [-H²/2, H²/2].
    """
    b = _check(b)
    lo, hi = check_bounds(lo, hi, "value bounds")
    h = (hi - lo) / 2.0
    return {
        "normalized_sum": normalized_sum(b, lo, hi),
        "normalized_sum_of_squares": _bounded_sum(b, -h * h / 2.0, h * h / 2.0, b.max_rows_per_partition),
        "count": count(b),
    }


def quantile_utility(b: ContributionBounds) -> float:
    """Sensitivity, within one partition, of the rank utility u(x) = -|rank(x) - q·n| of the exponential mechanism.

    rank(x) counts values below x. Adding k <= Linf rows raises rank by j in 0..k and
    q·n by q·k, so u moves by at most |j - q·k| <= max(q, 1-q)·k <= Linf. Replacing k1
    rows by k2 (both <= Linf) moves it by at most (1-q)·k2 + q·k1 <= Linf. So Linf for
    both adjacencies. A unit touches up to L0 partitions (2·L0 under general replace):
    the caller composes the per-partition selections over those (e.g. eps/L0 each).
    """
    b = _check(b)
    return float(b.max_rows_per_partition)


__all__ = [
    "ADJACENCIES",
    "ContributionBounds",
    "Sensitivity",
    "count",
    "mean",
    "normalized_sum",
    "quantile_utility",
    "sum_",
    "unit_count",
    "variance",
]
