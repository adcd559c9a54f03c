"""Helpers for the Airflow tests: a private AIRFLOW_HOME, workspaces with a spec, data,
a noise key and a ledger scope, and the environment for Airflow subprocesses.

Importing this module sets the environment Airflow reads at its own import time, so it
must be imported before anything imports ``airflow`` (tests/test_dags*.py import it first).
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DAGS_FOLDER = REPO / "dags"
VENV_BIN = Path(sys.executable).parent
AIRFLOW_BIN = str(VENV_BIN / "airflow")

QUIET = {
    "GX_ANALYTICS_ENABLED": "false",
    "SCARF_ANALYTICS": "false",
    "DO_NOT_TRACK": "true",
    "AIRFLOW__CORE__LOAD_EXAMPLES": "false",
    "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS_FOLDER),
    "AIRFLOW__CORE__UNIT_TEST_MODE": "false",
    "AIRFLOW__LOGGING__LOGGING_LEVEL": "WARNING",
    # Retries in the DAG tests must not wait a minute.
    "DPOPS_RETRY_DELAY_SECONDS": "0",
}


def _session_home() -> Path:
    home = Path(tempfile.mkdtemp(prefix="dpops-airflow-"))
    atexit.register(shutil.rmtree, home, True)
    return home


# One private AIRFLOW_HOME + SQLite metadata DB for the in-process tests of this session.
AIRFLOW_HOME = _session_home()
SQLITE_URL = f"sqlite:///{AIRFLOW_HOME / 'airflow.db'}"
os.environ.update(QUIET)
os.environ["AIRFLOW_HOME"] = str(AIRFLOW_HOME)
os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = SQLITE_URL
os.environ.pop("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC", None)

_migrated = False


def migrate_sqlite_db() -> None:
    """Create the session's metadata DB once (about 5 s)."""
    global _migrated
    if _migrated:
        return
    proc = subprocess.run([AIRFLOW_BIN, "db", "migrate"], env=dict(os.environ), capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        raise RuntimeError(f"airflow db migrate failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    _migrated = True


def airflow_env(home: Path, db_url: str, specs_dir: Path, **extra: str) -> dict[str, str]:
    """Environment for an Airflow subprocess (scheduler, dag-processor, CLI)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__")}
    env.update(QUIET)
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": db_url,
            "DPOPS_SPECS_DIR": str(specs_dir),
            "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        }
    )
    if db_url.startswith("postgresql+psycopg://"):
        env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC"] = db_url
    env.update(extra)
    return env


# ------------------------------------------------------------------- workspaces

SPEC_TEMPLATE = """\
name: {name}
description: Airflow test release (synthetic data)
schedule: "0 0 * * *"
input:
  path: "data/{{start:%Y-%m-%d}}.parquet"
  format: parquet
  columns: {{user_id: string, region: string, amount: float, category: string}}
privacy_unit:
  column: user_id
  description: "a synthetic user's events on one day"
  adjacency: add_remove
budget:
  scope: {scope}
  epsilon: {epsilon}
  delta: 0
  noise: laplace
contribution:
  max_partitions_per_unit: 2
  max_rows_per_unit_per_partition: 2
partitions:
  columns: [region]
  public: [{public}]
metrics:
  - {{type: count}}
  - {{type: sum, column: amount, bounds: [0, 100]}}
  - {{type: mean, column: amount, bounds: [0, 100]}}
output:
  root: "out"
"""


@dataclass
class Workspace:
    root: Path
    specs_dir: Path
    spec_path: Path
    key_path: Path
    ledger_url: str
    release: str
    scope: str

    @property
    def dag_id(self) -> str:
        return f"dpops_{self.release}"

    def env(self) -> dict[str, str]:
        return {
            "DPOPS_SPECS_DIR": str(self.specs_dir),
            "DPOPS_LEDGER_URL": self.ledger_url,
            "DPOPS_NOISE_KEY_FILE": str(self.key_path),
            "DPOPS_KEY_DIR": str(self.key_path.parent),  # the operator's key directory (dpops.keyref)
            "DPOPS_RANDOMNESS": "keyed",
        }


def make_workspace(
    root: Path,
    *,
    ledger_url: str | None = None,
    release: str = "af_test",
    scope: str = "af_scope",
    days: int = 3,
    start: str = "2024-01-01",
    epsilon_per_run: float = 0.5,
    scope_cap: float | None = 10.0,
    rows_per_day: int = 2000,
    n_partitions: int = 4,
) -> Workspace:
    """A spec folder with one release, ``days`` of synthetic data, a noise key and a ledger scope."""
    from dpops.randomness import NoiseKey
    from dpops.synthetic import generate_events

    root.mkdir(parents=True, exist_ok=True)
    specs = root / "specs"
    specs.mkdir(exist_ok=True)
    public = ", ".join(f"p{i}" for i in range(n_partitions))
    spec_path = specs / f"{release}.yaml"
    spec_path.write_text(SPEC_TEMPLATE.format(name=release, scope=scope, epsilon=epsilon_per_run, public=public))
    generate_events(
        str(specs / "data" / "{start:%Y-%m-%d}.parquet"),
        n_rows=rows_per_day,
        n_users=max(50, rows_per_day // 5),
        n_partitions=n_partitions,
        days=days,
        seed=7,
        start=start,
    )
    key_path = root / "noise.key"
    if not key_path.exists():
        NoiseKey.generate(key_path)
    url = ledger_url or f"sqlite:///{root / 'ledger.sqlite'}"
    if scope_cap is not None:
        create_scope(url, scope, scope_cap)
    return Workspace(root, specs, spec_path, key_path, url, release, scope)


def create_scope(ledger_url: str, scope: str, epsilon_cap: float, accountant: str = "basic") -> None:
    from dpops.accounting import get_accountant
    from dpops.ledger import ScopeDefinition, open_ledger

    acct = get_accountant(accountant)
    ledger = open_ledger(ledger_url)
    try:
        ledger.create_scope(
            ScopeDefinition(
                name=scope,
                unit="a synthetic user's events on one day",
                unit_column="user_id",
                epsilon=epsilon_cap,
                delta=0.0,
                rho=None,
                accountant=f"{acct.name}/{acct.version}",
                adjacency="add_remove",
            ),
            actor="tests",
        )
    finally:
        close = getattr(ledger, "close", None)
        if close:
            close()


def write_dag_env_file(path: Path, env: dict[str, str]) -> None:
    path.write_text(textwrap.dedent("".join(f"{k}={v}\n" for k, v in env.items())))


# ------------------------------------------------------------------- real Airflow processes


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pg_exec(url: str, sql: str, params: tuple = (), fetch: bool = False):
    import psycopg

    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://", 1), autocommit=True,
                         connect_timeout=5) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchall() if fetch else None


def airflow_cli(env: dict, *args: str, timeout: float = 240, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([AIRFLOW_BIN, *args], env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, f"airflow {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def start_airflow(env: dict, logdir: Path, stack, *args: str) -> subprocess.Popen:
    """``airflow <args>`` in its own session (stopped by its own PID/group id when ``stack`` closes)."""
    log = open(logdir / f"{args[0]}.log", "wb")
    stack.callback(log.close)
    proc = subprocess.Popen([AIRFLOW_BIN, *args], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    stack.callback(stop_process, proc)
    return proc


def stop_process(proc: subprocess.Popen) -> None:
    import signal

    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass


def wait_health(port: int, procs: list, timeout: float = 180) -> None:
    import time
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, f"{p.args[1]} exited early with {p.returncode}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v2/monitor/health", timeout=3):
                return
        except OSError:
            time.sleep(1)
    raise AssertionError("api-server did not become healthy")
