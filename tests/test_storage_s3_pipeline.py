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

from dpops.cli.main import main
from dpops.storage import Location, files

from s3_support import s3_release

pytest.importorskip("apache_beam")
pytest.importorskip("boto3")


def test_release_run_with_beam_on_s3_publishes_and_verifies(s3, tmp_path, monkeypatch, capsys):
    rng = np.random.default_rng(7)
    n = 2000
    table = pa.table({"user_id": [f"u{i}" for i in rng.integers(0, 300, n)],
                      "region": rng.choice(["north", "south", "east"], n).tolist(),
                      "amount": rng.uniform(0, 10, n)})
    parts = {f"2024-01-01/part-{part}.parquet": table.slice(part * n // 2, n // 2) for part in (0, 1)}
    rel = s3_release(s3, tmp_path, monkeypatch, "s3_e2e", parts,  # two input files, found by an object-store glob
                     "{start:%Y-%m-%d}/part-*.parquet", epsilon=1.0, cap=2.0, public=["north", "south", "east"],
                     metrics=[{"type": "count"}, {"type": "sum", "column": "amount", "bounds": [0, 10]}])
    bucket, url, key = rel.bucket, rel.ledger_url, rel.key_file
    assert main(["release", "run", *rel.args(), "--publish", "--no-gx-checks", "--json"]) == 0
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
