"""Issue 19 item 8: no exact counter and no killed attempt's scratch stays on the object store.

The real Beam job (FnApiRunner) on moto S3, through the CLI. The first attempt is "killed" after the
workers wrote their parts (the driver dies before it reads them back, and a killed process runs no
cleanup); the retry publishes. Afterwards nothing under the output root holds the exact counters
(``_internal_stats.json`` or any object with ``rows_read``), no ``.tmp-<run_id>-*`` prefix of the run is
left, and the counters are in the private state directory only (``DPOPS_STATE_DIR``)."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pytest

from dpops.cli.main import main
from s3_support import s3_release

pytest.importorskip("apache_beam")
N = 600


def _setup(s3, tmp_path, monkeypatch) -> tuple[list[str], str]:
    rng = np.random.default_rng(3)
    table = pa.table({"user_id": [f"u{i}" for i in rng.integers(0, 100, N)],
                      "region": rng.choice(["north", "south"], N).tolist(), "amount": rng.uniform(0, 10, N)})
    rel = s3_release(s3, tmp_path, monkeypatch, "scratch_e2e", {"2024-01-01.parquet": table},
                     "{start:%Y-%m-%d}.parquet", epsilon=1.0, cap=2.0, public=["north", "south"],
                     metrics=[{"type": "count"}])
    monkeypatch.setenv("DPOPS_STATE_DIR", str(tmp_path / "state"))
    return rel.args(), rel.bucket


def _objects(s3) -> dict[str, bytes]:
    out = {}
    for page in s3.client().get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix="out/"):
        for o in page.get("Contents", []):
            out[o["Key"]] = s3.client().get_object(Bucket=s3.bucket, Key=o["Key"])["Body"].read()
    return out


def test_killed_attempt_leaves_no_counters_or_scratch_on_s3(s3, tmp_path, monkeypatch, capsys):
    from dpops.storage.objectstore import ObjectReleaseStore
    from pipelines import release_pipeline

    args, _ = _setup(s3, tmp_path, monkeypatch)

    def killed(*a, **k):  # the driver dies once the workers wrote every part
        raise RuntimeError("driver killed")

    stores = []
    take = getattr(ObjectReleaseStore, "take_scratch_lease", lambda self, slug, name: None)

    def taking(self, slug, name):
        stores.append(self)
        take(self, slug, name)

    with monkeypatch.context() as m:
        m.setattr(release_pipeline, "read_shards", killed)
        m.setattr(ObjectReleaseStore, "discard_staging", lambda self, staging: None)  # SIGKILL: no cleanup ran
        m.setattr(ObjectReleaseStore, "take_scratch_lease", taking, raising=False)
        assert main(["release", "run", *args, "--publish", "--no-gx-checks"]) != 0
    capsys.readouterr()
    for store in stores:  # the process died: the kernel closes its files, which releases its scratch lease
        for fd in store.__dict__.get("_scratch_leases", {}).values():
            os.close(fd)
        store.__dict__["_scratch_leases"] = {}
    left = _objects(s3)
    assert [k for k in left if "/staged/scratch_e2e/" in k and "/.tmp-" in k and "/_parts/" in k], sorted(left)

    assert main(["release", "run", *args, "--publish", "--no-gx-checks", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["state"] == "published"
    run_id = out["run_id"]
    after = _objects(s3)
    assert not [k for k in after if k.endswith("_internal_stats.json")], sorted(after)
    assert not [k for k in after if f"/.tmp-{run_id}-" in k], sorted(after)
    assert not [k for k, v in after.items() if b"rows_read" in v or b"rows_kept" in v], sorted(after)
    # the exact counters reached the driver (through the runner's metrics) and the private state dir only
    log = json.loads((tmp_path / "state" / "runs" / "scratch_e2e" / "20240101T000000Z_20240102T000000Z"
                      / f"{run_id}.internal.json").read_text())
    assert log["rows_read"] == N and 0 < log["rows_kept"] <= N
    # moto enforces no bucket policy: exactly the unprotected bucket the check exists to catch (run as a reader)
    assert main(["release", "check-staged-access", "--root", f"{s3.uri()}/out"]) == 7
    assert "may list staged/" in capsys.readouterr().out


def test_check_staged_access_denied_and_local_modes(s3, tmp_path, monkeypatch, capsys):
    from botocore.exceptions import ClientError

    from dpops.storage import objectstore

    class Denied:  # what a reader's client gets from a bucket with deploy/s3-bucket-policy.json
        def list_objects_v2(self, **kw):
            raise ClientError({"Error": {"Code": "AccessDenied"}}, "ListObjectsV2")

    monkeypatch.setattr(objectstore, "_s3_client", lambda: Denied())
    assert main(["release", "check-staged-access", "--root", f"{s3.uri()}/out"]) == 0
    capsys.readouterr()
    staged = tmp_path / "out" / "staged" / "rel" / "iv"
    staged.mkdir(parents=True)
    for d in (tmp_path / "out" / "staged", staged.parent, staged):
        d.chmod(0o700)
    assert main(["release", "check-staged-access", "--root", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    staged.parent.chmod(0o755)
    assert main(["release", "check-staged-access", "--root", str(tmp_path / "out")]) == 7
    assert "mode 755" in capsys.readouterr().out


def test_a_live_concurrent_attempt_keeps_its_scratch_a_dead_one_does_not(tmp_path):
    """The sweep removes only scratch whose attempt is gone (its lease is not held)."""
    from dpops.storage import ReleaseStore

    a = ReleaseStore(tmp_path / "out", "rel", state_dir=tmp_path / "state")
    b = ReleaseStore(tmp_path / "out", "rel", state_dir=tmp_path / "state")
    run = "r" * 32
    live = a.new_staging_dir("iv", run)
    other = b.new_staging_dir("iv", run)  # a second attempt of the same run: the first is live, kept
    assert live.is_dir() and other.is_dir()
    fd = a.__dict__["_scratch_leases"].pop(live.name)
    os.close(fd)  # the first attempt's process died
    third = b.new_staging_dir("iv", run)
    assert not live.exists() and other.is_dir() and third.is_dir()



def test_scratch_removal_on_s3_removes_every_depth(s3):
    """``pipelines.fs.delete_everything_under`` (the estimation's and the private tune's scratch cleanup): every
    object below the prefix goes, at any depth, and nothing beside it; an empty prefix is no error."""
    from apache_beam.io.filesystems import FileSystems
    from apache_beam.options.pipeline_options import PipelineOptions

    from pipelines import fs

    FileSystems.set_options(PipelineOptions(fs.s3_options([])))  # what a pipeline's construction does
    base = s3.uri("scratch/run1")
    for key in ("a.npz", "b/c.npz", "b/d/e.npz"):
        fs.write_bytes(f"{base}/{key}", b"rows")
    fs.write_bytes(s3.uri("scratch/run10/keep.npz"), b"other")  # a sibling sharing the prefix's text
    fs.delete_everything_under(base)
    left = [o["Key"] for o in s3.client().list_objects_v2(Bucket=s3.bucket).get("Contents", [])]
    assert left == ["scratch/run10/keep.npz"], left
    fs.delete_everything_under(s3.uri("scratch/never-written"))
