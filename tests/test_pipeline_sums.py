"""Exact fixed-point sums (issue 11 item 4): the charged sensitivity holds for any row order, and
sums are bit-identical across row orders, chunkings, bucket merges and Parquet layouts."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import dpops.noise.mechanisms as mech
import pipelines.bounding as bounding
from dpops.noise.randomness import test_random
from dpops.release_plan import plan_release
from dpops.spec import load_spec, parse_spec
from pipelines.aggregate import select_and_noise
from pipelines.bounding import (
    AggregationSpec,
    aggregate_bucket,
    checked_add,
    exact_group_sum,
    fixed_point_terms,
    merge_partials,
    metric_layout,
    sum_term_bounds,
    sum_unit,
)
from test_pipeline_helpers import request, run, write_spec

ATTACK_SPEC = {
    "name": "float_sum_attack",
    "input": {"path": "x.parquet", "format": "parquet", "columns": {"u": "int", "p": "string", "v": "float"}},
    "privacy_unit": {"column": "u", "description": "one row owner", "adjacency": "add_remove"},
    "budget": {"scope": "s", "epsilon": 1.0, "delta": 0.0, "noise": "laplace"},
    "contribution": {"max_partitions_per_unit": 1, "max_rows_per_unit_per_partition": 1},
    "partitions": {"columns": ["p"], "public": ["a"]},
    "metrics": [{"type": "sum", "column": "v", "bounds": [-1, 1]}, {"type": "mean", "column": "v", "bounds": [-1, 1]}],
}


def _zero_noise(monkeypatch):
    """Noise-free lattice values: the adversary's best case (the noise does not depend on the data)."""
    monkeypatch.setattr(mech, "discrete_laplace", lambda lat, size, rng: np.zeros(size, np.int64))


def _rows(values, parts=None, units=None, seed=1):
    n = len(values)
    rows = {"u": np.asarray(units if units is not None else np.arange(1, n + 1), np.uint64),
            "p": np.asarray(parts if parts is not None else np.full(n, 7), np.uint64),
            "prio": test_random(seed, ("prio",)).uint64(n), "v:v": np.asarray(values, np.float64)}
    rows["pp"] = bounding.pair_priority(rows["u"], rows["p"], (17, 29))  # one run's salt, shared by all rows
    return rows


def test_float_sum_attack_stays_within_the_charge(monkeypatch):
    """The issue's attack: 2^22 rows of 1.0, one 0.5, the target's -1, then 2^22 rows of -2^-31
    (bounds [-1, 1], L0 = Linf = 1, add_remove). A float64 running sum loses the tiny rows in one
    neighbour only (ties to even at 2^22): 1026 lattice steps apart against a charge of 1025.
    Exact sums differ by exactly the target's 1.0 = 1024 steps."""
    _zero_noise(monkeypatch)
    plan = plan_release(parse_spec(ATTACK_SPEC, source="<attack>"))
    sum_m, mean_m = plan.metrics
    vec = sum_m.vectors[0]
    r = vec.params.resolution
    charge = vec.params.l1_sensitivity / r
    assert (r, charge) == (2.0**-10, 1025.0)  # the charge the issue quotes: ceil(Δ/r + m)
    nsum = next(v for v in mean_m.vectors if v.name == "normalized_sum")
    _, _, sums, _, _ = metric_layout(plan)
    agg = AggregationSpec(l0=1, linf=1, sums=sums)
    n = 2**22
    values = np.concatenate([np.ones(n), [0.5], [-1.0], np.full(n, -(2.0**-31))])
    target = n + 1
    lattice, nsum_lattice = [], []
    for world in (0, 1):
        keep = np.ones(values.size, bool)
        keep[target] = world == 1
        parts, acc, _ = aggregate_bucket(_rows(values[keep]), agg)
        cols = select_and_noise(0, parts, acc, {7: ("a",)}, plan, parts, {7: ("a",)}, test_random(0, ("n",)))
        lattice.append(cols[sum_m.key][0] / r)
        nsum_lattice.append(int(mech.lattice_of_fixed(acc[f"nsum:{mean_m.key}"], sum_unit("nsum", -1.0, 1.0),
                                                      nsum.params)[0]))
    assert abs(lattice[1] - lattice[0]) <= charge  # float64 running sums: 1026
    # the exact sums: D = 2^22 + 0.5 - 2^-9, D' = D - 1 (1024 steps)
    assert lattice[0] == (n + 0.5 - 2.0**-9) / r and lattice[1] == lattice[0] - 1024
    assert abs(nsum_lattice[1] - nsum_lattice[0]) <= nsum.params.l1_sensitivity / nsum.params.resolution


