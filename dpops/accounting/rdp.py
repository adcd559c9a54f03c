"""Rényi-DP accountant (``rdp/1``) over a fixed grid of orders.

The grid (``ORDERS``) is part of version 1 and recorded in ``describe()``:
alpha - 1 = 10**(k/20) for k = -40..120, i.e. 161 orders from 1.01 to
1,000,001, each step a factor 1.122 in alpha - 1. That is fine enough that the
grid never loses against the zCDP closed form for Gaussians (the grid costs at
most 0.34% of 2·sqrt(rho·ln(1/delta)) while the improved conversion below gains
more than that) whenever the optimal order lies inside the grid.

RDP of each event at order alpha (all additive under composition, Mironov 2017
Prop 1):

- gaussian: alpha·Δ2²/(2σ²) (Mironov 2017, Table 2);
- discrete_gaussian, zcdp: alpha·rho, since rho-zCDP *is* this RDP curve
  (Canonne, Kamath, Steinke 2020, Thm 4);
- laplace: exact, Mironov 2017 Prop 6 with eps = Δ1/b:
  1/(alpha-1)·log( alpha/(2alpha-1)·e^{(alpha-1)eps} + (alpha-1)/(2alpha-1)·e^{-alpha·eps} );
- discrete_laplace, pure_dp: any eps-DP mechanism satisfies
  1/(alpha-1)·log( (e^{alpha·eps} + e^{(1-alpha)eps}) / (1 + e^eps) ),
  the RDP of randomized response, which is the worst eps-DP mechanism
  (Bun & Steinke 2016, proof of Prop 3.3, written there as
  log((sinh(alpha·eps) - sinh((alpha-1)eps))/sinh(eps))/(alpha-1)); it is below
  both eps and alpha·eps²/2. For a discrete Laplace with sensitivity one
  lattice step it is exact.
- approx_dp has no RDP curve: composed beside by basic composition,
  eps_total(delta) = eps_rdp(delta - Σdelta_i) + Σeps_i; delta <= Σdelta_i gives inf.

As in ``zcdp/1``, the pure-eps events may alternatively be added beside
(their eps summed); both are valid bounds and the smaller is reported, so that
rdp/1 is never worse than zcdp/1 (and hence than basic/1).

Conversion to (eps, delta): Canonne, Kamath & Steinke 2020, Prop 12 (also
Asoodeh et al. 2020): eps = rdp(alpha) + ln((alpha-1)/alpha) - (ln delta + ln alpha)/(alpha-1),
minimised over the grid; inverted for delta(eps). Computed here with numpy;
the tests cross-check it against ``dp_accounting.rdp.compute_epsilon``.

Running state: the summed RDP vector of all events, the summed RDP vector of
the non-pure events, Σeps of the pure events and the approx-DP sums: JSON
floats whose size does not grow with history.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from dpops.accounting.base import Accountant, State
from dpops.accounting.zcdp import check_state
from dpops.errors import InvalidParameter
from dpops.events import (
    ZCDP,
    ApproxDP,
    DiscreteGaussian,
    DiscreteLaplace,
    Gaussian,
    Laplace,
    PrivacyEvent,
    PureDP,
    flatten,
)
from dpops.param_checks import check_delta, check_epsilon

ORDERS = tuple(1.0 + 10.0 ** (k / 20.0) for k in range(-40, 121))
_A = np.array(ORDERS)
_ATOMS = (Gaussian, DiscreteGaussian, ZCDP, Laplace, DiscreteLaplace, PureDP, ApproxDP)
_STATE_KEYS = ("rdp_all", "rdp_noise", "pure_eps", "approx_eps", "approx_delta")


def laplace_rdp(eps: float) -> np.ndarray:
    """Mironov 2017 Prop 6, in log space so that large alpha·eps cannot overflow."""
    a = _A
    log_terms = np.logaddexp(np.log(a / (2 * a - 1)) + (a - 1) * eps, np.log((a - 1) / (2 * a - 1)) - a * eps)
    return np.maximum(log_terms / (a - 1), 0.0)


def pure_dp_rdp(eps: float) -> np.ndarray:
    """RDP of randomized response with parameter eps: the worst case of any eps-DP mechanism."""
    a = _A
    log_num = np.logaddexp(a * eps, (1 - a) * eps)
    log_den = np.logaddexp(0.0, eps)
    val = (log_num - log_den) / (a - 1)
    # Guard against rounding: never above the two simple bounds, never negative.
    return np.clip(np.minimum(val, np.minimum(eps, a * eps * eps / 2.0)), 0.0, None)


def rdp_to_epsilon(rdp: np.ndarray, delta: float) -> float:
    """CKS 2020 Prop 12, minimised over the grid; inf when delta == 0 and rdp > 0."""
    if not np.any(rdp > 0):
        return 0.0
    if delta <= 0:
        return math.inf
    a = _A
    eps = rdp + np.log1p(-1.0 / a) - (math.log(delta) + np.log(a)) / (a - 1)
    return max(0.0, float(np.min(eps)))


def rdp_to_delta(rdp: np.ndarray, epsilon: float) -> float:
    """Inverse of rdp_to_epsilon: delta = min_alpha exp((alpha-1)(rdp - eps + ln(1 - 1/alpha)) - ln alpha)."""
    if not np.any(rdp > 0):
        return 0.0
    a = _A
    log_delta = (a - 1) * (rdp - epsilon + np.log1p(-1.0 / a)) - np.log(a)
    return float(min(1.0, math.exp(min(0.0, float(np.min(log_delta))))))


class RdpAccountant(Accountant):
    """``rdp/1``: Rényi DP curves over fixed orders, converted with Canonne, Kamath & Steinke 2020, Prop 12."""

    name = "rdp"
    version = "1"

    def empty_state(self) -> State:
        """Zero curves, zero pure epsilon, zero approx (epsilon, delta)."""
        zeros = [0.0] * len(ORDERS)
        return {"rdp_all": list(zeros), "rdp_noise": list(zeros), "pure_eps": 0.0, "approx_eps": 0.0,
                "approx_delta": 0.0}

    def _vectors(self, state: State) -> tuple[np.ndarray, np.ndarray]:
        check_state(state, _STATE_KEYS, self.ref)
        all_, noise = np.asarray(state["rdp_all"], dtype=float), np.asarray(state["rdp_noise"], dtype=float)
        if all_.shape != _A.shape or noise.shape != _A.shape:
            raise InvalidParameter(f"{self.ref} running state has RDP vectors of the wrong length "
                                   f"(expected {len(ORDERS)})")
        return all_, noise

    def add_events(self, state: State, events: Sequence[PrivacyEvent]) -> State:
        """Add each event's RDP curve; approx-DP events are summed beside (they have no RDP form)."""
        rdp_all, rdp_noise = (v.copy() for v in self._vectors(state))
        pure_eps, a_eps, a_delta = float(state["pure_eps"]), float(state["approx_eps"]), float(state["approx_delta"])
        # Group identical atoms first: a history of 10,000 copies costs one curve evaluation.
        grouped: dict[PrivacyEvent, int] = {}
        for ev, k in flatten(events):
            if not isinstance(ev, _ATOMS):
                raise InvalidParameter(f"{self.ref} cannot compose {ev!r}: not a privacy event")
            grouped[ev] = grouped.get(ev, 0) + k
        for ev, k in grouped.items():
            if isinstance(ev, (Gaussian, DiscreteGaussian, ZCDP)):
                curve = _A * ev.rho
                rdp_noise += k * curve
                rdp_all += k * curve
            elif isinstance(ev, Laplace):
                rdp_all += k * laplace_rdp(ev.epsilon)
                pure_eps += k * ev.epsilon
            elif isinstance(ev, (DiscreteLaplace, PureDP)):
                rdp_all += k * pure_dp_rdp(ev.epsilon)
                pure_eps += k * ev.epsilon
            elif isinstance(ev, ApproxDP):
                a_eps += k * ev.epsilon
                a_delta += k * ev.delta
            else:
                raise InvalidParameter(f"{self.ref} cannot compose {ev!r}: not a privacy event")
        return {
            "rdp_all": rdp_all.tolist(),
            "rdp_noise": rdp_noise.tolist(),
            "pure_eps": pure_eps,
            "approx_eps": a_eps,
            "approx_delta": a_delta,
        }

    def state_epsilon(self, state: State, delta: float) -> float:
        """The better of the joint curve and (noise curve + pure epsilon beside), plus the approx epsilon."""
        check_delta(delta)
        rdp_all, rdp_noise = self._vectors(state)
        left = delta - state["approx_delta"]
        if left < 0:
            return math.inf
        joint = rdp_to_epsilon(rdp_all, left)
        beside = rdp_to_epsilon(rdp_noise, left) + state["pure_eps"]
        return min(joint, beside) + state["approx_eps"]

    def state_delta(self, state: State, epsilon: float) -> float:
        """Inverse of ``state_epsilon``: the smaller delta of the two analyses, plus the approx deltas."""
        check_epsilon(epsilon)
        rdp_all, rdp_noise = self._vectors(state)
        spare = epsilon - state["approx_eps"]
        if spare < 0:
            return 1.0
        joint = rdp_to_delta(rdp_all, spare)
        rest = spare - state["pure_eps"]
        beside = rdp_to_delta(rdp_noise, rest) if rest >= 0 else 1.0
        return min(1.0, min(joint, beside) + state["approx_delta"])

    def describe(self) -> dict:
        """Also records the orders and the numpy version that computed the curves."""
        return {
            "name": self.name,
            "version": self.version,
            "libraries": {"numpy": np.__version__},
            "orders": list(ORDERS),
            "conversion": "Canonne, Kamath & Steinke 2020, Prop 12",
            "approx_dp": "composed beside by basic composition",
        }
