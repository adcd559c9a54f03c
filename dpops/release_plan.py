"""The release plan: from a spec ALONE (never data), every mechanism a run will use.

The ledger reserves ``plan.events`` and the pipeline draws exactly the noise in
``plan.metrics``; both come from ``plan_release(spec)``, a pure function of the
validated spec, so they cannot disagree (``plan_hash`` lets the pipeline check).

Budget split (documented in the manifest through ``describe()``):

- epsilon: each metric key and ``partition_selection`` (private partitions only)
  gets epsilon * w / sum(w) with the spec's ``budget.split`` weights.
- delta goes only to Gaussian-noised metrics and to partition selection, split
  by the same weights among those consumers. Laplace metrics and the
  exponential-mechanism metrics (quantiles, top_k) are pure epsilon-DP.
- Gaussian metrics, when the spec names no accountant (``budget.accountant`` absent), are
  calibrated in zCDP so that the plan certifies under the *basic* accountant too (which
  charges Gaussian events through their rho): the Gaussian group's (eps_G, delta_G) becomes
  rho_G with eps_G = rho_G + 2 sqrt(rho_G ln(1/delta_G)), split over the Gaussian metrics by
  weight. rdp/pld accountants certify the same events with a smaller epsilon (at eps 1,
  delta 1e-7, three Gaussian metrics cost pld/1 about 0.6 of the 0.75 they were given).
- With ``budget.accountant`` (the scope's pinned accountant, e.g. ``pld/1``) the Gaussian
  metrics are calibrated by that accountant (``GAUSSIAN_CALIBRATION``): the split above is
  only the starting point; every Gaussian vector's rho is then multiplied by ONE common
  factor (so the declared weights keep their ratios), and the factor is bisected until the
  accountant's composed epsilon at the spec's delta for ALL the run's events (Gaussian,
  Laplace, exponential mechanism and partition selection, composed as the accountant
  composes them) is at most the declared epsilon, to a relative tolerance of
  ``CALIBRATION_REL_TOL`` on the factor; the factor kept is the lower, checked end of the
  bracket (more noise, never less). The search only compares the accountant's own answer
  with the budget, so the claim is exactly as sound as the accountant: in particular a
  discrete Gaussian is never analysed as a continuous one (pld/1 uses the exact lattice PLD
  for one coordinate of at most 256 lattice steps and the zCDP rho, CKS20 Thm 14, otherwise).
  Under pld/1 the plan therefore describes its noise in what pld/1 analyses exactly: a
  real-valued vector's grid is at most 2**-7 of one coordinate's sensitivity
  (``PLD_EXACT_RESOLUTION_BITS``, recorded as the vector's ``resolution_bits``), and a vector
  over m > 1 partitions is charged as m compositions of its scalar noise at the per-coordinate
  bound (``coordinate_event``, which dominates the vector; the argument is its docstring). The
  charge the ledger
  records is that accountant's epsilon for these events: the declared epsilon, up to the
  tolerance. The calibration is a pure function of the spec and the accountant version, so
  ``manifest verify`` recomputes the same sigma; the plan records it (``gaussian_calibration``
  in ``describe()``), and specs without ``budget.accountant`` keep the zCDP split and their
  manifests verify unchanged.
- Inside a metric with several noised vectors the share is split equally:
  mean = (normalised sum, count), each 1/2; variance = (normalised sum,
  centred sum of squares, count), each 1/3. When the spec also releases a
  ``count`` metric, means and variances reuse that noisy count vector (the same
  bounded rows, so it is post-processing of a released value) and spend their
  whole share on their sums: mean = nsum alone, variance = (nsum, squares) 1/2 each. mean = mid + nsum/count,
  variance = E[(x-mid)^2] - E[x-mid]^2 (post-processing of the noised vectors).
- quantiles: one exponential mechanism per (partition, quantile). One unit can
  change at most ``m`` partitions (m = L0 for add_remove, 2 L0 for replace: the
  ``max_coords`` of the count sensitivity), so each run gets
  eps_metric / (m * n_quantiles) and the metric is charged
  SelfComposed(PureDP(that), m * n_quantiles) = eps_metric under basic composition.
- top_k: ``selection.top_k`` per partition with eps_metric / m (it spends its
  epsilon across the k picks itself); utility sensitivity = the per-partition
  count sensitivity ``count(b).linf`` (a unit moves one category count by <= Linf);
  under add_remove the counts are monotone in the data (adding a unit never lowers
  one), so the permute-and-flip monotone rate eps/Delta applies (McKenna & Sheldon 2020).
- quantile utilities are made integers (q = a/d from its decimal form: utility
  -|d rank - a n|, sensitivity d * Linf) so permute-and-flip runs its exact path.
- partition selection: ``PartitionSelection`` over unit counts with its (eps, delta)
  for add_remove (it already accounts for a unit touching L0 partitions). For
  replace (a removal plus an addition) group privacy of size 2 is used: the
  selection runs at (eps/2, delta / (1 + e^(eps/2))) and is charged (eps, delta).

- per-metric contribution bounds (``metrics[].contribution``, issue 26 item 3): a metric with its own
  (L0, Linf) has every vector's sensitivity, its EM runs per unit (m from its own L0) and its utility
  sensitivity (its own Linf) computed from them, so each of its events is exactly the event of a release of
  that metric alone with those bounds (at the same share). Why that is sound: its vectors are computed on
  the rows bounded with its own bounds, a function of each unit's own rows and the run's priorities only
  (``pipelines.bounding``, "Per-metric bounds"); conditional on the priorities, adding or removing one unit
  moves that metric's vectors by at most its own sensitivity, and the mechanisms' noises are independent, so
  the events compose as before (each carries its own sensitivity; the charge is their composition, nothing
  else changes). Partition selection keeps the release's L0 (a metric may only narrow it, ``dpops.spec``):
  every metric's partitions are among the release's, which the selection covers. A mean or variance reuses
  a count metric's noisy vector only when the two are bounded alike (else it noises its own count). A metric
  bounded otherwise than the release records ``contribution`` in ``describe()`` and names its accumulators
  with ``bound_set_suffix``; a spec without overrides plans, describes and hashes exactly as before.

Every share is multiplied by (1 - 1e-9) so float rounding can never make the
composed total exceed the spec; ``plan_release`` re-checks the total with the
basic accountant (or the spec's ``budget.accountant``) and refuses a plan that does not certify.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, cast

from dpops.errors import InvalidParameter, SpecError
from dpops.events import ApproxDP, PrivacyEvent, PureDP, SelfComposed, canonical_json, event_to_dict
from dpops.noise import sensitivity

if TYPE_CHECKING:  # imported lazily at run time (numpy); see plan_release
    from dpops.noise.mechanisms import NoiseParams
    from dpops.noise.selection import PartitionSelection
    from dpops.noise.sensitivity import Sensitivity

SAFETY = 1.0 - 1e-9
# public candidate grid for quantiles: lo + j (hi - lo) / 256, j = 0..256 (dense per-partition histograms)
QUANTILE_BINS = 256
PARTITION_SELECTION_KEY = "partition_selection"
GAUSSIAN_ABLE = ("count", "unit_count", "sum", "mean", "variance")
# The accountant-driven Gaussian calibration (issue 26). A change to what it computes for an existing spec is a new
# method name, kept beside this one: manifests recorded with it must still verify.
GAUSSIAN_CALIBRATION = "accountant_common_rho_factor/1"
CALIBRATION_REL_TOL = 1e-6  # on the common rho factor; epsilon moves by about half of it
# Under pld/1 a real-valued Gaussian vector gets a grid at most 2**-7 of one coordinate's sensitivity (instead of
# the mechanisms' 2**-10), so that one coordinate moves at most pld.MAX_EXACT_DG_LATTICE_SENSITIVITY lattice steps and
# pld/1 uses the exact discrete-Gaussian PLD: the rounding charge grows by at most 2**-7 + one step, the analysis
# becomes exact instead of the zCDP rho's RDP conversion (about 7% of sigma).
PLD_EXACT_RESOLUTION_BITS = 7


def bound_set_suffix(l0: int, linf: int) -> str:
    """The accumulator-name suffix of a per-metric bound set (``count@2x5``, ``sum:spend@2x5``): rows bounded
    with L0 = ``l0`` and Linf = ``linf``. The release's own bound set has no suffix, so plans and pipelines of
    specs without per-metric bounds name every accumulator as before."""
    return f"@{int(l0)}x{int(linf)}"


@dataclass(frozen=True)
class NoisyVector:
    """One noised vector (one value per partition) of a metric."""

    name: str  # "count", "sum", "normalized_sum", "normalized_sum_squares"
    accumulator: str  # which per-partition aggregate it noises
    params: NoiseParams
    sensitivity: Sensitivity  # before the rounding charge
    resolution_bits: int | None = None  # the grid's bits when not the mechanisms' default (pld/1-calibrated plans)
    charged_event: PrivacyEvent | None = None  # per-coordinate form (``coordinate_event``), pld/1-calibrated plans

    def event(self) -> PrivacyEvent:
        """What this vector's noise spends (the rounding charge included)."""
        return self.charged_event if self.charged_event is not None else self.params.event()


