"""Drive an audit: sample the statistic on both neighbours, bound ε, compare with the claim."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from dpops.audit.harness import Harness, safe_run
from dpops.audit.scenarios import Scenario, ScenarioBuilder
from dpops.audit.stats import Bound, held_out_bound
from dpops.errors import InvalidParameter, SpecError
from dpops.noise.randomness import test_random

if TYPE_CHECKING:
    from dpops.release_plan import ReleasePlan
    from dpops.spec import ReleaseSpec

MAX_ROWS_PER_CALL = 600_000  # rows pushed through the pipeline functions in one call (memory/latency)
# Automatic trial counts (audit_plan(trials=None)): DEFAULT_TRIALS, fewer where the pipeline works per
# partition in Python (exponential mechanism) and where one trial needs very many rows.
DEFAULT_TRIALS = 4000
SLOW_TRIALS = {"top_k": 2000, "mean": 2000, "variance": 2000, "quantiles": 500}
ROW_BUDGET = 5_000_000  # rows per neighbour and scenario
MIN_AUTO_TRIALS = 200


@dataclass(frozen=True)
class AuditResult:
    """The audit of one target: the claimed ε, the lower bound the samples give and whether the claim held."""

    target: str  # metric key, or "partition_selection"
    mechanism: str  # metric type / selection strategy
    claimed_epsilon: float
    delta: float
    epsilon_lb: float
    trials: int  # per neighbour and scenario
    confidence: float
    scenario: str  # the scenario that gave the bound
    event: str
    passed: bool
    seconds: float

    def to_dict(self) -> dict:
        """JSON form (all fields)."""
        return asdict(self)


def sample_statistic(h: Harness, sc: Scenario, world: int, trials: int, seed: int, label: str) -> np.ndarray:
    """The statistics (one row per trial) of ``trials`` independent trials on one neighbour (NaN: the run failed)."""
    rows_per_group = max(1, sc.rows(world, 1).unit.size)
    chunk = max(1, min(trials, MAX_ROWS_PER_CALL // rows_per_group))
    out = None
    for c, start in enumerate(range(0, trials, chunk)):
        t = min(chunk, trials - start)
        rng = test_random(seed, ("audit", label, sc.name, world, c))
        cols = safe_run(h, sc.rows(world, t), t * sc.n_parts, rng)
        if out is None:
            out = np.full((trials, 1 if sc.n_parts == 1 else 2), np.nan)
        if not isinstance(cols, Exception):
            out[start:start + t] = sc.statistic(cols, t)
            continue
        # The batch failed: find out, trial by trial, which trials fail (each one is an outcome).
        for i in range(t):
            rng_i = test_random(seed, ("audit", label, sc.name, world, c, i))
            cols_i = safe_run(h, sc.rows(world, 1), sc.n_parts, rng_i)
            out[start + i] = np.nan if isinstance(cols_i, Exception) else sc.statistic(cols_i, 1)[0]
    assert out is not None
    return out


def audit_scenarios(h: Harness, scenarios: list[Scenario], *, target: str, mechanism: str, claimed_epsilon: float,
                    delta: float, trials: int, confidence: float, seed: int) -> AuditResult:
    """Bound ε for every scenario at confidence 1 − α/S (Bonferroni over the S scenarios); keep the largest."""
    if not (0 < confidence < 1):
        raise InvalidParameter(f"confidence must be in (0, 1), got {confidence!r}")
    if not isinstance(trials, int) or trials < 8:
        raise InvalidParameter(f"trials must be an integer >= 8, got {trials!r}")
    t0 = time.time()
    alpha = (1.0 - confidence) / max(1, len(scenarios))
    best: tuple[Bound, str] | None = None
    for sc in scenarios:
        s_d = sample_statistic(h, sc, 0, trials, seed, target)
        s_dp = sample_statistic(h, sc, 1, trials, seed, target)
        b = held_out_bound(s_d, s_dp, delta, alpha)
        if best is None or b.epsilon_lb > best[0].epsilon_lb:
            best = (b, sc.name)
    assert best is not None, "audit_scenarios needs at least one scenario"
    b, name = best
    return AuditResult(target=target, mechanism=mechanism, claimed_epsilon=claimed_epsilon, delta=delta,
                       epsilon_lb=b.epsilon_lb, trials=trials, confidence=confidence, scenario=name, event=b.event,
                       passed=b.epsilon_lb <= claimed_epsilon, seconds=round(time.time() - t0, 2))


def auto_trials(kind: str, scenarios: list[Scenario]) -> int:
    rows = max(max(1, sc.rows(w, 1).unit.size) for sc in scenarios for w in (0, 1))
    return max(MIN_AUTO_TRIALS, min(SLOW_TRIALS.get(kind, DEFAULT_TRIALS), ROW_BUDGET // rows))


def audit_plan(spec: ReleaseSpec, plan: ReleasePlan | None = None, *, metrics: list[str] | None = None,
               trials: int | None = None, confidence: float = 0.99, seed: int = 0) -> list[AuditResult]:
    """Audit each metric of a release plan (and its partition selection) against its share of the budget.

    Claimed ε of a metric = its share in the plan (plus the share of a count metric whose noisy
    vector it reuses). Metrics are audited over fixed partitions; private partition selection is
    audited on its own against its (ε, δ).
    """
    from dpops.release_plan import PARTITION_SELECTION_KEY, partition_selection, plan_release

    # An audit tests the mechanisms as the code builds them now: plans share one partition selection per public
    # parameters (an lru_cache for the solver), and one built earlier in this process (before a planted bug, a
    # reload, a patched table) must not stand in for the selection under audit.
    partition_selection.cache_clear()
    plan = plan if plan is not None else plan_release(spec)
    keys = [m.key for m in plan.metrics]
    if plan.partition_selection is not None:
        keys.append(PARTITION_SELECTION_KEY)
    wanted = metrics or keys
    unknown = [k for k in wanted if k not in keys]
    if unknown:
        raise SpecError(f"{spec.source}: no metric {unknown} in this release; metrics are {keys}")
    ps_eps = ps_delta = 0.0
    if plan.partition_selection_event is not None:
        ps_eps = float(plan.partition_selection_event.epsilon)
        ps_delta = float(plan.partition_selection_event.delta)
    results = []
    for key in wanted:
        # Only the audited metric is computed: every metric draws its noise from its own child
        # stream, so its output does not depend on the others (and top_k/quantiles are slow).
        # A mean/variance that reuses a count metric's noisy vector depends on it: keep both, claim both.
        m = next((x for x in plan.metrics if x.key == key), None)
        deps = {key} | ({m.count_from} if m is not None and getattr(m, "count_from", None) else set())
        only = tuple(x for x in plan.metrics if x.key in deps) or plan.metrics[:1]
        if key == PARTITION_SELECTION_KEY:
            sub = dataclasses.replace(plan, metrics=only)
        else:
            # A metric is audited over fixed partitions: its noise is drawn independently of the
            # selection, which is audited (and charged) on its own.
            sub = dataclasses.replace(plan, metrics=only, partition_selection=None, partition_selection_event=None,
                                      public_partitions=plan.public_partitions or (("audit",),))
        h = Harness(spec, sub)
        sb = ScenarioBuilder(h)
        if key == PARTITION_SELECTION_KEY:
            assert plan.partition_selection is not None  # the key is offered only when there is one
            scen = sb.partition_selection(trials or DEFAULT_TRIALS)
            n = trials or auto_trials(key, scen)
            results.append(audit_scenarios(
                h, scen, target=key, mechanism=plan.partition_selection.strategy,
                claimed_epsilon=ps_eps, delta=ps_delta, trials=n, confidence=confidence, seed=seed))
            continue
        assert m is not None  # every other wanted key is a metric key (checked above)
        scen = sb.metric(key)
        n = trials or auto_trials(m.type, scen)
        results.append(audit_scenarios(
            h, scen, target=key, mechanism=m.type,
            claimed_epsilon=sum(float(x.epsilon) for x in only),
            delta=sum(float(x.delta) for x in only), trials=n, confidence=confidence, seed=seed))
    return results


__all__ = ["AuditResult", "sample_statistic", "audit_scenarios", "audit_plan"]
