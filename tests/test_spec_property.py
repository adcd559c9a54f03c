"""Issue 11 item 5: for any spec ``dpops spec check`` accepts, the release core raises no parameter error.

Everything that can fail for a spec reason must fail before ``ledger.start`` (in ``spec check`` /
``prepare``): a parameter error afterwards burns the budget and can never publish. Hypothesis draws
specs across extreme epsilon/delta, bounds, contribution bounds, quantiles and top_k domains; each
one that parses and plans is run through the pipeline's numpy core (read, bound, aggregate,
select and noise; the same functions the Beam DoFns call) over a small random input.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from fuzz_support import examples

from dpops.release.pipeline_seam import ComputeRequest
from dpops.errors import DpopsError
from dpops.noise.randomness import test_random
from dpops.noise.selection import dp_quantile, exponential_mechanism
from dpops.spec import load_spec

REGIONS = ["north", "south", "east"]
START, END = "2024-01-01T00:00:00+00:00", "2024-01-02T00:00:00+00:00"

EPS = st.one_of(st.sampled_from([1e-6, 1e-4, 0.001, 0.1, 1.0, 10.0, 100.0]),
                st.floats(min_value=1e-6, max_value=100.0, allow_nan=False))
DELTA = st.sampled_from([0.0, 1e-15, 1e-10, 1e-7, 1e-5])
CONTRIB = st.one_of(st.sampled_from([1, 2, 10, 1000, 100_000]), st.integers(1, 5000))
BOUNDS = st.sampled_from([(0.0, 100.0), (-1e12, 1e12), (0.0, 1e-9), (-1e-3, 0.0), (5.0, 5.0), (-7.5, -2.5),
                          (1e6, 1e6 + 1), (-1.0, 1.0), (0.0, 2.0**53), (-1e300, 1e300)])
QUANTILES = st.lists(st.sampled_from([0.0001, 0.001, 0.01, 0.25, 0.5, 0.9, 0.999, 0.9999]), min_size=1, max_size=3,
                     unique=True)


@st.composite
def spec_docs(draw):
    record_level = draw(st.booleans())
    l0 = 1 if record_level else draw(CONTRIB)
    linf = 1 if record_level else draw(CONTRIB)
    noise = draw(st.sampled_from(["laplace", "gaussian"]))
    private = draw(st.booleans())
    int_domain = draw(st.booleans())
    domain_size = draw(st.sampled_from([1, 3, 3, 3, 40_000]))  # > 32767: the old int16 codes overflowed
    domain = list(range(domain_size)) if int_domain else [f"c{i}" for i in range(domain_size)]
    metrics = []
    for kind in draw(st.lists(st.sampled_from(["count", "unit_count", "sum", "mean", "variance", "quantiles",
                                               "top_k"]), min_size=1, max_size=4, unique=True)):
        if kind in ("count", "unit_count"):
            metrics.append({"type": kind})
        elif kind == "top_k":
            metrics.append({"type": "top_k", "column": "c", "k": draw(st.integers(1, min(3, domain_size))),
                            "domain": domain})
        else:
            lo, hi = draw(BOUNDS)
            m = {"type": kind, "column": "x", "bounds": [lo, hi]}
            if kind == "quantiles":
                m["quantiles"] = draw(QUANTILES)
            metrics.append(m)
    keys = [m["type"] if m["type"] in ("count", "unit_count") else f"{m['type']}_{m['column']}" for m in metrics]
    split = None
    if draw(st.booleans()):
        split = {k: draw(st.sampled_from([1e-6, 0.5, 1.0, 1000.0])) for k in keys}
    columns = {"user_id": "string", "region": "string", "x": "float", "c": "int" if int_domain else "string"}
    inp = {"path": "in.parquet", "format": "parquet", "columns": columns}
    if draw(st.booleans()):  # event-time filter on: rows outside the interval are dropped first
        columns["ts"] = "timestamp"
        inp["time_column"] = "ts"
    return {
        "name": "prop",
        "input": inp,
        "privacy_unit": {"column": "user_id", "description": "a user", "record_level": record_level,
                         "adjacency": draw(st.sampled_from(["add_remove", "replace"])),
                         "population": draw(st.sampled_from([None, 10, 10**9]))},
        "budget": {"scope": "s", "epsilon": draw(EPS), "delta": draw(DELTA), "noise": noise,
                   **({"split": split} if split else {})},
        "contribution": {"max_partitions_per_unit": l0, "max_rows_per_unit_per_partition": linf},
        "partitions": ({"columns": ["region"], "private": {"strategy": draw(st.sampled_from(
                           ["truncated_geometric", "laplace_threshold", "gaussian_threshold"]))}}
                       if private else {"columns": ["region"], "public": REGIONS[: draw(st.integers(1, 3))]}),
        "metrics": metrics,
        "postprocess": {"suppress_below": draw(st.sampled_from([None, 0.0, 5.0]))},
    }


# Issue 25 item 6a, found by Hypothesis on a fresh clone: a quantiles metric at a tiny epsilon whose dyadic
# rate has denominator exactly 2**63 (eps = 2**-31 for this input's utility range) failed after the charge.
ISSUE_25_6A = {
    "name": "prop",
    "input": {"path": "in.parquet", "format": "parquet",
              "columns": {"user_id": "string", "region": "string", "x": "float", "c": "string"}},
    "privacy_unit": {"column": "user_id", "description": "a user", "record_level": True, "adjacency": "add_remove",
                     "population": None},
    "budget": {"scope": "s", "epsilon": 2.0**-31, "delta": 0.0, "noise": "laplace"},
    "contribution": {"max_partitions_per_unit": 1, "max_rows_per_unit_per_partition": 1},
    "partitions": {"columns": ["region"], "public": REGIONS},
    "metrics": [{"type": "quantiles", "column": "x", "bounds": [0.0, 100.0], "quantiles": [0.5]}],
    "postprocess": {"suppress_below": None},
}


def _write_input(path: Path, rng: np.random.Generator, int_domain: bool, n: int = 60) -> None:
    users = rng.integers(0, 12, n)
    xs = rng.choice([0.0, -1e15, 1e15, 3.5, 5.0, -2.0, 2.0**60, float("nan")], n)
    cats = rng.integers(0, 5, n)
    day0 = 1_704_067_200_000_000  # 2024-01-01T00:00Z in us; times spread over the day before to the day after
    ts = day0 + rng.integers(-86_400_000_000, 2 * 86_400_000_000, n)
    pq.write_table(pa.table({
        "user_id": [f"u{u}" for u in users], "region": rng.choice(REGIONS + ["west"], n).tolist(), "x": xs,
        "c": cats.astype(np.int64) if int_domain else [f"c{c}" for c in cats],
        "ts": pa.array(ts, pa.timestamp("us", tz="UTC")),
    }), path)


def numpy_core(spec_path: Path, input_path: Path) -> dict:
    """The pipeline's stages without Beam: read/check/hash, bound+aggregate per bucket, select+noise."""
    from pipelines.bounding import aggregate_bucket, merge_partials
    from pipelines.io import iter_record_batches, prepare_batch, split_by_bucket, work_items
    from pipelines.release_pipeline import _empty_acc, build_context, select_and_noise
    from dpops.release_plan import plan_release

    spec = load_spec(spec_path)
    plan = plan_release(spec)
    label = {"release": spec.name, "spec_hash": spec.spec_hash, "interval_start": START, "interval_end": END,
             "input_fingerprint": "fp"}
    req = ComputeRequest(spec_path=str(spec_path), interval_start=START, interval_end=END,
                         input_paths=(str(input_path),), noise_label=label, randomness="test", test_seed=5)
    ctx = build_context(spec, plan, req, "")
    source = ctx.randomness.source()
    buckets: dict[int, list] = {}
    names: dict[int, tuple] = {}
    for item in work_items([str(input_path)], "parquet"):
        for seq, (batch, offset) in enumerate(iter_record_batches(item, ctx.read)):
            rows, (uniq, values), _ = prepare_batch(batch, item[0], offset, ctx.read,
                                                    source.child("bounding", item[0], item[2], seq),
                                                    pair_salt=ctx.randomness.pair_salt(source))
            for j, h in enumerate(uniq):
                names.setdefault(int(h), tuple(col[j] for col in values))
            for b, chunk in split_by_bucket(rows, ctx.read.n_buckets):
                buckets.setdefault(b, []).append(chunk)
    partials = []
    for b in sorted(buckets):
        rows = {k: np.concatenate([c[k] for c in buckets[b]]) for k in buckets[b][0]}
        parts, acc, _ = aggregate_bucket(rows, ctx.agg)
        partials.append((parts, acc))
    parts, acc = merge_partials(partials) if partials else (np.zeros(0, np.uint64), _empty_acc(ctx.agg))
    if not acc:
        acc = _empty_acc(ctx.agg)
    pub = np.array(sorted(ctx.public_names), dtype=np.uint64) if ctx.public_names is not None else None
    return select_and_noise(0, parts, acc, names, plan, pub, ctx.public_names, source)