@pytest.mark.parametrize("kind", ["sum", "nsum", "nsq"])
def test_fixed_point_terms_stay_inside_the_charged_term_bounds(kind):
    # Every per-row term k·g lies in [a, b], the range dpops.noise.sensitivity derives Δ from, for bounds
    # that are not multiples of g and values at, near and beyond the bounds.
    gen = np.random.default_rng(5)
    for lo, hi in [(-1.0, 1.0), (0.1, 0.7), (-3.3, 1e-3), (0.0, 1e12), (-7e-5, -1e-5), (2.5, 2.5)]:
        g = sum_unit(kind, lo, hi)
        a, b = sum_term_bounds(kind, lo, hi)
        assert g > 0 and math.log2(g).is_integer()
        assert max(abs(a), abs(b)) <= g * 2**bounding.SUM_UNIT_BITS
        x = np.concatenate([[lo, hi, np.nextafter(lo, hi), np.nextafter(hi, lo), (lo + hi) / 2],
                            gen.uniform(lo, hi, 2000)])
        k = fixed_point_terms(np.clip(x, lo, hi), kind, lo, hi)
        assert k.dtype == np.int64
        assert all(Fraction(a) <= int(kk) * Fraction(g) <= Fraction(b) for kk in k)
        # a NaN or inf that slipped past the row checks still gives a bounded term
        odd = fixed_point_terms(np.array([np.nan, np.inf, -np.inf]), kind, lo, hi)
        assert all(Fraction(a) <= int(kk) * Fraction(g) <= Fraction(b) for kk in odd)
        # and each term is within g of the float term it snaps
        t = {"sum": x, "nsum": x - (lo + hi) / 2, "nsq": (x - (lo + hi) / 2) ** 2 - ((hi - lo) / 2) ** 2 / 2}[kind]
        assert np.all(np.abs(k * g - t) <= g * (1 + 1e-9))


def test_sums_are_bit_identical_under_row_order_chunking_and_merge_order():
    # Wide magnitudes make float64 running sums order-dependent; exact integer sums are not.
    gen = np.random.default_rng(11)
    n = 20000
    units = gen.integers(0, 3000, n)
    parts = gen.integers(0, 5, n)
    values = gen.choice([1e6, -1e6, 0.1, 1e-7, 3.3], n) * gen.uniform(0.5, 1.0, n)
    prio = test_random(3, ("prio",)).uint64(n)
    rows = {"u": units.astype(np.uint64), "p": parts.astype(np.uint64), "prio": prio, "v:v": values}
    rows["pp"] = bounding.pair_priority(rows["u"], rows["p"], (5, 6))
    agg = AggregationSpec(l0=2, linf=3, sums=(("sum:s", "v", -1e6, 1e6, "sum"), ("nsum:m", "v", -1e6, 1e6, "nsum"),
                                               ("nsq:m", "v", -1e6, 1e6, "nsq")))
    ref_parts, ref, _ = aggregate_bucket(rows, agg)
    for trial in range(3):
        perm = gen.permutation(n)
        shuffled = {k: v[perm] for k, v in rows.items()}
        p2, acc2, _ = aggregate_bucket(shuffled, agg)
        assert np.array_equal(p2, ref_parts)
        for name in ("sum:s", "nsum:m", "nsq:m"):
            assert acc2[name].dtype == ref[name].dtype and np.array_equal(acc2[name], ref[name]), name
        # bucketed by unit (any number of buckets), partials merged in any order
        n_buckets = (1, 3, 17)[trial]
        bucket = units % n_buckets
        partials = []
        for b in range(n_buckets):
            sel = perm[bucket[perm] == b]
            pp, aa, _ = aggregate_bucket({k: v[sel] for k, v in rows.items()}, agg)
            partials.append((pp, aa))
        order = gen.permutation(len(partials))
        mp, macc = merge_partials([partials[i] for i in order])
        assert np.array_equal(mp, ref_parts)
        for name in ("sum:s", "nsum:m", "nsq:m", "count"):
            assert np.array_equal(macc[name], ref[name]), name
    # and they are the exact sums of the snapped terms (Python integers as the reference)
    kept, _, _ = bounding.bound_contributions(rows["u"], rows["p"], prio, 2, 3, rows["pp"])
    k = fixed_point_terms(np.clip(values[kept], -1e6, 1e6), "sum", -1e6, 1e6)
    for j, p in enumerate(ref_parts):
        assert int(ref["sum:s"][j]) == sum(int(x) for x in k[parts[kept] == p])


