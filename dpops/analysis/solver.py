"""``dpops plan --solve``: the epsilon split that meets every accuracy target at the least cost.

What is optimised. The decision variables are the epsilon shares s_k of the split keys that carry a
target (a metric key, or ``partition_selection`` for a keep target); every other key keeps the share
the spec declares (a metric without a target has no accuracy to trade against, and the solver must
not silently starve it). The one exception: a count metric whose noisy vector a targeted mean or
variance reuses may be RAISED above its declared share when that is cheaper than raising the mean's;
it never goes below it. A candidate split is turned into a spec (``ReleaseSpec.with_budget``) and
planned by ``plan_release`` -- the very calibration a release uses -- and its targets are checked by
``dpops.analysis.targets.evaluate``. So the solution is judged by the real plan, never by a model of it.

Algorithm. For one key, "all its targets are met" is monotone in its own share (more epsilon, less
noise, higher keep probability), so the least sufficient share is found by bisection on a log scale
(relative precision 1e-6, rounded up: the returned point is always feasible). Keys are updated in
turn with the others fixed until no share moves (Gauss-Seidel; at most ``MAX_ROUNDS`` rounds), and
the result is verified once more against the real plan.

Why it is optimal. If each target depends only on its own key's share (Laplace noise; public
partitions or keep targets without Gaussian metrics; means/variances whose count vector is their
own), the feasible set is the product of half-lines [s*_k, inf), and s* is its least element. Every
accountant's epsilon of the plan (basic: the sum of shares; zCDP, RDP, PLD: the composition of the
plan's events) is non-decreasing in each share -- a larger share only lowers a noise scale or raises
a selection's epsilon -- so s* minimises the per-interval cost under EVERY accountant at once: the
accountant changes what the interval costs, not which split is best. When targets are coupled (the
Gaussian metrics share one zCDP conversion, delta is split between Gaussian metrics and partition
selection, a mean reuses the count metric's noisy vector) the fixpoint is a coordinate-wise minimum:
no single share can be lowered without breaking a target. ``tests/test_analysis_solver.py`` checks
on a grid that no cheaper split meets the targets, for both noise families.

When the budget is short (the scope's cap, what remains of it in the ledger, or a cap on the run), the
solver minimises the LARGEST relative shortfall (``TargetResult.shortfall``: predicted/target - 1 for an
error, 1 - p/target for a probability) over the splits that fit (issue 26 section 4: scaling every targeted
share down by one factor starved the targets whose accuracy falls fastest with epsilon, two of them to a
share of 0.0058). For a level s, relax every target by s (an error bound times 1 + s, a probability times
1 - s) and take the least shares meeting the relaxed targets, exactly as above; their cost is
non-decreasing as s falls, so the least s whose shares fit is found by bisection, and every target then
misses by at most s. The result lists which targets fail and by how much. No privacy question is involved:
whatever split is chosen, the release is planned and charged from it like any other.

The split a spec should declare is ``Solution.patch_split`` (and ``patch_epsilon``): the shares rounded to
``PATCH_DIGITS`` significant digits, up when the split meets its targets (rounding up never loses one) and
down when it was limited by the budget (so it still fits), and checked again against the real plan; when
a rounded split would change a verdict, more digits are kept. That is what ``dpops plan --solve --out``
writes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dpops.analysis.targets import TargetResult, evaluate, target_key, target_met
from dpops.analysis.tune_output import SOLVE_PATCH_SCHEMA as PATCH_SCHEMA  # one name per patch kind
from dpops.errors import InvalidParameter
from dpops.spec import BOUNDS_SHARE_SUFFIX

if TYPE_CHECKING:
    from dpops.events import PrivacyEvent
    from dpops.release_plan import ReleasePlan
    from dpops.spec import ReleaseSpec

PATCH_DIGITS = 4  # significant digits of a written share (more when fewer would change a verdict)
MIN_SHARE = 1e-4  # below this a share is not planned (selection tables grow as 1/epsilon)
MAX_SHARE = 100.0  # epsilon per key beyond which a target is called unreachable
REL_TOL = 1e-6
MAX_ROUNDS = 30
FitCheck = Callable[[Sequence["PrivacyEvent"]], bool]


@dataclass(frozen=True)
class Solution:
    """What ``solve`` found: the split, its cost per interval, and each target at that split."""

    feasible: bool  # every target met, within the budget when one was given
    epsilon: float  # budget.epsilon to declare (the plan's basic-composition total)
    split: dict[str, float]  # epsilon share per split key (write as budget.split: they are weights)
    accountant: str
    cost: float  # epsilon of one interval (the release and any bounds: estimate estimation) under ``accountant``
    targets: list[TargetResult]
    unreachable: list[int] = field(default_factory=list)  # target indices no share up to MAX_SHARE meets
    limited_by: str | None = None  # "budget" when the split was scaled down to fit
    available: float | None = None
    rounds: int = 0
    spec: ReleaseSpec | None = field(default=None, repr=False, compare=False)
    # the split to declare: ``split`` rounded (see the module docstring), checked against the real plan
    patch_epsilon: float | None = None
    patch_split: dict[str, float] | None = None
    max_shortfall: float = 0.0  # the largest relative shortfall of a target (0 when all are met)

    @property
    def failing(self) -> list[TargetResult]:
        """The targets not met at the returned split."""
        return [t for t in self.targets if not t.met]

    def spec_patch(self) -> dict[str, Any]:
        """The ``budget`` keys to write into the spec to use this split (the rounded, checked shares)."""
        split = dict(self.patch_split if self.patch_split is not None else self.split)
        return {"budget": {"epsilon": self.patch_epsilon if self.patch_epsilon is not None else self.epsilon,
                           "split": split}}

    def patched_spec(self) -> ReleaseSpec:
        """The spec as the patch leaves it (``spec_patch``: the rounded split): what the horizon prices."""
        if self.spec is None:
            raise InvalidParameter("this Solution carries no solved spec")
        budget = self.spec_patch()["budget"]
        return self.spec.with_budget(float(budget["epsilon"]), dict(budget["split"]))

    def patch_yaml(self) -> str:
        """``patch_document`` as YAML (no anchors, ``dpops.analysis.tune_output.dump_patch``), headed by comments
        saying what it is and, when it does not meet every target, which ones it misses."""
        from dpops.analysis.tune_output import dump_patch

        head = ("# dpops plan --solve: a budget split for the spec's accuracy targets, computed from the spec alone "
                "(no data read, nothing charged)\n# apply with: dpops spec apply-patch SPEC THIS_FILE\n")
        if not self.feasible:
            head += (f"# it does NOT meet every target ({self.limited_by or 'unreachable'}): the largest shortfall "
                     f"is {self.max_shortfall:.1%}\n")
        return head + dump_patch(self.patch_document())

    def patch_document(self) -> dict[str, Any]:
        """What ``dpops plan --solve --out`` writes and ``dpops spec apply-patch`` applies: the spec's ``budget``
        patch, and (never copied into the spec) what the solver found at that split."""
        patch = self.spec_patch()
        cost, targets = self.cost, self.targets
        if self.spec is not None and self.patch_split is not None:  # the figures of the split written, not the exact
            patched = self.patched_spec()
            cost = interval_cost(self.spec, dict(patch["budget"]["split"]), self.accountant)
            from dpops.release_plan import plan_release

            targets = evaluate(plan_release(patched), patched.accuracy)
        return {"schema": PATCH_SCHEMA, "spec": self.spec.name if self.spec is not None else None, "patch": patch,
                "solve": {"feasible": all(t.met for t in targets), "accountant": self.accountant, "cost": cost,
                          "limited_by": self.limited_by, "available": self.available,
                          "max_shortfall": max_shortfall(targets),
                          "failing": [t.description for t in targets if not t.met]}}

    def to_dict(self) -> dict[str, Any]:
        """JSON form (without the solved spec object)."""
        return {"feasible": self.feasible, "epsilon": self.epsilon, "split": dict(self.split),
                "accountant": self.accountant, "cost": self.cost,
                "targets": [t.to_dict() for t in self.targets], "unreachable": list(self.unreachable),
                "limited_by": self.limited_by, "available": self.available, "rounds": self.rounds,
                "max_shortfall": self.max_shortfall, "spec_patch": self.spec_patch()}


def declared_shares(spec: ReleaseSpec) -> dict[str, float]:
    """The spec's own epsilon share per split key (basic view: epsilon * w / sum w).

    ``bounds: estimate`` (issue 25 item 7e): ``budget.epsilon`` is the interval's whole charge, the release's
    own keys share what the estimation leaves (``release_part``), and each ``<key>.bounds`` share is a key
    of its own at the estimation's epsilon. It is never targeted, so it keeps that share, and every cost
    and fit below counts it (``interval_events``)."""
    release = spec.release_part()
    w = release.split_weights()
    total = sum(w.values())
    out = {k: float(release.budget.epsilon) * v / total for k, v in w.items()}
    est = spec.estimation_epsilon()
    if est > 0.0:
        given = spec.budget.split or {}
        keys = [k + BOUNDS_SHARE_SUFFIX for k in spec.estimated_metric_keys]
        wsum = sum(float(given.get(k, 0.0)) for k in keys)
        out.update({k: est * float(given.get(k, 0.0)) / wsum for k in keys})
    return out


def spec_for(spec: ReleaseSpec, shares: dict[str, float]) -> ReleaseSpec:
    """The spec whose plan spends ``shares`` (epsilon per key): budget.epsilon = their sum, split = them."""
    return spec.with_budget(math.fsum(shares.values()), dict(shares))


def plan_for(spec: ReleaseSpec, shares: dict[str, float]) -> ReleasePlan:
    """``plan_release`` of ``spec_for``: the real calibration of a candidate split."""
    from dpops.release_plan import plan_release

    return plan_release(spec_for(spec, shares))


def interval_events(spec: ReleaseSpec, shares: dict[str, float]) -> list[PrivacyEvent]:
    """What one interval of ``spec_for(spec, shares)`` charges: its plan's events and, for ``bounds: estimate``,
    its estimation's (``dpops.analysis.estimate.option_events``), two ledger runs on one scope."""
    from dpops.analysis.estimate import option_events

    return list(plan_for(spec, shares).events) + option_events(spec_for(spec, shares))


