"""Contribution bounding and pre-aggregation (numpy only, no Beam): exact, maximal, uniform."""

from __future__ import annotations

import numpy as np
import pytest

from dpops.noise.randomness import test_random
from pipelines.bounding import (
    AggregationSpec,
    aggregate_bucket,
    bound_contributions,
    merge_partials,
    pair_priority,
    pair_salt,
    sum_unit,
)


def _rows(units, parts, values=None, seed=0):
    rng = test_random(seed, ("rows",))
    u = np.array([hash_u(x) for x in units], dtype=np.uint64)
    p = np.array([hash_u("p" + str(x)) for x in parts], dtype=np.uint64)
    rows = {"u": u, "p": p, "prio": rng.uint64(len(u)), "pp": pair_priority(u, p, pair_salt(rng))}
    if values is not None:
        rows["v:amount"] = np.asarray(values, dtype=np.float64)
    return rows


def hash_u(s: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")


def test_hand_checked_bounds_and_clamping():
    # unit A: 10 rows in partition 1; unit B: one row in each of 9 partitions; unit C: one huge value.
    units = ["A"] * 10 + ["B"] * 9 + ["C"]
    parts = [1] * 10 + list(range(1, 10)) + [2]
    values = [5.0] * 10 + [1.0] * 9 + [500.0]
    spec = AggregationSpec(l0=3, linf=2, sums=(("sum:s", "amount", 0.0, 100.0, "sum"),))
    parts_out, acc, stats = aggregate_bucket(_rows(units, parts, values), spec)
    assert acc["count"].sum() == 2 + 3 + 1  # A keeps Linf=2 rows, B keeps L0=3 partitions, C its row
    assert acc["unit_count"].sum() == 1 + 3 + 1
    # sums are exact integer multiples of the grid step g = sum_unit (here 2^-24: 100 <= 2^7 = 2^31 g)
    assert sum_unit("sum", 0.0, 100.0) == 2.0**-24
    assert acc["sum:s"].dtype == np.int64
    assert int(acc["sum:s"].sum()) == (2 * 5 + 3 * 1 + 100) * 2**24  # C's 500 clamped to 100
    assert stats["rows_dropped_linf"] == 8 and stats["rows_dropped_l0"] == 6 and stats["values_clamped"] == 1
    p1 = parts_out.tolist().index(hash_u("p1"))
    assert acc["count"][p1] in (2, 3)  # A's 2 rows, plus B's row if B kept partition 1


def test_bounds_hold_and_are_maximal_on_random_data():
    gen = np.random.default_rng(3)
    for trial in range(20):
        n = int(gen.integers(1, 400))
        units = [f"u{x}" for x in gen.integers(0, 15, n)]
        parts = list(gen.integers(0, 12, n))
        l0, linf = int(gen.integers(1, 5)), int(gen.integers(1, 4))
        rows = _rows(units, parts, seed=trial)
        kept, pair_parts, _ = bound_contributions(rows["u"], rows["p"], rows["prio"], l0, linf, rows["pp"])
        assert len(set(kept.tolist())) == len(kept)
        ku, kp = rows["u"][kept], rows["p"][kept]
        for unit in set(rows["u"].tolist()):
            mine = ku == unit
            pairs_all = set(rows["p"][rows["u"] == unit].tolist())
            kept_parts = set(kp[mine].tolist())
            assert len(kept_parts) == min(l0, len(pairs_all))  # at most L0, and no partition wasted
            for part in kept_parts:
                have = int(np.count_nonzero((rows["u"] == unit) & (rows["p"] == part)))
                assert int(np.count_nonzero(mine & (kp == part))) == min(linf, have)
        assert len(pair_parts) == len(set(zip(ku.tolist(), kp.tolist())))


def test_choice_is_uniform():
    # One unit in 4 partitions with L0 = 2: each partition must be kept with probability 1/2; one
    # pair with 3 rows and Linf = 1: each row kept with probability 1/3. 3000 independent streams:
    # binomial sd <= 0.0092, threshold 0.045 (> 4.8 sd): false-failure rate < 1e-5 over all 7 checks.
    trials = 3000
    kept_part = np.zeros(4)
    kept_row = np.zeros(3)
    units = ["A"] * 4 + ["B"] * 3
    parts = [0, 1, 2, 3, 9, 9, 9]
    base = _rows(units, parts)
    for t in range(trials):
        rng = test_random(t, ("uniform",))
        prio = rng.uint64(len(units))
        pp = pair_priority(base["u"], base["p"], pair_salt(rng))  # a fresh run salt per trial
        kept, _, _ = bound_contributions(base["u"], base["p"], prio, 2, 1, pp)
        s = set(kept.tolist())
        kept_part += [i in s for i in range(4)]
        kept_row += [i in s for i in range(4, 7)]
    assert np.all(np.abs(kept_part / trials - 0.5) < 0.045), kept_part / trials
    assert np.all(np.abs(kept_row / trials - 1 / 3) < 0.045), kept_row / trials


def test_histograms_categories_and_merge_order():
    spec = AggregationSpec(l0=5, linf=5, hists=(("hist:q", "amount", 0.0, 10.0, 10),), cats=(("cat:t", "cat", 3),))
    rows = _rows(["A", "A", "B"], [1, 1, 1], [0.0, 9.5, 10.0])
    rows["c:cat"] = np.array([0, -1, 2], dtype=np.int16)  # -1: outside the declared domain
    parts, acc, _ = aggregate_bucket(rows, spec)
    assert acc["hist:q"].tolist() == [[1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]]  # 0.0 -> c0; 9.5, 10.0 -> c10
    assert acc["cat:t"].tolist() == [[1, 0, 1]]
    merged_parts, merged = merge_partials([(parts, acc), (parts, acc)])
    assert merged["hist:q"].sum() == 6 and merged["count"].tolist() == [6]


def test_hashes_are_stable_across_processes():
    # Bucket/shard placement and public-partition matching rely on hashes that do not change
    # between worker processes (Python's salted hash() would).
    import subprocess
    import sys

    import pyarrow as pa

    from pipelines.io import combine_hashes, hash_column

    code = ("import pyarrow as pa; from pipelines.io import hash_column, combine_hashes; "
            "h = combine_hashes([hash_column(pa.array(['a', 'b', None]), 'string'), "
            "hash_column(pa.array([1, 2, 3]), 'int')]); print(','.join(map(str, h.tolist())))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout.strip()
    here = combine_hashes([hash_column(pa.array(["a", "b", None]), "string"), hash_column(pa.array([1, 2, 3]), "int")])
    assert out == ",".join(map(str, here.tolist()))
    assert len(set(here.tolist())) == 3
    # dictionary-encoded and plain strings hash alike (Parquet may give either)
    plain = hash_column(pa.array(["x", "y", "x"]), "string")
    dic = hash_column(pa.array(["x", "y", "x"]).dictionary_encode(), "string")
    assert plain.tolist() == dic.tolist()


# --------------------------------------------------------------------------- ranks once, filter per (L0, Linf)

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from fuzz_support import examples

from pipelines.bounding import contribution_ranks  # noqa: E402


def _oracle_keep(u, p, prio, pp, l0, linf) -> set[int]:
    """The bounding rule written out naively: per unit the l0 pairs of smallest (pair priority, partition
    hash), per kept pair the linf rows of smallest row priority (ties: input order)."""
    pairs: dict[tuple[int, int], list[int]] = {}
    for i in range(len(u)):
        pairs.setdefault((int(u[i]), int(p[i])), []).append(i)
    by_unit: dict[int, list[tuple[int, int]]] = {}
    for (uu, pp_) in pairs:
        by_unit.setdefault(uu, []).append((uu, pp_))
    keep: set[int] = set()
    for keys in by_unit.values():
        keys.sort(key=lambda k: (int(pp[pairs[k][0]]), k[1]))
        for k in keys[:l0]:
            rows = sorted(pairs[k], key=lambda i: (int(prio[i]), i))
            keep.update(rows[:linf])
    return keep


@st.composite
def _bounding_input(draw):
    n = draw(st.integers(0, 60))
    u = np.array(draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)), dtype=np.uint64)
    p = np.array(draw(st.lists(st.integers(0, 6), min_size=n, max_size=n)), dtype=np.uint64) + np.uint64(2**63)
    # an adversary's priorities: few distinct values, so ties within a pair are common
    prio = np.array(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)), dtype=np.uint64) << np.uint64(62)
    salt = draw(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)))
    return u, p, prio, pair_priority(u, p, salt)


