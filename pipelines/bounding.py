"""Contribution bounding and per-partition pre-aggregation, vectorised with numpy.

The bound is a function of each unit's own rows, applied by a streaming, mergeable combiner
(``pipelines.transforms.BoundContributions``) so that no worker ever holds more than one unit's
bounded rows per key plus one buffer:

1. L0: each unit keeps the ``l0`` (unit, partition) pairs with the smallest pair priority
   ``pair_priority(u, p, salt)``: a keyed 64-bit mix of the unit hash and the partition hash
   under a secret per-run salt drawn from the run's randomness source (ties: partition hash);
2. Linf: within each kept pair keep the ``linf`` rows with the smallest row priority (one
   uniform uint64 per row drawn when the row is read, from a stream labelled with file, row
   group and batch);
3. clamp values to each metric's bounds, then sum per partition -- exactly, in fixed point.

Mergeable, hence exact under any split (issue 10). Both orders are total orders over a unit's
own rows that do not depend on which other rows are present: the pair priority is a function of
(salt, unit, partition) only, and a row keeps its priority wherever it travels. Keeping the k
smallest of a union equals keeping the k smallest of the union of each part's k smallest, so
bound(bound(A) + bound(B)) == bound(A + B) for any split of the input into batches, bundles,
workers, keys and merge orders. (The previous rule ordered pairs by the low bits of the pair's
winning row, which changes when a merge brings a better row: not mergeable.) The pipeline
therefore pre-bounds each read batch, compacts the combiner's buffer whenever it doubles, and
bounds once more at the end, and the result is bit-identical to bounding all rows at once.

Privacy. The DP argument needs only that a unit's kept rows are chosen from that unit's rows
with randomness independent of every other unit's presence: then adding or removing one unit
changes at most L0 partitions by at most Linf rows each, which is the sensitivity charged. The
pair priority depends on the unit's hash, the partition hash and the salt only; the row
priorities are i.i.d. Uniformity (utility): given a secret uniform salt, the mixed values of a
unit's distinct pairs behave as independent uniform draws, so the kept partitions are a uniform
random subset; the kept rows of a pair are a uniform random subset of min(Linf, rows). A tie of
two row priorities within a pair (probability ~r^2/2^65 for r rows) is broken by input order: it
may make the choice depend on arrival order, never the bound.

Per-metric bounds (issue 26 item 3). A metric may have its own (L0, Linf) (``metrics[].contribution``), its L0
at most the release's. The rows are bounded ONCE, streaming, at (the release's L0, the largest Linf of any bound
set) (``aggregation_spec``), then each narrower set keeps of those rows what bounding at its own (L0, Linf) with
the SAME priorities keeps (``ContributionRanks.keep_mask``): the k smallest of the K >= k smallest are the k
smallest, so that equals bounding the raw rows at the narrower set directly, and metrics sharing a set share
its accumulators. Same priorities rather than independent ones (a choice; both are sound): each set's rows are
a function of the unit's own rows and the run's salt and row priorities only, which is all the sensitivity
argument above needs, per set; sharing them keeps one salt and one row stream (reproducible from the key or
the test seed like today), makes a metric's kept partitions a subset of the release's (so partition selection,
on the release's unit counts, covers every metric), and gives one release with two bound sets exactly the
numbers of two releases with one each (same key and label). The composition does not need the sets to be
independent: for any fixed priorities (i.i.d. uniform, whatever the data) each set's bounding is a
deterministic function of each unit's own rows, so each metric's mechanism is DP with its own sensitivity; the
noises are independent of each other and of the priorities, so for fixed priorities the metrics' events
compose as usual, and averaging over priorities that do not depend on the data keeps the guarantee. A spec
without per-metric bounds has no subsets: today's path.

Exact sums (issue 11 item 4). The noise is charged for Δ + r·m (``dpops.noise.mechanisms``): the
sensitivity Δ of the *exact* sum, plus the rounding to the noise grid r. A float64 running sum
is not that function: its rounding error depends on the order of the rows and on the other
rows' magnitudes, so one unit can move it by more than Δ (2^22 rows of 1.0, a 0.5, the
target's -1, then 2^22 rows of -2^-31: the tiny rows vanish in one neighbour and not in the
other, 1026 lattice steps against a charge of 1025), and two runners adding the same rows in
another order publish different numbers. So every sum accumulator is built in integers:

- each row's term t(x) (x for "sum", x - mid for "nsum", (x - mid)^2 - h^2/2 for "nsq", x
  already clamped) is snapped ONCE, per row, to the grid g of ``sum_unit`` as the integer
  k = rint(t/g), then clipped to [ceil(a/g), floor(b/g)], where [a, b] are the term bounds
  ``dpops.noise.sensitivity`` derives Δ from (``sum_term_bounds``: the same float expressions). So
  k·g lies in [a, b] for every row, whatever float error the term carries: the integer sum
  sum(k)·g is a sum of per-row terms in [a, b], a function whose sensitivity is exactly the Δ
  already charged. No extra charge is needed for the per-row snap; the noise step then rounds
  sum(k)·g exactly (integer arithmetic) to the noise grid r, which the +r·m term covers.
- g is a public power of two from the term bounds only: the smallest with max(|a|, |b|)/g
  <= 2^31 (``SUM_UNIT_BITS``), so |k| <= 2^31. Cost: each row moves by at most g
  (<= 2^-31 of the bound); over n rows of a partition at most n·g, against a noise std of at
  least Linf·max(|a|,|b|)·sqrt(2)/ε -- below 2^-11 of one noise std up to 2^20 rows per
  partition at ε = 1 (and in practice ~sqrt(n)·g/sqrt(12), as the errors are not aligned).
- the integer sums are exact and associative, so any row order, bundle order, chunking or
  bucket merge order gives the same bits. Within a bucket the per-partition sum is two float64
  bincounts over 16-bit limbs of k (exact while a partial sum stays below 2^53: up to 2^36
  rows, chunked beyond), recombined in int64. Partials are int64; any addition whose operands
  could reach 2^63 (``checked_add``: decided from the operands' magnitudes) is done in Python
  integers instead (dtype object), so nothing overflows and nothing aborts on the data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

# Accumulator kinds over clamped values x in [lo, hi], mid = (lo+hi)/2, h = (hi-lo)/2:
#   "sum":   x                      (sum metric)
#   "nsum":  x - mid                (mean, variance: |term| <= h)
#   "nsq":   (x - mid)^2 - h^2/2    (variance: centred squares, |term| <= h^2/2)
SUM_KINDS = ("sum", "nsum", "nsq")
SUM_UNIT_BITS = 31  # |per-row integer term| <= 2**SUM_UNIT_BITS (see the module docstring)
_LIMB_BITS = 16
_CHUNK_ROWS = 1 << 36  # rows per exact limb bincount: 2**36 * 2**16 < 2**53
_INT64_SAFE = 1 << 62  # two int64 operands each below this cannot overflow when added
_INT64_ROWS = 1 << (62 - SUM_UNIT_BITS)  # fewer rows than this: |sum| < 2**62 in int64


def sum_term_bounds(kind: str, lo: float, hi: float) -> tuple[float, float]:
    """[a, b] of the per-row term of accumulator ``kind`` over values clamped to [lo, hi].

    The same float expressions as ``dpops.noise.sensitivity`` (sum_, normalized_sum, variance), so the
    clip of the fixed-point term to [a, b] is exactly the range the charged Δ was derived from.
    """
    if kind == "sum":
        return float(lo), float(hi)
    h = (hi - lo) / 2.0
    if kind == "nsum":
        return -h, h
    if kind == "nsq":
        return -h * h / 2.0, h * h / 2.0
    raise ValueError(f"unknown sum accumulator kind {kind!r}")  # pragma: no cover - plan builds only known kinds


def sum_unit(kind: str, lo: float, hi: float) -> float:
    """The fixed-point grid g of accumulator ``kind``: the smallest power of two with
    max(|a|, |b|) / g <= 2**SUM_UNIT_BITS. Public (declared bounds only)."""
    a, b = sum_term_bounds(kind, lo, hi)
    big = max(abs(a), abs(b))
    if big == 0.0 or not math.isfinite(big):
        return 1.0
    f, e = math.frexp(big)  # big = f * 2**e, f in [0.5, 1): 2**(e-1) <= big < 2**e
    if f == 0.5:  # big = 2**(e-1) exactly: the smallest power of two >= big
        e -= 1
    return max(math.ldexp(1.0, e - SUM_UNIT_BITS), math.ldexp(1.0, -1074))


def fixed_point_terms(x: np.ndarray, kind: str, lo: float, hi: float) -> np.ndarray:
    """int64 k per row with k·g in [a, b]: the row's term snapped once to the grid g (see module doc).

    ``x`` must already be clamped to [lo, hi]. Each k depends on its own row only.
    """
    a, b = sum_term_bounds(kind, lo, hi)
    g = sum_unit(kind, lo, hi)
    mid = (lo + hi) / 2.0
    x = np.asarray(x, dtype=np.float64)
    if kind == "sum":
        t = x
    elif kind == "nsum":
        t = x - mid
    else:
        h = (hi - lo) / 2.0
        t = (x - mid) ** 2 - h * h / 2.0
    # NaN never gets here (such rows are dropped when read); if one did, it becomes a bounded
    # term like any other value instead of an unbounded integer (defence in depth).
    t = np.nan_to_num(t, nan=0.0, posinf=b, neginf=a)
    k = np.rint(t / g)  # g is a power of two: the division is exact
    k = np.clip(k, math.ceil(a / g), math.floor(b / g))  # inward: k·g stays inside [a, b]
    return k.astype(np.int64)


def checked_add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a + b elementwise, exact: int64 when no result can overflow, else Python integers (object)."""
    if a.dtype == object or b.dtype == object or _max_abs(a) >= _INT64_SAFE or _max_abs(b) >= _INT64_SAFE:
        return a.astype(object) + b.astype(object)
    return a + b


