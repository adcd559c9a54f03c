"""The check after a release's read compares the bytes the reader consumed with the run key's fingerprint.

The run key (so the keyed noise) names the input by its fingerprint, so the published output must be computed
from exactly the fingerprinted bytes. The CSV reader hashes every byte it reads (``pipelines.io.ReadDigest``),
the digests reach the driver as salted tags (``dpops.inputs.read_digest_tag``) with the run's internal counters,
and ``check_input_unchanged`` compares them with the tags of the fingerprint pass's digests instead of hashing the
input a second time (at 10M rows that pass was 0.7 s of
the release's critical path). What must hold:

- a complete digest is the sha256 and size of the whole file, whatever its lines (a property over any bytes
  and any read size); a read that stopped early has none;
- the digests survive the trip through the counters and never stay in them (they are unkeyed hashes of a
  private file: nothing may write them);
- a real release reads the input once for its check (no second hashing pass) and publishes;
- a pipeline that read other bytes than the fingerprinted ones is refused, even when the file on disk is the
  fingerprinted one (the old hash-again check passed it: the output of other data under the key's noise);
- a read without digests (Parquet row groups) still hashes the input again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

import pipelines.io as pio
from dpops import release
from dpops.errors import InputDataError
from dpops.ledger import ScopeDefinition, open_ledger
from dpops.noise.randomness import NoiseKey
from fuzz_support import examples
from dpops.inputs import read_digest_tag
from pipelines.io import ReadConfig, ReadDigest, iter_record_batches
from pipelines.transforms import read_digest_counters, split_read_digests

IV = ("2024-01-01", "2024-01-02")
TYPES = {"user_id": "string", "region": "string", "amount": "float"}
CFG = ReadConfig(format="csv", types=TYPES, unit_column="user_id", partition_columns=("region",),
                 value_columns=("amount",), batch_rows=5)
HEADER = b"user_id,region,amount\n"
SALT = b"s" * 32


def _read_whole(path: Path) -> ReadDigest:
    digest = ReadDigest()
    for _ in iter_record_batches((0, str(path), None, 0), CFG, {}, digest):
        pass
    return digest


@settings(max_examples=examples(60))
@given(body=st.binary(max_size=400) | st.lists(st.sampled_from([b"u1,north,3\n", b'u2,"so""uth",4\r\n', b"\r",
                                                                b'"open,', b"\xff\xfe", b",,,\n", b"\n"]),
                                                max_size=40).map(b"".join),
       read_bytes=st.integers(1, 64), bom=st.booleans())
@example(body=b"u1,north,3\r", read_bytes=1, bom=False)  # a lone CR at the end, held back across reads
@example(body=b"", read_bytes=3, bom=True)
def test_a_complete_digest_is_the_whole_files_sha256(tmp_path_factory, body, read_bytes, bom):
    """Any bytes after the header (malformed lines, CR/CRLF, invalid UTF-8, a too-long line), any read size:
    the reader consumes the file to its end, and the digest is the file's."""
    data = (b"\xef\xbb\xbf" if bom else b"") + HEADER + body
    path = tmp_path_factory.mktemp("d") / "in.csv"
    path.write_bytes(data)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pio, "CSV_READ_BYTES", read_bytes)
        mp.setattr(pio, "MAX_LINE_BYTES", 64)  # some lines are too long: dropped, still hashed
        digest = _read_whole(path)
    assert digest.complete
    assert (digest.size, digest.hexdigest()) == (len(data), hashlib.sha256(data).hexdigest())
    rest, got = split_read_digests({"rows_read": 3, **read_digest_counters(4, digest, SALT)})
    sha = hashlib.sha256(data).hexdigest()
    assert rest == {"rows_read": 3} and got == {4: (len(data), read_digest_tag(SALT, len(data), sha))}
    assert got[4][1] != sha and got[4][1] != read_digest_tag(b"t" * 32, len(data), sha)  # salted, never the sha


def test_a_read_stopped_early_has_no_digest(tmp_path, monkeypatch):
    path = tmp_path / "in.csv"
    path.write_bytes(HEADER + b"".join(b"u%d,north,%d\n" % (i, i) for i in range(1000)))
    monkeypatch.setattr(pio, "CSV_READ_BYTES", 16)  # many reads: the read-ahead cannot have reached the end
    digest = ReadDigest()
    gen = iter_record_batches((0, str(path), None, 0), CFG, {}, digest)
    next(gen)
    gen.close()
    assert not digest.complete and read_digest_counters(0, digest, SALT) == {}


def test_split_read_digests_takes_no_damaged_digest_as_a_match():
    digest = ReadDigest()
    digest.update(b"abc")
    digest.complete = True
    good = read_digest_counters(2, digest, SALT)
    assert split_read_digests(good)[1] == {2: (3, read_digest_tag(SALT, 3, hashlib.sha256(b"abc").hexdigest()))}
    missing = {k: v for k, v in good.items() if not k.endswith("/w5")}
    assert split_read_digests(missing) == ({}, {})  # a lost word: no digest, the driver hashes again
    overflowed = {k: (v + (1 << 32) if k.endswith("/w0") else v) for k, v in good.items()}
    assert split_read_digests(overflowed) == ({}, {})  # a word summed twice past 32 bits


# --------------------------------------------------------------------------- real releases