@settings(max_examples=examples(50), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow, HealthCheck.data_too_large])
@given(doc=spec_docs(), seed=st.integers(0, 2**32 - 1))
@example(doc=ISSUE_25_6A, seed=0)
def test_accepted_specs_never_fail_with_a_parameter_error(tmp_path, doc, seed):
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(doc))
    # `dpops spec check` (and dpops.release.prepare): parse + plan. A refusal here is before any reservation.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            spec = load_spec(spec_path)
            from dpops.release_plan import plan_release

            plan_release(spec)
    except DpopsError:
        assume(False)
    _write_input(tmp_path / "in.parquet", np.random.default_rng(seed), doc["input"]["columns"]["c"] == "int")
    cols = numpy_core(spec_path, tmp_path / "in.parquet")  # must not raise
    n = len(cols["region"])
    if "public" in doc["partitions"]:
        assert sorted(cols["region"]) == sorted(doc["partitions"]["public"])  # every public partition, once
    for m in doc["metrics"]:
        key = m["type"] if m["type"] in ("count", "unit_count") else f"{m['type']}_{m['column']}"
        produced = [c for c in cols if c == key or c.startswith(key + "_")]
        assert produced and all(len(cols[c]) == n for c in produced)


def test_extreme_quantile_from_the_issue():
    """q = 0.0001, Linf = 1000, eps = 0.001 crashed after start (np.int64(1) << k for k >= 63)."""
    v = np.random.default_rng(0).uniform(0, 100, 5000)
    out = dp_quantile(v, 0, 100, 0.0001, 0.001, test_random(1), sensitivity=1000)
    assert 0 <= out <= 100
    # the exact path with 2**k beyond int64, on a tiny utility range: still a valid index, and the best
    # candidate wins when the rate is large enough relative to the gaps (sanity of the sampler)
    idx = exponential_mechanism(-np.arange(600, dtype=np.int64) * 10**9, 1e-12, 1.0, test_random(2))
    assert 0 <= idx < 600


