"""The estimation's check after its read compares the bytes each read consumed (issue 27; as the release's).

A charged estimation reads the interval once on the driver engine and once per counting pass on the Beam engine.
Each read of a CSV file hashes the bytes it parsed and reports a salted tag of them
(``pipelines.estimation.ReadDigestsOf``, ``dpops.release.estimation.read_rows``); the check after the read
(``dpops.release.computation.check_input_unchanged``) compares every read's with the fingerprint pass's. Before,
the estimation hashed the file at the path again: a reader that saw other bytes while the path and its stat
stayed the same (a view that changed under it) committed an estimate of other data under the run key.
Deterministic: fixed data, fixed keys, no statistical threshold.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import pipelines.io as pio
from dpops.analysis.estimate import EstimateConfig
from dpops.errors import InputDataError
from dpops.inputs import read_digest_tag
from dpops.ledger import ScopeDefinition, open_ledger
from dpops.noise.randomness import NoiseKey
from dpops.release import estimation as R
from dpops.release.execute import estimate
from dpops.release.pipeline_seam import CONFLICTING_READS, estimation_digest_salt
from dpops.release.preparation import prepare
from fuzz_support import examples

DAY = ("2024-01-01", "2024-01-02")
REGIONS = [f"r{i}" for i in range(6)]


def _env(tmp_path: Path, monkeypatch, fmt: str = "csv") -> tuple[Path, Path, Path]:
    rng = np.random.default_rng(3)
    n = 900
    table = pa.table({"user_id": [f"u{int(i)}" for i in rng.integers(0, 150, n)],
                      "region": rng.choice(REGIONS, n).tolist(), "amount": rng.uniform(0, 50, n)})
    (tmp_path / "data").mkdir()
    data = tmp_path / "data" / f"2024-01-01.{fmt}"
    if fmt == "csv":
        pacsv.write_csv(table, data)
    else:
        pq.write_table(table, data, row_group_size=300)
    doc = {"name": f"est_digest_{fmt}", "schedule": "0 0 * * *",
           "input": {"path": f"data/{{start:%Y-%m-%d}}.{fmt}", "format": fmt,
                     "columns": {"user_id": "string", "region": "string", "amount": "float"}},
           "privacy_unit": {"column": "user_id", "description": "a user's purchases", "adjacency": "add_remove"},
           "budget": {"scope": "shop", "epsilon": 0.5, "delta": 0},
           "contribution": {"max_partitions_per_unit": 2, "max_rows_per_unit_per_partition": 3},
           "partitions": {"columns": ["region"], "public": REGIONS},
           "metrics": [{"type": "count"}, {"type": "sum", "column": "amount", "bounds": [0, 50]}]}
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(doc))
    key = tmp_path / "noise.key"
    NoiseKey.generate(key)
    monkeypatch.chdir(tmp_path)
    for var in ("DPOPS_LEDGER_URL", "DPOPS_MANIFESTS_DIR", "DPOPS_NOISE_KEY_FILE", "DPOPS_DATA_ROOTS"):
        monkeypatch.delenv(var, raising=False)
    return spec, data, key


def _ledger(tmp_path: Path):
    led = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    led.create_scope(ScopeDefinition(name="shop", unit="a user's purchases", unit_column="user_id", epsilon=5.0,
                                     delta=1e-6, rho=None, accountant="basic/1", adjacency="add_remove"), actor="test")
    return led


def _counting_hash(monkeypatch) -> list:
    import dpops.release.computation as computation

    calls: list = []
    real = computation.input_fingerprint

    def counting(*a, **kw):
        calls.append(list(a[0]))
        return real(*a, **kw)

    monkeypatch.setattr(computation, "input_fingerprint", counting)
    return calls


CONFIG = EstimateConfig(epsilon=1.0, method="quantile/1", max_l0=8, max_linf=8)  # two Beam passes: pairs, values


@pytest.mark.parametrize("engine", ["beam", "driver"])
def test_a_csv_estimation_checks_the_bytes_each_read_consumed_without_hashing_again(tmp_path, monkeypatch, engine):
    spec, data, key = _env(tmp_path, monkeypatch)
    calls = _counting_hash(monkeypatch)
    written: list[bytes] = []
    from pipelines import fs

    real_write = fs.write_bytes
    monkeypatch.setattr(fs, "write_bytes", lambda path, b: (written.append(bytes(b)), real_write(path, b))[1])
    with _ledger(tmp_path) as led:
        est = estimate(spec, *DAY, config=CONFIG, ledger=led, key_path=str(key), engine=engine)
        assert est.state == "committed"
    assert calls == []  # the check after the read hashed nothing again
    # every read reported the tag of exactly the file's bytes: one read on the driver, one per pass on Beam
    ctx = prepare(spec, *DAY, key_path=str(key), for_estimation=True)
    run = R.EstimationRun(ctx, R.run_key_of(ctx, CONFIG))
    rng = R.random_source(ctx, run.key)
    reads: list = []
    R.compute_estimation(run, CONFIG, rng, engine=engine, reads=reads)
    content = data.read_bytes()
    sha = hashlib.sha256(content).hexdigest()
    salt = estimation_digest_salt(rng)
    assert len(salt) == 32
    assert reads == [{str(data): (len(content), read_digest_tag(salt, len(content), sha))}] * (
        2 if engine == "beam" else 1)
    # the sha256 itself never left the reader: no scratch or counts file the passes wrote holds it
    assert not any(sha.encode() in b for b in written)
    if engine == "beam":
        assert written  # the passes did write (scratch and counts) through the hooked function


@pytest.mark.parametrize("engine", ["beam", "driver"])
def test_an_estimation_that_read_other_bytes_is_refused_though_the_file_is_the_fingerprinted_one(
        tmp_path, monkeypatch, engine):
    """The reader opens another file than the one fingerprinted, while the file at the checked path never
    changes (its stat snapshot and a second hash both match the run key). Fails on the old check, which
    hashed the path again and committed an estimate of other data."""
    spec, data, key = _env(tmp_path, monkeypatch)
    other = tmp_path / "other.csv"
    other.write_bytes(data.read_bytes().replace(b"u1", b"u7"))
    real_open = pio.open_input
    monkeypatch.setattr(pio, "open_input", lambda path: real_open(str(other)) if path == str(data) else real_open(path))
    with _ledger(tmp_path) as led:
        with pytest.raises(InputDataError, match="read input bytes other than those the run was prepared with"):
            estimate(spec, *DAY, config=CONFIG, ledger=led, key_path=str(key), engine=engine)
        (rec,) = led.runs()
        assert rec.state == "started"  # charged (noise was drawn), never committed


def test_a_parquet_estimation_still_hashes_its_input_again(tmp_path, monkeypatch):
    spec, data, key = _env(tmp_path, monkeypatch, "parquet")
    calls = _counting_hash(monkeypatch)
    with _ledger(tmp_path) as led:
        assert estimate(spec, *DAY, config=CONFIG, ledger=led, key_path=str(key), engine="beam").state == "committed"
    assert calls == [[str(data)]]  # row groups are not one byte stream: the file was hashed again


@settings(max_examples=examples(80), deadline=None)
@given(reads=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.sampled_from(["a" * 64, "b" * 64])),
                      max_size=8), split=st.integers(0, 8))
def test_joined_reads_mark_every_disagreement_and_do_not_depend_on_the_merge_order(reads, split):
    """``ReadDigestsOf``: a file read twice with different bytes is CONFLICTING, whatever the order in which
    workers' partial joins meet; a file read once, or twice alike, keeps its (size, tag)."""
    from pipelines.estimation import ReadDigestsOf

    fn = ReadDigestsOf()

    def joined(items):
        acc = fn.create_accumulator()
        for r in items:
            acc = fn.add_input(acc, r)
        return acc

    whole = fn.extract_output(joined(reads))
    parts = fn.extract_output(fn.merge_accumulators([joined(reads[split:]), joined(reads[:split])]))
    for index in {r[0] for r in reads}:
        seen = {(s, t) for i, s, t in reads if i == index}
        for got in (whole[index], parts[index]):
            if len(seen) == 1:
                assert tuple(got) == next(iter(seen))
            else:
                assert got[1] == CONFLICTING_READS
    assert set(whole) == set(parts) == {r[0] for r in reads}