def interval_cost(spec: ReleaseSpec, shares: dict[str, float], accountant: str) -> float:
    """Epsilon of one interval (``interval_events``) under ``accountant`` at the spec's delta."""
    from dpops.accounting import get_accountant

    return float(get_accountant(accountant).epsilon(interval_events(spec, shares), plan_for(spec, shares).delta))


def run_cost(plan: ReleasePlan, accountant: str, delta: float | None = None) -> float:
    """Epsilon of one run of ``plan`` under ``accountant`` at ``delta`` (default the plan's)."""
    from dpops.accounting import get_accountant

    return float(get_accountant(accountant).epsilon(plan.events, plan.delta if delta is None else delta))


def _met(spec: ReleaseSpec, shares: dict[str, float], key: str) -> bool:
    try:
        plan = plan_for(spec, shares)
    except (InvalidParameter, OverflowError):
        return False  # a share too small or too large to plan (e.g. a selection table too long) meets nothing
    acc = spec.accuracy
    assert acc is not None
    return all(target_met(plan, t, float(acc.confidence)) for t in acc.targets if target_key(t) == key)


def least_share(spec: ReleaseSpec, shares: dict[str, float], key: str, rel_tol: float = REL_TOL) -> float | None:
    """The least share of ``key`` meeting all of its targets with the other shares fixed (None: none up to MAX).

    Brackets the answer by doubling or halving from the current share (so the plans evaluated stay near
    the answer, away from extreme epsilons), then bisects on a log scale to REL_TOL, returning the
    feasible end.
    """
    trial = dict(shares)

    def ok(s: float) -> bool:
        trial[key] = s
        return _met(spec, trial, key)

    s0 = min(max(shares[key], MIN_SHARE), MAX_SHARE)
    if ok(s0):
        hi, lo = s0, s0 / 2
        while lo >= MIN_SHARE and ok(lo):
            hi, lo = lo, lo / 2
        if lo < MIN_SHARE:
            return hi if hi == MIN_SHARE or not ok(MIN_SHARE) else MIN_SHARE
    else:
        lo, hi = s0, s0 * 2
        while not ok(min(hi, MAX_SHARE)):
            if hi >= MAX_SHARE:
                return None
            lo, hi = hi, hi * 2
        hi = min(hi, MAX_SHARE)
    while hi > lo * (1.0 + rel_tol):
        mid = math.sqrt(lo * hi)
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _coupled_pairs(spec: ReleaseSpec, keys: list[str]) -> dict[str, str]:
    """Targeted mean/variance key -> the count metric key whose noisy vector it reuses (both targeted or not)."""
    from dpops.release_plan import plan_release

    plan = plan_release(spec)
    return {m.key: m.count_from for m in plan.metrics if m.key in keys and m.count_from is not None}


