"""Issue 25, "nothing data-dependent after the charge": every accepted extreme either runs or is refused first.

After ``ledger.start`` only a machine fault may stop a run (README): a parameter the spec accepted but a
mechanism cannot run with burns the budget and leaves the interval charged and unpublishable. So for every
metric type x noise x extreme of what ``dpops.spec`` accepts, this test asserts one of two outcomes:

- refused by ``load_spec`` / ``plan_release`` (what ``spec check`` and ``prepare`` run, before any
  reservation), or
- computed: the pipeline's numpy core (``test_spec_property.numpy_core``: the reader, bounding, aggregation,
  selection and noise functions the Beam DoFns call) returns every output column for every partition.

The extremes, read off ``dpops/spec.py`` (which bounds epsilon only by > 0 and L0/Linf only by >= 1):

- epsilon on a ladder 2**0 .. 2**-48 (every power of two: the exponential mechanism's dyadic rate 2**-k
  crosses every k, which is how issue 25 item 6a's k = 63 was missed by a random search), and 1e-300;
- L0 = Linf up to 2**31 (L0*Linf*bound up to 2**115), value bounds at the accepted +-2**53 and 2**-53,
  below it (refused), one ulp wide, degenerate (lo = hi, 0 = 0) and one-sided;
- delta from the smallest double to 0.9; quantiles at 1e-12 and 1 - 1e-12 and 99 of them at once;
  top_k over a 40,000-value domain; split weights 1e-6 against 1000; the three private partition
  strategies;
- inputs: tiny, empty (no rows) and all-malformed (every row dropped by the reader's checks).

At least one path per mechanism also runs through the real steps (``prepare`` -> ``reserve`` -> ``compute``
(which calls ``ledger.start``) -> ``publish``, the Beam FnApiRunner, a SQLite ledger):
``test_real_steps_publish_at_the_extremes``; the estimator (``bounds: estimate``, issue 25 item 6b) runs
there too, inside ``prepare``, over tiny, all-malformed and empty input (issue 25 item 3).

Deterministic: test randomness with fixed seeds; no statistical assertion (nothing can fail by chance).
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
from test_spec_property import numpy_core

from dpops.errors import DpopsError
from dpops.release_plan import plan_release
from dpops.spec import MAX_ABS_BOUND, MIN_ABS_BOUND, load_spec

REGIONS = ["north", "south"]
DOMAIN = [f"c{i}" for i in range(5)]
METRICS = ["count", "unit_count", "sum", "mean", "variance", "quantiles", "top_k"]
NOISES = ["laplace", "gaussian"]
EPS_LADDER = [2.0**-j for j in range(0, 49)] + [1e-300]


def _metric(kind: str, bounds: tuple[float, float] = (0.0, 100.0), quantiles: list[float] | None = None,
            k: int = 1, domain: list[str] | None = None) -> dict:
    m: dict = {"type": kind}
    if kind in ("sum", "mean", "variance", "quantiles"):
        m.update(column="x", bounds=[float(bounds[0]), float(bounds[1])])
    if kind == "quantiles":
        m["quantiles"] = quantiles or [0.0001, 0.5, 0.9999]
    if kind == "top_k":
        m.update(column="c", k=k, domain=domain or DOMAIN)
    return m


def _key(m: dict) -> str:
    return m["type"] if m["type"] in ("count", "unit_count") else f"{m['type']}_{m['column']}"


def spec_doc(metrics: list[dict], noise: str, eps: float, *, l0: int = 1, linf: int = 1, delta: float | None = None,
             private: str | None = None, split: dict[str, float] | None = None,
             adjacency: str = "add_remove") -> dict:
    """A day-interval spec over ``in.parquet`` (user_id, region, x, c)."""
    if delta is None:
        delta = 1e-10 if noise == "gaussian" or private else 0.0
    budget: dict = {"scope": "s", "epsilon": eps, "delta": delta, "noise": noise}
    if split:
        budget["split"] = split
    return {
        "name": "extremes",
        "input": {"path": "in.parquet", "format": "parquet",
                  "columns": {"user_id": "string", "region": "string", "x": "float", "c": "string"}},
        "privacy_unit": {"column": "user_id", "description": "a user", "adjacency": adjacency},
        "budget": budget,
        "contribution": {"max_partitions_per_unit": l0, "max_rows_per_unit_per_partition": linf},
        "partitions": ({"columns": ["region"], "private": {"strategy": private}} if private
                       else {"columns": ["region"], "public": REGIONS}),
        "metrics": metrics,
    }


def write_input(path: Path, kind: str) -> None:
    """``tiny``: 12 rows, values at and beyond every bound; ``empty``: no rows; ``malformed``: every row is
    dropped by the reader (null unit, null partition, NaN value, or a category outside the domain)."""
    if kind == "tiny":
        users = [f"u{i % 4}" for i in range(12)]
        regions = [REGIONS[i % 2] for i in range(12)]
        xs = [0.0, -1e300, 1e300, 3.5, 2.0**60, -2.0**60, 5.0, 1e-300, 100.0, -100.0, 42.0, 7.0]
        cs = [DOMAIN[i % 5] for i in range(12)]
    elif kind == "empty":
        users, regions, xs, cs = [], [], [], []
    else:
        users = [None, "u1", "u2", None]
        regions = ["north", None, "south", "south"]
        xs = [1.0, 2.0, float("nan"), float("inf")]
        cs = ["c0", "c1", "zz", None]
    pq.write_table(pa.table({"user_id": pa.array(users, pa.string()), "region": pa.array(regions, pa.string()),
                             "x": pa.array(xs, pa.float64()), "c": pa.array(cs, pa.string())}), path)


def run_or_refuse(tmp_path: Path, doc: dict, inputs: tuple[str, ...] = ("tiny",)) -> str:
    """'refused' (before any reservation) or 'computed' (every column, every partition), else the test fails."""
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(doc))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "delta above 1e-5" is a warning by design
            plan_release(load_spec(spec_path))
    except DpopsError:
        return "refused"
    for kind in inputs:
        data = tmp_path / "in.parquet"
        write_input(data, kind)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cols = numpy_core(spec_path, data)  # after the charge: must not raise
        if "public" in doc["partitions"]:
            assert sorted(cols["region"]) == sorted(REGIONS), kind
        n = len(cols["region"])
        for m in doc["metrics"]:
            produced = [c for c in cols if c == _key(m) or c.startswith(_key(m) + "_")]
            assert produced and all(len(cols[c]) == n for c in produced), (kind, _key(m))
            for c in produced:
                vals = cols[c]
                if len(vals) and isinstance(vals[0], (float, np.floating)):
                    assert not any(math.isnan(float(v)) for v in vals), (kind, c)  # a noisy value is never NaN
    return "computed"


@pytest.mark.parametrize("noise", NOISES)
@pytest.mark.parametrize("metric", METRICS)
def test_epsilon_ladder(tmp_path, metric, noise):
    # every rung for the exponential mechanism (its exact path rounds the rate to 2**-k: each k is a case),
    # every fourth for the additive noise (whose lattice scale keeps 40 bits at any epsilon)
    ladder = EPS_LADDER if metric in ("quantiles", "top_k") else EPS_LADDER[::4] + EPS_LADDER[-1:]
    outcomes = [run_or_refuse(tmp_path, spec_doc([_metric(metric)], noise, eps)) for eps in ladder]
    assert outcomes[0] == "computed"  # the ladder starts where every mechanism runs


@pytest.mark.parametrize("noise", NOISES)
@pytest.mark.parametrize("metric", METRICS)
def test_contribution_bounds_up_to_2_31(tmp_path, metric, noise):
    for bound in (1000, 10**6, 2**31):
        for eps in (1.0, 1e-5):
            run_or_refuse(tmp_path, spec_doc([_metric(metric)], noise, eps, l0=bound, linf=bound))
    for eps in (1.0, 1e-5):  # replace doubles every sensitivity
        run_or_refuse(tmp_path, spec_doc([_metric(metric)], noise, eps, l0=2**31, linf=2**31, adjacency="replace"))


VALUE_BOUNDS = [(-MAX_ABS_BOUND, MAX_ABS_BOUND), (0.0, MAX_ABS_BOUND), (MAX_ABS_BOUND - 1, MAX_ABS_BOUND),
                (0.0, MIN_ABS_BOUND), (-MIN_ABS_BOUND, MIN_ABS_BOUND), (1.0, 1.0 + 2.0**-52), (5.0, 5.0),
                (0.0, 0.0), (-MAX_ABS_BOUND, -MAX_ABS_BOUND), (-1e-300, 0.0), (-1e-300, 100.0)]


@pytest.mark.parametrize("noise", NOISES)
@pytest.mark.parametrize("metric", ["sum", "mean", "variance", "quantiles"])
def test_value_bounds(tmp_path, metric, noise):
    for bounds in VALUE_BOUNDS:
        for eps, bound in ((1.0, 1), (1e-6, 1000), (100.0, 2**31)):
            run_or_refuse(tmp_path, spec_doc([_metric(metric, bounds)], noise, eps, l0=bound, linf=bound))


@pytest.mark.parametrize("noise", NOISES)
def test_delta_extremes(tmp_path, noise):
    metrics = [_metric(m) for m in METRICS]
    for delta in (5e-324, 1e-300, 1e-15, 0.9):
        for eps in (1.0, 1e-6):
            run_or_refuse(tmp_path, spec_doc(metrics, noise, eps, delta=delta))


@pytest.mark.parametrize("noise", NOISES)
def test_quantile_counts_and_extreme_quantiles(tmp_path, noise):
    many = [round(i / 100, 2) for i in range(1, 100)]
    for qs in ([1e-12], [1 - 1e-12], [1e-12, 0.5, 1 - 1e-12], many):
        for eps in (1.0, 2.0**-31, 1e-9):
            run_or_refuse(tmp_path, spec_doc([_metric("quantiles", quantiles=qs)], noise, eps, linf=1000))


def test_top_k_sizes(tmp_path):
    big = [f"v{i}" for i in range(40_000)]
    # a domain beyond int16 codes and 256 candidates (the vectorised path) costs ~5 s a partition: one case
    for domain, k, eps in ((DOMAIN, 5, 1.0), (DOMAIN, 5, 2.0**-31), (DOMAIN, 5, 1e-12), (big, 1, 2.0**-31)):
        run_or_refuse(tmp_path, spec_doc([_metric("top_k", k=k, domain=domain)], "laplace", eps, linf=1000))


@pytest.mark.parametrize("noise", NOISES)
def test_share_splits(tmp_path, noise):
    metrics = [_metric(m) for m in METRICS]
    for tiny_key in ("count", "quantiles_x", "top_k_c", "sum_x"):
        split = {_key(m): (1e-6 if _key(m) == tiny_key else 1000.0) for m in metrics}
        for eps in (1.0, 1e-3):
            run_or_refuse(tmp_path, spec_doc(metrics, noise, eps, split=split, l0=1000, linf=1000))


@pytest.mark.parametrize("strategy", ["truncated_geometric", "laplace_threshold", "gaussian_threshold"])
def test_private_partitions(tmp_path, strategy):
    metrics = [_metric(m) for m in ("count", "sum", "quantiles")]
    for eps, delta, bound in ((1.0, 1e-10, 1), (1e-6, 1e-10, 1000), (1e-3, 5e-324, 2**31), (50.0, 0.9, 1)):
        run_or_refuse(tmp_path, spec_doc(metrics, "laplace", eps, delta=delta, private=strategy, l0=bound,
                                         linf=bound))


@pytest.mark.parametrize("noise", NOISES)
def test_empty_and_all_malformed_inputs(tmp_path, noise):
    metrics = [_metric(m) for m in METRICS]
    for eps, bound in ((1.0, 1), (2.0**-31, 1000)):
        run_or_refuse(tmp_path, spec_doc(metrics, noise, eps, l0=bound, linf=bound), inputs=("empty", "malformed"))
    for strategy in ("truncated_geometric", "laplace_threshold", "gaussian_threshold"):
        run_or_refuse(tmp_path, spec_doc(metrics, noise, 1.0, private=strategy), inputs=("empty", "malformed"))


# --------------------------------------------------------------------------- the real steps, Beam and ledger

IV = ("2024-01-01", "2024-01-02")
ALL_METRICS = [_metric(m) for m in METRICS]
ESTIMATED = [m if "bounds" not in m else {**m, "bounds": "estimate", "fallback_bounds": [-100.0, 100.0]}
             for m in ALL_METRICS]
ESTIMATED_SPLIT = {**{_key(m): 1.0 for m in ESTIMATED}, **{f"{_key(m)}.bounds": 1.0 for m in ESTIMATED if "bounds" in m}}


def smallest_accepted_epsilon(doc: dict, tmp_path: Path) -> float:
    """The spec's minimum epsilon: the smallest rung of the ladder that ``load_spec`` + ``plan_release`` accept."""
    accepted = []
    for eps in EPS_LADDER:
        path = tmp_path / "probe.yaml"
        path.write_text(yaml.safe_dump({**doc, "budget": {**doc["budget"], "epsilon": eps}}))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan_release(load_spec(path))
        except DpopsError:
            continue
        accepted.append(eps)
    assert accepted, "no rung of the ladder is accepted"
    return min(accepted)