@settings(max_examples=examples(300), deadline=None)
@given(data=_bounding_input(), l0_floor=st.integers(1, 4), linf_floor=st.integers(1, 4),
       bounds=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), min_size=1, max_size=6))
def test_ranks_filtered_at_any_bounds_keep_exactly_what_bound_contributions_keeps(data, l0_floor, linf_floor,
                                                                                   bounds):
    """One ranking (``contribution_ranks`` at the grid's smallest bounds) filtered at any (L0, Linf) at or
    above those floors keeps exactly the rows ``bound_contributions(L0, Linf)`` keeps, and both are the
    rule written out naively; what tune's one pass relies on (issue 20). Below the floor, it refuses."""
    u, p, prio, pp = data
    ranks = contribution_ranks(u, p, prio, pp, l0_floor=l0_floor, linf_floor=linf_floor)
    for dl0, dlinf in bounds:
        l0, linf = l0_floor + dl0, linf_floor + dlinf
        kept, kept_parts, stats = bound_contributions(u, p, prio, l0, linf, pp)
        mask = ranks.keep_mask(l0, linf)
        assert np.flatnonzero(mask).tolist() == kept.tolist()
        assert set(kept.tolist()) == _oracle_keep(u, p, prio, pp, l0, linf)
        pair_ok = ranks.pair_mask(l0)
        assert sorted(p[ranks.first[pair_ok]].tolist()) == sorted(kept_parts.tolist())
        assert stats["rows_dropped_l0"] == len(u) - int(np.count_nonzero(pair_ok[ranks.pair]))
    if l0_floor > 1:
        with pytest.raises(ValueError, match="cannot filter"):
            ranks.pair_mask(l0_floor - 1)
    if linf_floor > 1:
        with pytest.raises(ValueError, match="cannot filter"):
            ranks.row_mask(linf_floor - 1)


