"""The estimation's counts computed by Beam on workers equal the driver path's, bit for bit (issue 27 item 1).

``dpops.release.estimation.compute_estimation(engine="beam")`` reads the interval with the same streams and
counts each unit bucket with the same functions as ``engine="driver"``; only public-grid counts reach the
driver. Compared here: every count each mechanism sees (L0, Linf at every candidate L0, both value counts of
each column) and the chosen bounds, over Parquet split into many row groups (many work items, batches and
buckets to merge), CSV with an event-time filter, keyed and test randomness, and an interval without rows.
Deterministic: no statistical threshold (fixed data, fixed keys).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import yaml

from dpops.analysis.estimate import EstimateConfig, RowCounts, contribution_grid, value_grid
from dpops.ledger import ScopeDefinition, open_ledger
from dpops.noise.randomness import NoiseKey
from dpops.release import estimation as R
from dpops.release.execute import estimate
from dpops.release.preparation import prepare

REGIONS = [f"r{i}" for i in range(12)]
DAY = ("2024-01-01", "2024-01-02")


def _rows(users: int, seed: int) -> dict[str, list]:
    rng = np.random.default_rng(seed)
    u, p, a, t = [], [], [], []
    for i in range(users):
        k = min(12, int(rng.zipf(1.8)))
        for r in rng.choice(12, size=k, replace=False):
            for _ in range(int(rng.zipf(1.6)) % 40 + 1):
                u.append(f"u{i}")
                p.append(REGIONS[r])
                a.append(float(rng.lognormal(2.0, 1.5)) * (-1 if rng.random() < 0.2 else 1))
                t.append(f"2024-01-0{1 + int(rng.random() < 0.1)}T{int(rng.integers(0, 24)):02d}:00:00")
    return {"user_id": u, "region": p, "amount": a, "ts": t}


def _env(tmp_path, monkeypatch, fmt: str, users: int = 600):
    cols = {"user_id": "string", "region": "string", "amount": "float",
            "ts": "timestamp" if fmt == "csv" else "string"}
    doc = {"name": f"est_beam_{fmt}", "schedule": "0 0 * * *",
           "input": {"path": f"data/{{start:%Y-%m-%d}}.{fmt}", "format": fmt, "columns": cols,
                     **({"time_column": "ts"} if fmt == "csv" else {})},
           "privacy_unit": {"column": "user_id", "description": "a user's purchases", "adjacency": "add_remove"},
           "budget": {"scope": "shop", "epsilon": 0.5, "delta": 0},
           "contribution": {"max_partitions_per_unit": 2, "max_rows_per_unit_per_partition": 3},
           "partitions": {"columns": ["region"], "public": REGIONS},
           "metrics": [{"type": "count"}, {"type": "sum", "column": "amount", "bounds": [-10, 10]}]}
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(doc))
    (tmp_path / "data").mkdir()
    table = pa.table(_rows(users, 7))
    path = tmp_path / "data" / f"2024-01-01.{fmt}"
    if fmt == "parquet":
        pq.write_table(table, path, row_group_size=700)  # many row groups: many work items to merge
    else:
        pacsv.write_csv(table, path)
    key = tmp_path / "noise.key"
    NoiseKey.generate(key)
    monkeypatch.chdir(tmp_path)
    for var in ("DPOPS_LEDGER_URL", "DPOPS_MANIFESTS_DIR", "DPOPS_NOISE_KEY_FILE", "DPOPS_DATA_ROOTS"):
        monkeypatch.delenv(var, raising=False)
    return spec, key


def _run(spec, key, config, randomness="keyed"):
    kw = {"key_path": str(key)} if randomness == "keyed" else {"randomness": "test", "test_seed": 5}
    ctx = prepare(spec, *DAY, for_estimation=True, **kw)
    return R.EstimationRun(ctx, R.run_key_of(ctx, config))


def _same_counts(run, config):
    """Every count the mechanisms can ask for, from both engines."""
    rng = R.random_source(run.ctx, run.key)
    driver = RowCounts(R.read_rows(run.ctx, rng.child("estimate", "read")))
    beam = R.PipelineCounts(run, config)
    g0, g1, gv = contribution_grid(config.max_l0), contribution_grid(config.max_linf), value_grid()
    a, b = driver.l0_counts(g0), beam.l0_counts(g0)
    assert a.n == b.n and a.n > 0 and np.array_equal(a.at_or_below, b.at_or_below)
    for l0 in g0:
        a, b = driver.linf_counts(int(l0), g1), beam.linf_counts(int(l0), g1)
        assert a.n == b.n and np.array_equal(a.at_or_below, b.at_or_below), int(l0)
    for l0, linf in ((1, 1), (2, 3), (5, 40)):
        a, b = driver.value_counts(l0, linf, ["amount"], gv)["amount"], beam.value_counts(l0, linf, ["amount"], gv)["amount"]
        assert a.n == b.n and np.array_equal(a.below, b.below) and np.array_equal(a.at_or_below, b.at_or_below)
    return driver


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_beam_counts_and_bounds_equal_the_driver_path(tmp_path, monkeypatch, fmt):
    spec, key = _env(tmp_path, monkeypatch, fmt)
    config = EstimateConfig(epsilon=1.0, max_l0=64, max_linf=64)
    run = _run(spec, key, config)
    _same_counts(run, config)
    results = {}
    for engine in ("driver", "beam"):
        est = R.compute_estimation(run, config, R.random_source(run.ctx, run.key), engine=engine)
        results[engine] = est.result()
    assert results["beam"] == results["driver"]
    assert results["driver"]["max_partitions_per_unit"] is not None and set(results["driver"]["bounds"]) == {"amount"}


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_error_method_histograms_and_bounds_equal_the_driver_path(tmp_path, monkeypatch, fmt):
    """error/1 (the CLI's default method) on the Beam engine: the exact histograms the workers sum equal the
    driver's over all rows, cell for cell, and so do the noisy histograms, the choice and the bounds."""
    from dpops.analysis import estimate as E

    spec, key = _env(tmp_path, monkeypatch, fmt)
    config = EstimateConfig(epsilon=1.0, method="error/1", max_l0=16, max_linf=64)
    run = _run(spec, key, config)
    rows = R.read_rows(run.ctx, R.random_source(run.ctx, run.key).child("estimate", "read"))
    driver = E.error_exact_histograms(run.ctx.spec, rows, config, E.public_partition_hashes(run.ctx.spec))
    beam = R.PipelineCounts(run, config).error_histograms()
    assert beam.names() == driver.names() == ["units", "pairs", "partitions", "values:amount"]
    for name in driver.names():
        assert np.array_equal(beam.get(name), driver.get(name)), name
    assert int(driver.get("partitions").sum()) > 0
    out = {e: R.compute_estimation(run, config, R.random_source(run.ctx, run.key), engine=e) for e in ("beam", "driver")}
    assert out["beam"].result() == out["driver"].result()
    assert out["beam"].histograms == out["driver"].histograms and out["beam"].choice == out["driver"].choice


def test_test_mode_and_an_empty_interval_agree(tmp_path, monkeypatch):
    spec, key = _env(tmp_path, monkeypatch, "parquet", users=50)
    config = EstimateConfig(epsilon=0.7, max_l0=16, max_linf=16)
    run = _run(spec, key, config, randomness="test")
    rng = lambda: R.random_source(run.ctx, run.key)  # noqa: E731
    assert (R.compute_estimation(run, config, rng(), engine="beam").result()
            == R.compute_estimation(run, config, rng(), engine="driver").result())
    # an interval without rows is data: both engines count zeros and still choose DP bounds
    empty = pa.table({c: pa.array([], type=t) for c, t in (("user_id", pa.string()), ("region", pa.string()),
                                                            ("amount", pa.float64()), ("ts", pa.string()))})
    pq.write_table(empty, tmp_path / "data" / "2024-01-01.parquet")
    run = _run(spec, key, config, randomness="test")
    assert (R.compute_estimation(run, config, rng(), engine="beam").result()
            == R.compute_estimation(run, config, rng(), engine="driver").result())


def test_a_charged_estimation_on_the_beam_engine_commits_what_the_driver_computes(tmp_path, monkeypatch):
    """The whole run (reserve, start, Beam counts, commit, manifest) on ``engine="beam"``; the driver path over
    the same prepared context recomputes the committed result."""
    from dpops.manifest.io import read_manifest
    from dpops.manifest.verify import verify_manifest

    spec, key = _env(tmp_path, monkeypatch, "parquet", users=200)
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    with open_ledger(url) as led:
        led.create_scope(ScopeDefinition(name="shop", unit="a user's purchases", unit_column="user_id",
                                         epsilon=3.0, delta=1e-6, rho=None, accountant="basic/1",
                                         adjacency="add_remove"), actor="test")
        config = EstimateConfig(epsilon=1.0)
        est = estimate(spec, *DAY, config=config, ledger=led, key_path=str(key), engine="beam")
        assert est.state == "committed"
        assert verify_manifest(read_manifest(est.manifest), ledger=led).ok
    run = _run(spec, key, config)
    assert est.result() == R.compute_estimation(run, config, R.random_source(run.ctx, run.key),
                                                 engine="driver").result()


def test_an_engine_that_could_only_fail_after_the_charge_is_refused_before_anything_is_reserved(tmp_path,
                                                                                                  monkeypatch):
    """An unknown engine, Beam missing, or keyed mode without a key reference
    for the workers: each would fail (or choose by another rule) after ``ledger.start``, so each is refused
    before the reservation."""
    from dpops.errors import InvalidParameter
    from dpops.release import pipeline_seam

    spec, key = _env(tmp_path, monkeypatch, "parquet", users=20)
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    with open_ledger(url) as led:
        led.create_scope(ScopeDefinition(name="shop", unit="a user's purchases", unit_column="user_id",
                                         epsilon=3.0, delta=1e-6, rho=None, accountant="basic/1",
                                         adjacency="add_remove"), actor="test")
        config = EstimateConfig(epsilon=1.0)
        with pytest.raises(InvalidParameter, match="engine must be one of"):
            estimate(spec, *DAY, config=config, ledger=led, key_path=str(key), engine="spark")

        def no_beam():
            raise ModuleNotFoundError("No module named 'apache_beam'", name="apache_beam")

        with monkeypatch.context() as m:
            m.setattr(pipeline_seam, "load_count_estimation", no_beam)
            with pytest.raises(InvalidParameter, match="needs Apache Beam"):
                estimate(spec, *DAY, config=config, ledger=led, key_path=str(key), engine="beam")
        ctx = prepare(spec, *DAY, key=NoiseKey.from_file(key), for_estimation=True)
        with pytest.raises(InvalidParameter, match="key from its reference"):
            R.run_estimation(ctx, config, led, engine="beam")
        assert led.runs() == []


def test_the_cli_engine_option_runs_the_beam_counts(tmp_path, monkeypatch):
    """``dpops estimate SPEC ... --engine beam`` (docs/accuracy.md): committed, and the bounds the driver engine
    computes over the same prepared context."""
    from dpops.cli.main import main

    spec, key = _env(tmp_path, monkeypatch, "parquet", users=120)
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    with open_ledger(url) as led:
        led.create_scope(ScopeDefinition(name="shop", unit="a user's purchases", unit_column="user_id",
                                         epsilon=3.0, delta=1e-6, rho=None, accountant="basic/1",
                                         adjacency="add_remove"), actor="test")
    assert main(["--ledger", url, "estimate", str(spec), "--interval", "2024-01-01", "--epsilon", "0.6",
                 "--key-file", str(key), "--method", "quantile/1", "--engine", "beam",
                 "--out", str(tmp_path / "out")]) == 0
    done = json.loads((tmp_path / "out" / "result.json").read_text())
    assert done["state"] == "committed"
    config = EstimateConfig(epsilon=0.6)
    run = _run(spec, key, config)
    assert done["result"] == R.compute_estimation(run, config, R.random_source(run.ctx, run.key),
                                                  engine="driver").result()


@pytest.mark.slow
def test_the_estimation_benchmark_runs_both_engines_and_they_agree(tmp_path, monkeypatch, capsys):
    """``benchmarks/bench_estimate.py`` (benchmarks/README.md "Estimation benchmark") at 20k rows, value bounds
    only: both engines exit 0 and print that they chose the same bounds."""
    import importlib
    import sys

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    bench_scale = importlib.import_module("bench_scale")
    bench = importlib.import_module("bench_estimate")
    monkeypatch.setattr(bench_scale, "OUT", tmp_path)
    monkeypatch.setattr(bench, "OUT", tmp_path)
    monkeypatch.setattr(bench, "RUNS", tmp_path / "estimate")
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    assert bench.main(["--sizes", "2e4", "--no-contribution"]) == 0
    out = capsys.readouterr().out
    assert "same bounds on every engine: True" in out
    rows = [json.loads(x) for x in (tmp_path / "estimate" / "results.jsonl").read_text().splitlines()]
    assert [(r["engine"], r["exit"]) for r in rows] == [("driver", 0), ("beam", 0)], sys.executable