def test_exact_group_sum_chunks_and_widens(monkeypatch):
    # Force the chunked and the Python-integer paths on small inputs; the sums stay exact.
    gen = np.random.default_rng(2)
    top = 2**bounding.SUM_UNIT_BITS
    k = gen.choice([top, -top, top - 1, 1, -7], 101).astype(np.int64)
    pidx = gen.integers(0, 4, 101)
    want = [sum(int(x) for x in k[pidx == j]) for j in range(4)]
    base = exact_group_sum(pidx, k, 4)
    assert base.dtype == np.int64 and base.tolist() == want
    monkeypatch.setattr(bounding, "_CHUNK_ROWS", 7)
    monkeypatch.setattr(bounding, "_INT64_ROWS", 3)
    wide = exact_group_sum(pidx, k, 4)
    assert [int(x) for x in wide] == want


def test_merge_widens_instead_of_overflowing():
    # Two buckets whose partial sums together leave int64: the merge is exact in Python integers,
    # and the noise step rounds the exact value (saturating far beyond any real sum).
    big = np.array([2**62 + 3, -(2**62) - 5, 11], np.int64)
    parts = np.array([1, 2, 3], np.uint64)
    merged_parts, acc = merge_partials([(parts, {"sum:s": big}), (parts, {"sum:s": big}), (parts[:1], {"sum:s": big[:1]})])
    assert acc["sum:s"].dtype == object
    assert [int(x) for x in acc["sum:s"]] == [3 * (2**62 + 3), 2 * (-(2**62) - 5), 22]
    assert checked_add(np.array([2**61], np.int64), np.array([2**61], np.int64)).dtype == np.int64
    params = mech.laplace_mechanism(1.0, 1.0, integer_valued=False)
    exact = [Fraction(int(x)) * Fraction(2**-40) / Fraction(params.resolution) for x in acc["sum:s"]]
    assert mech.lattice_of_fixed(acc["sum:s"], 2.0**-40, params).tolist() == [round(x) for x in exact]
    cap = 2**52 - 1  # |lattice| beyond 2^52: saturated (1-Lipschitz), never an error
    assert mech.lattice_of_fixed(acc["sum:s"], 1.0, params).tolist() == [cap, -cap, 22 * 2**10]


@pytest.mark.parametrize("s_unit", [-60, -45, -20, -1, 0, 3])
def test_lattice_rounding_is_exact_nearest_ties_to_even(s_unit):
    params = mech.laplace_mechanism(1.0, 1.0, integer_valued=False)  # r = 2^-10
    unit = params.resolution * 2.0**s_unit
    gen = np.random.default_rng(abs(s_unit))
    vals = list(gen.integers(-(2**62), 2**62, 300)) + [0, 1, -1]
    if s_unit < 0:  # exact ties and their neighbours
        half = 2 ** (-s_unit - 1)
        vals += [half, -half, 3 * half, -3 * half, half + 1, half - 1, 5 * half]
    for dtype in (np.int64, object):
        arr = np.array([int(v) for v in vals], dtype=dtype)
        got = mech.lattice_of_fixed(arr, unit, params)
        for v, g in zip(vals, got.tolist()):
            exact = Fraction(int(v)) * Fraction(unit) / Fraction(params.resolution)
            want = round(exact)  # Python rounds Fractions half to even
            want = max(-(2**52 - 1), min(2**52 - 1, want))
            assert g == want, (v, dtype)


def test_release_is_bit_identical_across_parquet_layouts_and_row_orders(tmp_path):
    """Same rows, shuffled and written with different row-group sizes (so different work items,
    batches and bundle orders): the exact bounded sums and the published table are identical.
    Every unit stays inside L0/Linf, so bounding keeps every row whatever the priorities."""
    from pipelines.release_pipeline import bounded_truth

    gen = np.random.default_rng(4)
    n = 3000
    users = [f"u{i // 2}" for i in range(n)]  # 2 rows per user
    regions = [("north", "south")[i % 2] for i in range(n)]  # one row in each of 2 regions (L0 = 2)
    amounts = (gen.choice([1e6, -1e6, 0.1, 3e-7, 7.7], n) * gen.uniform(0.5, 1, n)).tolist()
    metrics = [{"type": "sum", "column": "amount", "bounds": [-1e6, 1e6]},
               {"type": "variance", "column": "amount", "bounds": [-1e6, 1e6]}]
    spec = write_spec(tmp_path, metrics, {"columns": ["region"], "public": ["north", "south"]}, l0=2, linf=1)
    outs = []
    for trial, rg in enumerate((None, 1000, 317)):
        perm = gen.permutation(n) if trial else np.arange(n)
        table = pa.table({"user_id": [users[i] for i in perm], "region": [regions[i] for i in perm],
                          "amount": [amounts[i] for i in perm], "category": ["x"] * n})
        path = tmp_path / f"in{trial}" / "2024-01-01.parquet"
        path.parent.mkdir()
        pq.write_table(table, path, row_group_size=rg)
        req = request(spec, [path], tmp_path / f"stage{trial}")
        keys, acc = bounded_truth(req)
        df, _, _ = run(req)
        outs.append((keys, acc, df))
    keys0, acc0, df0 = outs[0]
    plan = plan_release(load_spec(spec))
    for keys, acc, df in outs[1:]:
        assert keys == keys0
        for m in plan.metrics:
            for v in m.vectors:
                assert np.array_equal(acc[v.accumulator], acc0[v.accumulator]), v.accumulator
        assert df.equals(df0)