def _max_abs(a: np.ndarray) -> int:
    if a.size == 0:
        return 0
    return max(abs(int(a.min())), abs(int(a.max())))


def exact_group_sum(pidx: np.ndarray, k: np.ndarray, n_parts: int) -> np.ndarray:
    """Exact per-partition sums of the int64 terms ``k`` (|k| <= 2**SUM_UNIT_BITS): int64, or
    Python integers (object) if a sum could leave int64. Order-independent by construction."""
    out = np.zeros(n_parts, np.int64)
    mask = np.int64((1 << _LIMB_BITS) - 1)
    for start in range(0, len(k), _CHUNK_ROWS):
        kk, pp = k[start:start + _CHUNK_ROWS], pidx[start:start + _CHUNK_ROWS]
        # k = hi·2^16 + lo with lo in [0, 2^16), |hi| <= 2^15: every float64 partial sum of a limb
        # stays below 2^53 (<= 2^36 rows), so bincount adds them exactly.
        lo_sum = np.bincount(pp, weights=(kk & mask).astype(np.float64), minlength=n_parts)
        hi_sum = np.bincount(pp, weights=(kk >> np.int64(_LIMB_BITS)).astype(np.float64), minlength=n_parts)
        lo_i, hi_i = lo_sum.astype(np.int64), hi_sum.astype(np.int64)
        if len(kk) < _INT64_ROWS:  # |sum| <= rows·2^31 < 2^62: int64 is exact
            part = (hi_i << np.int64(_LIMB_BITS)) + lo_i
        else:
            part = np.array([(int(h) << _LIMB_BITS) + int(lo) for h, lo in zip(hi_i, lo_i)], dtype=object)
        out = checked_add(out, part)
    return out


