"""The estimation's counts are additive over units and equal the per-unit definitions (issue 27 item 1).

What makes the Beam engine's bounds equal the driver's: each mechanism's counts (``GridCounts``/``ValueCounts``)
over all rows equal the sum of the counts over any split of the units into buckets, with each bucket's rows
split into batches whose pair tables are merged (``PairTable.merge``) as the workers' combiners do. And the
counts equal their definitions written directly (pandas groupby per unit, ``bound_contributions`` on all
rows at once), which is what the estimator computed before the counts existed.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from dpops.analysis.estimate import PairTable, RowCounts, contribution_grid, value_counts_of, value_grid
from fuzz_support import examples
from pipelines.bounding import bound_contributions, pair_priority

NO_ROW_LIMIT = 1 << 62


@st.composite
def rows_and_split(draw):
    n = draw(st.integers(0, 400))
    seed = draw(st.integers(0, 2**32 - 1))
    g = np.random.default_rng(seed)
    units = draw(st.integers(1, 40))
    parts = draw(st.integers(1, 12))
    u = (g.integers(0, units, n).astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    p = g.integers(0, parts, n).astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9) + np.uint64(3)
    rows = {"u": u, "p": p, "prio": g.integers(0, 2**63, n).astype(np.uint64),
            "pp": pair_priority(u, p, (int(g.integers(0, 2**62)), int(g.integers(0, 2**62)))),
            "v:x": np.round(g.normal(0, 8, n), int(draw(st.integers(0, 3))))}  # rounding puts values on grid points
    buckets = draw(st.integers(1, 5))
    batches = draw(st.integers(1, 4))
    return rows, buckets, batches, seed


def _direct_l0(rows, grid):
    df = pd.DataFrame({"u": rows["u"], "p": rows["p"]}).drop_duplicates()
    per_unit = df.groupby("u").size().to_numpy(np.int64)
    return np.searchsorted(np.sort(per_unit), grid, side="right"), per_unit.size


def _direct_linf(rows, l0, grid):
    kept, _, _ = bound_contributions(rows["u"], rows["p"], rows["prio"], l0, NO_ROW_LIMIT, rows["pp"])
    df = pd.DataFrame({"u": rows["u"][kept], "p": rows["p"][kept]})
    per_unit = df.groupby(["u", "p"]).size().groupby(level=0).max().to_numpy(np.int64) if len(df) else np.zeros(0)
    return np.searchsorted(np.sort(per_unit), grid, side="right"), per_unit.size


@settings(max_examples=examples(60), deadline=None)
@given(rows_and_split())
def test_counts_are_their_definitions_and_add_up_over_any_split_of_the_units(case):
    rows, buckets, batches, seed = case
    g0, g1, gv = contribution_grid(16), contribution_grid(16), value_grid()
    whole = RowCounts(rows)
    r, n = _direct_l0(rows, g0)
    c = whole.l0_counts(g0)
    assert c.n == n and np.array_equal(c.at_or_below, r)
    for l0 in (1, 2, 5):
        r, n = _direct_linf(rows, l0, g1)
        c = whole.linf_counts(l0, g1)
        assert c.n == n and np.array_equal(c.at_or_below, r)
    # the workers' way: units split into buckets, each bucket's rows into batches, pair tables merged per bucket
    g = np.random.default_rng(seed + 1)
    bucket_of_unit = {int(x): int(g.integers(0, buckets)) for x in np.unique(rows["u"])}
    key = np.array([bucket_of_unit[int(x)] for x in rows["u"]], dtype=np.int64)
    batch = g.integers(0, batches, len(rows["u"]))
    total_l0 = total_linf = None
    total_v = None
    for b in range(buckets):
        sel = key == b
        tables = [PairTable.of(rows["u"][sel & (batch == j)], rows["p"][sel & (batch == j)],
                               rows["pp"][sel & (batch == j)]) for j in range(batches)]
        table = PairTable.merge(tables)
        c0 = table.l0_counts(g0)
        c1 = table.linf_counts_at([2], g1)[2]
        part = {k: v[sel] for k, v in rows.items()}
        # pre-bounded per batch as the reader does, then bounded again per bucket (bounding is mergeable)
        pre = [np.flatnonzero(sel & (batch == j)) for j in range(batches)]
        kept = np.concatenate([ix[bound_contributions(rows["u"][ix], rows["p"][ix], rows["prio"][ix], 2, 3,
                                                      rows["pp"][ix])[0]] for ix in pre]) if pre else np.zeros(0, int)
        bounded = {k: v[np.sort(kept)] for k, v in rows.items()}
        cv = value_counts_of(bounded, 2, 3, ["x"], gv)["x"]
        assert value_counts_of(part, 2, 3, ["x"], gv)["x"].n == cv.n
        total_l0 = c0 if total_l0 is None else total_l0 + c0
        total_linf = c1 if total_linf is None else total_linf + c1
        total_v = cv if total_v is None else total_v + cv
    c = whole.l0_counts(g0)
    assert total_l0.n == c.n and np.array_equal(total_l0.at_or_below, c.at_or_below)
    c = whole.linf_counts(2, g1)
    assert total_linf.n == c.n and np.array_equal(total_linf.at_or_below, c.at_or_below)
    v = whole.value_counts(2, 3, ["x"], gv)["x"]
    assert total_v.n == v.n and np.array_equal(total_v.below, v.below) and np.array_equal(total_v.at_or_below,
                                                                                          v.at_or_below)


def _request(stage: str, public: np.ndarray):
    from dpops.release.pipeline_seam import EstimationCountsRequest
    from pipelines.io import ReadConfig

    read = ReadConfig(format="parquet", types={}, unit_column="u", partition_columns=(), value_columns=("x",))
    return EstimationCountsRequest(stage=stage, read=read, work_items=(), label=(), randomness="test", key_ref=None,
                                   key_id=None, test_seed=0, staging_dir="", grid_l0=tuple(int(x) for x in
                                                                                            contribution_grid(16)),
                                   grid_linf=tuple(int(x) for x in contribution_grid(16)), l0=2, linf=3,
                                   columns=("x",), public_hashes=tuple(int(x) for x in public),
                                   histograms=("units", "pairs", "partitions", "values:x"), max_linf=16)


@settings(max_examples=examples(60), deadline=None)
@given(rows_and_split())
def test_the_workers_reduce_write_and_count_steps_sum_to_the_counts_of_all_rows(case):
    """``pipelines.estimation``'s own steps (a batch reduced as the reader does, a bucket's reduced batches merged
    and counted, the buckets' counts documents added, the document read back) give, for each pass, exactly what
    the driver computes over all rows at once; and the value counts, computed from each value's two grid cells
    (``value_codes``), are their definition over the rows bounding keeps (#{v < c} and #{v <= c})."""
    from dpops.analysis.estimate import exact_histograms_of_rows
    from pipelines.estimation import add_counts, count_rows, counts_of_document, empty_rows, merge_reduced, reduce_batch

    rows, buckets, batches, seed = case
    g0, g1, gv = contribution_grid(16), contribution_grid(16), value_grid()
    public = np.unique(rows["p"])[::-1]  # plan order need not be sorted
    g = np.random.default_rng(seed + 2)
    bucket_of_unit = {int(x): int(g.integers(0, buckets)) for x in np.unique(rows["u"])}
    key = np.array([bucket_of_unit[int(x)] for x in rows["u"]], dtype=np.int64)
    batch = g.integers(0, batches, len(rows["u"]))
    kept, _, _ = bound_contributions(rows["u"], rows["p"], rows["prio"], 2, 3, rows["pp"])
    v = np.sort(rows["v:x"][kept])
    for stage in ("pairs", "values", "error"):
        req = _request(stage, public)
        doc = None
        for b in range(buckets):
            reduced = [reduce_batch(req, {k: x[(key == b) & (batch == j)] for k, x in rows.items()})
                       for j in range(batches)]
            c = count_rows(req, merge_reduced(req, reduced))
            doc = c if doc is None else add_counts(doc, c)
        got = counts_of_document(req, doc if doc is not None else count_rows(req, empty_rows(req)))
        whole = RowCounts(rows)
        if stage == "pairs":
            assert got.l0 is not None and got.l0.n == whole.l0_counts(g0).n
            assert np.array_equal(got.l0.at_or_below, whole.l0_counts(g0).at_or_below)
            for l0 in g0:
                w = whole.linf_counts(int(l0), g1)
                assert got.linf[int(l0)].n == w.n and np.array_equal(got.linf[int(l0)].at_or_below, w.at_or_below)
        elif stage == "values":
            vc = got.values["x"]
            assert vc.n == v.size
            assert np.array_equal(vc.below, np.searchsorted(v, gv, side="left"))
            assert np.array_equal(vc.at_or_below, np.searchsorted(v, gv, side="right"))
        else:
            exact = exact_histograms_of_rows(rows, public, req.histograms, 16)
            assert got.histograms is not None and got.histograms.names() == exact.names()
            for name in exact.names():
                assert np.array_equal(got.histograms.get(name), exact.get(name)), name
