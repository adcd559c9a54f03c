"""Privacy events: a serializable, versioned description of what a release spent.

The ledger and the manifests store these, and every accountant composes them.
An event describes the *mechanism* (noise scale and sensitivity), not only an
(epsilon, delta) label, so that RDP/PLD accounting over many releases can be
tighter than adding epsilons (semantics.md section 4).

Stable JSON: every event dict carries ``"schema": "dpops.event/1"`` and a
``"kind"``. ``canonical_json`` is the byte form that is hashed; it never changes
for a given schema version. A new field or kind means a new schema version.

Kinds (all sensitivities are in the same units as the noise scale). ``max_coords``
on the Laplace-type and discrete Gaussian kinds is the number of output
coordinates one privacy unit can change: 1 for a scalar query, L0 (or 2·L0 for
``replace``) for a per-partition vector. Accountants whose tight analysis holds
only for scalars (PLDs of Laplace-type and discrete mechanisms) must fall back to
a dominating analysis when it is above 1; the Gaussian is rotation invariant, so
its scalar analysis is exact for any vector and it carries no such field.

- ``laplace``            continuous Laplace, scale b, L1 sensitivity; pure eps = Δ1/b.
- ``gaussian``           continuous Gaussian, std sigma, L2 sensitivity.
- ``discrete_laplace``   integer-lattice Laplace (two-sided geometric) on a grid of
                         ``resolution`` r: P(k·r) ∝ exp(-|k|·r/b). ``scale`` b and
                         ``l1_sensitivity`` are in value units and already include
                         the rounding charge; pure eps = Δ1/b.
- ``discrete_gaussian``  discrete Gaussian on the lattice rZ, ``sigma`` and
                         ``l2_sensitivity`` in value units (rounding charge included);
                         rho-zCDP with rho = Δ2²/(2σ²) + τ (Canonne, Kamath, Steinke 2020,
                         Thm 14: a d-dimensional discrete Gaussian pays a small τ term, a
                         sum over the dimension; we require σ ≥ 2r, where τ < 7.2e-17 +
                         d·5.2e-34 whatever d, and charge a flat DISCRETE_GAUSSIAN_TAU =
                         1e-12, which covers it for every d below 10^21).
- ``pure_dp``            any eps-DP mechanism, e.g. the exponential mechanism or
                         report-noisy-max; ``mechanism`` names it.
- ``approx_dp``          any (eps, delta)-DP mechanism, e.g. private partition
                         selection; ``mechanism`` names it.
- ``zcdp``               any rho-zCDP mechanism.
- ``composed``           the sequential composition of ``events``.
- ``self_composed``      ``count`` adaptive repetitions of ``event``.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from dpops.errors import InvalidParameter

EVENT_SCHEMA = "dpops.event/1"

# CKS20 Thm 14: tau = 10 * sum_{k=1}^{d-1} exp(-2 pi^2 s^2 k/(k+1)) for d coordinates, s = sigma/resolution
# >= 2. Each term is below 10 exp(-2 pi^2 s^2 / 2) and tends to 10 exp(-2 pi^2 s^2) = 5.1e-34 at s = 2, so
# tau < 7.2e-17 + d * 5.2e-34: the flat 1e-12 covers every release of fewer than 10^21 coordinates.
DISCRETE_GAUSSIAN_TAU = 1e-12
DISCRETE_GAUSSIAN_MIN_SIGMA_STEPS = 2.0


def canonical_json(obj: Any) -> str:
    """Deterministic JSON: sorted keys, no whitespace, floats by repr (round-trip exact).

    NaN and infinities are refused: they have no meaning in a privacy claim.
    """
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _finite_positive(x: Any, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
        raise InvalidParameter(f"privacy event: {what} must be a finite number > 0, got {x!r}")
    return float(x)


def _max_coords(x: Any, kind: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise InvalidParameter(f"privacy event: {kind} max_coords must be an integer >= 1, got {x!r}")
    return x


def _delta(x: Any, what: str = "delta") -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not (0 <= x < 1):
        raise InvalidParameter(f"privacy event: {what} must be in [0, 1), got {x!r}")
    return float(x)


@dataclass(frozen=True)
class Laplace:
    """Continuous Laplace noise of scale ``scale`` on a query of L1 sensitivity ``l1_sensitivity``."""

    scale: float
    l1_sensitivity: float
    max_coords: int = 1
    kind: str = field(default="laplace", init=False)

    def __post_init__(self) -> None:
        _finite_positive(self.scale, "laplace scale")
        _finite_positive(self.l1_sensitivity, "laplace l1_sensitivity")
        _max_coords(self.max_coords, "laplace")

    @property
    def epsilon(self) -> float:
        """Pure epsilon = Δ1 / b."""
        return self.l1_sensitivity / self.scale


@dataclass(frozen=True)
class Gaussian:
    """Continuous Gaussian noise of standard deviation ``sigma`` on a query of L2 sensitivity ``l2_sensitivity``."""

    sigma: float
    l2_sensitivity: float
    kind: str = field(default="gaussian", init=False)

    def __post_init__(self) -> None:
        _finite_positive(self.sigma, "gaussian sigma")
        _finite_positive(self.l2_sensitivity, "gaussian l2_sensitivity")

    @property
    def rho(self) -> float:
        """zCDP rho = Δ2² / (2σ²) (Bun & Steinke 2016, Prop 1.6)."""
        return self.l2_sensitivity**2 / (2 * self.sigma**2)


@dataclass(frozen=True)
class DiscreteLaplace:
    """Discrete Laplace noise on the lattice ``resolution``·Z; scale, sensitivity in value units (rounding charged)."""

    scale: float
    l1_sensitivity: float
    resolution: float = 1.0
    max_coords: int = 1
    kind: str = field(default="discrete_laplace", init=False)

    def __post_init__(self) -> None:
        _finite_positive(self.scale, "discrete_laplace scale")
        _finite_positive(self.l1_sensitivity, "discrete_laplace l1_sensitivity")
        _finite_positive(self.resolution, "discrete_laplace resolution")
        _max_coords(self.max_coords, "discrete_laplace")

    @property
    def epsilon(self) -> float:
        """Pure epsilon = Δ1 / b (the rounding charge is already in Δ1)."""
        return self.l1_sensitivity / self.scale


@dataclass(frozen=True)
class DiscreteGaussian:
    """Discrete Gaussian noise on the lattice ``resolution``·Z; sigma and sensitivity in value units, rounding charged.

    sigma must be at least DISCRETE_GAUSSIAN_MIN_SIGMA_STEPS lattice steps: the flat tau charge in ``rho`` is only
    valid there (see the module docstring).
    """

    sigma: float
    l2_sensitivity: float
    resolution: float = 1.0
    max_coords: int = 1
    kind: str = field(default="discrete_gaussian", init=False)

    def __post_init__(self) -> None:
        _finite_positive(self.sigma, "discrete_gaussian sigma")
        _finite_positive(self.l2_sensitivity, "discrete_gaussian l2_sensitivity")
        _finite_positive(self.resolution, "discrete_gaussian resolution")
        _max_coords(self.max_coords, "discrete_gaussian")
        if self.sigma < DISCRETE_GAUSSIAN_MIN_SIGMA_STEPS * self.resolution:
            raise InvalidParameter(
                f"privacy event: discrete_gaussian sigma={self.sigma!r} must be at least "
                f"{DISCRETE_GAUSSIAN_MIN_SIGMA_STEPS:g} x resolution={self.resolution!r} (the zCDP bound "
                "used for vectors needs it; calibrate with more noise or a finer resolution)"
            )

    @property
    def rho(self) -> float:
        """zCDP rho = Δ2² / (2σ²) plus the flat tau of CKS20 Thm 14 for vectors."""
        return self.l2_sensitivity**2 / (2 * self.sigma**2) + DISCRETE_GAUSSIAN_TAU


@dataclass(frozen=True)
class PureDP:
    """Any ε-DP mechanism (exponential mechanism, report-noisy-max), named by ``mechanism``."""

    epsilon: float
    mechanism: str = "pure_dp"
    kind: str = field(default="pure_dp", init=False)

    def __post_init__(self) -> None:
        _finite_positive(self.epsilon, "pure_dp epsilon")


@dataclass(frozen=True)
class ApproxDP:
    """Any (ε, δ)-DP mechanism (private partition selection), named by ``mechanism``; ε may be 0, not both."""

    epsilon: float
    delta: float
    mechanism: str = "approx_dp"
    kind: str = field(default="approx_dp", init=False)

    def __post_init__(self) -> None:
        # epsilon may be 0 for a pure-delta mechanism (e.g. a thresholding step).
        if isinstance(self.epsilon, bool) or not isinstance(self.epsilon, (int, float)) or not math.isfinite(
            self.epsilon
        ) or self.epsilon < 0:
            raise InvalidParameter(f"privacy event: approx_dp epsilon must be finite and >= 0, got {self.epsilon!r}")
        _delta(self.delta, "approx_dp delta")
        if self.epsilon == 0 and self.delta == 0:
            raise InvalidParameter("privacy event: approx_dp with epsilon=0 and delta=0 spends nothing; omit it")


@dataclass(frozen=True)
class ZCDP:
    """Any ρ-zCDP mechanism, named by ``mechanism``."""

    rho: float
    mechanism: str = "zcdp"
    kind: str = field(default="zcdp", init=False)

    def __post_init__(self) -> None:
        _finite_positive(self.rho, "zcdp rho")


@dataclass(frozen=True)
class Composed:
    """Sequential composition of ``events`` (at least one), in order."""

    events: tuple[PrivacyEvent, ...]
    kind: str = field(default="composed", init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "events", tuple(self.events))
        if not self.events:
            raise InvalidParameter("privacy event: composed needs at least one event")


@dataclass(frozen=True)
class SelfComposed:
    """``count`` adaptive repetitions of ``event``: how a per-partition mechanism is charged once per partition."""

    event: PrivacyEvent
    count: int
    kind: str = field(default="self_composed", init=False)

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise InvalidParameter(f"privacy event: self_composed count must be an integer >= 1, got {self.count!r}")


PrivacyEvent = (
    Laplace | Gaussian | DiscreteLaplace | DiscreteGaussian | PureDP | ApproxDP | ZCDP | Composed | SelfComposed
)

_SIMPLE = {
    "laplace": (Laplace, ("scale", "l1_sensitivity", "max_coords")),
    "gaussian": (Gaussian, ("sigma", "l2_sensitivity")),
    "discrete_laplace": (DiscreteLaplace, ("scale", "l1_sensitivity", "resolution", "max_coords")),
    "discrete_gaussian": (DiscreteGaussian, ("sigma", "l2_sensitivity", "resolution", "max_coords")),
    "pure_dp": (PureDP, ("epsilon", "mechanism")),
    "approx_dp": (ApproxDP, ("epsilon", "delta", "mechanism")),
    "zcdp": (ZCDP, ("rho", "mechanism")),
}


def event_to_dict(event: PrivacyEvent) -> dict[str, Any]:
    """The stable JSON form of an event."""
    if isinstance(event, Composed):
        return {"schema": EVENT_SCHEMA, "kind": "composed", "events": [event_to_dict(e) for e in event.events]}
    if isinstance(event, SelfComposed):
        return {"schema": EVENT_SCHEMA, "kind": "self_composed", "count": event.count,
                "event": event_to_dict(event.event)}
    kind = getattr(event, "kind", None)
    cls_fields = _SIMPLE.get(kind) if isinstance(kind, str) else None
    if cls_fields is None or not isinstance(event, cls_fields[0]):
        raise InvalidParameter(f"not a privacy event: {event!r}")
    out: dict[str, Any] = {"schema": EVENT_SCHEMA, "kind": event.kind}
    for name in cls_fields[1]:
        out[name] = getattr(event, name)
    return out


def event_from_dict(data: object) -> PrivacyEvent:
    """Parse the stable JSON form; unknown schema versions, kinds or fields are refused.

    ``data`` is untrusted parsed JSON (a ledger row, a manifest), so anything is accepted and checked here.
    """
    if not isinstance(data, Mapping):
        raise InvalidParameter(f"privacy event must be a JSON object, got {type(data).__name__}")
    schema = data.get("schema", EVENT_SCHEMA)
    if schema != EVENT_SCHEMA:
        raise InvalidParameter(f"privacy event schema {schema!r} is not supported (expected {EVENT_SCHEMA!r})")
    kind = data.get("kind")
    if kind == "composed":
        _only(data, {"events"})
        events = data.get("events")
        if not isinstance(events, list):
            raise InvalidParameter("privacy event 'composed' needs a list 'events'")
        return Composed(tuple(event_from_dict(e) for e in events))
    if kind == "self_composed":
        _only(data, {"event", "count"})
        # the count is checked by SelfComposed itself, like every field of the simple kinds
        return SelfComposed(event_from_dict(data.get("event")), cast(int, data.get("count")))
    if kind not in _SIMPLE:
        raise InvalidParameter(
            f"unknown privacy event kind {kind!r}; known: {sorted(_SIMPLE) + ['composed', 'self_composed']}"
        )
    cls, names = _SIMPLE[kind]
    _only(data, set(names))
    kwargs = {n: data[n] for n in names if n in data}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise InvalidParameter(f"privacy event {kind!r}: {exc}") from None


def _only(data: Mapping[str, Any], allowed: set[str]) -> None:
    extra = set(data) - allowed - {"schema", "kind"}
    if extra:
        raise InvalidParameter(f"privacy event {data.get('kind')!r}: unknown field(s) {sorted(extra)}")


def events_to_json(events: Iterable[PrivacyEvent]) -> str:
    """Canonical JSON of a list of events: the form the ledger stores and hashes."""
    return canonical_json([event_to_dict(e) for e in events])


def events_from_json(text: str) -> list[PrivacyEvent]:
    """Parse a list of events (or one event object) from JSON; anything malformed is an ``InvalidParameter``."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidParameter(f"privacy events are not valid JSON: {exc}") from None
    if isinstance(data, Mapping):
        data = [data]
    if not isinstance(data, list):
        raise InvalidParameter("privacy events must be a JSON list of event objects")
    return [event_from_dict(d) for d in data]


def event_hash(event: PrivacyEvent) -> str:
    """SHA-256 of the event's canonical JSON: stable for a given event schema version."""
    return hashlib.sha256(canonical_json(event_to_dict(event)).encode()).hexdigest()


def flatten(events: Iterable[PrivacyEvent]) -> Iterator[tuple[PrivacyEvent, int]]:
    """Yield (atomic event, multiplicity), unrolling composed and self_composed events."""
    for e in events:
        if isinstance(e, Composed):
            yield from flatten(e.events)
        elif isinstance(e, SelfComposed):
            for inner, k in flatten([e.event]):
                yield inner, k * e.count
        else:
            yield e, 1