@pytest.mark.parametrize("eps", [1e-3, 1e-9])
def test_tiny_rate_exponential_mechanism_is_near_uniform(eps):
    """At rate ~ 0 permute-and-flip is uniform: over 3000 draws from 400 candidates with utilities 0..-399
    and eps/(2*sens) = eps/2e9, each candidate's share stays within 6 binomial standard deviations."""
    rng = test_random(11)
    u = -np.arange(400, dtype=np.int64)
    draws = np.array([exponential_mechanism(u, eps, 1e9, rng) for _ in range(3000)])
    counts = np.bincount(draws, minlength=400)
    p = 1 / 400
    sd = math.sqrt(3000 * p * (1 - p))
    assert np.abs(counts - 3000 * p).max() < 6 * sd + 1


def test_bernoulli_exp_takes_a_denominator_of_2_63_exactly():
    """Issue 25 item 6a, at its root: numpy types the Python int 2**63 as uint64, and the samplers' int64
    conversion wrapped it to -2**63 ("bernoulli_exp needs num >= 0 and den >= 1" after the charge)."""
    from dpops.noise.samplers import bernoulli_exp

    out = bernoulli_exp(np.array([0, 1, 2**62], dtype=np.int64), 1 << 63, test_random(3))
    assert out.shape == (3,) and bool(out[0])  # exp(-0) = 1: always accepted
    assert bool(bernoulli_exp(np.array([2**64 + 5], dtype=object), 1 << 63, test_random(4))[0]) in (True, False)


def test_quantile_at_the_epsilon_where_the_rate_denominator_is_2_63():
    """Issue 25 item 6a through ``dp_quantile`` (1025 candidates: the vectorised ``_accept_in_order`` path).
    The dyadic rate's denominator is 2**k with k = 46 + j at eps = 2**-j for these 30 values (utility range
    2**16 * 15 < 2**20, so 30 bits of rate, e = -j - 17): j = 17 gives exactly 2**63; the ladder covers it."""
    v = np.random.default_rng(1).uniform(0, 100, 30)
    for j in range(10, 25):
        out = dp_quantile(v, 0, 100, 0.5, 2.0**-j, test_random(j))
        assert 0 <= out <= 100


