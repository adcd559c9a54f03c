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
from typing import Iterator

import pytest

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


__all__ = ["moto_server", "s3", "S3Env", "start_moto_server", "stop_server", "s3_env_vars", "create_bucket",
           "free_port"]
