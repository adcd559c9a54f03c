"""Calibrated additive-noise mechanisms: what the Beam pipeline calls.

Every mechanism adds *integer* noise sampled exactly (``dpops.noise.samplers``):

- integer-valued queries (counts): true integer + integer noise, resolution r = 1, no rounding;
- real-valued queries ("secure noise generation", Google 2020; Mironov 2012): each value is
  rounded to the nearest multiple of a power-of-two resolution r and r·(integer noise) is added,
  so the output is exactly representable and no floating-point artefact depends on the input.

Rounding charge. Rounding moves each coordinate by at most r/2, so two neighbouring inputs
whose query vectors differ by Δ1 (L1) / Δ2 (L2) and in at most ``max_coords`` = m coordinates
have rounded vectors differing by at most Δ1 + r·m (L1) / Δ2 + r·sqrt(m) (L2). In lattice units
(divided by r) we charge the integer ceil(Δ/r + m) (resp. ceil(Δ2/r + sqrt(m))), which is what
``l1_sensitivity``/``l2_sensitivity`` record (times r).

Resolution policy (public parameters only): r is the largest power of two with
r·m ≤ Δ1/2**10 (L1) or r·sqrt(m) ≤ Δ2/2**10 (L2), so the rounding costs at most 2**-10 ≈ 0.1%
of the sensitivity (plus the ceil, at most one more lattice step, another ≤ 0.1%), and the grid
is ≥ 2**10·m/ε times finer than the Laplace scale. A plan calibrated by pld/1 may ask for fewer bits
(``resolution_bits``) for a one-coordinate Gaussian vector, so that pld/1 analyses it with the exact
discrete-Gaussian lattice PLD; the rounding charge above holds for any power-of-two r.

Calibration of the Gaussian: ``calibration="exact"`` uses the exact (ε, δ) of the discrete
Gaussian (CKS20 Thm 7) when one coordinate changes (m = 1); that profile is what a PLD accountant
certifies. With m > 1, or ``calibration="zcdp"``, σ is set so the event's ρ converts to ≤ ε by
ε = ρ + 2 sqrt(ρ ln(1/δ)), which every accountant (basic, zcdp, rdp, pld) certifies.
Measured for ε=1, δ=1e-6, Δ=1: exact σ=4.2308 is certified as ε=1.00006 by pld/1 (its
pessimistic discretisation), 1.076 by rdp/1 and 1.27 by zcdp/1. When the scope's accountant is
known, pass ``accountant="pld/1"`` (or any ref): σ is then bisected until that accountant
certifies ≤ ε for the single event (pld/1: σ=4.2311; rdp/1: 4.537; basic/zcdp: 5.350).
The discrete Gaussian event charges ρ = Δ²/(2σ²) + τ (``events.DISCRETE_GAUSSIAN_TAU``, CKS20
Thm 14) and needs σ ≥ 2r: σ is calibrated against ρ − τ and never set below 2 lattice steps
(more noise than asked in that corner, never less).
The scale is always rounded *up* to the exact rational the sampler uses; ``scale`` records
a double ≤ that exact value, so a claim recomputed from the event is conservative.

Exact fixed-point input (``add_noise_fixed``, the pipeline's sums). The Δ + r·m charge holds
for the rounding of the *exact* query value. A float64 running sum is not exact (its error
depends on row order and on the other rows: issue 11 item 4), so the pipeline accumulates
each sum as an exact integer count N of a power-of-two step g (``pipelines.bounding``: every
row's term snapped once to g and kept inside the term bounds Δ is derived from, so N·g is a
function of sensitivity exactly Δ). ``add_noise_fixed`` rounds N·g to the nearest multiple
of r in integer arithmetic (ties to even, no float on the way), so |rounded − N·g| ≤ r/2 per
coordinate holds exactly and the charge Δ + r·m is unchanged: two neighbours' lattice vectors
differ by at most Δ/r + m in L1 (Δ2/r + sqrt(m) in L2). The lattice value is saturated at
±(2**52 − 1): clamping is 1-Lipschitz (never raises a sensitivity) and replaces a data-dependent
error by a bounded output; it is reached only by sums beyond 2**52·r.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, cast

import numpy as np

from dpops.errors import InvalidParameter
from dpops.events import (
    DISCRETE_GAUSSIAN_MIN_SIGMA_STEPS,
    DISCRETE_GAUSSIAN_TAU,
    DiscreteGaussian,
    DiscreteLaplace,
)
from dpops.noise.calibration import (
    discrete_gaussian_delta,
    discrete_gaussian_sigma,
    gaussian_sigma_analytic,
    zcdp_epsilon,
    zcdp_rho_for,
)
from dpops.noise.randomness import RandomSource
from dpops.noise.samplers import (
    DiscreteGaussianParam,
    DiscreteLaplaceParam,
    discrete_gaussian,
    discrete_gaussian_param,
    discrete_laplace,
    discrete_laplace_param,
    float_up,
)
from dpops.param_checks import check_delta, check_epsilon, check_positive, check_positive_int

RESOLUTION_BITS = 10
Target = tuple[tuple[str, float], ...]  # the requested budget, e.g. (("epsilon", 1.0), ("delta", 1e-6))
_MAX_LATTICE = 2**52  # |rounded value + noise| in lattice units must stay exact in a double


@dataclass(frozen=True)
class NoiseParams:
    """The noise a vector gets, as calibrated: enough to draw it and to record and re-check the privacy claim.

    ``scale`` and the sensitivities are the conservatively rounded floats the event records; ``lattice`` is
    the exact integer-lattice parameter the sampler uses (rebuilt from ``scale`` when absent).
    """

    family: str  # "laplace" | "gaussian"
    integer_valued: bool
    resolution: float
    scale: float  # Laplace b or Gaussian sigma actually used, value units (<= exact value)
    l1_sensitivity: float | None
    l2_sensitivity: float | None
    std: float
    lattice: DiscreteLaplaceParam | DiscreteGaussianParam | None = field(default=None, repr=False)
    max_coords: int = 1
    calibration: str = "pure"  # "pure" | "cks20_exact" | "zcdp_conversion" | "zcdp"
    target: Target = ()  # requested (("epsilon", e), ("delta", d)) or (("rho", r),), for the record

    def event(self) -> DiscreteLaplace | DiscreteGaussian:
        """The privacy event this noise spends, from the recorded (conservatively rounded) floats."""
        if self.family == "laplace":
            return self._laplace_event()
        return self._gaussian_event()

    # A None sensitivity (the other family's field) is refused by the event's own check, hence the casts.
    def _laplace_event(self) -> DiscreteLaplace:
        return DiscreteLaplace(
            scale=self.scale, l1_sensitivity=cast(float, self.l1_sensitivity), resolution=self.resolution,
            max_coords=self.max_coords,
        )

    def _gaussian_event(self) -> DiscreteGaussian:
        return DiscreteGaussian(
            sigma=self.scale, l2_sensitivity=cast(float, self.l2_sensitivity), resolution=self.resolution,
            max_coords=self.max_coords,
        )

    def lattice_halfwidth(self, coverage: float = 0.95) -> int:
        """Smallest integer h with P(|K| > h) <= 1 - coverage for the integer noise K."""
        alpha = 1.0 - coverage
        lat = self._lattice()
        if isinstance(lat, DiscreteLaplaceParam):
            p = math.exp(-lat.s / lat.t)
            if 2 * lat.tail(1) <= alpha:  # also when p underflows to 0 (scale far below one lattice step)
                return 0
            # P(|K| > h) = 2 p^(h+1)/(1+p)
            h = max(0, math.ceil(math.log(alpha / 2 * (1 + p)) / math.log(p)) - 1)
            while h > 0 and 2 * lat.tail(h) <= alpha:
                h -= 1
            while 2 * lat.tail(h + 1) > alpha:
                h += 1
            return h
        sigma = math.sqrt(float(lat.sigma2))
        lo, hi = -1, int(6 * sigma) + 10  # 2·tail(hi+1) <= alpha; find the smallest such h
        # Narrow the bracket around the normal quantile (the discrete Gaussian's tail is within a few
        # lattice steps of it); kept only if it really brackets, so the answer is the same exact h.
        from statistics import NormalDist

        guess = NormalDist().inv_cdf(1 - alpha / 2) * sigma
        g_lo, g_hi = max(-1, int(guess * 0.98) - 3), min(hi, int(guess * 1.02) + 3)
        if (g_lo < 0 or 2 * lat.tail(g_lo + 1) > alpha) and 2 * lat.tail(g_hi + 1) <= alpha:
            lo, hi = g_lo, g_hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if 2 * lat.tail(mid + 1) <= alpha:
                hi = mid
            else:
                lo = mid
        return hi

    def halfwidth(self, coverage: float = 0.95) -> float:
        """Half-width (value units) of a ``coverage`` interval for the true value, from public parameters only.

        The one owner of per-value interval widths: the pipeline's published intervals
        (``ci95_halfwidth``), ``dpops spec check``/``plan`` and the report all call it. Exact for the
        integer noise (the smallest lattice h with P(|K| > h) <= 1 - coverage, from the pmf), plus, for
        real-valued queries, the rounding to the grid (r/2, a worst case). Post-processing of public
        parameters: it costs no privacy.
        """
        if not (0.0 < coverage < 1.0):
            raise InvalidParameter(f"coverage must be strictly between 0 and 1, got {coverage!r}")
        h = self.lattice_halfwidth(coverage) * self.resolution
        return h if self.integer_valued else h + self.resolution / 2

    def noise_coverage(self, lattice_halfwidth: int) -> float:
        """Exact P(|K| <= h) of the integer noise K (the probability the ``halfwidth`` interval covers the noise)."""
        h = int(lattice_halfwidth)
        if h < 0:
            return 0.0
        return max(0.0, 1.0 - 2.0 * self._lattice().tail(h + 1))

    def lattice_param(self) -> DiscreteLaplaceParam | DiscreteGaussianParam:
        """The exact lattice distribution the sampler draws from (for predictions; never to sample)."""
        return self._lattice()

    def ci95_halfwidth(self) -> float:
        """Half-width of a 95% interval for the true value, from public parameters only (``halfwidth(0.95)``).

        Covers the noise (≥ 95%) plus, for real-valued queries, the rounding to the grid (r/2).
        """
        return self.halfwidth(0.95)

    def _lattice(self) -> DiscreteLaplaceParam | DiscreteGaussianParam:
        if self.lattice is not None:
            return self.lattice
        if self.family == "laplace":
            return discrete_laplace_param(Fraction(self.scale) / Fraction(self.resolution))
        return discrete_gaussian_param(Fraction(self.scale) / Fraction(self.resolution))

    def describe(self) -> dict[str, Any]:
        """JSON for manifests: parameters, sensitivities and the exact lattice parameter."""
        lat = self._lattice()
        if isinstance(lat, DiscreteLaplaceParam):
            exact = {"lattice_scale": f"{lat.t}/{lat.s}"}
        else:
            exact = {"lattice_sigma2": f"{lat.t * lat.c}/{lat.b}"}
        return {
            "family": self.family,
            "sampler": "discrete_laplace" if self.family == "laplace" else "discrete_gaussian",
            "integer_valued": self.integer_valued,
            "resolution": self.resolution,
            "scale": self.scale,
            "l1_sensitivity": self.l1_sensitivity,
            "l2_sensitivity": self.l2_sensitivity,
            "max_coords": self.max_coords,
            "std": self.std,
            "ci95_halfwidth": self.ci95_halfwidth(),
            "calibration": self.calibration,
            "target": dict(self.target),
            **exact,
        }


def choose_resolution(sensitivity: float, coord_factor: float, bits: int = RESOLUTION_BITS) -> float:
    """Largest power of two r with r·coord_factor <= sensitivity / 2**bits (``RESOLUTION_BITS`` unless a plan says)."""
    x = sensitivity / (coord_factor * 2.0**bits)
    _, e = math.frexp(x)  # x = f·2**e, f in [0.5, 1)
    r = math.ldexp(1.0, e - 1)
    if r * coord_factor * 2.0**bits > sensitivity:  # float rounding in x: step down
        r /= 2
    return r


def _lattice_sensitivity(sens: float, integer_valued: bool, m: int, norm: str,
                         bits: int = RESOLUTION_BITS) -> tuple[float, Fraction]:
    """(resolution r, charged sensitivity in lattice units as an exact Fraction)."""
    if integer_valued:
        return 1.0, Fraction(sens)
    factor = m if norm == "l1" else math.sqrt(m)
    r = choose_resolution(sens, factor, bits)
    if norm == "l1":
        extra = Fraction(m)
    else:
        extra = Fraction(float_up(Fraction(math.sqrt(m))))
        if extra * extra < m:  # pragma: no cover - sqrt is correctly rounded
            extra = Fraction(math.nextafter(float(extra), math.inf))
    lat = Fraction(sens) / Fraction(r) + extra
    return r, Fraction(math.ceil(lat))


def charged_sensitivity(sens: float, integer_valued: bool, max_coords: int, norm: str,
                        resolution_bits: int = RESOLUTION_BITS) -> float:
    """The sensitivity a mechanism charges for ``sens`` (the rounding to its grid included): r times the
    integer ceil(sens/r + m) (L1) or ceil(sens/r + sqrt(m)) (L2); ``sens`` itself for integer queries. The
    one formula, for ``manifest verify`` to recompute a plan's ``*_sensitivity_charged``."""
    r, lat = _lattice_sensitivity(float(sens), bool(integer_valued), int(max_coords), norm, int(resolution_bits))
    return float(r * lat)


