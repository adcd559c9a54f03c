"""The auditor's float-sum attack case (issue 11 item 4): exact sums keep each attack within the
charged sensitivity; a float64 running sum (the old accumulation, planted back) is caught."""

from __future__ import annotations

import json

import numpy as np
import pytest

import pipelines.bounding as bounding
from dpops.audit.float_sums import CASES, attack_rows, attack_spec, audit_float_sums
from dpops.cli.main import main


def _float_running_sum(pidx, k, n_parts):
    """The pre-fix accumulation: float64 sums in row order (np.bincount), here in grid units."""
    return np.bincount(pidx, weights=k.astype(np.float64), minlength=n_parts).astype(np.int64)


def test_attack_rows_are_neighbours():
    for case in CASES:
        d, dp = attack_rows(case, 0, n=8), attack_rows(case, 1, n=8)
        assert dp.unit.size == d.unit.size + 1 and 0 in dp.unit.tolist() and 0 not in d.unit.tolist()
        assert len(set(dp.unit.tolist())) == dp.unit.size  # one row per unit: L0 = Linf = 1 holds
        r0, r1 = attack_rows(case, 0, "replace", n=8), attack_rows(case, 1, "replace", n=8)
        assert (r0.unit != r1.unit).sum() == 1 and (r0.value != r1.value).sum() == 1
        lo, hi = attack_spec(case).metrics[0].bounds
        assert ((lo <= d.value) & (d.value <= hi)).all()  # inside the bounds: clamping plays no part


@pytest.mark.parametrize("case", ["mean", "variance"])
def test_exact_sums_hold_the_charge_under_the_attack(case):
    results = audit_float_sums([case])
    assert results and all(r.passed for r in results), results
    for r in results:
        assert r.epsilon_lb <= r.claimed_epsilon and r.confidence == 1.0
    # the audited vector really moved by the target's whole contribution: 1024 of 1025 steps
    moved = [r for r in results if r.epsilon_lb > 0]
    assert moved and all(r.event == "lattice difference 1024 vs charged 1025" for r in moved)


def test_cli_runs_the_sum_case(capsys):
    rc = main(["audit", "mechanisms", "--mechanism", "float_sum", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out
    assert [r["target"] for r in out] == ["sum_amount/sum"]
    assert out[0]["passed"] and out[0]["event"] == "lattice difference 1024 vs charged 1025"
    assert 0.99 * out[0]["claimed_epsilon"] < out[0]["epsilon_lb"] <= out[0]["claimed_epsilon"]


def test_float_running_sum_is_caught(monkeypatch, capsys):
    monkeypatch.setattr(bounding, "exact_group_sum", _float_running_sum)
    (res,) = audit_float_sums(["sum"])
    assert not res.passed and res.event == "lattice difference 1026 vs charged 1025"
    assert res.epsilon_lb > res.claimed_epsilon
