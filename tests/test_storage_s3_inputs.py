"""Inputs on an object store: glob expansion, schema check and the keyed fingerprint through pyarrow.fs."""

from __future__ import annotations

import hashlib
import hmac

import pyarrow as pa
import pytest

from dpops.errors import InputDataError, SpecError
from dpops.inputs import check_input, input_fingerprint, resolve_input_paths
from dpops.storage import Location, files

from test_inputs import make_spec, write_parquet



class Key:
    key_id = "k"

    def hmac(self, data: bytes) -> bytes:
        return hmac.new(b"secret", data, hashlib.sha256).digest()


def put_parquet(loc: Location, local_dir, name: str, **cols) -> None:
    p = write_parquet(local_dir / name, **cols)
    files.write_bytes(loc, p.read_bytes())


def test_s3_glob_schema_and_fingerprint(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("DPOPS_DATA_ROOTS", s3.uri("data"))
    spec = make_spec(tmp_path, path=s3.uri("data/{start:%Y%m%d}/part-*.parquet"))
    local = tmp_path / "local"
    for i in (2, 0, 1):
        put_parquet(Location.parse(s3.uri(f"data/20240305/part-{i}.parquet")), local, f"part-{i}.parquet")
    files.write_bytes(Location.parse(s3.uri("data/20240305/sub/part-9.parquet")), b"not matched: one level deeper")
    paths = resolve_input_paths(spec, "2024-03-05", "2024-03-06")
    assert paths == [s3.uri(f"data/20240305/part-{i}.parquet") for i in (0, 1, 2)]
    check_input(spec, paths)
    fp = input_fingerprint(paths, Key())
    # The same bytes under the same names locally give the same fingerprint: names are relative to the files'
    # common directory, content hashed through the same layer.
    assert fp == input_fingerprint([str(local / f"part-{i}.parquet") for i in (0, 1, 2)], Key())
    put_parquet(Location.parse(s3.uri("data/20240305/part-1.parquet")), local, "changed.parquet",
                amount=pa.array([9.5, 2.0]))
    assert input_fingerprint(paths, Key()) != fp  # a changed object changes the fingerprint
    with pytest.raises(InputDataError, match="no file matches"):
        resolve_input_paths(spec, "2024-03-06", "2024-03-07")


def test_s3_schema_errors_and_missing(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("DPOPS_DATA_ROOTS", s3.uri("data"))
    spec = make_spec(tmp_path, path=s3.uri("data/{start:%Y-%m-%d}.parquet"))
    (path,) = resolve_input_paths(spec, "2024-03-05", "2024-03-06")
    with pytest.raises(InputDataError, match="does not exist"):
        check_input(spec, [path])
    put_parquet(Location.parse(path), tmp_path, "x.parquet", amount=None)
    with pytest.raises(InputDataError, match="column 'amount' declared in input.columns is missing"):
        check_input(spec, [path])


def test_s3_input_outside_data_roots_refused(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("DPOPS_DATA_ROOTS", s3.uri("data"))
    spec = make_spec(tmp_path, path=s3.uri("private/{start:%Y-%m-%d}.parquet"))
    with pytest.raises(SpecError, match="outside the allowed data roots"):
        resolve_input_paths(spec, "2024-03-05", "2024-03-06")
