"""``dpops estimate`` with the input on S3 (moto), its private read computed by isolated EXTERNAL SDK workers
(tests/cluster_support.py: they cannot see the driver's working, temporary, input or output directories; the
noise key's directory is visible to them as a mounted secret), equals the same estimation computed in process
(FnApiRunner) with the same key, byte for byte: the spec patch and the manifest's ``estimation`` section
(configuration, mechanisms, result; for error/1 also the noisy histograms and the choice), for both methods
(issue 27 item 1).

Through the CLI, as an operator runs it: ``--runner PortableRunner --runner-option ... --staging s3://...``
(the workers write their scratch files and the exact counts under a private prefix both sides reach; a
driver-local staging directory would be invisible to them). Each run uses a fresh ledger, so the same key,
input and spec give the same run id and the same keyed noise, and any difference in what the workers counted
shows in the bounds or the recorded noisy histograms.
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

BUCKET = "dpops-cluster-estimate"
N_ROWS = 60_000
N_USERS = 4_000
REGIONS = [f"r{i:02d}" for i in range(16)]
METHODS = ("error/1", "quantile/1")


def _spec_doc() -> dict:
    return {
        "name": "cluster_estimate",
        "input": {"path": f"s3://{BUCKET}/in/{{start:%Y-%m-%d}}.parquet", "format": "parquet",
                  "columns": {"user_id": "string", "region": "string", "amount": "float"}},
        "privacy_unit": {"column": "user_id", "description": "a user-day", "adjacency": "add_remove"},
        "budget": {"scope": "cluster", "epsilon": 1.0, "delta": 1e-6},
        "contribution": {"max_partitions_per_unit": 3, "max_rows_per_unit_per_partition": 2},
        "partitions": {"columns": ["region"], "public": REGIONS},
        "metrics": [{"type": "count"}, {"type": "sum", "column": "amount", "bounds": [-10, 100]}],
        "output": {"root": "out"},  # next to the spec, on the driver: an estimation's manifest and result
    }


def _s3(port: int):
    import boto3

    return boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="testing",
                        aws_secret_access_key="testing", region_name="us-east-1")


def _keys(client, prefix: str) -> list[str]:
    return [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
            for o in page.get("Contents", [])]


def _new_ledger(path: Path) -> str:
    url = f"sqlite:///{path}"
    led = open_ledger(url)
    led.create_scope(ScopeDefinition(name="cluster", unit="a user-day", unit_column="user_id", epsilon=50.0,
                                     delta=1e-5, rho=None, accountant="basic/1", adjacency="add_remove"), actor="test")
    led.close()
    return url


def _estimate(cwd: Path, key: Path, method: str, runner: str, options: list[str], env: dict[str, str],
              doc: dict | None = None) -> dict:
    """One ``dpops estimate`` in ``cwd`` (a fresh spec, ledger and output); its patch bytes and manifest section."""
    run_dir = cwd / method.replace("/", "_")
    run_dir.mkdir(parents=True)
    spec = run_dir / "spec.yaml"
    spec.write_text(yaml.safe_dump(doc or _spec_doc()))
    args = ["estimate", str(spec), "--interval", "2024-01-01/2024-01-02", "--epsilon", "1.0", "--method", method,
            "--ledger", _new_ledger(run_dir / "ledger.sqlite"), "--key-file", str(key), "--out", str(run_dir / "est"),
            "--json", "--runner", runner, "--staging", f"s3://{BUCKET}/scratch/", "--buckets", "3"]
    for o in options:
        args += ["--runner-option", o]
    proc = subprocess.run([sys.executable, "-m", "dpops.cli.main", *args], cwd=run_dir, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"{runner} {method} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    out = json.loads(proc.stdout)
    assert out["state"] == "committed", out
    manifest = json.loads(Path(out["manifest"]).read_text())
    return {"run_id": out["run_id"], "patch": (run_dir / "est" / "patch.yaml").read_bytes(),
            "estimation": json.dumps(manifest["estimation"], sort_keys=True).encode()}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """moto, the input on S3, the noise key (a 'mounted secret'), and the in-process reference of each method."""
    base = tmp_path_factory.mktemp("cluster_estimate")
    moto = start_moto(base / "logs")
    try:
        client = _s3(moto.port)
        client.create_bucket(Bucket=BUCKET)
        gen = np.random.default_rng(20240102)
        users = (gen.zipf(1.4, N_ROWS) - 1) % N_USERS
        table = pa.table({"user_id": pa.array([f"u{u}" for u in users], pa.string()),
                          "region": pa.array([REGIONS[r] for r in (gen.zipf(1.3, N_ROWS) - 1) % len(REGIONS)]),
                          "amount": pa.array(np.round(gen.lognormal(2.0, 1.2, N_ROWS), 2))})
        local = base / "input.parquet"
        pq.write_table(table, local, row_group_size=20_000)  # several work items (x 3 buckets: S3 objects)
        client.upload_file(str(local), BUCKET, "in/2024-01-01.parquet")
        local.unlink()
        secrets = base / "secrets"
        secrets.mkdir()
        key = secrets / "noise.key"
        NoiseKey.generate(key)
        ref = base / "reference"
        env = {**os.environ, **pythonpath_env(), **s3_env(moto.port), "DPOPS_STATE_DIR": str(ref / "state"),
               "DPOPS_DATA_ROOTS": f"s3://{BUCKET}/in"}
        for var in ("DPOPS_MANIFESTS_DIR", "DPOPS_LEDGER_URL"):
            env.pop(var, None)
        reference = {m: _estimate(ref, key, m, "FnApiRunner", [f"--s3_endpoint_url=http://127.0.0.1:{moto.port}"],
                                  env) for m in METHODS}
        assert not _keys(client, "scratch/"), "the in-process passes left scratch files behind"
        yield {"moto": moto, "client": client, "key": key, "reference": reference}
    finally:
        moto.stop()


@pytest.fixture(scope="module")
def cluster(world, tmp_path_factory):
    """One job service and isolated worker pool for the module's tests (each counts the jobs it adds)."""
    with portable_cluster(tmp_path_factory.mktemp("cluster"), moto=world["moto"]) as c:
        yield c