@dataclass(frozen=True)
class AggregationSpec:
    """What to accumulate per partition (derived from the release plan by ``aggregation_spec``; picklable).

    ``l0``/``linf``: the bound every unit's rows get first (the streaming combiner's). ``subsets``: the
    narrower bound sets of per-metric contribution bounds, as (accumulator suffix, L0, Linf): the accumulators
    whose names end in the suffix (and ``count<suffix>``, ``unit_count<suffix>``) are aggregated over the rows
    that bounding at that (L0, Linf) keeps, by the same priorities (see "Per-metric bounds" in the module doc).
    Empty for a spec without per-metric bounds: one bound set, exactly the pipeline it always had."""

    l0: int
    linf: int
    sums: tuple[tuple[str, str, float, float, str], ...] = ()  # (accumulator, column, lo, hi, kind)
    hists: tuple[tuple[str, str, float, float, int], ...] = ()  # (accumulator, column, lo, hi, n_bins)
    cats: tuple[tuple[str, str, int], ...] = ()  # (accumulator, column, domain size)
    subsets: tuple[tuple[str, int, int], ...] = ()  # (accumulator suffix, L0, Linf), "" = the release's set

    @property
    def first_suffix(self) -> str:
        """The accumulator suffix of the rows kept by the first bound (``l0``, ``linf``) itself: the release's
        (``""``) unless the release's set is one of the subsets (a metric's Linf exceeds the release's), then
        ``bound_set_suffix(l0, linf)``."""
        from dpops.release_plan import bound_set_suffix

        return "" if "" not in {sfx for sfx, _, _ in self.subsets} else bound_set_suffix(self.l0, self.linf)

    @property
    def set_suffixes(self) -> tuple[str, ...]:
        """Every bound set's accumulator suffix, the first bound's first."""
        return (self.first_suffix,) + tuple(sfx for sfx, _, _ in self.subsets)


