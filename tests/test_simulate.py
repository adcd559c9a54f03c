"""``dpops simulate``: seeded test-mode releases on a public sample, predicted against observed.

Refusals (each before a row is read): a sample under a data root, the spec's input in disguise (copy, hard link),
a sample outside the public roots, keyed/os randomness, an --out under the spec's output.root; the pipeline-side
pass refuses a private sample itself. It opens no ledger and writes only --out, every file marked. The same seed
gives the same numbers. Statistics: on a synthetic public sample, observed coverage, std and keep rate match the
predictions (family-wise false-failure rate ALPHA, stated at each test); the truth is the bounded aggregate
(a sample whose bounded truth is known exactly, and a planted truth from elsewhere that the checks catch).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pandas as pd
import pytest

from dpops.cli.main import main
from dpops.errors import InvalidParameter, SpecError

ALPHA = 1e-4  # family-wise false-failure rate of a simulate call in the statistical tests (Bonferroni inside)

SPEC = """\
name: simtest
schedule: "0 0 * * *"
input: {path: "data/{start:%Y-%m-%d}.csv", format: csv, columns: {user_id: string, region: string, amount: float}}
privacy_unit: {column: user_id, description: a customer, adjacency: add_remove}
budget: {scope: sim, epsilon: 1.0, delta: 1.0e-7, noise: laplace}
contribution: {max_partitions_per_unit: 2, max_rows_per_unit_per_partition: LINF}
partitions: {columns: [region], private: {strategy: truncated_geometric}}
metrics: [{type: count}, {type: sum, column: amount, bounds: [0, 100]}, {type: mean, column: amount, bounds: [0, 100]}]
"""


def sample(seed: int = 1, sizes: tuple[int, ...] = (15, 113, 400, 1500, 3000), rows_per_unit: int | None = None,
           same_value: bool = False) -> pd.DataFrame:
    """Units in one region each (113 units: kept about half the time), 1-4 rows (or ``rows_per_unit``) of gamma(2, 20) amounts (some above the bound)."""
    rng = np.random.default_rng(seed)
    out, uid = [], 0
    for r, n in enumerate(sizes):
        for _ in range(n):
            uid += 1
            k = rows_per_unit or int(rng.integers(1, 5))
            v = float(rng.gamma(2, 20))
            for _ in range(k):
                out.append((f"u{uid}", f"r{r}", v if same_value else float(rng.gamma(2, 20))))
    return pd.DataFrame(out, columns=["user_id", "region", "amount"])


@pytest.fixture
def env(tmp_path, monkeypatch):
    """spec/ (a data root: the spec's directory) with its input data/2024-01-01.csv; public/ under
    $DPOPS_PUBLIC_ROOTS with sample.csv; no ledger anywhere."""
    for v in ("DPOPS_DATA_ROOTS", "DPOPS_LEDGER_URL", "DPOPS_NOISE_KEY_FILE"):
        monkeypatch.delenv(v, raising=False)
    spec_dir, pub = tmp_path / "spec", tmp_path / "public"
    (spec_dir / "data").mkdir(parents=True)
    pub.mkdir()
    (spec_dir / "spec.yaml").write_text(SPEC.replace("LINF", "3"), encoding="utf-8")
    sample(seed=7).to_csv(spec_dir / "data" / "2024-01-01.csv", index=False)
    sample().to_csv(pub / "sample.csv", index=False)
    monkeypatch.setenv("DPOPS_PUBLIC_ROOTS", str(pub))
    monkeypatch.chdir(tmp_path)

    class Env:
        root, spec, public = tmp_path, spec_dir / "spec.yaml", pub
        private = spec_dir / "data" / "2024-01-01.csv"

    return Env


def _no_read(monkeypatch):
    """Make any read of the sample fail the test: refusals must come first."""
    import dpops.release.pipeline_seam as seam

    def boom():
        raise AssertionError("the sample was read before the refusal")

    monkeypatch.setattr(seam, "load_sample_truth", boom)


def _run(capsys, *args):
    code = main(list(args))
    cap = capsys.readouterr()
    return code, cap.out, cap.err


# --------------------------------------------------------------------------- refusals


def test_a_sample_under_a_data_root_is_refused(env, capsys, monkeypatch):
    _no_read(monkeypatch)
    code, _, err = _run(capsys, "simulate", str(env.spec), "--sample", str(env.private), "--out", "o")
    assert code == 3 and "data root" in err and "no flag to read private data" in err, err
    assert not (env.root / "o").exists()


@pytest.mark.parametrize("how", ["copy", "hardlink"])
def test_the_private_input_in_disguise_is_refused(env, capsys, monkeypatch, how):
    _no_read(monkeypatch)
    twin = env.public / "looks_public.csv"
    (shutil.copyfile if how == "copy" else os.link)(env.private, twin)
    code, _, err = _run(capsys, "simulate", str(env.spec), "--sample", str(twin), "--out", "o")
    assert code == 3 and "private input" in err and str(env.private) in err, err
    assert not (env.root / "o").exists()


def test_a_sample_outside_the_public_roots_is_refused(env, capsys, monkeypatch):
    _no_read(monkeypatch)
    other = env.root / "elsewhere"
    other.mkdir()
    sample().to_csv(other / "s.csv", index=False)
    code, _, err = _run(capsys, "simulate", str(env.spec), "--sample", str(other / "s.csv"), "--out", "o")
    assert code == 3 and "DPOPS_PUBLIC_ROOTS" in err, err
    monkeypatch.delenv("DPOPS_PUBLIC_ROOTS")  # no public root at all: nothing is public
    code, _, err = _run(capsys, "simulate", str(env.spec), "--sample", str(env.public / "sample.csv"), "--out", "o")
    assert code == 3, err
    assert not (env.root / "o").exists()


@pytest.mark.parametrize("mode", ["keyed", "os"])
def test_keyed_and_os_randomness_are_refused(env, capsys, monkeypatch, mode):
    _no_read(monkeypatch)
    code, out, err = _run(capsys, "simulate", str(env.spec), "--sample", str(env.public / "sample.csv"),
                          "--randomness", mode, "--out", "o", "--json")
    doc = json.loads(out)
    assert code == 3 and doc["exit_code"] == 3 and "test randomness only" in doc["error"], doc
    from dpops.release.simulation import simulate

    with pytest.raises(InvalidParameter, match="test randomness only"):
        simulate(env.spec, env.public / "sample.csv", randomness=mode)
    assert not (env.root / "o").exists()


def test_per_metric_contribution_bounds_are_refused_before_the_read(env, capsys, monkeypatch):
    """simulate scores every metric against the release's bound set: a metric with its own bounds is refused."""
    _no_read(monkeypatch)
    env.spec.write_text(SPEC.replace("LINF", "3").replace(
        "{type: count}", "{type: count, contribution: {max_rows_per_unit_per_partition: 1}}"), encoding="utf-8")
    code, _, err = _run(capsys, "simulate", str(env.spec), "--sample", str(env.public / "sample.csv"), "--out", "o")
    assert code == 3 and "metrics[0].contribution" in err and "dpops simulate" in err, err
    assert not (env.root / "o").exists()


@pytest.mark.parametrize("args,what", [(["--draws", "0"], "--draws"), (["--alpha", "1.5"], "--alpha"),
                                       (["--confidence", "1"], "--confidence")])
def test_bad_parameters_are_refused_before_the_read(env, capsys, monkeypatch, args, what):
    _no_read(monkeypatch)
    code, _, err = _run(capsys, "simulate", str(env.spec), "--sample", str(env.public / "sample.csv"), *args,
                        "--out", "o")
    assert code == 3 and what in err, err


def test_the_pipeline_pass_refuses_a_private_sample_itself(env):
    """Defence in depth: ``sample_truth`` (the only producer of the exact aggregates) checks the path again,
    whoever calls it, and takes only an integer test seed."""
    from dpops.analysis.loading import load
    from dpops.release.pipeline_seam import SampleTruthRequest, load_sample_truth

    spec = load(env.spec)
    run = load_sample_truth()
    with pytest.raises(SpecError, match="data root"):
        run(SampleTruthRequest(spec, str(env.private), "csv", 1))
    twin = env.public / "twin.csv"
    shutil.copyfile(env.private, twin)
    with pytest.raises(SpecError, match="private input"):
        run(SampleTruthRequest(spec, str(twin), "csv", 1))
    with pytest.raises(InvalidParameter, match="test seed"):
        run(SampleTruthRequest(spec, str(env.public / "sample.csv"), "csv", None))  # type: ignore[arg-type]


def test_out_under_the_output_root_is_refused(env, capsys, monkeypatch):
    _no_read(monkeypatch)
    out_root = env.spec.parent / "out"  # the spec's output.root (default "out" beside the spec)
    code, _, err = _run(capsys, "simulate", str(env.spec), "--sample", str(env.public / "sample.csv"), "--draws", "20",
                        "--out", str(out_root / "sim"))
    assert code == 3 and "output.root" in err, err
    assert not out_root.exists()


def test_no_ledger_no_output_root_and_every_output_is_marked(env, capsys, monkeypatch):
    import dpops.ledger as ledger_pkg
    from dpops.analysis.simulation import MARKER

    missing = env.root / "ledger.sqlite"
    monkeypatch.setenv("DPOPS_LEDGER_URL", f"sqlite:///{missing}")

    def no_ledger(*a, **k):
        raise AssertionError("simulate opened a ledger")

    monkeypatch.setattr(ledger_pkg, "open_ledger", no_ledger)
    code, out, err = _run(capsys, "simulate", str(env.spec), "--sample", str(env.public / "sample.csv"), "--draws", "50",
                          "--out", "o", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] is True, err
    assert doc["publishable"] is False and doc["simulation"] is True and doc["marker"] == MARKER
    assert doc["randomness"] == "test"
    assert not missing.exists() and not (env.spec.parent / "out").exists()
    written = sorted(p.name for p in (env.root / "o").iterdir())
    assert written == ["simulation.html", "simulation.json", "simulation.png"]
    assert MARKER in (env.root / "o" / "simulation.html").read_text()
    assert json.loads((env.root / "o" / "simulation.json").read_text())["publishable"] is False
    assert (env.root / "o" / "simulation.png").stat().st_size > 5000
    page = (env.root / "o" / "simulation.html").read_text()
    assert "data:image/png;base64," in page and "<script" not in page and "http://" not in page


# --------------------------------------------------------------------------- reproducibility


def test_the_same_seed_gives_the_same_numbers(env):
    from dpops.release.simulation import simulate

    a = simulate(env.spec, env.public / "sample.csv", draws=200, seed=5).to_dict()
    b = simulate(env.spec, env.public / "sample.csv", draws=200, seed=5).to_dict()
    c = simulate(env.spec, env.public / "sample.csv", draws=200, seed=6).to_dict()
    assert a == b
    obs = lambda d: [r["observed_std"] for r in d["rows"]]  # noqa: E731
    assert obs(a) != obs(c)


# --------------------------------------------------------------------------- statistics


def test_observed_coverage_std_and_keep_rate_match_the_predictions(env):
    """5,000 draws on the synthetic public sample (fixed seed): every check holds at the family-wise false-failure
    rate ALPHA = 1e-4 (binomial bands for coverage and keep, exact-conservative; the std ratio a normal
    approximation, see dpops.analysis.simulation). Non-vacuous: every scored metric has a two-sided coverage check
    on >= 10,000 observations, and the keep rate is checked in the bucket where it is near 1/2."""
    from dpops.release.simulation import simulate

    sim = simulate(env.spec, env.public / "sample.csv", draws=5000, seed=11, alpha=ALPHA)
    assert sim.holds, [c for c in sim.score.failed()]
    for key in ("count", "sum_amount", "mean_amount"):
        cov = [c for c in sim.score.checks if c.metric == key and c.what == "coverage" and c.sides == "two-sided"]
        assert cov and all(0.93 < c.observed < 0.97 for c in cov), (key, cov)
        assert any(c.what == "std_ratio" and c.metric == key for c in sim.score.checks)
    big = [r for r in sim.score.rows if r.bucket == "[1000,10000)" and r.metric != "partition_selection"]
    assert len(big) == 3 and all(r.observations == 10_000 for r in big), big
    keep = [c for c in sim.score.checks if c.what == "keep" and 0.2 < c.predicted < 0.8]
    assert keep, sim.score.checks
    assert {r.metric for r in sim.score.rows} >= {"count", "sum_amount", "mean_amount", "partition_selection"}


def test_the_truth_is_the_bounded_aggregate(env):
    """Every unit has 3 rows of one value in one region and Linf = 1, so the bounded truth is known exactly
    whatever row the bounding keeps: count = units, sum = sum of clip(value, 0, 100) over units. simulate's truth
    must be that (not the unbounded 3x count), its draws must hold around it, and the bounding's reported bias
    must be the exact difference. Public partitions are not needed: the larger regions are kept with
    probability 1."""
    from dpops.release.simulation import simulate

    (env.spec.parent / "spec.yaml").write_text(SPEC.replace("LINF", "1"), encoding="utf-8")
    df = sample(seed=3, sizes=(400, 1500, 3000), rows_per_unit=3, same_value=True)
    df.to_csv(env.public / "bounded.csv", index=False)
    sim = simulate(env.spec, env.public / "bounded.csv", draws=1000, seed=2, alpha=ALPHA)
    per_unit = df.groupby("user_id").agg(region=("region", "first"), amount=("amount", "first"))
    units = per_unit.groupby("region").size()
    clipped = per_unit.assign(amount=per_unit["amount"].clip(0, 100)).groupby("region")["amount"].sum()
    names = [n[0] for n in sim.names]
    t = sim.truths
    assert np.array_equal(t["count"].bounded, units[names].to_numpy(float))
    assert np.array_equal(t["count"].unbounded, 3 * units[names].to_numpy(float))
    assert np.allclose(t["sum_amount"].bounded, clipped[names].to_numpy(), rtol=1e-9)
    assert np.allclose(t["sum_amount"].unbounded, df.groupby("region")["amount"].sum()[names].to_numpy())
    assert sim.bounding["rows_dropped_linf"] == 2 * len(per_unit) and sim.bounding["rows_kept"] == len(per_unit)
    assert sim.holds, [c for c in sim.score.failed()]
    rows = {(r.metric, r.bucket): r for r in sim.score.rows}
    r = rows[("count", "[1000,10000)")]
    assert r.bounding_relative_bias == pytest.approx(2 / 3)  # bounded = unbounded / 3


def test_public_partitions(env):
    """Public partitions: every partition of the list with rows in the sample is simulated, none is selected
    (no keep rows), and the predictions hold (ALPHA)."""
    from dpops.release.simulation import simulate

    text = SPEC.replace("LINF", "3").replace("private: {strategy: truncated_geometric}", "public: [r0, r1, r2, r9]")
    (env.spec.parent / "spec.yaml").write_text(text, encoding="utf-8")
    sim = simulate(env.spec, env.public / "sample.csv", draws=300, seed=8, alpha=ALPHA)
    assert sorted(n[0] for n in sim.names) == ["r0", "r1", "r2"]  # r9 has no rows in the sample; r3, r4 not public
    assert sim.holds, sim.score.failed()
    assert not [r for r in sim.score.rows if r.metric == "partition_selection"]
    assert sim.bounding["rows_dropped_by_checks"] > 0  # the rows of r3 and r4 are outside the public list


def test_a_truth_from_elsewhere_is_caught(env, monkeypatch):
    """Planted bug: the draws scored against the unbounded truth (the sample's rows before bounding and
    clamping) instead of the bounded aggregates the release noised. The checks must fail, on coverage of the
    count and the sum (a bias of about 10% of the count, ~100 stds)."""
    import dpops.analysis.simulation as scoring
    from dpops.release.simulation import simulate

    real = scoring.metric_truths

    def unbounded_truth(plan, bounded, unbounded):
        out = real(plan, bounded, unbounded)
        return {k: scoring.MetricTruth(v.key, v.type, v.unbounded, v.unbounded, v.valid) for k, v in out.items()}

    monkeypatch.setattr(scoring, "metric_truths", unbounded_truth)
    sim = simulate(env.spec, env.public / "sample.csv", draws=300, seed=4, alpha=ALPHA)
    assert not sim.holds
    failed = {(c.metric, c.what) for c in sim.score.failed()}
    assert {("count", "coverage"), ("sum_amount", "coverage")} <= failed, failed


def test_the_readme_example_on_a_synthetic_sample(tmp_path, capsys, monkeypatch):
    """README's ``dpops simulate examples/daily_purchases.yaml --sample ... --draws 1000 --seed 1``, on the
    sample ``dpops spec synth`` writes for a copy of the spec placed under a public root (the procedure the
    refusal message names). top_k is listed as not scored; quantiles are scored by their rank error. count,
    unit_count, sum, mean and the quantiles' rank error hold
    (ALPHA is the default 1e-3 here, family-wise). The variance is not asserted: its normal approximation is the
    known finding of docs/accuracy.md (coverage below 95% under Laplace noise), so the exit code may be 7."""
    from pathlib import Path

    for v in ("DPOPS_DATA_ROOTS", "DPOPS_LEDGER_URL"):
        monkeypatch.delenv(v, raising=False)
    example = Path(__file__).resolve().parents[1] / "examples" / "daily_purchases.yaml"
    spec_dir, pub = tmp_path / "spec", tmp_path / "public"
    spec_dir.mkdir()
    pub.mkdir()
    shutil.copy(example, spec_dir / "daily_purchases.yaml")
    shutil.copy(example, pub / "daily_purchases.yaml")  # the copy whose input path lands under the public root
    monkeypatch.setenv("DPOPS_PUBLIC_ROOTS", str(pub))
    assert main(["spec", "synth", str(pub / "daily_purchases.yaml"), "--from", "2024-01-01", "--to", "2024-01-02",
                 "--rows", "20000", "--users", "3000"]) == 0
    capsys.readouterr()
    sample_file = next((pub / "data" / "purchases").glob("*.parquet"))
    code, out, err = _run(capsys, "simulate", str(spec_dir / "daily_purchases.yaml"), "--sample", str(sample_file),
                          "--draws", "1000", "--seed", "1", "--out", str(tmp_path / "o"), "--json")
    doc = json.loads(out)
    assert code in (0, 7), err
    assert doc["not_scored"] == ["top_k_category"]
    assert doc["partitions"] == 4 and doc["publishable"] is False
    failed = {c["metric"] for c in doc["checks"] if not c["passed"]}
    assert not failed - {"variance_amount"}, [c for c in doc["checks"] if not c["passed"]]
    checked = {c["metric"] for c in doc["checks"]}
    assert {"count", "unit_count", "sum_amount", "mean_amount", "quantiles_amount"} <= checked


def test_cli_exit_codes_and_table(env, capsys, monkeypatch):
    """0 and the table when predictions hold; 7 (verification failed) with the failed checks named, and the
    --json document still printed once, when they do not (planted: the truth shifted by 5 stds)."""
    code, out, err = _run(capsys, "simulate", str(env.spec), "--sample", str(env.public / "sample.csv"),
                          "--draws", "200", "--seed", "3", "--out", "o")
    assert code == 0, err
    assert "predictions hold" in out and "count" in out and "partition_selection" in out and "bounding:" in out
    assert "never publishable" in err
    import dpops.analysis.simulation as scoring

    real = scoring.metric_truths

    def shifted(plan, bounded, unbounded):
        out = real(plan, bounded, unbounded)
        c = out["count"]
        return {**out, "count": scoring.MetricTruth(c.key, c.type, c.bounded + 5 * 42.4, c.unbounded, c.valid)}

    monkeypatch.setattr(scoring, "metric_truths", shifted)
    code, out, err = _run(capsys, "simulate", str(env.spec), "--sample", str(env.public / "sample.csv"),
                          "--draws", "200", "--seed", "3", "--out", "o", "--json")
    doc = json.loads(out)
    assert code == 7 and doc["ok"] is False and doc["exit_code"] == 7 and doc["holds"] is False
    assert "count" in doc["error"] and "outside their band" in doc["error"]


# --------------------------------------------------------------------------- quantiles: rank error

QSPEC_METRICS = "metrics: [{type: count}, {type: quantiles, column: amount, bounds: [0, 200], quantiles: QS}]"


def _quantile_spec(env, qs: str) -> None:
    text = SPEC.replace("LINF", "3").replace(SPEC.splitlines()[-1], QSPEC_METRICS.replace("QS", qs))
    (env.spec.parent / "spec.yaml").write_text(text, encoding="utf-8")


@pytest.mark.parametrize("qs,sides", [("[0.5]", "two-sided"), ("[0.9, 0.25]", "upper")])
def test_the_quantiles_rank_error_matches_its_exact_law(env, qs, sides):
    """A quantiles metric is scored by its excess rank error against the exact law of the mechanism at each
    partition's bounded histogram: 2,000 draws, every check holds at ALPHA = 1e-4 (a z band on the summed excess;
    one-sided, not above, when the release sorts several picks). Non-vacuous: checks on >= 2,000 observations in
    the large buckets, and the observed mean within 15% of the predicted one there with one quantile (the z
    band's half-width there is about 13% of the mean at ALPHA with these draws; measured: within 1.5%)."""
    from dpops.release.simulation import simulate

    _quantile_spec(env, qs)
    sim = simulate(env.spec, env.public / "sample.csv", draws=2000, seed=3, alpha=ALPHA)
    assert sim.holds, sim.score.failed()
    rank = [c for c in sim.score.checks if c.what == "rank_error"]
    assert rank and all(c.sides == sides and c.metric == "quantiles_amount" for c in rank), rank
    rows = [r for r in sim.score.rows if r.metric == "quantiles_amount" and r.observations >= 2000]
    assert rows, sim.score.rows
    if sides == "two-sided":
        assert all(abs(r.observed_rank_error / r.predicted_rank_error - 1) < 0.15 for r in rows), rows
    assert sim.score.not_scored == []


def test_a_rank_error_predicted_at_the_wrong_epsilon_is_caught(env, monkeypatch):
    """Planted bug: the prediction made at twice the quantile's per-run epsilon (half the expected excess, as a
    prediction that forgot the split over quantiles would). The two-sided rank check must fail."""
    import dataclasses

    import dpops.analysis.simulation as scoring
    from dpops.release.simulation import simulate

    real = scoring.predict_quantiles

    def optimistic(plan, bounded):
        metrics = tuple(dataclasses.replace(m, per_run_epsilon=2 * m.per_run_epsilon) if m.type == "quantiles" else m
                        for m in plan.metrics)
        return real(dataclasses.replace(plan, metrics=metrics), bounded)

    monkeypatch.setattr(scoring, "predict_quantiles", optimistic)
    _quantile_spec(env, "[0.5]")
    sim = simulate(env.spec, env.public / "sample.csv", draws=1000, seed=3, alpha=ALPHA)
    assert ("quantiles_amount", "rank_error") in {(c.metric, c.what) for c in sim.score.failed()}, sim.score.checks