def _check_common(sens: float, name: str, integer_valued: Any, max_coords: int) -> tuple[float, bool, int]:
    sens = check_positive(sens, name)
    if not isinstance(integer_valued, bool):
        raise InvalidParameter(f"integer_valued must be True or False, got {integer_valued!r}")
    m = check_positive_int(max_coords, "max_coords")
    return sens, integer_valued, m


def laplace_mechanism(epsilon: float, l1_sensitivity: float, *, integer_valued: bool,
                      max_coords: int = 1) -> NoiseParams:
    """ε-DP discrete Laplace noise for a query with L1 sensitivity Δ1 (value units)."""
    epsilon = check_epsilon(epsilon)
    sens, integer_valued, m = _check_common(l1_sensitivity, "l1_sensitivity", integer_valued, max_coords)
    r, lat_sens = _lattice_sensitivity(sens, integer_valued, m, "l1")
    lat = discrete_laplace_param(lat_sens / Fraction(epsilon))
    fr = Fraction(r)
    scale = float(fr * lat.scale)  # r power of two, t < 2**53: exact
    if Fraction(scale) != fr * lat.scale:  # pragma: no cover - guarded by the bit budget of the param
        raise InvalidParameter("internal: Laplace scale is not exactly representable")
    l1 = float_up(fr * lat_sens)
    params = NoiseParams(
        family="laplace",
        integer_valued=integer_valued,
        resolution=r,
        scale=scale,
        l1_sensitivity=l1,
        l2_sensitivity=None,
        std=r * math.sqrt(lat.variance()),
        lattice=lat,
        max_coords=m,
        calibration="pure",
        target=(("epsilon", epsilon),),
    )
    if not params._laplace_event().epsilon <= epsilon:  # pragma: no cover - rounding is upward by construction
        raise InvalidParameter("internal: Laplace calibration does not certify the requested epsilon")
    return params


