"""A flagged private ``dpops tune`` reads through Beam (issue 27 item 1): the statistics the workers compute equal
the driver path's, bit for bit, and so does everything tune reports from them.

The reference is the driver path (``dpops.analysis.tuning.sample_statistics``: the whole sample read into the
process, ranked once) on the same file with the same ``--seed``; the Beam path is ``dpops.release.tuning.
private_statistics`` (``pipelines.tuning`` on the in-process runner, a few unit and partition buckets so that
units, partitions and work items really are split across bundles). Equality is exact: every per-partition
array (same dtype, NaN where the driver has NaN), every unit count, and the scored rows, candidates and the
recommendation serialised to JSON. A wrong merge order, a different stream, a partition split across buckets
or a rank computed on part of a unit shows as a difference (the first would reorder the partitions' means, the
others change counts).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpops.analysis.sample_access import SampleAccess
from dpops.analysis.tuning import TuneStatistics, grid_from_doc, prepare_tune, sample_statistics, score
from dpops.cli.main import main
from dpops.ledger import ScopeDefinition, open_ledger
from dpops.noise.randomness import NoiseKey
from dpops.release.estimation import EstimationEngine
from dpops.release.tuning import private_statistics
from fuzz_support import examples

BASE = {
    "name": "tune_beam",
    "input": {"path": "data/x.parquet", "format": "parquet",
              "columns": {"user_id": "string", "region": "string", "amount": "float", "color": "string"}},
    "privacy_unit": {"column": "user_id", "description": "a user", "adjacency": "add_remove"},
    "budget": {"scope": "shop", "epsilon": 1.0, "delta": 1e-6},
    "contribution": {"max_partitions_per_unit": 2, "max_rows_per_unit_per_partition": 2},
    "partitions": {"columns": ["region"], "private": {"strategy": "truncated_geometric"}},
    "metrics": [{"type": "count"}, {"type": "unit_count"}, {"type": "sum", "column": "amount", "bounds": [0, 50]},
                {"type": "mean", "column": "amount", "bounds": [0, 50]},
                {"type": "quantiles", "column": "amount", "bounds": [0, 100], "quantiles": [0.5]}],
}
OTHER = {**BASE, "partitions": {"columns": ["region"], "public": [f"r{i}" for i in range(12)]},
         "metrics": [{"type": "variance", "column": "amount", "bounds": [0, 20]},
                     {"type": "quantiles", "column": "amount", "bounds": [-10, 100], "quantiles": [0.1, 0.5, 0.9]},
                     {"type": "top_k", "column": "color", "k": 1, "domain": ["red", "blue", "green"]},
                     {"type": "count"}]}
GRIDS = {"base": {"l0": [1, 2, 4], "linf": [1, 3], "bounds": {"amount": [[0, 10], [0, 100]]}},
         "other": {"l0": [2, 3], "linf": [2], "bounds": {"amount": [[0, 5], [-5, 50]]}}}


def frame(n: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"user_id": [f"u{i}" for i in rng.zipf(1.5, n) % 900],
                         "region": [f"r{int(i) % 40}" for i in rng.zipf(1.6, n)],
                         "amount": np.round(rng.lognormal(2.5, 1.2, n), 2),
                         "color": np.asarray(["red", "blue", "green", "pink"])[rng.integers(0, 4, n)]})


def write(df: pd.DataFrame, path: Path, row_group: int = 2_000) -> Path:
    table = pa.Table.from_pandas(df, preserve_index=False)
    if path.suffix == ".csv":
        pacsv.write_csv(table, path)
    else:
        pq.write_table(table, path, row_group_size=row_group)  # several work items
    return path


def spec_file(root: Path, doc: dict) -> Path:
    p = root / "spec.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


def assert_same_statistics(a: TuneStatistics, b: TuneStatistics) -> None:
    """Every statistic equal, dtype and NaN placement included (``first`` is the merge key, not a statistic)."""
    assert a.units == b.units
    assert sorted(a.partitions) == sorted(b.partitions)
    for k in a.partitions:
        if k == "first":
            continue
        x, y = a.partitions[k], b.partitions[k]
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), f"{k} differs"


def reported(setup, stats) -> str:
    r = score(setup, stats)
    return json.dumps({"rows": r.rows, "candidates": r.candidates, "best": r.best, "loss": r.loss}, sort_keys=True)


@pytest.mark.parametrize("case,suffix,seed", [("base", ".parquet", 3), ("other", ".parquet", 11),
                                               ("base", ".csv", 5), ("other", ".csv", None)])
def test_beam_statistics_equal_the_driver_path(tmp_path, case, suffix, seed):
    """Four specs x formats x grids (count, unit_count, sum, mean, quantiles, private selection; variance,
    three quantiles, top_k, public partitions; a default grid for the last). ``seed=None`` (fresh randomness)
    cannot be compared with another run, so that case checks the path's own invariants instead."""
    doc = BASE if case == "base" else OTHER
    spec = spec_file(tmp_path, doc)
    path = write(frame(9_000, 7), tmp_path / f"x{suffix}")
    grid = grid_from_doc(prepare_tune(spec).spec, GRIDS[case]) if seed is not None else None
    setup = prepare_tune(spec, grid=grid)
    beam = private_statistics(setup, str(path), seed, EstimationEngine(buckets=3))
    if seed is None:  # fresh randomness: the same rows read; bounding's choices differ run to run
        driver = sample_statistics(setup, str(path), None)
        assert beam.units["rows"] == driver.units["rows"] and beam.units["units"] == driver.units["units"]
        for k in ("count", "units", "sum|amount"):
            assert np.array_equal(beam.partitions[k], driver.partitions[k]), k  # the truth has no random part
        return
    driver = sample_statistics(setup, str(path), seed)
    assert_same_statistics(driver, beam)
    assert reported(setup, driver) == reported(setup, beam)


