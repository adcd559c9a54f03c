"""The release pipeline with input and staging on an S3-compatible object store (moto's standalone
server on 127.0.0.1), reached the standard way: ``AWS_ENDPOINT_URL`` plus the usual credential
variables; the pipeline forwards the endpoint to Beam's S3 filesystem as ``--s3_endpoint_url``."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_pipeline_helpers import request, run, write_spec
from test_pipeline_streaming import COUNT_SUM, _input

from dpops.errors import StorageError
from pipelines import release_pipeline

boto3 = pytest.importorskip("boto3")
MOTO = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def s3_endpoint(monkeypatch, tmp_path):
    if not Path(MOTO).exists():
        pytest.skip("moto_server is not installed")
    port = _free_port()
    log = open(tmp_path / "moto.log", "wb")  # noqa: SIM115 - closed in the finally below, after the server
    proc = subprocess.Popen([MOTO, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log)
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.2)
        else:
            pytest.fail("moto_server did not start")
        url = f"http://127.0.0.1:{port}"
        for k, v in {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                     "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(k, v)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_release_with_input_and_staging_on_s3(tmp_path, s3_endpoint):
    spec = write_spec(tmp_path, COUNT_SUM, {"columns": ["region"], "private": {"strategy": "truncated_geometric"}},
                      l0=3, linf=2, epsilon=4.0, delta=1e-5)
    inp = _input(tmp_path, 3000)
    local, _, _ = run(request(spec, [inp], tmp_path / "local"))
    s3 = boto3.client("s3")  # endpoint from AWS_ENDPOINT_URL, as the pipeline's workers get it
    s3.create_bucket(Bucket="rel")
    s3.upload_file(str(inp), "rel", "in/2024-01-01.parquet")
    req = request(spec, ["s3://rel/in/2024-01-01.parquet"], "s3://rel/runs/r1")
    res = release_pipeline.run_release(req)
    assert res.output_file == "s3://rel/runs/r1/data.parquet"
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="rel")["Contents"])
    assert keys == ["in/2024-01-01.parquet", "runs/r1/data.parquet", "runs/r1/summary.json"]  # _parts removed
    body = s3.get_object(Bucket="rel", Key="runs/r1/data.parquet")["Body"].read()
    assert pq.read_table(pa.BufferReader(body)).to_pandas().equals(local)
    with pytest.raises(StorageError, match="already holds an output"):
        release_pipeline.run_release(req)