def _gaussian_params(lat: DiscreteGaussianParam, r: float, lat_sens: Fraction, integer_valued: bool, m: int,
                     calibration: str, target: Target) -> NoiseParams:
    fr = Fraction(r)
    return NoiseParams(
        family="gaussian",
        integer_valued=integer_valued,
        resolution=r,
        scale=r * lat.sigma_float,  # times a power of two: exact, and <= the exact sigma
        l1_sensitivity=None,
        l2_sensitivity=float_up(fr * lat_sens),
        std=r * math.sqrt(lat.variance()),
        lattice=lat,
        max_coords=m,
        calibration=calibration,
        target=target,
    )


def gaussian_mechanism(
    epsilon: float,
    delta: float,
    l2_sensitivity: float,
    *,
    integer_valued: bool,
    max_coords: int = 1,
    calibration: str = "exact",
    accountant: str | None = None,
) -> NoiseParams:
    """(ε, δ)-DP discrete Gaussian noise (see the module docstring for the calibrations).

    ``accountant="pld/1"`` (any registered ref) calibrates instead to the smallest σ whose single
    event that accountant certifies at ≤ ε (bisection between a lower bound and the zCDP σ):
    use it when the budget scope is checked by that accountant.
    """
    epsilon = check_epsilon(epsilon)
    delta = check_delta(delta, allow_zero=False)
    sens, integer_valued, m = _check_common(l2_sensitivity, "l2_sensitivity", integer_valued, max_coords)
    if calibration not in ("exact", "zcdp"):
        raise InvalidParameter(f"calibration must be 'exact' or 'zcdp', got {calibration!r}")
    r, lat_sens = _lattice_sensitivity(sens, integer_valued, m, "l2")
    target = (("epsilon", epsilon), ("delta", delta))
    if accountant is not None:
        return _gaussian_for_accountant(epsilon, delta, r, lat_sens, integer_valued, m, accountant, target)
    if calibration == "exact" and m == 1:
        d_int = math.ceil(lat_sens)  # one coordinate: integer differences of size <= ceil
        lat_sens = Fraction(d_int)
        sigma = max(discrete_gaussian_sigma(epsilon, delta, float(d_int)), DISCRETE_GAUSSIAN_MIN_SIGMA_STEPS)
        for _ in range(100):
            lat = discrete_gaussian_param(sigma)
            params = _gaussian_params(lat, r, lat_sens, integer_valued, m, "cks20_exact", target)
            ev = params._gaussian_event()
            # verify on the recorded (conservative) floats, in lattice units
            if discrete_gaussian_delta(epsilon, (ev.sigma / r) ** 2, round(ev.l2_sensitivity / r)) <= delta:
                return params
            sigma *= 1 + 1e-9
        raise InvalidParameter("internal: discrete Gaussian calibration did not verify")  # pragma: no cover
    rho = zcdp_rho_for(epsilon, delta) - DISCRETE_GAUSSIAN_TAU  # the event charges tau on top
    if rho <= 0:
        raise InvalidParameter(f"epsilon={epsilon} is too small for a discrete Gaussian at delta={delta}")
    sigma = max(float(lat_sens) / math.sqrt(2 * rho), DISCRETE_GAUSSIAN_MIN_SIGMA_STEPS)
    for _ in range(100):
        lat = discrete_gaussian_param(sigma)
        params = _gaussian_params(lat, r, lat_sens, integer_valued, m, "zcdp_conversion", target)
        if zcdp_epsilon(params._gaussian_event().rho, delta) <= epsilon:
            return params
        sigma *= 1 + 1e-12
    raise InvalidParameter("internal: zCDP calibration did not verify")  # pragma: no cover


