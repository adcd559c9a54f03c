"""Mechanisms: the certified privacy never exceeds the request, rounding is charged, bad values refused."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from dpops.accounting import get_accountant, known_accountants
from dpops.noise.calibration import discrete_gaussian_delta, zcdp_epsilon
from dpops.errors import InvalidParameter
from dpops.events import event_from_dict, event_to_dict
from dpops.noise.mechanisms import (
    RESOLUTION_BITS,
    NoiseParams,
    add_noise,
    gaussian_mechanism,
    gaussian_mechanism_zcdp,
    laplace_mechanism,
)
from dpops.noise.randomness import test_random
from dpops.noise.samplers import discrete_gaussian, discrete_laplace

Z_ALPHA = stats.norm.isf(1e-4 / 2)  # every statistical check: false-failure rate 1e-4
EPSILONS = [0.01, 0.5, 1.0, 3.0]
SENSITIVITIES = [1.0, 0.3, 7.5, 100.0]
COORDS = [1, 3, 10]


def _is_power_of_two(x: float) -> bool:
    m, _ = math.frexp(x)
    return m == 0.5


@pytest.mark.parametrize("eps", EPSILONS)
@pytest.mark.parametrize("sens", SENSITIVITIES)
@pytest.mark.parametrize("m", COORDS)
@pytest.mark.parametrize("integer_valued", [True, False])
def test_laplace_certifies_at_most_the_requested_epsilon(eps, sens, m, integer_valued):
    p = laplace_mechanism(eps, sens, integer_valued=integer_valued, max_coords=m)
    ev = p.event()
    assert ev.epsilon <= eps
    assert ev.epsilon >= eps * (1 - 2.0**-RESOLUTION_BITS) * (1 - 1e-9) or not integer_valued
    assert get_accountant("basic").epsilon([ev], 0.0) <= eps
    if integer_valued:
        assert p.resolution == 1.0 and p.l1_sensitivity == sens
    else:
        r = p.resolution
        assert _is_power_of_two(r) and r * m <= sens / 2**RESOLUTION_BITS
        # charged: Δ1 + r·m, rounded up to a whole lattice step
        assert sens + r * m <= p.l1_sensitivity <= sens + r * m + r
        if (sens / r).is_integer():
            assert p.l1_sensitivity == sens + r * m
        assert p.l1_sensitivity <= sens * (1 + 2 * 2.0**-RESOLUTION_BITS)  # the documented cost
    # the event round-trips through the stable JSON form
    assert event_from_dict(json.loads(json.dumps(event_to_dict(ev)))) == ev


@pytest.mark.parametrize("eps,delta", [(0.1, 1e-6), (1.0, 1e-6), (3.0, 1e-9)])
@pytest.mark.parametrize("sens", SENSITIVITIES)
@pytest.mark.parametrize("integer_valued", [True, False])
def test_gaussian_exact_calibration_certifies_delta(eps, delta, sens, integer_valued):
    if integer_valued:
        sens = float(math.ceil(sens))  # integer queries have integer sensitivities
    p = gaussian_mechanism(eps, delta, sens, integer_valued=integer_valued)
    ev = p.event()
    r = p.resolution
    lattice_sens = ev.l2_sensitivity / r
    assert lattice_sens.is_integer()
    assert ev.l2_sensitivity >= sens + (0 if integer_valued else r)
    # recompute the exact discrete Gaussian delta from the event alone (CKS20 Thm 7)
    assert discrete_gaussian_delta(eps, (ev.sigma / r) ** 2, int(lattice_sens)) <= delta
    assert p.calibration == "cks20_exact"


@pytest.mark.parametrize("m", [1, 4, 25])
@pytest.mark.parametrize("integer_valued", [True, False])
def test_gaussian_zcdp_conversion_is_certified_by_every_simple_accountant(m, integer_valued):
    eps, delta = 1.0, 1e-6
    calibration = "zcdp" if m == 1 else "exact"  # m > 1 always uses the universal conversion
    p = gaussian_mechanism(eps, delta, 2.0 * math.sqrt(m), integer_valued=integer_valued, max_coords=m,
                           calibration=calibration)
    ev = p.event()
    assert p.calibration == "zcdp_conversion"
    assert zcdp_epsilon(ev.rho, delta) <= eps
    assert get_accountant("basic").epsilon([ev], delta) <= eps
    if not integer_valued:
        assert ev.l2_sensitivity >= 2.0 * math.sqrt(m) + p.resolution * math.sqrt(m)
    for ref in known_accountants():  # other engineers' zcdp/rdp accountants, once registered
        if ref.split("/")[0] in ("zcdp", "rdp", "pld"):
            assert get_accountant(ref).epsilon([ev], delta) <= eps * (1 + 1e-9)


def test_zcdp_mechanism_rho():
    for rho in (0.01, 0.5, 2.0):
        for integer_valued in (True, False):
            ev = gaussian_mechanism_zcdp(rho, 3.0, integer_valued=integer_valued, max_coords=2).event()
            assert ev.rho <= rho
            if ev.sigma > 2.001 * ev.resolution:  # below that, sigma is held at 2 lattice steps
                assert rho * (1 - 1e-3) <= ev.rho
            else:
                assert ev.sigma >= 2 * ev.resolution


def test_integer_path_adds_exactly_the_sampled_integer_noise():
    values = np.arange(-500, 500, dtype=np.int64)
    for p, sampler in (
        (laplace_mechanism(0.5, 2.0, integer_valued=True), discrete_laplace),
        (gaussian_mechanism(0.5, 1e-6, 2.0, integer_valued=True), discrete_gaussian),
    ):
        out = add_noise(values, p, test_random(5, ["m"]))
        assert out.dtype == np.int64
        noise = sampler(p.lattice, values.size, test_random(5, ["m"]))
        assert np.array_equal(out, values + noise)
    # integral floats are accepted for integer queries; fractions are not
    assert add_noise(np.array([3.0, 4.0]), p, test_random(1)).dtype == np.int64
    with pytest.raises(InvalidParameter, match=r"values\[1\]"):
        add_noise(np.array([3.0, 4.5]), p, test_random(1))


def test_real_path_rounds_to_the_grid_then_adds_grid_noise():
    p = laplace_mechanism(1.0, 10.0, integer_valued=False)
    r = p.resolution
    values = np.linspace(-3.3, 17.7, 1001)
    out = add_noise(values, p, test_random(6))
    assert out.dtype == np.float64
    assert np.all(out / r == np.rint(out / r))
    noise = discrete_laplace(p.lattice, values.size, test_random(6))
    assert np.array_equal(out, (np.rint(values / r) + noise) * r)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_are_refused(bad):
    p = gaussian_mechanism(1.0, 1e-6, 1.0, integer_valued=False)
    with pytest.raises(InvalidParameter, match=r"values\[2\]"):
        add_noise(np.array([1.0, 2.0, bad]), p, test_random(1))
    with pytest.raises(InvalidParameter):
        add_noise(np.array([True, False]), p, test_random(1))


@pytest.mark.parametrize(
    "params",
    [
        laplace_mechanism(1.0, 1.0, integer_valued=True),
        laplace_mechanism(0.2, 5.0, integer_valued=False, max_coords=2),
        gaussian_mechanism(1.0, 1e-6, 1.0, integer_valued=True),
        gaussian_mechanism(0.5, 1e-6, 4.0, integer_valued=False),
    ],
    ids=["lap-int", "lap-real", "gauss-int", "gauss-real"],
)
def test_std_and_ci95_are_right(params: NoiseParams):
    n = 100_000
    noise = add_noise(np.zeros(n), params, test_random(8, ["ci"])).astype(float)
    # variance: the sample variance of n draws has relative sd sqrt((kurtosis-1)/n), kurtosis <= 6
    assert abs(noise.var() / params.std**2 - 1) < Z_ALPHA * math.sqrt(5 / n)
    # the 95% half-width from public parameters covers at least 95% (exactly: minimal lattice width)
    h = params.ci95_halfwidth()
    lat = params._lattice()
    k = params.lattice_halfwidth()
    assert 2 * lat.tail(k + 1) <= 0.05 < 2 * lat.tail(k)
    covered = np.mean(np.abs(noise) <= h)
    p_exact = 1 - 2 * lat.tail(k + 1)
    assert covered >= p_exact - Z_ALPHA * math.sqrt(p_exact * (1 - p_exact) / n)
    json.dumps(params.describe())


@pytest.mark.parametrize(
    "call",
    [
        lambda: laplace_mechanism(0.0, 1.0, integer_valued=True),
        lambda: laplace_mechanism(float("nan"), 1.0, integer_valued=True),
        lambda: laplace_mechanism(1.0, -1.0, integer_valued=True),
        lambda: laplace_mechanism(1.0, float("inf"), integer_valued=True),
        lambda: laplace_mechanism(1.0, 1.0, integer_valued="yes"),
        lambda: laplace_mechanism(1.0, 1.0, integer_valued=True, max_coords=0),
        lambda: gaussian_mechanism(1.0, 0.0, 1.0, integer_valued=True),
        lambda: gaussian_mechanism(1.0, 1.0, 1.0, integer_valued=True),
        lambda: gaussian_mechanism(1.0, float("nan"), 1.0, integer_valued=True),
        lambda: gaussian_mechanism(-1.0, 1e-6, 1.0, integer_valued=True),
        lambda: gaussian_mechanism(1.0, 1e-6, 1.0, integer_valued=True, calibration="magic"),
        lambda: gaussian_mechanism_zcdp(0.0, 1.0, integer_valued=True),
        lambda: add_noise(np.array([1, 2]), "params", test_random(1)),
        lambda: add_noise(np.array([1, 2]), laplace_mechanism(1.0, 1.0, integer_valued=True), None),
    ],
)
def test_bad_input_is_refused(call):
    with pytest.raises(InvalidParameter):
        call()


@pytest.mark.parametrize("m", [1, 4])
def test_accountant_aware_calibration(m):
    eps, delta = 1.0, 1e-6
    exact = gaussian_mechanism(eps, delta, 1.0, integer_valued=True, max_coords=m)
    for ref in ("basic", "rdp", "pld"):
        if not any(k.startswith(ref + "/") for k in known_accountants()):
            continue
        p = gaussian_mechanism(eps, delta, 1.0, integer_valued=True, max_coords=m, accountant=ref)
        acct = get_accountant(ref)
        assert acct.epsilon([p.event()], delta) <= eps
        assert acct.epsilon([p.event()], delta) >= eps * (1 - 1e-3)  # and not wastefully more noise
        assert p.calibration.startswith("accountant:" + ref)
        if m == 1:
            assert p.scale >= exact.scale * (1 - 1e-6)  # no valid analysis beats the exact profile
    with pytest.raises(InvalidParameter):
        gaussian_mechanism(eps, delta, 1.0, integer_valued=True, accountant="nope")
