"""Basic sequential composition: epsilons add, deltas add (Dwork & Roth, Thm 3.16).

Mechanisms without a pure-DP form (Gaussian, discrete Gaussian, zCDP) are
charged through their zCDP rho: the summed rho of all such events is converted
once with rho + 2*sqrt(rho*ln(1/delta')) at the delta' left after the
approximate-DP deltas. That is still a valid (loose) bound; tighter ones are
the rdp and pld accountants.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dpops.accounting.base import Accountant, State
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


def zcdp_to_epsilon(rho: float, delta: float) -> float:
    """Bun & Steinke 2016, Prop 1.3: rho-zCDP implies (rho + 2 sqrt(rho ln(1/delta)), delta)-DP."""
    if rho == 0:
        return 0.0
    if delta <= 0:
        return math.inf
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


class BasicAccountant(Accountant):
    """``basic/1``: pure and approximate epsilons and deltas add; Gaussian-type events go through zCDP."""

    name = "basic"
    version = "1"

    def empty_state(self) -> State:
        """Three sums: pure+approx epsilon, approx delta, and the rho of the Gaussian-type events."""
        return {"eps": 0.0, "delta": 0.0, "rho": 0.0}

    def add_events(self, state: State, events: Sequence[PrivacyEvent]) -> State:
        """Add each atomic event (times its multiplicity) to the matching sum."""
        eps, dlt, rho = float(state["eps"]), float(state["delta"]), float(state["rho"])
        for ev, k in flatten(events):
            if isinstance(ev, (Laplace, DiscreteLaplace, PureDP)):
                eps += k * ev.epsilon
            elif isinstance(ev, ApproxDP):
                eps += k * ev.epsilon
                dlt += k * ev.delta
            elif isinstance(ev, (Gaussian, DiscreteGaussian, ZCDP)):
                rho += k * ev.rho
            else:  # pragma: no cover - flatten yields atomic events only
                raise InvalidParameter(f"basic accountant cannot compose {ev!r}")
        return {"eps": eps, "delta": dlt, "rho": rho}

    def state_epsilon(self, state: State, delta: float) -> float:
        """Summed epsilon plus the zCDP conversion of rho at the delta left after the approx-DP deltas."""
        check_delta(delta)
        left = delta - state["delta"]
        if left < 0:
            return math.inf
        if state["rho"] > 0 and left == 0:
            return math.inf
        return state["eps"] + zcdp_to_epsilon(state["rho"], left)

    def state_delta(self, state: State, epsilon: float) -> float:
        """Inverse of ``state_epsilon``: the approx deltas plus the delta the zCDP part needs for the spare epsilon."""
        check_epsilon(epsilon)
        spare = epsilon - state["eps"]
        if spare < 0:
            return 1.0
        if state["rho"] == 0:
            return min(1.0, state["delta"])
        rho = state["rho"]
        if spare <= rho:
            return 1.0
        # invert eps = rho + 2 sqrt(rho ln(1/d))  =>  d = exp(-((eps - rho)/2)^2 / rho)
        return min(1.0, state["delta"] + math.exp(-(((spare - rho) / 2.0) ** 2) / rho))