def aggregation_spec(plan) -> AggregationSpec:
    """The ``AggregationSpec`` of a release plan: its layout (``metric_layout``) and its bound sets.

    One owner for the pipeline's context and the auditor's harness. Without per-metric bounds: the release's
    (L0, Linf) and no subsets. With them: the first bound is (the release's L0, the largest Linf of any bound
    set) -- every set's L0 is at most the release's (``dpops.spec`` refuses more) -- and each set narrower than
    that, the release's own included, is a subset filtered from it."""
    from dpops.release_plan import bound_set_suffix

    _, _, sums, hists, catspecs = metric_layout(plan)
    base = (int(plan.max_partitions_per_unit), int(plan.max_rows_per_unit_per_partition))
    sets = [base] + [m.contribution for m in plan.metrics if m.contribution is not None]
    sets = list(dict.fromkeys((int(a), int(b)) for a, b in sets))
    l0, linf = base[0], max(b for _, b in sets)
    if any(a > l0 for a, _ in sets):  # pragma: no cover - the spec refuses it (dpops.spec)
        raise ValueError("a metric's own L0 exceeds the release's L0; the spec must have refused it")
    subsets = tuple(("" if s == base else bound_set_suffix(*s), s[0], s[1]) for s in sets if s != (l0, linf))
    return AggregationSpec(l0=l0, linf=linf, sums=sums, hists=hists, cats=catspecs, subsets=subsets)


def pair_salt(source) -> tuple[int, int]:
    """The run's secret pair-priority salt: two uint64 words from ``source.child("bounding", "pair_salt")``.

    Drawn by every worker from the run's randomness source (keyed and test mode reproduce it from
    the key or the seed; never shipped in the job graph). In os mode every process would draw a
    different salt, so the driver draws it once and ships it (see ``RandomnessConfig``): the salt
    only has to be uniform and independent of the data; the privacy argument does not rest on
    its secrecy (module doc).
    """
    w = np.asarray(source.child("bounding", "pair_salt").uint64(2), dtype=np.uint64)
    return int(w[0]), int(w[1])