def _setup(tmp_path: Path, fmt: str) -> tuple[Path, Path, Path, object]:
    doc = {
        "name": "digest",
        "input": {"path": "data/{start:%Y-%m-%d}." + fmt, "format": fmt, "columns": TYPES},
        "privacy_unit": {"column": "user_id", "description": "a user-day", "adjacency": "add_remove"},
        "budget": {"scope": "shop", "epsilon": 1.0, "delta": 0},
        "contribution": {"max_partitions_per_unit": 2, "max_rows_per_unit_per_partition": 2},
        "partitions": {"columns": ["region"], "public": ["north", "south", "east"]},
        "metrics": [{"type": "count"}, {"type": "sum", "column": "amount", "bounds": [0, 100]}],
    }
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(doc))
    (tmp_path / "data").mkdir()
    data = tmp_path / f"data/2024-01-01.{fmt}"
    _write_day(data, seed=3)
    key = tmp_path / "noise.key"
    NoiseKey.generate(key)
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    ledger.create_scope(ScopeDefinition(name="shop", unit="a user-day", unit_column="user_id", epsilon=5.0,
                                        delta=1e-6, rho=None, accountant="basic/1", adjacency="add_remove"),
                        actor="test")
    return spec, data, key, ledger


def _write_day(path: Path, seed: int) -> None:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    rng = np.random.default_rng(seed)
    n = 300
    table = pa.table({"user_id": [f"u{i}" for i in rng.integers(0, 60, n)],
                      "region": rng.choice(["north", "south", "east"], n).tolist(),
                      "amount": rng.uniform(0, 120, n)})
    if path.suffix == ".parquet":
        pq.write_table(table, path)
    else:
        pcsv.write_csv(table, path)


def _capturing_pipeline(seen: list):
    from pipelines.release_pipeline import run_release

    def run(req):
        res = run_release(req)
        seen.append(res)
        return res

    return run


def _counting_hash(monkeypatch) -> list:
    import dpops.release.computation as computation

    calls: list = []
    real = computation.input_fingerprint

    def counting(*a, **kw):
        calls.append(a[0])
        return real(*a, **kw)

    monkeypatch.setattr(computation, "input_fingerprint", counting)
    return calls


@pytest.mark.parametrize("randomness", ["keyed", "os"])  # os: the driver draws the salt and ships it
def test_a_csv_release_checks_the_bytes_it_read_without_hashing_again(tmp_path, monkeypatch, randomness):
    monkeypatch.setenv("DPOPS_STATE_DIR", str(tmp_path / "state"))  # the internal run log, scanned below
    spec, data, key, ledger = _setup(tmp_path, "csv")
    calls = _counting_hash(monkeypatch)
    seen: list = []
    try:
        out = release.execute_release(spec, *IV, ledger=ledger, key_path=str(key), randomness=randomness,
                                      run_release=_capturing_pipeline(seen))
        assert out.state == "published"
        assert calls == []  # the check after the read hashed nothing again
        (res,) = seen
        content = data.read_bytes()
        sha = hashlib.sha256(content).hexdigest()
        tag = read_digest_tag(res.read_digest_salt, len(content), sha)
        assert len(res.read_digest_salt) == 32 and res.read_digests == {str(data): (len(content), tag)}
        assert not any("read_digest" in k for k in res.internal)  # never among the counters that are written
        written = [p for p in tmp_path.rglob("*") if p.is_file() and p != data]
        assert written and not any(h.encode() in p.read_bytes() for p in written for h in (sha, tag))  # nor any file
        (log,) = (tmp_path / "state").rglob("*.internal.json")
        assert json.loads(log.read_text())["input_check_after_read"] == "reader_digests"
    finally:
        ledger.close()


def test_a_pipeline_that_read_other_bytes_is_refused_though_the_file_is_the_fingerprinted_one(tmp_path, monkeypatch):
    """The reader opens another file than the one fingerprinted (a mount or object-store view that changed
    under it, a link swapped and restored): the file at the checked path never changes, so its stat snapshot
    and a second hash both match the run key, and the old check published a release of other data under the
    key's noise. The bytes the reader consumed are compared now. Fails on the old code (published)."""
    spec, data, key, ledger = _setup(tmp_path, "csv")
    other = tmp_path / "other.csv"
    _write_day(other, seed=4)
    real_open = pio.open_input
    monkeypatch.setattr(pio, "open_input", lambda path: real_open(str(other)) if path == str(data) else real_open(path))
    try:
        with pytest.raises(InputDataError, match="read input bytes other than those the run was prepared with"):
            release.execute_release(spec, *IV, ledger=ledger, key_path=str(key))
        (rec,) = ledger.runs()
        assert rec.state == "started"  # noise was drawn: charged, never published
        assert not any((tmp_path / "out").rglob("published/**/data.parquet"))
    finally:
        ledger.close()


def test_a_parquet_release_still_hashes_its_input_again(tmp_path, monkeypatch):
    monkeypatch.setenv("DPOPS_STATE_DIR", str(tmp_path / "state"))
    spec, data, key, ledger = _setup(tmp_path, "parquet")
    calls = _counting_hash(monkeypatch)
    seen: list = []
    try:
        out = release.execute_release(spec, *IV, ledger=ledger, key_path=str(key), run_release=_capturing_pipeline(seen))
        assert out.state == "published"
        assert seen[0].read_digests == {}  # row groups are not one byte stream
        assert calls == [[str(data)]]  # the check after the read hashed the file again
        (log,) = (tmp_path / "state").rglob("*.internal.json")
        assert json.loads(log.read_text())["input_check_after_read"] == "hashed_again"
    finally:
        ledger.close()
