"""The release pipeline with input and staging on an S3-compatible object store (moto's standalone
server on 127.0.0.1), reached the standard way: ``AWS_ENDPOINT_URL`` plus the usual credential
variables; the pipeline forwards the endpoint to Beam's S3 filesystem as ``--s3_endpoint_url``."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_pipeline_helpers import request, run, write_spec
from test_pipeline_streaming import COUNT_SUM, _input

from dpops.errors import StorageError
from pipelines import release_pipeline

pytest.importorskip("boto3")


def test_release_with_input_and_staging_on_s3(tmp_path, s3):
    """``s3``: tests/s3_support.py's moto server (session) and a fresh bucket, AWS_* variables set."""
    spec = write_spec(tmp_path, COUNT_SUM, {"columns": ["region"], "private": {"strategy": "truncated_geometric"}},
                      l0=3, linf=2, epsilon=4.0, delta=1e-5)
    inp = _input(tmp_path, 3000)
    local, _, _ = run(request(spec, [inp], tmp_path / "local"))
    import boto3

    client = boto3.client("s3")  # endpoint from AWS_ENDPOINT_URL, as the pipeline's workers get it
    client.upload_file(str(inp), s3.bucket, "in/2024-01-01.parquet")
    req = request(spec, [s3.uri("in/2024-01-01.parquet")], s3.uri("runs/r1"))
    res = release_pipeline.run_release(req)
    assert res.output_file == s3.uri("runs/r1/data.parquet")
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=s3.bucket)["Contents"])
    assert keys == ["in/2024-01-01.parquet", "runs/r1/data.parquet", "runs/r1/summary.json"]  # _parts removed
    body = client.get_object(Bucket=s3.bucket, Key="runs/r1/data.parquet")["Body"].read()
    assert pq.read_table(pa.BufferReader(body)).to_pandas().equals(local)
    with pytest.raises(StorageError, match="already holds an output"):
        release_pipeline.run_release(req)
