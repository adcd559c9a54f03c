"""The same release through Beam's portable path (local job service, LOOPBACK workers) gives output
identical to the in-process run under the same key: the DoFns are picklable and hold no shared state."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest

from test_pipeline_helpers import request, run, write_input, write_spec

pytestmark = pytest.mark.timeout(240)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def job_service(tmp_path):
    port = _free_port()
    log = open(tmp_path / "job_service.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "apache_beam.runners.portability.local_job_service_main", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.time() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"job service exited with {proc.returncode}: {(tmp_path / 'job_service.log').read_text()}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline:
                    pytest.fail("job service did not start listening within 60 s")
                time.sleep(0.3)
        yield port
    finally:
        proc.terminate()  # this PID only
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
        log.close()


def test_portable_runner_matches_in_process(tmp_path, job_service):
    from dpops.noise.randomness import NoiseKey

    key_path = tmp_path / "noise.key"
    NoiseKey.generate(key_path)
    gen = np.random.default_rng(5)
    n = 2000
    rows = {"user_id": [f"u{i}" for i in gen.integers(0, 300, n)], "region": list(gen.choice(["n", "s", "e"], n)),
            "amount": list(gen.uniform(-5, 120, n)), "category": list(gen.choice(["x", "y", "z"], n))}
    metrics = [{"type": "count"}, {"type": "sum", "column": "amount", "bounds": [0, 100]},
               {"type": "mean", "column": "amount", "bounds": [0, 100]},
               {"type": "quantiles", "column": "amount", "bounds": [0, 100], "quantiles": [0.5]},
               {"type": "top_k", "column": "category", "k": 1, "domain": ["x", "y", "z"]}]
    spec = write_spec(tmp_path, metrics, {"columns": ["region"], "private": {"strategy": "truncated_geometric"}},
                      epsilon=2.0, delta=1e-6)
    inp = write_input(tmp_path, rows)
    local, _, _ = run(request(spec, [inp], tmp_path / "local", randomness="keyed", key_path=str(key_path)))
    portable, summary, _ = run(request(
        spec, [inp], tmp_path / "portable", randomness="keyed", key_path=str(key_path), runner="PortableRunner",
        runner_options=(f"--job_endpoint=localhost:{job_service}", "--environment_type=LOOPBACK")))
    assert summary["runner"] == "PortableRunner"
    assert len(local) >= 1
    pd.testing.assert_frame_equal(local, portable)