@dataclass(frozen=True)
class MetricPlan:
    """One released metric: its share of the budget and either its noised vectors or its exponential-mechanism runs."""

    key: str
    type: str
    column: str | None
    bounds: tuple[float, float] | None
    epsilon: float  # share of the budget (basic-composition view)
    delta: float
    rho: float | None  # zCDP share when Gaussian
    vectors: tuple[NoisyVector, ...] = ()
    # exponential-mechanism metrics
    quantiles: tuple[float, ...] = ()
    quantile_suffixes: tuple[str, ...] = ()
    n_bins: int = 0
    per_run_epsilon: float | None = None  # epsilon of one EM run (one partition [, one quantile])
    utility_sensitivity: float | None = None
    runs_per_unit: int = 0  # how many EM runs one unit can influence
    k: int = 0
    domain: tuple[Any, ...] = ()
    monotonic: bool = False  # top_k under add_remove: category counts only grow when a unit is added
    count_from: str | None = None  # mean/variance: key of the count metric whose noisy vector is reused
    # (L0, Linf) the metric is bounded with when its own (``metrics[].contribution``) differ from the release's;
    # None: the release's. Its sensitivities, EM runs and utility sensitivity are computed from these.
    contribution: tuple[int, int] | None = None

    @property
    def bound_suffix(self) -> str:
        """``""`` for a metric bounded with the release's contribution bounds, else ``bound_set_suffix(L0, Linf)``:
        the suffix of its per-partition accumulators (``pipelines.bounding``), which are aggregated over the rows
        bounded with its own bounds."""
        return "" if self.contribution is None else bound_set_suffix(*self.contribution)

    def events(self) -> list[PrivacyEvent]:
        """What this metric spends: one event per noised vector, or the EM runs one unit can influence."""
        if self.vectors:
            return [v.event() for v in self.vectors]
        mech = "exponential_mechanism/quantile" if self.type == "quantiles" else "top_k"
        # per_run_epsilon is set for every EM metric; PureDP refuses a None itself
        return [SelfComposed(PureDP(cast(float, self.per_run_epsilon), mechanism=mech), self.runs_per_unit)]