def _mix64(h: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 with full avalanche (wrapping arithmetic)."""
    h = h ^ (h >> np.uint64(30))
    h = h * np.uint64(0xBF58476D1CE4E5B9)
    h = h ^ (h >> np.uint64(27))
    h = h * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


def pair_priority(u: np.ndarray, p: np.ndarray, salt: tuple[int, int]) -> np.ndarray:
    """The L0 priority of each row's (unit, partition) pair: a keyed function of the two hashes only.

    Every row of a pair gets the same value wherever and whenever it is read, which is what makes
    the L0 bound mergeable (module doc). Pseudo-uniform given the secret per-run ``salt``.
    """
    u = np.asarray(u, dtype=np.uint64)
    p = np.asarray(p, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = _mix64(u ^ np.uint64(salt[0]))
        return _mix64((h + _mix64(p)) ^ np.uint64(salt[1]))


def _order_by_group_then(group: np.ndarray, key: np.ndarray, tie: np.ndarray | None = None) -> np.ndarray:
    """Indices sorting by (group, key[, tie]) exactly, as ``np.lexsort`` would (stable on full ties).

    Fast path: one argsort of a single uint64 word, the dense group code in the high bits and the
    key's high bits below it. Only if two neighbours of one group share that truncated word (the
    key's low bits might order them) does it fall back to the exact lexsort, so the result is always
    the exact order of the full keys."""
    group = np.asarray(group, dtype=np.int64)
    if not len(group):
        return np.zeros(0, np.int64)
    gbits = max(1, int(group.max()).bit_length())
    if gbits < 48:
        shift = np.uint64(64 - gbits)
        word = (group.astype(np.uint64) << shift) | (np.asarray(key, dtype=np.uint64) >> np.uint64(gbits))
        order = np.argsort(word)  # equal words fall back below, so stability does not matter
        w = word[order]
        if not np.any(w[1:] == w[:-1]):
            return order
    keys = (key, group) if tie is None else (tie, key, group)
    return np.lexsort(keys)


@dataclass(frozen=True)
class ContributionRanks:
    """Where each row and each (unit, partition) pair stands in the bounding's two orders.

    ``row_rank[i]``: the rank of row i among the rows of its pair by row priority ``prio`` (0 = smallest);
    ``pair_rank[j]``: the rank of pair j among its unit's pairs by (pair priority, partition hash). Ranks
    are exact in every group larger than the floor they were computed with (``linf_floor`` rows per pair,
    ``l0_floor`` pairs per unit) and 0 in groups at or below it, which such bounds keep whole anyway; so
    for every l0 >= l0_floor and linf >= linf_floor, ``keep_mask(l0, linf)`` is exactly the rows bounding
    with (l0, linf) keeps. The orders are the bounding rule itself (module doc); ``bound_contributions``
    is this filter at one (l0, linf), so the rule has one owner.

    Also the dense codes the ranks were computed over, for callers that aggregate per unit, pair or
    partition without factorizing again: ``ucode`` (unit code per row), ``pcode`` (partition code per row,
    in order of first appearance), ``pair`` (pair code per row), ``first`` (a representative row of each
    pair), ``pair_unit`` (unit code per pair)."""

    ucode: np.ndarray
    n_units: int
    pcode: np.ndarray
    n_parts: int
    pair: np.ndarray
    first: np.ndarray
    pair_unit: np.ndarray
    row_rank: np.ndarray
    pair_rank: np.ndarray
    l0_floor: int
    linf_floor: int

    def pair_mask(self, l0: int) -> np.ndarray:
        """Per pair: kept by the L0 step at ``l0`` (>= ``l0_floor``)."""
        if l0 < self.l0_floor:
            raise ValueError(f"ranks computed for L0 >= {self.l0_floor} cannot filter at L0 = {l0}")
        return self.pair_rank < l0

    def row_mask(self, linf: int) -> np.ndarray:
        """Per row: kept by the Linf step at ``linf`` (>= ``linf_floor``) within its pair."""
        if linf < self.linf_floor:
            raise ValueError(f"ranks computed for Linf >= {self.linf_floor} cannot filter at Linf = {linf}")
        return self.row_rank < linf

    def keep_mask(self, l0: int, linf: int) -> np.ndarray:
        """Per row: kept by bounding at (l0, linf): its pair survives L0 and the row survives Linf."""
        return self.pair_mask(l0)[self.pair] & self.row_mask(linf)


PAIR_KEYS_INT32_MAX = (1 << 31) - 1  # the largest n_units * n_partitions whose pair keys are int32


def pair_keys(ucode: np.ndarray, pcode: np.ndarray, n_units: int, n_parts: int) -> np.ndarray:
    """One distinct integer per (unit, partition) pair, ``ucode * n_parts + pcode`` (dense codes in, so the map
    is injective and factorizing the keys gives exactly the pair codes). int32 when every key fits (at most
    n_units * n_parts - 1): pandas factorizes int32 keys in about 60% of the time of int64 ones, the hash
    table being half the size; the codes are the same either way (tests/test_pipeline_bounding.py)."""
    if n_units * n_parts <= PAIR_KEYS_INT32_MAX:
        return ucode.astype(np.int32) * np.int32(n_parts) + pcode.astype(np.int32)
    return ucode.astype(np.int64) * n_parts + pcode


def pair_codes(ucode: np.ndarray, pcode: np.ndarray, n_units: int, n_parts: int) -> np.ndarray:
    """Dense codes of the rows' (unit, partition) pairs, in order of first appearance: ``pd.factorize`` of
    ``pair_keys``. When every row is its own unit (record-level units, one row per user) every row is its own
    pair, and those codes are the unit codes (0..n-1 in order of appearance) exactly: one hash pass less."""
    if n_units == len(ucode):
        return ucode
    codes, _ = pd.factorize(pair_keys(ucode, pcode, n_units, n_parts), sort=False)
    return codes


def _ranks_within(group: np.ndarray, key: np.ndarray, tie: np.ndarray | None, n: int) -> np.ndarray:
    """Rank of each of ``group``'s elements by (key[, tie]) within its group; ``n`` = len(group)."""
    order = _order_by_group_then(group, key, tie)
    grp = group[order]
    start = np.r_[True, grp[1:] != grp[:-1]]
    pos = np.arange(n) - np.flatnonzero(start)[np.cumsum(start) - 1]
    ranks = np.empty(n, np.int64)
    ranks[order] = pos
    return ranks


def contribution_ranks(u: np.ndarray, p: np.ndarray, prio: np.ndarray, pp: np.ndarray | None = None, *,
                       l0_floor: int = 1, linf_floor: int = 1) -> ContributionRanks:
    """The ranks of ``ContributionRanks`` for rows (u, p, prio, pp), exact in groups above the floors.

    ``pp`` (``pair_priority``, one value per row, equal for all rows of a pair) orders the pairs of a
    unit, ties by partition hash; ``prio`` (one uniform uint64 per row, drawn when the row was read)
    orders the rows of a pair. Both are total orders that depend on the unit's own rows only. Only the
    rows of pairs with more than ``linf_floor`` rows and the pairs of units with more than ``l0_floor``
    pairs are sorted, so the common case (few rows per pair, few pairs per unit) costs no sort at all.
    Without ``pp``: the unsalted ``pair_priority(u, p, (0, 0))`` (see ``bound_contributions``)."""
    if pp is None:
        pp = pair_priority(u, p, (0, 0))
    n = len(u)
    if n == 0:
        z = np.zeros(0, np.int64)
        return ContributionRanks(z, 0, z, 0, z, z, z, np.zeros(0, np.int32), z, l0_floor, linf_floor)
    # Dense codes by hashing (O(n)).
    ucode, uniq_u = pd.factorize(u, sort=False)
    pcode, uniq_p = pd.factorize(p, sort=False)
    pair = pair_codes(ucode, pcode, len(uniq_u), len(uniq_p))
    m = int(pair.max()) + 1
    first = np.empty(m, np.int64)
    first[pair[::-1]] = np.arange(n - 1, -1, -1)  # a representative row of each pair (its first)
    rows_per_pair = np.bincount(pair, minlength=m)

    # Linf order: rows of each pair with more than linf_floor rows, by row priority.
    row_rank = np.zeros(n, np.int32)  # a pair's rows are far fewer than 2^31
    big = rows_per_pair[pair] > linf_floor
    if big.any():
        idx = np.flatnonzero(big)
        row_rank[idx] = _ranks_within(pair[idx], prio[idx], None, len(idx))

    # L0 order: pairs of each unit with more than l0_floor pairs, by (pair priority, partition hash).
    pair_unit = ucode[first]
    pair_rank = np.zeros(m, np.int64)
    pairs_per_unit = np.bincount(pair_unit, minlength=len(uniq_u))
    bigu = pairs_per_unit[pair_unit] > l0_floor
    if bigu.any():
        pidx = np.flatnonzero(bigu)
        pair_rank[pidx] = _ranks_within(pair_unit[pidx], pp[first[pidx]], p[first[pidx]], len(pidx))
    return ContributionRanks(ucode, len(uniq_u), pcode, len(uniq_p), pair, first, pair_unit, row_rank, pair_rank,
                             l0_floor, linf_floor)


def bound_contributions(u: np.ndarray, p: np.ndarray, prio: np.ndarray, l0: int, linf: int,
                        pp: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, dict]:
    """Rows kept under L0 / Linf. Returns (kept row indices, partition of each kept (unit, partition)
    pair, internal counters).

    ``pp`` (``pair_priority``, one value per row, equal for all rows of a pair) orders the pairs of a
    unit: the ``l0`` smallest (ties by partition hash) are kept. ``prio`` (one uniform uint64 per row,
    drawn when the row was read) orders the rows of a pair: the ``linf`` smallest are kept. Both are
    total orders that depend on the unit's own rows only, so the result is the same function of the
    rows whatever subset it was applied to first: bound(bound(A) + bound(B)) == bound(A + B). The
    orders are ``contribution_ranks`` (the one place they are computed); this is its filter at (l0, linf).

    Without ``pp`` the pair priority is the unsalted ``pair_priority(u, p, (0, 0))``: still a valid
    bound (a function of the unit's own rows), but the same choice on every run; for direct callers
    such as property tests only. The pipeline always passes the run's salted priorities.
    """
    n = len(u)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.uint64), {"rows_dropped_linf": 0, "rows_dropped_l0": 0}
    r = contribution_ranks(u, p, prio, pp, l0_floor=l0, linf_floor=linf)
    pair_ok = r.pair_mask(l0)
    row_pair_ok = pair_ok[r.pair]
    keep = row_pair_ok & r.row_mask(linf)
    stats = {
        "rows_dropped_l0": int(n - np.count_nonzero(row_pair_ok)),
        "rows_dropped_linf": int(np.count_nonzero(row_pair_ok) - np.count_nonzero(keep)),
    }
    return np.flatnonzero(keep), p[r.first[pair_ok]], stats


