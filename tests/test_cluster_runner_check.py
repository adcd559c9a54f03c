"""A bad runner, option or endpoint fails with exit 6 before the ledger reserves or starts anything.

Through the CLI in a subprocess, os randomness (where a started run would stay charged): a typo'd
runner, a dead job endpoint and a black-hole job endpoint each exit 6 within 30 s and leave the ledger
without a run and the scope's budget whole. A control run with a valid runner shows the same
assertions do see a charge. The check itself (pipelines.runner_check) is also tested in-process.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cluster_support import BlackHole, dead_port, pythonpath_env
from dpops.errors import RunnerError
from dpops.ledger import ScopeDefinition, open_ledger
from dpops.noise.randomness import NoiseKey
from test_pipeline_helpers import write_input, write_spec

pytestmark = pytest.mark.timeout(300)
SCOPE_EPS = 3.0


@pytest.fixture
def release_env(tmp_path):
    gen = np.random.default_rng(3)
    n = 500
    rows = {"user_id": [f"u{i}" for i in gen.integers(0, 100, n)], "region": list(gen.choice(["n", "s"], n)),
            "amount": list(gen.uniform(0, 50, n)), "category": list(gen.choice(["x", "y"], n))}
    spec = write_spec(tmp_path, [{"type": "count"}], {"columns": ["region"], "public": ["n", "s"]},
                      epsilon=1.0, delta=1e-7)
    write_input(tmp_path, rows)
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    led = open_ledger(url)
    led.create_scope(ScopeDefinition(name="s", unit="a user-day", unit_column="user_id", epsilon=SCOPE_EPS,
                                     delta=1e-5, rho=None, accountant="basic/1", adjacency="add_remove"), actor="test")
    led.close()
    key = tmp_path / "noise.key"
    NoiseKey.generate(key)
    return tmp_path, spec, url, key


def _cli(env_dir: Path, spec: Path, url: str, key: Path, runner: str, *options: str, timeout: float = 60):
    argv = [sys.executable, "-m", "dpops.cli.main", "release", "run", str(spec), "--interval", "2024-01-01/2024-01-02",
            "--ledger", url, "--key-file", str(key), "--randomness", "os", "--runner", runner]
    for o in options:
        argv += ["--runner-option", o]
    env = {**os.environ, **pythonpath_env(), "DPOPS_STATE_DIR": str(env_dir / "state")}
    env.pop("DPOPS_RUNNER_CONNECT_TIMEOUT", None)  # the default bound (10 s) is the one under test
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=env_dir,
                          check=False)
    return proc, time.monotonic() - t0


def _assert_nothing_charged(url: str) -> None:
    led = open_ledger(url)
    try:
        assert led.runs(release="t") == [], "a run was reserved or started"
        assert float(led.status("s").remaining) == pytest.approx(SCOPE_EPS)
    finally:
        led.close()


@pytest.mark.parametrize("case", ["typo", "dead_endpoint", "black_hole", "unknown_flag"])
def test_bad_runner_exits_6_before_the_ledger(release_env, case):
    tmp, spec, url, key = release_env
    with BlackHole() as hole:
        if case == "typo":
            args, names = ("FnApiRuner",), "FnApiRuner"
        elif case == "dead_endpoint":
            port = dead_port()
            args, names = ("PortableRunner", f"--job_endpoint=localhost:{port}"), f"localhost:{port}"
        elif case == "black_hole":
            args, names = ("PortableRunner", f"--job_endpoint=localhost:{hole.port}"), f"localhost:{hole.port}"
        else:
            args, names = ("FnApiRunner", "--job_endpont=localhost:1"), "--job_endpont"
        proc, elapsed = _cli(tmp, spec, url, key, *args)
    assert proc.returncode == 6, (proc.returncode, proc.stderr[-2000:])
    assert elapsed < 30, f"took {elapsed:.1f} s"
    assert "RunnerError" in proc.stderr or "runner" in proc.stderr.lower()
    assert names in proc.stderr, proc.stderr[-2000:]
    _assert_nothing_charged(url)


def test_control_valid_runner_is_charged(release_env):
    """The same command with a valid runner publishes nothing (stage only) but is charged: the
    assertions above can fail."""
    tmp, spec, url, key = release_env
    proc, _ = _cli(tmp, spec, url, key, "FnApiRunner", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    led = open_ledger(url)
    try:
        assert len(led.runs(release="t")) == 1
        assert float(led.status("s").remaining) == pytest.approx(SCOPE_EPS - 1.0)
    finally:
        led.close()


def test_compute_step_checks_before_start(release_env):
    """The Airflow path (reserve, then compute as its own task): a dead endpoint at compute fails before
    ``ledger.start``; the run stays reserved (refundable), never started."""
    from dpops import release

    _, spec, url, key = release_env
    led = open_ledger(url)
    try:
        ctx = release.prepare(spec, "2024-01-01", "2024-01-02", randomness="os", key_path=str(key))
        release.reserve(ctx, led)
        os.environ["DPOPS_RUNNER_CONNECT_TIMEOUT"] = "2"
        try:
            with pytest.raises(RunnerError, match="refused"):
                release.compute(ctx, led, runner="PortableRunner", runner_options=(f"--job_endpoint=localhost:{dead_port()}",))
        finally:
            del os.environ["DPOPS_RUNNER_CONNECT_TIMEOUT"]
        assert led.run(ctx.run_id).state == "reserved"
    finally:
        led.close()


# --------------------------------------------------------------------------- the check in-process


def test_known_runners_come_from_beam():
    from apache_beam.options.pipeline_options import StandardOptions

    from pipelines.runner_check import check_runner, known_runners

    names = known_runners()
    for path in StandardOptions.ALL_KNOWN_RUNNERS:
        assert names[path.rsplit(".", 1)[-1].lower()] == path
    assert check_runner("FnApiRunner").runner == "FnApiRunner"
    assert check_runner("DirectRunner").runner == "DirectRunner"
    # Beam does not list DaskRunner: it is handed over by its dotted path, which Beam's create_runner imports
    assert check_runner("DaskRunner").runner == "apache_beam.runners.dask.dask_runner.DaskRunner"


def test_option_errors_name_the_flag_never_the_value(caplog):
    from pipelines.runner_check import check_runner

    with caplog.at_level(logging.DEBUG), pytest.raises(RunnerError) as err:
        check_runner("FnApiRunner", ("--s3_secret_access_key=hunter2", "--s3_secrte_key=hunter3"))
    assert "--s3_secrte_key" in str(err.value)
    assert "hunter" not in str(err.value) and "hunter" not in caplog.text
    with pytest.raises(RunnerError, match="--flexrs_goal"):
        check_runner("FnApiRunner", ("--flexrs_goal=FASTEST_PLEASE",))
    with pytest.raises(RunnerError, match="needs --job_endpoint"):
        check_runner("PortableRunner")
    with pytest.raises(RunnerError, match="--runner"):
        check_runner("FnApiRunner", ("--runner=DirectRunner",))
    with pytest.raises(RunnerError, match="not a Beam PipelineRunner"):
        check_runner("os.path")


def test_dead_dask_scheduler_and_external_pool(monkeypatch):
    from pipelines.runner_check import check_runner

    monkeypatch.setenv("DPOPS_RUNNER_CONNECT_TIMEOUT", "2")
    with pytest.raises(RunnerError, match="Dask scheduler"):
        check_runner("DaskRunner", (f"--dask_client_address=tcp://127.0.0.1:{dead_port()}",))
    monkeypatch.setenv("DPOPS_RUNNER_CONNECT_TIMEOUT", "abc")
    with pytest.raises(RunnerError, match="DPOPS_RUNNER_CONNECT_TIMEOUT"):
        check_runner("FnApiRunner")


def test_live_job_service_passes_and_dead_pool_is_named(tmp_path, monkeypatch):
    """A running job service and EXTERNAL pool pass (both probed); with the pool stopped, the check
    names the pool, not the job endpoint."""
    from cluster_support import portable_options, start_job_service, start_worker_pool
    from pipelines.runner_check import check_runner

    monkeypatch.setenv("DPOPS_RUNNER_CONNECT_TIMEOUT", "5")
    job = start_job_service(tmp_path / "logs")
    try:
        pool = start_worker_pool(tmp_path / "logs", hide=[])
        try:
            opts = portable_options(job.port, pool.port)
            checked = check_runner("PortableRunner", opts)
            assert checked.probed == (f"job_endpoint localhost:{job.port}", f"environment_config localhost:{pool.port}")
        finally:
            pool.stop()
        with pytest.raises(RunnerError, match=f"worker pool .*localhost:{pool.port}"):
            check_runner("PortableRunner", opts)
    finally:
        job.stop()
