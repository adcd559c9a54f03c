"""dpops tune (issue 20 section 3): one pass over the sample, the privacy gate, the ledger event, the page."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from dpops import dataroots
from dpops import analysis as tune_api
from dpops.analysis.tuning import Candidate, apply_patch, default_grid, grid_from_doc, load_patched
from dpops.cli.main import main
from dpops.errors import InvalidParameter
from dpops.ledger import ScopeDefinition, open_ledger
from dpops.noise.randomness import NoiseKey

SPEC = {
    "name": "tune_test",
    "input": {"path": "data/x.parquet", "format": "parquet",
              "columns": {"user_id": "string", "region": "string", "amount": "float"}},
    "privacy_unit": {"column": "user_id", "description": "a user", "adjacency": "add_remove"},
    "budget": {"scope": "shop", "epsilon": 1.0, "delta": 1e-6},
    "contribution": {"max_partitions_per_unit": 2, "max_rows_per_unit_per_partition": 2},
    "partitions": {"columns": ["region"], "private": {"strategy": "truncated_geometric"}},
    "metrics": [{"type": "count"}, {"type": "unit_count"}, {"type": "sum", "column": "amount", "bounds": [0, 50]},
                {"type": "mean", "column": "amount", "bounds": [0, 50]},
                {"type": "quantiles", "column": "amount", "bounds": [0, 100], "quantiles": [0.5]}],
}


def sample(n: int = 4000, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"user_id": [f"u{i}" for i in rng.integers(0, 600, n)],
                         "region": [f"r{int(i) % 40}" for i in rng.zipf(1.6, n)],
                         "amount": rng.lognormal(3.0, 1.0, n)})


def spec_at(root: Path, doc: dict | None = None) -> Path:
    p = root / "spec.yaml"
    p.write_text(yaml.safe_dump(doc or SPEC))
    return p


def test_grid_in_one_pass_equals_each_candidate_alone(tmp_path):
    """The one-pass property: evaluating the grid together gives, row for row, what each candidate gives
    evaluated alone (its own read and ranking, at its own floors), and ranks the rows once for the whole grid."""
    spec = spec_at(tmp_path)
    df = sample()
    grid = grid_from_doc(tune_api.load(spec), {"l0": [1, 3], "linf": [1, 2], "bounds": {"amount": [[0, 20], [0, 80]]}})
    together = tune_api.tune(spec, df, grid=grid, seed=7)
    assert together.boundings == 1 and len(grid) == 8  # one ranking pass, whatever the grid
    for cand in grid:
        alone = tune_api.tune(spec, df, grid=[cand], seed=7)
        assert alone.boundings == 1
        mine = [r for r in together.rows if r["candidate"] == cand.label]
        assert mine == alone.rows
        summ = next(c for c in together.candidates if c["candidate"] == cand.label)
        assert {k: v for k, v in summ.items() if k != "loss"} == \
            {k: v for k, v in alone.candidates[0].items() if k != "loss"}


def test_hand_computed_bias_drops_and_noise(tmp_path):
    """Three users, one public partition: the bounding biases and drop shares are the exact numbers, and
    the noise std is the plan's own prediction."""
    doc = {**SPEC, "partitions": {"columns": ["region"], "public": ["a"]},
           "metrics": [{"type": "count"}, {"type": "sum", "column": "amount", "bounds": [0, 10]}]}
    spec = spec_at(tmp_path, doc)
    df = pd.DataFrame({"user_id": ["x", "x", "x", "y", "z", "z"], "region": ["a"] * 6,
                       "amount": [5.0, 5.0, 5.0, 30.0, 1.0, 2.0]})
    res = tune_api.tune(spec, df, grid=[Candidate(1, 2, (("amount", 0.0, 10.0),))], seed=1)
    c = res.candidates[0]
    assert c["rows_dropped_linf"] == pytest.approx(1 / 6) and c["rows_dropped_l0"] == 0
    assert c["units_dropped_linf"] == pytest.approx(1 / 3) and c["units_dropped_l0"] == 0
    rows = {r["metric"]: r for r in res.rows}
    assert rows["count"]["bias_bounding"] == -1 and rows["count"]["bias_clipping"] == 0
    assert rows["sum_amount"]["bias_bounding"] == -5.0
    assert rows["sum_amount"]["bias_clipping"] == -20.0  # 30 clipped to 10
    plan_std = tune_api.plan(load_patched(tune_api.load(spec), {"contribution": {
        "max_partitions_per_unit": 1, "max_rows_per_unit_per_partition": 2}}))
    std = float(plan_std.loc[plan_std.metric == "sum_amount", "std"].iloc[0])
    assert rows["sum_amount"]["noise_std"] == pytest.approx(std)
    assert rows["sum_amount"]["rmse"] == pytest.approx(math.sqrt(std ** 2 + 25.0 ** 2))