def bound_rows(rows: dict[str, np.ndarray], l0: int, linf: int) -> tuple[dict[str, np.ndarray], dict]:
    """``rows`` restricted to the rows kept by ``bound_contributions`` (columns "u", "p", "prio",
    "pp" required). Idempotent and mergeable: the streaming combiner's compaction step."""
    kept, _, stats = bound_contributions(rows["u"], rows["p"], rows["prio"], l0, linf, _pp(rows))
    if len(kept) == len(rows["u"]):
        return rows, stats
    return {k: v[kept] for k, v in rows.items()}, stats


def _distinct_pair_partitions(u: np.ndarray, p: np.ndarray) -> np.ndarray:
    """The partition hash of each distinct (unit, partition) pair (exact: dense codes, no hash mixing)."""
    if not len(u):
        return np.zeros(0, np.uint64)
    ucode, uniq_u = pd.factorize(u, sort=False)
    pcode, uniq_p = pd.factorize(p, sort=False)
    pair = pair_codes(ucode, pcode, len(uniq_u), len(uniq_p))
    first = np.empty(int(pair.max()) + 1, np.int64)
    first[pair[::-1]] = np.arange(len(u) - 1, -1, -1)
    return p[first]


def _pp(rows: dict[str, np.ndarray]) -> np.ndarray:
    try:
        return rows["pp"]
    except KeyError:
        raise ValueError("rows carry no pair priority 'pp': build them with pipelines.io.prepare_batch "
                         "(pair_salt=...) or add pair_priority(u, p, salt)") from None


