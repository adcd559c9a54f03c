"""Issue 11 item 6: input fingerprint re-checked, -0.0 labels, wide top_k codes, test-mode refusal manifests."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dpops import release  # noqa: E402
from dpops.release import execute  # noqa: E402
from dpops.errors import InputDataError  # noqa: E402
from dpops.ledger import ScopeDefinition, open_ledger  # noqa: E402
from dpops.noise.randomness import test_random  # noqa: E402
from test_pipeline_helpers import request, run, write_input, write_spec  # noqa: E402
from test_runs import IV, FakeKey, FakePipeline, planner  # noqa: E402
from test_runs import write_input as write_day  # noqa: E402


@pytest.fixture
def env(tmp_path):
    import yaml

    doc = {
        "name": "purchases_test",
        "input": {"path": "data/{start:%Y-%m-%d}.parquet", "format": "parquet",
                  "columns": {"user_id": "string", "region": "string", "amount": "float"}},
        "privacy_unit": {"column": "user_id", "description": "a user", "adjacency": "add_remove"},
        "budget": {"scope": "shop", "epsilon": 0.5, "delta": 0},
        "contribution": {"max_partitions_per_unit": 1, "max_rows_per_unit_per_partition": 2},
        "partitions": {"columns": ["region"], "public": ["north", "south"]},
        "metrics": [{"type": "count"}],
    }
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(doc))
    data = write_day(tmp_path)
    led = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    led.create_scope(ScopeDefinition(name="shop", unit="a user", unit_column="user_id", epsilon=5.0, delta=1e-6,
                                     rho=None, accountant="basic/1", adjacency="add_remove"), actor="t")
    yield spec, data, led
    led.close()


def test_input_changed_during_the_computation_is_never_published(env, tmp_path):
    spec, data, led = env
    pipe = FakePipeline()

    def swapping_pipeline(req):
        out = pipe(req)
        write_day(tmp_path, amounts=(9.0, 9.0, 9.0, 9.0))  # another process rewrites the day's file
        return out

    with pytest.raises(InputDataError, match="input files changed since the run was prepared .*while the pipeline"):
        release.execute_release(spec, *IV, ledger=led, key=FakeKey(), run_release=swapping_pipeline, planner=planner)
    (rec,) = led.runs()
    assert rec.state == "started"  # noise was drawn: charged, never refunded, never published
    assert not (tmp_path / "out/published").exists() or not any((tmp_path / "out/published").rglob("data.parquet"))
    assert not any((tmp_path / "out/staged").rglob("data.parquet"))


def test_input_changed_before_the_computation_is_refunded(env, tmp_path):
    spec, data, led = env
    pipe = FakePipeline()
    ctx = release.prepare(spec, *IV, key=FakeKey(), planner=planner)
    release.reserve(ctx, led)
    write_day(tmp_path, amounts=(7.0, 7.0, 7.0, 7.0))
    with pytest.raises(InputDataError, match="before the computation started"):
        execute._run_steps(ctx, led, publish_output=True, runner="FnApiRunner", runner_options=(), run_release=pipe,
                        gx_checks=False, restates=None)
    assert pipe.calls == 0
    assert [r.state for r in led.runs()] == ["released"]


def test_float_private_partition_label_is_normalised(tmp_path):
    cols = {"user_id": "string", "region": "float", "amount": "float", "category": "string"}
    n = 300
    rows = {"user_id": [f"u{i}" for i in range(n)], "region": [-0.0] + [0.0] * (n - 1),
            "amount": [1.0] * n, "category": ["x"] * n}
    spec = write_spec(tmp_path, [{"type": "count"}], {"columns": ["region"], "private": {"strategy": "truncated_geometric"}},
                      columns=cols, delta=1e-6, epsilon=5.0)
    df, _, _ = run(request(spec, [write_input(tmp_path, rows)], tmp_path / "stage"))
    assert len(df) == 1 and df["region"][0] == 0.0
    assert math.copysign(1.0, float(df["region"][0])) == 1.0  # not -0.0: the first row's sign bit stays private


def test_top_k_codes_beyond_int16():
    from pipelines.io import ReadConfig, prepare_batch

    domain = tuple(range(40_000))
    cfg = ReadConfig(format="parquet", types={"u": "string", "p": "string", "c": "int"}, unit_column="u",
                     partition_columns=("p",), value_columns=(), category_columns={"c": domain})
    batch = pa.RecordBatch.from_pydict({"u": ["a", "b", "c"], "p": ["x", "x", "x"], "c": [39_999, 32_768, 5]})
    rows, _, _ = prepare_batch(batch, 0, 0, cfg, test_random(1))
    assert sorted(rows["c:c"].tolist()) == [5, 32_768, 39_999]


def test_test_mode_refusal_manifest_leaves_out_the_input_fingerprint(env, tmp_path):
    from dpops.manifest import read_manifest
    from dpops.manifest.run_hook import TEST_REFUSAL_FINGERPRINT, write_run_manifest

    spec, data, led = env
    ctx = release.prepare(spec, *IV, randomness="test", test_seed=4, planner=planner)
    path = write_run_manifest(ctx, led, {"state": "refused", "reason": "budget"}, manifests_dir=tmp_path / "m")
    text = Path(path).read_text()
    assert ctx.input_fingerprint not in text and ctx.run_id not in text and ctx.run_id not in Path(path).name
    m = read_manifest(path)
    assert m["run_key"]["input_fingerprint"] == TEST_REFUSAL_FINGERPRINT and m["outcome"]["state"] == "refused"
    # keyed mode keeps its (secret-keyed) fingerprint
    kctx = release.prepare(spec, *IV, key=FakeKey(), planner=planner)
    kpath = write_run_manifest(kctx, led, {"state": "refused", "reason": "budget"}, manifests_dir=tmp_path / "k")
    assert json.loads(Path(kpath).read_text())["run_key"]["input_fingerprint"] == kctx.input_fingerprint



def test_an_unchanged_input_is_hashed_twice_not_three_times(env, monkeypatch):
    """``prepare`` hashes the input (the run key) and the check after the computation hashes it again (what was
    read is what the key names); the check before ``start`` compares ``prepare``'s stat snapshot instead."""
    import dpops.release.computation as computation

    spec, data, led = env
    calls = []
    real = computation.input_fingerprint
    monkeypatch.setattr(computation, "input_fingerprint", lambda *a, **k: calls.append(1) or real(*a, **k))
    release.execute_release(spec, *IV, ledger=led, key=FakeKey(), run_release=FakePipeline(), planner=planner)
    assert len(calls) == 1  # after the computation only; prepare's pass is the other one
    assert [r.state for r in led.runs()] == ["committed"]