def test_estimation_on_isolated_workers_with_s3_input_equals_the_in_process_one(world, cluster):
    client = world["client"]
    env = {**os.environ, **cluster.env, "TMPDIR": str(cluster.tmp), "DPOPS_STATE_DIR": str(cluster.cwd / "state"),
           "DPOPS_DATA_ROOTS": f"s3://{BUCKET}/in"}
    for var in ("DPOPS_MANIFESTS_DIR", "DPOPS_LEDGER_URL"):
        env.pop(var, None)
    before = cluster.workers_started()
    for method in METHODS:
        got = _estimate(cluster.cwd / "estimate", world["key"], method, "PortableRunner", cluster.options(), env)
        want = world["reference"][method]
        assert got["run_id"] == want["run_id"]  # same key, input and spec: the same run
        assert got["estimation"] == want["estimation"], f"{method}: the workers' estimation differs"
        assert got["patch"] == want["patch"], f"{method}: the spec patch differs"
    assert cluster.workers_started() > before  # the passes ran on the isolated pool
    assert not _keys(client, "scratch/"), "the workers' scratch files or counts were left in the bucket"


def test_a_csv_estimation_on_isolated_workers_checks_the_bytes_they_read_and_equals_the_in_process_one(
        world, cluster, tmp_path):
    """CSV on S3: each worker's read reports the salted tag of the bytes it parsed (``ReadDigestsOf``) and the
    driver's check after the estimation compares it with the fingerprint. A tag the driver could not reproduce
    (another salt on the workers, another byte count) would refuse the run after its charge: both runs commit,
    with the same estimation as in process."""
    import pyarrow.csv as pcsv

    client = world["client"]
    gen = np.random.default_rng(7)
    n = 20_000
    local = tmp_path / "input.csv"
    pcsv.write_csv(pa.table({"user_id": [f"u{u}" for u in gen.integers(0, 1_500, n)],
                             "region": [REGIONS[r] for r in gen.integers(0, len(REGIONS), n)],
                             "amount": np.round(gen.lognormal(2.0, 1.2, n), 2)}), local)
    client.upload_file(str(local), BUCKET, "in-csv/2024-01-01.csv")
    doc = _spec_doc()
    doc["input"] = {**doc["input"], "path": f"s3://{BUCKET}/in-csv/{{start:%Y-%m-%d}}.csv", "format": "csv"}
    roots = {"DPOPS_DATA_ROOTS": f"s3://{BUCKET}/in-csv"}
    try:
        ref_env = {**os.environ, **pythonpath_env(), **s3_env(world["moto"].port), **roots,
                   "DPOPS_STATE_DIR": str(tmp_path / "ref-state")}
        env = {**os.environ, **cluster.env, **roots, "TMPDIR": str(cluster.tmp),
               "DPOPS_STATE_DIR": str(cluster.cwd / "csv-state")}
        for e in (ref_env, env):
            for var in ("DPOPS_MANIFESTS_DIR", "DPOPS_LEDGER_URL"):
                e.pop(var, None)
        want = _estimate(tmp_path / "reference", world["key"], "quantile/1", "FnApiRunner",
                         [f"--s3_endpoint_url=http://127.0.0.1:{world['moto'].port}"], ref_env, doc)
        before = cluster.workers_started()
        got = _estimate(cluster.cwd / "estimate-csv", world["key"], "quantile/1", "PortableRunner",
                        cluster.options(), env, doc)
        assert cluster.workers_started() > before  # the passes ran on the isolated pool
        assert (got["run_id"], got["estimation"], got["patch"]) == (want["run_id"], want["estimation"], want["patch"])
        assert not _keys(client, "scratch/"), "the workers' scratch files or counts were left in the bucket"
    finally:
        client.delete_object(Bucket=BUCKET, Key="in-csv/2024-01-01.csv")