REAL = {  # one path per mechanism: discrete Laplace and Gaussian, exponential (quantiles, top_k), the three
    # partition selections, and the estimator (issue 25 item 6b: L0 = Linf = 1000 at epsilon 1e-5);
    # (spec, run at the smallest accepted epsilon of the ladder?, input)
    "laplace_public_estimated": (spec_doc(ESTIMATED, "laplace", 1e-5, l0=1000, linf=1000, split=ESTIMATED_SPLIT),
                                 False, "tiny"),
    "laplace_public_estimated_malformed": (spec_doc(ESTIMATED, "laplace", 1e-5, l0=1000, linf=1000,
                                                    split=ESTIMATED_SPLIT), False, "malformed"),
    "gaussian_public": (spec_doc(ALL_METRICS, "gaussian", 1.0, l0=1000, linf=1000), True, "tiny"),
    "gaussian_public_empty": (spec_doc(ALL_METRICS, "gaussian", 1.0, l0=1000, linf=1000), True, "empty"),
    "laplace_threshold": (spec_doc(ALL_METRICS, "laplace", 1.0, l0=1000, linf=1000, private="laplace_threshold"),
                          True, "tiny"),
    "gaussian_threshold": (spec_doc(ALL_METRICS, "gaussian", 1.0, l0=1000, linf=1000, private="gaussian_threshold"),
                           True, "tiny"),
    # truncated_geometric's table has ~2 ln(1/delta') / eps' entries: its extreme is the quick refusal
    # (test_spec_property.test_a_keep_table_too_long_is_refused_at_once); here a table of ~6,000 entries
    "truncated_geometric": (spec_doc(ALL_METRICS, "laplace", 1e-1, l0=10, linf=10, private="truncated_geometric"),
                            False, "tiny"),
}
# Issue 25 item 3: `bounds: estimate` over an interval with no data rows failed after the estimation's charge
# ("no rows to estimate from"); an empty interval is now data.
REAL["laplace_public_estimated_empty"] = (spec_doc(ESTIMATED, "laplace", 1e-5, l0=1000, linf=1000,
                                                   split=ESTIMATED_SPLIT), False, "empty")