@dataclass(frozen=True)
class ReleasePlan:
    """Every mechanism of one release run, derived from the spec alone (``plan_release``)."""

    release: str
    spec_hash: str
    epsilon: float
    delta: float
    noise: str
    unit_column: str
    adjacency: str
    record_level: bool
    max_partitions_per_unit: int
    max_rows_per_unit_per_partition: int
    partition_columns: tuple[str, ...]
    public_partitions: tuple[tuple[Any, ...], ...] | None
    partition_selection: PartitionSelection | None  # the parameters it runs with
    partition_selection_event: ApproxDP | None  # what it is charged (group privacy for replace)
    metrics: tuple[MetricPlan, ...]
    postprocess: dict[str, Any] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    accountant: str | None = None  # the spec's budget.accountant: what the plan certifies under (else basic/1)
    gaussian_calibration: dict[str, Any] | None = None  # how the Gaussian sigmas were found, when by the accountant

    @property
    def events(self) -> list[PrivacyEvent]:
        """What the ledger reserves: one event per noised vector / EM metric, plus partition selection."""
        out: list[PrivacyEvent] = []
        for m in self.metrics:
            out.extend(m.events())
        if self.partition_selection_event is not None:
            out.append(self.partition_selection_event)
        return out

    def total_epsilon(self, accountant: str = "basic") -> float:
        """epsilon of this run at the spec's delta under ``accountant`` (for display)."""
        from dpops.accounting import get_accountant

        return get_accountant(accountant).epsilon(self.events, self.delta)

    def describe(self) -> dict[str, Any]:
        """JSON for the manifest: every mechanism with its parameters and sensitivity."""
        metrics = []
        for m in self.metrics:
            d: dict[str, Any] = {
                "key": m.key, "type": m.type, "column": m.column,
                "bounds": list(m.bounds) if m.bounds else None,
                "epsilon_share": m.epsilon, "delta_share": m.delta, "rho_share": m.rho,
            }
            if m.count_from:
                d["count_reused_from"] = m.count_from
            if m.contribution is not None:  # only when set: plans without per-metric bounds describe as before
                d["contribution"] = {"max_partitions_per_unit": m.contribution[0],
                                     "max_rows_per_unit_per_partition": m.contribution[1]}
            if m.vectors:
                d["vectors"] = [
                    {
                        "name": v.name,
                        "mechanism": f"{'integer' if v.params.integer_valued else 'grid'}_{v.params.family}",
                        "scale": v.params.scale, "resolution": v.params.resolution, "std": v.params.std,
                        "l1_sensitivity_charged": v.params.l1_sensitivity,
                        "l2_sensitivity_charged": v.params.l2_sensitivity,
                        "sensitivity": {"l1": v.sensitivity.l1, "l2": v.sensitivity.l2,
                                        "linf": v.sensitivity.linf, "max_coords": v.sensitivity.max_coords},
                        "event": event_to_dict(v.event()),
                        # only when set: vectors on the default grid describe (and hash) as before
                        **({"resolution_bits": v.resolution_bits} if v.resolution_bits is not None else {}),
                    }
                    for v in m.vectors
                ]
            else:
                d.update({
                    "mechanism": "exponential_mechanism" if m.type == "quantiles" else "top_k",
                    "epsilon_per_run": m.per_run_epsilon, "utility_sensitivity": m.utility_sensitivity,
                    "runs_per_unit": m.runs_per_unit, "event": event_to_dict(m.events()[0]),
                })
                if m.type == "quantiles":
                    d.update({"quantiles": list(m.quantiles), "candidate_grid_bins": m.n_bins})
                else:
                    d.update({"k": m.k, "domain": list(m.domain), "monotonic_utility": m.monotonic})
            metrics.append(d)
        ps = None
        if self.partition_selection is not None:
            s = self.partition_selection
            ps = {"strategy": s.strategy, "epsilon_run": s.epsilon, "delta_run": s.delta,
                  "max_partitions_per_unit": s.max_partitions_per_unit,
                  # set together with partition_selection by plan_release
                  "event": event_to_dict(cast(PrivacyEvent, self.partition_selection_event))}
        budget: dict[str, Any] = {"epsilon": self.epsilon, "delta": self.delta, "noise": self.noise,
                                  "weights": self.weights}
        # only when set: a plan of a spec without budget.accountant describes (and hashes) as before
        if self.accountant is not None:
            budget["accountant"] = self.accountant
        if self.gaussian_calibration is not None:
            budget["gaussian_calibration"] = self.gaussian_calibration
        return {
            "schema": "dpops.plan/1",
            "release": self.release, "spec_hash": self.spec_hash,
            "budget": budget,
            "privacy_unit": {"column": self.unit_column, "adjacency": self.adjacency,
                             "record_level": self.record_level},
            "contribution": {"max_partitions_per_unit": self.max_partitions_per_unit,
                             "max_rows_per_unit_per_partition": self.max_rows_per_unit_per_partition},
            "partitions": {"columns": list(self.partition_columns),
                           "strategy": "public" if self.public_partitions is not None else "private",
                           "public_count": None if self.public_partitions is None else len(self.public_partitions),
                           "selection": ps},
            "metrics": metrics,
            "events": [event_to_dict(e) for e in self.events],
            "postprocess": self.postprocess,
        }

    @property
    def plan_hash(self) -> str:
        """SHA-256 of ``describe()``'s canonical JSON: lets the compute step refuse a plan other than the reserved."""
        return hashlib.sha256(canonical_json(self.describe()).encode()).hexdigest()