def _gauss_seidel(spec: ReleaseSpec, shares: dict[str, float], keys: list[str], unreachable: set[str],
                  pairs: dict[str, str], floor: dict[str, float] | None = None, rel_tol: float = REL_TOL,
                  max_rounds: int = MAX_ROUNDS) -> int:
    """Update each targeted share to its least sufficient value given the others, until none moves."""
    floor = floor or {}
    rounds = 0
    while rounds < max_rounds:
        rounds += 1
        moved = False
        for k in keys:
            s = least_share(spec, shares, k, rel_tol)
            if s is None:
                if k not in unreachable:
                    unreachable.add(k)
                    moved = True
                shares[k] = MAX_SHARE if k not in pairs.values() else shares[k]
                continue
            unreachable.discard(k)
            s = max(s, floor.get(k, 0.0))
            if abs(s - shares[k]) > 2 * rel_tol * shares[k]:
                moved = True
            shares[k] = s
        if not moved:
            break
    return rounds


def _golden_log(f: Callable[[float], float], lo: float, hi: float, iters: int = 14) -> float:
    """Minimiser of a unimodal f on [lo, hi] by golden-section search in log space."""
    g = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = math.log(lo), math.log(hi)
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(math.exp(c)), f(math.exp(d))
    for _ in range(iters):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(math.exp(d))
    best = math.exp(c if fc <= fd else d)
    return best if f(best) <= f(lo) else lo


