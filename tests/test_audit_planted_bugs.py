"""Planted privacy bugs: the auditor must FAIL each one and PASS the correct code.

Each bug is a monkeypatch of the real code (or a small variant built from it), so the audit runs
the same planning, row checks, bounding, selection and noise as a release. Claimed ε is 1 per
mechanism; a bug that doubles the true ε is detected with high power at these trial counts
(measured power in docs/audit.md). The confidence level of every bound is 0.99: with correct
code a single audit fails falsely with probability <= 1%; the seeds here are fixed, so the
outcome is deterministic.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dpops.audit.key_reuse import audit_key_reuse
from dpops.audit.runner import audit_plan
from dpops.audit.suite import audit_target, mechanism_spec

TRIALS = 4000
CONF = 0.99


def _audit(name: str, trials: int = TRIALS, **spec_kw):
    spec = mechanism_spec(name, **spec_kw)
    (res,) = audit_plan(spec, metrics=[audit_target(name)], trials=trials, confidence=CONF, seed=11)
    return res


# ---------------------------------------------------------------- correct code passes, tightly
@pytest.mark.parametrize("name", ["count", "sum", "mean", "unit_count", "partition_selection"])
def test_correct_code_passes_with_a_tight_bound(name):
    res = _audit(name)
    assert res.passed, res
    # the audit is not vacuous: at least half the claim is demonstrated as really spent
    assert res.epsilon_lb > 0.5 * res.claimed_epsilon, res


def test_correct_replace_count_passes():
    res = _audit("count", adjacency="replace")
    assert res.passed and res.epsilon_lb > 0.3, res


# ---------------------------------------------------------------- planted bugs fail
def test_replace_release_noised_with_add_remove_sensitivity_fails(monkeypatch):
    from dpops.noise import sensitivity

    real = sensitivity.count

    def add_remove_count(b):  # BUG: ignores that a replacement touches 2·L0 partitions
        return real(dataclasses.replace(b, adjacency="add_remove"))

    monkeypatch.setattr(sensitivity, "count", add_remove_count)
    res = _audit("count", adjacency="replace")
    assert not res.passed, res


def test_l0_bounding_skipped_fails(monkeypatch):
    import pipelines.bounding as bounding

    real = bounding.bound_contributions

    def no_l0(u, p, prio, l0, linf, *pair_prio):  # BUG: a unit keeps all its partitions
        return real(u, p, prio, 10**9, linf, *pair_prio)

    monkeypatch.setattr(bounding, "bound_contributions", no_l0)
    res = _audit("count")
    assert not res.passed and res.scenario == "over_bounds", res


def test_linf_bounding_skipped_fails(monkeypatch):
    import pipelines.bounding as bounding

    real = bounding.bound_contributions
    monkeypatch.setattr(bounding, "bound_contributions",
                        lambda u, p, prio, l0, linf, *pair_prio: real(u, p, prio, l0, 10**9, *pair_prio))
    res = _audit("sum")
    assert not res.passed and res.scenario == "over_bounds", res


def test_nan_passing_the_clamp_fails(monkeypatch):
    import pipelines.io as io

    real = io._mark

    def keep_bad_values(drop, mask, reason):  # BUG: NaN/inf rows are not dropped before clamping
        if reason != "bad_value":
            real(drop, mask, reason)

    monkeypatch.setattr(io, "_mark", keep_bad_values)
    # Exact fixed-point sums bound every term, a NaN included (pipelines.bounding): the leaked
    # NaN rows cost nothing, and the audit still shows the claim holds.
    res = _audit("sum", trials=600)
    assert res.passed, res
    # A sum path that aborts on NaN (as the float64 path did in the noise step) fails exactly
    # when the unit is present: a data-dependent abort is an observable event.
    import pipelines.bounding as bounding

    real_terms = bounding.fixed_point_terms

    def abort_on_nan(x, *a):
        if np.isnan(x).any():
            raise ValueError("NaN in a sum")
        return real_terms(x, *a)

    monkeypatch.setattr(bounding, "fixed_point_terms", abort_on_nan)
    res = _audit("sum", trials=600)
    assert not res.passed and res.event.startswith("run failed"), res


def test_laplace_scale_off_by_two_fails(monkeypatch):
    from dpops.noise import mechanisms
    from dpops.noise.samplers import discrete_laplace_param

    real = mechanisms.laplace_mechanism

    def half_scale(*a, **kw):  # BUG: samples with half the recorded scale
        p = real(*a, **kw)
        return dataclasses.replace(p, lattice=discrete_laplace_param(p.lattice.scale / 2))

    monkeypatch.setattr(mechanisms, "laplace_mechanism", half_scale)
    res = _audit("count")
    assert not res.passed and res.epsilon_lb > 1.2, res


def test_partition_selection_threshold_without_delta_fails(monkeypatch):
    from dpops.noise import selection

    assert _audit("partition_selection", strategy="laplace_threshold").passed
    # BUG: threshold T = 1 (keep iff n + noise >= 1) ignores delta: a lone unit's partition shows up
    monkeypatch.setattr(selection, "_threshold", lambda tail, delta_pp, scale: 1)
    res = _audit("partition_selection", strategy="laplace_threshold")
    assert not res.passed and res.scenario == "n0=0", res


def test_truncated_geometric_with_inflated_delta_fails(monkeypatch):
    from dpops.noise import selection

    real = selection._truncated_geometric_table
    monkeypatch.setattr(selection, "_truncated_geometric_table", lambda eps, delta: real(eps, min(0.5, delta * 1e4)))
    res = _audit("partition_selection")
    assert not res.passed, res


def test_key_reused_on_changed_input_fails(monkeypatch):
    ok = audit_key_reuse(trials=2000, confidence=CONF, seed=3)
    assert ok.passed, ok
    from dpops.release import RunContext

    real = RunContext.noise_label.fget
    # BUG: the run label forgets the input fingerprint: a restatement reuses the original noise
    monkeypatch.setattr(RunContext, "noise_label",
                        property(lambda self: {k: v for k, v in real(self).items() if k != "input_fingerprint"}))
    res = audit_key_reuse(trials=2000, confidence=CONF, seed=3)
    assert not res.passed and res.epsilon_lb > 4, res
    assert "==" in res.event  # the difference of the two releases is exact


def test_top_k_and_quantiles_pass_and_an_overspending_top_k_fails(monkeypatch):
    assert _audit("top_k", trials=2000).passed
    assert _audit("quantiles", trials=200).passed
    from dpops.noise import selection

    real = selection.top_k
    # BUG: top_k runs with 4x the epsilon it is charged (e.g. the eps/k split applied twice the wrong way)
    monkeypatch.setattr(selection, "top_k", lambda u, k, eps, sens, rng, monotonic=False: real(u, k, 4 * eps, sens, rng,
                                                                                               monotonic=monotonic))
    res = _audit("top_k", trials=2000)
    assert not res.passed, res