REAL_CASES = sorted(REAL)


@pytest.mark.parametrize("case", REAL_CASES)
def test_real_steps_publish_at_the_extremes(tmp_path, monkeypatch, case):
    """prepare -> reserve -> compute (ledger.start, then the Beam job) -> publish, for specs ``spec check``
    accepts at their extremes: each must publish (the estimation, inside prepare, must commit)."""
    from dpops import release
    from dpops.ledger import ScopeDefinition, open_ledger
    from dpops.noise.randomness import NoiseKey

    doc, at_minimum, input_kind = REAL[case]
    doc = {**doc, "input": {**doc["input"], "path": "data/{start:%Y-%m-%d}.parquet"}}
    if at_minimum:
        doc["budget"] = {**doc["budget"], "epsilon": smallest_accepted_epsilon(doc, tmp_path)}
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(doc))
    (tmp_path / "data").mkdir()
    write_input(tmp_path / "data/2024-01-01.parquet", input_kind)
    key = tmp_path / "noise.key"
    NoiseKey.generate(key)
    monkeypatch.chdir(tmp_path)
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    ledger.create_scope(ScopeDefinition(name="s", unit="a user", unit_column="user_id", epsilon=2.0, delta=1e-6,
                                        rho=None, accountant="basic/1", adjacency="add_remove"), actor="test")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # every case here is one spec check accepts, so prepare must accept it too
            ctx = release.prepare(spec, *IV, key_path=str(key), ledger=ledger)
            assert release.reserve(ctx, ledger).state == "reserved"
            release.compute(ctx, ledger)  # ledger.start, then the pipeline: nothing may fail from here
            out = release.publish(ctx, ledger)
        assert out.state == "published", out.line()
        table = pq.read_table(next((tmp_path / "out/published").rglob("current/data.parquet")))
        for m in doc["metrics"]:
            assert any(c == _key(m) or c.startswith(_key(m) + "_") for c in table.column_names), _key(m)
        assert ledger.verify().ok
    finally:
        ledger.close()