def solve(spec: ReleaseSpec, *, accountant: str = "basic/1", available: float | None = None,
          fits: FitCheck | None = None) -> Solution:
    """The least-cost split meeting every target of ``spec.accuracy`` (see the module docstring).

    ``available``: the epsilon (under ``accountant``, at the spec's delta) one interval may cost, e.g.
    what remains of the scope's cap, or a cap on the run. ``fits``: a callable deciding whether a run's events
    fit (the CLI passes the ledger's own ``plan``, which knows buckets, rho caps and open reservations). Both
    hold when both are given. When the least-cost split does not fit, the split that fits with the smallest
    largest relative shortfall is returned (``balanced_shares``).
    """
    if spec.accuracy is None:
        raise InvalidParameter(f"{spec.source}: the spec declares no accuracy targets (add an accuracy: section)")
    shares = declared_shares(spec)
    keys = list(dict.fromkeys(target_key(t) for t in spec.accuracy.targets))
    unknown = [k for k in keys if k not in shares]
    if unknown:
        raise InvalidParameter(f"{spec.source}: accuracy targets name {unknown}, which are not split keys")
    declared = dict(shares)
    unreachable_keys: set[str] = set()
    pairs = _coupled_pairs(spec, keys)
    rounds = _gauss_seidel(spec, shares, keys, unreachable_keys, pairs)
    # A mean/variance that reuses the count metric's noisy vector trades its own share against the
    # count's: search the count's share (log scale, golden section) for the least total.
    for metric_key, count_key in pairs.items():
        lo_c = shares[count_key]

        def total(c: float, count_key: str = count_key, metric_key: str = metric_key) -> float:
            trial = dict(shares)
            trial[count_key] = c
            s = least_share(spec, trial, metric_key)
            return math.inf if s is None else c + s

        best_c = _golden_log(total, lo_c, lo_c * 1e2)
        if total(best_c) < total(lo_c):
            shares[count_key] = best_c
            unreachable_keys.discard(metric_key)
            rounds += _gauss_seidel(spec, shares, keys, unreachable_keys, pairs, floor={count_key: best_c})
    for k in unreachable_keys:
        shares[k] = declared[k]  # do not spend on a target no share can meet; report it instead
    # Coupled targets can leave a key a hair short after the others moved: nudge up until verified.
    for _ in range(50):
        results = evaluate(plan_for(spec, shares), spec.accuracy)
        short = {r.metric for r in results if not r.met} - unreachable_keys
        if not short:
            break
        for k in short:
            shares[k] *= 1.0 + 10 * REL_TOL
    plan = plan_for(spec, shares)
    results = evaluate(plan, spec.accuracy)
    unreachable = [r.index for r in results if not r.met and r.metric in unreachable_keys]
    limited_by = None

    def affordable(sh: dict[str, float]) -> bool:
        # the whole interval: the release and its bounds: estimate estimation (issue 25 item 7e); both limits hold
        # when both are given (the ledger's remaining budget and a cap on the run)
        if fits is not None and not fits(interval_events(spec, sh)):
            return False
        if available is not None:
            return interval_cost(spec, sh, accountant) <= available * (1.0 + 1e-12)
        return True

    if not affordable(shares):
        limited_by = "budget"
        floor = {**shares, **{k: MIN_SHARE for k in keys}}
        if not affordable(floor):
            raise InvalidParameter(f"{spec.source}: even with the targeted metrics at epsilon {MIN_SHARE:g} the run "
                                   "does not fit the budget: the untargeted metrics' declared shares alone exceed it")
        active = [k for k in keys if k not in unreachable_keys]
        shares, extra = balanced_shares(spec, shares, active, pairs, affordable, floor)
        rounds += extra
        plan = plan_for(spec, shares)
        results = evaluate(plan, spec.accuracy)
    feasible = all(r.met for r in results)
    solved = spec_for(spec, shares)
    patch = rounded_split(spec, shares, results, up=limited_by is None, affordable=affordable)
    return Solution(feasible=feasible, epsilon=float(solved.budget.epsilon), split=dict(shares),
                    accountant=accountant, cost=interval_cost(spec, shares, accountant), targets=results,
                    unreachable=unreachable, limited_by=limited_by, available=available, rounds=rounds, spec=solved,
                    patch_epsilon=patch[0] if patch else None, patch_split=patch[1] if patch else None,
                    max_shortfall=max_shortfall(results))