def test_a_same_size_overwrite_with_its_mtime_set_back_is_refunded_before_start(env):
    """The snapshot is not the mtime alone: an in-place overwrite of the same size whose mtime is set back still
    moves the ctime, so the check before ``start`` re-hashes, sees the change and refunds. A test-only pause of
    30 ms puts the write past the coarse clock tick of the snapshot (Linux timestamps move in jiffies)."""
    import os
    import time

    spec, data, led = env
    pipe = FakePipeline()
    ctx = release.prepare(spec, *IV, key=FakeKey(), planner=planner)
    assert ctx.input_stats is not None
    release.reserve(ctx, led)
    st = os.stat(data)
    time.sleep(0.03)
    raw = bytearray(open(data, "rb").read())
    raw[len(raw) // 2] ^= 1  # same size, other bytes, same inode
    with open(data, "r+b") as fh:
        fh.write(raw)
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime set back: only the ctime shows the write
    assert (os.stat(data).st_size, os.stat(data).st_ino, os.stat(data).st_mtime_ns) == (st.st_size, st.st_ino,
                                                                                      st.st_mtime_ns)
    with pytest.raises(InputDataError, match="before the computation started"):
        execute._run_steps(ctx, led, publish_output=True, runner="FnApiRunner", runner_options=(), run_release=pipe,
                           gx_checks=False, restates=None)
    assert pipe.calls == 0
    assert [r.state for r in led.runs()] == ["released"]


def test_a_file_rewritten_between_the_input_checks_and_the_fingerprint_is_refused_before_reserve(env, tmp_path,
                                                                                                 monkeypatch):
    """The file the input checks passed must be the file the run key names: a writer that replaces the day's file
    right after ``check_input`` (here: renamed over it) made ``prepare`` fingerprint the new file, and the check
    before ``start`` compared a snapshot taken after the checks, so the pipeline would read, after the charge, a
    file that no input check had seen. Now ``prepare`` refuses, nothing reserved (fails on the old code: prepare
    returned a context)."""
    import dpops.release.preparation as preparation

    spec, data, led = env
    real = preparation.check_input

    def racing_check(s, paths):
        real(s, paths)
        import os

        other = write_day(tmp_path, day="other", amounts=(7.0, 7.0, 7.0, 7.0))
        os.replace(other, data)  # a different file at the checked name, after the checks passed

    monkeypatch.setattr(preparation, "check_input", racing_check)
    with pytest.raises(InputDataError, match="changed while they were checked"):
        release.prepare(spec, *IV, key=FakeKey(), planner=planner)
    assert led.runs() == []
    monkeypatch.setattr(preparation, "check_input", real)
    assert release.prepare(spec, *IV, key=FakeKey(), planner=planner).input_stats is not None  # a stable file passes


def test_an_input_swapped_during_the_computation_and_put_back_is_never_published(env, tmp_path):
    """The check after the computation hashed the input again, and only that: a writer that renamed the checked
    file aside while the pipeline read, put another file in its place, then renamed the original back before the
    check, left bytes that hash as the run key's, so a release of other data was published under the key (with the
    noise of the key's own data). The rename moves the ctime, which the stat snapshot now compares too. Fails on
    the old code (the run was committed)."""
    import os

    spec, data, led = env
    pipe = FakePipeline()

    def swapping_pipeline(req):
        aside = data.with_name("aside.parquet")
        os.replace(data, aside)
        other = write_day(tmp_path, day="other", amounts=(9.0, 9.0, 9.0, 9.0))
        os.replace(other, data)  # the pipeline reads this file
        out = pipe(req)
        os.replace(aside, data)  # and the checked one is back, same inode, same bytes
        return out

    with pytest.raises(InputDataError, match="input files changed since the run was prepared .*while the pipeline"):
        release.execute_release(spec, *IV, ledger=led, key=FakeKey(), run_release=swapping_pipeline, planner=planner)
    (rec,) = led.runs()
    assert rec.state == "started"  # noise was drawn: charged, never published
    assert not any((tmp_path / "out").rglob("data.parquet"))


def test_a_public_partition_file_swapped_during_the_computation_and_put_back_is_never_published(
        env, tmp_path, tmp_path_factory, monkeypatch):
    """The public partition list is part of the run's input (its rows enter the keyed fingerprint) and the
    pipeline reads it again: renamed aside while the pipeline ran, another list in its place, then renamed back,
    it re-read as the key's list, so the check after the computation passed. The stat snapshot covers the file
    now (``dpops.inputs.snapshot_locations``). Fails on the old code (the run was committed)."""
    import os

    import yaml

    spec, _, led = env
    public = tmp_path_factory.mktemp("public")  # the operator's public root, apart from the data root
    monkeypatch.setenv("DPOPS_PUBLIC_ROOTS", str(public))
    monkeypatch.delenv("DPOPS_DATA_ROOTS", raising=False)
    (public / "regions.csv").write_text("region\nnorth\nsouth\n")
    doc = yaml.safe_load(spec.read_text())
    doc["partitions"] = {"columns": ["region"], "public_file": str(public / "regions.csv")}
    spec.write_text(yaml.safe_dump(doc))
    pipe = FakePipeline()

    def swapping_pipeline(req):
        path = public / "regions.csv"
        os.replace(path, public / "aside.csv")
        (public / "other.csv").write_text("region\nnorth\nsouth\nwest\n")
        os.replace(public / "other.csv", path)  # the list the pipeline reads
        out = pipe(req)
        os.replace(public / "aside.csv", path)  # and the checked one is back, same bytes
        return out

    with pytest.raises(InputDataError, match="input files changed since the run was prepared"):
        release.execute_release(spec, *IV, ledger=led, key=FakeKey(), run_release=swapping_pipeline, planner=planner)
    (rec,) = led.runs()
    assert rec.state == "started"  # noise was drawn: charged, never published
    assert not any((tmp_path / "out").rglob("data.parquet"))
