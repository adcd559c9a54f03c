"""Bounds chosen by the release's predicted error (issue 26 item 3, ``dpops.analysis.bound_choice``, method error/1).

- The sensitivity the ledger is charged for: every histogram moves by at most S (add/remove) or 2 S (replace)
  in L1 when one unit changes, on any data (property).
- The objective's row model is exact where its bins are: the expected kept rows of a joint (L0, Linf).
- The regret against the oracle of ``benchmarks/bench_bound_regret.py`` (heavy-tailed data, release epsilon
  0.25 and 1, count, unit_count, sum, mean): median <= 5% over fixed-seed draws.
- The method through ``dpops estimate``: private partitions and metric-less specs refused before any charge;
  an empty interval commits; ``manifest verify`` recomputes the choice from the recorded histograms and
  refuses a result they do not give; old configurations keep their run key (quantile/1).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from fuzz_support import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from dpops.analysis import bound_choice as B
from dpops.analysis import estimate as E
from dpops.cli.main import main
from dpops.errors import InvalidParameter
from dpops.ledger import ScopeDefinition, open_ledger
from dpops.noise.randomness import NoiseKey, test_random
from dpops.release.execute import estimate as run_estimate

ROOT = Path(__file__).resolve().parent.parent
P = 4
ALL = ["units", "pairs", "partitions", "values:amount"]


def _bench():
    path = ROOT / "benchmarks" / "bench_bound_regret.py"
    spec = importlib.util.spec_from_file_location("bench_bound_regret", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


BENCH = _bench()


def _hist(rows):
    u = np.asarray([r[0] for r in rows], dtype=np.int64)
    p = np.asarray([r[1] for r in rows], dtype=np.int64)
    v = np.asarray([r[2] for r in rows], dtype=np.float64)
    _, ucode = np.unique(u, return_inverse=True)
    return B.exact_histograms(ucode, p, {"amount": v}, n_partitions=P, linf_grid=E.contribution_grid(32),
                              v_grid=E.value_grid(), names=ALL)


def _l1(a: B.BoundHistograms, b: B.BoundHistograms) -> dict[str, int]:
    return {n: int(np.abs(a.get(n).astype(np.int64) - b.get(n).astype(np.int64)).sum()) for n in ALL}


row = st.tuples(st.integers(0, 4), st.integers(0, P - 1), st.floats(-1e6, 1e6))
heavy = st.tuples(st.integers(0, P - 1), st.integers(1, 300), st.floats(0, 1e9))  # one unit's many rows


@settings(deadline=None, max_examples=examples(80))
@given(st.lists(row, max_size=25), st.lists(heavy, min_size=1, max_size=4), st.lists(heavy, min_size=1, max_size=4))
def test_one_unit_moves_every_histogram_by_at_most_its_charged_sensitivity(others, mine, theirs):
    """The charge (module docstring of bound_choice): adding or removing a unit changes each histogram by at
    most S in L1, replacing it by at most 2 S, however many rows and partitions the unit has (here up to 1,200
    rows over 4 partitions)."""
    def unit_rows(uid, spec):
        return [(uid, p, v) for p, n, v in spec for _ in range(n)]

    base = _hist(others)
    added = _hist(others + unit_rows(99, mine))
    replaced = _hist(others + unit_rows(99, theirs))
    for n, d in _l1(base, added).items():
        assert d <= B.l1_sensitivity("add_remove"), n
    for n, d in _l1(added, replaced).items():
        assert d <= B.l1_sensitivity("replace"), n


def test_the_row_model_gives_the_expected_kept_rows_of_a_joint_choice():
    """Where the bins are exact (units with 1 or 2 partitions: coarse k bins of one value each; up to 16 rows
    per pair), K(L0, Linf) is the release's expected kept rows: sum_u min(1, L0/k_u) sum_p min(r_up, Linf),
    rows, not pairs; N and the pairs L0 drops are exact, and the per-partition split adds up to them."""
    g = np.random.default_rng(3)
    rows = []
    truth = []
    for uid in range(300):
        k = int(g.integers(1, 3))
        parts = g.choice(P, size=k, replace=False)
        rs = g.integers(1, 17, size=k)
        rows += [(uid, int(p), 1.0) for p, r in zip(parts, rs, strict=True) for _ in range(int(r))]
        truth.append((k, rs))
    h = _hist(rows)
    l0s, linfs = np.array([1, 2]), np.array([1, 2, 3, 5, 8, 16])
    m = B.row_model(h, l0s, linfs)
    for i, L0 in enumerate(l0s):
        for j, Li in enumerate(linfs):
            want = sum(min(1.0, L0 / k) * float(np.minimum(rs, Li).sum()) for k, rs in truth)
            assert m.kept_rows[i, j] == pytest.approx(want, rel=1e-5), (L0, Li)
            assert (m.kept_a[i, j] @ m.profiles).sum() == pytest.approx(want, rel=1e-5)
        dropped_pairs = sum(max(0, k - L0) for k, _ in truth)
        assert (m.pairs_dropped_a[i] @ m.profiles).sum() == pytest.approx(dropped_pairs, rel=1e-5, abs=1e-6)
    assert m.rows == pytest.approx(len(rows), rel=1e-5)
    # per partition: each partition's rows, split as the pairs of each k bin fall
    per_part = np.bincount([p for _, p, _ in rows], minlength=P)
    part_rows = m.rows_a @ m.profiles
    assert part_rows.sum() == pytest.approx(len(rows), rel=1e-5)
    # rows are taken to follow pairs within a k bin: right on average (about 50 random pairs per partition and
    # bin here, so within 15%)
    assert part_rows == pytest.approx(per_part, rel=0.15)


def test_the_partition_means_are_the_same_in_chunks(monkeypatch):
    """``partition_moments`` bounds its memory by summing over chunks of partitions (it runs after the charge,
    on releases with any number of public partitions): chunks of one partition give the same means."""
    g = np.random.default_rng(5)
    rows = [(int(u), int(g.integers(0, P)), float(g.lognormal())) for u in g.integers(0, 200, 2_000)]
    m = B.row_model(_hist(rows), np.array([1, 2, 3]), np.array([1, 4, 16]))
    whole = B.partition_moments(m)
    monkeypatch.setattr(B, "_CHUNK_CELLS", 1)
    chunked = B.partition_moments(m)
    for name in ("drop2", "drop_kept", "kept2", "inv_kept2", "sampling", "pairs_drop2"):
        assert getattr(chunked, name) == pytest.approx(getattr(whole, name), rel=1e-12), name


def test_denoise_keeps_a_monotone_tail_and_drops_noise_far_out():
    """Post-processing of a noisy histogram: pure noise far in the value grid's tail does not survive as mass
    (it would be multiplied by values up to 2^40), a real geometric tail does, approximately."""
    g = np.random.default_rng(0)
    true = np.zeros(200)
    true[20:60] = 5_000.0 * 0.8 ** np.arange(40)
    b = 50.0
    noisy = true + g.laplace(0, b, 200)
    fit = B.denoise(noisy, b, cut_tails=True)
    assert fit[120:].sum() < 5 * b  # 80 cells of pure noise: at most a few scales of mass left
    assert fit[20:40].sum() == pytest.approx(true[20:40].sum(), rel=0.05)
    assert np.all(np.diff(fit[int(np.argmax(fit)):]) <= 1e-9)  # non-increasing after the mode


def test_median_regret_against_the_oracle_is_at_most_5_percent():
    """The issue's requirement, calibration style: heavy-tailed data as the issue's trial (38,600 users,
    about 186,000 rows, 30 Zipf regions, lognormal amounts with a Pareto tail), release epsilon 0.25 and 1,
    count, unit_count, sum and mean, estimation epsilon 1, 7 fixed-seed draws each through the release's own
    noise path (test mode). Deterministic: the seeds are fixed, so this either always passes or always fails
    for a given code (no false-failure rate); benchmarks/bench_bound_regret.py runs the same with 21 draws."""
    res = BENCH.run(38_600, 7, [0.25, 1.0], 1.0, 0, methods=("error/1",), verbose=False)
    assert len(res) == 8
    worst = {k: r["median_regret"] for k, r in res.items() if r["median_regret"] > BENCH.MAX_REGRET}
    assert not worst, worst


def test_the_benchmark_exits_1_above_the_threshold_and_0_below(monkeypatch, capsys):
    """The benchmark's own verdict, on a small version (3,000 users, 2 draws, one metric)."""
    monkeypatch.setattr(BENCH, "METRICS", ("count",))
    args = ["--users", "3000", "--draws", "2", "--epsilons", "1", "--estimation-epsilon", "1"]
    code = BENCH.main(args)
    out = capsys.readouterr().out
    assert "count eps=1 error/1" in out and "count eps=1 quantile/1" in out
    monkeypatch.setattr(BENCH, "MAX_REGRET", -1.0)  # nothing can meet a negative regret
    assert BENCH.main(args) == 1 and code in (0, 1)
    assert "FAIL: median regret above" in capsys.readouterr().out


