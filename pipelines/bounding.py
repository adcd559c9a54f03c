"""Contribution bounding and per-partition pre-aggregation of one bucket, vectorised with numpy.

All rows of a unit are in the same bucket (bucket = hash(unit) mod B), so the
bounds can be enforced exactly here:

1. Linf: within each (unit, partition) keep the ``linf`` rows with the smallest
   random priority: a uniformly random subset of min(Linf, rows) rows;
2. L0: each unit keeps the ``l0`` (unit, partition) pairs with the smallest
   random pair priority: a uniformly random subset of its partitions;
3. clamp values to each metric's bounds, then sum per partition.

Priorities are uint64 words drawn from the run's randomness source when the row
is read (stream labelled with file, row group and batch), so they do not depend
on the order in which a runner delivers batches to a bucket: the same input and
key give the same kept rows on every runner. They are i.i.d. uniform across rows,
which is also what the privacy argument needs (each unit's choice is independent
of every other unit's presence). A tie (probability ~g^2/2^64, or ~g^2/2^32 for a
unit's g pairs) is broken by the sort order: it biases the choice, never the bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

# Accumulator kinds over clamped values x in [lo, hi], mid = (lo+hi)/2, h = (hi-lo)/2:
#   "sum":   x                      (sum metric)
#   "nsum":  x - mid                (mean, variance: |term| <= h)
#   "nsq":   (x - mid)^2 - h^2/2    (variance: centred squares, |term| <= h^2/2)
SUM_KINDS = ("sum", "nsum", "nsq")


@dataclass(frozen=True)
class AggregationSpec:
    """What to accumulate per partition (derived from the release plan; picklable)."""

    l0: int
    linf: int
    sums: tuple[tuple[str, str, float, float, str], ...] = ()  # (accumulator, column, lo, hi, kind)
    hists: tuple[tuple[str, str, float, float, int], ...] = ()  # (accumulator, column, lo, hi, n_bins)
    cats: tuple[tuple[str, str, int], ...] = ()  # (accumulator, column, domain size)


def bound_contributions(u: np.ndarray, p: np.ndarray, prio: np.ndarray, l0: int, linf: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """Rows kept under L0 / Linf. Returns (kept row indices, partition of each kept (unit, partition)
    pair, internal counters).

    ``prio`` is one uniform uint64 per row drawn when the row was read (see module doc): its
    value orders the rows of a (unit, partition) pair (Linf), and the low 32 bits of each pair's
    first row -- independent of the ordering -- order the pairs of a unit (L0).
    """
    n = len(u)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.uint64), {"rows_dropped_linf": 0, "pairs_dropped_l0": 0}
    # One argsort instead of a 3-key lexsort: dense pair codes in the high bits, the priority's
    # high bits below them (pair codes need bit_length(pairs) <= 32 bits; the remaining >= 32
    # priority bits make a tie within a pair negligible).
    ucode = pd.factorize(u, sort=False)[0].astype(np.int64)
    pcode, p_uniq = pd.factorize(p, sort=False)
    pair, _ = pd.factorize(ucode * len(p_uniq) + pcode, sort=False)
    m = int(pair.max()) + 1
    shift = np.uint64(64 - max(1, m.bit_length()))
    order = np.argsort((pair.astype(np.uint64) << shift) | (prio >> np.uint64(64) - shift))
    pair_sorted = pair[order]
    new_pair = np.empty(n, bool)
    new_pair[0] = True
    np.not_equal(pair_sorted[1:], pair_sorted[:-1], out=new_pair[1:])
    pair_start = np.flatnonzero(new_pair)  # position of pair code c's first (winning) row is pair_start[c]
    pair_id = pair_sorted
    linf_ok = (np.arange(n) - pair_start[pair_id]) < linf

    # L0: order each unit's pairs by the low 32 bits of the pair's winning row (independent of
    # the high bits that chose it), keep the first l0.
    first_rows = order[pair_start]
    pair_unit = ucode[first_rows].astype(np.uint64)
    pprio = prio[first_rows] & np.uint64(0xFFFFFFFF)
    porder = np.argsort((pair_unit << np.uint64(32)) | pprio)
    pu = pair_unit[porder]
    new_unit = np.empty(m, bool)
    new_unit[0] = True
    np.not_equal(pu[1:], pu[:-1], out=new_unit[1:])
    unit_start = np.flatnonzero(new_unit)
    rank_in_unit = np.arange(m) - unit_start[np.cumsum(new_unit) - 1]
    pair_ok = np.empty(m, bool)
    pair_ok[porder] = rank_in_unit < l0
    ps = p[first_rows]

    kept = order[linf_ok & pair_ok[pair_id]]
    stats = {
        "rows_dropped_linf": int(n - np.count_nonzero(linf_ok)),
        "pairs_dropped_l0": int(m - np.count_nonzero(pair_ok)),
    }
    return kept, ps[pair_ok], stats


def aggregate_bucket(rows: dict[str, np.ndarray], spec: AggregationSpec) -> tuple[np.ndarray, dict, dict]:
    """Bound one bucket's rows and pre-aggregate them per partition.

    Returns (sorted unique partition hashes, accumulators aligned with them, internal counters).
    Accumulators: "count" and "unit_count" (int64), each sum (float64), each histogram / category
    count as a dense (partitions x bins) int64 matrix.
    """
    kept, pair_parts, stats = bound_contributions(rows["u"], rows["p"], rows["prio"], spec.l0, spec.linf)
    p = rows["p"][kept]
    parts, pidx = np.unique(p, return_inverse=True)
    n_parts = len(parts)
    acc: dict[str, np.ndarray] = {"count": np.bincount(pidx, minlength=n_parts).astype(np.int64)}
    # distinct units per partition = kept (unit, partition) pairs per partition
    acc["unit_count"] = np.bincount(np.searchsorted(parts, pair_parts), minlength=n_parts).astype(np.int64)

    clamped_cache: dict[tuple[str, float, float], np.ndarray] = {}
    clamped_rows = 0

    def clamped(col: str, lo: float, hi: float) -> np.ndarray:
        nonlocal clamped_rows
        key = (col, lo, hi)
        if key not in clamped_cache:
            v = rows[f"v:{col}"][kept]
            x = np.clip(v, lo, hi)
            clamped_rows += int(np.count_nonzero(x != v))
            clamped_cache[key] = x
        return clamped_cache[key]

    for name, col, lo, hi, kind in spec.sums:
        x = clamped(col, lo, hi)
        mid, half = (lo + hi) / 2.0, (hi - lo) / 2.0
        if kind == "sum":
            w = x
        elif kind == "nsum":
            w = x - mid
        elif kind == "nsq":
            w = (x - mid) ** 2 - half * half / 2.0
        else:  # pragma: no cover - plan builds only known kinds
            raise ValueError(kind)
        acc[name] = np.bincount(pidx, weights=w, minlength=n_parts)
    for name, col, lo, hi, n_bins in spec.hists:
        acc[name] = _histogram(pidx, n_parts, clamped(col, lo, hi), lo, hi, n_bins)
    for name, col, k in spec.cats:
        codes = rows[f"c:{col}"][kept].astype(np.int64)
        ok = codes >= 0  # values outside the declared domain do not count for top_k
        acc[name] = np.bincount(pidx[ok] * k + codes[ok], minlength=n_parts * k).reshape(n_parts, k).astype(np.int64)
    stats["rows_kept"] = int(len(kept))
    stats["values_clamped"] = clamped_rows
    return parts, acc, stats


def quantile_candidates(lo: float, hi: float, n_bins: int) -> np.ndarray:
    """The public candidate grid c_j = lo + j (hi - lo) / n_bins, j = 0..n_bins."""
    return lo + (hi - lo) * np.arange(n_bins + 1, dtype=np.float64) / n_bins


def _histogram(pidx: np.ndarray, n_parts: int, x: np.ndarray, lo: float, hi: float, n_bins: int) -> np.ndarray:
    """Counts per (partition, j) of values whose smallest candidate >= value is c_j.

    Then rank(c_j) = #values <= c_j is the running sum over j: what the quantile utility needs.
    """
    if hi > lo:
        j = np.ceil((x - lo) / (hi - lo) * n_bins).astype(np.int64)
        j = np.clip(j, 0, n_bins)
        # guard float rounding: the bin's candidate must be >= the value
        cand = quantile_candidates(lo, hi, n_bins)
        j = np.where(cand[j] < x, np.minimum(j + 1, n_bins), j)
    else:
        j = np.zeros(len(x), np.int64)
    width = n_bins + 1
    return np.bincount(pidx * width + j, minlength=n_parts * width).reshape(n_parts, width).astype(np.int64)


def merge_partials(partials: list[tuple[np.ndarray, dict]]) -> tuple[np.ndarray, dict]:
    """Sum per-bucket accumulators per partition. Callers pass partials in bucket order, so
    float sums are added in the same order on every runner (identical output under one key)."""
    if not partials:
        return np.zeros(0, np.uint64), {}
    all_parts = np.concatenate([pp for pp, _ in partials])
    parts, inv = np.unique(all_parts, return_inverse=True)
    n = len(parts)
    out: dict[str, np.ndarray] = {}
    offset = 0
    for pp, acc in partials:
        idx = inv[offset: offset + len(pp)]
        offset += len(pp)
        for name, arr in acc.items():
            if name not in out:
                out[name] = np.zeros((n,) + arr.shape[1:], dtype=arr.dtype)
            out[name][idx] += arr  # idx is unique within one partial: plain fancy-index add is exact
    return parts, out


def metric_layout(plan) -> tuple[tuple[str, ...], dict, tuple, tuple, tuple]:
    """What the plan's metrics need from each row: (value columns, top_k category domains,
    sum accumulators, quantile histograms, category accumulators). One function, used by the
    Beam pipeline's context and by the auditor's harness, so the two can never drift apart."""
    value_cols, cats, sums, hists, catspecs = [], {}, [], [], []
    for m in plan.metrics:
        if m.type in ("sum", "mean", "variance", "quantiles"):
            value_cols.append(m.column)
        if m.type == "top_k":
            cats[m.column] = m.domain
            catspecs.append((f"cat:{m.key}", m.column, len(m.domain)))
        for v in m.vectors:
            kind = v.accumulator.split(":")[0]
            if kind in ("sum", "nsum", "nsq"):
                sums.append((v.accumulator, m.column, m.bounds[0], m.bounds[1], kind))
        if m.type == "quantiles":
            hists.append((f"hist:{m.key}", m.column, m.bounds[0], m.bounds[1], m.n_bins))
    return (tuple(dict.fromkeys(value_cols)), cats, tuple(dict.fromkeys(sums)), tuple(hists), tuple(catspecs))