def test_recommendation_meets_targets_when_a_candidate_can(tmp_path):
    doc = {**SPEC, "accuracy": {"confidence": 0.95, "targets": [
        {"kind": "error", "metric": "count", "max_relative_error": 1.0, "at_units": 100}]}}
    spec = spec_at(tmp_path, doc)
    res = tune_api.tune(spec, sample(8000), seed=3)
    ratios = [c["target_ratio"] for c in res.candidates]
    assert res.loss == "targets"
    assert min(ratios) <= 1.0 < max(ratios)  # the grid holds both kinds: the choice matters
    assert res.candidates[res.best]["target_ratio"] == min(ratios)
    # the patch applies and gives a valid spec with the recommended bounds
    from dpops.analysis.tune_output import patch_document

    prov = {"source": "public", "sample": "public/s.parquet", "checked_at": "2024-01-01T00:00:00+00:00"}
    patched = load_patched(tune_api.load(spec), patch_document(res, prov)["patch"])
    assert patched.contribution.max_partitions_per_unit == res.recommended.l0
    assert patched.tuning is not None and patched.tuning.candidate == res.recommended.label
    assert patched.tuning.statement == "bounds chosen by dpops tune on a public sample on 2024-01-01"
    assert patched.spec_hash == load_patched(tune_api.load(spec), {k: v for k, v in patch_document(res, prov)[
        "patch"].items() if k != "tuning"}).spec_hash  # provenance is outside the spec hash


def test_default_grid_and_bad_grid(tmp_path):
    s = tune_api.load(spec_at(tmp_path))
    g = default_grid(s)
    assert len(g) == 27 and Candidate(2, 2) in g
    with pytest.raises(Exception, match="bounds.nope"):
        grid_from_doc(s, {"bounds": {"nope": [[0, 1]]}})
    with pytest.raises(Exception, match="l0 must be"):
        grid_from_doc(s, {"l0": [0]})
    assert apply_patch({"a": {"b": 1, "c": 2}, "l": [1]}, {"a": {"b": 3}, "l": [2]}) == {"a": {"b": 3, "c": 2}, "l": [2]}


# --------------------------------------------------------------------------- the CLI and the privacy gate


def _env(tmp_path, monkeypatch):
    root = tmp_path / "data"
    root.mkdir()
    spec = spec_at(root)
    pq.write_table(pa.Table.from_pandas(sample(), preserve_index=False), root / "private.parquet")
    (root / "data").mkdir()  # the spec's own input (input.path data/x.parquet): what a private tune may read
    pq.write_table(pa.Table.from_pandas(sample(seed=1), preserve_index=False), root / "data" / "x.parquet")
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    with open_ledger(url) as led:
        led.create_scope(ScopeDefinition(name="shop", unit="a user", unit_column="user_id", epsilon=5.0, delta=1e-6,
                                         rho=None, accountant="basic/1", adjacency="add_remove"), actor="test")
    key = tmp_path / "keys" / "noise.key"
    key.parent.mkdir()
    NoiseKey.generate(key)
    for v in ("DPOPS_DATA_ROOTS", "DPOPS_PUBLIC_ROOTS", "DPOPS_NOISE_KEY_FILE", "DPOPS_LEDGER_URL"):
        monkeypatch.delenv(v, raising=False)
    return root, spec, url, key


def _history(url):
    with open_ledger(url) as led:
        return [e for e in led.history("shop")]