@settings(max_examples=examples(100), deadline=None)
@given(data=_bounding_input(), l0=st.integers(1, 4), linf=st.integers(1, 4))
def test_pair_codes_are_the_same_with_int32_and_int64_pair_keys(data, l0, linf):
    """``pair_keys`` narrows the keys to int32 when they fit (speed only): every rank, code and kept row is the
    same as with int64 keys, and both are the rule written out naively."""
    import pipelines.bounding as B

    u, p, prio, pp = data
    narrow = contribution_ranks(u, p, prio, pp, l0_floor=l0, linf_floor=linf)
    saved = B.PAIR_KEYS_INT32_MAX
    B.PAIR_KEYS_INT32_MAX = 0  # every key int64
    try:
        wide = contribution_ranks(u, p, prio, pp, l0_floor=l0, linf_floor=linf)
        kept, _parts, _stats = bound_contributions(u, p, prio, l0, linf, pp)
    finally:
        B.PAIR_KEYS_INT32_MAX = saved
    for name in ("ucode", "pcode", "pair", "first", "pair_unit", "row_rank", "pair_rank"):
        assert np.array_equal(getattr(narrow, name), getattr(wide, name)), name
    assert set(kept.tolist()) == _oracle_keep(u, p, prio, pp, l0, linf)


