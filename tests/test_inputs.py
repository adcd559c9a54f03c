"""Input resolution, schema checks and the keyed fingerprint."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from dpops.errors import InputDataError, InvalidParameter
from dpops.inputs import (
    TestFingerprintKey,
    check_input,
    input_fingerprint,
    parse_interval,
    resolve_input_paths,
)
from dpops.spec import load_spec

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "daily_purchases.yaml"


def make_spec(tmp_path: Path, **input_overrides):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["input"].update(input_overrides)
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(doc))
    return load_spec(p)


def write_parquet(path: Path, **cols):
    path.parent.mkdir(parents=True, exist_ok=True)
    default = {
        "user_id": pa.array(["u1", "u2"]),
        "region": pa.array(["north", "south"]),
        "amount": pa.array([1.5, 2.0]),
        "category": pa.array(["books", "toys"]),
        "ts": pa.array([0, 1], pa.timestamp("s")),
    }
    default.update(cols)
    default = {k: v for k, v in default.items() if v is not None}
    pq.write_table(pa.table(default), path)
    return path


def test_interval_parsing():
    iv = parse_interval("2024-01-01/2024-01-02")
    assert iv.start_iso == "2024-01-01T00:00:00+00:00" and iv.end_iso == "2024-01-02T00:00:00+00:00"
    assert iv.slug == "20240101T000000Z_20240102T000000Z"
    # the same instants written differently give the same interval (and so the same run key)
    assert parse_interval("2024-01-01T00:00:00Z", "2024-01-02T02:00:00+02:00") == parse_interval(
        "2024-01-01", "2024-01-02T00:00:00+00:00"
    )
    assert parse_interval("2024-01-01T02:00:00+02:00", "2024-01-02").start_iso == "2024-01-01T00:00:00+00:00"
    with pytest.raises(InvalidParameter, match="must be before"):
        parse_interval("2024-01-02/2024-01-01")
    with pytest.raises(InvalidParameter, match="START/END"):
        parse_interval("2024-01-01")
    with pytest.raises(InvalidParameter, match="not an ISO-8601"):
        parse_interval("yesterday/today")


def test_resolve_paths_relative_to_spec(tmp_path):
    spec = make_spec(tmp_path)
    paths = resolve_input_paths(spec, "2024-03-05", "2024-03-06")
    assert paths == [str(tmp_path / "data/purchases/2024-03-05.parquet")]


def test_resolve_glob(tmp_path):
    spec = make_spec(tmp_path, path="data/{start:%Y%m%d}/part-*.parquet")
    for i in (2, 0, 1):
        write_parquet(tmp_path / f"data/20240305/part-{i}.parquet")
    paths = resolve_input_paths(spec, "2024-03-05", "2024-03-06")
    assert [Path(p).name for p in paths] == ["part-0.parquet", "part-1.parquet", "part-2.parquet"]
    with pytest.raises(InputDataError, match="no file matches"):
        resolve_input_paths(spec, "2024-03-06", "2024-03-07")


def test_check_input_ok_and_extra_columns_ignored(tmp_path):
    spec = make_spec(tmp_path)
    p = write_parquet(tmp_path / "x.parquet", extra=pa.array([1, 2]), amount=pa.array([1, 2], pa.int32()))
    check_input(spec, [str(p)])  # int widens to a declared float; extra column ignored


@pytest.mark.parametrize(
    "cols,match",
    [
        ({"amount": None}, r"x.parquet: column 'amount' declared in input.columns is missing"),
        ({"amount": pa.array(["1", "2"])}, r"x.parquet: column 'amount' has type string but input.columns declares float"),
        ({"region": pa.array([1, 2])}, r"x.parquet: column 'region' has type int64 but input.columns declares string"),
    ],
)
def test_check_input_schema_errors(tmp_path, cols, match):
    spec = make_spec(tmp_path)
    p = write_parquet(tmp_path / "x.parquet", **cols)
    with pytest.raises(InputDataError, match=match) as info:
        check_input(spec, [str(p)])
    assert info.value.exit_code == 4


def test_check_input_missing_unreadable_corrupt(tmp_path):
    spec = make_spec(tmp_path)
    with pytest.raises(InputDataError, match=r"nope.parquet does not exist"):
        check_input(spec, [str(tmp_path / "nope.parquet")])
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"this is not parquet at all")
    with pytest.raises(InputDataError, match=r"bad.parquet is not a readable Parquet file"):
        check_input(spec, [str(bad)])
    with pytest.raises(InputDataError, match=r"no input files"):
        check_input(spec, [])
    if os.geteuid() != 0:  # root reads anything; the permission case only means something for other users
        p = write_parquet(tmp_path / "locked.parquet")
        p.chmod(0)
        with pytest.raises(InputDataError, match=r"locked.parquet is not readable"):
            check_input(spec, [str(p)])
    d = tmp_path / "adir.parquet"
    d.mkdir()
    with pytest.raises(InputDataError, match=r"adir.parquet is not a regular file"):
        check_input(spec, [str(d)])


def test_unreadable_file_via_open_error(tmp_path, monkeypatch):
    # Works as root too: simulate EACCES from open().
    spec = make_spec(tmp_path)
    p = write_parquet(tmp_path / "locked.parquet")
    real_open = open

    def fake_open(file, *a, **k):
        if str(file) == str(p):
            raise PermissionError(13, "Permission denied")
        return real_open(file, *a, **k)

    monkeypatch.setattr("builtins.open", fake_open)
    with pytest.raises(InputDataError, match=r"locked.parquet is not readable: Permission denied"):
        check_input(spec, [str(p)])


def test_check_csv_header(tmp_path):
    spec = make_spec(tmp_path, format="csv", path="d.csv")
    good = tmp_path / "d.csv"
    good.write_text("user_id,region,amount,category,ts,extra\nu1,north,1.0,books,2024-01-01T00:00:00Z,x\n")
    check_input(spec, [str(good)])
    bad = tmp_path / "e.csv"
    bad.write_text("user_id,region,category\nu1,north,books\n")
    with pytest.raises(InputDataError, match=r"e.csv: column 'amount' declared in input.columns is missing"):
        check_input(spec, [str(bad)])
    empty = tmp_path / "f.csv"
    empty.write_text("")
    with pytest.raises(InputDataError, match=r"f.csv: empty CSV file"):
        check_input(spec, [str(empty)])


def test_fingerprint_is_keyed_and_content_sensitive(tmp_path):
    a = write_parquet(tmp_path / "a" / "2024-01-01.parquet")
    key = TestFingerprintKey()
    f1 = input_fingerprint([str(a)], key)
    assert len(f1) == 64
    # the same content elsewhere (data root moved) keeps the fingerprint
    b = tmp_path / "b" / "2024-01-01.parquet"
    b.parent.mkdir()
    b.write_bytes(a.read_bytes())
    assert input_fingerprint([str(b)], key) == f1

    class OtherKey:
        key_id = "other"

        def hmac(self, data: bytes) -> bytes:
            import hashlib
            import hmac

            return hmac.new(b"another secret key of 32 bytes!!", data, hashlib.sha256).digest()

    assert input_fingerprint([str(a)], OtherKey()) != f1  # keyed: not a plain hash
    # not a plain sha256 of the file either
    import hashlib

    assert hashlib.sha256(a.read_bytes()).hexdigest() != f1
    # one changed byte of content changes it
    write_parquet(a, amount=pa.array([1.5, 2.5]))
    assert input_fingerprint([str(a)], key) != f1


def test_fingerprint_order_independent_and_name_sensitive(tmp_path):
    p1 = write_parquet(tmp_path / "d" / "p1.parquet")
    p2 = write_parquet(tmp_path / "d" / "p2.parquet", amount=pa.array([3.0, 4.0]))
    key = TestFingerprintKey()
    assert input_fingerprint([str(p1), str(p2)], key) == input_fingerprint([str(p2), str(p1)], key)
    before = input_fingerprint([str(p1), str(p2)], key)
    p3 = tmp_path / "d" / "p3.parquet"
    p2.rename(p3)
    assert input_fingerprint([str(p1), str(p3)], key) != before  # same bytes, different name
    with pytest.raises(InputDataError, match="listed twice"):
        input_fingerprint([str(p1), str(p1)], key)


@pytest.mark.parametrize("writer", ["pandas", "pyarrow"])
@pytest.mark.parametrize("column", ["category", "amount", "region", "ts"])
def test_an_all_missing_column_passes_the_checks_whatever_is_declared(tmp_path, writer, column):
    """Issue 25 item 5: a declared column in which no unit has a value is stored by pandas as type ``null``;
    check_input refused it (exit 4) while the same day with one unit's value published. Both the schema
    check and the GX input check accept it now, and the reader drops exactly the rows a null drops."""
    import pandas as pd

    from dpops.release.gx_checks import check_input_schema
    from pipelines.io import ReadConfig, iter_record_batches, prepare_batch, work_items

    spec = make_spec(tmp_path)
    p = tmp_path / "x.parquet"
    cols = {"user_id": ["u1", "u2"], "region": ["north", "south"], "amount": [1.5, 2.0], "category": ["a", "b"],
            "ts": pd.to_datetime(["2024-01-01T01:00:00", "2024-01-01T02:00:00"])}
    cols[column] = [None, None]
    if writer == "pandas":
        pd.DataFrame(cols).to_parquet(p)
    else:
        pq.write_table(pa.table({k: pa.array(v) if k != column else pa.nulls(2) for k, v in cols.items()}), p)
    assert pq.read_schema(p).field(column).type == pa.null()
    check_input(spec, [str(p)])
    assert check_input_schema([str(p)], spec.input.columns, "parquet").success
    cfg = ReadConfig(format="parquet", types=dict(spec.input.columns), unit_column="user_id", partition_columns=("region",),
                     value_columns=("amount",), category_columns={"category": ("a", "b")}, time_column="ts",
                     time_window_ns=(1_704_067_200 * 10**9, 1_704_153_600 * 10**9))

    class Rng:
        def uint64(self, n):
            import numpy as np

            return np.zeros(n, np.uint64)

    kept = 0
    for item in work_items([str(p)], "parquet"):
        for batch, offset in iter_record_batches(item, cfg, {}):
            rows, _names, stats = prepare_batch(batch, 0, offset, cfg, Rng(), pair_salt=(1, 2))
            kept += len(rows["u"])
    # a null region, amount or time drops both rows; a null category keeps them (code -1: outside the domain)
    assert kept == (2 if column == "category" else 0)
