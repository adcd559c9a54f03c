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


# `make test` runs `pytest -n 3 --dist loadfile --no-loadscope-reorder`: each worker takes whole files in
# collection order. The files that take longest go first, so the last files handed out are short and the
# workers finish together (xdist's default order, by number of tests, put the 1-test Airflow files last).
# Wall and CPU seconds of each file in the whole suite (3 workers on the shared 2-core machine at load 7-13,
# 2026-12-03, `DPOPS_TEST_CPU_REPORT`): every file of 40 s or more, longest first; only the order matters.
SLOWEST_FIRST = (
    "test_year_in_the_life_airflow.py",  # 473 s wall, 160 CPU-s: one Airflow stack, ~25 DAG runs, a scheduler restart
    "test_airflow_operations.py",  # 454 s wall, 122 CPU-s: one Airflow stack, ~10 DAG runs, then the 6-day backfill twice
    "test_cluster_release.py",  # 271 s wall, 45 CPU-s: releases on isolated Beam workers
    # 630 s wall at load ~10 since it also runs a release with bounds: estimate on the workers (lead's check run)
    "test_cluster_estimate.py",
    "test_audit_float_sums.py",  # 249 s wall, 59 CPU-s: 2^22-row attacks
    "test_year_in_the_life.py",  # 216 s wall, 48 CPU-s: benchmarks/year_in_the_life.py, forked CLI children
    "test_deploy_stack.py",  # 213 s wall, 66 CPU-s: the compose stack's services as uid 50000
    "test_demo.py",  # 189 s wall, 60 CPU-s: make demo twice, real DAG runs
    "test_dags_airflow.py",  # 161 s wall, 54 CPU-s: one Airflow stack
    "test_faults.py",  # 153 s wall, 28 CPU-s
    "test_dags_native.py",  # 143 s wall, 24 CPU-s
    "test_cluster_harness.py",  # 138 s wall, 12 CPU-s
    "test_simulate.py",  # 133 s wall, 32 CPU-s
    "test_analysis_notebook.py",  # 122 s wall, 24 CPU-s
    "test_gx_project.py",  # 98 s wall, 40 CPU-s
    "test_cluster_tune.py",  # 95 s wall, 20 CPU-s
    "test_extremes.py",  # 95 s wall, 19 CPU-s
    "test_pipeline_sums.py",  # 77 s wall, 14 CPU-s
    "test_analysis_estimate.py",  # 77 s wall, 11 CPU-s
    "test_dags_run.py",  # 76 s wall, 25 CPU-s
    "test_tune_beam.py",  # 73 s wall, 19 CPU-s
    "test_analysis_tune.py",  # ~69 s wall, ~19 CPU-s (suite4: variance targets compute only the half-width)
    "test_airflow_support.py",  # 64 s wall, 8 CPU-s
    "test_pipeline_streaming.py",  # 64 s wall, 11 CPU-s
    "test_pipeline_s3.py",  # 61 s wall, 10 CPU-s
    "test_analysis_solver.py",  # 59 s wall, 12 CPU-s
    "test_quiet_logs.py",  # 59 s wall, 11 CPU-s
    "test_reader_isolation.py",  # 57 s wall, 17 CPU-s
    "test_estimation_beam.py",  # 57 s wall, 19 CPU-s
    "test_leaks_airflow.py",  # 55 s wall, 17 CPU-s
    "test_corpus.py",  # 54 s wall, 13 CPU-s
    "test_spec_property.py",  # 54 s wall, 10 CPU-s
    "test_cluster_runner_check.py",  # 52 s wall, 13 CPU-s
    "test_ledger.py",  # 51 s wall, 7 CPU-s
    "test_airflow_plugin.py",  # 51 s wall, 23 CPU-s
    "test_bounds_estimate_option.py",  # 49 s wall, 10 CPU-s
    "test_bench_vs_duckdb.py",  # 46 s wall, 9 CPU-s
    "test_storage_s3_pipeline.py",  # 46 s wall, 11 CPU-s
    "test_report.py",  # 43 s wall, 8 CPU-s
    "test_ledger_roles_property.py",  # 43 s wall, 2 CPU-s
    "test_audit_planted_bugs.py",  # 42 s wall, 8 CPU-s
    "test_storage_s3_scratch.py",  # 41 s wall, 14 CPU-s
    "test_audit_estimate.py",  # 41 s wall, 11 CPU-s
    "test_bound_choice.py",  # 41 s wall, 8 CPU-s
    "test_analysis_calibration.py",  # ~40 s wall, ~14 CPU-s (suite4, scaled from the -n 0 ratio)
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the files of ``SLOWEST_FIRST`` first, in that order; every other file keeps its place after them."""
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