# --------------------------------------------------------------------------- planning


def rho_for_epsilon_delta(epsilon: float, delta: float) -> float:
    """Largest rho with rho + 2 sqrt(rho ln(1/delta)) <= epsilon (Bun & Steinke 2016, Prop 1.3, inverted)."""
    if not (0 < delta < 1):
        raise InvalidParameter(f"Gaussian metrics need 0 < delta < 1, got {delta!r}")
    L = math.log(1.0 / delta)
    return (math.sqrt(epsilon + L) - math.sqrt(L)) ** 2


def plan_release(spec) -> ReleasePlan:  # spec: dpops.spec.ReleaseSpec (typing it needs its metric union narrowed)
    """Derive the whole release plan from a validated ``dpops.spec.ReleaseSpec``.

    A spec with ``bounds: estimate`` is planned as its ``release_part()``: the release's own epsilon (the
    declared total minus the estimation's share) at the fallback bounds, until the run substitutes the
    estimated ones (``dpops.spec.ReleaseSpec.with_estimated_bounds``). The events do not depend on the
    value bounds, so what is reserved is known before the estimation runs."""
    from dpops.noise import mechanisms, selection  # noqa: PLC0415 - keeps `import dpops.release_plan` light
    spec = spec.release_part()
    eps, delta, noise = float(spec.budget.epsilon), float(spec.budget.delta), spec.budget.noise
    unit = spec.privacy_unit
    c = spec.contribution
    bounds = sensitivity.ContributionBounds(
        adjacency=unit.adjacency,
        max_partitions=int(c.max_partitions_per_unit),
        max_rows_per_partition=int(c.max_rows_per_unit_per_partition),
    )
    public = spec.public_partitions()
    private = public is None
    weights = spec.split_weights()
    total_w = sum(weights.values())

    def gaussian(m) -> bool:
        return noise == "gaussian" and m.type in GAUSSIAN_ABLE

    # delta consumers: Gaussian metrics + partition selection
    delta_w = {m.key: weights[m.key] for m in spec.metrics if gaussian(m)}
    if private:
        delta_w[PARTITION_SELECTION_KEY] = weights[PARTITION_SELECTION_KEY]
    if delta_w and delta <= 0:
        raise SpecError(f"{spec.source}: budget.delta must be > 0 for gaussian noise or private partitions")
    dw_total = sum(delta_w.values())
    eps_share = {k: eps * w / total_w * SAFETY for k, w in weights.items()}
    delta_share = {k: delta * w / dw_total * SAFETY for k, w in delta_w.items()}

    g_keys = [m.key for m in spec.metrics if gaussian(m)]
    rho_share: dict[str, float] = {}
    if g_keys:
        eps_g = sum(eps_share[k] for k in g_keys)
        delta_g = sum(delta_share[k] for k in g_keys)
        rho_g = rho_for_epsilon_delta(eps_g, delta_g) * SAFETY
        wg = sum(weights[k] for k in g_keys)
        rho_share = {k: rho_g * weights[k] / wg for k in g_keys}

    # Each metric's own contribution bounds (``metrics[].contribution``, else the release's): every sensitivity
    # of its vectors, its EM runs and its utility sensitivity come from these, so the charge of each event is
    # that of a release of the metric alone with those bounds.
    own = {m.key: spec.metric_contribution(m.key) for m in spec.metrics}
    mbounds = {k: bounds if lb == (bounds.max_partitions, bounds.max_rows_per_partition) else
               sensitivity.ContributionBounds(adjacency=unit.adjacency, max_partitions=lb[0],
                                              max_rows_per_partition=lb[1])
               for k, lb in own.items()}
    # A released count metric is reused (post-processing) as the denominator of means and variances, only by
    # those bounded like it: a count over other bounded rows is not the denominator of this metric's sum.
    count_keys = {m.key: next((c.key for c in spec.metrics if c.type == "count" and own[c.key] == own[m.key]), None)
                  for m in spec.metrics}

    acct_ref = spec.budget.accountant

    def build_metrics(rho_share: dict[str, float]) -> list[MetricPlan]:
        return _build_metrics(spec, mechanisms, mbounds, bounds, lambda m: gaussian(m), eps_share, delta_share,
                              rho_share, count_keys, acct_ref)

    metrics = build_metrics(rho_share)

    ps: selection.PartitionSelection | None = None
    ps_event: ApproxDP | None = None
    if private:
        e_ps, d_ps = eps_share[PARTITION_SELECTION_KEY], delta_share[PARTITION_SELECTION_KEY]
        if unit.adjacency == "replace":
            e_run = e_ps / 2.0
            d_run = d_ps / (1.0 + math.exp(e_run))
        else:
            e_run, d_run = e_ps, d_ps
        ps = partition_selection(spec.partitions.private.strategy, e_run, d_run, int(c.max_partitions_per_unit))
        if unit.adjacency == "replace":
            # group privacy, k = 2: (2 e, (1 + e^e) d)
            ps_event = ApproxDP(2.0 * e_run, d_run * (1.0 + math.exp(e_run)),
                                mechanism=f"partition_selection/{ps.strategy}/replace")
        else:
            ps_event = ps.event()

    calibration: dict[str, Any] | None = None
    if acct_ref is not None and g_keys:
        # The Gaussian vectors, as (weight, vectors in the metric, sensitivity, integer-valued): their rho at a
        # group rho_G is (rho_G * w / wg) / n, the same expression build_metrics uses, so the events searched
        # are the events planned.
        layout = tuple((weights[m.key], n, sens, integer, resolution_bits(acct_ref, sens, integer), acct_ref == "pld/1")
                       for m, n, sens, integer in _gaussian_vectors(spec, mbounds, gaussian, count_keys))
        fixed = tuple(e for mp in metrics if mp.key not in rho_share for e in mp.events())
        fixed += (ps_event,) if ps_event is not None else ()
        rho_cal = calibrated_rho_group(acct_ref, eps, delta, fixed, layout, wg, rho_g)
        rho_share = {k: rho_cal * weights[k] / wg for k in g_keys}
        metrics = build_metrics(rho_share)
        calibration = {"method": GAUSSIAN_CALIBRATION, "accountant": acct_ref,
                       "relative_tolerance": CALIBRATION_REL_TOL, "rho_group": rho_cal, "rho_group_zcdp_split": rho_g}

    plan = ReleasePlan(
        release=spec.name, spec_hash=spec.spec_hash, epsilon=eps, delta=delta, noise=noise,
        unit_column=unit.column, adjacency=unit.adjacency, record_level=bool(unit.record_level),
        max_partitions_per_unit=int(c.max_partitions_per_unit),
        max_rows_per_unit_per_partition=int(c.max_rows_per_unit_per_partition),
        partition_columns=tuple(spec.partitions.columns),
        public_partitions=None if public is None else tuple(tuple(p) for p in public),
        partition_selection=ps, partition_selection_event=ps_event, metrics=tuple(metrics),
        postprocess=spec.postprocess.model_dump(mode="json"), weights=weights,
        accountant=acct_ref, gaussian_calibration=calibration,
    )
    _certify(plan)
    return plan