# --------------------------------------------------------------------------- through dpops estimate

REGIONS = [f"r{i}" for i in range(6)]
DAY = ("2024-01-01", "2024-01-02")


def _data(root: Path, users: int, seed: int) -> None:
    g = np.random.default_rng(seed)
    u, p, a = [], [], []
    for i in range(users):
        for r in g.choice(len(REGIONS), size=min(len(REGIONS), int(g.zipf(2.5))), replace=False):
            for _ in range(int(np.ceil(g.lognormal(0.0, 1.0)))):
                u.append(f"u{i}")
                p.append(REGIONS[r])
                a.append(float(g.lognormal(3.0, 1.0)))
    (root / "data").mkdir(exist_ok=True)
    pq.write_table(pa.table({"user_id": u, "region": p, "amount": a}), root / "data" / "2024-01-01.parquet")


@pytest.fixture
def env(tmp_path, monkeypatch):
    doc = {"name": "shop_err", "schedule": "0 0 * * *",
           "input": {"path": "data/{start:%Y-%m-%d}.parquet", "format": "parquet",
                     "columns": {"user_id": "string", "region": "string", "amount": "float"}},
           "privacy_unit": {"column": "user_id", "description": "a user's purchases", "adjacency": "add_remove"},
           "budget": {"scope": "shop", "epsilon": 1.0, "delta": 0},
           "contribution": {"max_partitions_per_unit": 1, "max_rows_per_unit_per_partition": 1},
           "partitions": {"columns": ["region"], "public": REGIONS},
           "metrics": [{"type": "count"}, {"type": "mean", "column": "amount", "bounds": [0, 10]}],
           "accuracy": {"targets": [{"kind": "error", "metric": "count", "max_relative_error": 0.5,
                                     "at_units": 100}]}}
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(doc))
    _data(tmp_path, 600, 1)
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    with open_ledger(url) as led:
        led.create_scope(ScopeDefinition(name="shop", unit="a user's purchases", unit_column="user_id",
                                         epsilon=5.0, delta=1e-6, rho=None, accountant="basic/1",
                                         adjacency="add_remove"), actor="test")
    key = tmp_path / "noise.key"
    NoiseKey.generate(key)
    monkeypatch.chdir(tmp_path)
    for var in ("DPOPS_LEDGER_URL", "DPOPS_MANIFESTS_DIR", "DPOPS_NOISE_KEY_FILE"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path, spec, doc, url, key


def _estimate(spec, url, key, eps=1.0):
    with open_ledger(url) as led:
        return run_estimate(spec, *DAY, config=E.EstimateConfig(epsilon=eps, method=E.ERROR_METHOD), ledger=led,
                            key_path=str(key))


def _total(url):
    with open_ledger(url) as led:
        return len(led.history("shop")), float(led.status("shop").total)


def test_error_method_commits_and_verify_recomputes_the_choice_from_its_histograms(env):
    from dpops.manifest.io import read_manifest
    from dpops.manifest.verify import verify_manifest

    root, spec, doc, url, key = env
    est = _estimate(spec, url, key)
    assert est.state == "committed" and est.epsilon_charged == pytest.approx(1.0, rel=1e-6)
    assert {m.kind for m in est.mechanisms} == {"noisy_histogram"}
    m = read_manifest(est.manifest)
    sec = m["estimation"]
    assert sec["config"]["method"] == "error/1" and sec["choice"]["method"] == "error/1"
    assert sec["result"]["max_partitions_per_unit"] == sec["choice"]["max_partitions_per_unit"]
    assert [t["metric"] for t in sec["targets"]] == ["count"]  # the spec's targets, at the estimated bounds
    with open_ledger(url) as led:
        res = verify_manifest(m, ledger=led, check_files=False)
        assert res.ok, res.problems
        # a result the recorded histograms do not give, or histograms edited to give it, fail
        for edit in ("result", "histograms", "sensitivity"):
            bad = json.loads(json.dumps(m))
            if edit == "result":  # another upper bound, written consistently into the result and the patch
                sec_bad = bad["estimation"]
                lo, hi = sec_bad["result"]["bounds"]["amount"]
                sec_bad["result"]["bounds"]["amount"] = [lo, hi * 2]
                for mm in sec_bad["patch"]["metrics"]:
                    if mm.get("column") == "amount":
                        mm["bounds"] = [lo, hi * 2]
            elif edit == "histograms":
                h = bad["estimation"]["histograms"]["histograms"]["values:amount"]
                h[-2] += 10**9  # mass far in the tail: the choice moves
            else:
                bad["estimation"]["mechanisms"][0]["utility_sensitivity"] //= 2
            assert not verify_manifest(bad, ledger=led, check_files=False).ok, edit


def test_error_method_on_an_interval_without_rows_commits(env):
    """After the charge nothing data-dependent may fail: zero rows give zero histograms, the noise and the
    objective still give grid bounds, and the run commits."""
    root, spec, doc, url, key = env
    schema = pa.schema([("user_id", pa.string()), ("region", pa.string()), ("amount", pa.float64())])
    pq.write_table(pa.table({"user_id": [], "region": [], "amount": []}, schema=schema),
                   root / "data" / "2024-01-01.parquet")
    est = _estimate(spec, url, key)
    assert est.state == "committed"
    assert est.l0 in set(E.contribution_grid(E.DEFAULT_MAX_L0).tolist())
    lo, hi = est.bounds["amount"]
    assert lo == 0 and hi > lo
    assert main(["manifest", "verify", str(est.manifest), "--ledger", url]) == 0


@pytest.mark.parametrize("change", ["private_partitions", "no_count_metric"])
def test_error_method_refuses_what_it_cannot_minimise_before_any_charge(env, change):
    root, spec, doc, url, key = env
    doc = json.loads(json.dumps(doc))
    if change == "private_partitions":
        doc["partitions"] = {"columns": ["region"], "private": {"strategy": "truncated_geometric"}}
        doc["budget"]["delta"] = 1e-7
    else:
        doc["metrics"] = [{"type": "quantiles", "column": "amount", "bounds": [0, 10], "quantiles": [0.5]}]
        doc.pop("accuracy")
    spec.write_text(yaml.safe_dump(doc))
    before = _total(url)
    with pytest.raises(InvalidParameter, match="nothing was charged"):
        _estimate(spec, url, key)
    assert _total(url) == before


def test_old_configurations_keep_their_run_key_and_rule():
    """A configuration without ``method`` is quantile/1 (every manifest written before error/1 existed), and its
    estimation hash is the one main computed before this change (pinned), so old runs are served and verify."""
    cfg = E.EstimateConfig(epsilon=0.5)
    assert cfg.method == E.QUANTILE_METHOD and "method" not in cfg.to_dict()
    assert E.EstimateConfig.from_dict(cfg.to_dict()).method == E.QUANTILE_METHOD
    assert E.estimation_hash("0" * 64, cfg) == "2aeb73b6b3cdf3780fcd1c99d3226cd3394e6531522d8e1663b3aae93e573245"
    new = E.EstimateConfig(epsilon=0.5, method=E.ERROR_METHOD)
    assert E.estimation_hash("0" * 64, new) != E.estimation_hash("0" * 64, cfg)
    with pytest.raises(InvalidParameter, match="method"):
        E.EstimateConfig(epsilon=0.5, method="error/9")


def test_the_cli_says_which_targets_the_estimated_bounds_meet(env, capsys):
    root, spec, doc, url, key = env
    argv = ["estimate", str(spec), "--interval", "2024-01-01", "--epsilon", "1", "--key-file", str(key),
            "--ledger", url, "--out", str(root / "est")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "chosen by error/1" in out and "predicted RMSE" in out
    assert "accuracy targets with these bounds, at the release's epsilon: " in out
    assert "count: relative error <= 0.5" in out
    result = json.loads((root / "est" / "result.json").read_text())
    assert result["config"]["method"] == "error/1" and result["targets"][0]["metric"] == "count"


def test_the_noise_is_the_release_samplers_and_seeded_in_test_mode():
    """noisy_histograms draws through dpops.noise (discrete Laplace at S / share): the same seed gives the same
    histograms, another seed others, and the recorded scale is the calibrated one."""
    h = _hist([(1, 0, 1.0), (1, 1, 2.0), (2, 3, 5.0)])
    shares = B.histogram_shares(ALL, 1.0)
    a = B.noisy_histograms(h, shares, "add_remove", test_random(1, ("t",)))
    b = B.noisy_histograms(h, shares, "add_remove", test_random(1, ("t",)))
    c = B.noisy_histograms(h, shares, "add_remove", test_random(2, ("t",)))
    assert a.to_dict() == b.to_dict() and a.to_dict() != c.to_dict()
    assert sum(shares.values()) <= 1.0
    for n in ALL:
        assert a.noise_scale[n] == pytest.approx(B.WEIGHT_SCALE / shares[n], rel=1e-6)


@settings(deadline=None, max_examples=examples(40))
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.floats(-1e12, 1e12)), max_size=8),
       st.integers(0, 2**32), st.sampled_from(["count", "unit_count", "sum", "mean"]))
