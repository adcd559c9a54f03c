"""A whole release run with its input, staging, published output and manifests on S3 (moto's server).

The pipeline here is a stand-in that writes its two files through the storage layer, as the Beam job
does through Beam FileSystems; ``test_storage_s3_pipeline.py`` runs the real Beam job."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from dpops.release import computation
from dpops.cli.main import main
from dpops.release.pipeline_seam import ComputeResult
from dpops.ledger import open_ledger
from dpops.storage import Location, files
from dpops.storage.objectstore import ObjectReleaseStore
from s3_support import s3_release

from test_runs import FakePipeline  # the run tests' stand-in (same noisy table)

INTERVAL = "2024-01-01/2024-01-02"
SLUG = "20240101T000000Z_20240102T000000Z"


class UriPipeline(FakePipeline):
    """FakePipeline's table, written to ``req.staging_dir`` (a URI here) through pyarrow.fs."""

    def __call__(self, req):
        self.calls += 1
        self.requests.append(req)
        if self.fail_after_start:
            raise RuntimeError("worker lost")
        local = FakePipeline()
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory() as d:
            class R:  # the same request, pointed at a local directory, to reuse FakePipeline's table
                pass
            r = R()
            r.__dict__.update(req.__dict__)
            r.staging_dir = d
            local(r)
            staging = Location.parse(req.staging_dir)
            for name in ("data.parquet", "summary.json"):
                files.write_bytes(staging / name, (Path(d) / name).read_bytes())
        return ComputeResult(str(staging / "data.parquet"), str(staging / "summary.json"), 2,
                             internal={"rows_read": 4, "rows_dropped": {"null_unit": 1}})


@pytest.fixture
def s3_run(s3, tmp_path, monkeypatch):
    table = pa.table({"user_id": ["a", "b", "c", None], "region": ["north", "south", "north", "south"],
                      "amount": [1.0, 2.0, 3.0, 4.0]})
    rel = s3_release(s3, tmp_path, monkeypatch, "purchases_test", {"2024-01-01.parquet": table},
                     "{start:%Y-%m-%d}.parquet", epsilon=0.5, cap=0.7, public=["north", "south"],
                     metrics=[{"type": "count"}, {"type": "sum", "column": "amount", "bounds": [0, 10]}], max_rows=2)
    bucket, spec, url, key = rel.bucket, rel.spec, rel.ledger_url, rel.key_file
    pipe = UriPipeline()
    monkeypatch.setattr(computation, "_load_run_release", lambda: pipe)
    base = ["--interval", INTERVAL, "--ledger", url, "--key-file", str(key)]
    return {"s3": s3, "spec": str(spec), "url": url, "key": str(key), "base": base, "pipe": pipe,
            "root": Location.parse(f"{bucket}/out")}


def _published(env) -> Location:
    return env["root"].join("published", "purchases_test", SLUG)