def test_the_check_refuses_any_read_that_differs_and_hashes_again_only_when_a_digest_is_missing(tmp_path,
                                                                                               monkeypatch):
    """One pass with a matching digest and one without: hashed again; one conflicting: refused, though the
    file at the path is the fingerprinted one and another pass matched."""
    from dpops.release.computation import check_input_unchanged

    spec, data, key = _env(tmp_path, monkeypatch)
    calls = _counting_hash(monkeypatch)
    ctx = prepare(spec, *DAY, key_path=str(key), for_estimation=True)
    salt = b"s" * 32
    size, sha = ctx.input_digests[str(data)]
    good = {str(data): (size, read_digest_tag(salt, size, sha))}
    assert check_input_unchanged(ctx, "t", read_digests=[good, good], read_digest_salt=salt) == "reader_digests"
    assert calls == []
    assert check_input_unchanged(ctx, "t", read_digests=[good, {}], read_digest_salt=salt) == "hashed_again"
    assert calls == [[str(data)]]
    for bad in ({str(data): (size, CONFLICTING_READS)}, {str(data): (size + 1, good[str(data)][1])},
                {str(tmp_path / "elsewhere.csv"): good[str(data)]}):
        with pytest.raises(InputDataError, match="read input bytes other than"):
            check_input_unchanged(ctx, "t", read_digests=[good, bad], read_digest_salt=salt)