def test_error_method_outputs_grid_bounds_on_any_small_input_including_none(items, seed, metric):
    """Nothing data-dependent may fail after the charge: on any input (no row, one unit, extreme values, rows
    outside the public partitions) error/1 returns grid bounds with lo < hi and raises nothing."""
    from dpops.spec import parse_spec
    from pipelines.bounding import pair_priority
    from pipelines.io import hash_partition_tuples

    m = {"type": metric} | ({"column": "amount", "bounds": [-10, 10]} if metric in ("sum", "mean") else {})
    spec = parse_spec({"name": "prop", "input": {"path": "x.parquet", "format": "parquet",
                                                 "columns": {"user_id": "string", "region": "string",
                                                             "amount": "float"}},
                       "privacy_unit": {"column": "user_id", "description": "u", "adjacency": "replace"},
                       "budget": {"scope": "s", "epsilon": 1.0},
                       "contribution": {"max_partitions_per_unit": 2, "max_rows_per_unit_per_partition": 2},
                       "partitions": {"columns": ["region"], "public": ["a", "b", "c"]},
                       "metrics": [m]}, source="prop")
    pub = hash_partition_tuples([("a",), ("b",), ("c",), ("z",)], ("region",), {"region": "string"})
    u = np.asarray([i for i, _, _ in items], dtype=np.uint64) * np.uint64(2654435761) + np.uint64(1)
    p = pub[np.asarray([j for _, j, _ in items], dtype=np.int64)] if items else np.zeros(0, np.uint64)
    g = np.random.default_rng(seed)
    rows = {"u": u, "p": p, "prio": g.integers(0, 2**63, len(items)).astype(np.uint64),
            "pp": pair_priority(u, p, (1, 2)), "v:amount": np.asarray([v for _, _, v in items], dtype=np.float64)}
    cfg = E.EstimateConfig(epsilon=0.5, method=E.ERROR_METHOD)
    est = E.estimate_rows(spec, rows, cfg, test_random(seed, ("prop",)))
    assert est.l0 in set(E.contribution_grid(E.DEFAULT_MAX_L0).tolist()) and est.l0 <= 3
    assert est.linf in set(E.contribution_grid(E.DEFAULT_MAX_LINF).tolist()) | {2}
    for lo, hi in est.bounds.values():
        assert lo < hi and hi in set(E.value_grid().tolist())
    assert est.choice is not None and all(np.isfinite(v) for v in est.choice["predicted_rmse"].values())