def test_private_root_refused_without_the_flag(tmp_path, monkeypatch, capsys):
    root, spec, url, key = _env(tmp_path, monkeypatch)
    before = len(_history(url))
    code = main(["--ledger", url, "tune", str(spec), "--sample", str(root / "private.parquet"),
                 "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 3
    assert "--i-understand-this-reads-private-data" in err and "data root" in err
    assert len(_history(url)) == before  # nothing recorded, nothing written
    assert not (tmp_path / "o").exists()


def test_private_read_with_the_flag_is_recorded_in_the_ledger(tmp_path, monkeypatch, capsys):
    root, spec, url, key = _env(tmp_path, monkeypatch)
    out = tmp_path / "o"
    code = main(["--ledger", url, "tune", str(spec), "--sample", str(root / "data" / "x.parquet"), "--out", str(out),
                 "--i-understand-this-reads-private-data", "--reason", "first bounds for a new release",
                 "--key-file", str(key), "--actor", "alice", "--l0", "1,2", "--linf", "1,2", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0, doc
    events = [e for e in _history(url) if e.kind == "private_access"]
    assert len(events) == 1
    ev = events[0]
    assert ev.actor == "alice" and ev.scope == "shop"
    assert ev.data["reason"] == "first bounds for a new release"
    assert ev.data["fingerprint"].startswith("hmac-sha256:") and len(ev.data["fingerprint"]) > 40
    with open_ledger(url) as led:
        assert led.verify().ok  # replay accepts the entry and no budget moved
        assert led.status("shop").total == 0
    patch = (out / "patch.yaml").read_text()
    assert "bounds chosen by looking at the private data on" in patch
    assert yaml.safe_load(patch)["tuning"]["data"]["ledger_entry"] == ev.id
    assert doc["data"]["source"] == "private" and len(doc["candidates"]) == 4


def test_private_flag_needs_a_reason(tmp_path, monkeypatch, capsys):
    root, spec, url, key = _env(tmp_path, monkeypatch)
    code = main(["--ledger", url, "tune", str(spec), "--sample", str(root / "data" / "x.parquet"),
                 "--i-understand-this-reads-private-data", "--key-file", str(key), "--out", str(tmp_path / "o")])
    assert code == 3 and "--reason" in capsys.readouterr().err
    assert not [e for e in _history(url) if e.kind == "private_access"]


@pytest.mark.skipif(not hasattr(dataroots, "check_public_path"), reason="needs DPOPS_PUBLIC_ROOTS (dataroots)")
def test_public_sample_html_page(tmp_path, monkeypatch, capsys):
    root, spec, url, key = _env(tmp_path, monkeypatch)
    pub = tmp_path / "public"
    pub.mkdir()
    pq.write_table(pa.Table.from_pandas(sample(), preserve_index=False), pub / "s.parquet")
    monkeypatch.setenv("DPOPS_PUBLIC_ROOTS", str(pub))
    out = tmp_path / "o"
    code = main(["tune", str(spec), "--sample", str(pub / "s.parquet"), "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    page = (out / "tune.html").read_text()
    assert page.count("data:image/png;base64,") >= 3
    assert "http://" not in page and "https://" not in page and "<script" not in page
    assert "NOT differentially private" in page


def test_outside_every_root_refused(tmp_path, monkeypatch, capsys):
    root, spec, url, key = _env(tmp_path, monkeypatch)
    other = tmp_path / "elsewhere"
    other.mkdir()
    pq.write_table(pa.Table.from_pandas(sample(100), preserve_index=False), other / "s.parquet")
    code = main(["tune", str(spec), "--sample", str(other / "s.parquet"), "--out", str(tmp_path / "o")])
    assert code == 3
    assert not (tmp_path / "o").exists()


def test_html_page_offline(tmp_path):
    """The page itself (any sample source): embedded PNGs, no external resource."""
    from dpops.analysis.tune_output import html_page

    res = tune_api.tune(spec_at(tmp_path), sample(), seed=2)
    page = html_page(res, {"source": "public"})
    assert page.count("data:image/png;base64,") == 3  # error vs L0, vs the bound of amount, partitions kept
    assert "http://" not in page and "https://" not in page and "<script" not in page


# --------------------------------------------------------------------------- properties

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from fuzz_support import examples


@st.composite
def small_samples(draw):
    n = draw(st.integers(1, 40))
    users = draw(st.lists(st.integers(0, 7), min_size=n, max_size=n))
    parts = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    vals = draw(st.lists(st.floats(-20, 200, allow_nan=False), min_size=n, max_size=n))
    return pd.DataFrame({"user_id": [f"u{u}" for u in users], "region": [f"r{p}" for p in parts], "amount": vals})


@settings(max_examples=examples(8), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(df=small_samples(), l0s=st.lists(st.integers(1, 4), min_size=1, max_size=2, unique=True),
       linfs=st.lists(st.integers(1, 3), min_size=1, max_size=2, unique=True))
def test_one_pass_property_on_small_samples(tmp_path_factory, df, l0s, linfs):
    """For any small sample: the grid evaluated in one pass equals each candidate evaluated alone, and each
    candidate's drop shares add up to the rows ``bound_contributions`` removed."""
    spec = spec_at(tmp_path_factory.mktemp("p"))
    grid = grid_from_doc(tune_api.load(spec), {"l0": l0s, "linf": linfs, "bounds": {"amount": [[0, 10]]}})
    together = tune_api.tune(spec, df, grid=grid, seed=5)
    assert together.boundings == 1
    for cand in grid:
        alone = tune_api.tune(spec, df, grid=[cand], seed=5)
        assert [r for r in together.rows if r["candidate"] == cand.label] == alone.rows
        c = next(x for x in together.candidates if x["candidate"] == cand.label)
        count_rows = [r for r in alone.rows if r["metric"] == "count"]
        dropped = -sum(r["bias_bounding"] * r["partitions"] for r in count_rows)  # true minus bounded rows
        assert dropped == pytest.approx((c["rows_dropped_l0"] + c["rows_dropped_linf"]) * len(df))
        assert 0 <= c["units_dropped_l0"] <= 1 and 0 <= c["units_dropped_linf"] <= 1


def test_variance_quantiles_and_top_k_by_hand(tmp_path):
    """Three users in one public partition, nothing dropped by bounding: the variance and quantile biases are
    the clipping's exact effect, the quantile is the release's grid pick, top_k keeps its leader, and the
    noise is each owner's prediction (first_order_variance_error: tuning keeps the first-order variance noise,
    prediction versions 1-2; quantile_typical_rank_error, top_pick)."""
    from dpops.analysis.accuracy import first_order_variance_error, quantile_typical_rank_error, top_pick
    from dpops.release_plan import plan_release
    from pipelines.bounding import quantile_candidates

    doc = {**SPEC, "input": {**SPEC["input"], "columns": {**SPEC["input"]["columns"], "color": "string"}},
           "partitions": {"columns": ["region"], "public": ["a"]},
           "metrics": [{"type": "variance", "column": "amount", "bounds": [0, 10]},
                       {"type": "quantiles", "column": "amount", "bounds": [0, 10], "quantiles": [0.5]},
                       {"type": "top_k", "column": "color", "k": 1, "domain": ["red", "blue"]}]}
    spec = spec_at(tmp_path, doc)
    df = pd.DataFrame({"user_id": ["x", "x", "x", "y", "z", "z"], "region": ["a"] * 6,
                       "amount": [1.0, 2.0, 3.0, 30.0, 4.0, 5.0],
                       "color": ["red", "red", "blue", "blue", "blue", "blue"]})
    res = tune_api.tune(spec, df, grid=[Candidate(1, 3)], seed=1)
    assert res.not_evaluated == []
    rows = {r["type"]: r for r in res.rows}
    raw, clipped = np.array([1, 2, 3, 30, 4, 5.0]), np.array([1, 2, 3, 10, 4, 5.0])
    var = rows["variance"]
    assert var["bias_bounding"] == pytest.approx(0.0, abs=1e-9)
    assert var["bias_clipping"] == pytest.approx(clipped.var() - raw.var())
    plan = plan_release(load_patched(tune_api.load(spec), {"contribution": {
        "max_partitions_per_unit": 1, "max_rows_per_unit_per_partition": 3}}))
    mv, mq, mt = plan.metrics
    std, _, _, _ = first_order_variance_error(plan, mv, 6, float(clipped.mean() - 5.0), float(((clipped - 5.0) ** 2).mean()), 0.95)
    assert var["noise_std"] == pytest.approx(std)
    q = rows["quantiles"]
    cand = quantile_candidates(0.0, 10.0, mq.n_bins)
    pick = float(cand[np.searchsorted(cand, 3.0)])  # the smallest grid point with 3 of the 6 rows at or below
    assert q["quantity"] == "q50" and q["bias_bounding"] == 0.0
    assert q["bias_clipping"] == pytest.approx(pick - 3.0)  # true median (inverted CDF) is 3
    assert q["expected_rank_error"] == pytest.approx(quantile_typical_rank_error(mq))
    assert q["rank_error_fraction"] == pytest.approx(quantile_typical_rank_error(mq) / 6)
    t = rows["top_k"]
    assert t["top_changed_by_bounding"] == 0.0 and t["rmse"] is None
    assert t["top_pick_probability"] == pytest.approx(top_pick(mt, 2))  # blue 4, red 2
    # Linf = 1 keeps one row per user: blue 3 to red 0 (x kept its blue row) or 2 to 1 (a red one), under
    # the plan at Linf = 1
    res1 = tune_api.tune(spec, df, grid=[Candidate(1, 1)], seed=1)
    t1 = next(r for r in res1.rows if r["type"] == "top_k")
    mt1 = plan_release(load_patched(tune_api.load(spec), {"contribution": {
        "max_partitions_per_unit": 1, "max_rows_per_unit_per_partition": 1}})).metrics[2]
    assert t1["top_pick_probability"] in (pytest.approx(top_pick(mt1, 1)), pytest.approx(top_pick(mt1, 3)))


def test_a_rank_error_target_is_judged_on_the_sample(tmp_path):
    """A quantile's rank_error target: achieved = the plan's expected rank error over the bucket's bounded rows
    (mean over its partitions), divided by the allowed fraction; it is the candidate's loss. (Linf scales the
    rank error's sensitivity and the bounded rows alike, so here the two candidates tie.)"""
    from dpops.analysis.accuracy import quantile_typical_rank_error
    from dpops.release_plan import plan_release

    doc = {**SPEC, "partitions": {"columns": ["region"], "public": ["a"]},
           "metrics": [{"type": "quantiles", "column": "amount", "bounds": [0, 100], "quantiles": [0.5]}],
           "accuracy": {"targets": [{"kind": "rank_error", "metric": "quantiles_amount", "max_rank_error": 0.05,
                                     "at_units": 50}]}}
    spec = spec_at(tmp_path, doc)
    rng = np.random.default_rng(4)
    df = pd.DataFrame({"user_id": [f"u{i % 60}" for i in range(1200)], "region": ["a"] * 1200,
                       "amount": rng.uniform(0, 100, 1200)})  # 60 users, 20 rows each
    grid = [Candidate(1, 1), Candidate(1, 20)]
    res = tune_api.tune(spec, df, grid=grid, seed=2)
    assert res.loss == "targets"
    for cand, summ in zip(grid, res.candidates, strict=True):
        m = plan_release(load_patched(tune_api.load(spec), {"contribution": {
            "max_partitions_per_unit": cand.l0, "max_rows_per_unit_per_partition": cand.linf}})).metrics[0]
        want = quantile_typical_rank_error(m) / (60 * cand.linf) / 0.05
        assert summ["target_ratio"] == pytest.approx(want)
        assert summ["loss"] == summ["target_ratio"]


# --------------------------------------------------------------------------- the private input in disguise


@pytest.mark.parametrize("disguise", ["hard_link", "copy"])
def test_a_link_or_copy_of_the_private_input_under_a_public_root_is_private(tmp_path, monkeypatch, capsys, disguise):
    """Issue 25 item 7a: a hard link or a byte-identical copy of the spec's own input under a public root was
    read as public with no ledger entry. It is the private input: refused without the flag; with it, recorded
    on the spec's scope with the fingerprint of the input file, and the patch says "private"."""
    import os
    import shutil

    root, spec, url, key = _env(tmp_path, monkeypatch)
    pub = tmp_path / "public"
    pub.mkdir()
    monkeypatch.setenv("DPOPS_PUBLIC_ROOTS", str(pub))
    src = root / "data" / "x.parquet"
    if disguise == "hard_link":
        os.link(src, pub / "s.parquet")
    else:
        shutil.copyfile(src, pub / "s.parquet")
    before = len(_history(url))
    code = main(["--ledger", url, "tune", str(spec), "--sample", str(pub / "s.parquet"), "--out", str(tmp_path / "o"),
                 "--l0", "1", "--linf", "1"])
    err = capsys.readouterr().err
    assert code == 3 and "private input" in err and "--i-understand-this-reads-private-data" in err, err
    assert len(_history(url)) == before and not (tmp_path / "o").exists()
    code = main(["--ledger", url, "tune", str(spec), "--sample", str(pub / "s.parquet"), "--out", str(tmp_path / "o"),
                 "--i-understand-this-reads-private-data", "--reason", "r", "--key-file", str(key), "--l0", "1",
                 "--linf", "1", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0, doc
    events = [e for e in _history(url) if e.kind == "private_access"]
    assert len(events) == 1 and events[0].scope == "shop"
    assert doc["data"]["source"] == "private" and doc["data"]["ledger_entry"] == events[0].id
    # a different public file of the same size is still public (the content decides, not the size)
    other = pub / "other.parquet"
    data = bytearray(src.read_bytes())
    data[len(data) // 2] ^= 1
    other.write_bytes(bytes(data))
    from dpops.release.private_reads import open_sample

    assert open_sample(tune_api.load(spec), other).private is False


def test_the_python_api_refuses_a_private_path_and_a_foreign_private_file(tmp_path, monkeypatch):
    """Issue 25 item 7a: ``analysis.tune(spec, "<data root>/x.csv")`` read private data with no ledger entry (only
    the CLI checked paths). A path is now checked as a public sample. And a flagged read of a file under a data
    root that is not the spec's own input is refused: it would be recorded on the spec's scope, not the scope
    of the data read."""
    from dpops.release.private_reads import open_sample
    from dpops.errors import SpecError
    from dpops.noise.randomness import load_key

    root, spec, url, key = _env(tmp_path, monkeypatch)
    with pytest.raises(SpecError, match="data root"):
        tune_api.tune(spec, str(root / "data" / "x.parquet"), grid=[Candidate(1, 1)], seed=1)
    with pytest.raises(SpecError, match="data root"):
        tune_api.tune(spec, root / "private.parquet", grid=[Candidate(1, 1)], seed=1)
    with open_ledger(url) as led, pytest.raises(SpecError, match="not an input file"):
        open_sample(tune_api.load(spec), root / "private.parquet", allow_private=True, ledger=led, actor="a",
                    reason="r", fingerprint_key=load_key(key))
    assert not [e for e in _history(url) if e.kind == "private_access"]
    # the recorded private read, handed over as its SampleAccess, is read by Beam (dpops.release.tuning), never by
    # the pure analysis API, which refuses it
    from dpops.release.tuning import tune_private

    with open_ledger(url) as led:
        access = open_sample(tune_api.load(spec), root / "data" / "x.parquet", allow_private=True, ledger=led,
                             actor="a", reason="r", fingerprint_key=load_key(key))
    with pytest.raises(InvalidParameter, match="private data .* runs on Beam workers"):
        tune_api.tune(spec, access, grid=[Candidate(1, 1)], seed=1)
    assert access.private and tune_private(spec, access, grid=[Candidate(1, 1)], seed=1).sample_rows > 0


def test_a_public_tune_cannot_replace_the_record_of_a_private_one(tmp_path, monkeypatch, capsys):
    """Issue 25 item 7b: tune on the private input (recorded), apply the patch; then a one-candidate "public" tune
    over exactly those privately chosen values, and ``spec apply-patch``, used to replace ``source: private`` so
    that manifests said "chosen on a public sample". apply-patch now refuses that patch and writes nothing; a
    second private tune may still replace the record."""
    root, spec, url, key = _env(tmp_path, monkeypatch)
    pub = tmp_path / "public"
    pub.mkdir()
    pq.write_table(pa.Table.from_pandas(sample(seed=2), preserve_index=False), pub / "s.parquet")
    monkeypatch.setenv("DPOPS_PUBLIC_ROOTS", str(pub))
    private = ["--i-understand-this-reads-private-data", "--reason", "r", "--key-file", str(key)]
    assert main(["--ledger", url, "tune", str(spec), "--sample", str(root / "data" / "x.parquet"), "--out",
                 str(tmp_path / "t1"), *private, "--l0", "1,2", "--linf", "1,2"]) == 0
    tuned = root / "spec.tuned.yaml"
    assert main(["spec", "apply-patch", str(spec), str(tmp_path / "t1" / "patch.yaml"), "--out", str(tuned)]) == 0
    capsys.readouterr()
    doc = yaml.safe_load(tuned.read_text())
    assert doc["tuning"]["data"]["source"] == "private"
    c = doc["contribution"]
    assert main(["tune", str(tuned), "--sample", str(pub / "s.parquet"), "--out", str(tmp_path / "t2"),
                 "--l0", str(c["max_partitions_per_unit"]), "--linf", str(c["max_rows_per_unit_per_partition"])]) == 0
    capsys.readouterr()
    public_patch = yaml.safe_load((tmp_path / "t2" / "patch.yaml").read_text())
    assert public_patch["patch"]["tuning"]["data"]["source"] == "public" and public_patch["tuning"]["candidates"] == 1
    laundered = root / "spec.laundered.yaml"
    code = main(["spec", "apply-patch", str(tuned), str(tmp_path / "t2" / "patch.yaml"), "--out", str(laundered)])
    err = capsys.readouterr().err
    assert code == 3 and "chosen by looking at private data" in err, err
    assert not laundered.exists()
    # a new private tune of the tuned spec is a new recorded read: it may replace the record
    assert main(["--ledger", url, "tune", str(tuned), "--sample", str(root / "data" / "x.parquet"), "--out",
                 str(tmp_path / "t3"), *private, "--l0", "1", "--linf", "1"]) == 0
    assert main(["spec", "apply-patch", str(tuned), str(tmp_path / "t3" / "patch.yaml"), "--out",
                 str(root / "spec.again.yaml")]) == 0


def test_tune_seed_unmet_targets_and_heavy_drops_are_said(tmp_path, monkeypatch, capsys):
    """Issue 26 section 4: --seed makes two runs identical; when no candidate meets the targets the output
    says so and names the binding target; a recommendation dropping many rows is warned about."""
    import json

    root, _, url, key = _env(tmp_path, monkeypatch)
    doc = {**SPEC, "accuracy": {"confidence": 0.95, "targets": [
        {"kind": "error", "metric": "count", "max_error": 0.001, "at_units": 100}]}}  # unreachable
    spec = spec_at(root, doc)
    pub = tmp_path / "public"
    pub.mkdir()
    pq.write_table(pa.Table.from_pandas(sample(), preserve_index=False), pub / "s.parquet")
    monkeypatch.setenv("DPOPS_PUBLIC_ROOTS", str(pub))
    docs = []
    for out in ("o1", "o2"):
        code = main(["tune", str(spec), "--sample", str(pub / "s.parquet"), "--out", str(tmp_path / out),
                     "--l0", "1", "--linf", "1", "--seed", "7", "--json"])
        assert code == 0, capsys.readouterr().err
        docs.append(json.loads(capsys.readouterr().out))
    assert docs[0]["candidates"] == docs[1]["candidates"] and docs[0]["seed"] == 7  # reproducible bounding
    warnings = " ".join(docs[0]["warnings"])
    assert "no candidate meets every accuracy target" in warnings and "accuracy.targets[0] (error on count" in warnings
    dropped = docs[0]["candidates"][0]["rows_dropped_l0"] + docs[0]["candidates"][0]["rows_dropped_linf"]
    assert dropped > 0.10 and "drops" in warnings  # L0 = Linf = 1 on a sample of several rows per user
    code = main(["tune", str(spec), "--sample", str(pub / "s.parquet"), "--out", str(tmp_path / "o3"),
                 "--l0", "1", "--linf", "1", "--seed", "7"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0 and "WARNING: no candidate meets every accuracy target" in out and "WARNING: the " in out


@pytest.mark.skipif(not hasattr(dataroots, "check_public_path"), reason="needs DPOPS_PUBLIC_ROOTS (dataroots)")
@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_tune_never_writes_through_a_link_planted_in_its_out_directory(tmp_path, monkeypatch, capsys, link):
    """``--out`` was checked as a directory, then ``out/results.json`` written by name: whoever can write the out
    directory could leave results.json as a link to a file in a public root, and tune's exact functions of the
    sample were written into that published file. Now each file is renamed into place: the planted link is
    replaced, its target left as it was (fails on the old code: the public file held the results)."""
    import os

    root, spec, url, key = _env(tmp_path, monkeypatch)
    pub = tmp_path / "public"
    pub.mkdir()
    pq.write_table(pa.Table.from_pandas(sample(), preserve_index=False), pub / "s.parquet")
    published = pub / "published.json"
    published.write_text("{}")
    monkeypatch.setenv("DPOPS_PUBLIC_ROOTS", str(pub))
    out = tmp_path / "shared-out"
    out.mkdir()
    (os.symlink if link == "symlink" else os.link)(published, out / "results.json")
    code = main(["tune", str(spec), "--sample", str(pub / "s.parquet"), "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    assert published.read_text() == "{}"
    assert not (out / "results.json").is_symlink() and "recommended" in (out / "results.json").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["patch.yaml", "results.json", "tune.html"]  # no temp left
