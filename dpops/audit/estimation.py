"""Audit the private bound estimators (``dpops.analysis.estimate``) on neighbouring datasets.

The estimators run exactly as ``dpops estimate`` runs them: ``estimate_rows`` over checked, hashed rows
(the shape ``pipelines.io.prepare_batch`` returns), with the release's own bounding and exponential
mechanism and a seeded randomness source per trial. Each scenario is a pair of neighbours under
add/remove: D, and D plus one target unit built to move the estimate as far as a unit can (it owns the
most items the lemma allows: one per-unit value for L0/Linf, L0*Linf rows for the value bounds). The
statistic is the estimator's output (one column per estimated bound); ``held_out_bound`` chooses an
output event on half the trials and bounds epsilon on the other half (``dpops.audit.stats``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from dpops.audit.runner import AuditResult
from dpops.audit.stats import held_out_bound
from dpops.noise.randomness import test_random

if TYPE_CHECKING:
    from dpops.analysis.estimate import Estimate, EstimateConfig
    from dpops.spec import ReleaseSpec

Rows = dict[str, np.ndarray]
Estimator = Callable[["ReleaseSpec", Rows, "EstimateConfig", object], "Estimate"]


def audit_spec(l0: int, linf: int, lower: float = 0.0, hi: float = 1.0) -> ReleaseSpec:
    """A spec with one bounded column ``amount`` ([lower, hi]) and the declared contribution bounds (the
    declared values anchor the estimators' public tail preference: declaring the largest candidates turns it off)."""
    from dpops.spec import parse_spec

    return parse_spec({"name": "audit_estimate",
                       "input": {"path": "x.parquet", "format": "parquet",
                                 "columns": {"user_id": "string", "region": "string", "amount": "float"}},
                       "privacy_unit": {"column": "user_id", "description": "audited unit", "adjacency": "add_remove"},
                       "budget": {"scope": "audit", "epsilon": 1.0},
                       "contribution": {"max_partitions_per_unit": l0, "max_rows_per_unit_per_partition": linf},
                       "partitions": {"columns": ["region"], "public": [f"r{i}" for i in range(64)]},
                       "metrics": [{"type": "sum", "column": "amount", "bounds": [lower, hi]}]}, source="audit")


def rows_of(unit: np.ndarray, part: np.ndarray, value: np.ndarray, seed: int) -> Rows:
    """Rows in ``prepare_batch``'s form: unit/partition hashes, Linf priorities, salted pair priorities."""
    from pipelines.bounding import pair_priority

    g = np.random.default_rng(seed)
    u = (np.asarray(unit, np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    p = (np.asarray(part, np.uint64) + np.uint64(1)) * np.uint64(0xC2B2AE3D27D4EB4F)
    return {"u": u, "p": p, "prio": g.integers(0, 2**63, u.size, dtype=np.int64).astype(np.uint64),
            "pp": pair_priority(u, p, (int(g.integers(0, 2**62)), 7)),
            "v:amount": np.asarray(value, np.float64)}


def contribution_scenario() -> tuple[Rows, Rows]:
    """D: 98 units with one row in one partition and 2 with three rows in each of three partitions; D'
    adds a unit with 16 rows in each of 16 partitions (above every candidate of ``max_l0 = max_linf = 8``).

    At the 0.99 quantile, D's utility S r(k) - Q n changes sign between k = 2 and k = 3, and the added
    unit moves it by -Q everywhere: the candidates below the quantile lose Q and those above it gain Q,
    a contrast of 2Q (nearly twice the sensitivity S), the most one unit can make."""
    unit = list(range(98)) + [98] * 9 + [99] * 9
    part = [0] * 98 + [0, 0, 0, 1, 1, 1, 2, 2, 2] * 2
    tu = np.repeat(100, 256)
    tp = np.repeat(np.arange(16), 16)
    d = rows_of(np.asarray(unit), np.asarray(part), np.zeros(len(unit)), 2)
    dp = rows_of(np.r_[unit, tu], np.r_[part, tp], np.zeros(len(unit) + tu.size), 2)
    return d, dp


def value_scenario(l0: int, linf: int) -> tuple[Rows, Rows]:
    """D: 788 units with one row of value 1, 8 with value 4 and 4 with value 16; D' adds a unit with l0*linf
    = 4 rows (the most one unit keeps after bounding) of value 2**20. Use with declared bounds [0, 4].

    At the 0.99 quantile D's utility S r(c) - Q n is -4 S just below 4 and +4 S from 4 on, so the two sides
    carry similar mass; the added rows move it by -Q m below 4 and +Q m from 4 to 2**20 (contrast 2 Q m,
    nearly twice the sensitivity S m), the most one unit can make."""
    m = l0 * linf
    v = np.r_[np.ones(788), np.full(8, 4.0), np.full(4, 16.0)]
    d = rows_of(np.arange(800), np.zeros(800), v, 3)
    tu = np.repeat(800, m)
    tp = np.repeat(np.arange(l0), linf)
    dp = rows_of(np.r_[np.arange(800), tu], np.r_[np.zeros(800), tp], np.r_[v, np.full(m, 2.0**20)], 3)
    return d, dp


def _statistic(est: Estimate) -> list[float]:
    r = est.result()
    out = [float(r[k]) for k in ("max_partitions_per_unit", "max_rows_per_unit_per_partition") if r[k] is not None]
    for _, (lo, hi) in sorted(est.bounds.items()):
        out += [lo, hi]
    return out


def audit_estimator(spec: ReleaseSpec, config: EstimateConfig, neighbours: tuple[Rows, Rows], *, target: str,
                    trials: int = 1500, confidence: float = 0.99, seed: int = 0,
                    estimator: Estimator | None = None) -> AuditResult:
    """Lower-bound the estimator's epsilon on one pair of neighbours (``held_out_bound`` at ``confidence``).

    ``estimator``: ``estimate_rows`` (default) or a planted-bug variant, to show the audit can fail."""
    from dpops.analysis.estimate import estimate_rows

    fn = estimator or estimate_rows
    t0 = time.time()
    stats = []
    for world, rows in enumerate(neighbours):
        s = np.asarray([_statistic(fn(spec, rows, config, test_random(seed, ("audit-estimate", target, world, t))))
                        for t in range(trials)])
        stats.append(s)
    b = held_out_bound(stats[0], stats[1], 0.0, 1.0 - confidence)
    eps = float(config.epsilon)
    return AuditResult(target=target, mechanism="estimate/quantile_exponential_mechanism", claimed_epsilon=eps,
                       delta=0.0, epsilon_lb=b.epsilon_lb, trials=trials, confidence=confidence,
                       scenario=f"{target}: D vs D plus one extreme unit", event=b.event, passed=b.epsilon_lb <= eps,
                       seconds=round(time.time() - t0, 2))


__all__ = ["audit_estimator", "audit_spec", "contribution_scenario", "value_scenario", "rows_of"]