def _release_doc() -> dict:
    """A release whose sum bounds are estimated at run time (``bounds: estimate``), its outputs on S3 where the
    workers write their shards."""
    doc = _spec_doc()
    doc["name"] = "cluster_estimated_release"
    doc["budget"] = {**doc["budget"], "split": {"count": 1.0, "sum_amount": 1.0, "sum_amount.bounds": 1.0}}
    doc["metrics"] = [{"type": "count"},
                      {"type": "sum", "column": "amount", "bounds": "estimate", "fallback_bounds": [0, 100]}]
    doc["output"] = {"root": f"s3://{BUCKET}/out"}
    return doc


def _release_run(client, cwd: Path, key: Path, runner: str, options: list[str], env: dict[str, str],
                 estimation_staging: str | None, *, again: bool = False) -> dict:
    """``dpops release run --publish`` of ``_release_doc`` in ``cwd`` (fresh spec and ledger): the run ids, the
    published table's bytes and the runs' states; the estimation's manifest must be on S3 beside the release's.
    ``again``: run it a second time, which must be served (the estimation served from its S3 manifest, whose
    sha256 the ledger's commit entry names). The output is wiped after."""
    cwd.mkdir(parents=True)
    spec = cwd / "spec.yaml"
    spec.write_text(yaml.safe_dump(_release_doc()))
    ledger = _new_ledger(cwd / "ledger.sqlite")
    args = ["release", "run", str(spec), "--interval", "2024-01-01/2024-01-02", "--ledger", ledger,
            "--key-file", str(key), "--publish", "--no-gx-checks", "--json", "--runner", runner]
    for o in options:
        args += ["--runner-option", o]
    if estimation_staging:
        args += ["--estimation-staging", estimation_staging]
    proc = subprocess.run([sys.executable, "-m", "dpops.cli.main", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"{runner} release failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    out = json.loads(proc.stdout)
    assert out["state"] == "published", out
    key_of_table = (out["output_uri"].rstrip("/") + "/data.parquet").removeprefix(f"s3://{BUCKET}/")
    table = client.get_object(Bucket=BUCKET, Key=key_of_table)["Body"].read()
    with open_ledger(ledger) as led:
        runs = {r.key.release: r for r in led.runs(scope="cluster")}
    est_run = runs["cluster_estimated_release__estimate"].run_id
    manifests = _keys(client, "out/manifests/")
    assert [k for k in manifests if est_run in k], manifests  # the estimation's manifest, on S3
    assert _keys(client, f"out/estimates/cluster_estimated_release/{est_run}.json")  # and its result file
    if again:
        # a reviewer's check: the release's manifest verifies, its dependency (the estimation) looked up on S3
        verify = subprocess.run([sys.executable, "-m", "dpops.cli.main", "manifest", "verify", out["run_id"],
                                 "--ledger", ledger, "--key-file", str(key), "--manifests",
                                 f"s3://{BUCKET}/out/manifests/cluster_estimated_release"], cwd=cwd, env=env,
                                capture_output=True, text=True, timeout=600, check=False)
        assert verify.returncode == 0 and "verified: run" in verify.stdout, verify.stdout[-3000:] + verify.stderr[-3000:]
        proc = subprocess.run([sys.executable, "-m", "dpops.cli.main", *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, f"{runner} retry failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
        retry = json.loads(proc.stdout)
        assert (retry["state"], retry["run_id"]) == ("already_published", out["run_id"]), retry
        with open_ledger(ledger) as led:
            assert len(led.runs(scope="cluster")) == 2  # nothing new: the estimation was served, not re-run
        # the served bounds become the release's sensitivity: an edited S3 manifest is refused (exit 7), uncharged
        (name,) = [k for k in manifests if est_run in k]
        doc = json.loads(client.get_object(Bucket=BUCKET, Key=name)["Body"].read())
        doc["estimation"]["result"]["bounds"]["amount"] = [0.0, 1e6]
        client.put_object(Bucket=BUCKET, Key=name, Body=json.dumps(doc).encode())
        proc = subprocess.run([sys.executable, "-m", "dpops.cli.main", *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 7 and "refusing to serve committed estimation" in proc.stderr, proc.stderr[-3000:]
    for k in _keys(client, "out/"):
        client.delete_object(Bucket=BUCKET, Key=k)
    return {"run_id": out["run_id"], "table": table, "estimation_run": est_run,
            "states": sorted((r, v.state) for r, v in runs.items())}


def test_bounds_estimate_of_a_release_runs_on_the_isolated_workers_with_estimation_staging(world, cluster, tmp_path):
    """``release run --estimation-staging s3://...`` on the isolated workers: the release's ``bounds: estimate``
    pass reads the private input on the workers too (issue 27 item 1: every private read through the Beam
    reader, on the release's runner), and the release equals the in-process one byte for byte (same run ids,
    same published table, both runs committed); the scratch prefix is left empty."""
    client = world["client"]
    port = world["moto"].port
    base_env = {**os.environ, **pythonpath_env(), **s3_env(port),
                "DPOPS_DATA_ROOTS": f"s3://{BUCKET}/in", "DPOPS_OUTPUT_ROOTS": f"s3://{BUCKET}/out"}
    for var in ("DPOPS_MANIFESTS_DIR", "DPOPS_LEDGER_URL", "DPOPS_ESTIMATION_STAGING"):
        base_env.pop(var, None)
    ref = _release_run(client, tmp_path / "reference", world["key"], "FnApiRunner",
                       [f"--s3_endpoint_url=http://127.0.0.1:{port}"],
                       {**base_env, "DPOPS_STATE_DIR": str(tmp_path / "reference-state")}, None, again=True)
    env = {**base_env, **cluster.env, "TMPDIR": str(cluster.tmp), "DPOPS_STATE_DIR": str(cluster.cwd / "state")}
    before = cluster.workers_started()
    got = _release_run(client, cluster.cwd / "release", world["key"], "PortableRunner", cluster.options(), env,
                       f"s3://{BUCKET}/scratch/")
    jobs = cluster.workers_started() - before
    assert got["states"] == ref["states"] == [("cluster_estimated_release", "committed"),
                                              ("cluster_estimated_release__estimate", "committed")]
    assert (got["run_id"], got["estimation_run"]) == (ref["run_id"], ref["estimation_run"])
    assert got["table"] == ref["table"], "the workers' release (or its estimated bounds) differs from in process"
    # one SDK worker per job: the release's own job plus the estimation's passes (at least its values pass)
    assert jobs >= 2, f"only {jobs} job(s) on the pool: the estimation did not run on the workers"
    assert not _keys(client, "scratch/"), "the estimation's scratch files or counts were left in the bucket"
