"""Sensitivities: worst-case neighbouring datasets reach each bound exactly; random neighbours never exceed it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from fuzz_support import examples

from dpops.noise import sensitivity as sens
from dpops.errors import InvalidParameter
from dpops.noise.sensitivity import ContributionBounds

# ---- the queries, written independently of the module: rows are (unit, partition, value) ----


def _clamp(v, lo, hi):
    return min(max(v, lo), hi)


def q_count(rows, parts, lo, hi):
    return np.array([sum(1 for _, p, _ in rows if p == q) for q in parts], dtype=float)


def q_unit_count(rows, parts, lo, hi):
    return np.array([len({u for u, p, _ in rows if p == q}) for q in parts], dtype=float)


def q_sum(rows, parts, lo, hi):
    return np.array([sum(_clamp(v, lo, hi) for _, p, v in rows if p == q) for q in parts], dtype=float)


def q_nsum(rows, parts, lo, hi):
    mid = (lo + hi) / 2
    return np.array([sum(_clamp(v, lo, hi) - mid for _, p, v in rows if p == q) for q in parts], dtype=float)


def q_nss(rows, parts, lo, hi):
    mid, h = (lo + hi) / 2, (hi - lo) / 2
    return np.array(
        [sum((_clamp(v, lo, hi) - mid) ** 2 - h * h / 2 for _, p, v in rows if p == q) for q in parts], dtype=float
    )


def s_count(b, lo, hi):
    return sens.count(b)


def s_unit_count(b, lo, hi):
    return sens.unit_count(b)


def s_mean_nsum(b, lo, hi):
    return sens.mean(b, lo, hi)["normalized_sum"]


def s_var_nss(b, lo, hi):
    return sens.variance(b, lo, hi)["normalized_sum_of_squares"]


# (name, query, sensitivity, per-row term t(v) used to pick extreme raw values)
QUERIES = [
    ("count", q_count, s_count, lambda v, lo, hi: 1.0),
    ("unit_count", q_unit_count, s_unit_count, lambda v, lo, hi: 1.0),
    ("sum", q_sum, sens.sum_, lambda v, lo, hi: v),
    ("normalized_sum", q_nsum, sens.normalized_sum, lambda v, lo, hi: v - (lo + hi) / 2),
    ("mean.normalized_sum", q_nsum, s_mean_nsum, lambda v, lo, hi: v - (lo + hi) / 2),
    ("variance.normalized_sum_of_squares", q_nss, s_var_nss, lambda v, lo, hi: (v - (lo + hi) / 2) ** 2 - ((hi - lo) / 2) ** 2 / 2),
]

BOUND_CASES = [
    ("add_remove", 1, 1, False),
    ("add_remove", 3, 2, False),
    ("replace", 1, 1, False),
    ("replace", 3, 2, False),
    ("replace", 2, 3, True),
]
VALUE_RANGES = [(0.0, 10.0), (-4.0, 10.0), (-5.0, 5.0), (2.0, 7.0), (-9.0, -1.0)]


def _norms(d):
    return float(np.abs(d).sum()), float(np.sqrt((d * d).sum())), float(np.abs(d).max(initial=0.0)), int(np.count_nonzero(np.abs(d) > 1e-12))


def _worst_pairs(b: ContributionBounds, lo: float, hi: float, term):
    """Candidate worst-case neighbour pairs (D, D') respecting the bounds, under b's adjacency."""
    l0, linf = b.max_partitions, b.max_rows_per_partition
    cands = [lo, hi, (lo + hi) / 2]
    v_hi = max(cands, key=lambda v: term(v, lo, hi))
    v_lo = min(cands, key=lambda v: term(v, lo, hi))
    # the unit's contribution per partition: Linf rows of the extreme value, or no rows when 0 is more extreme
    high = [v_hi] * linf if term(v_hi, lo, hi) > 0 else []
    low = [v_lo] * linf if term(v_lo, lo, hi) < 0 else []
    big = high if abs(linf * term(v_hi, lo, hi)) * bool(high) >= abs(linf * term(v_lo, lo, hi)) * bool(low) else low
    background = [("bg", p, (lo + hi) / 2) for p in range(2 * l0 + 1)]

    def unit(vals, parts, name="u"):
        return [(name, p, v) for p in parts for v in vals]

    first, second = range(l0), range(l0, 2 * l0)
    if b.adjacency == "add_remove":
        return [(background, background + unit(big, first))]
    overlap = (background + unit(low, first), background + unit(high, first, "w"))
    if b.partitions_fixed_per_unit:
        return [overlap]
    disjoint = (background + unit(big, first), background + unit(big, second, "w"))
    return [disjoint, overlap]


@pytest.mark.parametrize("adj,l0,linf,fixed", BOUND_CASES)
@pytest.mark.parametrize("lo,hi", VALUE_RANGES)
@pytest.mark.parametrize("name,query,sens_fn,term", QUERIES, ids=[q[0] for q in QUERIES])
def test_worst_case_pair_reaches_bound_exactly(adj, l0, linf, fixed, lo, hi, name, query, sens_fn, term):
    b = ContributionBounds(adj, l0, linf, fixed)
    s = sens_fn(b, lo, hi)
    parts = list(range(2 * l0 + 1))
    got = [_norms(query(d2, parts, lo, hi) - query(d1, parts, lo, hi)) for d1, d2 in _worst_pairs(b, lo, hi, term)]
    best = [max(g[i] for g in got) for i in range(4)]
    assert best[0] == pytest.approx(s.l1, rel=1e-12, abs=1e-12)
    assert best[1] == pytest.approx(s.l2, rel=1e-12, abs=1e-12)
    assert best[2] == pytest.approx(s.linf, rel=1e-12, abs=1e-12)
    assert best[3] <= s.max_coords
    for g in got:
        assert g[0] <= s.l1 + 1e-9 and g[1] <= s.l2 + 1e-9 and g[2] <= s.linf + 1e-9


def test_spec_formulas():
    for l0, linf in ((1, 1), (3, 2), (5, 7)):
        ar, rp = ContributionBounds("add_remove", l0, linf), ContributionBounds("replace", l0, linf)
        fx = ContributionBounds("replace", l0, linf, partitions_fixed_per_unit=True)
        assert sens.count(ar).l1 == l0 * linf and sens.count(rp).l1 == 2 * l0 * linf
        assert sens.count(ar).l2 == pytest.approx(math.sqrt(l0) * linf)
        assert sens.count(rp).l2 == pytest.approx(math.sqrt(2 * l0) * linf)
        assert sens.count(rp).max_coords == 2 * l0 and sens.count(ar).max_coords == l0
        for lo, hi in ((0.0, 100.0), (-3.0, 10.0)):
            m = max(abs(lo), abs(hi))
            assert sens.sum_(ar, lo, hi).l1 == l0 * linf * m
            assert sens.sum_(rp, lo, hi).l1 == 2 * l0 * linf * m
            assert sens.sum_(fx, lo, hi).l1 == l0 * linf * (hi - lo)  # 0 in [lo, hi]
        assert sens.unit_count(ar) == sens.Sensitivity(l0, math.sqrt(l0), 1.0, l0)
        assert sens.quantile_utility(ar) == linf == sens.quantile_utility(rp)
    # 0 outside [lo, hi]: the fixed-partition bound is max|v| per row, not hi - lo (a unit may drop its rows)
    assert sens.sum_(ContributionBounds("replace", 2, 3, True), 2.0, 7.0).l1 == 2 * 3 * 7.0


# ---- random datasets and random neighbours ----

@st.composite
def dataset_and_neighbour(draw):
    adj = draw(st.sampled_from(["add_remove", "replace"]))
    fixed = adj == "replace" and draw(st.booleans())
    l0, linf = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    a, c = draw(st.integers(-6, 6)), draw(st.integers(-6, 6))
    lo, hi = float(min(a, c)), float(max(a, c)) + draw(st.sampled_from([0.0, 0.5]))
    parts = list(range(6))
    value = st.floats(lo - 3, hi + 3, allow_nan=False)  # out-of-range values get clamped by the queries

    def contribution(name, allowed, at_least_one):
        chosen = draw(st.lists(st.sampled_from(allowed), min_size=0, max_size=l0, unique=True))
        rows = []
        for p in chosen:
            k = draw(st.integers(1 if at_least_one else 0, linf))
            rows += [(name, p, draw(value)) for _ in range(k)]
        return chosen, rows

    units = {}
    rows = []
    for u in range(draw(st.integers(1, 4))):
        chosen, r = contribution(f"u{u}", parts, True)
        units[f"u{u}"] = chosen
        rows += r
    victim = draw(st.sampled_from(sorted(units)))
    others = [r for r in rows if r[0] != victim]
    if adj == "add_remove":
        neighbour = others  # remove the victim's whole data (adding is the same pair read backwards)
    else:
        # fixed partitions: the replacement stays inside the victim's public partitions, 0..Linf rows each
        allowed = units[victim] if fixed else parts
        new = contribution("new", allowed, at_least_one=not fixed)[1] if allowed else []
        neighbour = others + new
    return ContributionBounds(adj, l0, linf, fixed), lo, hi, parts, rows, neighbour


@settings(max_examples=examples(300), deadline=None)
@given(dataset_and_neighbour())
def test_random_neighbours_never_exceed_bounds(case):
    b, lo, hi, parts, d1, d2 = case
    for name, query, sens_fn, _ in QUERIES:
        s = sens_fn(b, lo, hi)
        l1, l2, linf, nnz = _norms(query(d2, parts, lo, hi) - query(d1, parts, lo, hi))
        tol = 1e-9 * (1 + s.l1)
        assert l1 <= s.l1 + tol, name
        assert l2 <= s.l2 + tol, name
        assert linf <= s.linf + tol, name
        assert nnz <= s.max_coords, name


def _utility(values, candidates, q):
    n = len(values)
    return np.array([-abs(sum(1 for v in values if v < x) - q * n) for x in candidates])


@settings(max_examples=examples(200), deadline=None)
@given(
    st.lists(st.integers(0, 10), max_size=12),
    st.lists(st.integers(0, 10), max_size=3),
    st.lists(st.integers(0, 10), max_size=3),
    st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]),
)
def test_quantile_utility_bound(base, removed, added, q):
    linf = 3
    b = ContributionBounds("replace", 1, linf)
    cands = [x + 0.5 for x in range(-1, 11)]
    before = _utility(base + removed, cands, q)
    after = _utility(base + added, cands, q)
    assert np.abs(after - before).max() <= sens.quantile_utility(b) + 1e-12


def test_quantile_utility_bound_is_reached():
    linf = 3
    b = ContributionBounds("add_remove", 1, linf)
    cands = [5.5]
    diff = _utility([1, 2, 8] + [0] * linf, cands, 0.0) - _utility([1, 2, 8], cands, 0.0)
    assert abs(diff[0]) == sens.quantile_utility(b)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(adjacency="add_remove", max_partitions=0, max_rows_per_partition=1), "max_partitions"),
        (dict(adjacency="add_remove", max_partitions=1, max_rows_per_partition=0), "max_rows_per_partition"),
        (dict(adjacency="swap", max_partitions=1, max_rows_per_partition=1), "adjacency"),
        (dict(adjacency="add_remove", max_partitions=1.5, max_rows_per_partition=1), "max_partitions"),
        (dict(adjacency="replace", max_partitions=1, max_rows_per_partition=1, partitions_fixed_per_unit="yes"), "fixed"),
    ],
)
def test_bad_bounds(kwargs, match):
    with pytest.raises(InvalidParameter, match=match):
        ContributionBounds(**kwargs)


@pytest.mark.parametrize("lo,hi,match", [(float("nan"), 1.0, "lower"), (0.0, float("inf"), "upper"), (5.0, 1.0, "greater")])
def test_bad_value_bounds(lo, hi, match):
    b = ContributionBounds("add_remove", 1, 1)
    for fn in (sens.sum_, sens.normalized_sum, sens.mean, sens.variance):
        with pytest.raises(InvalidParameter, match=match):
            fn(b, lo, hi)


def test_not_bounds():
    with pytest.raises(InvalidParameter, match="ContributionBounds"):
        sens.count({"adjacency": "replace"})