@pytest.mark.parametrize("metric", ["count", "mean"])
def test_an_accountant_calibrated_spec_is_priced_by_one_common_factor(metric):
    """A spec with budget.accountant plans each candidate without it and scales by the calibration's factor at
    the spec's own bounds (planning under pld/1 takes seconds per candidate). Against the real calibrated plan
    at other candidates (rdp/1 here, which plans in milliseconds) the stds agree within 1%."""
    from dpops import analysis
    from dpops.release_plan import plan_release

    m = {"type": metric} | ({"column": "amount", "bounds": [0, 100]} if metric == "mean" else {})
    doc = {"name": "acc", "input": {"path": "x.parquet", "format": "parquet",
                                    "columns": {"user_id": "string", "region": "string", "amount": "float"}},
           "privacy_unit": {"column": "user_id", "description": "u", "adjacency": "add_remove"},
           "budget": {"scope": "s", "epsilon": 1.0, "delta": 1e-7, "noise": "gaussian", "accountant": "rdp/1"},
           "contribution": {"max_partitions_per_unit": 1, "max_rows_per_unit_per_partition": 1},
           "partitions": {"columns": ["region"], "public": ["a", "b", "c"]}, "metrics": [m]}
    spec = analysis.load(doc)
    key = spec.metrics[0].key
    for l0, linf in ((2, 3), (3, 16)):
        got = B.release_noise(spec, l0, linf)[key]
        exact_spec = analysis.load(doc | {"contribution": {"max_partitions_per_unit": l0,
                                                           "max_rows_per_unit_per_partition": linf}})
        plan = plan_release(exact_spec)
        want = plan.metrics[0].vectors[0].params.std
        assert got.std == pytest.approx(want, rel=0.01), (l0, linf)