def _build_metrics(spec, mechanisms, mbounds, release_bounds, gaussian, eps_share: dict[str, float],
                   delta_share: dict[str, float], rho_share: dict[str, float], count_keys: dict[str, str | None],
                   acct_ref: str | None) -> list[MetricPlan]:
    """Every metric's plan at the given shares (the Gaussian ones at ``rho_share``); pure in its arguments.

    ``mbounds``: each metric key's ContributionBounds (its own, or ``release_bounds``)."""
    unit = spec.privacy_unit
    metrics = []
    for m in spec.metrics:
        key = m.key
        bounds = mbounds[key]
        count_s = sensitivity.count(bounds)
        m_coords = int(count_s.max_coords)  # partitions one unit can change, under this metric's own L0
        count_key = count_keys[key]
        lohi = tuple(float(x) for x in m.bounds) if getattr(m, "bounds", None) is not None else None
        base = dict(key=key, type=m.type, column=getattr(m, "column", None), bounds=lohi,
                    epsilon=eps_share[key], delta=delta_share.get(key, 0.0), rho=rho_share.get(key),
                    contribution=None if bounds is release_bounds else
                    (int(bounds.max_partitions), int(bounds.max_rows_per_partition)))
        if m.type in GAUSSIAN_ABLE:
            parts = _vector_layout(m.type, key, bounds, lohi)
            if bounds is not release_bounds:  # aggregated over this metric's own bounded rows
                sfx = bound_set_suffix(bounds.max_partitions, bounds.max_rows_per_partition)
                parts = [(name, acc + sfx, sens, integer) for name, acc, sens, integer in parts]
            reuse = m.type in ("mean", "variance") and count_key is not None
            if reuse:
                parts = [p for p in parts if p[0] != "count"]
                base["count_from"] = count_key
            vecs = []
            for name, acc, sens, integer in parts:
                bits: int | None = None
                charged: PrivacyEvent | None = None
                if gaussian(m):
                    bits = resolution_bits(acct_ref, sens, integer)
                    params = _gaussian_zcdp(mechanisms, rho_share[key] / len(parts), sens, integer, bits)
                    bits = None if bits == mechanisms.RESOLUTION_BITS else bits
                    charged = coordinate_event(params, sens) if acct_ref == "pld/1" else None
                else:
                    params = mechanisms.laplace_mechanism(
                        eps_share[key] / len(parts), sens.l1, integer_valued=integer, max_coords=sens.max_coords)
                vecs.append(NoisyVector(name, acc, params, sens, bits, charged))
            metrics.append(MetricPlan(**base, vectors=tuple(vecs)))
        elif m.type == "quantiles":
            qs = tuple(float(q) for q in m.quantiles)
            runs = m_coords * len(qs)
            metrics.append(MetricPlan(
                **base, quantiles=qs, quantile_suffixes=tuple(m.column_suffixes()), n_bins=QUANTILE_BINS,
                per_run_epsilon=eps_share[key] / runs, utility_sensitivity=float(sensitivity.quantile_utility(bounds)),
                runs_per_unit=runs))
        elif m.type == "top_k":
            metrics.append(MetricPlan(
                **base, k=int(m.k), domain=tuple(m.domain), per_run_epsilon=eps_share[key] / m_coords,
                utility_sensitivity=float(count_s.linf), runs_per_unit=m_coords,
                monotonic=unit.adjacency == "add_remove"))
        else:  # pragma: no cover - the spec model only admits known types
            raise SpecError(f"unknown metric type {m.type!r}")
    return metrics


