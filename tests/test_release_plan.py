"""The release plan: what the ledger charges must certify the spec's budget, and use the
sensitivities of dpops.noise.sensitivity."""

from __future__ import annotations

import json
import math

import pytest

from dpops.noise import sensitivity
from dpops.accounting import get_accountant, known_accountants
from dpops.release_plan import plan_release
from dpops.spec import parse_spec

ALL_METRICS = [
    {"type": "count"},
    {"type": "unit_count"},
    {"type": "sum", "column": "amount", "bounds": [0, 100]},
    {"type": "mean", "column": "amount", "bounds": [-10, 100]},
    {"type": "variance", "column": "amount", "bounds": [0, 50]},
    {"type": "quantiles", "column": "amount", "bounds": [0, 100], "quantiles": [0.5, 0.9]},
    {"type": "top_k", "column": "category", "k": 2, "domain": ["a", "b", "c"]},
]


def make_spec(metrics=None, *, adjacency="add_remove", noise="laplace", private=False, epsilon=1.0,
              delta=1e-7, l0=3, linf=2, split=None):
    doc = {
        "name": "plan_test",
        "input": {"path": "in/{start:%Y-%m-%d}.parquet", "format": "parquet",
                  "columns": {"user_id": "string", "region": "string", "amount": "float", "category": "string"}},
        "privacy_unit": {"column": "user_id", "description": "a user", "adjacency": adjacency},
        "budget": {"scope": "s", "epsilon": epsilon, "delta": delta, "noise": noise},
        "contribution": {"max_partitions_per_unit": l0, "max_rows_per_unit_per_partition": linf},
        "partitions": {"columns": ["region"]},
        "metrics": metrics if metrics is not None else ALL_METRICS,
    }
    if split:
        doc["budget"]["split"] = split
    if private:
        doc["partitions"]["private"] = {"strategy": "truncated_geometric"}
    else:
        doc["partitions"]["public"] = ["north", "south"]
    return parse_spec(doc)


@pytest.mark.parametrize("adjacency", ["add_remove", "replace"])
@pytest.mark.parametrize("noise", ["laplace", "gaussian"])
@pytest.mark.parametrize("private", [False, True])
@pytest.mark.parametrize("metric", ALL_METRICS, ids=[m["type"] for m in ALL_METRICS])
def test_events_certify_the_budget_under_every_accountant(adjacency, noise, private, metric):
    spec = make_spec([metric], adjacency=adjacency, noise=noise, private=private)
    plan = plan_release(spec)
    assert plan.events
    # pld is checked separately on fewer cases: its discrete-Gaussian PLD takes ~20 s on fine grids
    for ref in [r for r in known_accountants() if not r.startswith("pld")]:
        eps = get_accountant(ref).epsilon(plan.events, spec.budget.delta)
        assert eps <= spec.budget.epsilon, (ref, eps)
    # and the budget is actually used (not silently wasted): basic is within 1e-6 for pure/approx plans
    if noise == "laplace":
        assert plan.total_epsilon("basic") >= spec.budget.epsilon * (1 - 1e-6)


@pytest.mark.parametrize("adjacency", ["add_remove", "replace"])
@pytest.mark.parametrize("noise", ["laplace", "gaussian"])
def test_pld_accountant_certifies_too(adjacency, noise):
    metrics = ALL_METRICS if noise == "laplace" else [{"type": "count"}, {"type": "unit_count"}]
    spec = make_spec(metrics, adjacency=adjacency, noise=noise, private=True)
    plan = plan_release(spec)
    for ref in [r for r in known_accountants() if r.startswith("pld")]:
        assert get_accountant(ref).epsilon(plan.events, spec.budget.delta) <= spec.budget.epsilon


@pytest.mark.parametrize("adjacency", ["add_remove", "replace"])
@pytest.mark.parametrize("noise", ["laplace", "gaussian"])
def test_all_metrics_together_certify(adjacency, noise):
    spec = make_spec(adjacency=adjacency, noise=noise, private=True)
    plan = plan_release(spec)
    for ref in [r for r in known_accountants() if not r.startswith("pld")]:
        assert get_accountant(ref).epsilon(plan.events, spec.budget.delta) <= 1.0
    # one event per noised vector + quantiles + top_k + selection; mean (nsum) and variance (nsum,
    # squares) reuse the count metric's noisy vector instead of noising their own count
    assert len(plan.events) == 1 + 1 + 1 + 1 + 2 + 1 + 1 + 1


def test_pure_laplace_with_public_partitions_needs_no_delta():
    spec = make_spec([{"type": "count"}, {"type": "sum", "column": "amount", "bounds": [0, 10]}], delta=0.0)
    plan = plan_release(spec)
    assert get_accountant("basic").epsilon(plan.events, 0.0) <= 1.0


