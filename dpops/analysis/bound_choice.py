"""Bounds that minimise the release's predicted error (issue 26 item 3): histograms, their noise, the objective.

``dpops estimate --method error/1`` chooses L0, Linf and the value bounds of a release with PUBLIC partitions
jointly, by the error the release itself would have at its own epsilon: for every candidate the noise the
release's plan would draw (``dpops.release_plan.plan_release``, the one owner of sensitivity and
calibration, through ``dpops.analysis.accuracy``) is traded against the rows that candidate drops or
clips, counted in ROWS (not pairs). The quantile rule it replaces (``quantile/1``: keep 99% of each item
whole, whatever the release's epsilon) chose L0 = 4 and Linf = 38 on heavy-tailed data, raising a count's
noise std from 56.6 to 860.

This module is pure: numpy in, numbers out, no reading and no ledger. ``dpops.analysis.estimate`` builds the
exact histograms from the interval's bounded-for-nothing rows, noises them with the release's own noise
path and calls ``choose``; the benchmark (``benchmarks/bench_bound_regret.py``) and the tests call the same
functions.

The histograms (what is charged)
--------------------------------

Every histogram weighs each privacy unit's items so that ONE UNIT'S WEIGHTS SUM TO AT MOST S = 2**20
(integer weights, floored): adding or removing a unit moves the histogram by at most S in L1, replacing it by
at most 2 S, whatever the unit's number of rows or partitions. That is what bounds the sensitivity without
any contribution bound, and why the weights are fractions of the unit's own totals:

- ``units``: per k = 1..P (P public partitions), S for each unit with exactly k partitions (its one item).
- ``pairs``: per (coarse k bin A, row bin b), floor(S / k_u) for each of unit u's (unit, partition) pairs
  with r rows in bin b, u's k_u in A. A unit's pairs sum to k_u floor(S / k_u) <= S.
- ``partitions``: per (coarse k bin A, public partition p), floor(S / k_u) for each of u's pairs in p, u's k_u
  in A (sum <= S): where the pairs of units with few and with many partitions fall, so the objective knows
  each partition's share of what a bound drops (units with many partitions spread over more of them).
- ``values:<col>``: per value bin, floor(S / R_u) for each of u's rows with its value there (sum <= S).

Why the sensitivity holds: a unit's weights are functions of its OWN rows only (its k_u, R_u and r_up), so
adding, removing or replacing one unit leaves every other unit's weights unchanged; the histogram changes by
the unit's own weights, at most S in L1 (add/remove), or by one unit's weights out and another's in, at most
2 S (replace). Rows outside the public partitions never reach the histograms (the release's reader drops
them, a function of the row alone). Each histogram gets discrete Laplace noise of L1 sensitivity S
(add/remove) or 2 S (replace) at its share of the estimation's epsilon (``HISTOGRAM_WEIGHTS``, public), drawn
by the release's own ``dpops.noise.mechanisms.laplace_mechanism`` and ``add_noise``: each histogram is
epsilon_i-DP, and the shares sum to the estimation's epsilon (basic composition of pure-DP events; the
ledger's accountant composes the recorded events).

The joint (k, r) histogram is what makes the rows dropped by a JOINT (L0, Linf) choice computable: per unit
the expected kept rows are min(1, L0/k_u) sum_p min(r_up, Linf) (the release keeps L0 of a unit's partitions
uniformly at random, then Linf rows of each), and weighting each pair by 1/k_u makes min(k, L0) times the
pair-weighted histogram exactly that sum. ``units`` refines k inside a coarse bin (within a bin, the
rows-per-pair profile is assumed not to depend on the exact k).

The choice (post-processing: no extra charge)
---------------------------------------------

``choose`` reads only the noisy histograms and public parameters (the spec, the candidate grids), so it
is post-processing of DP outputs and charges nothing more. Per metric and candidate c it predicts the
release's mean squared error over its P public partitions, E(released_p - true_p)^2 = noise variance +
bias_p^2, averaged over p. Per coarse k bin A the histograms give the pairs, the rows and the expected kept
rows K_A(c); ``partitions`` gives where bin A's pairs fall (profile prof_A, rows following pairs within a
bin), so partition p keeps K_p(c) = sum_A prof_A[p] K_A(c) of its N_p rows. Values are taken not to depend on
how many rows or partitions a unit has.

- count: sigma(c)^2 + mean_p (N_p - K_p)^2;
- unit_count: the same with the (unit, partition) pairs L0 drops in p;
- sum: bias_p = -(N_p - K_p) vbar - K_p (c_hi - c_lo), with c_hi = E(v - hi)+ and c_lo = E(lo - v)+ per row;
- mean: (sigma_nsum^2 + d^2 sigma_count^2) mean_p(1 / K_p^2) + (c_hi - c_lo)^2 +
  var_clip mean_p(1/K_p - 1/N_p): the first-order mean error at K_p rows
  (``accuracy.mean_std_first_order``), the clipping bias, and the sampling error of keeping a random subset
  of the partition's rows (random drops do not bias a mean, but they move it).

The noise stds come from the release's own plan at the candidate (L0, Linf) and the declared (or fallback)
value bounds, scaled linearly to the candidate value bound (the sensitivity is linear in it; the lattice
rounding makes this exact to the lattice step). A spec with several metrics minimises the sum over metrics
of MSE_m(c) / min_c MSE_m(c), so every metric counts in its own units. Noisy histogram cells are clamped at
0 and cells below the noise's level (where a noise-only cell survives with probability
``FALSE_CELL_RATE`` over the histogram's cells, b ln(cells / 0.05)) are zeroed before use: empty cells far in
the value grid's tail would otherwise be multiplied by values up to 2^40. The price is a tail lighter than the
data's where its cells hold less than that mass: the objective then sees less clipping than there is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dpops.errors import DpopsError, InvalidParameter

if TYPE_CHECKING:
    from dpops.noise.randomness import RandomSource
    from dpops.release_plan import ReleasePlan
    from dpops.spec import ReleaseSpec

METHOD = "error/1"  # EstimateConfig.method of this rule (recorded in the manifest's estimation.config)
HISTOGRAM_MECHANISM = "estimate/noisy_histogram"
WEIGHT_BITS = 20
WEIGHT_SCALE = 1 << WEIGHT_BITS  # S: one unit's weights sum to at most S in every histogram
FALSE_CELL_RATE = 0.05  # a histogram whose cells are all empty keeps a noise-only cell with probability <= this
EXACT_ROWS = 16  # rows per pair: exact bins 1..16, then the contribution grid and quarter octaves to 2**16
COUNT_TYPES = ("count", "unit_count", "sum", "mean")


# --------------------------------------------------------------------------- public bins


def row_edges(linf_grid: np.ndarray) -> np.ndarray:
    """Upper edges of the rows-per-pair bins: 1..16 and every Linf candidate; pairs with more rows than the
    largest candidate fall in its bin (``_bin_index``).

    Every Linf candidate is an edge, so min(r, Linf) is exact for every bin above it. The rows of pairs beyond
    the largest candidate are counted as that candidate's: they are dropped by every candidate alike, and a
    bin reaching further would multiply its noise by rows it cannot see. Public."""
    top = int(max(linf_grid))
    e = {x for x in range(1, EXACT_ROWS + 1) if x <= top} | {int(x) for x in linf_grid}
    return np.asarray(sorted(e), dtype=np.int64)


def coarse_k_edges(n_partitions: int) -> np.ndarray:
    """Upper edges of the coarse partitions-per-unit bins of ``pairs``: 1, 2, 4, 8, ... up to P. Public."""
    e = [1]
    while e[-1] < n_partitions:
        e.append(min(2 * e[-1], int(n_partitions)))
    return np.asarray(e, dtype=np.int64)


def _bin_index(x: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Bin a holds (edges[a-1], edges[a]]; values above the last edge go to the last bin."""
    return np.minimum(np.searchsorted(edges, x, side="left"), edges.size - 1)


