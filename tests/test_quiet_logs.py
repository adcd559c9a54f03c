"""Issue 21 item 13: ``dpops release run --no-progress`` prints its outcome line and nothing from Great
Expectations or Beam's import-time warnings (reproduced on 42476cc: ``INFO:great_expectations.data_context.
types.base:Created temporary directory '...' for ephemeral docs site`` and ``WARNING:root:apitools not found``
on every run), while a dpops warning still reaches stderr.

The CLI runs in its own process (the real Beam pipeline on the FnApiRunner, a deployed GX project as
deploy/ sets ``DPOPS_GX_PROJECT``, no GX_* environment opt-outs), as an operator runs it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_support import DAYS, make_env

REPO = Path(__file__).resolve().parent.parent


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GX_ANALYTICS_ENABLED", "SCARF_ANALYTICS", "DO_NOT_TRACK") and not k.startswith("DPOPS_")}
    env.update(PYTHONPATH=str(REPO), DPOPS_GX_PROJECT=str(tmp_path / "gx"))
    return env


def test_release_run_prints_no_gx_or_beam_lines(tmp_path):
    with pytest.MonkeyPatch.context() as mp:  # only the files: the run below uses the real pipeline
        env = make_env(tmp_path, mp)
    done = subprocess.run([sys.executable, "-m", "dpops.cli.main", "release", "run", str(env.spec), *env.base(DAYS[0]),
                           "--ledger", env.url, "--no-progress", "--publish"],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path, env=_env(tmp_path))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "outcome=published" in done.stdout
    assert (tmp_path / "gx" / "gx").is_dir(), "the GX project was used (its checkpoint ran)"
    for noise in ("great_expectations", "ephemeral docs site", "apitools", "bigquery", "INFO:"):
        assert noise not in done.stderr, done.stderr
    assert done.stderr == "", done.stderr


def test_gx_context_is_quiet_even_with_the_root_logger_at_info(tmp_path):
    """Airflow task logs take INFO from every logger: the GX ephemeral context (the input/output checks) must
    still not log its temporary docs site, and a dpops INFO line must still show."""
    code = ("import logging, sys\n"
            "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
            "import pyarrow as pa, pyarrow.parquet as pq\n"
            "pq.write_table(pa.table({'a': [1, 2]}), 'x.parquet')\n"
            "from dpops.release.gx_checks import check_input_schema\n"
            "check_input_schema(['x.parquet'], {'a': 'int'}, 'parquet')\n"
            "logging.getLogger('dpops.release').info('dpops-own-info')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env=_env(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "great_expectations" not in done.stderr and "ephemeral" not in done.stderr, done.stderr
    assert "dpops-own-info" in done.stderr
    assert logging.getLogger("dpops").level in (logging.NOTSET, logging.DEBUG, logging.INFO)