def aggregate_bucket(rows: dict[str, np.ndarray], spec: AggregationSpec, bounded: bool = False) -> tuple[np.ndarray, dict, dict]:
    """Bound one bucket's rows and pre-aggregate them per partition.

    Returns (sorted unique partition hashes, accumulators aligned with them, internal counters).
    Accumulators: "count" and "unit_count" (int64), each sum as an exact integer count of its
    grid step ``sum_unit(kind, lo, hi)`` (int64, or object = Python ints where int64 could
    overflow), each histogram / category count as a dense (partitions x bins) int64 matrix.
    """
    if bounded:  # rows already bounded (bound_rows): every row is kept; one partition per distinct pair
        kept = np.arange(len(rows["u"]))
        pair_parts = _distinct_pair_partitions(rows["u"], rows["p"])
        stats: dict = {}
    else:
        kept, pair_parts, stats = bound_contributions(rows["u"], rows["p"], rows["prio"], spec.l0, spec.linf, _pp(rows))
    p = rows["p"][kept]
    parts, pidx = np.unique(p, return_inverse=True)
    n_parts = len(parts)
    if not spec.subsets:  # one bound set: every accumulator over the rows kept (today's path)
        acc, clamped_rows = _accumulate(rows, kept, pidx, np.searchsorted(parts, pair_parts), n_parts, spec, "")
    else:
        acc, clamped_rows = _accumulate_subsets(rows, kept, pidx, parts, n_parts, spec)
    stats["rows_kept"] = int(len(kept))
    stats["values_clamped"] = clamped_rows
    return parts, acc, stats


def _suffix_of(name: str) -> str:
    """The bound-set suffix of an accumulator name (``sum:spend@2x5`` -> ``@2x5``), ``""`` for the release's."""
    i = name.rfind("@")
    return "" if i < 0 else name[i:]


def _accumulate(rows: dict[str, np.ndarray], kept: np.ndarray, pidx: np.ndarray, pair_pidx: np.ndarray,
                n_parts: int, spec: AggregationSpec, suffix: str) -> tuple[dict, int]:
    """The accumulators of one bound set (the names whose bound-set suffix is ``suffix``) over the rows ``kept``
    (partition index ``pidx``; ``pair_pidx``: the partition index of each kept (unit, partition) pair).
    Returns (accumulators, values clamped)."""
    def mine(name: str) -> bool:
        return _suffix_of(name) == suffix

    acc: dict[str, np.ndarray] = {"count" + suffix: np.bincount(pidx, minlength=n_parts).astype(np.int64)}
    # distinct units per partition = kept (unit, partition) pairs per partition
    acc["unit_count" + suffix] = np.bincount(pair_pidx, minlength=n_parts).astype(np.int64)

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
        if mine(name):
            # exact fixed point (module doc): integer multiples of sum_unit(kind, lo, hi)
            acc[name] = exact_group_sum(pidx, fixed_point_terms(clamped(col, lo, hi), kind, lo, hi), n_parts)
    for name, col, lo, hi, n_bins in spec.hists:
        if mine(name):
            acc[name] = _histogram(pidx, n_parts, clamped(col, lo, hi), lo, hi, n_bins)
    for name, col, k in spec.cats:
        if mine(name):
            codes = rows[f"c:{col}"][kept].astype(np.int64)
            ok = codes >= 0  # values outside the declared domain do not count for top_k
            acc[name] = np.bincount(pidx[ok] * k + codes[ok], minlength=n_parts * k).reshape(n_parts, k
                                                                                             ).astype(np.int64)
    return acc, clamped_rows


