"""The isolated-worker harness holds: EXTERNAL SDK workers write to S3 (moto) through Beam FileSystems,
cannot read a driver-local file, and what they write to a driver-local path never reaches the driver.
With ``--sdk_worker_parallelism=2`` two SDK worker processes share the job.

Before trusting the release tests (tests/test_cluster_release.py) on this harness, these show that a
pipeline which only worked because workers shared the driver's disk would fail here.
"""

from __future__ import annotations

import os
import pytest

from cluster_support import portable_cluster

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
BUCKET = "dpops-harness"


def _pipeline(cluster, *, extra=()):
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    return beam.Pipeline(options=PipelineOptions(["--runner=PortableRunner", *cluster.options(), *extra]))


def _write_s3(x: int, bucket: str = BUCKET) -> int:
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.create(f"s3://{bucket}/parts/part-{x:03d}.txt") as f:
        f.write(f"row {x} from pid {os.getpid()}".encode())
    return x


def _write_local(x: int, target: str) -> str:
    with open(target, "w") as f:
        f.write("written by a worker")
    return target


def _read_local(x: int, source: str) -> str:
    with open(source) as f:
        return f.read()


def _pid(x: int) -> int:
    return os.getpid()


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    with portable_cluster(tmp_path) as c:
        for k, v in c.env.items():
            monkeypatch.setenv(k, v)
        yield c


def test_workers_write_s3_and_cannot_see_driver_dirs(cluster):
    import apache_beam as beam
    import boto3

    s3 = boto3.client("s3")
    s3.create_bucket(Bucket=BUCKET)
    with _pipeline(cluster) as p:
        _ = p | beam.Create(list(range(20))) | beam.Reshuffle() | beam.Map(_write_s3)
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"])
    assert keys == [f"parts/part-{i:03d}.txt" for i in range(20)]

    # A write to the driver's output directory lands in the worker's own tmpfs: the driver never sees it.
    target = cluster.out / "from_worker.txt"
    with _pipeline(cluster) as p:
        _ = p | beam.Create([1]) | beam.Map(_write_local, target=str(target))
    assert not target.exists()

    # A file in the driver's working, temporary or input directory does not exist for a worker.
    for d in (cluster.cwd, cluster.tmp, cluster.inp):
        source = d / "driver_only.txt"
        source.write_text("driver")
        with pytest.raises(Exception, match="FileNotFoundError|No such file"), _pipeline(cluster) as p:
            _ = p | beam.Create([1]) | beam.Map(_read_local, source=str(source))

    # The noise key's directory (a mounted secret) is visible to workers.
    secret = cluster.secrets / "visible.txt"
    secret.write_text("mounted")
    with _pipeline(cluster) as p:
        _ = p | beam.Create([1]) | beam.Map(_read_local, source=str(secret)) | beam.Map(_write_local_s3)
    body = s3.get_object(Bucket=BUCKET, Key="secret-check.txt")["Body"].read().decode()
    assert body == "mounted"


def _write_local_s3(text: str, bucket: str = BUCKET) -> None:
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.create(f"s3://{bucket}/secret-check.txt") as f:
        f.write(text.encode())


def test_two_sdk_workers(tmp_path, monkeypatch):
    import apache_beam as beam
    import boto3

    with portable_cluster(tmp_path, parallelism=2) as c:
        for k, v in c.env.items():
            monkeypatch.setenv(k, v)
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket=BUCKET)
        with _pipeline(c) as p:
            _ = p | beam.Create(list(range(200))) | beam.Reshuffle() | beam.Map(_write_s3)
        assert c.workers_started() == 2
        bodies = [s3.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read().decode()
                  for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"]]
        assert len(bodies) == 200
        pids = {b.rsplit(" ", 1)[-1] for b in bodies}
        assert len(pids) == 2, f"all rows were written by {pids}: the second SDK worker did no work"
        assert str(os.getpid()) not in pids
