"""Private bound estimation (issue 20 section 4): the mechanisms that choose contribution and value bounds under DP.

docs/semantics.md section 1: "a bound learned from data must itself be a charged DP release". That release
is ``dpops.release.estimation`` (prepare, reserve, start, compute, commit, like any release; ``dpops
estimate``): it reads the interval's input through the release's own reading code
(``pipelines.io.prepare_batch``: type checks, null/NaN drops, hashing, public partitions, the time filter)
after ``ledger.start`` and hands the rows to ``estimate_rows`` here. This module is pure: it sees only the
rows (or, for ``estimate_l0``, the per-unit counts) it is given, draws from the source it is given, reads
no file and writes nothing to the ledger. What it owns is what a reviewer recomputes: the configuration and
its hash in the run key (``estimation_hash``), the mechanisms with their shares and sensitivities, the
events the ledger charges (``events``, a function of spec and configuration only), the manifest's
``estimation`` section and the spec patch carrying ``estimated_from: <run id>``; a release made from the
patched spec names the estimation in its manifest (``dependencies``), and verifying that manifest verifies
the estimation's too.

The mechanisms
--------------

Every estimate is a quantile chosen by the exponential mechanism (``dpops.noise.selection.exponential_mechanism``:
permute-and-flip, exact for integer utilities, the same code the release's quantile and top-k metrics
use) over a PUBLIC candidate grid, with the utility of candidate c

    u(c) = -| S * r(c) - Q * n |,    S = 2**QUANTILE_Q_BITS,  Q = round(q * S)

where r(c) counts the items "at or below c" (see each estimator), n counts all items and q is the
target quantile (default 0.99: the bound keeps 99% of the items whole). Lemma (sensitivity): if one
privacy unit owns at most m of the items, adding, removing or replacing that unit changes u(c) by at
most S*m, for every c. Proof: write a (b) for the unit's items at or below (above) c. Under add/remove
r changes by a and n by a + b with a + b <= m, so S*r - Q*n changes by (S - Q)*a - Q*b, whose absolute
value is at most max(S - Q, Q) * m <= S*m (0 <= Q <= S). Under replace (unit A's items swapped for
unit B's) the change is (S - Q)(a_B - a_A) - Q(b_B - b_A); each bracket is at most m in absolute value
and a_B + b_B <= m, a_A + b_A <= m, so the absolute value is at most (S - Q)*m + Q*m = S*m. And
|u(c) - u'(c)| <= |(S r - Q n) - (S r' - Q n')| (reverse triangle inequality). So each mechanism is
epsilon_i-DP with utility sensitivity S*m. A public, data-independent preference for bounds near the
spec's declared ones is subtracted from u (``quantile_choice``); it changes no sensitivity. The shares
sum to at most the requested epsilon (times 1 - 1e-9, as in ``dpops.release_plan``) and compose
sequentially (basic composition of pure-DP events; the ledger's accountant composes the recorded
events themselves).

- **L0** (``estimate_l0``): the items are the units, one per unit, each with its number of distinct
  partitions after the release's row checks (before any bounding): m = 1. r(k) = #{units with at most
  k partitions}. Candidates ``contribution_grid(max_l0)``: 1..8, then four per octave up to ``max_l0``
  (public; units above it count as above every candidate).
- **Linf**: the items are the units again, each with the largest number of rows it has in one of the
  partitions it keeps under the estimated L0 (``bound_contributions`` with that L0 and no row limit):
  m = 1. r(k) = #{units whose largest partition has at most k rows}. Candidates ``contribution_grid(max_linf)``.
  One value per unit (its maximum) rather than one per (unit, partition) pair keeps m = 1 instead
  of L0; the price is a more conservative Linf (it covers a unit's largest partition).
- **Value bounds**, per bounded column: the items are the rows kept by the release's bounding with
  the estimated (or the spec's) L0 and Linf, so one unit owns at most m = L0*Linf of them (the
  contribution-bound lemma of ``pipelines.bounding``). Candidates: the public signed log grid
  ``value_grid()`` (0 and +-2**(j/4) for 2**-8 .. 2**40). Upper bound: r(c) = #{v <= c} at the
  quantile q. Lower bound: r(c) = #{v < c} at the quantile 1 - q; it is estimated only when the spec
  declares a negative lower bound -- a declared lower bound >= 0 is public and kept (no budget spent
  learning that amounts are not negative). L0 and Linf used here are the outputs of the two earlier
  mechanisms: choosing a later mechanism's parameters from earlier DP outputs is adaptive composition,
  which the basic composition bound covers.

Record-level specs (every row its own unit) have L0 = Linf = 1 by definition: only value bounds are
estimated.

Randomness, retries and the ledger: ``dpops.release.estimation`` (keyed or test randomness, never os;
the run key ``<name>__estimate``; a committed estimation is served from its manifest, uncharged).

What is public: the estimates themselves (DP outputs) and the configuration. The manifest records
them, the mechanisms and their sensitivities; nothing else about the data.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from dpops.errors import InvalidParameter

if TYPE_CHECKING:
    from dpops.analysis.bound_choice import BoundChoice, BoundHistograms
    from dpops.events import PrivacyEvent
    from dpops.noise.randomness import RandomSource
    from dpops.spec import ReleaseSpec

ESTIMATION_SCHEMA = "dpops.estimation/1"
PATCH_SCHEMA = "dpops.estimate-patch/1"  # patch.yaml, applied by ``dpops spec apply-patch``
RELEASE_SUFFIX = "__estimate"  # an estimation's run key names the release <spec name>__estimate
MECHANISM = "estimate/quantile_exponential_mechanism"
# The rule that turns the data into bounds (``EstimateConfig.method``, recorded in the manifest's
# estimation.config; a method's meaning never changes, so a manifest recomputes with the rule it names):
# quantile/1: one exponential mechanism per bound at ``quantile`` (this module's docstring), whatever the
# release's epsilon; error/1: noisy histograms and the bounds minimising the release's predicted error at its
# own epsilon (``dpops.analysis.bound_choice``, issue 26 item 3). A config without the field is quantile/1.
QUANTILE_METHOD = "quantile/1"
ERROR_METHOD = "error/1"
METHODS = (QUANTILE_METHOD, ERROR_METHOD)
DEFAULT_QUANTILE = 0.99
DEFAULT_MAX_L0 = 256
DEFAULT_MAX_LINF = 256
GRID_MIN_EXP = -8  # smallest non-zero magnitude of the value grid: 2**-8
GRID_MAX_EXP = 40  # largest: 2**40
GRID_STEPS_PER_OCTAVE = 4
TAIL_DECAY = 0.5  # nats of public preference per grid step toward the small end (``quantile_choice``)
SAFETY = 1.0 - 1e-9  # as dpops.release_plan: float rounding never makes the shares exceed the request
_NO_ROW_LIMIT = 1 << 62


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class EstimateConfig:
    """What an estimation is asked to do. Public; part of the run key (``estimation_hash``)."""

    epsilon: float
    quantile: float = DEFAULT_QUANTILE
    contribution: bool = True  # estimate L0 and Linf (ignored for record-level specs)
    columns: tuple[str, ...] | None = None  # bounded columns to estimate (None: every bounded column)
    max_l0: int = DEFAULT_MAX_L0
    max_linf: int = DEFAULT_MAX_LINF
    method: str = QUANTILE_METHOD  # METHODS; quantile/1 is what every configuration without the field meant

    def __post_init__(self) -> None:
        from dpops.param_checks import check_epsilon

        check_epsilon(self.epsilon)
        if self.method not in METHODS:
            raise InvalidParameter(f"estimate: method must be one of {', '.join(METHODS)}, got {self.method!r}")
        q = self.quantile
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not (0.5 <= q < 1.0):
            raise InvalidParameter(f"estimate: quantile must be in [0.5, 1), got {q!r} (0.99 keeps 99% of the "
                                   "units or rows whole)")
        for name in ("max_l0", "max_linf"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not (1 <= v <= 100_000):
                raise InvalidParameter(f"estimate: {name} must be an integer in [1, 100000], got {v!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON form (recorded in the manifest; hashed into the run key)."""
        d = asdict(self)
        d["epsilon"] = float(self.epsilon)
        d["quantile"] = float(self.quantile)
        d["columns"] = None if self.columns is None else list(self.columns)
        if self.method == QUANTILE_METHOD:  # absent, as before the field existed: old run keys stay the same
            del d["method"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EstimateConfig:
        """Inverse of ``to_dict``."""
        cols = d.get("columns")
        return cls(epsilon=float(d["epsilon"]), quantile=float(d["quantile"]), contribution=bool(d["contribution"]),
                   columns=None if cols is None else tuple(str(c) for c in cols), max_l0=int(d["max_l0"]),
                   max_linf=int(d["max_linf"]), method=str(d.get("method", QUANTILE_METHOD)))


@dataclass(frozen=True)
class Mechanism:
    """One exponential mechanism of an estimation: what it estimates, its share, its utility sensitivity."""

    name: str  # "l0", "linf", "upper:<column>", "lower:<column>"
    epsilon: float
    quantile: float
    candidates: int
    max_items_per_unit: int  # m of the module docstring's lemma (a histogram: the weight one unit spreads)
    utility_sensitivity: int  # S * m (a histogram: its L1 sensitivity, in weight units)
    kind: str = "exponential_mechanism"  # or "noisy_histogram" (error/1: ``dpops.analysis.bound_choice``)

    def event(self) -> PrivacyEvent:
        """The pure-DP event this mechanism spends."""
        from dpops.analysis.bound_choice import HISTOGRAM_MECHANISM
        from dpops.events import PureDP

        return PureDP(self.epsilon, mechanism=MECHANISM if self.kind == "exponential_mechanism"
                      else HISTOGRAM_MECHANISM)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the manifest's ``estimation.mechanisms``; ``kind`` only when not the default, so manifests
        written before it existed recompute to what they recorded)."""
        d = asdict(self)
        if self.kind == "exponential_mechanism":
            del d["kind"]
        return d


def _names(spec: ReleaseSpec, config: EstimateConfig) -> list[str]:
    """The mechanisms' names in the order they run (later ones use earlier outputs)."""
    cols = spec.declared_value_bounds()
    if config.columns is not None:
        unknown = sorted(set(config.columns) - set(cols))
        if unknown:
            raise InvalidParameter(f"estimate: column(s) {unknown} are not bounded columns of {spec.source} "
                                   f"(bounded: {sorted(cols)})")
        chosen = [c for c in cols if c in config.columns]
    else:
        chosen = list(cols)
    names: list[str] = []
    if config.contribution and not spec.privacy_unit.record_level:
        names += ["l0", "linf"]
    for c in chosen:
        if cols[c][0] < 0:
            names.append(f"lower:{c}")
        names.append(f"upper:{c}")
    if not names:
        raise InvalidParameter(f"estimate: nothing to estimate for {spec.source}: no bounded metric and "
                               "no contribution bounds (record-level spec, or --no-contribution)")
    return names


