"""The Beam release pipeline end to end on the in-process FnApiRunner (small inputs)."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from dpops.errors import InvalidParameter
from dpops.release_plan import plan_release
from dpops.spec import load_spec
from test_pipeline_helpers import request, run, write_input, write_spec

COUNT_SUM_MEAN = [
    {"type": "count"},
    {"type": "sum", "column": "amount", "bounds": [0, 100]},
    {"type": "mean", "column": "amount", "bounds": [0, 100]},
]


def _hand_rows():
    # A: 10 rows in north (Linf=2 keeps 2). B: one row in each of 5 regions (L0=2 keeps 2).
    # C: a value of 500 (clamped to 100) in south. D: NaN and inf amounts (both rows dropped).
    # E: a null user id (dropped). F: a row in a non-public region (dropped before bounding).
    users = ["A"] * 10 + ["B"] * 5 + ["C", "D", "D", None, "F"]
    regions = ["north"] * 10 + ["north", "south", "east", "west", "x1"] + ["south", "south", "south", "north", "zz"]
    amounts = [10.0] * 10 + [1.0] * 5 + [500.0, float("nan"), float("inf"), 5.0, 5.0]
    return {"user_id": users, "region": regions, "amount": amounts, "category": ["books"] * len(users)}


def test_public_release_hand_checked(tmp_path):
    spec = write_spec(tmp_path, COUNT_SUM_MEAN + [{"type": "unit_count"}],
                      {"columns": ["region"], "public": ["north", "south", "east", "west", "empty"]}, epsilon=2.0)
    inp = write_input(tmp_path, _hand_rows())
    df, summary, res = run(request(spec, [inp], tmp_path / "stage"))
    # every public partition (also the one without data) and nothing else
    assert sorted(df["region"]) == ["east", "empty", "north", "south", "west"]
    internal = res.internal
    assert internal["rows_read"] == 20
    assert internal["dropped_bad_value"] == 2 and internal["dropped_null_unit"] == 1
    assert internal["rows_outside_public_partitions"] == 2  # B's x1 and F's zz
    assert internal["rows_kept"] == 2 + 2 + 1  # A: Linf, B: L0 (of its 4 public regions), C
    assert internal["values_clamped"] >= 1  # C's 500 (counted once per clamped accumulator column)
    # noisy values stay within their 95% interval widths of the truth most of the time; here only sanity:
    assert np.all(np.isfinite(df["sum_amount"])) and np.all(np.isfinite(df["mean_amount"]))
    assert (df["count"] >= 0).all() and df["count"].dtype == np.int64
    for col in ("count", "sum_amount", "mean_amount", "unit_count"):
        assert (df[f"{col}_ci95_low"] <= df[col]).all() and (df[col] <= df[f"{col}_ci95_high"]).all()
        assert (df[f"{col}_std"] > 0).all()
    assert summary["test_mode"] is True and summary["randomness"] == "test" and summary["key_id"] is None
    assert summary["partitions_released"] == 5
    text = json.dumps(summary)
    assert "rows_read" not in text and "dropped" not in text.replace("are dropped", "")  # internal counts stay internal


def test_nan_never_poisons_a_sum(tmp_path):
    # PipelineDP 0.3.1 lets one user's NaN make a partition's sum NaN; here such rows are dropped.
    rows = {"user_id": [f"u{i}" for i in range(40)] + ["bad", "bad2"],
            "region": ["north"] * 42, "amount": [50.0] * 40 + [float("nan"), float("-inf")],
            "category": ["books"] * 42}
    spec = write_spec(tmp_path, COUNT_SUM_MEAN, {"columns": ["region"], "public": ["north"]})
    df, _, res = run(request(spec, [write_input(tmp_path, rows)], tmp_path / "stage"))
    assert math.isfinite(df["sum_amount"][0]) and math.isfinite(df["mean_amount"][0])
    assert res.internal["dropped_bad_value"] == 2


def test_private_partitions_and_multiple_columns(tmp_path):
    cols = {"user_id": "string", "region": "string", "day": "int", "amount": "float", "category": "string"}
    n_big = 400
    rows = {
        "user_id": [f"u{i}" for i in range(n_big)] + ["lonely"],
        "region": ["north"] * n_big + ["south"],
        "day": [1] * n_big + [2],
        "amount": [1.0] * (n_big + 1),
        "category": ["books"] * (n_big + 1),
    }
    spec = write_spec(tmp_path, [{"type": "count"}, {"type": "unit_count"}],
                      {"columns": ["region", "day"], "private": {"strategy": "truncated_geometric"}},
                      columns=cols, delta=1e-6)
    df, summary, _ = run(request(spec, [write_input(tmp_path, rows)], tmp_path / "stage"))
    # A 400-unit partition is kept (P(drop) < 1e-30 at eps 0.33); a 1-unit one only with prob <= delta
    # (false-failure rate <= 1e-6).
    assert list(zip(df["region"], df["day"])) == [("north", 1)]
    assert df["day"].dtype == np.int64
    assert abs(int(df["unit_count"][0]) - n_big) < 6 * df["unit_count_std"][0]
    assert summary["plan"]["partitions"]["strategy"] == "private"


def test_public_partitions_with_two_columns(tmp_path):
    cols = {"user_id": "string", "region": "string", "day": "int", "amount": "float", "category": "string"}
    rows = {"user_id": ["a", "b", "c"], "region": ["n", "n", "s"], "day": [1, 2, 1], "amount": [1.0, 2.0, 3.0],
            "category": ["x"] * 3}
    spec = write_spec(tmp_path, [{"type": "count"}], {"columns": ["region", "day"], "public": [["n", 1], ["s", 9]]},
                      columns=cols)
    df, _, res = run(request(spec, [write_input(tmp_path, rows)], tmp_path / "stage"))
    assert sorted(zip(df["region"], df["day"])) == [("n", 1), ("s", 9)]
    assert res.internal["rows_outside_public_partitions"] == 2


def test_csv_malformed_rows_are_dropped(tmp_path):
    table = {"user_id": ["a", "b", "", "d", "e"], "region": ["n", "n", "n", "n", "n"],
             "amount": ["1.5", "abc", "2", "", "3"], "category": ["x"] * 5}
    write_input(tmp_path, table, fmt="csv")
    spec = write_spec(tmp_path, COUNT_SUM_MEAN, {"columns": ["region"], "public": ["n"]}, fmt="csv")
    inp = tmp_path / "in" / "2024-01-01.csv"
    # the writer quotes every cell; a quoted "" is the empty string (README: CSV dialect), an unquoted empty
    # cell is null: unquote the empty cells so they are the null unit and the null value this test is about
    inp.write_text(inp.read_text().replace(',"",', ",,").replace('\n"",', "\n,"))
    df, _, res = run(request(spec, [inp], tmp_path / "stage"))
    i = res.internal
    # "abc" does not parse (wrong_type); "" user id is a null unit; "" amount is a null value
    assert i["rows_read"] == 5 and i["dropped_wrong_type"] == 1 and i["dropped_null_unit"] == 1, sorted(i.items())
    assert i["dropped_bad_value"] == 1 and i["rows_kept"] == 2
    assert len(df) == 1 and math.isfinite(df["mean_amount"][0])


def test_quantiles_and_top_k(tmp_path):
    n = 300
    rows = {"user_id": [f"u{i}" for i in range(n)], "region": ["n"] * n,
            "amount": list(np.linspace(0, 100, n)), "category": ["books"] * 200 + ["games"] * 100}
    metrics = [{"type": "quantiles", "column": "amount", "bounds": [0, 100], "quantiles": [0.5, 0.9]},
               {"type": "top_k", "column": "category", "k": 2, "domain": ["books", "games", "music"]},
               {"type": "variance", "column": "amount", "bounds": [0, 100]}]
    spec = write_spec(tmp_path, metrics, {"columns": ["region"], "public": ["n"]}, epsilon=3.0)
    df, _, _ = run(request(spec, [write_input(tmp_path, rows)], tmp_path / "stage"))
    # with eps 1 per metric, 300 units: the EM quantile lands within ~10 of the truth with high probability
    assert abs(df["quantiles_amount_q50"][0] - 50) < 15 and abs(df["quantiles_amount_q90"][0] - 90) < 15
    assert df["quantiles_amount_q50"][0] <= df["quantiles_amount_q90"][0]
    assert df["top_k_category_rank1"][0] == "books" and df["top_k_category_rank2"][0] == "games"
    assert 0 <= df["variance_amount"][0] <= 2500


def test_keyed_noise_is_reproducible_and_input_bound(tmp_path):
    from dpops.noise.randomness import NoiseKey

    key_path = tmp_path / "noise.key"
    key = NoiseKey.generate(key_path)
    gen = np.random.default_rng(0)
    rows = {"user_id": [f"u{i}" for i in gen.integers(0, 50, 300)], "region": list(gen.choice(["n", "s"], 300)),
            "amount": list(gen.uniform(0, 100, 300)), "category": ["x"] * 300}
    spec = write_spec(tmp_path, COUNT_SUM_MEAN, {"columns": ["region"], "public": ["n", "s"]})
    inp = write_input(tmp_path, rows)
    a, sa, _ = run(request(spec, [inp], tmp_path / "s1", randomness="keyed", key_path=str(key_path)))
    b, _, _ = run(request(spec, [inp], tmp_path / "s2", randomness="keyed", key_path=str(key_path)))
    c, _, _ = run(request(spec, [inp], tmp_path / "s3", randomness="keyed", key_path=str(key_path),
                          fingerprint="fp2"))
    pd.testing.assert_frame_equal(a, b)
    assert not a["count"].equals(c["count"]) or not a["sum_amount"].equals(c["sum_amount"])
    assert sa["key_id"] == key.key_id and sa["test_mode"] is False
    assert key_path.read_bytes().hex() not in json.dumps(sa)


def test_changed_spec_is_refused(tmp_path):
    spec = write_spec(tmp_path, [{"type": "count"}], {"columns": ["region"], "public": ["n"]})
    inp = write_input(tmp_path, {"user_id": ["a"], "region": ["n"], "amount": [1.0], "category": ["x"]})
    req = request(spec, [inp], tmp_path / "stage")
    write_spec(tmp_path, [{"type": "count"}], {"columns": ["region"], "public": ["n"]}, epsilon=5.0)
    from pipelines.release_pipeline import run_release

    with pytest.raises(InvalidParameter, match="spec changed"):
        run_release(req)


def test_confidence_intervals_cover(tmp_path):
    """95% intervals of counts and sums contain the truth at least 95% of the time.

    No Beam: the shard step is called directly with many test seeds. 300 seeds x 40 partitions =
    12,000 independent intervals per metric; the threshold 0.95 - 4.3 * sqrt(0.95 * 0.05 / 12000)
    = 0.9415 has a false-failure rate below 1e-5 per metric when coverage is exactly 95% (the
    mechanisms' intervals are conservative, so it is lower still). It fails if the std or the
    half-width is understated by ~10%.
    """
    from dpops.noise.randomness import test_random
    from pipelines.aggregate import select_and_noise
    from pipelines.bounding import sum_unit

    spec = write_spec(tmp_path, [{"type": "count"}, {"type": "sum", "column": "amount", "bounds": [0, 10]}],
                      {"columns": ["region"], "public": [f"p{i}" for i in range(40)]}, epsilon=1.0)
    plan = plan_release(load_spec(spec))
    parts = np.arange(1, 41, dtype=np.uint64)
    gen = np.random.default_rng(1)
    true_c = gen.integers(0, 500, 40).astype(np.int64)
    g = sum_unit("sum", 0.0, 10.0)  # the pipeline's sums are exact integer multiples of g
    true_units = np.rint(gen.uniform(0, 3000, 40) / g).astype(np.int64)
    true_s = true_units * g
    acc = {"count": true_c, "unit_count": true_c, "sum:sum_amount": true_units}
    names = {int(h): (f"p{int(h)}",) for h in parts}
    hit_c = hit_s = total = 0
    for seed in range(300):
        cols = select_and_noise(0, parts, acc, names, plan, parts, names, test_random(seed, ("ci",)))
        hit_c += int(np.sum((cols["count_ci95_low"] <= true_c) & (true_c <= cols["count_ci95_high"])))
        hit_s += int(np.sum((cols["sum_amount_ci95_low"] <= true_s) & (true_s <= cols["sum_amount_ci95_high"])))
        total += 40
    assert hit_c / total >= 0.9415, hit_c / total
    assert hit_s / total >= 0.9415, hit_s / total


def test_suppress_below_blanks_small_noisy_counts(tmp_path):
    import yaml

    rows = {"user_id": [f"u{i}" for i in range(300)] + ["x"], "region": ["big"] * 300 + ["small"],
            "amount": [1.0] * 301, "category": ["x"] * 301}
    spec = write_spec(tmp_path, COUNT_SUM_MEAN, {"columns": ["region"], "public": ["big", "small"]}, epsilon=3.0)
    doc = yaml.safe_load(spec.read_text())
    doc["postprocess"] = {"suppress_below": 100}
    spec.write_text(yaml.safe_dump(doc))
    df, _, _ = run(request(spec, [write_input(tmp_path, rows)], tmp_path / "stage"))
    df = df.set_index("region")
    # count noise std ~ 8.5 at eps 1 with L0*Linf = 4: 300 vs 1 row are ~23 std from the threshold
    assert df.loc["small"][["count", "sum_amount", "mean_amount_ci95_high"]].isna().all()
    assert df.loc["big"][["count", "sum_amount", "mean_amount"]].notna().all()


def test_input_without_valid_rows(tmp_path):
    # Every row malformed: public partitions still appear (noised zeros); private ones: an empty table
    # with the full schema. Neither case aborts (an abort would itself depend on the data).
    rows = {"user_id": [None, None], "region": ["n", "s"], "amount": [1.0, 2.0], "category": ["x", "x"]}
    inp = write_input(tmp_path, rows)
    spec = write_spec(tmp_path, COUNT_SUM_MEAN, {"columns": ["region"], "public": ["n", "s"]})
    df, _, _ = run(request(spec, [inp], tmp_path / "public"))
    assert sorted(df["region"]) == ["n", "s"]
    spec = write_spec(tmp_path, COUNT_SUM_MEAN, {"columns": ["region"], "private": {"strategy": "truncated_geometric"}})
    df, summary, _ = run(request(spec, [inp], tmp_path / "private"))
    assert len(df) == 0 and "mean_amount_ci95_high" in df.columns and summary["partitions_released"] == 0


def test_module_entry_point_reports_errors_with_exit_codes(tmp_path, capsys):
    from pipelines.release_pipeline import main

    req = {"spec_path": str(tmp_path / "missing.yaml"), "interval_start": "a", "interval_end": "b",
           "input_paths": ["x.parquet"], "noise_label": {}, "randomness": "test", "test_seed": 1,
           "staging_dir": str(tmp_path / "stage")}
    (tmp_path / "req.json").write_text(json.dumps(req))
    assert main(["--request", str(tmp_path / "req.json")]) == 3  # SpecError: fix the configuration
    assert "missing.yaml" in capsys.readouterr().err
    spec = write_spec(tmp_path, [{"type": "count"}], {"columns": ["region"], "public": ["n"]})
    req.update(spec_path=str(spec), randomness="keyed", test_seed=None, key_path=None)
    (tmp_path / "req.json").write_text(json.dumps(req))
    assert main(["--request", str(tmp_path / "req.json")]) == 3  # keyed mode without a key file
    assert "key_ref" in capsys.readouterr().err