def _gaussian_for_accountant(epsilon: float, delta: float, r: float, lat_sens: Fraction, integer_valued: bool,
                             m: int, ref: str, target: Target) -> NoiseParams:
    from dpops.accounting import get_accountant  # lazy: accounting is a separate layer

    acct = get_accountant(ref)
    label = f"accountant:{acct.ref}"

    def build(sigma: float) -> NoiseParams:
        sigma = max(sigma, DISCRETE_GAUSSIAN_MIN_SIGMA_STEPS)
        return _gaussian_params(discrete_gaussian_param(sigma), r, lat_sens, integer_valued, m, label, target)

    def ok(p: NoiseParams) -> bool:
        return acct.epsilon([p.event()], delta) <= epsilon

    # the analytic continuous Gaussian is a lower bound for any valid analysis of this event
    lo = gaussian_sigma_analytic(epsilon, delta, float(lat_sens)) * 0.5
    hi = max(float(lat_sens) / math.sqrt(2 * zcdp_rho_for(epsilon, delta)), lo * 2)
    while not ok(build(hi)):
        hi *= 1.5
        if hi > 2.0**49:
            raise InvalidParameter(f"accountant {acct.ref} certifies no discrete Gaussian at epsilon={epsilon}")
    if ok(build(lo)):
        return build(lo)
    while hi - lo > 1e-9 * hi:
        mid = 0.5 * (lo + hi)
        if ok(build(mid)):
            hi = mid
        else:
            lo = mid
    return build(hi)