def test_a_candidate_the_plan_refuses_is_skipped_and_a_target_failure_is_reported(monkeypatch):
    """After the charge nothing may raise: a candidate whose plan is refused (public parameters only) is never
    chosen, and targets that cannot be evaluated at the chosen bounds are reported as such, not raised."""
    import dpops.release_plan as RP
    from dpops import analysis

    real = RP.plan_release

    def refusing(spec, *a, **k):
        if spec.contribution.max_partitions_per_unit > 2:
            raise InvalidParameter("planted: this candidate cannot be planned")
        return real(spec, *a, **k)

    spec = BENCH.release_spec("count", 1.0)
    data = BENCH.heavy_tailed(3_000, 1)
    monkeypatch.setattr(B, "_PLAN_CACHE", {})
    monkeypatch.setattr(RP, "plan_release", refusing)
    l0s, linfs = BENCH.grids()
    names = E.error_histogram_names(spec, E.EstimateConfig(epsilon=1.0, method=E.ERROR_METHOD))
    h = B.exact_histograms(data.u, data.p, {}, n_partitions=30, linf_grid=linfs, v_grid=E.value_grid(), names=names)
    c = B.choose(spec, h, l0_grid=l0s, linf_grid=linfs, columns=[], contribution=True)
    assert c.l0 <= 2
    doc = spec.model_dump(mode="json", exclude_none=True)
    doc["accuracy"] = {"targets": [{"kind": "error", "metric": "count", "max_error": 10, "at_units": 100}]}
    targets = E.target_check(analysis.load(doc), {"max_partitions_per_unit": 5, "max_rows_per_unit_per_partition": 1,
                                                  "bounds": {}})
    assert len(targets) == 1 and targets[0]["kind"] == "error" and "could not be evaluated" in targets[0]["description"]


