"""The auditor's statistics, its harness over the pipeline functions, and the ``dpops audit`` CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dpops.audit.stats import Event, candidate_events, cp_lower, cp_upper, epsilon_from_counts, held_out_bound
from dpops.cli.main import main
from dpops.errors import InvalidParameter


# ---------------------------------------------------------------- Clopper–Pearson
def test_clopper_pearson_closed_forms():
    n, a = 1000, 0.01
    assert cp_upper(0, n, a) == pytest.approx(1 - a ** (1 / n), rel=1e-9)  # (1 - p)^n = a
    assert cp_lower(n, n, a) == pytest.approx(a ** (1 / n), rel=1e-9)  # p^n = a
    assert cp_lower(0, n, a) == 0.0 and cp_upper(n, n, a) == 1.0
    lo, hi = cp_lower(300, n, a), cp_upper(300, n, a)
    assert lo < 0.3 < hi and hi - lo < 0.08


def test_clopper_pearson_refuses_bad_counts():
    with pytest.raises(InvalidParameter):
        cp_lower(5, 4, 0.05)
    with pytest.raises(InvalidParameter):
        cp_upper(0, 0, 0.05)


def test_epsilon_from_counts_subtracts_delta():
    e0 = epsilon_from_counts(500, 1000, 100, 1000, 0.0, 0.05)
    e1 = epsilon_from_counts(500, 1000, 100, 1000, 0.1, 0.05)
    assert 0 < e1 < e0 < math.log(5)
    assert epsilon_from_counts(10, 1000, 10, 1000, 0.5, 0.05) == -math.inf


def test_events_error_outcome_and_categories():
    s = np.array([0.0, 1.0, np.nan, 1.0])
    assert Event("error").indicator(s).tolist() == [False, False, True, False]
    assert Event(">=", 1.0).indicator(s).tolist() == [False, True, False, True]
    ops = {e.op for e in candidate_events(s[:2], s[2:])}
    assert ops == {"error", "==", ">=", "<="}


def _randomized_response(eps: float, n: int, rng: np.random.Generator):
    p = math.exp(eps) / (1 + math.exp(eps))
    return (rng.random(n) < 1 - p).astype(float), (rng.random(n) < p).astype(float)


def test_held_out_bound_is_sound_and_has_power():
    """Randomized response with known ε = 1: the bound holds at its confidence and is nearly tight.

    Soundness: 100 repetitions at confidence 0.9; P(bound > ε) <= 0.1 per repetition, so more than
    25 exceedances has probability < 1e-5 under a correct bound (binomial tail).
    """
    rng = np.random.default_rng(20240601)
    over = 0
    for _ in range(100):
        s0, s1 = _randomized_response(1.0, 400, rng)
        over += held_out_bound(s0, s1, 0.0, 0.1).epsilon_lb > 1.0
    assert over <= 25
    s0, s1 = _randomized_response(1.0, 40000, rng)
    b = held_out_bound(s0, s1, 0.0, 0.01)
    assert 0.85 < b.epsilon_lb <= 1.0  # power: 20000 held-out trials per side get within 15%
    s0, s1 = _randomized_response(2.0, 4000, rng)
    assert held_out_bound(s0, s1, 0.0, 0.01).epsilon_lb > 1.0  # a 2x larger ε is visible at CI size


def test_held_out_bound_needs_trials():
    with pytest.raises(InvalidParameter):
        held_out_bound(np.zeros(2), np.zeros(2), 0.0, 0.01)


# ---------------------------------------------------------------- the harness runs the pipeline functions
def test_harness_counts_are_exact_before_noise(monkeypatch):
    """With the noise switched off, the harness output is the bounded true count: L0 and Linf hold."""
    import pipelines.aggregate as aggregate

    from dpops.audit.harness import Harness
    from dpops.audit.scenarios import ScenarioBuilder
    from dpops.audit.suite import mechanism_spec
    from dpops.noise.randomness import test_random
    from dpops.release_plan import plan_release

    monkeypatch.setattr("dpops.noise.mechanisms.add_noise", lambda values, params, rng: np.asarray(values))
    spec = mechanism_spec("count", l0=2, linf=3)
    h = Harness(spec, plan_release(spec))
    at, over = ScenarioBuilder(h).metric("count")
    for sc in (at, over):
        cols = h.run(sc.rows(1, 5), 5 * sc.n_parts, test_random(1, ("t",)))
        s = sc.statistic(cols, 5)[:, 0]  # column 0: the sum over the group's partitions
        assert np.all(s == 2 * 3), (sc.name, s)  # the unit counts L0 * Linf rows, never more
        assert np.all(sc.statistic(h.run(sc.rows(0, 5), 5 * sc.n_parts, test_random(2, ("t",))), 5) == 0)
    assert aggregate  # imported: the harness really goes through pipelines.aggregate


# ---------------------------------------------------------------- CLI
def test_cli_mechanisms_json(capsys):
    rc = main(["audit", "mechanisms", "--mechanism", "count", "--mechanism", "unit_count", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert [r["target"] for r in out] == ["count", "unit_count"]
    assert all(r["passed"] and 0.5 < r["epsilon_lb"] <= r["claimed_epsilon"] for r in out)


def test_cli_fails_with_exit_7_on_a_bug(monkeypatch, capsys):
    from dpops.noise import mechanisms
    from dpops.noise.samplers import discrete_laplace_param
    import dataclasses

    real = mechanisms.laplace_mechanism

    def quarter_scale(*a, **kw):
        p = real(*a, **kw)
        return dataclasses.replace(p, lattice=discrete_laplace_param(p.lattice.scale / 4))

    monkeypatch.setattr(mechanisms, "laplace_mechanism", quarter_scale)
    rc = main(["audit", "mechanisms", "--mechanism", "count"])
    captured = capsys.readouterr()
    assert rc == 7
    assert "FAIL" in captured.out and "audit FAILED for count" in captured.err


def test_cli_spec_audit_of_an_example(tmp_path, capsys):
    """A replace-adjacency Gaussian release with private partitions: the count metric, at its share."""
    rc = main(["audit", "spec", "examples/weekly_visits_private.yaml", "--metric", "count", "--trials", "400",
               "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out
    assert [r["target"] for r in out] == ["count"]
    assert out[0]["passed"] and out[0]["claimed_epsilon"] == pytest.approx(0.25, rel=1e-6)
    assert out[0]["delta"] > 0 and out[0]["trials"] == 400


def test_cli_bad_input_errors(tmp_path, capsys):
    assert main(["audit", "mechanisms", "--mechanism", "nope"]) == 3
    assert "unknown ['nope']" in capsys.readouterr().err
    assert main(["audit", "spec", "examples/daily_purchases.yaml", "--metric", "nope", "--trials", "100"]) == 3
    assert "no metric ['nope']" in capsys.readouterr().err
    assert main(["audit", "spec", str(tmp_path / "missing.yaml")]) == 3
    assert main(["audit", "spec", "examples/daily_purchases.yaml", "--trials", "3"]) == 3


# ---------------------------------------------------------------- end to end through Beam
def test_audit_through_the_beam_pipeline_passes_and_catches_a_halved_scale(monkeypatch):
    """run_release (FnApiRunner) on D and D': one pipeline run gives 1500 trials (groups of partitions)."""
    import dataclasses

    from dpops.noise import mechanisms
    from dpops.audit.pipeline_path import audit_metric_via_pipeline
    from dpops.audit.suite import mechanism_spec
    from dpops.noise.samplers import discrete_laplace_param

    spec = mechanism_spec("count")
    ok = audit_metric_via_pipeline(spec, "count", trials=1500, seed=5)
    assert ok.passed and ok.epsilon_lb > 0.5, ok
    real = mechanisms.laplace_mechanism

    def half(*a, **kw):
        p = real(*a, **kw)
        return dataclasses.replace(p, lattice=discrete_laplace_param(p.lattice.scale / 2))

    monkeypatch.setattr(mechanisms, "laplace_mechanism", half)
    bad = audit_metric_via_pipeline(spec, "count", trials=1500, seed=5)
    assert not bad.passed, bad