def gaussian_mechanism_zcdp(rho: float, l2_sensitivity: float, *, integer_valued: bool,
                            max_coords: int = 1, resolution_bits: int = RESOLUTION_BITS) -> NoiseParams:
    """ρ-zCDP discrete Gaussian noise: σ = Δ2'/sqrt(2ρ) with the rounding-charged Δ2'.

    ``resolution_bits`` (default ``RESOLUTION_BITS``) sets the grid of a real-valued query: a plan calibrated
    by pld/1 asks for a coarser one (``dpops.release_plan.PLD_EXACT_RESOLUTION_BITS``) so that one
    coordinate's lattice sensitivity stays where pld/1 uses the exact discrete-Gaussian PLD."""
    rho = check_positive(rho, "rho")
    sens, integer_valued, m = _check_common(l2_sensitivity, "l2_sensitivity", integer_valued, max_coords)
    bits = check_positive_int(resolution_bits, "resolution_bits")
    r, lat_sens = _lattice_sensitivity(sens, integer_valued, m, "l2", bits)
    if rho <= DISCRETE_GAUSSIAN_TAU:
        raise InvalidParameter(f"rho={rho} is not above the discrete Gaussian's tau term {DISCRETE_GAUSSIAN_TAU}")
    sigma = max(float(lat_sens) / math.sqrt(2 * (rho - DISCRETE_GAUSSIAN_TAU)), DISCRETE_GAUSSIAN_MIN_SIGMA_STEPS)
    for _ in range(100):
        lat = discrete_gaussian_param(sigma)
        params = _gaussian_params(lat, r, lat_sens, integer_valued, m, "zcdp", (("rho", rho),))
        if params._gaussian_event().rho <= rho:
            return params
        sigma *= 1 + 1e-12
    raise InvalidParameter("internal: zCDP calibration did not verify")  # pragma: no cover