def test_fixed_point_noise_refuses_wrong_inputs():
    params = mech.laplace_mechanism(1.0, 1.0, integer_valued=False)
    with pytest.raises(mech.InvalidParameter, match="power of two"):
        mech.lattice_of_fixed(np.array([1], np.int64), 0.3, params)
    with pytest.raises(mech.InvalidParameter, match="integers"):
        mech.lattice_of_fixed(np.array([1.5]), 2.0**-20, params)
    with pytest.raises(mech.InvalidParameter, match="real-valued"):
        mech.lattice_of_fixed(np.array([1], np.int64), 1.0, mech.laplace_mechanism(1.0, 1.0, integer_valued=True))
    noisy = mech.add_noise_fixed(np.array([3 * 2**20], np.int64), 2.0**-20, params, test_random(1, ("f",)))
    assert noisy.dtype == np.float64 and float(noisy[0] / params.resolution).is_integer()


@pytest.mark.parametrize("adjacency", ["add_remove", "replace"])
def test_random_neighbours_never_exceed_the_charge(adjacency):
    """Random datasets and bounds (not multiples of the grid), a unit with rows at, inside and
    beyond its bounds: the L1 lattice difference of every sum vector stays within its charge."""
    gen = np.random.default_rng(8 if adjacency == "add_remove" else 9)
    for trial in range(12):
        lo = float(gen.choice([-3.7, 0.0, 0.1, -1e5, 2.5e-4]))
        hi = lo + float(gen.choice([0.3, 1.0, 7.9, 1e6]))
        l0, linf = int(gen.integers(1, 4)), int(gen.integers(1, 4))
        doc = {**ATTACK_SPEC, "contribution": {"max_partitions_per_unit": l0, "max_rows_per_unit_per_partition": linf},
               "privacy_unit": {**ATTACK_SPEC["privacy_unit"], "adjacency": adjacency},
               "partitions": {"columns": ["p"], "public": [f"q{i}" for i in range(6)]},
               "metrics": [{"type": t, "column": "v", "bounds": [lo, hi]} for t in ("sum", "mean", "variance")]}
        plan = plan_release(parse_spec(doc, source="<random>"))
        _, _, sums, _, _ = metric_layout(plan)
        agg = AggregationSpec(l0=l0, linf=linf, sums=sums)
        n = int(gen.integers(50, 400))
        base_vals = gen.uniform(lo - (hi - lo), hi + (hi - lo), n)
        base = _rows(base_vals, parts=gen.integers(0, 6, n), units=gen.integers(10, 60, n), seed=trial)

        def unit_rows(uid, seed):
            g2 = np.random.default_rng(seed)
            k = int(g2.integers(1, 3 * l0 * linf + 2))
            vals = g2.choice([lo, hi, (lo + hi) / 2, lo - 5 * (hi - lo), hi + 5 * (hi - lo)], k)
            return _rows(vals, parts=g2.integers(0, 6, k), units=np.full(k, uid), seed=seed + 1000)

        u = unit_rows(1, trial)
        worlds = [base, {k: np.concatenate([base[k], u[k]]) for k in base}]
        if adjacency == "replace":
            worlds[0] = worlds[1]
            worlds[1] = {k: np.concatenate([base[k], unit_rows(2, trial + 500)[k]]) for k in base}
        lattices = []
        for rows in worlds:
            parts, acc, _ = aggregate_bucket(rows, agg)
            out = {}
            for m in plan.metrics:
                for v in m.vectors:
                    kind = v.accumulator.split(":")[0]
                    if kind in bounding.SUM_KINDS:
                        lat = mech.lattice_of_fixed(acc[v.accumulator], sum_unit(kind, lo, hi), v.params)
                        out[v.accumulator] = (dict(zip(parts.tolist(), lat.tolist())), v.params)
            lattices.append(out)
        for name, (d0, params) in lattices[0].items():
            d1 = lattices[1][name][0]
            diff = sum(abs(d1.get(p, 0) - d0.get(p, 0)) for p in set(d0) | set(d1))
            assert diff <= params.l1_sensitivity / params.resolution, (trial, name, lo, hi, l0, linf)
