"""Shared fixtures. Environment set before anything imports GX or Airflow."""

from __future__ import annotations

import os

os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
os.environ.setdefault("SCARF_ANALYTICS", "false")
os.environ.setdefault("DO_NOT_TRACK", "true")
# The private run log (exact counts) goes to the state directory, never under an output root: keep the
# tests' logs out of the real ~/.local/state/dpops.
if "DPOPS_STATE_DIR" not in os.environ:
    import tempfile

    os.environ["DPOPS_STATE_DIR"] = tempfile.mkdtemp(prefix="dpops-test-state-")

import pytest

# The S3 test server (session scope, started on first use) and a fresh bucket per test, for every module.
from s3_support import moto_server, s3  # noqa: E402, F401

POSTGRES_URL = os.environ.get("DPOPS_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


def _postgres_available() -> bool:
    try:
        import psycopg
    except ImportError:
        return False
    try:
        with psycopg.connect(POSTGRES_URL, connect_timeout=3):
            return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def postgres_url() -> str:
    """URL of the real PostgreSQL server. Under CI=true its absence is a failure, not a skip."""
    if not _postgres_available():
        if os.environ.get("CI") == "true":
            pytest.fail(f"PostgreSQL is required under CI=true but {POSTGRES_URL} is not reachable")
        pytest.skip(f"PostgreSQL not reachable at {POSTGRES_URL}")
    return POSTGRES_URL