def _first_bad(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask.reshape(-1))[0])


def add_noise(values: np.ndarray, params: NoiseParams, rng: RandomSource) -> np.ndarray:
    """Noisy copy of ``values``: int64 for integer-valued params, float64 on the r-grid otherwise.

    NaN or infinite values are refused (the pipeline must clamp/drop them before noising).
    """
    if not isinstance(params, NoiseParams):
        raise InvalidParameter("add_noise needs NoiseParams from laplace_mechanism/gaussian_mechanism")
    if not isinstance(rng, RandomSource):
        raise InvalidParameter("add_noise needs a RandomSource (os_random, keyed_random or test_random)")
    arr = np.asarray(values)
    numeric = np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)
    if arr.dtype == bool or arr.dtype == object or not numeric:
        raise InvalidParameter(f"values must be a numeric array, got dtype {arr.dtype}")
    if np.issubdtype(arr.dtype, np.floating):
        bad = ~np.isfinite(arr)
        if bad.any():
            i = _first_bad(bad)
            raise InvalidParameter(f"values[{i}] is {arr.reshape(-1)[i]!r}: NaN/inf must never reach the noise step")
    if params.integer_valued:
        if np.issubdtype(arr.dtype, np.floating):
            frac = arr != np.floor(arr)
            if frac.any():
                i = _first_bad(frac)
                raise InvalidParameter(f"values[{i}]={arr.reshape(-1)[i]!r} is not an integer but the query is "
                                       "integer-valued")
        if arr.size and np.abs(arr).max() >= _MAX_LATTICE:
            raise InvalidParameter(f"values must be below 2**52 in magnitude, got {np.abs(arr).max()!r}")
        base = arr.astype(np.int64)
    else:
        r = params.resolution
        scaled = arr.astype(np.float64) / r  # r is a power of two: exact
        base_f = np.rint(scaled)  # nearest multiple of r (ties to even: deterministic)
        if base_f.size and np.abs(base_f).max() >= _MAX_LATTICE:
            raise InvalidParameter(f"values too large for resolution {r}: |value|/r must stay below 2**52")
        base = base_f.astype(np.int64)
    out = _lattice_noise(base, params, rng)
    if params.integer_valued:
        return out
    return out.astype(np.float64) * params.resolution