def test_sensitivities_come_from_dpops_sensitivity():
    spec = make_spec(adjacency="replace")
    plan = plan_release(spec)
    b = sensitivity.ContributionBounds("replace", 3, 2)
    by_key = {m.key: m for m in plan.metrics}
    assert by_key["count"].vectors[0].sensitivity == sensitivity.count(b)
    assert by_key["unit_count"].vectors[0].sensitivity == sensitivity.unit_count(b)
    assert by_key["sum_amount"].vectors[0].sensitivity == sensitivity.sum_(b, 0, 100)
    mean = {v.name: v.sensitivity for v in by_key["mean_amount"].vectors}
    assert mean == {"normalized_sum": sensitivity.mean(b, -10, 100)["normalized_sum"]}
    assert by_key["mean_amount"].count_from == "count"  # the released count is reused
    var = {v.name: v.sensitivity for v in by_key["variance_amount"].vectors}
    ref = sensitivity.variance(b, 0, 50)
    assert var == {"normalized_sum": ref["normalized_sum"], "normalized_sum_squares": ref["normalized_sum_of_squares"]}
    # without a count metric, a mean noises its own count with half its share
    alone = plan_release(make_spec([ALL_METRICS[3]], adjacency="replace")).metrics[0]
    assert {v.name: v.sensitivity for v in alone.vectors} == sensitivity.mean(b, -10, 100)
    assert alone.count_from is None
    assert alone.vectors[0].params.scale == pytest.approx(2 * alone.vectors[0].sensitivity.l1 / 1.0, rel=0.02)
    assert by_key["quantiles_amount"].utility_sensitivity == sensitivity.quantile_utility(b)
    # the charged sensitivity includes the grid rounding, never less than the true one
    for m in plan.metrics:
        for v in m.vectors:
            assert v.params.l1_sensitivity >= v.sensitivity.l1


def test_replace_doubles_count_noise_and_em_runs():
    add = plan_release(make_spec([{"type": "count"}, ALL_METRICS[5]], adjacency="add_remove"))
    rep = plan_release(make_spec([{"type": "count"}, ALL_METRICS[5]], adjacency="replace"))
    assert rep.metrics[0].vectors[0].sensitivity.l1 == 2 * add.metrics[0].vectors[0].sensitivity.l1
    assert rep.metrics[0].vectors[0].params.scale == pytest.approx(2 * add.metrics[0].vectors[0].params.scale)
    # quantiles: a unit touches L0 (add_remove) or 2 L0 (replace) partitions, each with 2 quantiles
    assert add.metrics[1].runs_per_unit == 3 * 2 and rep.metrics[1].runs_per_unit == 2 * 3 * 2
    assert rep.metrics[1].per_run_epsilon == pytest.approx(add.metrics[1].per_run_epsilon / 2)


def test_replace_partition_selection_uses_group_privacy():
    add = plan_release(make_spec([{"type": "count"}], private=True))
    rep = plan_release(make_spec([{"type": "count"}], private=True, adjacency="replace"))
    assert rep.partition_selection.epsilon == pytest.approx(add.partition_selection.epsilon / 2)
    e = rep.partition_selection.epsilon
    assert rep.partition_selection_event.delta == pytest.approx(rep.partition_selection.delta * (1 + math.exp(e)))
    assert rep.partition_selection_event.delta <= add.partition_selection.delta


def test_split_weights_and_delta_only_to_consumers():
    spec = make_spec([{"type": "count"}, {"type": "sum", "column": "amount", "bounds": [0, 1]}],
                     split={"count": 3, "sum_amount": 1, "partition_selection": 4}, private=True)
    plan = plan_release(spec)
    c, s = plan.metrics
    assert c.epsilon == pytest.approx(0.375) and s.epsilon == pytest.approx(0.125)
    assert c.delta == 0 and s.delta == 0  # laplace metrics take no delta
    assert plan.partition_selection.epsilon == pytest.approx(0.5)
    assert plan.partition_selection.delta == pytest.approx(1e-7)


def test_gaussian_metrics_share_delta_with_selection():
    spec = make_spec([{"type": "count"}], noise="gaussian", private=True, split={"count": 1, "partition_selection": 1})
    plan = plan_release(spec)
    assert plan.metrics[0].delta == pytest.approx(5e-8) and plan.partition_selection.delta == pytest.approx(5e-8)
    assert plan.metrics[0].vectors[0].params.family == "gaussian"


def test_plan_is_deterministic_and_describable():
    a, b = plan_release(make_spec()), plan_release(make_spec())
    assert a.plan_hash == b.plan_hash
    d = a.describe()
    json.dumps(d, allow_nan=False)
    assert d["metrics"][0]["vectors"][0]["sensitivity"]["l1"] == 6.0  # L0 * Linf
    assert make_spec(epsilon=0.5).spec_hash != make_spec().spec_hash
    assert plan_release(make_spec(epsilon=0.5)).plan_hash != a.plan_hash


def test_planning_never_imports_dp_accounting():
    """Planning runs in every Beam worker: it certifies with basic/1 without importing the PLD stack."""
    import subprocess
    import sys

    code = ("import sys; from dpops.accounting import get_accountant; get_accountant('basic/1'); "
            "import dpops.release_plan; assert 'dp_accounting' not in sys.modules, 'dp_accounting imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr