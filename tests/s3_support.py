"""An S3-compatible server for tests: moto's standalone server on 127.0.0.1, started and stopped by PID.

Use from a test module::

    from s3_support import moto_server, s3  # noqa: F401  (pytest fixtures; tests/ is on sys.path)

    def test_x(s3):                       # s3: S3Env, a fresh bucket, env vars set for this test
        root = s3.uri("out")              # "s3://<bucket>/out"

- ``moto_server`` (session scope): one ``moto_server -H 127.0.0.1 -p <free port>`` subprocess (the venv's
  ``moto_server`` script next to ``sys.executable``, else ``python -m moto.server``), waited for until it
  answers HTTP, stopped with SIGTERM (then SIGKILL) by its own PID at the end of the session. Yields
  the endpoint URL.
- ``s3`` (function scope): creates a new bucket and sets, via ``monkeypatch``, ``AWS_ENDPOINT_URL``
  (honoured by boto3 and by pyarrow's S3 filesystem), ``AWS_ACCESS_KEY_ID=testing``,
  ``AWS_SECRET_ACCESS_KEY=testing``, ``AWS_DEFAULT_REGION=us-east-1`` (and clears ``AWS_PROFILE``),
  so nothing secret is ever on a command line. Yields an ``S3Env``.
- ``s3_release(s3, tmp_path, monkeypatch, name, inputs, ...)``: a release whose input and output root are in
  the bucket (input objects uploaded, ``DPOPS_DATA_ROOTS``/``DPOPS_OUTPUT_ROOTS`` set to them), a SQLite ledger
  with the scope ``shop`` and a noise key: the setup of every end-to-end S3 release test.
- Both fixtures are imported by tests/conftest.py, so every test module can ask for them.
- ``start_moto_server()`` / ``stop_server(proc)``: the same outside pytest fixtures (the cluster test
  starts one for its worker processes too); ``s3_env_vars(endpoint)`` gives the variables to pass to
  subprocesses such as an SDK worker pool.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import pytest

if TYPE_CHECKING:
    import pyarrow as pa

REGION = "us-east-1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_command(port: int) -> list[str]:
    script = Path(sys.executable).parent / "moto_server"
    if script.exists():
        return [str(script), "-H", "127.0.0.1", "-p", str(port)]
    found = shutil.which("moto_server")
    if found:
        return [found, "-H", "127.0.0.1", "-p", str(port)]
    return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]


def start_moto_server(timeout: float = 30.0) -> tuple[subprocess.Popen[bytes], str]:
    """Start moto's S3 server on a free local port; return (process, endpoint URL) once it answers."""
    port = free_port()
    proc = subprocess.Popen(_server_command(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with code {proc.returncode} before answering on {endpoint}")
        try:
            with urllib.request.urlopen(endpoint + "/moto-api/", timeout=1):
                return proc, endpoint
        except OSError:
            time.sleep(0.1)
    stop_server(proc)
    raise RuntimeError(f"moto_server did not answer on {endpoint} within {timeout} s")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """Stop the server by its own PID: SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is not None:
        return
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def s3_env_vars(endpoint: str) -> dict[str, str]:
    """The environment a process needs to reach the test server (boto3, pyarrow, Beam with --s3_endpoint_url)."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": REGION, "AWS_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true"}


def create_bucket(endpoint: str, name: str) -> None:
    import boto3

    env = s3_env_vars(endpoint)
    client = boto3.client("s3", endpoint_url=endpoint, region_name=REGION,
                          aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    client.create_bucket(Bucket=name)


@dataclass(frozen=True)
class S3Env:
    endpoint: str
    bucket: str

    def uri(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{key}".rstrip("/")

    def client(self):  # boto3 client for assertions in tests (listing, tampering)
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id="testing",
                            aws_secret_access_key="testing")


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    proc, endpoint = start_moto_server()
    try:
        yield endpoint
    finally:
        stop_server(proc)


@pytest.fixture
def s3(moto_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Env]:
    for name, value in s3_env_vars(moto_server).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    bucket = f"dpops-test-{uuid.uuid4().hex[:12]}"
    create_bucket(moto_server, bucket)
    yield S3Env(moto_server, bucket)


INTERVAL = "2024-01-01/2024-01-02"


@dataclass(frozen=True)
class S3Release:
    """A spec (local file) reading from and publishing into the test bucket, its ledger URL and noise key."""

    spec: Path
    ledger_url: str
    key_file: Path
    bucket: str

    def base(self) -> list[str]:
        """``--interval ... --ledger ... --key-file ...`` for ``dpops release run SPEC``."""
        return ["--interval", INTERVAL, "--ledger", self.ledger_url, "--key-file", str(self.key_file)]

    def args(self) -> list[str]:
        """``SPEC --interval ... --ledger ... --key-file ...``."""
        return [str(self.spec), *self.base()]


def s3_release(s3: S3Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, inputs: dict[str, "pa.Table"],
               input_path: str, *, epsilon: float, cap: float, public: list[str], metrics: list[dict],
               max_partitions: int = 1, max_rows: int = 5) -> S3Release:
    """Upload ``inputs`` (key under ``data/`` -> table) as Parquet, write the spec ``name`` (input
    ``<bucket>/data/<input_path>``, output root ``<bucket>/out``, partitions ``region`` with ``public``), set the
    data and output roots to the bucket's prefixes, create the scope ``shop`` (cap ``cap``) in a SQLite ledger
    and generate a noise key."""
    import io

    import pyarrow.parquet as pq
    import yaml

    from dpops.ledger import ScopeDefinition, open_ledger
    from dpops.noise.randomness import NoiseKey
    from dpops.storage import Location, files

    bucket = s3.uri()
    for key, table in inputs.items():
        buf = io.BytesIO()
        pq.write_table(table, buf)
        files.write_bytes(Location.parse(f"{bucket}/data/{key}"), buf.getvalue())
    doc = {
        "name": name,
        "input": {"path": f"{bucket}/data/{input_path}", "format": "parquet",
                  "columns": {"user_id": "string", "region": "string", "amount": "float"}},
        "privacy_unit": {"column": "user_id", "description": "a user's purchases on one day", "adjacency": "add_remove"},
        "budget": {"scope": "shop", "epsilon": epsilon, "delta": 0},
        "contribution": {"max_partitions_per_unit": max_partitions, "max_rows_per_unit_per_partition": max_rows},
        "partitions": {"columns": ["region"], "public": public},
        "metrics": metrics,
        "output": {"root": f"{bucket}/out"},
    }
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(doc))
    monkeypatch.setenv("DPOPS_OUTPUT_ROOTS", f"{bucket}/out")
    monkeypatch.setenv("DPOPS_DATA_ROOTS", f"{bucket}/data")
    monkeypatch.delenv("DPOPS_MANIFESTS_DIR", raising=False)
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    with open_ledger(url) as led:
        led.create_scope(ScopeDefinition(name="shop", unit="a user's purchases", unit_column="user_id", epsilon=cap,
                                         delta=1e-6, rho=None, accountant="basic/1", adjacency="add_remove"),
                         actor="test")
    key_file = tmp_path / "noise.key"
    NoiseKey.generate(key_file)
    return S3Release(spec, url, key_file, bucket)


__all__ = ["moto_server", "s3", "S3Env", "S3Release", "s3_release", "start_moto_server", "stop_server", "s3_env_vars", "create_bucket",
           "free_port"]