def _accumulate_subsets(rows: dict[str, np.ndarray], kept: np.ndarray, pidx: np.ndarray, parts: np.ndarray,
                        n_parts: int, spec: AggregationSpec) -> tuple[dict, int]:
    """Every bound set's accumulators, aligned with ``parts`` (the partitions of the rows kept at the first
    bound). The first bound's set is the rows ``kept``; each subset (suffix, L0, Linf) keeps of them what
    ``contribution_ranks`` at that (L0, Linf) keeps, by the rows' own priorities (module doc). A partition
    where a narrower set keeps no row gets zeros there: every accumulator is a function of its set's rows."""
    k_p, k_pp = rows["p"][kept], _pp(rows)[kept]
    r = contribution_ranks(rows["u"][kept], k_p, rows["prio"][kept], k_pp, l0_floor=1, linf_floor=1)
    sets = [(spec.first_suffix, np.ones(len(kept), bool), np.ones(len(r.first), bool))]
    sets += [(sfx, r.keep_mask(l0, linf), r.pair_mask(l0)) for sfx, l0, linf in spec.subsets]
    acc: dict[str, np.ndarray] = {}
    clamped_total = 0
    for sfx, row_mask, pair_mask in sets:
        # a pair kept at L0 keeps >= 1 row (Linf >= 1): its partition is that of its first row
        pair_pidx = np.searchsorted(parts, k_p[r.first[pair_mask]])
        a, c = _accumulate(rows, kept[row_mask], pidx[row_mask], pair_pidx, n_parts, spec, sfx)
        acc.update(a)
        clamped_total += c
    return acc, clamped_total


def quantile_candidates(lo: float, hi: float, n_bins: int) -> np.ndarray:
    """The public candidate grid c_j = lo + j (hi - lo) / n_bins, j = 0..n_bins."""
    return lo + (hi - lo) * np.arange(n_bins + 1, dtype=np.float64) / n_bins


def quantile_bins(x: np.ndarray, lo: float, hi: float, n_bins: int) -> np.ndarray:
    """Per value (already clamped to [lo, hi]): the index j of the smallest candidate c_j >= the value.

    The quantile histogram's bin of each row (``_histogram``), so rank(c_j) = #values <= c_j is the running
    sum of the counts over j; ``dpops.analysis.tuning`` bins a sample's bounded rows with it too."""
    if hi > lo:
        j = np.ceil((x - lo) / (hi - lo) * n_bins).astype(np.int64)
        j = np.clip(j, 0, n_bins)
        # guard float rounding: the bin's candidate must be >= the value
        cand = quantile_candidates(lo, hi, n_bins)
        return np.where(cand[j] < x, np.minimum(j + 1, n_bins), j)
    return np.zeros(len(x), np.int64)


def _histogram(pidx: np.ndarray, n_parts: int, x: np.ndarray, lo: float, hi: float, n_bins: int) -> np.ndarray:
    """Counts per (partition, j) of values whose smallest candidate >= value is c_j (``quantile_bins``).

    Then rank(c_j) = #values <= c_j is the running sum over j: what the quantile utility needs.
    """
    j = quantile_bins(x, lo, hi, n_bins)
    width = n_bins + 1
    return np.bincount(pidx * width + j, minlength=n_parts * width).reshape(n_parts, width).astype(np.int64)


def merge_partials(partials: list[tuple[np.ndarray, dict]]) -> tuple[np.ndarray, dict]:
    """Sum per-bucket accumulators per partition. Every accumulator is an integer array, so the
    result does not depend on the order of the partials; sum accumulators are added with
    ``checked_add`` (widened to Python integers rather than overflowing)."""
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
            if arr.ndim == 1:  # counts and exact sums: checked (sums may need Python integers)
                res = checked_add(out[name][idx], arr)
                if res.dtype == object and out[name].dtype != object:
                    out[name] = out[name].astype(object)  # widen before storing Python integers
                out[name][idx] = res
                continue
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
            catspecs.append((f"cat:{m.key}{m.bound_suffix}", m.column, len(m.domain)))
        for v in m.vectors:
            kind = v.accumulator.split(":")[0]
            if kind in ("sum", "nsum", "nsq"):
                sums.append((v.accumulator, m.column, m.bounds[0], m.bounds[1], kind))
        if m.type == "quantiles":
            hists.append((f"hist:{m.key}{m.bound_suffix}", m.column, m.bounds[0], m.bounds[1], m.n_bins))
    return (tuple(dict.fromkeys(value_cols)), cats, tuple(dict.fromkeys(sums)), tuple(hists), tuple(catspecs))