def mechanisms(spec: ReleaseSpec, config: EstimateConfig, l0: int | None = None,
               linf: int | None = None) -> list[Mechanism]:
    """Every mechanism of the estimation, with its share (equal shares) and utility sensitivity.

    ``l0``/``linf``: the contribution bounds the value mechanisms bound with (the estimated ones, or the
    spec's when not estimated); they set m = L0 * Linf for the value mechanisms. The events (what the
    ledger charges) do not depend on them, only the recorded sensitivities do."""
    from dpops.noise.selection import QUANTILE_Q_BITS

    if config.method == ERROR_METHOD:
        return _histogram_mechanisms(spec, config)
    names = _names(spec, config)
    share = float(config.epsilon) * SAFETY / len(names)
    rl = bool(spec.privacy_unit.record_level)
    L0 = 1 if rl else int(l0 if l0 is not None else spec.contribution.max_partitions_per_unit)
    LI = 1 if rl else int(linf if linf is not None else spec.contribution.max_rows_per_unit_per_partition)
    grid = value_grid()
    out = []
    for n in names:
        if n == "l0":
            cands, m, q = contribution_grid(config.max_l0).size, 1, config.quantile
        elif n == "linf":
            cands, m, q = contribution_grid(config.max_linf).size, 1, config.quantile
        else:
            cands, m = int(grid.size), L0 * LI
            q = config.quantile if n.startswith("upper:") else 1.0 - config.quantile
        out.append(Mechanism(n, share, float(q), int(cands), int(m), int(m) << QUANTILE_Q_BITS))
    return out


def _public_partition_count(spec: ReleaseSpec) -> int:
    """How many public partitions the release has; error/1 refuses private partitions (before any charge)."""
    from dpops.release_plan import plan_release

    pub = plan_release(spec).public_partitions
    if pub is None:
        raise InvalidParameter(f"estimate --method {ERROR_METHOD}: {spec.source} selects its partitions privately; "
                               "the error objective needs the public partition list (partitions.public or "
                               f"public_file) to weigh each partition's error. Use --method {QUANTILE_METHOD}; "
                               "nothing was charged")
    return len(pub)