@pytest.mark.parametrize("n_units, n_parts", [(46_341, 46_340), (46_341, 46_341), (1, (1 << 31) - 1), (3, 1 << 40)])
def test_pair_keys_never_wrap(n_units, n_parts):
    """The largest key, n_units * n_parts - 1, whichever width ``pair_keys`` picks (int32 up to 2^31 - 1)."""
    from pipelines.bounding import pair_keys

    ucode = np.array([0, n_units - 1], dtype=np.int64)
    pcode = np.array([0, n_parts - 1], dtype=np.int64)
    keys = pair_keys(ucode, pcode, n_units, n_parts)
    assert [int(k) for k in keys] == [0, n_units * n_parts - 1]
    assert keys.dtype == (np.int32 if n_units * n_parts <= (1 << 31) - 1 else np.int64)


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.none() | st.text(max_size=12), min_size=1, max_size=30), st.booleans(), st.booleans())
def test_a_string_hashes_as_pandas_hashes_the_python_str(values, dictionary, large):
    """A string's hash is pandas' SipHash of the Python str (``hash_array``, fixed key), whatever Arrow layout
    carries it (plain, dictionary, large): the hashes decide units, buckets and pair priorities, so a reader
    change that made them differ would change every bounding choice. (A null's hash is not used: its row is
    dropped as a null unit or partition before anything is hashed into a key.)"""
    import pandas as pd
    import pyarrow as pa

    from pipelines.io import hash_column

    arr = pa.array(values, type=pa.large_string() if large else pa.string())
    if dictionary:
        arr = arr.dictionary_encode()
    want = pd.util.hash_array(np.array([v for v in values], dtype=object), categorize=False)
    got = hash_column(arr, "string")
    present = [i for i, v in enumerate(values) if v is not None]
    assert got[present].tolist() == want[present].tolist()


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.none() | st.text(max_size=6), min_size=0, max_size=20) |
       st.lists(st.none() | st.integers(-2**63, 2**63 - 1), max_size=20) |
       st.lists(st.none() | st.floats(allow_nan=False), max_size=20), st.booleans())
def test_partition_names_are_the_values_as_python_gives_them(values, dictionary):
    """The names a batch reports for its partitions (``_values_list``, a speed-up for dictionary arrays) are
    exactly ``to_pylist()`` of the column: the same values, types and nulls."""
    import pyarrow as pa

    import pipelines.io as pio

    arr = pa.array(values)
    if dictionary and len(values):
        arr = arr.dictionary_encode()
    got = pio._values_list(arr)
    assert got == arr.to_pylist() and [type(v) for v in got] == [type(v) for v in arr.to_pylist()]


@settings(max_examples=examples(40))
@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=60, unique=True), st.integers(1, 4), st.data())
def test_rows_of_distinct_units_get_the_pair_codes_of_the_general_path(units, n_parts, data):
    """When every row is its own unit, ``contribution_ranks`` takes the unit codes as the pair codes instead of
    factorizing the pair keys (one hash pass less over record-level data): they must be the codes that pass
    gives, and the bound must keep every row."""
    import pandas as pd

    from pipelines.bounding import pair_keys

    n = len(units)
    u = np.asarray(units, dtype=np.uint64)
    p = np.asarray(data.draw(st.lists(st.integers(0, n_parts - 1), min_size=n, max_size=n)), dtype=np.uint64)
    prio = np.asarray(data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n)), dtype=np.uint64)
    r = contribution_ranks(u, p, prio)
    ucode, uu = pd.factorize(u, sort=False)
    pcode, up = pd.factorize(p, sort=False)
    want, _ = pd.factorize(pair_keys(ucode, pcode, len(uu), len(up)), sort=False)
    assert np.array_equal(r.pair, want) and np.array_equal(r.first, np.arange(n))
    assert r.keep_mask(1, 1).all()
