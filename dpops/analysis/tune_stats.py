"""The statistics ``dpops tune`` scores, as exact functions of ranked rows: one owner for both places they are computed.

``dpops.analysis.tuning`` scores candidates from per-partition statistics only (truth and, per (L0, Linf),
bounded counts, sums, clipped sums, second moments, quantile histograms, order statistics, category counts)
and from a few unit-level counts (rows and units dropped by the L0 and by the Linf step). This module computes
them from rows the bounding has *ranked* (``rank_rows``: each row's pair rank and row rank under the run's
keyed priorities, ``pipelines.bounding.contribution_ranks``), so that:

- the driver path (a public sample read into this process) ranks all rows at once and calls
  ``partition_statistics`` and ``unit_counts`` on them;
- the Beam path (``pipelines.tuning``, a flagged private read) ranks the rows of each unit-hash bucket (whole
  units: a unit's ranks depend on its own rows only), then computes ``unit_counts`` per unit bucket (integers,
  summed) and ``partition_statistics`` per partition-hash bucket (whole partitions, rows in the read's
  order), and the driver concatenates the buckets' partitions in order of first appearance
  (``merge_partition_statistics``).

Why the two are equal bit for bit: every per-partition float is a ``np.bincount`` sum, which adds one
partition's rows in the order given; a bucket holds whole partitions with their rows in the read's order
(``pos``), so each partition's sum is the same additions in the same order. Order statistics and histograms
are exact. Partitions are then ordered by their first row, which is the order of first appearance the driver
path's codes have, so every mean over partitions adds the same numbers in the same order too.

Privacy. These are exact statistics of the rows, not differentially private. On the Beam path they are
per-partition aggregates (never rows) and reach the driver only to be scored; they are never logged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

Columns = dict[str, np.ndarray]


@dataclass(frozen=True)
class BoundNeeds:
    """What the candidates of one (L0, Linf) need of the rows that bounding keeps."""

    l0: int
    linf: int
    clipped: tuple[tuple[str, float, float], ...] = ()  # sum / mean / variance: clipped sums at (col, lo, hi)
    squares: tuple[str, ...] = ()  # variance: bounded unclipped sums of squares per column
    clipped_squares: tuple[tuple[str, float, float], ...] = ()  # variance: clipped sums of squares
    hists: tuple[tuple[str, float, float, int], ...] = ()  # quantiles: (col, lo, hi, n_bins)
    quantiles: tuple[tuple[str, float], ...] = ()  # quantiles: (col, q) order statistic of the bounded rows
    categories: tuple[tuple[str, int], ...] = ()  # top_k: (col, domain size)

    @property
    def prefix(self) -> str:
        """The key prefix of this (L0, Linf)'s statistics."""
        return bound_prefix(self.l0, self.linf)


@dataclass(frozen=True)
class StatNeeds:
    """Everything a grid's candidates read of the sample (``dpops.analysis.tuning.statistic_needs``): picklable,
    public (a function of the spec and the grid), shipped to the Beam workers."""

    value_columns: tuple[str, ...]
    l0_floor: int
    linf_floor: int
    squares: tuple[str, ...] = ()  # variance: true sums of squares
    quantiles: tuple[tuple[str, float], ...] = ()  # quantiles: true order statistic per (col, q)
    categories: tuple[tuple[str, int], ...] = ()  # top_k: true category counts
    bounds: tuple[BoundNeeds, ...] = ()


def bound_prefix(l0: int, linf: int) -> str:
    """The key prefix of the statistics at (l0, linf)."""
    return f"b{int(l0)},{int(linf)}|"


def clip_key(col: str, lo: float, hi: float) -> str:
    """The key part of a (column, bounds) pair (``repr`` of a float round-trips exactly)."""
    return f"{col}|{float(lo)!r}|{float(hi)!r}"


def q_key(col: str, q: float) -> str:
    """The key part of a (column, quantile)."""
    return f"{col}|{float(q)!r}"


# --------------------------------------------------------------------------- ranking


def rank_rows(rows: Mapping[str, np.ndarray], l0_floor: int, linf_floor: int) -> Columns:
    """``rows`` (``prepare_batch``'s columns of whole units, in the read's order, with ``pos``) with each row's
    pair rank ``pr`` and row rank ``rr`` (``pipelines.bounding.contribution_ranks``: the release's own orders,
    exact above the floors); the priorities are dropped (not needed past this point)."""
    from pipelines.bounding import contribution_ranks

    r = contribution_ranks(rows["u"], rows["p"], rows["prio"], rows["pp"], l0_floor=l0_floor, linf_floor=linf_floor)
    out = {k: v for k, v in rows.items() if k not in ("prio", "pp")}
    out["pr"] = r.pair_rank[r.pair] if len(r.pair) else np.zeros(0, np.int64)
    out["rr"] = r.row_rank
    return out