def max_shortfall(results: Sequence[TargetResult]) -> float:
    """The largest relative shortfall of ``results`` (0 when every target is met)."""
    return max([0.0, *(r.shortfall for r in results)])


def relaxed(spec: ReleaseSpec, level: float) -> ReleaseSpec:
    """``spec`` with every accuracy target relaxed to a shortfall of ``level``: an error or rank-error bound times
    1 + level, a probability times 1 - level (at least 0). Used only to search; targets are never judged by it."""
    from dpops.spec import ErrorTarget, RankTarget

    acc = spec.accuracy
    assert acc is not None
    targets = []
    for t in acc.targets:
        update: dict[str, float]
        if isinstance(t, ErrorTarget):
            update = {f: float(v) * (1.0 + level) for f in ("max_error", "max_relative_error")
                      if (v := getattr(t, f)) is not None}
        elif isinstance(t, RankTarget):
            update = {"max_rank_error": float(t.max_rank_error) * (1.0 + level)}
        else:
            update = {"min_probability": float(t.min_probability) * max(0.0, 1.0 - level)}
        targets.append(t.model_copy(update=update))
    return spec.model_copy(update={"accuracy": acc.model_copy(update={"targets": targets})})


MAX_SHORTFALL_LEVEL = 1e6  # beyond this relaxation every share is at MIN_SHARE anyway
# On 1 + level: the largest shortfall is minimised to within 0.1% of 1 + shortfall; each relaxed least share to
# SHORTFALL_SHARE_TOL. Every evaluation plans the whole release; the selection's keep table, the slow part at a
# small epsilon, is built once per share (``dpops.release_plan.partition_selection``): the kind of case (a
# keep, a count and a quantile target at 50% of the budget) solves in 1.8 s, 103 s without that cache. No privacy
# property depends on these tolerances: the split returned is planned and checked like any other.
SHORTFALL_REL_TOL = 1e-3
SHORTFALL_SHARE_TOL = 1e-4
SHORTFALL_ROUNDS = MAX_ROUNDS


