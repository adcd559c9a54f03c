"""``basic/2``: basic composition, with the Gaussian-type part charged by its exact profile when it has one.

Everything ``basic/1`` does, unchanged: pure and approximate epsilons add, deltas add (Dwork & Roth,
Thm 3.16), and the Gaussian-type events (gaussian, discrete_gaussian, zcdp) form one part that receives
the delta left after the approximate-DP deltas, delta_G = delta - sum(delta_approx) (basic composition adds
deltas, so any split that sums to delta is valid; giving the whole remainder to the only part whose
epsilon depends on its delta is the best one). ``basic/1`` charges that part through its summed zCDP rho
(rho + 2 sqrt(rho ln(1/delta_G))). ``basic/2`` charges it by the SMALLEST of these valid bounds:

- the zCDP conversion of basic/1, computed from the same sums in the same order, so ``basic/2`` is never
  above ``basic/1`` on any history (the tests check it on every history they draw);
- when the part is only continuous Gaussians: their exact composition, mu-GDP with
  mu = sqrt(sum (Delta_i/sigma_i)^2) (Dong, Roth & Su 2022, Cor 3.3; adaptive composition included), and
  the exact profile of mu-GDP (the analytic Gaussian of Balle & Wang 2018);
- when the part is exactly ONE discrete Gaussian event on one coordinate (``max_coords`` 1, not
  self-composed) whose sensitivity is a whole number n of lattice steps and whose noise is at most
  ``MAX_EXACT_SIGMA_STEPS`` steps: the exact profile of N_Z(0, s^2) against N_Z(n, s^2), s = sigma/r
  (Canonne, Kamath & Steinke 2020, Thm 7). n is the event's charged sensitivity (the rounding charge is in
  it): a unit moves the rounded value by a whole number k <= n of steps, and the pair with shift k is
  dominated by the pair with shift n (the family has a monotone likelihood ratio;
  ``dpops.release_plan.coordinate_event`` gives the argument), so charging n never undercounts.

Any other mix (a discrete Gaussian vector, several discrete Gaussians, a zcdp event, continuous and
discrete together) is charged by the zCDP conversion alone, i.e. exactly as basic/1 charges it.

The profiles are computed as upper bounds on delta and inverted to an epsilon that is never below the
true one, within a stated tolerance (``dpops.accounting.gaussian_profiles``).

Running state: basic/1's three sums plus the GDP sum ``mu2``, the number of continuous and of other
Gaussian-type atomic events, and the one discrete Gaussian event (its JSON) while it is the only one,
so a ledger reservation stays O(new events) as under basic/1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from dpops.accounting import gaussian_profiles
from dpops.accounting.base import Accountant, State
from dpops.accounting.basic import zcdp_to_epsilon
from dpops.accounting.zcdp import check_state, zcdp_to_delta
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
    event_from_dict,
    event_to_dict,
    flatten,
)
from dpops.param_checks import check_delta, check_epsilon

_STATE_KEYS = ("eps", "delta", "rho", "mu2", "n_gaussian", "n_other", "single_dg")
_LATTICE_TOL = 1e-9  # as pld/1: a sensitivity within 1e-9 relative of n lattice steps is n steps


def lattice_shift(ev: DiscreteGaussian) -> int | None:
    """The event's sensitivity in whole lattice steps, or None when it is not one (then zCDP charges it).

    Within the tolerance of an integer k, k: the rounded value moves by a whole number of steps, at most
    sensitivity/r, so at most k whichever side of k the float quotient fell (pld/1's rule too)."""
    x = ev.l2_sensitivity / ev.resolution
    k = round(x)
    if k >= 1 and abs(x - k) <= _LATTICE_TOL * max(1.0, x):
        return int(k)
    return None


def exact_dg_eligible(ev: DiscreteGaussian) -> bool:
    """One coordinate, a whole-step sensitivity and a noise the lattice sum covers (module docstring)."""
    if ev.max_coords != 1 or lattice_shift(ev) is None:
        return False
    s = ev.sigma / ev.resolution
    return 1.0 <= s <= gaussian_profiles.MAX_EXACT_SIGMA_STEPS


class ExactBasicAccountant(Accountant):
    """``basic/2``: basic/1's composition, the Gaussian-type part by min(zCDP, its exact profile) (module docstring)."""

    name = "basic"
    version = "2"

    def empty_state(self) -> State:
        """basic/1's sums, the GDP sum, the two Gaussian-type counts and no single discrete Gaussian."""
        return {"eps": 0.0, "delta": 0.0, "rho": 0.0, "mu2": 0.0, "n_gaussian": 0, "n_other": 0, "single_dg": None}

    def add_events(self, state: State, events: Sequence[PrivacyEvent]) -> State:
        """Add each atomic event (times its multiplicity) to basic/1's sums, and count the Gaussian-type ones."""
        check_state(state, _STATE_KEYS, self.ref)
        eps, dlt, rho, mu2 = float(state["eps"]), float(state["delta"]), float(state["rho"]), float(state["mu2"])
        n_gauss, n_other = int(state["n_gaussian"]), int(state["n_other"])
        single: dict[str, Any] | None = state["single_dg"]
        for ev, k in flatten(events):
            if isinstance(ev, (Laplace, DiscreteLaplace, PureDP)):
                eps += k * ev.epsilon
            elif isinstance(ev, ApproxDP):
                eps += k * ev.epsilon
                dlt += k * ev.delta
            elif isinstance(ev, (Gaussian, DiscreteGaussian, ZCDP)):
                rho += k * ev.rho  # exactly basic/1's sum, in the same order
                if isinstance(ev, Gaussian):
                    n_gauss += k
                    mu2 += k * (ev.l2_sensitivity / ev.sigma) ** 2
                else:
                    first = n_other == 0 and k == 1 and isinstance(ev, DiscreteGaussian) and exact_dg_eligible(ev)
                    single = event_to_dict(ev) if first else None
                    n_other += k
            else:  # pragma: no cover - flatten yields atomic events only
                raise InvalidParameter(f"{self.ref} cannot compose {ev!r}: not a privacy event")
        if n_other != 1:
            single = None
        return {"eps": eps, "delta": dlt, "rho": rho, "mu2": mu2, "n_gaussian": n_gauss, "n_other": n_other,
                "single_dg": single}

    def _single(self, state: State) -> DiscreteGaussian | None:
        """The one discrete Gaussian of the Gaussian-type part, when the exact profile applies to the whole part."""
        if state["n_gaussian"] or state["n_other"] != 1 or state["single_dg"] is None:
            return None
        ev = event_from_dict(state["single_dg"])
        if not isinstance(ev, DiscreteGaussian) or not exact_dg_eligible(ev):
            raise InvalidParameter(f"{self.ref} running state 'single_dg' is not an eligible discrete Gaussian event; "
                                   "was it written by another accountant? Rebuild it from the ledger's events")
        return ev

    def _gaussian_part_epsilon(self, state: State, left: float) -> float:
        """epsilon of the Gaussian-type part alone at delta ``left`` > 0: the smallest valid bound."""
        zc = zcdp_to_epsilon(state["rho"], left)
        hi = zc if math.isfinite(zc) else 1e3
        best = zc
        ev = self._single(state)
        if ev is not None:
            n = lattice_shift(ev)
            assert n is not None  # exact_dg_eligible
            best = min(best, gaussian_profiles.dg_epsilon(ev.sigma / ev.resolution, n, left, hi))
        elif state["n_gaussian"] and not state["n_other"]:
            best = min(best, gaussian_profiles.gaussian_epsilon(math.sqrt(state["mu2"]), left, hi))
        return best

    def _gaussian_part_delta(self, state: State, spare: float) -> float:
        """delta of the Gaussian-type part alone at epsilon ``spare`` >= 0: the smallest valid bound."""
        best = zcdp_to_delta(state["rho"], spare)
        ev = self._single(state)
        if ev is not None:
            n = lattice_shift(ev)
            assert n is not None  # exact_dg_eligible
            best = min(best, gaussian_profiles.dg_delta(ev.sigma / ev.resolution, n, spare))
        elif state["n_gaussian"] and not state["n_other"]:
            best = min(best, gaussian_profiles.gaussian_delta(math.sqrt(state["mu2"]), spare))
        return best

    def state_epsilon(self, state: State, delta: float) -> float:
        """Summed epsilon plus the Gaussian-type part's epsilon at the delta left after the approx-DP deltas."""
        check_delta(delta)
        check_state(state, _STATE_KEYS, self.ref)
        left = delta - state["delta"]
        if left < 0:
            return math.inf
        if state["rho"] == 0:
            return state["eps"] + 0.0
        if left == 0:
            return math.inf
        return state["eps"] + self._gaussian_part_epsilon(state, left)

    def state_delta(self, state: State, epsilon: float) -> float:
        """The approx deltas plus the smallest delta the Gaussian-type part needs for the spare epsilon."""
        check_epsilon(epsilon)
        check_state(state, _STATE_KEYS, self.ref)
        spare = epsilon - state["eps"]
        if spare < 0:
            return 1.0
        if state["rho"] == 0:
            return min(1.0, state["delta"])
        return min(1.0, state["delta"] + self._gaussian_part_delta(state, spare))

    def describe(self) -> dict:
        """Records the profiles and their tolerances: they change the numbers."""
        return {
            "name": self.name,
            "version": self.version,
            "libraries": {},
            "composition": "basic: epsilons add, deltas add; the Gaussian-type part gets delta - sum(approx deltas)",
            "gaussian_part": "min(zCDP conversion as basic/1; one 1-coordinate discrete Gaussian: exact lattice "
                             "profile (CKS20 Thm 7); continuous Gaussians only: mu-GDP profile)",
            "profile_sum_relative_error": gaussian_profiles.SUM_REL_ERROR,
            "epsilon_relative_tolerance": gaussian_profiles.EPS_REL_TOL,
            "max_exact_sigma_steps": gaussian_profiles.MAX_EXACT_SIGMA_STEPS,
        }
