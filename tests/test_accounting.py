"""Accountants: shared vectors, ordering, running state, averaging, bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from dpops.accounting import get_accountant, known_accountants
from dpops.accounting.rdp import ORDERS, laplace_rdp, pure_dp_rdp, rdp_to_epsilon
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
    event_from_dict,
    events_from_json,
)

# The seed's vectors (../shared/spec/accounting_vectors.json), copied into the repository so the
# test never silently skips where shared/ is elsewhere; test_vectors_copy_is_current guards the copy.
VECTORS_FILE = Path(__file__).resolve().parent / "data" / "accounting_vectors.json"
SHARED_VECTORS = Path(__file__).resolve().parents[2] / "shared" / "spec" / "accounting_vectors.json"
VECTORS = json.loads(VECTORS_FILE.read_text())
NAMES = ["basic", "zcdp", "rdp", "pld", "basic/2"]  # bare names resolve to their latest; "basic" to basic/1

MIXED = [
    SelfComposed(Gaussian(5.0, 1.0), 20),
    SelfComposed(Laplace(10.0, 1.0), 10),
    ApproxDP(0.1, 1e-8, mechanism="partition_selection/truncated_geometric"),
    SelfComposed(DiscreteGaussian(6.0, 1.0), 3),
    DiscreteLaplace(4.0, 1.0),
    PureDP(0.05, mechanism="exponential"),
    ZCDP(0.01),
]


def test_vectors_copy_is_current():
    if not SHARED_VECTORS.exists():
        pytest.skip(f"{SHARED_VECTORS} not present beside this checkout")
    assert json.loads(SHARED_VECTORS.read_text()) == VECTORS


def _cases():
    return [(c["k"], c["sigma"], c["eps_closed_form"]) for c in VECTORS["cases"]], VECTORS["delta"]


def test_all_registered():
    assert {"basic/1", "zcdp/1", "rdp/1", "pld/1", "basic/2"} <= set(known_accountants())
    for n in NAMES:
        d = get_accountant(n).describe()
        assert f"{d['name']}/{d['version']}" == (n if "/" in n else f"{n}/1")
    assert get_accountant("pld").describe()["libraries"]["dp_accounting"] == "0.4.4"
    assert len(get_accountant("rdp").describe()["orders"]) == len(ORDERS)


@pytest.mark.parametrize("k,sigma,expected", _cases()[0])
def test_zcdp_reproduces_shared_vectors_and_tighter_ones_are_smaller(k, sigma, expected):
    delta = _cases()[1]
    history = [SelfComposed(Gaussian(float(sigma), 1.0), k)]
    assert get_accountant("zcdp").epsilon(history, delta) == pytest.approx(expected, abs=1e-12)
    # k separate events give the same number as one self_composed event
    assert get_accountant("zcdp").epsilon([Gaussian(float(sigma), 1.0)] * k, delta) == pytest.approx(expected, abs=1e-12)
    rdp = get_accountant("rdp").epsilon(history, delta)
    pld = get_accountant("pld").epsilon(history, delta)
    assert pld < rdp < expected


def test_rdp_conversion_matches_dp_accounting():
    from dp_accounting.rdp import rdp_privacy_accountant as ref

    for rho in (1e-4, 0.03, 1.0, 20.0):
        vec = np.array(ORDERS) * rho
        for delta in (1e-9, 1e-6, 1e-3):
            ours = rdp_to_epsilon(vec, delta)
            theirs, _ = ref.compute_epsilon(list(ORDERS), list(vec), delta)
            assert ours == pytest.approx(theirs, rel=1e-9)


def test_rdp_curves_match_references_and_bounds():
    from dp_accounting.rdp.rdp_privacy_accountant import _laplace_rdp

    for eps in (0.01, 0.5, 3.0):
        lap = laplace_rdp(eps)
        ref = np.array([_laplace_rdp(eps, a) for a in ORDERS])
        np.testing.assert_allclose(lap, ref, rtol=1e-7, atol=1e-12)
        rr = pure_dp_rdp(eps)
        a = np.array(ORDERS)
        assert np.all(lap <= rr + 1e-12)  # Laplace is eps-DP, randomized response is the worst eps-DP
        assert np.all(rr <= np.minimum(eps, a * eps**2 / 2) + 1e-12)


def test_rdp_and_zcdp_never_worse_over_a_range_of_rho():
    zc, rd = get_accountant("zcdp"), get_accountant("rdp")
    for rho in np.geomspace(1e-8, 1e3, 23):
        for delta in (1e-12, 1e-6, 1e-3):
            h = [ZCDP(float(rho))]
            assert rd.epsilon(h, delta) <= zc.epsilon(h, delta) + 1e-12


def test_ordering_on_a_mixed_history():
    eps = {n: get_accountant(n).epsilon(MIXED, 1e-6) for n in NAMES}
    # 1e-12: pld takes min(own bound, rdp bound) and may sum the RDP vector in another order
    assert eps["pld"] <= eps["rdp"] + 1e-12
    assert eps["rdp"] <= eps["zcdp"] <= eps["basic"]
    assert eps["pld"] < eps["basic"]
    # and the inverse direction: delta at a fixed epsilon is ordered the same way
    dl = {n: get_accountant(n).delta(MIXED, 12.0) for n in NAMES}
    assert dl["pld"] <= dl["rdp"] <= dl["zcdp"] <= dl["basic"]


def test_epsilon_and_delta_are_consistent():
    for n in NAMES:
        acc = get_accountant(n)
        eps = acc.epsilon(MIXED, 1e-6)
        assert acc.delta(MIXED, eps * (1 + 1e-6) + 1e-9) <= 1e-6 * (1 + 1e-6)


def test_pure_laplace_history_basic_is_exact_sum():
    h = [Laplace(1.0, 0.3), Laplace(2.0, 0.5), DiscreteLaplace(4.0, 1.0), PureDP(0.07)]
    total = 0.3 + 0.25 + 0.25 + 0.07
    assert get_accountant("basic").epsilon(h, 0.0) == total
    assert get_accountant("basic").delta(h, total) == 0.0
    for n in NAMES:  # no accountant reports more than the plain sum of a pure history
        assert get_accountant(n).epsilon(h, 1e-6) <= total + 1e-12


@pytest.mark.parametrize("name", NAMES)
def test_incremental_equals_all_at_once_and_state_is_json(name):
    acc = get_accountant(name)
    flat = [Gaussian(5.0, 1.0)] * 3 + [Laplace(10.0, 1.0), ApproxDP(0.1, 1e-8), DiscreteGaussian(6.0, 1.0), PureDP(0.05),
                                       ZCDP(0.01), Composed((Laplace(5.0, 1.0), Gaussian(4.0, 1.0)))]
    state = acc.empty_state()
    for ev in flat:
        state = json.loads(json.dumps(acc.add_events(state, [ev])))  # what the ledger stores and reads back
    once = acc.add_events(acc.empty_state(), flat)
    assert json.loads(json.dumps(once)) == once
    for delta in (1e-9, 1e-6):
        a, b = acc.state_epsilon(state, delta), acc.epsilon(flat, delta)
        assert a == pytest.approx(b, rel=1e-9) and acc.state_epsilon(once, delta) == pytest.approx(b, rel=1e-9)
    assert acc.state_delta(state, 3.0) == pytest.approx(acc.delta(flat, 3.0), rel=1e-9, abs=1e-300)


@pytest.mark.parametrize("name", NAMES)
def test_add_events_does_not_modify_its_input(name):
    acc = get_accountant(name)
    s0 = acc.add_events(acc.empty_state(), [Gaussian(3.0, 1.0)])
    snapshot = json.dumps(s0, sort_keys=True)
    acc.add_events(s0, [Laplace(1.0, 1.0)])
    assert json.dumps(s0, sort_keys=True) == snapshot


@pytest.mark.parametrize("name", NAMES)
def test_monotone_more_events_more_epsilon(name):
    acc = get_accountant(name)
    prev = 0.0
    for k in (1, 2, 5, 20):
        e = acc.epsilon([SelfComposed(Gaussian(6.0, 1.0), k), SelfComposed(Laplace(20.0, 1.0), k)], 1e-6)
        assert e > prev
        prev = e


def test_averaging_sharpens_estimate_while_epsilon_grows():
    # r fresh releases of the same scalar with Gaussian sigma: the mean's std is sigma/sqrt(r).
    # With 20,000 replicates the sample std has relative standard error ~ 1/sqrt(2*20000) = 0.5%;
    # the 3% tolerance is 6 standard errors: false-failure rate < 1e-8 per r (fixed seed anyway).
    rng = np.random.default_rng(20240601)
    sigma, true_value, reps = 4.0, 100.0, 20_000
    last = {n: 0.0 for n in NAMES}
    for r in (1, 4, 16, 64):
        means = (true_value + rng.normal(0.0, sigma, size=(reps, r))).mean(axis=1)
        assert means.std(ddof=1) == pytest.approx(sigma / math.sqrt(r), rel=0.03)
        for n in NAMES:
            e = get_accountant(n).epsilon([SelfComposed(Gaussian(sigma, 1.0), r)], 1e-6)
            assert e > last[n]
            last[n] = e


def test_approx_dp_beside_and_refusal_of_too_small_delta():
    h = [Gaussian(4.0, 1.0), ApproxDP(0.2, 1e-6)]
    for n in NAMES:
        acc = get_accountant(n)
        assert acc.epsilon(h, 1e-6) == math.inf  # nothing left for the Gaussian
        assert acc.epsilon(h, 5e-7) == math.inf
        assert math.isfinite(acc.epsilon(h, 2e-6))
    zc = get_accountant("zcdp").epsilon(h, 2e-6)
    rho = 1 / 32
    assert zc == pytest.approx(rho + 2 * math.sqrt(rho * math.log(1 / 1e-6)) + 0.2, rel=1e-12)


def test_empty_history_costs_nothing():
    for n in NAMES:
        acc = get_accountant(n)
        assert acc.epsilon([], 1e-6) == 0.0
        assert acc.delta([], 1.0) == 0.0


def test_pld_state_is_a_multiset_of_distinct_events():
    acc = get_accountant("pld")
    s = acc.add_events(acc.empty_state(), [Gaussian(5.0, 1.0)] * 500 + [SelfComposed(Gaussian(5.0, 1.0), 500)])
    assert list(s["events"].values()) == [1000]


def test_pld_non_lattice_events_fall_back_to_dominating_forms():
    acc = get_accountant("pld")
    # discrete Laplace with a non-integral lattice sensitivity: charged as randomized response, never below it
    off = acc.epsilon([SelfComposed(DiscreteLaplace(2.0, 1.5, resolution=1.0), 3)], 1e-6)
    rr = acc.epsilon([SelfComposed(PureDP(0.75), 3)], 1e-6)
    assert off == pytest.approx(rr, rel=1e-12)
    # discrete Gaussian off the lattice: charged via its zCDP in the RDP part
    dg = acc.epsilon([DiscreteGaussian(3.0, 1.5)], 1e-6)
    assert dg == pytest.approx(get_accountant("rdp").epsilon([ZCDP(1.5**2 / 18)], 1e-6), rel=1e-9)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan"), "0.1", None])
def test_bad_delta(name, bad):
    with pytest.raises(InvalidParameter, match="delta"):
        get_accountant(name).epsilon([Gaussian(1.0, 1.0)], bad)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_epsilon(name, bad):
    with pytest.raises(InvalidParameter, match="epsilon"):
        get_accountant(name).delta([Gaussian(1.0, 1.0)], bad)


def test_unknown_kind_and_unknown_accountant_and_non_events():
    with pytest.raises(InvalidParameter, match="unknown privacy event kind 'poisson'"):
        event_from_dict({"kind": "poisson", "rate": 1.0})
    with pytest.raises(InvalidParameter, match="unknown accountant 'moments'"):
        get_accountant("moments")
    with pytest.raises(InvalidParameter, match="unknown accountant 'rdp/9'"):
        get_accountant("rdp/9")
    for n in NAMES:
        with pytest.raises(InvalidParameter, match="cannot compose"):
            get_accountant(n).add_events(get_accountant(n).empty_state(), [{"kind": "gaussian"}])
    with pytest.raises(InvalidParameter, match="sigma"):
        events_from_json('[{"kind": "gaussian", "sigma": -1, "l2_sensitivity": 1}]')


@pytest.mark.parametrize("name", ["zcdp", "rdp", "pld"])
def test_malformed_state_is_refused(name):
    with pytest.raises(InvalidParameter, match="running state"):
        get_accountant(name).state_epsilon({"eps": 1.0}, 1e-6)
