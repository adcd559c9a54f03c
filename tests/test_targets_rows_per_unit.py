"""Issue 26 item 2: accuracy targets say how many rows each unit has (``rows_per_unit``); before, ``at_units: 1000``
meant 1,000 rows, the worst case, so a release whose users each have several rows per partition was planned (and
solved into epsilon) for partitions far smaller than its own.

The rule (``dpops.analysis.targets.rows_at``): a target about ``at_units`` units with ``rows_per_unit`` rows each
is predicted for ``at_units * min(rows_per_unit, Linf)`` rows (bounding keeps at most Linf of a unit's rows in a
partition). Properties: it equals the same target stated in rows (``at_units = rows``, ``rows_per_unit = 1``) for
every metric the rows change (mean, variance, a count's relative error, a quantile's rank fraction); rows beyond
Linf change nothing; the default reproduces the old prediction; unit_count and keep targets stay about units.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuzz_support import examples
from dpops import analysis
from dpops.analysis.targets import evaluate_one, rows_at
from dpops.errors import SpecError
from dpops.release_plan import plan_release
from dpops.spec import parse_spec


def _spec(linf: int, targets: list[dict], noise: str = "laplace"):
    return parse_spec({
        "name": "rows", "input": {"path": "in.csv", "format": "csv",
                                  "columns": {"u": "string", "p": "string", "x": "float"}},
        "privacy_unit": {"column": "u", "description": "a unit", "adjacency": "add_remove"},
        "budget": {"scope": "rows", "epsilon": 1.0, "delta": 1e-7, "noise": noise},
        "contribution": {"max_partitions_per_unit": 2, "max_rows_per_unit_per_partition": linf},
        "partitions": {"columns": ["p"], "public": ["a", "b"]},
        "metrics": [{"type": "count"}, {"type": "unit_count"}, {"type": "mean", "column": "x", "bounds": [0, 100]},
                    {"type": "variance", "column": "x", "bounds": [0, 100]},
                    {"type": "quantiles", "column": "x", "bounds": [0, 100], "quantiles": [0.5]}],
        "accuracy": {"confidence": 0.95, "targets": targets},
    }, source="<rows>")


def _targets(units: int, rpu: float | None) -> list[dict]:
    extra = {} if rpu is None else {"rows_per_unit": rpu}
    return [
        {"kind": "error", "metric": "count", "max_relative_error": 0.05, "at_units": units, **extra},
        {"kind": "error", "metric": "unit_count", "max_relative_error": 0.05, "at_units": units, **extra},
        {"kind": "error", "metric": "mean_x", "max_error": 2.0, "at_units": units, **extra},
        {"kind": "error", "metric": "variance_x", "max_error": 50.0, "at_units": units, **extra},
        {"kind": "rank_error", "metric": "quantiles_x", "max_rank_error": 0.05, "at_units": units, **extra},
    ]


def _predicted(spec) -> dict[str, float]:
    plan = plan_release(spec)
    return {f"{t.kind}:{t.metric}": evaluate_one(plan, t, spec.accuracy.confidence).predicted
            for t in spec.accuracy.targets}


@settings(max_examples=examples(25), deadline=None)
@given(units=st.integers(1, 3000), rpu=st.integers(1, 6), linf=st.integers(1, 4),
       noise=st.sampled_from(["laplace", "gaussian"]))
def test_units_with_several_rows_are_predicted_as_that_many_rows(units, rpu, linf, noise):
    """A target about units with rpu rows each = the same target about min(rpu, Linf) * units rows, except
    unit_count, which counts units whatever their rows."""
    by_units = _predicted(_spec(linf, _targets(units, rpu), noise))
    rows = units * min(rpu, linf)
    by_rows = _predicted(_spec(linf, _targets(rows, 1), noise))
    assert rows_at(plan_release(_spec(linf, _targets(units, rpu), noise)),
                   _spec(linf, _targets(units, rpu), noise).accuracy.targets[0]) == rows
    for key in ("error:count", "error:mean_x", "error:variance_x", "rank_error:quantiles_x"):
        assert by_units[key] == pytest.approx(by_rows[key], rel=1e-12), key
    same_units = _predicted(_spec(linf, _targets(units, 1), noise))
    assert by_units["error:unit_count"] == pytest.approx(same_units["error:unit_count"], rel=1e-12)


def test_the_default_is_one_row_per_unit_and_rows_beyond_linf_change_nothing():
    default = _predicted(_spec(2, _targets(300, None)))
    assert default == _predicted(_spec(2, _targets(300, 1)))
    assert _predicted(_spec(2, _targets(300, 2))) == _predicted(_spec(2, _targets(300, 40)))
    # more rows per unit: a smaller error for the mean, a smaller relative count error, a smaller rank fraction
    more = _predicted(_spec(2, _targets(300, 2)))
    for key in ("error:count", "error:mean_x", "rank_error:quantiles_x"):
        assert more[key] < default[key], key


def test_a_solve_with_rows_per_unit_needs_less_epsilon_for_the_mean():
    """The solver reads the same rule: at 3 rows per unit (Linf 3) the mean's target is met at a smaller split."""
    def solved(rpu: int) -> float:
        spec = parse_spec({
            "name": "rows", "input": {"path": "in.csv", "format": "csv",
                                      "columns": {"u": "string", "p": "string", "x": "float"}},
            "privacy_unit": {"column": "u", "description": "a unit", "adjacency": "add_remove"},
            "budget": {"scope": "rows", "epsilon": 1.0, "delta": 1e-7, "noise": "laplace"},
            "contribution": {"max_partitions_per_unit": 1, "max_rows_per_unit_per_partition": 3},
            "partitions": {"columns": ["p"], "public": ["a"]},
            "metrics": [{"type": "mean", "column": "x", "bounds": [0, 100]}],
            "accuracy": {"targets": [{"kind": "error", "metric": "mean_x", "max_error": 1.0, "at_units": 500,
                                      "rows_per_unit": rpu}]},
        }, source="<rows>")
        sol = analysis.solve(spec)
        assert sol.feasible
        return sol.epsilon

    assert solved(3) < 0.8 * solved(1)


def test_rows_per_unit_below_one_is_refused_naming_the_field():
    with pytest.raises(SpecError, match="rows_per_unit"):
        _spec(2, [{"kind": "error", "metric": "count", "max_error": 5, "at_units": 10, "rows_per_unit": 0.5}])
