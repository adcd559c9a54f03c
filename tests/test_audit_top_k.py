"""Issue 11 item 6: the top_k add_remove path runs permute-and-flip at the monotone rate (eps/Delta).

Adding a unit only adds rows (bounding is per unit), so every category count can only grow: the
monotone rate is sound under add_remove, and the audit shows it spends (almost) all of its claim.
Under replace a count can go down as another goes up, so the plan keeps the eps/(2 Delta) rate.
"""

from __future__ import annotations

from dpops.audit.runner import audit_plan
from dpops.audit.suite import audit_target, mechanism_spec


def _audit(trials=4000, **kw):
    spec = mechanism_spec("top_k", **kw)
    (res,) = audit_plan(spec, metrics=[audit_target("top_k")], trials=trials, confidence=0.99, seed=11)
    return res


def test_top_k_add_remove_uses_the_monotone_rate_and_passes_tightly():
    from dpops.release_plan import plan_release

    plan = plan_release(mechanism_spec("top_k"))
    (m,) = [m for m in plan.metrics if m.type == "top_k"]
    assert m.monotonic is True
    res = _audit()
    # at the non-monotone rate the audit could not show more than eps/2 (0.297 measured before)
    assert res.passed and res.epsilon_lb > 0.6, res
    replace = [m for m in plan_release(mechanism_spec("top_k", adjacency="replace")).metrics if m.type == "top_k"]
    assert replace[0].monotonic is False

