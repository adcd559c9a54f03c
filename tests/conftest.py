"""Shared fixtures. Environment set before anything imports GX or Airflow."""

from __future__ import annotations

import os

os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
os.environ.setdefault("SCARF_ANALYTICS", "false")
os.environ.setdefault("DO_NOT_TRACK", "true")
# pytest-xdist's workers inherit COLUMNS=80 (xdist sets it for its own terminal reporting), which the CLI's prose
# honours (dpops.cli.common.prose_width): every message would then wrap at 80 under `make test` (-n 3) and not in
# a single process. Tests run as a pipe does, lines whole; a test that checks a width sets COLUMNS itself.
os.environ.pop("COLUMNS", None)
# The private run log (exact counts) goes to the state directory, never under an output root: keep the
# tests' logs out of the real ~/.local/state/dpops.
if "DPOPS_STATE_DIR" not in os.environ:
    import tempfile

    os.environ["DPOPS_STATE_DIR"] = tempfile.mkdtemp(prefix="dpops-test-state-")

import pytest
from fuzz_support import register_profiles

# Property tests run with a fixed seed unless HYPOTHESIS_PROFILE=fuzz (`make fuzz`): tests/fuzz_support.py says why.
# Loaded here, before any test module builds its settings objects, so they inherit the profile.
register_profiles()

# Keeps the suite running when a library closes pytest's own capture file (tests/capture_guard.py says how).
# cpu_report: wall and CPU per test file with DPOPS_TEST_CPU_REPORT=DIR (tests/cpu_report.py says why).
pytest_plugins = ["capture_guard", "cpu_report", "pytester"]  # pytester: tests/test_capture_guard.py runs pytest

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


# `make test` runs `pytest -n auto --dist loadfile --no-loadscope-reorder`: each worker takes whole files in
# collection order. The files that take longest go first, so the last files handed out are short and both
# workers finish together (xdist's default order, by number of tests, put the 1-test Airflow files last).
# Seconds each file took in the full suite (2 workers, shared 2-core machine, 2026-12-01); only the order matters.
SLOWEST_FIRST = (
    "test_year_in_the_life_airflow.py",  # ~510 s alone: one Airflow stack, ~25 DAG runs, a scheduler restart
    "test_airflow_operations.py",  # ~420 s: one Airflow stack, ~10 DAG runs, then the 6-day backfill twice
    "test_dags_airflow.py",  # 161 s
    "test_demo.py",  # 133 s: make demo twice, real DAG runs
    "test_cluster_estimate.py",  # ~410 s under load 8-25: two estimations on isolated workers, input on S3
    "test_cluster_release.py",  # 127 s
    "test_cluster_tune.py",  # ~60 s: a private tune on isolated workers, sample on S3
    "test_deploy_stack.py",  # 114 s
    "test_cluster_harness.py",  # 87 s
    "test_dags_native.py",  # 71 s
    "test_faults.py",  # 70 s
    "test_year_in_the_life.py",  # 68 s
    "test_audit_float_sums.py",  # 65 s: 2^22-row attacks
    "test_airflow_plugin.py",  # 55 s
    "test_extremes.py",  # ~50 s: every accepted extreme, 8 real Beam runs
    "test_audit_estimate.py",  # ~30 s: the estimators' audits
    "test_dags_run.py",  # 43 s
    "test_cluster_runner_check.py",  # 40 s
    "test_storage_s3_scratch.py",  # 40 s
    "test_gx_project.py",  # 34 s
    "test_corpus.py",  # 33 s
    "test_pipeline_s3.py",  # 22 s
    "test_reader_isolation.py",  # 21 s
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the files of ``SLOWEST_FIRST`` first, in that order; every other file keeps its place after them."""
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