def _integer_midpoints(edges: np.ndarray) -> np.ndarray:
    lower = np.concatenate([[1], edges[:-1] + 1]).astype(np.float64)
    return (lower + edges.astype(np.float64)) / 2.0


def _value_midpoints(grid: np.ndarray) -> np.ndarray:
    """Representative of value bin j = (grid[j-1], grid[j]] (bin 0: at or below grid[0]; the last bin holds
    everything above grid[-1] and is represented by its lower edge)."""
    mid = np.empty(grid.size + 1)
    mid[0] = grid[0]
    mid[1:-1] = (grid[:-1] + grid[1:]) / 2.0
    mid[-1] = grid[-1]
    return mid


# --------------------------------------------------------------------------- histograms


@dataclass(frozen=True)
class BoundHistograms:
    """The estimation's histograms (exact, or noisy: then a DP output and public). Integer weights; divide by
    ``scale`` for unit mass. ``noise_scale``: the Laplace scale (weight units) each was noised with, 0 when
    exact. Absent histograms (contribution not estimated, no value column) are None / missing."""

    scale: int
    n_partitions: int
    k_edges: np.ndarray  # coarse bins of ``pairs``
    r_edges: np.ndarray
    v_grid: np.ndarray
    units: np.ndarray | None  # (P,) per k = 1..P
    pairs: np.ndarray | None  # (len(k_edges), len(r_edges))
    partitions: np.ndarray  # (len(k_edges), P)
    values: dict[str, np.ndarray] = field(default_factory=dict)  # (len(v_grid) + 1,) per column
    noise_scale: dict[str, float] = field(default_factory=dict)

    def names(self) -> list[str]:
        """The histograms present, in the order they are noised and charged."""
        out = [n for n in ("units", "pairs") if getattr(self, n) is not None]
        return [*out, "partitions", *(f"values:{c}" for c in self.values)]

    def get(self, name: str) -> np.ndarray:
        """One histogram by name (``names``)."""
        if name.startswith("values:"):
            return self.values[name.split(":", 1)[1]]
        h = getattr(self, name)
        assert h is not None
        return np.asarray(h)

    def cells(self, name: str) -> int:
        """Number of cells of one histogram (recorded as the mechanism's ``candidates``)."""
        return int(self.get(name).size)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the manifest's ``estimation.histograms``): the noisy integer weights and the public bins."""
        return {"scale": self.scale, "n_partitions": self.n_partitions,
                "k_edges": [int(x) for x in self.k_edges], "r_edges": [int(x) for x in self.r_edges],
                "histograms": {n: np.asarray(self.get(n), dtype=np.int64).tolist() for n in self.names()},
                "noise_scale": {k: float(v) for k, v in sorted(self.noise_scale.items())}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], v_grid: np.ndarray) -> BoundHistograms:
        """Inverse of ``to_dict`` (the value grid is public and not recorded)."""
        h = d["histograms"]
        return cls(int(d["scale"]), int(d["n_partitions"]), np.asarray(d["k_edges"], np.int64),
                   np.asarray(d["r_edges"], np.int64), v_grid,
                   None if "units" not in h else np.asarray(h["units"], np.int64),
                   None if "pairs" not in h else np.asarray(h["pairs"], np.int64),
                   np.asarray(h["partitions"], np.int64),
                   {k.split(":", 1)[1]: np.asarray(v, np.int64) for k, v in h.items() if k.startswith("values:")},
                   {str(k): float(v) for k, v in d.get("noise_scale", {}).items()})


