"""Privacy-loss-distribution accountant (``pld/1``) built on ``dp_accounting.pld``.

Fixed choices of version 1 (recorded in ``describe()``): pessimistic estimates
(every rounding of the privacy loss goes up, so reported numbers are upper
bounds), ``value_discretization_interval = 1e-4``, dp_accounting's default tail
truncation (truncated mass is charged to delta in pessimistic mode).

Which PLD each event gets, and why it never under-reports:

- gaussian: the exact Gaussian PLD (standard deviation sigma, sensitivity Δ2).
  Exact for vector queries too: the Gaussian is rotation invariant, so only the
  L2 norm of the shift matters.
- laplace: the exact Laplace PLD (parameter b, sensitivity Δ1), i.e. the PLD of
  a scalar query whose value moves by Δ1.
- discrete_laplace: when Δ1/resolution is an integer n (within 1e-9), the exact
  discrete Laplace PLD on the lattice (parameter resolution/b, sensitivity n).
  Otherwise the PLD of randomized response with eps = Δ1/b
  (``from_privacy_parameters(eps, 0)``), which dominates every eps-DP mechanism.
- discrete_gaussian: when Δ2/resolution is an integer n, the exact discrete
  Gaussian PLD on the lattice (sigma/resolution, sensitivity n; CKS 2020).
  Otherwise it is charged by its zCDP rho = Δ2²/(2σ²) in the RDP part below.
- pure_dp: randomized response with its eps: the worst case of any eps-DP
  mechanism, so a dominating pair.
- approx_dp: ``from_privacy_parameters(eps, delta)``, the dominating pair of any
  (eps, delta)-DP mechanism (Meiser & Mohammadi 2018; dp_accounting docs).
- zcdp: no PLD; charged in the RDP part.

The RDP part (zcdp events and non-lattice discrete Gaussians) is composed
*beside* the PLD by basic composition: eps(delta) = eps_pld(delta - d2) +
eps_rdp(d2), minimised over a fixed grid of splits d2 = f·delta (``SPLITS``).

Finally the accountant reports min(that, rdp/1 on the same history): both are
valid bounds for the same composition, and the minimum keeps pld/1 never worse
than rdp/1 (e.g. when discretisation, at most 1e-4 per composed event, would
exceed what the PLD gains on a short pure-eps history).

Running state: ``{"events": {canonical event JSON: count}}``. Composing k copies
of one event is one ``self_compose(k)``, so checking a cap costs in the number of
*distinct* events, not in the history length. Composed PLDs are cached in-process.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence

import dp_accounting
import numpy as np
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from dpops.accounting.base import Accountant, State
from dpops.accounting.rdp import RdpAccountant, rdp_to_delta, rdp_to_epsilon
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
    SelfComposed,
    canonical_json,
    event_from_dict,
    event_to_dict,
    flatten,
)
from dpops.param_checks import check_delta, check_epsilon

VALUE_DISCRETIZATION_INTERVAL = 1e-4
SPLITS = (0.5, 0.1, 0.01, 0.001, 0.9, 0.99)
_LATTICE_TOL = 1e-9


# Fine grids (real-valued sums: r <= Δ/2^10) give lattice sensitivities above 1000 whose exact
# discrete-Gaussian PLDs take seconds to build and compose; those are charged by their zCDP rho
# in the RDP part instead (valid, slightly looser), which keeps a ledger reservation fast.
MAX_EXACT_DG_LATTICE_SENSITIVITY = 256


def _lattice_sensitivity(sensitivity: float, resolution: float) -> int | None:
    n = sensitivity / resolution
    k = round(n)
    if k >= 1 and abs(n - k) <= _LATTICE_TOL * max(1.0, n):
        return int(k)
    return None


def _rr(eps: float, delta: float = 0.0) -> pld_lib.PrivacyLossDistribution:
    return pld_lib.from_privacy_parameters(
        pld_common.DifferentialPrivacyParameters(eps, delta),
        value_discretization_interval=VALUE_DISCRETIZATION_INTERVAL,
    )


def event_pld(ev: PrivacyEvent) -> pld_lib.PrivacyLossDistribution | None:
    """The (dominating) PLD of one atomic event, or None if it is charged in the RDP part."""
    vdi = VALUE_DISCRETIZATION_INTERVAL
    if isinstance(ev, Gaussian):
        return pld_lib.from_gaussian_mechanism(
            ev.sigma, sensitivity=ev.l2_sensitivity, pessimistic_estimate=True, value_discretization_interval=vdi
        )
    if isinstance(ev, (Laplace, DiscreteLaplace)) and ev.max_coords > 1:
        # The Laplace PLD is exact for a scalar shift; for a vector of L1 norm Δ no
        # dominance of the scalar case is proven, so use randomized response at
        # eps = Δ1/b, which dominates every eps-DP mechanism.
        return _rr(ev.epsilon)
    if isinstance(ev, DiscreteGaussian) and ev.max_coords > 1:
        return None  # charged by its zCDP rho (CKS20 Thm 14, tau included) in the RDP part
    if isinstance(ev, Laplace):
        return pld_lib.from_laplace_mechanism(
            ev.scale, sensitivity=ev.l1_sensitivity, pessimistic_estimate=True, value_discretization_interval=vdi
        )
    if isinstance(ev, DiscreteLaplace):
        n = _lattice_sensitivity(ev.l1_sensitivity, ev.resolution)
        if n is None:
            return _rr(ev.epsilon)
        return pld_lib.from_discrete_laplace_mechanism(
            ev.resolution / ev.scale, sensitivity=n, pessimistic_estimate=True, value_discretization_interval=vdi
        )
    if isinstance(ev, DiscreteGaussian):
        n = _lattice_sensitivity(ev.l2_sensitivity, ev.resolution)
        if n is None or n > MAX_EXACT_DG_LATTICE_SENSITIVITY:
            return None
        return pld_lib.from_discrete_gaussian_mechanism(
            ev.sigma / ev.resolution, sensitivity=n, pessimistic_estimate=True, value_discretization_interval=vdi
        )
    if isinstance(ev, PureDP):
        return _rr(ev.epsilon)
    if isinstance(ev, ApproxDP):
        return _rr(ev.epsilon, ev.delta)
    if isinstance(ev, ZCDP):
        return None
    raise InvalidParameter(f"pld/1 cannot compose {ev!r}: not a privacy event")


@functools.lru_cache(maxsize=8)  # composed PLDs can be megabytes each
def _composed(items: tuple[tuple[str, int], ...]):
    """(PLD or None, RDP state of the beside part) for a frozen multiset of events."""
    pld = None
    beside: list[PrivacyEvent] = []
    for key, count in items:
        ev = event_from_dict(json.loads(key))
        one = event_pld(ev)
        if one is None:
            beside.append(SelfComposed(ev, count))
            continue
        one = one.self_compose(count) if count > 1 else one
        pld = one if pld is None else pld.compose(one)
    rdp = RdpAccountant()
    rdp_state = rdp.add_events(rdp.empty_state(), beside)
    return pld, rdp_state


class PldAccountant(Accountant):
    """``pld/1``: privacy loss distributions from dp_accounting (pessimistic), never looser than ``rdp/1``.

    The running state is the multiset of atomic events (canonical JSON -> count): a PLD cannot be
    stored compactly, so it is rebuilt from the events on each query (``_composed`` caches it).
    """

    name = "pld"
    version = "1"

    def empty_state(self) -> State:
        """No events."""
        return {"events": {}}

    def _items(self, state: State) -> tuple[tuple[str, int], ...]:
        check_state(state, ("events",), self.ref)
        events = state["events"]
        if not isinstance(events, dict) or not all(isinstance(c, int) and c >= 1 for c in events.values()):
            raise InvalidParameter(f"{self.ref} running state 'events' must map event JSON to counts >= 1")
        return tuple(sorted(events.items()))

    def _history(self, items) -> list[PrivacyEvent]:
        return [SelfComposed(event_from_dict(json.loads(k)), c) for k, c in items]

    def add_events(self, state: State, events: Sequence[PrivacyEvent]) -> State:
        """Count each atomic event by its canonical JSON; nothing is composed until a query."""
        out = dict(self._items(state))
        for ev, k in flatten(events):
            if not isinstance(ev, (Gaussian, Laplace, DiscreteLaplace, DiscreteGaussian, PureDP, ApproxDP, ZCDP)):
                raise InvalidParameter(f"{self.ref} cannot compose {ev!r}: not a privacy event")
            key = canonical_json(event_to_dict(ev))
            out[key] = out.get(key, 0) + k
        return {"events": out}

    def state_epsilon(self, state: State, delta: float) -> float:
        """The PLD's epsilon (with the events it cannot represent composed beside through RDP), capped by ``rdp/1``."""
        check_delta(delta)
        items = self._items(state)
        if not items:
            return 0.0
        pld, rdp_state = _composed(items)
        rdp = RdpAccountant()
        if not any(rdp_state["rdp_all"]):
            own = pld.get_epsilon_for_delta(delta)
        elif pld is None:
            own = rdp.state_epsilon(rdp_state, delta)
        else:
            vec = _vec(rdp_state)
            own = min(pld.get_epsilon_for_delta(delta * (1 - f)) + rdp_to_epsilon(vec, delta * f) for f in SPLITS)
        via_rdp = rdp.epsilon(self._history(items), delta)
        return float(max(0.0, min(own, via_rdp)))

    def state_delta(self, state: State, epsilon: float) -> float:
        """The PLD's delta (events it cannot represent composed beside through RDP), capped by ``rdp/1``."""
        check_epsilon(epsilon)
        items = self._items(state)
        if not items:
            return 0.0
        pld, rdp_state = _composed(items)
        rdp = RdpAccountant()
        if not any(rdp_state["rdp_all"]):
            own = float(pld.get_delta_for_epsilon(epsilon))
        elif pld is None:
            own = rdp.state_delta(rdp_state, epsilon)
        else:
            vec = _vec(rdp_state)
            own = min(
                float(pld.get_delta_for_epsilon(epsilon * (1 - f))) + rdp_to_delta(vec, epsilon * f) for f in SPLITS
            )
        via_rdp = rdp.delta(self._history(items), epsilon)
        return float(min(1.0, own, via_rdp))

    def describe(self) -> dict:
        """Also records the dp_accounting version and discretisation: they change the numbers."""
        return {
            "name": self.name,
            "version": self.version,
            "libraries": {"dp_accounting": _dp_accounting_version()},
            "value_discretization_interval": VALUE_DISCRETIZATION_INTERVAL,
            "pessimistic_estimate": True,
            "beside_splits": list(SPLITS),
            "also_bounded_by": "rdp/1",
        }


def _vec(rdp_state: State) -> np.ndarray:
    return np.asarray(rdp_state["rdp_all"], dtype=float)


def _dp_accounting_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dp-accounting")
    except PackageNotFoundError:  # pragma: no cover - installed with dpops
        return getattr(dp_accounting, "__version__", "unknown")