def balanced_shares(spec: ReleaseSpec, shares: dict[str, float], keys: list[str], pairs: dict[str, str],
                    affordable: Callable[[dict[str, float]], bool], floor: dict[str, float]
                    ) -> tuple[dict[str, float], int]:
    """The fitting split that minimises the largest relative shortfall (module docstring): the least shares for
    targets relaxed by a level s, with s bisected (on 1 + s, to ``SHORTFALL_REL_TOL``) to the least that fits.
    Keys outside ``keys`` keep their share. Returns the shares and the Gauss-Seidel rounds spent."""
    rounds = 0

    def at(level: float, start: dict[str, float]) -> dict[str, float]:
        nonlocal rounds
        trial = dict(start)
        rounds += _gauss_seidel(relaxed(spec, level), trial, keys, set(), pairs, rel_tol=SHORTFALL_SHARE_TOL,
                                max_rounds=SHORTFALL_ROUNDS)
        return trial

    lo, hi = 0.0, 0.05
    best = at(hi, shares)
    while not affordable(best):
        lo, hi = hi, hi * 4
        if hi > MAX_SHORTFALL_LEVEL:
            return dict(floor), rounds
        best = at(hi, best)
    while (1.0 + hi) > (1.0 + lo) * (1.0 + SHORTFALL_REL_TOL):
        mid = math.sqrt((1.0 + lo) * (1.0 + hi)) - 1.0
        trial = at(mid, best)
        if affordable(trial):
            hi, best = mid, trial
        else:
            lo = mid
    return best, rounds


def _round_share(value: float, digits: int, up: bool) -> float:
    from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal

    d = Decimal(repr(float(value)))
    step = Decimal(1).scaleb(d.adjusted() - digits + 1)
    r = d.quantize(step, rounding=ROUND_CEILING if up else ROUND_FLOOR)
    return float(r if r > 0 else step)


def rounded_split(spec: ReleaseSpec, shares: dict[str, float], results: Sequence[TargetResult], *, up: bool,
                  affordable: Callable[[dict[str, float]], bool]) -> tuple[float, dict[str, float]] | None:
    """(epsilon, split) with each share rounded to ``PATCH_DIGITS`` significant digits (more when needed), up when
    ``up`` (the split meets what it meets: rounding up keeps it) else down (it was limited by the budget: rounding
    down keeps it fitting), checked against the real plan: every target ``results`` met is still met and the
    split still fits. None when no rounding up to 12 digits passes (then the exact split is the patch)."""
    from decimal import Decimal

    from dpops.release_plan import plan_release

    met = {r.index for r in results if r.met}
    assert spec.accuracy is not None
    for digits in range(PATCH_DIGITS, 13):
        split = {k: _round_share(v, digits, up) for k, v in shares.items()}
        epsilon = float(sum(Decimal(repr(v)) for v in split.values()))
        try:
            check = evaluate(plan_release(spec.with_budget(epsilon, split)), spec.accuracy)
        except (InvalidParameter, OverflowError):
            continue
        if met <= {r.index for r in check if r.met} and affordable(split):
            return epsilon, split
    return None


__all__ = ["Solution", "solve", "least_share", "declared_shares", "spec_for", "plan_for", "run_cost",
           "interval_events", "interval_cost", "relaxed", "balanced_shares", "rounded_split", "max_shortfall",
           "MIN_SHARE", "MAX_SHARE", "PATCH_SCHEMA", "PATCH_DIGITS"]