def test_release_run_on_s3_publishes_and_manifest_verifies(s3_run, capsys):
    env = s3_run
    assert main(["release", "run", env["spec"], *env["base"], "--publish", "--no-gx-checks", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["state"] == "published"
    run_id = out["run_id"]
    assert out["output_uri"] == str(_published(env) / f"v0001-{run_id}")
    req = env["pipe"].requests[0]
    assert req.staging_dir.startswith(str(env["root"].join("staged", "purchases_test", SLUG)) + "/.tmp-")
    assert list(req.input_paths) == [str(env["s3"].uri("data/2024-01-01.parquet"))]
    pointer = files.read_json(_published(env) / "current")
    assert pointer["run_id"] == run_id and pointer["prefix"] == f"v0001-{run_id}"
    manifests = env["root"].join("manifests", "purchases_test")
    assert files.list_dir(manifests) == [f"{run_id}.published.json"]
    # verify: ledger claim, the published objects against the ledger digests and the keyed fingerprints
    assert main(["manifest", "verify", run_id, "--manifests", str(manifests), "--ledger", env["url"],
                 "--key-file", env["key"], "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is True
    assert not [c for c in result["checks"] if c.get("skipped") and "file" in c["name"]], result["checks"]
    # served again for free, through the pointer
    assert main(["release", "run", env["spec"], *env["base"], "--publish", "--no-gx-checks", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["state"] == "already_published" and again["epsilon_charged"] == 0
    assert env["pipe"].calls == 1
    assert main(["release", "status", env["spec"], "--interval", INTERVAL, "--ledger", env["url"],
                 "--key-file", env["key"], "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["published_files"]["ok"] is True and set(st["published_files"]["checked"]) == {"data.parquet",
                                                                                              "summary.json"}
    assert [v["version"] for v in st["versions"]] == [1]


def test_changed_published_object_is_refused(s3_run, capsys):
    env = s3_run
    assert main(["release", "run", env["spec"], *env["base"], "--publish", "--no-gx-checks", "--json"]) == 0
    run_id = json.loads(capsys.readouterr().out)["run_id"]
    files.write_bytes(_published(env) / f"v0001-{run_id}" / "data.parquet", b"exact values")
    assert main(["release", "run", env["spec"], *env["base"], "--publish", "--no-gx-checks"]) == 7
    manifests = env["root"].join("manifests", "purchases_test")
    assert main(["manifest", "verify", run_id, "--manifests", str(manifests), "--ledger", env["url"],
                 "--key-file", env["key"]]) == 7


def test_crash_between_commit_and_pointer_healed_by_retry(s3_run, capsys):
    env = s3_run

    def crash(self, *args, **kwargs):
        raise OSError("simulated crash between the ledger commit and the pointer write")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ObjectReleaseStore, "_point_current", crash)
        assert main(["release", "run", env["spec"], *env["base"], "--publish", "--no-gx-checks"]) != 0
    capsys.readouterr()
    led = open_ledger(env["url"])
    try:
        (rec,) = led.runs(release="purchases_test")
        assert rec.state == "committed"  # the decision is recorded ...
    finally:
        led.close()
    assert not files.exists(_published(env) / "current")  # ... but nothing is visible yet
    assert main(["release", "run", env["spec"], *env["base"], "--publish", "--no-gx-checks", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["state"] == "already_published" and out["epsilon_charged"] == 0
    assert files.read_json(_published(env) / "current")["run_id"] == rec.run_id
    assert env["pipe"].calls == 1


def test_an_s3_input_swapped_during_the_computation_and_put_back_is_never_published(s3_run, capsys, monkeypatch):
    """The object-store twin of the local swap-and-restore: while the pipeline reads, another object is PUT at
    the input's key and the original bytes are PUT back before the check after the computation. The bytes hash
    as the run key's, so the hash alone passed and the release of other data was published under the key; the
    S3 snapshot (LastModified, ETag, VersionId: ``object_version``) moves with each PUT. Fails on the old code
    (no snapshot for URIs: published)."""
    import time

    env = s3_run
    client = env["s3"].client()
    bucket = env["s3"].bucket
    original = client.get_object(Bucket=bucket, Key="data/2024-01-01.parquet")["Body"].read()
    pipe = env["pipe"]
    real = UriPipeline.__call__

    def swapping(req):
        time.sleep(1.1)  # S3 dates have one-second resolution: the restore lands in a later second
        client.put_object(Bucket=bucket, Key="data/2024-01-01.parquet", Body=b"other rows")  # what the job reads
        out = real(pipe, req)
        client.put_object(Bucket=bucket, Key="data/2024-01-01.parquet", Body=original)  # and the checked bytes back
        return out

    monkeypatch.setattr(computation, "_load_run_release", lambda: swapping)
    code = main(["release", "run", env["spec"], *env["base"], "--publish", "--no-gx-checks"])
    err = capsys.readouterr().err
    assert code != 0 and "input files changed since the run was prepared" in err, err
    with open_ledger(env["url"]) as led:
        (rec,) = led.runs()
    assert rec.state == "started"  # noise may have been drawn: charged, never published
    assert not files.exists(_published(env) / "current")
