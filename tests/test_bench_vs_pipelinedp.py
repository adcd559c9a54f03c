"""The dpops side of benchmarks/bench_vs_pipelinedp_analysis.py (no PipelineDP needed).

The PipelineDP comparison itself is a benchmark (it needs its own virtualenv); these tests pin what
the benchmark reads from dpops, so a drift between the benchmark and dpops' own predictions or
bounding cannot go unnoticed: the std it compares is ``dpops.analysis.plan``'s, its discrete-Laplace
closed form and continuous Gaussian formula match the plan's noise, and its drop shares measured on
``pipelines.bounding.bound_contributions`` equal the exact shares from contribution counts.
Deterministic (fixed seeds, no sampling tolerance).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from dpops import analysis

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    path = ROOT / "benchmarks" / "bench_vs_pipelinedp_analysis.py"
    spec = importlib.util.spec_from_file_location("bench_vs_pipelinedp_analysis", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


BENCH = _bench()


# one small- and one large-sensitivity setting per family (the benchmark runs all of NOISE_SETTINGS)
FAST_SETTINGS = [s for s in BENCH.NOISE_SETTINGS if (s[0], s[1]) in ((3, 1), (10, 3))]


@pytest.mark.parametrize("setting", FAST_SETTINGS, ids=lambda s: f"{s[4]}-L0={s[0]}-Linf={s[1]}-eps={s[3]}")
def test_dpops_side_std_is_the_analysis_prediction(setting):
    rows = BENCH.dpops_noise(*setting)
    df = analysis.plan(analysis.load(BENCH.spec_dict(*setting)), at_units=BENCH.MEAN_AT)
    want = dict(zip(df.metric, df["std"], strict=True))
    seen = set()
    for r in rows:
        if r["vector"] in ("count", "sum") or r["vector"].startswith("mean@"):
            assert r["std"] == pytest.approx(want[r["metric"]], rel=1e-12), r
            seen.add(r["metric"])
        if r.get("family") == "laplace" and "closed_form_std" in r:
            assert r["std"] == pytest.approx(r["closed_form_std"], rel=1e-9)
        if r.get("family") == "gaussian" and "continuous_std" in r:
            assert abs(r["std"] / r["continuous_std"] - 1) <= BENCH.TOL
    assert seen == {"count", "sum_amount", "mean_amount"}
    table, fails = BENCH.compare_noise(rows, None)
    assert fails == [] and len(table) == len(rows)


def test_laplace_count_expected_difference_is_the_lattice_formula():
    # count at Delta/eps = 1 (eps 4 split four ways): discrete Laplace std sqrt(2p)/(1-p), p = e^-1,
    # 4.0% below the continuous sqrt(2): the difference the benchmark reports, not a bug
    rows = BENCH.dpops_noise(1, 1, (0.0, 100.0), 4.0, "laplace")
    count = next(r for r in rows if r["vector"] == "count")
    p = math.exp(-1.0 / (1.0 / count["epsilon"]))
    assert count["std"] == pytest.approx(math.sqrt(2 * p) / (1 - p), rel=1e-6)
    assert count["std"] / count["continuous_std"] == pytest.approx(0.9597, abs=2e-3)


def test_compare_noise_flags_a_std_that_drifts_from_the_analysis():
    rows = BENCH.dpops_noise(5, 2, (0.0, 100.0), 1.0, "laplace")
    bad = [dict(r) for r in rows]
    bad[0]["analysis_std"] = bad[0]["std"] * 1.02
    _, fails = BENCH.compare_noise(bad, None)
    assert any("dpops.analysis std" in f for f in fails)


def test_dpops_bounding_shares_equal_exact_counts():
    rng = np.random.default_rng(7)
    n = 20_000
    w = 1.0 / np.arange(1, 501)
    u = rng.choice(500, size=n, p=w / w.sum()).astype(np.uint64)
    p = rng.integers(0, 40, size=n).astype(np.uint64)
    for l0, linf in [(1, 1), (3, 2), (10, 5)]:
        exact = BENCH.exact_reference(u, p, l0, linf)
        got = BENCH.dpops_bounding(u, p, l0, linf, seed=1)
        for key in ("pairs_dropped_l0", "rows_dropped_linf", "units_over_l0"):
            assert got[key] == pytest.approx(exact[key], rel=1e-12, abs=1e-15), (l0, linf, key)
        # every row Linf alone drops is dropped by L0 (its pair) or by Linf (in a kept pair)
        assert got["rows_dropped_linf"] <= got["rows_dropped_total"] <= 1.0


def test_calibrated_side_charges_the_declared_epsilon_and_flags_a_ratio_above_one():
    """Part 1b's dpops side (issue 26 item 1): the pld/1-calibrated plan is below the zCDP split's std and
    charged the declared epsilon; a PipelineDP std below dpops' is reported as a failed check, one above is not."""
    g = BENCH.dpops_calibrated(1, 1, (0.0, 100.0), 1.0, "gaussian")
    assert all(v["std"] < v["std_zcdp_split"] for v in g["vectors"])
    _, fails = BENCH.compare_calibrated([g], None)
    assert fails == []
    stds = [v["std"] for v in g["vectors"]]
    _, fails = BENCH.compare_calibrated([g], [[s * 1.001 for s in stds]])
    assert fails == []
    _, fails = BENCH.compare_calibrated([g], [[s * 0.999 for s in stds]])
    assert len(fails) == len(stds) and all("PipelineDP PLD" in f for f in fails)
    bad = dict(g, charged_epsilon=g["declared_epsilon"] * 1.0001)
    assert any("charges epsilon" in f for f in BENCH.compare_calibrated([bad], None)[1])
