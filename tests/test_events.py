"""The privacy-event JSON contract: stable, strict, round-trips exactly."""

from __future__ import annotations

import json
import math

import pytest

from dpops.errors import InvalidParameter
from dpops.events import (
    ZCDP,
    ApproxDP,
    Composed,
    DiscreteGaussian,
    DiscreteLaplace,
    Gaussian,
    Laplace,
    PureDP,
    SelfComposed,
    canonical_json,
    event_from_dict,
    event_hash,
    event_to_dict,
    events_from_json,
    events_to_json,
    flatten,
)

ALL = [
    Laplace(scale=2.0, l1_sensitivity=1.0),
    Gaussian(sigma=3.5, l2_sensitivity=1.0),
    DiscreteLaplace(scale=4.0, l1_sensitivity=2.0, resolution=1.0),
    DiscreteGaussian(sigma=5.0, l2_sensitivity=1.5, resolution=0.25),
    PureDP(epsilon=0.3, mechanism="exponential"),
    ApproxDP(epsilon=0.5, delta=1e-9, mechanism="partition_selection/truncated_geometric"),
    ZCDP(rho=0.01),
]


@pytest.mark.parametrize("event", ALL + [Composed(tuple(ALL)), SelfComposed(ALL[1], 7)])
def test_round_trip_is_exact(event):
    d = event_to_dict(event)
    assert d["schema"] == "dpops.event/1"
    again = event_from_dict(json.loads(canonical_json(d)))
    assert again == event
    assert event_hash(again) == event_hash(event)


def test_canonical_json_is_order_independent_and_stable():
    a = {"b": 1, "a": [1.5, {"y": 2, "x": 1}]}
    b = {"a": [1.5, {"x": 1, "y": 2}], "b": 1}
    assert canonical_json(a) == canonical_json(b) == '{"a":[1.5,{"x":1,"y":2}],"b":1}'
    with pytest.raises(ValueError):
        canonical_json({"x": math.nan})


def test_hash_changes_with_any_parameter():
    assert event_hash(Gaussian(3.5, 1.0)) != event_hash(Gaussian(3.5000001, 1.0))
    assert event_hash(Laplace(2.0, 1.0)) != event_hash(DiscreteLaplace(2.0, 1.0))


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ({"kind": "laplace", "scale": 0, "l1_sensitivity": 1}, "scale"),
        ({"kind": "laplace", "scale": float("nan"), "l1_sensitivity": 1}, "scale"),
        ({"kind": "gaussian", "sigma": 1, "l2_sensitivity": -1}, "l2_sensitivity"),
        ({"kind": "approx_dp", "epsilon": 1, "delta": 1.0}, "delta"),
        ({"kind": "approx_dp", "epsilon": -1, "delta": 0.1}, "epsilon"),
        ({"kind": "pure_dp", "epsilon": float("inf")}, "epsilon"),
        ({"kind": "teleport", "epsilon": 1}, "unknown privacy event kind"),
        ({"kind": "laplace", "scale": 1, "l1_sensitivity": 1, "eps": 3}, "unknown field"),
        ({"kind": "laplace", "scale": 1}, "l1_sensitivity"),
        ({"schema": "dpops.event/99", "kind": "laplace", "scale": 1, "l1_sensitivity": 1}, "schema"),
        ({"kind": "self_composed", "count": 0, "event": {"kind": "zcdp", "rho": 1}}, "count"),
        ({"kind": "composed", "events": []}, "at least one"),
        ({"kind": "laplace", "scale": True, "l1_sensitivity": 1}, "scale"),
    ],
)
def test_bad_events_are_refused_with_a_clear_message(bad, fragment):
    with pytest.raises(InvalidParameter, match=fragment):
        event_from_dict(bad)


def test_events_json_list_and_flatten():
    evs = [Composed((Laplace(1.0, 1.0), SelfComposed(Gaussian(2.0, 1.0), 3))), PureDP(0.1)]
    text = events_to_json(evs)
    assert events_from_json(text) == evs
    flat = list(flatten(evs))
    assert flat == [(Laplace(1.0, 1.0), 1), (Gaussian(2.0, 1.0), 3), (PureDP(0.1), 1)]
    with pytest.raises(InvalidParameter, match="JSON"):
        events_from_json("{not json")


def test_derived_quantities():
    assert Laplace(2.0, 1.0).epsilon == 0.5
    assert DiscreteLaplace(4.0, 2.0).epsilon == 0.5
    assert Gaussian(2.0, 1.0).rho == pytest.approx(1 / 8)
    assert DiscreteGaussian(2.0, 2.0).rho == pytest.approx(0.5)


def test_max_coords_and_discrete_gaussian_floor():
    assert DiscreteLaplace(4.0, 2.0, max_coords=5).max_coords == 5
    assert event_from_dict({"kind": "discrete_laplace", "scale": 4.0, "l1_sensitivity": 2.0}).max_coords == 1
    with pytest.raises(InvalidParameter, match="max_coords"):
        Laplace(1.0, 1.0, max_coords=0)
    with pytest.raises(InvalidParameter, match="at least 2"):
        DiscreteGaussian(sigma=1.5, l2_sensitivity=1.0, resolution=1.0)
    # the tau term of CKS20 Thm 14 is always charged on top of Δ²/2σ²
    assert DiscreteGaussian(4.0, 2.0).rho > 2.0**2 / (2 * 4.0**2)


def test_pld_never_uses_a_scalar_analysis_for_vector_laplace():
    from dpops.accounting import get_accountant

    pld = get_accountant("pld/1")
    scalar = pld.epsilon([DiscreteLaplace(scale=10.0, l1_sensitivity=5.0)], 1e-6)
    vector = pld.epsilon([DiscreteLaplace(scale=10.0, l1_sensitivity=5.0, max_coords=5)], 1e-6)
    # the vector falls back to randomized response at eps = 0.5, which is never tighter
    assert vector >= scalar
    assert vector <= 0.5 + 1e-9