# --------------------------------------------------------------------------- unit-level counts


def unit_counts(ranked: Mapping[str, np.ndarray], needs: StatNeeds) -> dict[str, list[int]]:
    """Integer counts of ranked rows of whole units: ``rows``/``units`` ([n]) and per (L0, Linf) prefix
    [rows dropped by L0, rows dropped by Linf, units dropped by L0, units dropped by Linf] (the counters of
    ``pipelines.bounding.bound_contributions``; a unit is dropped by a step if it lost a row to it). Sums over
    disjoint sets of whole units add up to the counts of their union."""
    import pandas as pd

    n = len(ranked["u"])
    ucode, uniq = pd.factorize(ranked["u"], sort=False) if n else (np.zeros(0, np.int64), np.zeros(0))
    n_units = len(uniq)
    out: dict[str, list[int]] = {"rows": [n], "units": [n_units]}
    for b in needs.bounds:
        pair_kept = ranked["pr"] < b.l0
        lost_linf = pair_kept & (ranked["rr"] >= b.linf)
        out[b.prefix] = [
            int(n - np.count_nonzero(pair_kept)), int(np.count_nonzero(lost_linf)),
            int(np.count_nonzero(np.bincount(ucode[~pair_kept], minlength=n_units))),
            int(np.count_nonzero(np.bincount(ucode[lost_linf], minlength=n_units)))]
    return out


def add_unit_counts(a: Mapping[str, list[int]], b: Mapping[str, list[int]]) -> dict[str, list[int]]:
    """Two ``unit_counts`` of disjoint units added (integers: any order gives the same sum)."""
    if set(a) != set(b):
        raise ValueError("tune unit counts of two buckets have different fields")  # no data in the text
    return {k: [int(x) + int(y) for x, y in zip(a[k], b[k], strict=True)] for k in a}


def empty_unit_counts(needs: StatNeeds) -> dict[str, list[int]]:
    """The counts of no rows."""
    return {"rows": [0], "units": [0], **{b.prefix: [0, 0, 0, 0] for b in needs.bounds}}


# --------------------------------------------------------------------------- per-partition statistics


def _kth(v: np.ndarray, pidx: np.ndarray, counts: np.ndarray, q: float) -> np.ndarray:
    """Per partition: the value of rank ceil(q n) - 1 among its rows (the inverted CDF); NaN where n = 0."""
    n = len(counts)
    out = np.full(n, np.nan)
    if not len(v):
        return out
    order = np.lexsort((v, pidx))
    c = counts.astype(np.int64)
    start = np.r_[0, np.cumsum(c)[:-1]]
    k = np.clip(np.ceil(q * c).astype(np.int64) - 1, 0, np.maximum(c - 1, 0))
    has = c > 0
    out[has] = v[order[(start + k)[has]]]
    return out