def test_a_predicted_mse_rounded_below_zero_does_not_raise_after_the_charge(monkeypatch):
    """Review 5 lead: ``choose`` took ``math.sqrt`` of the predicted MSE at the chosen bounds; float rounding of
    a variance plus a squared bias can leave it at -1e-18, and the ValueError came after the charge."""
    spec = BENCH.release_spec("count", 1.0)
    data = BENCH.heavy_tailed(2_000, 3)
    l0s, linfs = BENCH.grids()
    names = E.error_histogram_names(spec, E.EstimateConfig(epsilon=1.0, method=E.ERROR_METHOD))
    h = B.exact_histograms(data.u, data.p, {}, n_partitions=30, linf_grid=linfs, v_grid=E.value_grid(), names=names)
    real = B.metric_mse

    def rounded(*a, **k):
        return {key: np.full_like(v, -1e-18) for key, v in real(*a, **k).items()}

    monkeypatch.setattr(B, "metric_mse", rounded)
    c = B.choose(spec, h, l0_grid=l0s, linf_grid=linfs, columns=[], contribution=True)
    assert c.predicted_rmse and all(v == 0.0 for v in c.predicted_rmse.values())


def test_error_method_with_a_share_too_small_for_its_noise_is_refused_before_any_charge(env):
    """Review 5: a histogram's Laplace scale is computed from public parameters only (its share, its sensitivity),
    but it was computed after ``ledger.start``: an epsilon whose shares ask for a scale above the sampler's 2**50
    (about 1e-9 here) failed every attempt after the charge, the run stuck started. Refused before reserving."""
    root, spec, doc, url, key = env
    before = _total(url)
    with pytest.raises(InvalidParameter, match="nothing was charged"):
        _estimate(spec, url, key, eps=1e-10)
    assert _total(url) == before
    with open_ledger(url) as led:
        assert led.runs(scope="shop") == []
