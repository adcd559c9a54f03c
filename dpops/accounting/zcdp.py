"""zCDP accountant (``zcdp/1``): sum rho, convert once.

What each event costs (Bun & Steinke 2016, "Concentrated Differential Privacy:
Simplifications, Extensions, and Lower Bounds"):

- gaussian, discrete_gaussian: rho = Δ2²/(2σ²) (Prop 1.6; Canonne, Kamath,
  Steinke 2020, Thm 4 for the discrete Gaussian);
- zcdp: its rho;
- laplace, discrete_laplace, pure_dp: an eps-DP mechanism is (eps²/2)-zCDP
  (Prop 1.4);
- approx_dp (e.g. partition selection) has no zCDP form. It is composed *beside*
  the zCDP part by basic composition (Dwork & Roth Thm 3.16): if the zCDP part
  is (e1, d1)-DP and the approx-DP events sum to (E, D), the whole history is
  (e1 + E, d1 + D)-DP. So eps_total(delta) = eps_zcdp(delta - D) + E, and
  delta <= D is refused by returning inf (no finite epsilon certifies it).

Conversion: rho-zCDP implies (rho + 2 sqrt(rho ln(1/delta)), delta)-DP
(Prop 1.3). This is the closed form of seed 004, so the shared vectors are
reproduced exactly.

One refinement, also a valid bound: pure-eps events may instead be added
*beside* as well (their eps summed, like basic composition). Both ways bound
the same history, so the accountant reports the smaller of the two. This makes
zcdp never worse than basic/1, whose numbers are exactly the "beside" variant.

The running state keeps five floats, so a reservation costs O(new events).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dpops.accounting.base import Accountant, State
from dpops.accounting.basic import zcdp_to_epsilon
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

_STATE_KEYS = ("rho_noise", "rho_pure", "pure_eps", "approx_eps", "approx_delta")


def zcdp_to_delta(rho: float, epsilon: float) -> float:
    """Smallest delta with eps(rho, delta) <= epsilon under Prop 1.3 (inverse of zcdp_to_epsilon)."""
    if rho == 0:
        return 0.0 if epsilon >= 0 else 1.0
    if epsilon <= rho:
        return 1.0
    # eps = rho + 2 sqrt(rho ln(1/d))  <=>  d = exp(-((eps - rho)/2)² / rho)
    return min(1.0, math.exp(-(((epsilon - rho) / 2.0) ** 2) / rho))


def check_state(state: State, keys: Sequence[str], ref: str) -> None:
    """A running state comes back from a database: refuse a malformed one clearly."""
    if not isinstance(state, dict):
        raise InvalidParameter(f"{ref} running state must be a JSON object, got {type(state).__name__}")
    missing = [k for k in keys if k not in state]
    if missing:
        raise InvalidParameter(f"{ref} running state is missing {missing}; was it written by another accountant?")


class ZcdpAccountant(Accountant):
    """``zcdp/1``: sum rho and convert once (see the module docstring for what each event costs)."""

    name = "zcdp"
    version = "1"

    def empty_state(self) -> State:
        """Five zero sums (see ``_STATE_KEYS``)."""
        return {k: 0.0 for k in _STATE_KEYS}

    def add_events(self, state: State, events: Sequence[PrivacyEvent]) -> State:
        """Add each event's rho (and, for pure events, its epsilon for the "beside" bound) or approx (eps, delta)."""
        check_state(state, _STATE_KEYS, self.ref)
        out = {k: float(state[k]) for k in _STATE_KEYS}
        for ev, k in flatten(events):
            if isinstance(ev, (Gaussian, DiscreteGaussian, ZCDP)):
                out["rho_noise"] += k * ev.rho
            elif isinstance(ev, (Laplace, DiscreteLaplace, PureDP)):
                out["rho_pure"] += k * ev.epsilon**2 / 2.0
                out["pure_eps"] += k * ev.epsilon
            elif isinstance(ev, ApproxDP):
                out["approx_eps"] += k * ev.epsilon
                out["approx_delta"] += k * ev.delta
            else:
                raise InvalidParameter(f"{self.ref} cannot compose {ev!r}: not a privacy event")
        return out

    def state_epsilon(self, state: State, delta: float) -> float:
        """The smaller of "all as rho" and "pure beside", plus the approx epsilon.

        inf when ``delta`` does not exceed the approx deltas (no finite epsilon certifies it).
        """
        check_delta(delta)
        check_state(state, _STATE_KEYS, self.ref)
        left = delta - state["approx_delta"]
        all_rho = state["rho_noise"] + state["rho_pure"]
        if left < 0 or (left == 0 and all_rho > 0):
            return math.inf
        as_rho = zcdp_to_epsilon(all_rho, left)
        pure_beside = zcdp_to_epsilon(state["rho_noise"], left) + state["pure_eps"]
        return min(as_rho, pure_beside) + state["approx_eps"]

    def state_delta(self, state: State, epsilon: float) -> float:
        """Inverse of ``state_epsilon``: the smaller delta of the two analyses, plus the approx deltas."""
        check_epsilon(epsilon)
        check_state(state, _STATE_KEYS, self.ref)
        spare = epsilon - state["approx_eps"]
        if spare < 0:
            return 1.0
        as_rho = zcdp_to_delta(state["rho_noise"] + state["rho_pure"], spare)
        rest = spare - state["pure_eps"]
        pure_beside = zcdp_to_delta(state["rho_noise"], rest) if rest >= 0 else 1.0
        return min(1.0, min(as_rho, pure_beside) + state["approx_delta"])

    def describe(self) -> dict:
        """Also records the conversion used."""
        return {
            "name": self.name,
            "version": self.version,
            "libraries": {},
            "conversion": "rho + 2*sqrt(rho*ln(1/delta)) (Bun & Steinke 2016, Prop 1.3)",
            "approx_dp": "composed beside by basic composition",
        }