def test_estimator_tail_penalty_beyond_int64_is_exact():
    """Issue 25 item 6b: L0 = Linf = 1000 (m = 10**6 rows per unit) at a tiny estimation epsilon made the
    public tail penalty step * beyond leave int64 (main refused it after the charge: "integer utilities
    must be below 2**62"). The choice is now made on exact Python-int utilities."""
    from dpops.analysis.estimate import quantile_choice, value_grid

    grid = value_grid()
    for seed in range(3):
        idx = quantile_choice(np.zeros(grid.size, np.int64), 0, 0.99, 1e-6, 10**6, test_random(seed), anchor=10)
        assert 0 <= idx < grid.size


def test_estimator_quantile_utility_of_a_huge_count_does_not_wrap():
    """The rank term S r(c) - Q n of the estimator's utility (S = 2**16) left int64 once n S reached 2**63 and
    wrapped silently: at n = 2**49 items the two far candidates (r = 0 and r = n, 2**64 utility units from the
    median) wrapped to utility 0, the median's own, and were picked as often as it. Exact Python ints now: the
    median is picked (a gap of 2**63 utility units at this epsilon is never crossed). Fails on the old code."""
    from dpops.analysis.estimate import quantile_choice

    n = 2**49
    at_or_below = np.array([0, n // 4, n // 2, 3 * n // 4, n], dtype=np.int64)
    for seed in range(20):
        assert quantile_choice(at_or_below, n, 0.5, 1.0, 1, test_random(seed), anchor=4) == 2


def test_exponential_mechanism_on_utilities_beyond_int64():
    """The exact path for Python-int utilities (what 6b's fix relies on): a gap of 2**70 utility units at
    rate 1/2 is never crossed, and equal huge utilities are picked uniformly (both seen in 400 draws;
    false-failure probability 2 * 2**-400)."""
    rng = test_random(9)
    far = np.array([0, -(2**70)], dtype=object)
    assert {exponential_mechanism(far, 1.0, 1.0, rng) for _ in range(50)} == {0}
    tie = np.array([2**70, 2**70], dtype=object)
    assert {exponential_mechanism(tie, 1.0, 1.0, rng) for _ in range(400)} == {0, 1}


def test_a_keep_table_too_long_is_refused_at_once():
    """truncated_geometric at eps/L0 = 1e-9 was refused only after building ten million table entries (20 s
    in the plan); the closed-form lower bound on the table's length refuses it at once, and a table the
    loop accepts is at least as long as that bound (so the shortcut never refuses a runnable one)."""
    import time

    from dpops.errors import InvalidParameter
    from dpops.noise.selection import PartitionSelection

    t0 = time.monotonic()
    with pytest.raises(InvalidParameter, match="too small"):
        PartitionSelection("truncated_geometric", 1e-6, 1e-10, 1000)
    assert time.monotonic() - t0 < 1.0
    for eps, delta in ((1e-3, 1e-5), (1e-4, 1e-10), (5e-5, 1e-14)):
        size = PartitionSelection("truncated_geometric", eps, delta)._table.size
        assert size >= 2 * math.log1p(math.expm1(eps) / (2 * delta)) / eps - 1
    # a delta per partition within the table's rounding margins (< 3.6e-15) is refused at once too
    t0 = time.monotonic()
    with pytest.raises(InvalidParameter, match="too small"):
        PartitionSelection("truncated_geometric", 5e-5, 1e-15)
    assert time.monotonic() - t0 < 1.0


def test_dp_quantile_of_a_huge_histogram_does_not_wrap():
    """``dp_quantile(histogram=True)``'s utility had the same int64 wrap at 2**49 rows: the first and last
    candidate's rank 0 wrapped to the median's utility 0. Exact now: it is never picked. Fails on the old code."""
    from dpops.noise.selection import dp_quantile, quantile_grid

    grid = quantile_grid(0.0, 4.0, 5)
    counts = np.zeros(grid.size, np.int64)
    counts[0] = counts[-1] = 2**48  # n = 2**49 rows; rank(c) = #{v < c}
    picks = {dp_quantile(counts, 0.0, 4.0, 0.5, 1.0, test_random(s), n_candidates=5, histogram=True)
             for s in range(20)}
    assert picks <= {float(g) for g in grid[1:]}  # rank 2**48 = n/2 from the second candidate on