def _gaussian_vectors(spec, mbounds, gaussian, count_keys: dict[str, str | None]):
    """(metric, vectors in it, sensitivity, integer-valued) for each Gaussian vector, in plan order (each at its
    metric's own contribution bounds ``mbounds[key]``)."""
    out: list[tuple[Any, int, Sensitivity, bool]] = []
    for m in spec.metrics:
        if not gaussian(m):
            continue
        lohi = tuple(float(x) for x in m.bounds) if getattr(m, "bounds", None) is not None else None
        parts = _vector_layout(m.type, m.key, mbounds[m.key], lohi)
        if m.type in ("mean", "variance") and count_keys[m.key] is not None:
            parts = [p for p in parts if p[0] != "count"]
        out.extend((m, len(parts), sens, integer) for _, _, sens, integer in parts)
    return out


def _group_events(layout, wg: float, rho_group: float) -> list[PrivacyEvent]:
    from dpops.noise import mechanisms  # noqa: PLC0415 - numpy, only when planning

    out: list[PrivacyEvent] = []
    for w, n, sens, integer, bits, per_coordinate in layout:
        params = _gaussian_zcdp(mechanisms, rho_group * w / wg / n, sens, integer, bits)
        charged = coordinate_event(params, sens) if per_coordinate else None
        out.append(charged if charged is not None else params.event())
    return out


