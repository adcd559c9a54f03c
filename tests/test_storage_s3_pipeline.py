"""End to end with the real Beam job (FnApiRunner): input and output on S3 (moto's server), then
``dpops manifest verify``. Needs ``pipelines/`` to read and write through Beam FileSystems (the staging
location is an ``s3://`` URI here) and to forward ``AWS_ENDPOINT_URL`` as Beam's ``--s3_endpoint_url``."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from dpops.cli.main import main
from dpops.ledger import ScopeDefinition, open_ledger
from dpops.noise.randomness import NoiseKey
from dpops.storage import Location, files

import s3_support

moto_server = s3_support.moto_server  # pytest fixtures
s3 = s3_support.s3

pytest.importorskip("apache_beam")
pytest.importorskip("boto3")


def test_release_run_with_beam_on_s3_publishes_and_verifies(s3, tmp_path, monkeypatch, capsys):
    bucket = s3.uri()
    rng = np.random.default_rng(7)
    n = 2000
    table = pa.table({"user_id": [f"u{i}" for i in rng.integers(0, 300, n)],
                      "region": rng.choice(["north", "south", "east"], n).tolist(),
                      "amount": rng.uniform(0, 10, n)})
    for part in (0, 1):  # two input files, found by an object-store glob
        buf = io.BytesIO()
        pq.write_table(table.slice(part * n // 2, n // 2), buf)
        files.write_bytes(Location.parse(f"{bucket}/data/2024-01-01/part-{part}.parquet"), buf.getvalue())
    doc = {
        "name": "s3_e2e",
        "input": {"path": f"{bucket}/data/{{start:%Y-%m-%d}}/part-*.parquet", "format": "parquet",
                  "columns": {"user_id": "string", "region": "string", "amount": "float"}},
        "privacy_unit": {"column": "user_id", "description": "a user's purchases on one day", "adjacency": "add_remove"},
        "budget": {"scope": "shop", "epsilon": 1.0, "delta": 0},
        "contribution": {"max_partitions_per_unit": 1, "max_rows_per_unit_per_partition": 5},
        "partitions": {"columns": ["region"], "public": ["north", "south", "east"]},
        "metrics": [{"type": "count"}, {"type": "sum", "column": "amount", "bounds": [0, 10]}],
        "output": {"root": f"{bucket}/out"},
    }
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(doc))
    monkeypatch.setenv("DPOPS_OUTPUT_ROOTS", f"{bucket}/out")
    monkeypatch.setenv("DPOPS_DATA_ROOTS", f"{bucket}/data")
    monkeypatch.delenv("DPOPS_MANIFESTS_DIR", raising=False)
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    led = open_ledger(url)
    led.create_scope(ScopeDefinition(name="shop", unit="a user's purchases", unit_column="user_id", epsilon=2.0,
                                     delta=1e-6, rho=None, accountant="basic/1", adjacency="add_remove"), actor="t")
    led.close()
    key = tmp_path / "noise.key"
    NoiseKey.generate(key)
    base = ["--interval", "2024-01-01/2024-01-02", "--ledger", url, "--key-file", str(key)]
    assert main(["release", "run", str(spec), *base, "--publish", "--no-gx-checks", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["state"] == "published" and out["output_uri"].startswith(f"{bucket}/out/published/s3_e2e/")
    published = Location.parse(out["output_uri"])
    result = pq.read_table(io.BytesIO(files.read_bytes(published / "data.parquet")))
    assert sorted(result.column("region").to_pylist()) == ["east", "north", "south"]
    # nothing staged is left in a temporary prefix, and the private run log is not in the bucket
    keys = [o["Key"] for o in s3.client().list_objects_v2(Bucket=s3.bucket)["Contents"]]
    assert not [k for k in keys if "/.tmp-" in k and not k.endswith("/")], keys
    assert not [k for k in keys if "internal" in k], keys
    manifests = Location.parse(f"{bucket}/out/manifests/s3_e2e")
    assert main(["manifest", "verify", out["run_id"], "--manifests", str(manifests), "--ledger", url,
                 "--key-file", str(key), "--json"]) == 0
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["ok"] is True