def exact_histograms(ucode: np.ndarray, pcode: np.ndarray, values: Mapping[str, np.ndarray], *, n_partitions: int,
                     linf_grid: np.ndarray, v_grid: np.ndarray, names: Sequence[str]) -> BoundHistograms:
    """The histograms ``names`` (``units``, ``pairs``, ``partitions``, ``values:<col>``; what
    ``dpops.analysis.estimate.error_histogram_names`` asks for) of the module docstring, from the rows:
    ``ucode`` (dense unit code per row), ``pcode`` (the row's public partition, 0..P-1), ``values`` (per
    estimated column, one value per row).

    Weights are integers and one unit's weights sum to at most ``WEIGHT_SCALE`` in each histogram (the
    sensitivity argument of the module docstring)."""
    S = WEIGHT_SCALE
    P = int(n_partitions)
    u = np.asarray(ucode, dtype=np.int64)
    p = np.asarray(pcode, dtype=np.int64)
    if u.size and (p.min() < 0 or p.max() >= P):
        raise InvalidParameter("exact_histograms: partition codes must be in [0, n_partitions)")
    n_units = int(u.max()) + 1 if u.size else 0
    rows_per_unit = np.bincount(u, minlength=n_units).astype(np.int64)
    w_row = np.where(rows_per_unit > 0, S // np.maximum(rows_per_unit, 1), 0)[u]  # floor(S / R_u) per row
    vgrid = np.asarray(v_grid, dtype=np.float64)
    k_edges = coarse_k_edges(P)
    r_edges = row_edges(np.asarray(linf_grid))
    vals = {}
    for col, v in values.items():
        if f"values:{col}" not in names:
            continue
        idx = np.searchsorted(vgrid, np.asarray(v, dtype=np.float64), side="left")  # bin (g[j-1], g[j]]
        vals[col] = np.bincount(idx, weights=w_row, minlength=vgrid.size + 1).astype(np.int64)
    pk, r = np.unique(u * P + p, return_counts=True)  # the (unit, partition) pairs and their rows
    pu, pp = pk // P, pk % P
    k_u = np.bincount(pu, minlength=n_units).astype(np.int64)
    units = np.bincount(k_u[k_u > 0] - 1, minlength=P).astype(np.int64) * S
    kp = k_u[pu]
    a = _bin_index(kp, k_edges)
    b = _bin_index(r, r_edges)
    w_pair = S // np.maximum(kp, 1)  # floor(S / k_u) per pair
    pairs = np.bincount(a * r_edges.size + b, weights=w_pair,
                        minlength=k_edges.size * r_edges.size).astype(np.int64).reshape(k_edges.size, r_edges.size)
    parts = np.bincount(a * P + pp, weights=w_pair, minlength=k_edges.size * P).astype(np.int64).reshape(
        k_edges.size, P)
    return BoundHistograms(S, P, k_edges, r_edges, vgrid, units if "units" in names else None,
                           pairs if "pairs" in names else None, parts, vals)


def l1_sensitivity(adjacency: str) -> int:
    """L1 sensitivity of every histogram, in weight units: S under add/remove, 2 S under replace."""
    return WEIGHT_SCALE * (2 if adjacency == "replace" else 1)


# Public weights of the estimation's epsilon per histogram: the partition shares are large counts and need
# little; the rows-per-pair tail and the value tail decide the bounds and get more.
HISTOGRAM_WEIGHTS = {"units": 1.0, "pairs": 2.0, "partitions": 0.5, "values": 1.5}


def histogram_shares(names: Sequence[str], epsilon: float) -> dict[str, float]:
    """Each histogram's share of ``epsilon`` by ``HISTOGRAM_WEIGHTS`` (a function of public names only); the
    shares sum to ``epsilon`` (times 1 - 1e-12 against float rounding)."""
    w = {n: HISTOGRAM_WEIGHTS[n.split(":", 1)[0]] for n in names}
    total = sum(w.values())
    return {n: float(epsilon) * (1.0 - 1e-12) * v / total for n, v in w.items()}


def noisy_histograms(exact: BoundHistograms, shares: Mapping[str, float], adjacency: str,
                     rng: RandomSource) -> BoundHistograms:
    """Each histogram with discrete Laplace noise of L1 sensitivity ``l1_sensitivity(adjacency)`` at its share
    (the release's own ``laplace_mechanism`` and ``add_noise``): epsilon_i-DP each (module docstring)."""
    from dpops.noise.mechanisms import add_noise, laplace_mechanism

    sens = l1_sensitivity(adjacency)
    out: dict[str, np.ndarray] = {}
    scales: dict[str, float] = {}
    for name in exact.names():
        # a cell above 2^51 (more than 2^31 units at S = 2^20) is clipped there so the noised value stays exact
        # in a double (``add_noise`` refuses 2^52); clipping a coordinate never raises the sensitivity
        h = np.minimum(exact.get(name), np.int64(1) << 51)
        params = laplace_mechanism(float(shares[name]), float(sens), integer_valued=True, max_coords=max(1, h.size))
        out[name] = add_noise(h.reshape(-1), params, rng.child("bound_choice", name)).reshape(h.shape)
        scales[name] = float(params.scale)
    return BoundHistograms(exact.scale, exact.n_partitions, exact.k_edges, exact.r_edges, exact.v_grid,
                           out.get("units"), out.get("pairs"), out["partitions"],
                           {c: out[f"values:{c}"] for c in exact.values}, scales)


def _mass(h: BoundHistograms, name: str) -> np.ndarray:
    """Unit mass of a histogram as the objective reads it: the noisy cells denoised along their ordered axis
    (``denoise``; ``pairs`` row by row along the rows-per-pair axis). Post-processing of the DP histogram."""
    x = np.asarray(h.get(name), dtype=np.float64)
    b = float(h.noise_scale.get(name, 0.0))
    cut = name.startswith("values:")  # only the value grid's cells stand for unbounded values
    if name == "partitions":  # no order along the partitions: as drawn (``row_model`` shrinks its profiles)
        return x / float(h.scale)
    if b > 0:
        x = np.vstack([denoise(row, b, cut_tails=cut) for row in x]) if x.ndim == 2 else denoise(x, b, cut_tails=cut)
    return np.maximum(x, 0.0) / float(h.scale)


def _pava_non_increasing(y: np.ndarray) -> np.ndarray:
    """The least-squares non-increasing fit of y (pool adjacent violators)."""
    vals: list[float] = []
    sizes: list[int] = []
    for v in y.tolist():
        vals.append(float(v))
        sizes.append(1)
        while len(vals) > 1 and vals[-2] < vals[-1]:
            n = sizes[-2] + sizes[-1]
            vals[-2] = (vals[-2] * sizes[-2] + vals[-1] * sizes[-1]) / n
            sizes[-2] = n
            vals.pop()
            sizes.pop()
    return np.repeat(np.asarray(vals), np.asarray(sizes, dtype=np.int64))


def _tail_starts(tail_sums: np.ndarray, b: float, cells: int) -> np.ndarray:
    """Per position j: whether the noisy sum of the L cells from j to the end is above what L noise-only
    cells reach (a union-bound Bernstein bound for sums of Laplace(b): b max(sqrt(8 L lambda), 4 lambda),
    lambda = ln(cells / FALSE_CELL_RATE))."""
    lam = math.log(max(cells, 1) / FALSE_CELL_RATE)
    L = np.arange(tail_sums.size, 0, -1, dtype=np.float64)
    return tail_sums > b * np.maximum(np.sqrt(8.0 * L * lam), 4.0 * lam)


def denoise(x: np.ndarray, b: float, *, cut_tails: bool) -> np.ndarray:
    """A noisy histogram along an ordered axis, denoised by post-processing: a unimodal fit (non-decreasing up
    to the noisy mode, non-increasing after it: the shape of counts per partition, per row count and per value
    on a log grid), with each tail beyond the last stretch whose noisy sum is above the noise's reach set to 0.

    Why: the objective multiplies a cell by the rows or the value it stands for (up to 2^40 on the value
    grid), so noise in empty tail cells would dominate what is dropped or clipped; pooling neighbours
    averages the noise, and the tail test removes what no data supports (a true tail lighter than the
    noise's reach is lost: the objective then sees less dropped or clipped mass than there is)."""
    x = np.asarray(x, dtype=np.float64)
    if x.size <= 1:
        return np.maximum(x, 0.0)
    mode = int(np.argmax(x))
    right = _pava_non_increasing(x[mode:])
    left = _pava_non_increasing(x[: mode + 1][::-1])[::-1]
    fit = np.concatenate([left[:-1], right])
    up = _tail_starts(np.cumsum(x[::-1])[::-1], b, x.size)  # tail to the right of each j
    if not cut_tails:
        return np.maximum(fit, 0.0)
    down = _tail_starts(np.cumsum(x)[::-1], b, x.size)[::-1]  # the tail to the left of each j, ending there
    last = max(mode, int(np.flatnonzero(up)[-1]) if up.any() else mode)
    first = min(mode, int(np.flatnonzero(down)[0]) if down.any() else mode)
    fit[last + 1:] = _geometric_tail(x[mode:], last - mode, fit[last])
    fit[:first] = _geometric_tail(x[: mode + 1][::-1], mode - first, fit[first])[::-1][: first]
    return np.maximum(fit, 0.0)


TAIL_RATIO_MAX = 0.8  # per value-grid step (2^(1/4)): a power-law tail of index 1.29; the mean stays finite


def _geometric_tail(side: np.ndarray, last: int, at_last: float) -> np.ndarray:
    """The cells of ``side`` (from the mode outwards) beyond index ``last`` (the last significant one),
    continued from ``at_last`` at the geometric rate of the noisy tail sums: T(j) = sum of the cells from j on
    is unbiased, and a power-law tail on a log grid has T(j + d) / T(j) = ratio^d; measured between the middle
    of the significant stretch and its end, at most ``TAIL_RATIO_MAX``. A tail the noise hides is extrapolated,
    not dropped: dropping it would make the objective see no clipping above the noise's reach and choose
    bounds that clip the real tail."""
    n = side.size - last - 1
    if n <= 0:
        return np.zeros(0)
    if last < 1 or at_last <= 0:
        return np.zeros(n)
    tails = np.cumsum(side[::-1])[::-1]
    j1 = last // 2
    t1, t2 = float(tails[j1]), float(tails[last])
    ratio = (t2 / t1) ** (1.0 / (last - j1)) if t1 > 0 and t2 > 0 else 0.0
    ratio = min(TAIL_RATIO_MAX, ratio)
    return at_last * ratio ** np.arange(1, n + 1, dtype=np.float64)


# --------------------------------------------------------------------------- what the histograms say


@dataclass(frozen=True)
class RowModel:
    """What the objective needs, read off the (noisy) histograms, per candidate and per public partition: rows
    kept and dropped, pairs dropped, per-row value moments. All post-processing."""

    rows: float  # N
    kept_rows: np.ndarray  # (len(l0), len(linf)) K(L0, Linf), all partitions
    rows_a: np.ndarray  # (A,) rows of the units of each coarse k bin
    kept_a: np.ndarray  # (len(l0), len(linf), A) their expected kept rows
    pairs_dropped_a: np.ndarray  # (len(l0), A) their (unit, partition) pairs L0 drops
    profiles: np.ndarray  # (A, P) where each bin's pairs fall (rows sum to 1)
    value_mean: dict[str, float]
    clip_hi: dict[str, np.ndarray]  # per candidate upper bound (value grid): E(v - hi)+ per row
    clip_lo: dict[str, np.ndarray]  # per candidate lower bound: E(lo - v)+ per row
    value_bins: dict[str, np.ndarray]  # per column: the value distribution per row (sums to 1), on the grid's bins


def _partition_profiles(h: BoundHistograms) -> np.ndarray:
    """(A, P): where the pairs of each coarse k bin fall, each row summing to 1. A row with little mass is
    shrunk toward the overall profile by the noise's own mass (b P): post-processing that keeps a noisy, nearly
    empty bin from giving one partition all of its drops."""
    H = _mass(h, "partitions")
    P = h.n_partitions
    b = float(h.noise_scale.get("partitions", 0.0)) / float(h.scale)
    Hc = np.maximum(H, 0.0)
    tot = Hc.sum(axis=0)
    overall = tot / tot.sum() if tot.sum() > 0 else np.full(P, 1.0 / P)
    overall = np.maximum(overall, 1.0 / (10.0 * P))  # a partition the noise left empty still holds some rows
    overall = overall / overall.sum()
    lam = b * P
    w = Hc.sum(axis=1, keepdims=True)
    prof = (Hc + lam * overall[None, :]) / np.maximum(w + lam, 1e-300)
    prof = np.where(w + lam > 0, prof, overall[None, :])
    prof = np.maximum(prof, overall[None, :] / 10.0)
    return prof / prof.sum(axis=1, keepdims=True)


def row_model(h: BoundHistograms, l0: np.ndarray, linf: np.ndarray) -> RowModel:
    """``RowModel`` at candidate grids ``l0`` x ``linf`` (module docstring). Without ``units`` (contribution bounds
    not estimated) nothing is taken as dropped, without ``pairs`` (no count, sum or mean) no row."""
    P = h.n_partitions
    l0 = np.asarray(l0, dtype=np.float64)
    linf = np.asarray(linf, dtype=np.float64)
    prof = _partition_profiles(h)  # (A, P)
    A = h.k_edges.size
    a_of_k = _bin_index(np.arange(1, P + 1), h.k_edges)
    onehot = np.zeros((P, A))
    onehot[np.arange(P), a_of_k] = 1.0  # k = 1..P -> its coarse bin
    if h.units is not None:
        U = _mass(h, "units")  # per k = 1..P
        k = np.arange(1, P + 1, dtype=np.float64)
        kept_k = np.minimum(k[None, :], l0[:, None]) * U[None, :]  # (len(l0), P) pairs kept per k
        pairs_a = (U * k) @ onehot  # (A,)
        kept_pairs_a = kept_k @ onehot  # (len(l0), A)
    else:
        pairs_a = np.maximum(_mass(h, "partitions").sum(axis=1), 0.0)
        kept_pairs_a = np.broadcast_to(pairs_a, (l0.size, A))
    if h.units is not None and h.pairs is not None:
        H = _mass(h, "pairs")
        r_mid = _integer_midpoints(h.r_edges)
        w_all = H.sum(axis=0)
        prof_all = w_all / w_all.sum() if w_all.sum() > 0 else np.eye(1, r_mid.size)[0]
        w = H.sum(axis=1, keepdims=True)
        rprof = np.where(w > 0, H / np.where(w > 0, w, 1.0), prof_all[None, :])  # rows-per-pair profile per bin
        kept_per_pair = rprof @ np.minimum(r_mid[:, None], linf[None, :])  # (A, len(linf))
        rows_per_pair = rprof @ r_mid  # (A,)
    else:  # rows are not dropped by any candidate: one row per pair is as good as any count for the shares
        kept_per_pair = np.ones((A, linf.size))
        rows_per_pair = np.ones(A)
    rows_a = pairs_a * rows_per_pair  # (A,)
    kept_a = kept_pairs_a[:, None, :] * kept_per_pair.T[None, :, :]  # (len(l0), len(linf), A)
    vmean: dict[str, float] = {}
    chi: dict[str, np.ndarray] = {}
    clo: dict[str, np.ndarray] = {}
    qs: dict[str, np.ndarray] = {}
    mids = _value_midpoints(h.v_grid)
    for col in h.values:
        m = _mass(h, f"values:{col}")
        tot_v = m.sum()
        q = m / tot_v if tot_v > 0 else np.zeros_like(m)
        vmean[col] = float(q @ mids)
        chi[col] = np.maximum(mids[None, :] - h.v_grid[:, None], 0.0) @ q
        clo[col] = np.maximum(h.v_grid[:, None] - mids[None, :], 0.0) @ q
        qs[col] = q
    return RowModel(float(rows_a.sum()), kept_a.sum(axis=2), rows_a, kept_a, pairs_a[None, :] - kept_pairs_a, prof,
                    vmean, chi, clo, qs)


_CHUNK_CELLS = 1 << 22  # (L0, Linf, partition) cells per chunk of the per-partition means: bounded memory


@dataclass(frozen=True)
class PartitionMoments:
    """Means over the public partitions of what the objective needs, per (L0, Linf) (``partition_moments``)."""

    drop2: np.ndarray  # mean_p (N_p - K_p)^2
    drop_kept: np.ndarray  # mean_p (N_p - K_p) K_p
    kept2: np.ndarray  # mean_p K_p^2
    inv_kept2: np.ndarray  # mean_p 1 / max(K_p, 1)^2
    sampling: np.ndarray  # mean_p max(1 / max(K_p, 1) - 1 / N_p, 0)
    pairs_drop2: np.ndarray  # (len(l0),) mean_p (pairs L0 drops in p)^2


def partition_moments(model: RowModel) -> PartitionMoments:
    """The per-partition means of the module docstring, with partition p keeping K_p = sum_A prof_A[p] K_A of
    its N_p = sum_A prof_A[p] N_A rows; computed over chunks of partitions so that a release with many public
    partitions never holds all (L0, Linf, partition) cells at once (this runs after the charge)."""
    L, M, _ = model.kept_a.shape
    P = model.profiles.shape[1]
    step = max(1, _CHUNK_CELLS // max(1, L * M))
    acc = {k: np.zeros((L, M)) for k in ("drop2", "drop_kept", "kept2", "inv_kept2", "sampling")}
    pairs2 = np.zeros(L)
    for a in range(0, P, step):
        prof = model.profiles[:, a:a + step]
        n_p = model.rows_a @ prof  # (chunk,)
        k_p = model.kept_a @ prof  # (L, M, chunk)
        d_p = np.maximum(n_p[None, None, :] - k_p, 0.0)
        kn = np.maximum(k_p, 1.0)
        acc["drop2"] += (d_p ** 2).sum(axis=2)
        acc["drop_kept"] += (d_p * k_p).sum(axis=2)
        acc["kept2"] += (k_p ** 2).sum(axis=2)
        acc["inv_kept2"] += (1.0 / kn ** 2).sum(axis=2)
        acc["sampling"] += np.maximum(1.0 / kn - 1.0 / np.maximum(n_p, 1e-9)[None, None, :], 0.0).sum(axis=2)
        pairs2 += ((model.pairs_dropped_a @ prof) ** 2).sum(axis=1)
    n = float(max(P, 1))
    return PartitionMoments(**{k: v / n for k, v in acc.items()}, pairs_drop2=pairs2 / n)


def clipped_variance(model: RowModel, col: str, v_grid: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per candidate pair (lo[i], hi[i]): the variance of a row's value clipped to it (post-processing)."""
    q = model.value_bins.get(col)
    if q is None:
        return np.zeros(lo.size)
    mids = _value_midpoints(v_grid)
    c = np.clip(mids[None, :], lo[:, None], hi[:, None])
    m1 = c @ q
    return np.maximum((c * c) @ q - m1 * m1, 0.0)


# --------------------------------------------------------------------------- the noise of each candidate


@dataclass(frozen=True)
class MetricNoise:
    """The release's noise stds of one metric at one (L0, Linf), at the reference value bounds."""

    std: float  # count, unit_count, sum: of the released vector; mean: of its normalized sum
    count_std: float = 0.0  # mean: of the count it divides by
    bound_scale: float = 1.0  # sum: max(|lo|, |hi|); mean: (hi - lo) / 2 of the reference bounds


_PLAN_CACHE: dict[tuple[str, int, int], dict[str, MetricNoise]] = {}
_FACTOR_CACHE: dict[str, dict[str, tuple[float, float]]] = {}


def release_noise(spec: ReleaseSpec, l0: int, linf: int) -> dict[str, MetricNoise]:
    """Per metric key, the noise the release's own plan (``plan_release``) draws at (``l0``, ``linf``) and the
    spec's value bounds (declared, or the fallback of ``bounds: estimate``). Cached per (spec hash, L0, Linf):
    the plan is a function of public parameters only.

    A spec calibrated by its accountant (``budget.accountant``, issue 26 item 1) plans in seconds, too slow for
    hundreds of candidates: its candidates are planned without the field and every std is multiplied by the
    ratio the accountant's calibration gives at the spec's own bounds (the accountant scales all Gaussian
    vectors by one common factor, which the bounds change only through lattice rounding)."""
    if getattr(spec.budget, "accountant", None) is None:
        return _planned_noise(spec, l0, linf)
    from dpops.analysis.tuning import load_patched

    plain = load_patched(spec, {"budget": {"accountant": None}})
    if spec.spec_hash not in _FACTOR_CACHE:
        c = spec.contribution
        calibrated = _planned_noise(spec, c.max_partitions_per_unit, c.max_rows_per_unit_per_partition)
        base = _planned_noise(plain, c.max_partitions_per_unit, c.max_rows_per_unit_per_partition)
        _FACTOR_CACHE[spec.spec_hash] = {
            k: (v.std / base[k].std if base[k].std > 0 else 1.0,
                v.count_std / base[k].count_std if base[k].count_std > 0 else 1.0) for k, v in calibrated.items()}
    f = _FACTOR_CACHE[spec.spec_hash]
    return {k: MetricNoise(v.std * f[k][0], v.count_std * f[k][1], v.bound_scale)
            for k, v in _planned_noise(plain, l0, linf).items()}


def _planned_noise(spec: ReleaseSpec, l0: int, linf: int) -> dict[str, MetricNoise]:
    from dpops.analysis.accuracy import mean_noise_stds
    from dpops.analysis.tuning import Candidate, candidate_spec
    from dpops.release_plan import plan_release

    key = (spec.spec_hash, int(l0), int(linf))
    if key in _PLAN_CACHE:
        return _PLAN_CACHE[key]
    out: dict[str, MetricNoise] = {}
    try:
        cspec = spec if (l0, linf) == (spec.contribution.max_partitions_per_unit,
                                       spec.contribution.max_rows_per_unit_per_partition) else \
            candidate_spec(spec, Candidate(int(l0), int(linf)))
        plan: ReleasePlan = plan_release(cspec)
    except DpopsError:  # a candidate the plan refuses (public parameters only) is never chosen; this runs
        _PLAN_CACHE[key] = out  # after the charge, so it must not fail the run
        return out
    for m in plan.metrics:
        if m.type in ("count", "unit_count"):
            out[m.key] = MetricNoise(float(m.vectors[0].params.std))
        elif m.type == "sum" and m.bounds is not None:
            out[m.key] = MetricNoise(float(m.vectors[0].params.std), 0.0, max(abs(m.bounds[0]), abs(m.bounds[1])))
        elif m.type == "mean" and m.bounds is not None:
            s_std, c_std = mean_noise_stds(plan, m)
            out[m.key] = MetricNoise(s_std, c_std, (m.bounds[1] - m.bounds[0]) / 2.0)
    if len(_PLAN_CACHE) > 20_000:
        _PLAN_CACHE.clear()
    _PLAN_CACHE[key] = out
    return out


# --------------------------------------------------------------------------- the objective


@dataclass(frozen=True)
class BoundChoice:
    """The chosen bounds and what the objective predicted for them (all post-processing of DP histograms)."""

    l0: int
    linf: int
    bounds: dict[str, tuple[float, float]]
    predicted_rmse: dict[str, float]  # per metric key
    kept_row_share: float
    clipped_per_row: dict[str, float]  # per column: E|clipping| per kept row
    method: str = METHOD

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the manifest's ``estimation.choice``)."""
        return {"method": self.method, "max_partitions_per_unit": self.l0, "max_rows_per_unit_per_partition": self.linf,
                "bounds": {c: [float(lo), float(hi)] for c, (lo, hi) in sorted(self.bounds.items())},
                "predicted_rmse": {k: float(v) for k, v in sorted(self.predicted_rmse.items())},
                "kept_row_share": float(self.kept_row_share),
                "clipped_per_row": {k: float(v) for k, v in sorted(self.clipped_per_row.items())}}


def metric_mse(spec: ReleaseSpec, model: RowModel, l0: np.ndarray, linf: np.ndarray, v_grid: np.ndarray,
               columns: Sequence[str]) -> dict[str, np.ndarray]:
    """Per metric key, the predicted mean squared error over the partitions (module docstring): an array over
    (L0 index, Linf index) for count and unit_count, over (L0 index, Linf index, candidate) with the column's
    candidates of ``value_candidates`` for sum and mean."""
    mom = partition_moments(model)
    out: dict[str, np.ndarray] = {}
    noise = {(i, j): release_noise(spec, int(a), int(b)) for i, a in enumerate(l0) for j, b in enumerate(linf)}
    declared = spec.declared_value_bounds()

    def grid_of(key: str, what: str) -> np.ndarray:
        """One noise field over the candidates (infinite where the plan refused the candidate)."""
        return np.array([[getattr(noise[(i, j)][key], what) if key in noise[(i, j)] else math.inf
                          for j in range(len(linf))] for i in range(len(l0))])

    for m in spec.metrics:
        key = m.key
        if m.type not in COUNT_TYPES:
            continue
        std = grid_of(key, "std")
        if m.type == "count":
            out[key] = std ** 2 + mom.drop2
            continue
        if m.type == "unit_count":
            out[key] = std ** 2 + mom.pairs_drop2[:, None]
            continue
        col = getattr(m, "column", None)
        if col is None or col not in declared:  # bounds: estimate (the option estimates with quantile/1)
            continue
        lo_c, hi_c = value_candidates(v_grid, declared[col], col in columns)
        scale = grid_of(key, "bound_scale")
        chi = model.clip_hi.get(col)
        clo = model.clip_lo.get(col)
        if chi is None or clo is None or col not in columns:  # not estimated: the declared bounds, no clipping known
            chi_c = np.zeros(lo_c.size)
            clo_c = np.zeros(lo_c.size)
            vbar = model.value_mean.get(col, 0.0)
        else:
            chi_c = chi[np.searchsorted(v_grid, hi_c)]
            clo_c = clo[np.searchsorted(v_grid, lo_c)] if declared[col][0] < 0 else np.zeros(lo_c.size)
            vbar = model.value_mean[col]
        net_clip = chi_c - clo_c  # per kept row, how much clipping lowers the value
        if m.type == "sum":
            # bias_p = -(drop_p vbar + kept_p net_clip): its mean square from three moments over the partitions
            dd, dk, kk = mom.drop2, mom.drop_kept, mom.kept2
            s_ = (std / scale)[:, :, None] * np.maximum(np.abs(lo_c), np.abs(hi_c))[None, None, :]
            bias2 = (vbar ** 2 * dd[:, :, None] + 2.0 * vbar * dk[:, :, None] * net_clip[None, None, :]
                     + kk[:, :, None] * (net_clip ** 2)[None, None, :])
            out[key] = s_ ** 2 + bias2
        else:
            c_std = grid_of(key, "count_std")
            half = (hi_c - lo_c) / 2.0
            s_ = (std / scale)[:, :, None] * half[None, None, :]
            d = np.clip((vbar - net_clip) - (lo_c + hi_c) / 2.0, -half, half)
            inv_n2 = mom.inv_kept2  # (L0, Linf)
            var = (s_ ** 2 + (d[None, None, :] * c_std[:, :, None]) ** 2) * inv_n2[:, :, None]
            # the kept rows are a random subset of the partition's: their clipped mean moves from all rows'
            # by the sampling variance sigma_clip^2 (1/n_kept - 1/n) (random drops move a mean, never bias it)
            samp_w = mom.sampling
            samp = clipped_variance(model, col, v_grid, lo_c, hi_c)[None, None, :] * samp_w[:, :, None]
            out[key] = var + samp + (net_clip ** 2)[None, None, :]
    return out


def value_candidates(v_grid: np.ndarray, declared: tuple[float, float], estimated: bool
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) candidate pairs of one column: the declared pair when not estimated; otherwise every grid
    point above a declared lower bound >= 0 (kept: public), or the symmetric pairs (-c, c) when the declared
    lower bound is negative."""
    lo, hi = float(declared[0]), float(declared[1])
    if not estimated:
        return np.array([lo]), np.array([hi])
    if lo >= 0:
        up = v_grid[v_grid > lo]
        if not up.size:  # a declared lower bound above the grid: nothing to choose (public, spec-only)
            return np.array([lo]), np.array([hi])
        return np.full(up.size, lo), up
    pos = v_grid[v_grid > 0]
    return -pos, pos


def choose(spec: ReleaseSpec, hist: BoundHistograms, *, l0_grid: np.ndarray, linf_grid: np.ndarray,
           columns: Sequence[str], contribution: bool) -> BoundChoice:
    """The bounds minimising the release's predicted error (module docstring), from the histograms alone.

    ``l0_grid``/``linf_grid``: the public candidates (``contribution=False`` or a record-level spec: the
    spec's own L0 and Linf); ``columns``: the bounded columns whose value bounds are chosen (the others keep
    their declared bounds). Post-processing of the histograms: no charge of its own."""
    rl = bool(spec.privacy_unit.record_level)
    if rl or not contribution:
        l0s = np.array([1 if rl else spec.contribution.max_partitions_per_unit])
        linfs = np.array([1 if rl else spec.contribution.max_rows_per_unit_per_partition])
    else:
        l0s = np.asarray([x for x in l0_grid if x <= hist.n_partitions] or [1], dtype=np.int64)
        # without ``pairs`` (unit_count only) Linf changes neither noise nor bias: the declared one stays
        linfs = np.asarray(linf_grid if hist.pairs is not None else
                           [spec.contribution.max_rows_per_unit_per_partition], dtype=np.int64)
    model = row_model(hist, l0s, linfs)
    # An MSE is a variance plus a squared bias, but float rounding of their terms can leave it a hair below 0;
    # clipped at 0 (NaN stays NaN) so the square root below never raises: this runs after the charge.
    mse = {k: np.maximum(v, 0.0) for k, v in metric_mse(spec, model, l0s, linfs, hist.v_grid, columns).items()}
    if not mse:
        raise InvalidParameter(f"estimate --method {METHOD}: {spec.source} has no count, unit_count, sum or mean "
                               "metric whose error could be minimised; use --method quantile/1")
    declared = spec.declared_value_bounds()
    col_keys: dict[str, list[str]] = {}
    for m in spec.metrics:
        col = getattr(m, "column", None)
        if m.key in mse and m.type in ("sum", "mean") and col is not None:
            col_keys.setdefault(str(col), []).append(m.key)
    norm = {k: max(float(np.min(v)), 1e-300) for k, v in mse.items()}
    total = np.zeros((l0s.size, linfs.size))
    pick: dict[str, np.ndarray] = {}
    for m in spec.metrics:
        if m.key in mse and mse[m.key].ndim == 2:
            total = total + mse[m.key] / norm[m.key]
    for col, keys in col_keys.items():
        per = sum(mse[k] / norm[k] for k in keys)  # (L0, Linf, candidates)
        assert isinstance(per, np.ndarray)
        pick[col] = np.argmin(per, axis=2)
        total = total + np.min(per, axis=2)
    total = np.where(np.isfinite(total), total, np.inf)  # NaN never wins; all infinite: the first candidate
    i, j = np.unravel_index(int(np.argmin(total)), total.shape)
    bounds: dict[str, tuple[float, float]] = {}
    clipped: dict[str, float] = {}
    for col in col_keys:
        lo_c, hi_c = value_candidates(hist.v_grid, declared[col], col in columns)
        c = int(pick[col][i, j])
        if col in columns:
            bounds[col] = (float(lo_c[c]), float(hi_c[c]))
            chi = model.clip_hi[col][np.searchsorted(hist.v_grid, hi_c[c])]
            clo = model.clip_lo[col][np.searchsorted(hist.v_grid, lo_c[c])] if declared[col][0] < 0 else 0.0
            clipped[col] = float(chi + clo)
    pred: dict[str, float] = {}
    ii, jj = int(i), int(j)
    for m in spec.metrics:
        if m.key not in mse:
            continue
        v = mse[m.key]
        at = float(v[ii, jj]) if v.ndim == 2 else float(v[ii, jj, int(pick[str(getattr(m, "column", ""))][ii, jj])])
        pred[m.key] = math.sqrt(at)
    share = float(model.kept_rows[ii, jj] / model.rows) if model.rows > 0 else 1.0
    return BoundChoice(int(l0s[ii]), int(linfs[jj]), bounds, pred, min(1.0, share), clipped)


__all__ = ["METHOD", "BoundHistograms", "BoundChoice", "RowModel", "MetricNoise", "exact_histograms",
           "noisy_histograms", "histogram_shares", "l1_sensitivity", "row_model", "release_noise", "metric_mse",
           "value_candidates", "choose", "PartitionMoments", "partition_moments", "row_edges", "coarse_k_edges",
           "WEIGHT_SCALE"]
