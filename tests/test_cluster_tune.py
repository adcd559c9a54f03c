"""A flagged private ``dpops tune`` with the sample on S3 (moto), read by isolated EXTERNAL SDK workers
(tests/cluster_support.py: they cannot see the driver's working, temporary, input or output directories),
reports exactly what the same private tune computed in process (FnApiRunner) reports (issue 27 item 1).

Through the CLI, as an operator runs it: ``--i-understand-this-reads-private-data --reason ... --runner
PortableRunner --runner-option ... --staging s3://...`` (the workers' scratch files and the per-partition
statistics live under a private prefix both sides reach). The same ``--seed`` gives the same bounding choices,
so results.json (candidates, rows, recommendation) and patch.yaml's candidate must be equal byte for byte;
only the ledger entry's id and time (``data``) may differ. Each run uses a fresh ledger.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from cluster_support import portable_cluster, pythonpath_env, s3_env, start_moto
from dpops.ledger import ScopeDefinition, open_ledger
from dpops.noise.randomness import NoiseKey

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

BUCKET = "dpops-cluster-tune"
N_ROWS = 40_000
N_USERS = 3_000
REGIONS = [f"r{i:02d}" for i in range(16)]


def _spec_doc() -> dict:
    return {
        "name": "cluster_tune",
        "input": {"path": f"s3://{BUCKET}/in/x.parquet", "format": "parquet",
                  "columns": {"user_id": "string", "region": "string", "amount": "float"}},
        "privacy_unit": {"column": "user_id", "description": "a user-day", "adjacency": "add_remove"},
        "budget": {"scope": "cluster", "epsilon": 1.0, "delta": 1e-6},
        "contribution": {"max_partitions_per_unit": 3, "max_rows_per_unit_per_partition": 2},
        "partitions": {"columns": ["region"], "private": {"strategy": "truncated_geometric"}},
        "metrics": [{"type": "count"}, {"type": "sum", "column": "amount", "bounds": [0, 100]},
                    {"type": "quantiles", "column": "amount", "bounds": [0, 200], "quantiles": [0.5, 0.9]}],
        "output": {"root": "out"},
    }


def _s3(port: int):
    import boto3

    return boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="testing",
                        aws_secret_access_key="testing", region_name="us-east-1")


def _keys(client, prefix: str) -> list[str]:
    return [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
            for o in page.get("Contents", [])]


def _tune(cwd: Path, key: Path, runner: str, options: list[str], env: dict[str, str]) -> dict:
    """One flagged ``dpops tune`` in a fresh directory (spec, ledger, output): what it reported."""
    cwd.mkdir(parents=True)
    spec = cwd / "spec.yaml"
    spec.write_text(yaml.safe_dump(_spec_doc()))
    url = f"sqlite:///{cwd / 'ledger.sqlite'}"
    led = open_ledger(url)
    led.create_scope(ScopeDefinition(name="cluster", unit="a user-day", unit_column="user_id", epsilon=50.0,
                                     delta=1e-5, rho=None, accountant="basic/1", adjacency="add_remove"), actor="test")
    led.close()
    args = ["--ledger", url, "tune", str(spec), "--sample", f"s3://{BUCKET}/in/x.parquet", "--out", str(cwd / "o"),
            "--i-understand-this-reads-private-data", "--reason", "cluster test", "--key-file", str(key),
            "--l0", "1,3,6", "--linf", "1,2", "--seed", "23", "--json", "--runner", runner,
            "--staging", f"s3://{BUCKET}/scratch/", "--buckets", "3"]
    for o in options:
        args += ["--runner-option", o]
    proc = subprocess.run([sys.executable, "-m", "dpops.cli.main", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"{runner} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    doc = json.loads((cwd / "o" / "results.json").read_text())
    assert doc.pop("data")["source"] == "private"
    return {"results": json.dumps(doc, sort_keys=True).encode(),
            "candidate": yaml.safe_load((cwd / "o" / "patch.yaml").read_text())["tuning"]["candidate"]}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """moto, the private sample on S3, the noise key (a 'mounted secret'), and the in-process reference."""
    base = tmp_path_factory.mktemp("cluster_tune")
    moto = start_moto(base / "logs")
    try:
        client = _s3(moto.port)
        client.create_bucket(Bucket=BUCKET)
        gen = np.random.default_rng(20240103)
        users = (gen.zipf(1.4, N_ROWS) - 1) % N_USERS
        table = pa.table({"user_id": pa.array([f"u{u}" for u in users], pa.string()),
                          "region": pa.array([REGIONS[r] for r in (gen.zipf(1.3, N_ROWS) - 1) % len(REGIONS)]),
                          "amount": pa.array(np.round(gen.lognormal(2.0, 1.2, N_ROWS), 2))})
        local = base / "input.parquet"
        pq.write_table(table, local, row_group_size=10_000)  # several work items
        client.upload_file(str(local), BUCKET, "in/x.parquet")
        local.unlink()
        secrets = base / "secrets"
        secrets.mkdir()
        key = secrets / "noise.key"
        NoiseKey.generate(key)
        ref = base / "reference"
        env = {**os.environ, **pythonpath_env(), **s3_env(moto.port), "DPOPS_STATE_DIR": str(ref / "state"),
               "DPOPS_DATA_ROOTS": f"s3://{BUCKET}/in"}
        for var in ("DPOPS_MANIFESTS_DIR", "DPOPS_LEDGER_URL", "DPOPS_PUBLIC_ROOTS"):
            env.pop(var, None)
        reference = _tune(ref / "run", key, "FnApiRunner", [f"--s3_endpoint_url=http://127.0.0.1:{moto.port}"], env)
        assert not _keys(client, "scratch/"), "the in-process pass left scratch files behind"
        yield {"moto": moto, "client": client, "key": key, "reference": reference}
    finally:
        moto.stop()


def test_private_tune_on_isolated_workers_with_s3_input_equals_the_in_process_one(world, tmp_path):
    client = world["client"]
    with portable_cluster(tmp_path, moto=world["moto"]) as cluster:
        env = {**os.environ, **cluster.env, "TMPDIR": str(cluster.tmp), "DPOPS_STATE_DIR": str(cluster.cwd / "state"),
               "DPOPS_DATA_ROOTS": f"s3://{BUCKET}/in"}
        for var in ("DPOPS_MANIFESTS_DIR", "DPOPS_LEDGER_URL", "DPOPS_PUBLIC_ROOTS"):
            env.pop(var, None)
        got = _tune(cluster.cwd / "run", world["key"], "PortableRunner", cluster.options(), env)
        assert got["results"] == world["reference"]["results"], "the workers' tune differs from the in-process one"
        assert got["candidate"] == world["reference"]["candidate"]
        assert cluster.workers_started() >= 1  # the read ran on the isolated pool
        assert not _keys(client, "scratch/"), "the workers' scratch files or statistics were left in the bucket"