@lru_cache(maxsize=64)
def partition_selection(strategy: str, epsilon: float, delta: float, max_partitions_per_unit: int
                        ) -> PartitionSelection:
    """``selection.PartitionSelection`` for these public parameters, built once per process: its keep table (a
    truncated-geometric table at a small epsilon has millions of entries and takes ~80 ms) is a pure function of
    them, and ``dpops plan --solve`` plans the release hundreds of times with the selection's share unchanged while
    another key's share is searched. The object is frozen and its table is written only in its own
    ``__post_init__``, so sharing it between plans cannot let one plan change another's; what a run draws is
    unaffected (the table is the same either way)."""
    from dpops.noise import selection

    return selection.PartitionSelection(strategy=strategy, epsilon=epsilon, delta=delta,
                                        max_partitions_per_unit=max_partitions_per_unit)


@lru_cache(maxsize=256)  # plan_release runs many times per spec (plan, analysis, pipeline, verify): search once
def calibrated_rho_group(accountant: str, epsilon: float, delta: float, fixed: tuple[PrivacyEvent, ...],
                         layout: tuple[tuple[float, int, Sensitivity, bool, int, bool], ...], wg: float,
                         start: float) -> float:
    """The largest group rho (to ``CALIBRATION_REL_TOL``) whose Gaussian events, composed with ``fixed`` by
    ``accountant``, cost at most ``epsilon`` at ``delta`` (see the module docstring).

    ``start`` is the zCDP split's rho_G, which every accountant certifies (each is never worse than basic/1);
    the answer is a value the accountant was asked about and certified, never an interpolation."""
    from dpops.accounting import get_accountant  # lazy registry: pld pulls in dp_accounting only when named
    from dpops.noise.calibration import largest_passing

    acct = get_accountant(accountant)

    def ok(rho_group: float) -> bool:
        return acct.epsilon(list(fixed) + _group_events(layout, wg, rho_group), delta) <= epsilon

    return largest_passing(ok, start, CALIBRATION_REL_TOL, max_doublings=40)


def coordinate_lattice(linf: float, integer: bool, resolution: float) -> int:
    """How many lattice steps one unit can move ONE coordinate of the noised vector: Linf for an integer query
    (no rounding), ceil(Linf/r + 1) on a grid r (two roundings to the nearest multiple of r move the difference
    by less than r). The one formula, for the plan and for ``manifest verify``."""
    from fractions import Fraction

    if integer:
        if float(linf) != math.floor(linf):
            raise InvalidParameter(f"an integer-valued query needs an integer Linf sensitivity, got {linf!r}")
        return int(linf)
    return math.ceil(Fraction(float(linf)) / Fraction(float(resolution)) + 1)


def resolution_bits(accountant: str | None, sens: Sensitivity, integer: bool) -> int:
    """Grid bits of a Gaussian vector: the mechanisms' default, except under pld/1 for a real-valued one
    (``PLD_EXACT_RESOLUTION_BITS``, fewer if needed) so that ONE coordinate's lattice sensitivity
    (``coordinate_lattice``) is one pld/1 analyses exactly. Public parameters only; the manifest records any
    non-default value (``resolution_bits``) for ``manifest verify``."""
    from dpops.noise.mechanisms import RESOLUTION_BITS, choose_resolution

    if accountant != "pld/1" or integer:
        return RESOLUTION_BITS
    from dpops.accounting.pld import MAX_EXACT_DG_LATTICE_SENSITIVITY  # pld/1's own limit: it is being used

    for bits in range(PLD_EXACT_RESOLUTION_BITS, 0, -1):
        r = choose_resolution(float(sens.l2), math.sqrt(int(sens.max_coords)), bits)
        if coordinate_lattice(sens.linf, False, r) <= MAX_EXACT_DG_LATTICE_SENSITIVITY:
            return bits
    return RESOLUTION_BITS  # pragma: no cover - one bit always gives a lattice sensitivity of at most 3