def partition_statistics(ranked: Mapping[str, np.ndarray], needs: StatNeeds) -> Columns:
    """The per-partition statistics of ranked rows of whole partitions, in the read's order (module docstring).

    Keys (one value per partition, partitions in order of first appearance; ``first`` = ``pos`` of each
    partition's first row, the order the Beam path's buckets are merged in): ``count``, ``units``, ``sum|c``,
    ``sq|c``, ``q|c|q``, ``cat|c`` (n x k), and under each ``bound_prefix``: ``count``, ``units``, ``sum|c``,
    ``csum|c|lo|hi``, ``sq|c``, ``csq|c|lo|hi``, ``hist|c|lo|hi|nb`` (n x (nb + 1)), ``q|c|q``, ``cat|c``.
    Every float sum is ``np.bincount`` (adds a partition's rows in the given order)."""
    import pandas as pd

    from pipelines.bounding import quantile_bins

    p = ranked["p"]
    n_rows = len(p)
    pidx, uniq_p = pd.factorize(p, sort=False) if n_rows else (np.zeros(0, np.int64), np.zeros(0))
    pidx = np.asarray(pidx, dtype=np.int64)
    n = len(uniq_p)
    ucode = pd.factorize(ranked["u"], sort=False)[0] if n_rows else np.zeros(0, np.int64)
    pair = pd.factorize(ucode.astype(np.int64) * max(n, 1) + pidx, sort=False)[0] if n_rows else np.zeros(0, np.int64)
    m = int(pair.max()) + 1 if n_rows else 0
    first_row = np.empty(m, np.int64)
    first_row[pair[::-1]] = np.arange(n_rows - 1, -1, -1)
    pair_part = pidx[first_row]
    pfirst = np.empty(n, np.int64)
    pfirst[pidx[::-1]] = np.arange(n_rows - 1, -1, -1)
    out: Columns = {"first": np.asarray(ranked["pos"], dtype=np.int64)[pfirst]}
    count = np.bincount(pidx, minlength=n).astype(np.float64)
    out["count"] = count
    out["units"] = np.bincount(pair_part, minlength=n).astype(np.float64)
    for c in needs.value_columns:
        out[f"sum|{c}"] = np.bincount(pidx, weights=ranked[f"v:{c}"], minlength=n)
    for c in needs.squares:
        v = ranked[f"v:{c}"]
        out[f"sq|{c}"] = np.bincount(pidx, weights=v * v, minlength=n)
    for c, q in needs.quantiles:
        out[f"q|{q_key(c, q)}"] = _kth(ranked[f"v:{c}"], pidx, count, q)
    for c, k in needs.categories:
        out[f"cat|{c}"] = _category_counts(pidx, ranked[f"c:{c}"], n, k)
    for b in needs.bounds:
        pre = b.prefix
        pair_kept_row = ranked["pr"] < b.l0
        keep = np.flatnonzero(pair_kept_row & (ranked["rr"] < b.linf))
        kp = pidx[keep]
        bcount = np.bincount(kp, minlength=n).astype(np.float64)
        out[pre + "count"] = bcount
        out[pre + "units"] = np.bincount(pair_part[pair_kept_row[first_row]], minlength=n).astype(np.float64)
        kept_v = {c: ranked[f"v:{c}"][keep] for c in needs.value_columns}
        for c in needs.value_columns:
            out[f"{pre}sum|{c}"] = np.bincount(kp, weights=kept_v[c], minlength=n)
        for c, lo, hi in b.clipped:
            out[f"{pre}csum|{clip_key(c, lo, hi)}"] = np.bincount(kp, weights=np.clip(kept_v[c], lo, hi), minlength=n)
        for c in b.squares:
            out[f"{pre}sq|{c}"] = np.bincount(kp, weights=kept_v[c] ** 2, minlength=n)
        for c, lo, hi in b.clipped_squares:
            out[f"{pre}csq|{clip_key(c, lo, hi)}"] = np.bincount(kp, weights=np.clip(kept_v[c], lo, hi) ** 2,
                                                               minlength=n)
        for c, lo, hi, nb in b.hists:
            j = quantile_bins(np.clip(kept_v[c], lo, hi), lo, hi, nb)
            out[f"{pre}hist|{clip_key(c, lo, hi)}|{int(nb)}"] = np.bincount(
                kp * (nb + 1) + j, minlength=n * (nb + 1)).reshape(n, nb + 1)
        for c, q in b.quantiles:
            out[f"{pre}q|{q_key(c, q)}"] = _kth(kept_v[c], kp, bcount, q)
        for c, k in b.categories:
            out[f"{pre}cat|{c}"] = _category_counts(kp, ranked[f"c:{c}"][keep], n, k)
    return out


def _category_counts(pidx: np.ndarray, codes: np.ndarray, n: int, k: int) -> np.ndarray:
    """Per partition and category code: rows (codes < 0, values outside the declared domain, not counted)."""
    c = np.asarray(codes, dtype=np.int64)
    ok = c >= 0
    return np.bincount(pidx[ok] * k + c[ok], minlength=n * k).reshape(n, k)


def merge_partition_statistics(parts: Iterable[Columns]) -> Columns:
    """The statistics of disjoint sets of whole partitions as one: partitions ordered by their first row
    (``first``: the read's position), which is the driver path's order of first appearance."""
    parts = [x for x in parts if len(x["first"])]
    if not parts:
        raise ValueError("no partition statistics to merge")
    keys = list(parts[0])
    if any(list(x) != keys for x in parts):
        raise ValueError("tune partition statistics of two buckets have different fields")  # no data in the text
    cat = {k: np.concatenate([x[k] for x in parts]) for k in keys}
    order = np.argsort(cat["first"], kind="stable")
    return {k: v[order] for k, v in cat.items()}


def statistic_names(needs: StatNeeds) -> Sequence[str]:
    """The keys ``partition_statistics`` returns for ``needs`` (a check that a document is complete)."""
    empty: Columns = {"u": np.zeros(0, np.uint64), "p": np.zeros(0, np.uint64), "pos": np.zeros(0, np.int64),
             "pr": np.zeros(0, np.int64), "rr": np.zeros(0, np.int32),
             **{f"v:{c}": np.zeros(0) for c in needs.value_columns},
             **{f"c:{c}": np.zeros(0, np.int32) for c, _ in
                (*needs.categories, *(x for b in needs.bounds for x in b.categories))}}
    return list(partition_statistics(empty, needs))


__all__ = ["BoundNeeds", "StatNeeds", "add_unit_counts", "bound_prefix", "clip_key", "empty_unit_counts",
           "merge_partition_statistics", "partition_statistics", "q_key", "rank_rows", "statistic_names",
           "unit_counts"]