def error_histogram_names(spec: ReleaseSpec, config: EstimateConfig) -> list[str]:
    """The histograms error/1 draws (``dpops.analysis.bound_choice``), in order: ``units`` and ``pairs`` when
    the contribution bounds are estimated (``pairs`` only for a count, sum or mean: a unit_count's error does
    not depend on Linf), ``partitions``, then ``values:<col>`` per estimated column."""
    from dpops.analysis.bound_choice import COUNT_TYPES

    if not any(m.type in COUNT_TYPES for m in spec.metrics):
        raise InvalidParameter(f"estimate --method {ERROR_METHOD}: {spec.source} has no count, unit_count, sum or "
                               f"mean metric whose error could be minimised; use --method {QUANTILE_METHOD}; "
                               "nothing was charged")
    value_names = [n.split(":", 1)[1] for n in _names(spec, config) if n.startswith("upper:")]
    contrib = config.contribution and not spec.privacy_unit.record_level
    rows_matter = any(m.type in ("count", "sum", "mean") for m in spec.metrics)  # unit_count: L0 only
    return [*(["units"] if contrib else []), *(["pairs"] if contrib and rows_matter else []), "partitions",
            *(f"values:{c}" for c in value_names)]


def _histogram_mechanisms(spec: ReleaseSpec, config: EstimateConfig) -> list[Mechanism]:
    """error/1's mechanisms: one noisy histogram each, at its share of the epsilon
    (``bound_choice.histogram_shares``)."""
    from dpops.analysis import bound_choice as B

    P = _public_partition_count(spec)
    names = error_histogram_names(spec, config)
    shares = B.histogram_shares(names, float(config.epsilon) * SAFETY)
    k_cells = B.coarse_k_edges(P).size
    r_cells = B.row_edges(contribution_grid(config.max_linf)).size
    cells = {"units": P, "pairs": k_cells * r_cells, "partitions": P}
    sens = B.l1_sensitivity(spec.privacy_unit.adjacency)
    out = [Mechanism(f"hist:{n}", shares[n], 0.0, int(cells.get(n, value_grid().size + 1)), B.WEIGHT_SCALE, sens,
                     kind="noisy_histogram") for n in names]
    for m in out:
        _check_histogram_noise(m)
    return out


def _check_histogram_noise(m: Mechanism) -> None:
    """Refuse a histogram whose noise the sampler cannot draw, before anything is charged (``events`` runs before the
    reservation). Privacy reason (review 5): the noise parameters are public (share, sensitivity, cells), yet they
    were first computed by ``bound_choice.noisy_histograms`` after ``ledger.start``: a share too small for a discrete
    Laplace scale of at most 2**50 failed every attempt after the charge. The same call as there, so a request this
    accepts draws."""
    from dpops.noise.mechanisms import laplace_mechanism

    try:
        laplace_mechanism(float(m.epsilon), float(m.utility_sensitivity), integer_valued=True,
                          max_coords=max(1, int(m.candidates)))
    except (InvalidParameter, OverflowError, ZeroDivisionError):
        raise InvalidParameter(f"estimate --method {ERROR_METHOD}: histogram {m.name.split(':', 1)[1]!r} gets epsilon "
                               f"{m.epsilon:.3g}, too small for its noise (the discrete Laplace scale of sensitivity "
                               f"{m.utility_sensitivity} must stay below 2**50); raise --epsilon (or the bounds share);"
                               " nothing was charged") from None


def events(spec: ReleaseSpec, config: EstimateConfig) -> list[PrivacyEvent]:
    """What the estimation charges: one pure-DP event per mechanism (a function of spec and config only)."""
    return [m.event() for m in mechanisms(spec, config)]


def contribution_grid(max_bound: int) -> np.ndarray:
    """The public candidates of L0 or Linf: 1..8, then four per octave (rounded) up to ``max_bound`` (included).

    A log-scale grid keeps the number of candidates above the data's largest contribution small (the
    utility is flat there, so each such candidate takes probability mass away from the quantile)."""
    c = set(range(1, min(8, max_bound) + 1))
    j = 13
    while True:
        v = int(round(2 ** (j / 4)))
        if v > max_bound:
            break
        c.add(v)
        j += 1
    c.add(int(max_bound))
    return np.asarray(sorted(c), dtype=np.int64)


def value_grid() -> np.ndarray:
    """The public candidate grid of value bounds: 0 and +-2**(j/4), 2**-8 <= |c| <= 2**40, ascending."""
    k = np.arange(GRID_MIN_EXP * GRID_STEPS_PER_OCTAVE, GRID_MAX_EXP * GRID_STEPS_PER_OCTAVE + 1)
    pos = np.exp2(k / GRID_STEPS_PER_OCTAVE)
    return np.concatenate([-pos[::-1], [0.0], pos])


def estimation_hash(spec_hash: str, config: EstimateConfig | Mapping[str, Any]) -> str:
    """The run key's spec-hash field of an estimation: the spec's hash and the configuration together."""
    from dpops.events import canonical_json

    cfg = config.to_dict() if isinstance(config, EstimateConfig) else dict(config)
    body = {"schema": ESTIMATION_SCHEMA, "spec_hash": spec_hash, "config": cfg}
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()


# --------------------------------------------------------------------------- the mechanism core


def quantile_choice(at_or_below: np.ndarray, n: int, q: float, epsilon: float, items_per_unit: int,
                    rng: RandomSource, *, prefer: str = "low", anchor: int = 0) -> int:
    """Index of the candidate the exponential mechanism picks, for utility -|S r(c) - Q n| - pen(c).

    ``at_or_below[j]``: r(c_j), the items counted at or below candidate j; ``n``: all items;
    ``items_per_unit``: m, the most items one unit owns. Sensitivity S*m (the lemma of the module
    docstring); the selection is the release's own ``exponential_mechanism`` (exact on these integer
    utilities).

    pen(c_j) is PUBLIC: ``TAIL_DECAY`` nats per grid step beyond the ``anchor`` index (the spec's
    declared bound) away from the ``prefer`` end (``low``: steps above the anchor, for upper bounds and
    L0/Linf; ``high``: steps below it, for lower bounds), i.e. ceil(TAIL_DECAY * 2 S m / epsilon)
    utility units per step, and none on the other side of the anchor. Why: every candidate beyond the data's
    extreme has the same quantile utility, and a grid reaching 2**40 has hundreds of them, which would
    take most of the probability mass when (1-q) n is small. Privacy: pen does not depend on the data,
    so u - pen has the same sensitivity as u (|(u - pen)(c) - (u' - pen)(c)| = |u(c) - u'(c)|) and the
    mechanism stays epsilon-DP (it is the exponential mechanism with a geometric base measure)."""
    from dpops.noise.selection import QUANTILE_Q_BITS, exponential_mechanism

    scale = 1 << QUANTILE_Q_BITS
    qq = round(float(q) * scale)
    r = np.asarray(at_or_below, dtype=np.int64)
    sens = int(items_per_unit) * scale
    step_f = TAIL_DECAY * 2 * sens / float(epsilon)
    # The same integer, computed exactly when the float overflows (a tiny epsilon share with a large L0*Linf: the
    # float was inf and math.ceil raised after the charge, review 5). Public parameters only, so is the branch.
    step = math.ceil(step_f) if math.isfinite(step_f) else \
        math.ceil(Fraction(TAIL_DECAY) * 2 * sens / Fraction(float(epsilon)))
    j = np.arange(r.size, dtype=np.int64)
    beyond = np.maximum(0, j - int(anchor)) if prefer == "low" else np.maximum(0, int(anchor) - j)
    # Exact integers: at a tiny epsilon with large L0*Linf, step * beyond leaves int64 (issue 25 item 6b: the
    # estimation failed after the charge), and so does S r(c) - Q n itself once n S passes 2^63 (S = 2^16: 1.4e14
    # items), which wrapped silently: a far candidate's utility looked near and was picked. The bound is public
    # (n, S, step and the grid), so the choice of path leaks nothing; Python ints keep every utility exact and
    # the mechanism takes them on its exact path (as ``histogram_quantile_utility`` does for the release).
    if int(n) * scale + step * int(beyond.max(initial=0)) < 1 << 62 and int(r.max(initial=0)) <= int(n):
        util = -np.abs(r * np.int64(scale) - np.int64(qq) * np.int64(n)) - np.int64(step) * beyond
    else:
        pairs = zip(r.tolist(), beyond.tolist(), strict=True)
        util = np.array([-abs(int(a) * scale - qq * int(n)) - step * int(b) for a, b in pairs], dtype=object)
    return int(exponential_mechanism(util, epsilon, float(sens), rng))