def coordinate_event(params: NoiseParams, sens: Sensitivity) -> PrivacyEvent | None:
    """Under pld/1, a discrete Gaussian VECTOR (max_coords m > 1) charged as m compositions of its scalar noise at
    the per-coordinate lattice sensitivity n = ``coordinate_lattice``: SelfComposed(DiscreteGaussian(sigma, n r,
    r, max_coords=1), m), which pld/1 analyses with the exact lattice PLD instead of the vector's zCDP rho.

    Why it dominates the vector: the noise is independent N_Z(0, sigma^2) per coordinate, and a unit shifts at
    most m coordinates, each by an integer number of steps |mu_i| <= n (lattice units); untouched coordinates are
    identical on both sides. The family N_Z(theta, sigma^2) has a monotone likelihood ratio in x, so the most
    powerful tests of theta = 0 against theta > 0 are the same threshold tests and their power does not decrease
    with theta (Karlin-Rubin; Lehmann & Romano, TSH Lemma 3.4.2): the pair (N_Z(0), N_Z(mu_i)) is dominated by
    (N_Z(0), N_Z(n)) for |mu_i| <= n (the pmf is symmetric and the reflection x -> mu - x swaps the two sides).
    Domination is preserved by the product of independent coordinates (Dong, Roth & Su 2022, tensor products of
    trade-off functions are monotone), so the vector's pair is dominated by the m-fold composition of the scalar
    pair with shift n: exactly this event. Under zCDP it costs m (n r)^2/(2 sigma^2) + m tau, at least the vector's
    own rho up to the rounding terms, so no accountant undercounts it. None for a scalar (its own event is exact)."""
    m = int(sens.max_coords)
    if m <= 1:
        return None
    from dpops.events import DiscreteGaussian

    r = float(params.resolution)
    n = coordinate_lattice(sens.linf, params.integer_valued, r)
    return SelfComposed(DiscreteGaussian(sigma=params.scale, l2_sensitivity=n * r, resolution=r, max_coords=1), m)


def _gaussian_zcdp(mechanisms, rho: float, sens, integer: bool, bits: int):
    """``mechanisms.gaussian_mechanism_zcdp``; if its self-check fails on float rounding (seen for
    rho ~1e-3 on fine grids: recorded rho 1e-10 relative above the request), ask for a slightly
    smaller rho -- more noise, never less, and the returned params are still verified by it."""
    try:
        return mechanisms.gaussian_mechanism_zcdp(rho, sens.l2, integer_valued=integer, max_coords=sens.max_coords,
                                                  resolution_bits=bits)
    except InvalidParameter as exc:
        if "did not verify" not in str(exc):
            raise
        return mechanisms.gaussian_mechanism_zcdp(rho * (1 - 1e-6), sens.l2, integer_valued=integer,
                                                  max_coords=sens.max_coords, resolution_bits=bits)


def _vector_layout(mtype: str, key: str, b, lohi):
    """(vector name, accumulator, sensitivity, integer-valued) for the noised vectors of one metric.

    Accumulator names are shared with the pipeline (pipelines/bounding.py): "count",
    "unit_count", "sum:<key>", "nsum:<key>", "nsq:<key>".
    """
    if mtype == "count":
        return [("count", "count", sensitivity.count(b), True)]
    if mtype == "unit_count":
        return [("unit_count", "unit_count", sensitivity.unit_count(b), True)]
    lo, hi = lohi
    if mtype == "sum":
        return [("sum", f"sum:{key}", sensitivity.sum_(b, lo, hi), False)]
    if mtype == "mean":
        s = sensitivity.mean(b, lo, hi)
        return [("normalized_sum", f"nsum:{key}", s["normalized_sum"], False), ("count", "count", s["count"], True)]
    # variance: the centred squares (x - mid)^2 - h^2/2, h = (hi - lo)/2 (see dpops.noise.sensitivity.variance)
    s = sensitivity.variance(b, lo, hi)
    return [
        ("normalized_sum", f"nsum:{key}", s["normalized_sum"], False),
        ("normalized_sum_squares", f"nsq:{key}", s["normalized_sum_of_squares"], False),
        ("count", "count", s["count"], True),
    ]


def _certify(plan: ReleasePlan) -> None:
    """Refuse a plan whose events do not certify the spec's (epsilon, delta) under basic composition, or under
    the spec's ``budget.accountant`` when it names one (the only accountant its reservation may be charged by)."""
    from dpops.accounting import get_accountant  # lazy registry: importing basic/1 is cheap

    got = get_accountant(plan.accountant or "basic/1").epsilon(plan.events, plan.delta)
    if not got <= plan.epsilon:
        raise InvalidParameter(
            f"internal: release plan for {plan.release!r} certifies epsilon={got!r} > budget {plan.epsilon!r}; "
            "this is a bug in dpops.release_plan"
        )