def _lattice_noise(base: np.ndarray, params: NoiseParams, rng: RandomSource) -> np.ndarray:
    """base + integer noise (int64), in lattice units."""
    lat = params._lattice()
    if isinstance(lat, DiscreteLaplaceParam):
        noise = discrete_laplace(lat, base.size, rng)
    else:
        noise = discrete_gaussian(lat, base.size, rng)
    return base + noise.reshape(base.shape)


def _round_shift(v: int, s: int) -> int:
    """round(v / 2**s) to nearest, ties to even, for Python ints (s may be <= 0)."""
    if s <= 0:
        return v << -s
    q, rem = v >> s, v & ((1 << s) - 1)  # floor quotient, remainder in [0, 2**s)
    half = 1 << (s - 1)
    return q + (1 if rem > half or (rem == half and q & 1) else 0)


def lattice_of_fixed(units: np.ndarray, unit: float, params: NoiseParams) -> np.ndarray:
    """int64 lattice values (multiples of r) nearest to the exact reals units·unit, ties to even.

    ``units`` are integers (int64 or Python ints in an object array), ``unit`` a power of two.
    Integer arithmetic only; saturated at ±(2**52 − 1) (see the module docstring).
    """
    r = params.resolution
    if params.integer_valued:
        raise InvalidParameter("lattice_of_fixed is for real-valued (grid) queries")
    fu, fr = Fraction(unit), Fraction(r)
    if fu <= 0 or any(x & (x - 1) for x in (fu.numerator, fu.denominator)):
        raise InvalidParameter(f"fixed-point unit must be a power of two, got {unit!r}")
    # r / unit = 2**s exactly (both are powers of two)
    ratio = fr / fu
    s = ratio.numerator.bit_length() - 1 if ratio.denominator == 1 else -(ratio.denominator.bit_length() - 1)
    arr = np.asarray(units)
    if arr.dtype != object and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidParameter(f"fixed-point values must be integers, got dtype {arr.dtype}")
    cap = _MAX_LATTICE - 1
    if arr.dtype != object and 0 < s <= 62:
        a = arr.astype(np.int64)
        q = a >> np.int64(s)
        rem = a - (q << np.int64(s))
        half = np.int64(1 << (s - 1))
        q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1)))
        return np.clip(q, -cap, cap).astype(np.int64)
    flat = [max(-cap, min(cap, _round_shift(int(v), s))) for v in arr.reshape(-1)]
    return np.array(flat, dtype=np.int64).reshape(arr.shape)


def add_noise_fixed(units: np.ndarray, unit: float, params: NoiseParams, rng: RandomSource) -> np.ndarray:
    """Noisy copy (float64 on the r-grid) of the exact values units·unit (see the module docstring)."""
    if not isinstance(params, NoiseParams):
        raise InvalidParameter("add_noise_fixed needs NoiseParams from laplace_mechanism/gaussian_mechanism")
    if not isinstance(rng, RandomSource):
        raise InvalidParameter("add_noise_fixed needs a RandomSource (os_random, keyed_random or test_random)")
    base = lattice_of_fixed(units, unit, params)
    return _lattice_noise(base, params, rng).astype(np.float64) * params.resolution


__all__ = [
    "NoiseParams",
    "RESOLUTION_BITS",
    "choose_resolution",
    "laplace_mechanism",
    "gaussian_mechanism",
    "gaussian_mechanism_zcdp",
    "add_noise",
    "add_noise_fixed",
    "lattice_of_fixed",
]
