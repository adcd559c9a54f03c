"""A release over 1M rows with input and output on S3 (moto), computed by isolated EXTERNAL SDK workers
(tests/cluster_support.py: they cannot see the driver's working, temporary, input or output directories;
the noise key's directory is visible to them as a mounted secret), publishes; ``dpops manifest verify``
passes; the published table is byte-identical to the same release computed in-process (FnApiRunner)
with the same key. The same with two SDK workers.

Everything goes through the CLI (``dpops release run --publish``), as an operator would run it. This
needs the pipeline to write its shards through Beam FileSystems to the staging URI and the storage layer
to take s3:// inputs, outputs and manifests (issue 10); it fails where either is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from cluster_support import portable_cluster, pythonpath_env, s3_env, start_moto
from dpops.ledger import ScopeDefinition, open_ledger
from dpops.noise.randomness import NoiseKey

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

BUCKET = "dpops-cluster"
N_ROWS = 1_000_000
N_USERS = 100_000
INTERVAL = "2024-01-01/2024-01-02"
SCOPE_EPS = 10.0


def _spec_doc() -> dict:
    return {
        "name": "cluster_release",
        "input": {"path": f"s3://{BUCKET}/in/{{start:%Y-%m-%d}}.parquet", "format": "parquet",
                  "columns": {"user_id": "string", "region": "string", "amount": "float"}},
        "privacy_unit": {"column": "user_id", "description": "a user-day", "adjacency": "add_remove"},
        "budget": {"scope": "cluster", "epsilon": 1.0, "delta": 1e-6},
        "contribution": {"max_partitions_per_unit": 3, "max_rows_per_unit_per_partition": 2},
        "partitions": {"columns": ["region"], "private": {"strategy": "truncated_geometric"}},
        "metrics": [{"type": "count"}, {"type": "sum", "column": "amount", "bounds": [0, 100]},
                    {"type": "mean", "column": "amount", "bounds": [0, 100]}],
        "output": {"root": f"s3://{BUCKET}/out"},
    }


def _s3(port: int):
    import boto3

    return boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="testing",
                        aws_secret_access_key="testing", region_name="us-east-1")


def _wipe_prefix(client, prefix: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=BUCKET, Key=obj["Key"])


def _read_uri(client, uri: str) -> bytes:
    u = urlparse(uri)
    assert u.scheme == "s3" and u.netloc == BUCKET, f"published outside the S3 output root: {uri}"
    return client.get_object(Bucket=u.netloc, Key=u.path.lstrip("/"))["Body"].read()


def _new_ledger(path: Path) -> str:
    url = f"sqlite:///{path}"
    led = open_ledger(url)
    led.create_scope(ScopeDefinition(name="cluster", unit="a user-day", unit_column="user_id", epsilon=SCOPE_EPS,
                                     delta=1e-5, rho=None, accountant="basic/1", adjacency="add_remove"), actor="test")
    led.close()
    return url


def _dpops(args: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpops.cli.main", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def _release(spec: Path, ledger: str, key: Path, runner: str, options: list[str], *, cwd: Path,
             env: dict[str, str]) -> dict:
    args = ["release", "run", str(spec), "--interval", INTERVAL, "--ledger", ledger, "--key-file", str(key),
            "--publish", "--no-gx-checks", "--json", "--runner", runner]
    for o in options:
        args += ["--runner-option", o]
    proc = _dpops(args, cwd=cwd, env=env)
    assert proc.returncode == 0, f"{runner} release failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    out = json.loads(proc.stdout)
    assert out["state"] == "published", out
    return out


# The operator allow-lists: input and output both live in the test bucket (a URI root, as in production).
_ROOTS = {"DPOPS_DATA_ROOTS": f"s3://{BUCKET}", "DPOPS_OUTPUT_ROOTS": f"s3://{BUCKET}"}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """moto, the 1M-row input on S3, the noise key (a 'mounted secret'), and the in-process reference."""
    base = tmp_path_factory.mktemp("cluster_release")
    moto = start_moto(base / "logs")
    try:
        client = _s3(moto.port)
        client.create_bucket(Bucket=BUCKET)
        gen = np.random.default_rng(20240101)
        users = gen.integers(0, N_USERS, N_ROWS)
        table = pa.table({
            "user_id": pa.array([f"u{u}" for u in users], pa.string()),
            "region": pa.array([f"r{r:03d}" for r in gen.zipf(1.3, N_ROWS) % 1000], pa.string()),
            "amount": pa.array(gen.uniform(-10, 120, N_ROWS)),
        })
        local = base / "input.parquet"
        pq.write_table(table, local)
        client.upload_file(str(local), BUCKET, "in/2024-01-01.parquet")
        local.unlink()
        secrets = base / "secrets"
        secrets.mkdir()
        key = secrets / "noise.key"
        NoiseKey.generate(key)

        ref = base / "reference"
        ref.mkdir()
        spec = ref / "spec.yaml"
        spec.write_text(yaml.safe_dump(_spec_doc()))
        env = {**os.environ, **pythonpath_env(), **s3_env(moto.port), "DPOPS_STATE_DIR": str(ref / "state"),
               **_ROOTS}
        env.pop("DPOPS_MANIFESTS_DIR", None)
        out = _release(spec, _new_ledger(ref / "ledger.sqlite"), key, "FnApiRunner", [
            f"--s3_endpoint_url=http://127.0.0.1:{moto.port}"], cwd=ref, env=env)
        reference = _read_uri(client, out["output_uri"].rstrip("/") + "/data.parquet")
        assert pq.read_table(pa.BufferReader(reference)).num_rows > 0
        _wipe_prefix(client, "out/")  # the same run id is published again by each cluster run, on a new ledger
        yield {"moto": moto, "client": client, "key": key, "reference": reference, "reference_out": out}
    finally:
        moto.stop()


@pytest.mark.parametrize("parallelism", [1, 2])
def test_release_on_isolated_workers_matches_in_process(world, tmp_path, parallelism):
    client = world["client"]
    with portable_cluster(tmp_path, parallelism=parallelism, moto=world["moto"]) as cluster:
        spec = cluster.cwd / "spec.yaml"  # on the driver only: workers cannot read it
        spec.write_text(yaml.safe_dump(_spec_doc()))
        ledger = _new_ledger(cluster.cwd / "ledger.sqlite")
        env = {**os.environ, **cluster.env, "TMPDIR": str(cluster.tmp), "DPOPS_STATE_DIR": str(cluster.cwd / "state"),
               **_ROOTS}
        env.pop("DPOPS_MANIFESTS_DIR", None)
        try:
            out = _release(spec, ledger, world["key"], "PortableRunner", cluster.options(), cwd=cluster.cwd, env=env)
            assert out["run_id"] == world["reference_out"]["run_id"]  # same key, input and spec: the same run
            published = _read_uri(client, out["output_uri"].rstrip("/") + "/data.parquet")
            assert published == world["reference"], "the published table differs from the in-process release"
            assert cluster.workers_started() == parallelism
            verify = _dpops(["manifest", "verify", out["run_id"], "--ledger", ledger, "--key-file", str(world["key"]),
                             "--manifests", f"s3://{BUCKET}/out/manifests/cluster_release"], cwd=cluster.cwd, env=env)
            assert verify.returncode == 0, verify.stdout[-3000:] + verify.stderr[-3000:]
            assert "verified: run" in verify.stdout
            # issue 19 item 8: the isolated workers' exact counters reached the driver (Beam metrics) and its
            # private state dir only; none is in the bucket
            logs = list((cluster.cwd / "state").rglob("*.internal.json"))
            assert len(logs) == 1 and json.loads(logs[0].read_text())["rows_read"] == N_ROWS
            keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="out/")
                    for o in page.get("Contents", [])]
            assert not [k for k in keys if "internal" in k or "/.tmp-" in k], keys
        finally:
            _wipe_prefix(client, "out/")


def test_a_csv_release_on_isolated_workers_checks_the_bytes_its_workers_read(world, tmp_path):
    """CSV input on S3, read by an isolated worker: the worker's digest of the bytes it read (pipelines.io.ReadDigest)
    reaches the driver with the internal counters, the check after the read compares it with the fingerprint
    instead of downloading the object again, and it is in neither the internal log nor the bucket."""
    import hashlib

    import pyarrow.csv as pcsv

    client = world["client"]
    gen = np.random.default_rng(11)
    n = 20_000
    local = tmp_path / "input.csv"
    pcsv.write_csv(pa.table({"user_id": [f"u{u}" for u in gen.integers(0, 2_000, n)],
                             "region": [f"r{r}" for r in gen.integers(0, 20, n)],
                             "amount": gen.uniform(-10, 120, n)}), local)
    digest = hashlib.sha256(local.read_bytes()).hexdigest()
    client.upload_file(str(local), BUCKET, "in-csv/2024-01-01.csv")
    doc = _spec_doc()
    doc["input"]["path"] = f"s3://{BUCKET}/in-csv/{{start:%Y-%m-%d}}.csv"
    doc["input"]["format"] = "csv"
    with portable_cluster(tmp_path, parallelism=1, moto=world["moto"]) as cluster:
        spec = cluster.cwd / "spec.yaml"
        spec.write_text(yaml.safe_dump(doc))
        env = {**os.environ, **cluster.env, "TMPDIR": str(cluster.tmp), "DPOPS_STATE_DIR": str(cluster.cwd / "state"),
               **_ROOTS}
        env.pop("DPOPS_MANIFESTS_DIR", None)
        try:
            out = _release(spec, _new_ledger(cluster.cwd / "ledger.sqlite"), world["key"], "PortableRunner",
                           cluster.options(), cwd=cluster.cwd, env=env)
            assert out["state"] == "published"
            (log,) = (cluster.cwd / "state").rglob("*.internal.json")
            internal = json.loads(log.read_text())
            assert internal["input_check_after_read"] == "reader_digests" and internal["rows_read"] == n
            assert not [k for k in internal if "digest" in k and k != "input_check_after_read"]
            assert digest not in log.read_text()
            keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="out/")
                    for o in page.get("Contents", [])]
            assert not any(digest.encode() in client.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in keys)
        finally:
            _wipe_prefix(client, "out/")
            client.delete_object(Bucket=BUCKET, Key="in-csv/2024-01-01.csv")


def test_release_two_sdk_workers_shared_disk_matches_in_process(tmp_path):
    """The same CLI release over local files with two SDK workers that share the driver's disk (no
    isolation, no S3): the published table is byte-identical to the in-process one. Independent of the
    URI storage work, so it guards determinism across workers on any branch."""
    from cluster_support import portable_options, start_job_service, start_worker_pool

    gen = np.random.default_rng(7)
    n = 200_000
    users = gen.integers(0, 20_000, n)
    doc = _spec_doc()
    doc["input"]["path"] = "data/{start:%Y-%m-%d}.parquet"
    doc["output"]["root"] = "out"
    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({"user_id": pa.array([f"u{u}" for u in users], pa.string()),
                             "region": pa.array([f"r{r:03d}" for r in gen.zipf(1.3, n) % 1000], pa.string()),
                             "amount": pa.array(gen.uniform(-10, 120, n))}), tmp_path / "data" / "2024-01-01.parquet")
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(doc))
    key = tmp_path / "noise.key"
    NoiseKey.generate(key)
    env = {**os.environ, **pythonpath_env(), "DPOPS_STATE_DIR": str(tmp_path / "state")}
    env.pop("DPOPS_MANIFESTS_DIR", None)

    def published(out: dict) -> bytes:
        u = urlparse(out["output_uri"])
        assert u.scheme in ("", "file"), out["output_uri"]
        return (Path(u.path) / "data.parquet").read_bytes()

    ref = _release(spec, _new_ledger(tmp_path / "ref.sqlite"), key, "FnApiRunner", [], cwd=tmp_path, env=env)
    reference = published(ref)
    for sub in ("published", "staged", "manifests"):  # the same run id is published again on a new ledger
        shutil.rmtree(tmp_path / "out" / sub, ignore_errors=True)
    job = start_job_service(tmp_path / "logs")
    try:
        pool = start_worker_pool(tmp_path / "logs", hide=[])
        try:
            ledger = _new_ledger(tmp_path / "portable.sqlite")
            out = _release(spec, ledger, key, "PortableRunner", portable_options(job.port, pool.port, parallelism=2),
                           cwd=tmp_path, env=env)
            assert pool.log_text(tail=10_000_000).count("Starting worker with command") == 2
        finally:
            pool.stop()
    finally:
        job.stop()
    assert out["run_id"] == ref["run_id"]
    assert published(out) == reference
    verify = _dpops(["manifest", "verify", out["run_id"], "--ledger", ledger, "--key-file", str(key),
                     "--manifests", str(tmp_path / "out" / "manifests" / "cluster_release")], cwd=tmp_path, env=env)
    assert verify.returncode == 0, verify.stdout[-3000:] + verify.stderr[-3000:]