def test_bucket_counts_do_not_change_the_statistics(tmp_path):
    """One bucket (everything in one bundle) and many (most buckets hold one partition) give the same result."""
    spec = spec_file(tmp_path, OTHER)
    path = write(frame(5_000, 2), tmp_path / "x.parquet", row_group=700)
    setup = prepare_tune(spec, grid=grid_from_doc(prepare_tune(spec).spec, GRIDS["other"]))
    one = private_statistics(setup, str(path), 9, EstimationEngine(buckets=1))
    many = private_statistics(setup, str(path), 9, EstimationEngine(buckets=97))
    assert_same_statistics(one, many)
    assert_same_statistics(sample_statistics(setup, str(path), 9), many)


@st.composite
def small_samples(draw):
    n = draw(st.integers(1, 60))
    users = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    parts = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    vals = draw(st.lists(st.floats(-20, 200, allow_nan=False), min_size=n, max_size=n))
    colors = draw(st.lists(st.sampled_from(["red", "blue", "green", "pink"]), min_size=n, max_size=n))
    return pd.DataFrame({"user_id": [f"u{u}" for u in users], "region": [f"r{p}" for p in parts], "amount": vals,
                         "color": colors})


@settings(max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(df=small_samples(), l0s=st.lists(st.integers(1, 4), min_size=1, max_size=2, unique=True),
       linfs=st.lists(st.integers(1, 3), min_size=1, max_size=2, unique=True), other=st.booleans(),
       seed=st.integers(0, 1000), row_group=st.integers(3, 25))
def test_property_beam_equals_driver_on_small_samples(tmp_path_factory, df, l0s, linfs, other, seed, row_group):
    """For any small sample (duplicated values, one-row partitions, units in every partition, values outside
    the bounds), grid and seed: the Beam path's statistics and report equal the driver path's."""
    root = tmp_path_factory.mktemp("prop")
    spec = spec_file(root, OTHER if other else BASE)
    path = write(df, root / "x.parquet", row_group=row_group)
    s = prepare_tune(spec).spec
    setup = prepare_tune(spec, grid=grid_from_doc(s, {"l0": l0s, "linf": linfs, "bounds": {"amount": [[0, 10]]}}))
    try:
        driver = sample_statistics(setup, str(path), seed)
    except Exception as exc:  # no row survives the input checks (public partitions): both paths refuse
        with pytest.raises(type(exc)):
            private_statistics(setup, str(path), seed, EstimationEngine(buckets=2))
        return
    beam = private_statistics(setup, str(path), seed, EstimationEngine(buckets=2))
    assert_same_statistics(driver, beam)
    assert reported(setup, driver) == reported(setup, beam)


def test_the_flagged_cli_reads_through_beam_and_reports_the_driver_result(tmp_path, monkeypatch, capsys):
    """``dpops tune --i-understand-this-reads-private-data`` end to end: the ledger entry, then the Beam read (a
    local --staging that is empty afterwards); results.json's candidates and rows equal the driver path's on
    the same file and seed (a public ``SampleAccess`` of the same bytes, built by this test)."""
    root = tmp_path / "data"
    (root / "data").mkdir(parents=True)
    spec = spec_file(root, BASE)
    path = write(frame(6_000, 4), root / "data" / "x.parquet")
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    with open_ledger(url) as led:
        led.create_scope(ScopeDefinition(name="shop", unit="a user", unit_column="user_id", epsilon=5.0, delta=1e-6,
                                         rho=None, accountant="basic/1", adjacency="add_remove"), actor="test")
    key = tmp_path / "keys" / "noise.key"
    key.parent.mkdir()
    NoiseKey.generate(key)
    for v in ("DPOPS_DATA_ROOTS", "DPOPS_PUBLIC_ROOTS", "DPOPS_NOISE_KEY_FILE", "DPOPS_LEDGER_URL"):
        monkeypatch.delenv(v, raising=False)
    staging = tmp_path / "staging"
    staging.mkdir(mode=0o700)
    out = tmp_path / "o"
    code = main(["--ledger", url, "tune", str(spec), "--sample", str(path), "--out", str(out),
                 "--i-understand-this-reads-private-data", "--reason", "bounds for a new release", "--key-file",
                 str(key), "--l0", "1,3", "--linf", "1,2", "--seed", "17", "--staging", str(staging), "--buckets", "4",
                 "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0, doc
    assert doc["data"]["source"] == "private" and list(staging.iterdir()) == []  # scratch and statistics removed
    setup = prepare_tune(spec, grid=grid_from_doc(prepare_tune(spec).spec, {"l0": [1, 3], "linf": [1, 2]}))
    ref = score(setup, sample_statistics(setup, SampleAccess(str(path), False, "t").location, 17))
    got = json.loads((out / "results.json").read_text())
    want = json.loads(json.dumps({"candidates": ref.candidates, "rows": ref.rows}, default=float))
    assert got["candidates"] == want["candidates"] and got["rows"] == want["rows"]
    assert got["recommended"] == ref.recommended.label and got["sample_rows"] == ref.sample_rows


@pytest.mark.parametrize("where", ["data root", "key dir", "below a file", "TMPDIR in a data root"])
def test_a_bad_staging_is_refused_before_the_private_read_is_recorded(tmp_path, monkeypatch, capsys, where):
    """The private tune's scratch files are the sample's rows: a ``--staging`` in a data root or the key's
    directory is refused (exit 3), one that cannot be created fails too, and so is the default scratch's parent
    ``$TMPDIR`` inside a data root; in each case before the ledger records the access (no entry) and before a row
    is read."""
    import tempfile

    root = tmp_path / "data"
    (root / "data").mkdir(parents=True)
    spec = spec_file(root, BASE)
    path = write(frame(500, 4), root / "data" / "x.parquet")
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    with open_ledger(url) as led:
        led.create_scope(ScopeDefinition(name="shop", unit="a user", unit_column="user_id", epsilon=5.0, delta=1e-6,
                                         rho=None, accountant="basic/1", adjacency="add_remove"), actor="test")
    key = tmp_path / "keys" / "noise.key"
    key.parent.mkdir()
    NoiseKey.generate(key)
    for v in ("DPOPS_DATA_ROOTS", "DPOPS_PUBLIC_ROOTS", "DPOPS_NOISE_KEY_FILE", "DPOPS_LEDGER_URL"):
        monkeypatch.delenv(v, raising=False)
    (tmp_path / "plain").write_text("x")
    staging = {"data root": root / "scratch", "key dir": key.parent,
               "below a file": tmp_path / "plain" / "scratch"}.get(where)
    if staging is None:
        (root / "tmp").mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(root / "tmp"))  # what $TMPDIR sets
    code = main(["--ledger", url, "tune", str(spec), "--sample", str(path), "--out", str(tmp_path / "o"),
                 "--i-understand-this-reads-private-data", "--reason", "bounds", "--key-file", str(key),
                 "--l0", "1", "--linf", "1", "--seed", "1"] + (["--staging", str(staging)] if staging else []))
    err = capsys.readouterr().err
    assert code in (2, 3), err  # a spec-side refusal (3) or a bad parameter (2), never a run
    assert ("--staging" if staging else "$TMPDIR") in err, err
    with open_ledger(url) as led:
        assert led.history("shop") == [] or all(e.kind != "access" for e in led.history("shop"))
    assert not (tmp_path / "o").exists()