def _at_or_below_int(values: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """r(k) = #{values <= k} for each candidate k of ``grid``."""
    return np.searchsorted(np.sort(np.asarray(values, dtype=np.int64)), grid, side="right").astype(np.int64)


def estimate_l0(per_unit_partitions: Sequence[int] | np.ndarray, epsilon: float, rng: RandomSource | None = None, *,
                seed: int | None = None, quantile: float = DEFAULT_QUANTILE, max_l0: int = DEFAULT_MAX_L0,
                declared: int = 1) -> int:
    """epsilon-DP L0: the exponential mechanism over ``contribution_grid(max_l0)`` at the ``quantile`` of the
    units' partition counts.

    ``per_unit_partitions``: one entry per unit, its number of distinct partitions (each unit is one
    item: sensitivity S, module docstring). ``rng``: the randomness source (default: ``test_random(seed)``
    with ``seed``, else the OS CSPRNG). The building block of ``dpops estimate``; exposed for notebooks
    and the PipelineDP benchmark."""
    from dpops.noise.randomness import os_random, test_random

    if rng is None:
        rng = test_random(int(seed), ("estimate_l0",)) if seed is not None else os_random()
    counts = np.asarray(per_unit_partitions, dtype=np.int64)
    if counts.ndim != 1 or (counts.size and counts.min() < 1):
        raise InvalidParameter("estimate_l0: per_unit_partitions must be a 1-D array of counts >= 1, one per unit")
    grid = contribution_grid(max_l0)
    idx = quantile_choice(_at_or_below_int(counts, grid), int(counts.size), quantile, epsilon, 1, rng,
                          anchor=_anchor(grid, declared))
    return int(grid[idx])


def _anchor(grid: np.ndarray, declared: float) -> int:
    """Index of the largest grid point at or below the declared (public) value (0 if none)."""
    return max(0, int(np.searchsorted(grid, declared, side="right")) - 1)


@dataclass
class Estimate:
    """The estimated bounds and how they were obtained (``config``, ``mechanisms``)."""

    spec: ReleaseSpec
    config: EstimateConfig
    l0: int | None  # None: not estimated
    linf: int | None
    bounds: dict[str, tuple[float, float]]  # column -> (lo, hi), only the estimated columns
    mechanisms: list[Mechanism]
    run_id: str | None = None
    # computed | committed (new run) | already_committed (served, nothing charged) | test_only (seeded: charged,
    # spent_unpublished, never published, no manifest)
    state: str = "computed"
    epsilon_charged: float = 0.0
    manifest: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    # error/1 only: the noisy histograms (DP outputs) and what the objective predicted for the choice
    histograms: dict[str, Any] | None = None
    choice: dict[str, Any] | None = None

    def targets(self) -> list[dict[str, Any]]:
        """The spec's accuracy targets checked against the release with the estimated bounds (issue 26 item 3):
        a function of the spec and the result only (public), so a served estimation gives the same."""
        return target_check(self.spec, self.result())

    def result(self) -> dict[str, Any]:
        """The estimated bounds as JSON (the manifest's ``estimation.result``)."""
        return {"max_partitions_per_unit": self.l0, "max_rows_per_unit_per_partition": self.linf,
                "bounds": {c: [float(lo), float(hi)] for c, (lo, hi) in sorted(self.bounds.items())}}

    def patch(self) -> dict[str, Any]:
        """The spec patch (``dpops.analysis.tuning.apply_patch`` form): the new bounds and ``estimated_from``."""
        return spec_patch(self.spec, self.result(), self.run_id)

    def to_dict(self) -> dict[str, Any]:
        """JSON form of the whole result (the CLI's ``--json``)."""
        return {"run_id": self.run_id, "state": self.state, "epsilon_charged": self.epsilon_charged,
                "epsilon": float(self.config.epsilon), "config": self.config.to_dict(), "result": self.result(),
                "mechanisms": [m.to_dict() for m in self.mechanisms], "patch": self.patch(),
                "manifest": self.manifest, "choice": self.choice, "targets": self.targets()}


def target_check(spec: ReleaseSpec, result: Mapping[str, Any],
                 declared: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """``dpops.analysis.targets.evaluate`` of the spec's accuracy targets (or ``declared``, the targets a
    manifest's ``accuracy.declared`` recorded: the embedded spec leaves them out, as they are not part of the
    spec hash) against the plan of the spec patched with ``result``, the bounds a release made from the
    estimation would run with: every target, met or not, at the release's own epsilon."""
    from dpops.analysis.targets import evaluate
    from dpops.analysis.tuning import load_patched
    from dpops.errors import DpopsError, public_message
    from dpops.release_plan import plan_release
    from dpops.spec import AccuracySpec

    accuracy = AccuracySpec.model_validate(dict(declared)) if declared is not None else spec.accuracy
    if accuracy is None:
        return []
    try:
        patch = spec_patch(spec, result, None)
        patched = load_patched(spec, patch) if patch else spec
        return [t.to_dict() for t in evaluate(plan_release(patched), accuracy)]
    except DpopsError as exc:  # runs after the charge: a plan refusal is reported, never raised
        return [{"index": -1, "kind": "error", "metric": "", "measure": "", "target": 0.0, "predicted": None,
                 "met": False, "shortfall": None,
                 "description": f"the targets could not be evaluated at the estimated bounds: {public_message(exc)}"}]


def patch_document(est: Estimate) -> dict[str, Any]:
    """``patch.yaml``: ``{"schema", "spec", "run_id", "patch"}``, applied by ``dpops spec apply-patch`` (mappings
    merge, lists replace; ``dpops.analysis.tune_output.apply_patch_document``)."""
    return {"schema": PATCH_SCHEMA, "spec": est.spec.name, "run_id": est.run_id, "patch": est.patch()}


def spec_patch(spec: ReleaseSpec, result: Mapping[str, Any], run_id: str | None) -> dict[str, Any]:
    """A spec patch from an estimation result: ``contribution``, the whole ``metrics`` list (lists are
    replaced, not merged) with the estimated bounds, and ``estimated_from``."""
    patch: dict[str, Any] = {}
    contrib: dict[str, int] = {}
    if result.get("max_partitions_per_unit") is not None:
        contrib["max_partitions_per_unit"] = int(result["max_partitions_per_unit"])
    if result.get("max_rows_per_unit_per_partition") is not None:
        contrib["max_rows_per_unit_per_partition"] = int(result["max_rows_per_unit_per_partition"])
    if contrib:
        patch["contribution"] = contrib
    bmap = dict(result.get("bounds") or {})
    if bmap:
        metrics = []
        for m in spec.model_dump(mode="json", exclude_none=True)["metrics"]:
            if "bounds" in m and m.get("column") in bmap:
                m = {k: v for k, v in m.items() if k != "fallback_bounds"}  # bounds: estimate becomes declared
                m["bounds"] = [float(x) for x in bmap[m["column"]]]
            metrics.append(m)
        patch["metrics"] = metrics
    if run_id is not None:
        patch["estimated_from"] = run_id
    return patch


# --------------------------------------------------------------------------- what the mechanisms see


@dataclass(frozen=True)
class GridCounts:
    """What one L0 or Linf mechanism sees: r(c) = #{items <= c} per candidate c of a public grid, and n items.

    Exact counts of private data, not DP: they go only into ``quantile_choice`` (the estimation release keeps
    them in its process or its private staging directory, never in a manifest or a log). Additive over
    disjoint sets of units, so workers may count their buckets and the sums are the whole input's counts."""

    at_or_below: np.ndarray  # int64, one per candidate
    n: int

    def __add__(self, other: GridCounts) -> GridCounts:
        return GridCounts(self.at_or_below + other.at_or_below, self.n + other.n)


@dataclass(frozen=True)
class ValueCounts:
    """What one column's value mechanisms see over the bounded rows: #{v < c} and #{v <= c} per candidate c of
    ``value_grid()``, and the number of rows n. Private and additive, as ``GridCounts``."""

    below: np.ndarray  # int64
    at_or_below: np.ndarray  # int64
    n: int

    def __add__(self, other: ValueCounts) -> ValueCounts:
        return ValueCounts(self.below + other.below, self.at_or_below + other.at_or_below, self.n + other.n)


@dataclass(frozen=True)
class PassCounts:
    """What one counting pass over the input returns (``pipelines.estimation.count_estimation``): the L0 counts
    and the Linf counts at each candidate L0 (a ``pairs`` pass), the value counts per column (``values``), or
    error/1's exact histograms (``error``)."""

    l0: GridCounts | None = None
    linf: dict[int, GridCounts] = field(default_factory=dict)
    values: dict[str, ValueCounts] = field(default_factory=dict)
    histograms: BoundHistograms | None = None  # an ``error`` pass: error/1's exact histograms (private, not DP)


class EstimationCounts(Protocol):
    """The counts the mechanisms ask for, in their order (each later request names the earlier DP outputs).

    ``RowCounts`` answers from rows in memory; ``dpops.release.estimation`` may answer from Beam passes over
    the input (``pipelines.estimation``), which count each unit bucket with the same functions and sum."""

    def l0_counts(self, grid: np.ndarray) -> GridCounts:
        """Per unit its number of distinct partitions, counted at or below each candidate L0."""
        ...

    def linf_counts(self, l0: int, grid: np.ndarray) -> GridCounts:
        """Per unit its largest row count in one of the pairs it keeps under ``l0``, at or below each candidate."""
        ...

    def value_counts(self, l0: int, linf: int, columns: Sequence[str], grid: np.ndarray) -> dict[str, ValueCounts]:
        """Per column the values of the rows bounding keeps at (``l0``, ``linf``), below and at or below each c."""
        ...


@dataclass(frozen=True)
class PairTable:
    """One entry per distinct (unit, partition) pair: unit hash, partition hash, pair priority, row count.

    The L0 and Linf mechanisms need no more than this: bounding's L0 step orders a unit's pairs by (pair
    priority, partition hash) only (``pipelines.bounding.contribution_ranks``), and without a row limit a kept
    pair keeps all its rows. Tables of several batches merge by adding the row counts of equal pairs."""

    u: np.ndarray  # uint64
    p: np.ndarray  # uint64
    pp: np.ndarray  # uint64, equal for all rows of a pair
    rows: np.ndarray  # int64

    @classmethod
    def of(cls, u: np.ndarray, p: np.ndarray, pp: np.ndarray, rows: np.ndarray | None = None) -> PairTable:
        """The table of rows (u, p, pp) (``rows``: each entry's row count, default one row each)."""
        import pandas as pd

        u, p, pp = (np.asarray(x, dtype=np.uint64) for x in (u, p, pp))
        if not len(u):
            z = np.zeros(0, np.uint64)
            return cls(z, z, z, np.zeros(0, np.int64))
        from pipelines.bounding import pair_codes  # the release's own pair codes (one owner of the pair rule)

        ucode, uniq_u = pd.factorize(u, sort=False)
        pcode, uniq_p = pd.factorize(p, sort=False)
        pair = pair_codes(ucode, pcode, len(uniq_u), len(uniq_p))
        m = int(pair.max()) + 1
        first = np.empty(m, np.int64)
        first[pair[::-1]] = np.arange(len(u) - 1, -1, -1)
        weights = np.ones(len(u), np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
        counts = np.zeros(m, np.int64)
        np.add.at(counts, pair, weights)  # exact integers (a bincount with weights would go through float64)
        return cls(u[first], p[first], pp[first], counts)

    @classmethod
    def merge(cls, tables: Sequence[PairTable]) -> PairTable:
        """One table of the union (the row counts of a pair seen in several tables added)."""
        if len(tables) == 1:
            return tables[0]
        return cls.of(*(np.concatenate([getattr(t, f) for t in tables]) for f in ("u", "p", "pp", "rows")))

    def l0_counts(self, grid: np.ndarray) -> GridCounts:
        """``EstimationCounts.l0_counts``: one item per unit, its number of pairs."""
        import pandas as pd

        if not len(self.u):
            return GridCounts(_at_or_below_int(np.zeros(0, np.int64), grid), 0)
        ucode, uniq = pd.factorize(self.u, sort=False)
        per_unit = np.bincount(ucode, minlength=len(uniq)).astype(np.int64)
        return GridCounts(_at_or_below_int(per_unit, grid), int(per_unit.size))

    def linf_counts_at(self, l0s: Sequence[int], grid: np.ndarray) -> dict[int, GridCounts]:
        """``linf_counts`` at each L0 of ``l0s`` from one ranking of the pairs (``ContributionRanks``: exact for
        every L0 >= 1, so each is the pair set ``bound_contributions`` keeps at that L0)."""
        from pipelines.bounding import contribution_ranks

        if not len(self.u):
            return {int(k): GridCounts(_at_or_below_int(np.zeros(0, np.int64), grid), 0) for k in l0s}
        r = contribution_ranks(self.u, self.p, np.zeros(len(self.u), np.uint64), self.pp, l0_floor=1,
                               linf_floor=_NO_ROW_LIMIT)
        out = {}
        for k in l0s:
            kept = r.pair_mask(int(k))  # one table entry per pair, so pairs and entries coincide
            per_unit = np.zeros(r.n_units, np.int64)
            np.maximum.at(per_unit, r.pair_unit[kept], self.rows[r.first[kept]])
            out[int(k)] = GridCounts(_at_or_below_int(per_unit, grid), int(per_unit.size))
        return out


def value_codes(v: np.ndarray, grid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each value's two cells on the public ``grid`` (int16): ``lo`` = #{grid points < v}, ``hi`` = #{grid points
    <= v}. v <= c_j iff lo <= j, and v < c_j iff hi <= j (the grid is strictly increasing), so the codes carry
    all the value mechanisms see of a row: a worker may keep two small integers instead of the value."""
    x = np.asarray(v, dtype=np.float64)
    return (np.searchsorted(grid, x, side="left").astype(np.int16),
            np.searchsorted(grid, x, side="right").astype(np.int16))


def value_counts_of_codes(lo: np.ndarray, hi: np.ndarray, grid_size: int) -> ValueCounts:
    """``ValueCounts`` of rows given by their ``value_codes``: #{v < c_j} = #{hi <= j}, #{v <= c_j} = #{lo <= j}.
    Exact integers; additive over disjoint sets of rows."""
    n = int(np.asarray(lo).size)
    below = np.cumsum(np.bincount(np.asarray(hi, np.int64), minlength=grid_size + 1))[:grid_size]
    at_or_below = np.cumsum(np.bincount(np.asarray(lo, np.int64), minlength=grid_size + 1))[:grid_size]
    return ValueCounts(below.astype(np.int64), at_or_below.astype(np.int64), n)


def value_counts_of(rows: Mapping[str, np.ndarray], l0: int, linf: int, columns: Sequence[str],
                    grid: np.ndarray) -> dict[str, ValueCounts]:
    """``EstimationCounts.value_counts`` over ``rows`` (bounded here at (l0, linf); bounding is idempotent, so
    rows already bounded at the same bounds give the same counts). A row's value is read as its
    ``value_codes`` (column ``c:lo:<col>``/``c:hi:<col>`` when the rows carry them, as the Beam workers' do,
    else computed from ``v:<col>``): one counting rule for the driver and the workers."""
    from pipelines.bounding import bound_contributions

    kept, _, _ = bound_contributions(np.asarray(rows["u"]), np.asarray(rows["p"]), rows["prio"], l0, linf,
                                     rows["pp"])
    out = {}
    for col in columns:
        if f"c:lo:{col}" in rows:
            lo, hi = np.asarray(rows[f"c:lo:{col}"])[kept], np.asarray(rows[f"c:hi:{col}"])[kept]
        else:
            lo, hi = value_codes(np.asarray(rows[f"v:{col}"], dtype=np.float64)[kept], grid)
        out[col] = value_counts_of_codes(lo, hi, int(grid.size))
    return out


class RowCounts:
    """``EstimationCounts`` from checked, hashed rows in memory (``pipelines.io.prepare_batch``'s output)."""

    def __init__(self, rows: Mapping[str, np.ndarray]):
        self.rows = rows
        self._pairs: PairTable | None = None

    def _pair_table(self) -> PairTable:
        if self._pairs is None:
            self._pairs = PairTable.of(self.rows["u"], self.rows["p"], self.rows["pp"])
        return self._pairs

    def l0_counts(self, grid: np.ndarray) -> GridCounts:
        """Per unit its number of distinct partitions (``PairTable.l0_counts``)."""
        return self._pair_table().l0_counts(grid)

    def linf_counts(self, l0: int, grid: np.ndarray) -> GridCounts:
        """Per unit its largest kept pair (``PairTable.linf_counts_at``)."""
        return self._pair_table().linf_counts_at([l0], grid)[int(l0)]

    def value_counts(self, l0: int, linf: int, columns: Sequence[str], grid: np.ndarray) -> dict[str, ValueCounts]:
        """``value_counts_of`` the rows."""
        return value_counts_of(self.rows, l0, linf, columns, grid)


# --------------------------------------------------------------------------- the mechanisms in order


def estimate_rows(spec: ReleaseSpec, rows: Mapping[str, np.ndarray], config: EstimateConfig,
                  rng: RandomSource) -> Estimate:
    """The estimation's mechanisms over checked, hashed rows (``pipelines.io.prepare_batch``'s output:
    "u", "p", "prio", "pp", "v:<col>"). Every random choice comes from ``rng``; the estimation release
    (``dpops.release.estimation.compute_estimation``) passes the run's source, the auditor a seeded one.
    ``config.method`` picks the rule (``METHODS``): quantile/1 is ``estimate_counts`` over ``RowCounts(rows)``,
    error/1 the noisy histograms of ``_estimate_by_error``."""
    if config.method == ERROR_METHOD:
        return _estimate_by_error(spec, rows, config, rng)
    return estimate_counts(spec, RowCounts(rows), config, rng)


def estimate_counts(spec: ReleaseSpec, counts: EstimationCounts, config: EstimateConfig,
                    rng: RandomSource) -> Estimate:
    """The estimation's mechanisms, in order, over the counts they ask ``counts`` for (module docstring).

    Each mechanism sees only its public-grid counts, so the result depends on the data through them alone:
    counts computed by workers and summed give the same bounds, bit for bit, as counts of all rows at once.
    L0 first; Linf over the pairs kept under the L0 just chosen; value bounds over the rows kept under both
    (or the spec's declared ones where not estimated): adaptive composition, covered by basic composition.
    quantile/1 only (error/1 reads the rows: ``estimate_rows``)."""
    if config.method != QUANTILE_METHOD:  # the callers check before the charge; this is the rule's own guard
        raise InvalidParameter(f"estimate_counts: method {config.method} needs the rows (estimate_rows), not counts")
    plan = mechanisms(spec, config)
    rl = bool(spec.privacy_unit.record_level)
    l0 = linf = None
    L0 = 1 if rl else int(spec.contribution.max_partitions_per_unit)
    LI = 1 if rl else int(spec.contribution.max_rows_per_unit_per_partition)
    by_name = {m.name: m for m in plan}
    if "l0" in by_name:
        m = by_name["l0"]
        grid_l0 = contribution_grid(config.max_l0)
        c = counts.l0_counts(grid_l0)
        # estimate_l0's own call (units each count 1 item): the same mechanism, the same stream
        idx = quantile_choice(c.at_or_below, c.n, m.quantile, m.epsilon, 1, rng.child("estimate", "l0"),
                              anchor=_anchor(grid_l0, L0))
        l0 = L0 = int(grid_l0[idx])
    if "linf" in by_name:
        m = by_name["linf"]
        grid_linf = contribution_grid(config.max_linf)
        c = counts.linf_counts(L0, grid_linf)
        idx = quantile_choice(c.at_or_below, c.n, m.quantile, m.epsilon, m.max_items_per_unit,
                              rng.child("estimate", "linf"), anchor=_anchor(grid_linf, LI))
        linf = LI = int(grid_linf[idx])
    plan = mechanisms(spec, config, L0, LI)  # the value mechanisms' sensitivity uses the bounds just chosen
    by_name = {m.name: m for m in plan}
    grid = value_grid()
    bounds: dict[str, tuple[float, float]] = {}
    columns = list(dict.fromkeys(n.split(":", 1)[1] for n in by_name if ":" in n))
    if columns:
        declared = spec.declared_value_bounds()
        per_col = counts.value_counts(L0, LI, columns, grid)
        for col in columns:
            vc = per_col[col]
            lo = declared[col][0]
            if f"lower:{col}" in by_name:
                m = by_name[f"lower:{col}"]
                lo = float(grid[quantile_choice(vc.below, vc.n, m.quantile, m.epsilon, m.max_items_per_unit,
                                                rng.child("estimate", "lower", col), prefer="high",
                                                anchor=_anchor(grid, declared[col][0]))])
            m = by_name[f"upper:{col}"]
            hi = float(grid[quantile_choice(vc.at_or_below, vc.n, m.quantile, m.epsilon, m.max_items_per_unit,
                                            rng.child("estimate", "upper", col),
                                            anchor=_anchor(grid, declared[col][1]))])
            bounds[col] = _proper(lo, hi, grid)
    return Estimate(spec, config, l0, linf, bounds, plan)


def _estimate_by_error(spec: ReleaseSpec, rows: Mapping[str, np.ndarray], config: EstimateConfig,
                       rng: RandomSource) -> Estimate:
    """error/1 over rows in memory: ``error_exact_histograms`` of the rows, then ``estimate_by_error``."""
    return estimate_by_error(spec, error_exact_histograms(spec, rows, config, public_partition_hashes(spec)),
                             config, rng)


def public_partition_hashes(spec: ReleaseSpec) -> np.ndarray:
    """The release's public partitions' hashes in plan order (partition code i = the plan's i-th partition):
    what ``error_exact_histograms`` indexes its per-partition histogram by. Public (the spec's list)."""
    from dpops.release_plan import plan_release
    from pipelines.io import hash_partition_tuples

    plan_r = plan_release(spec)
    types = {k: str(v) for k, v in spec.input.columns.items()}
    return np.asarray(hash_partition_tuples([tuple(x) for x in (plan_r.public_partitions or [])],
                                            tuple(plan_r.partition_columns), types), dtype=np.uint64)


def error_exact_histograms(spec: ReleaseSpec, rows: Mapping[str, np.ndarray], config: EstimateConfig,
                           pub: np.ndarray) -> BoundHistograms:
    """error/1's exact histograms of ``rows`` (``exact_histograms_of_rows`` with this spec's histogram names and
    this configuration's Linf grid; ``pub``: ``public_partition_hashes(spec)``)."""
    names = [m.name.split(":", 1)[1] for m in mechanisms(spec, config)]
    return exact_histograms_of_rows(rows, pub, names, int(config.max_linf))


def exact_histograms_of_rows(rows: Mapping[str, np.ndarray], pub: np.ndarray, names: Sequence[str],
                             max_linf: int) -> BoundHistograms:
    """``bound_choice.exact_histograms`` of the rows of some units: ``names`` as ``error_histogram_names``,
    ``pub`` the public partitions' hashes in plan order. Every histogram is a sum over units of each unit's
    own weights, so the histograms of disjoint sets of units add up to those of their union, cell for cell
    (integers): the Beam workers compute them per unit bucket and sum (``add_histograms``). Exact, private:
    only ``estimate_by_error`` sees them. Dense unit codes are local to the call (a unit's weights depend on
    its own rows only)."""
    import pandas as pd

    from dpops.analysis import bound_choice as B

    pub = np.asarray(pub, dtype=np.uint64)
    order = np.argsort(pub, kind="stable")
    p = np.asarray(rows["p"], dtype=np.uint64)
    pos = np.minimum(np.searchsorted(pub[order], p), max(len(pub) - 1, 0))
    inside = (pub[order][pos] == p) if len(pub) else np.zeros(p.size, bool)  # the reader keeps public ones only
    ucode, _ = pd.factorize(np.asarray(rows["u"])[inside], sort=False)
    pcode = order[pos[inside]] if len(pub) else np.zeros(0, np.int64)
    cols = [n.split(":", 1)[1] for n in names if n.startswith("values:")]
    return B.exact_histograms(ucode.astype(np.int64), np.asarray(pcode, np.int64),
                              {c: np.asarray(rows[f"v:{c}"], dtype=np.float64)[inside] for c in cols},
                              n_partitions=len(pub), linf_grid=contribution_grid(max_linf),
                              v_grid=value_grid(), names=list(names))


def add_histograms(a: BoundHistograms, b: BoundHistograms) -> BoundHistograms:
    """The exact histograms of two disjoint sets of units added cell by cell (``error_exact_histograms``)."""
    import dataclasses

    def plus(x: np.ndarray | None, y: np.ndarray | None) -> np.ndarray | None:
        return None if x is None or y is None else np.asarray(x, np.int64) + np.asarray(y, np.int64)

    parts = plus(a.partitions, b.partitions)
    assert parts is not None
    return dataclasses.replace(a, units=plus(a.units, b.units), pairs=plus(a.pairs, b.pairs), partitions=parts,
                               values={c: a.values[c] + b.values[c] for c in a.values})


def estimate_by_error(spec: ReleaseSpec, exact: BoundHistograms, config: EstimateConfig,
                      rng: RandomSource) -> Estimate:
    """error/1 (``dpops.analysis.bound_choice``): the exact histograms of the rows (every unit's weights sum to
    at most S, so no bounding is needed for the sensitivity), each noised at its share by the release's own
    discrete Laplace, then the bounds minimising the release's predicted error, chosen from the noisy
    histograms alone (post-processing). Runs after the charge: an empty interval gives zero histograms and
    the choice still returns grid points. The result depends on the data through ``exact`` alone, so exact
    histograms summed by workers give the same bounds, bit for bit, as those of all rows at once."""
    from dpops.analysis import bound_choice as B

    plan = mechanisms(spec, config)
    names = [m.name.split(":", 1)[1] for m in plan]
    cols = [n.split(":", 1)[1] for n in names if n.startswith("values:")]
    contrib = "units" in names
    noisy = B.noisy_histograms(exact, {n: m.epsilon for n, m in zip(names, plan, strict=True)},
                               spec.privacy_unit.adjacency, rng.child("estimate", ERROR_METHOD))
    choice = choose_from_histograms(spec, config, noisy)
    return Estimate(spec, config, choice.l0 if contrib else None, choice.linf if contrib else None,
                    {c: choice.bounds[c] for c in cols}, plan, histograms=noisy.to_dict(), choice=choice.to_dict())


def choose_from_histograms(spec: ReleaseSpec, config: EstimateConfig, noisy: BoundHistograms) -> BoundChoice:
    """error/1's choice from its noisy histograms (``bound_choice.choose`` on this configuration's public
    grids): what the run computes and what ``manifest verify`` recomputes from the recorded histograms."""
    from dpops.analysis import bound_choice as B

    cols = [n.split(":", 1)[1] for n in noisy.names() if n.startswith("values:")]
    return B.choose(spec, noisy, l0_grid=contribution_grid(config.max_l0), linf_grid=contribution_grid(config.max_linf),
                    columns=cols, contribution=noisy.units is not None)


def _proper(lo: float, hi: float, grid: np.ndarray) -> tuple[float, float]:
    """(lo, hi) with lo < hi (post-processing of the two DP outputs): hi moves up to the next grid point."""
    if lo < hi:
        return lo, hi
    above = grid[grid > lo]
    return lo, float(above[0]) if above.size else lo + 1.0


def manifest_section(est: Estimate) -> dict[str, Any]:
    """The manifest's ``estimation`` object: configuration, mechanisms, result and patch (all public)."""
    out: dict[str, Any] = {"schema": ESTIMATION_SCHEMA, "config": est.config.to_dict(),
                           "mechanisms": [m.to_dict() for m in est.mechanisms], "result": est.result(),
                           "patch": est.patch()}
    if est.config.method == ERROR_METHOD:
        out |= {"histograms": est.histograms, "choice": est.choice, "targets": est.targets()}
    return out


def option_config(spec: ReleaseSpec) -> EstimateConfig:
    """The estimation a spec's ``bounds: estimate`` metrics ask for (issue 20 section 4): value bounds of
    the estimated columns only (the contribution bounds stay declared), epsilon the declared share
    (``ReleaseSpec.estimation_epsilon``), the default quantile and grids. A function of the spec alone,
    so a retry asks for the same run key."""
    return EstimateConfig(epsilon=spec.estimation_epsilon(), contribution=False,
                          columns=tuple(spec.estimated_columns))


def option_events(spec: ReleaseSpec) -> list[PrivacyEvent]:
    """What the ``bounds: estimate`` estimation charges per interval (empty when nothing is estimated):
    added to the release's own events wherever the interval's whole cost is predicted (the horizon)."""
    return events(spec, option_config(spec)) if spec.estimated_metric_keys else []


# --------------------------------------------------------------------------- verification


def recompute_section(manifest: Mapping[str, Any], spec: ReleaseSpec) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the ``estimation`` section's mechanisms and patch, the events) recomputed from the manifest's embedded
    spec (``spec``: parsed by the verifier, ``dpops.manifest.verify.parse_embedded_spec``), configuration and
    result alone: what ``manifest verify`` compares with the recorded ones."""
    from dpops.events import event_to_dict

    est = manifest["estimation"]
    config = EstimateConfig.from_dict(est["config"])
    res = est["result"]
    mech = mechanisms(spec, config, res.get("max_partitions_per_unit"), res.get("max_rows_per_unit_per_partition"))
    section: dict[str, Any] = {"schema": ESTIMATION_SCHEMA, "config": config.to_dict(),
                               "mechanisms": [m.to_dict() for m in mech], "result": dict(res),
                               "patch": spec_patch(spec, res, manifest["run_id"])}
    if config.method == ERROR_METHOD:
        # the choice is post-processing of the recorded noisy histograms: recomputed from them, and the result
        # must be the choice's bounds (a result no histogram supports is a bound no DP mechanism chose)
        from dpops.analysis.bound_choice import BoundHistograms

        hist = est.get("histograms") or {}
        choice = choose_from_histograms(spec, config, BoundHistograms.from_dict(hist, value_grid())).to_dict()
        contrib = "units" in hist.get("histograms", {})
        result: dict[str, Any] = {"max_partitions_per_unit": choice["max_partitions_per_unit"] if contrib else None,
                                  "max_rows_per_unit_per_partition":
                                      choice["max_rows_per_unit_per_partition"] if contrib else None,
                                  "bounds": choice["bounds"]}
        section |= {"result": result, "patch": spec_patch(spec, result, manifest["run_id"]), "histograms": hist,
                    "choice": choice,
                    "targets": target_check(spec, result, (manifest.get("accuracy") or {}).get("declared"))}
    return section, [event_to_dict(e) for e in events(spec, config)]


def is_test_key_id(key_id: str) -> bool:
    """A run key's key id that names test-mode (seeded, public) randomness (``dpops.release.preparation``)."""
    return str(key_id).startswith("test/")


__all__ = ["EstimateConfig", "Estimate", "Mechanism", "option_config", "option_events", "EstimationCounts",
           "GridCounts", "ValueCounts", "PassCounts", "PairTable", "RowCounts", "estimate_counts", "value_counts_of",
           "patch_document", "PATCH_SCHEMA", "estimate_l0",
           "estimate_rows", "events", "mechanisms", "value_grid", "contribution_grid", "estimation_hash",
           "quantile_choice", "spec_patch", "is_test_key_id", "recompute_section", "manifest_section",
           "QUANTILE_METHOD", "ERROR_METHOD", "METHODS", "choose_from_histograms", "target_check",
           "error_histogram_names", "RELEASE_SUFFIX", "ESTIMATION_SCHEMA", "value_codes", "value_counts_of_codes",
           "error_exact_histograms", "estimate_by_error", "public_partition_hashes", "add_histograms",
           "exact_histograms_of_rows"]
