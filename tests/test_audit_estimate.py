"""The empirical auditor on both private bound estimators (issue 20, "Estimation" proof).

``dpops.audit.estimation`` runs ``estimate_rows`` (the code ``dpops estimate`` runs: the release's bounding
and exponential mechanism) on two neighbours, D and D plus one unit built for the largest contrast the
quantile utility allows, and lower-bounds epsilon with ``held_out_bound`` at confidence 0.99: if the
estimator is epsilon-DP, the bound exceeds epsilon with probability at most 1% (the false-failure rate of
the honest tests; the seeds are fixed, so each test's outcome is deterministic). The planted-bug tests run
the same estimator at 3x the claimed epsilon (what an under-declared sensitivity does) and must be caught:
they show the honest tests can fail. Measured (seed 0, 1500 trials per neighbour): contribution 0.094 honest,
1.262 planted; value bounds 0.582 honest, 1.663 planted, against a claim of 1.0. ~5-9 s each.
"""

from __future__ import annotations

import dataclasses

import pytest

from dpops.analysis import estimate as E
from dpops.audit import estimation as A

TRIALS = 1500


def _cases():
    return {
        "contribution": (A.audit_spec(8, 8), E.EstimateConfig(epsilon=1.0, columns=(), max_l0=8, max_linf=8),
                         A.contribution_scenario()),
        "value": (A.audit_spec(2, 2, hi=4.0), E.EstimateConfig(epsilon=1.0, contribution=False),
                  A.value_scenario(2, 2)),
    }


def _overspending(factor: float):
    def run(spec, rows, cfg, rng):
        return E.estimate_rows(spec, rows, dataclasses.replace(cfg, epsilon=cfg.epsilon * factor), rng)
    return run


@pytest.mark.parametrize("target", ["contribution", "value"])
def test_auditor_lower_bound_stays_below_the_charged_epsilon(target):
    spec, cfg, neighbours = _cases()[target]
    res = A.audit_estimator(spec, cfg, neighbours, target=target, trials=TRIALS, confidence=0.99, seed=0)
    assert res.passed and res.epsilon_lb <= cfg.epsilon, res
    # the charged epsilon is what the ledger reserves: the events sum to it (basic composition)
    assert sum(e.epsilon for e in E.events(spec, cfg)) <= cfg.epsilon


@pytest.mark.parametrize("target", ["contribution", "value"])
def test_auditor_catches_an_estimator_spending_more_than_it_charges(target):
    spec, cfg, neighbours = _cases()[target]
    res = A.audit_estimator(spec, cfg, neighbours, target=target, trials=TRIALS, confidence=0.99, seed=0,
                            estimator=_overspending(3.0))
    assert not res.passed and res.epsilon_lb > cfg.epsilon, res
