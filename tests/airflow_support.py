"""Helpers for the Airflow tests: a private AIRFLOW_HOME, workspaces with a spec, data,
a noise key and a ledger scope, and the environment for Airflow subprocesses.

Importing this module sets the environment Airflow reads at its own import time, so it
must be imported before anything imports ``airflow`` (tests/test_dags*.py import it first).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

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
    data: str = "data",
) -> Workspace:
    """A spec folder with one release, ``days`` of synthetic data, a noise key and a ledger scope.

    Several releases can share one spec folder (one stack serves them all: same ``root``, ledger and key): each
    then needs its own input folder ``data`` under it, so that no release reads or rewrites another's days."""
    from dpops.noise.randomness import NoiseKey
    from dpops.testing.synthetic import generate_events

    root.mkdir(parents=True, exist_ok=True)
    specs = root / "specs"
    specs.mkdir(exist_ok=True)
    public = ", ".join(f"p{i}" for i in range(n_partitions))
    spec_path = specs / f"{release}.yaml"
    text = SPEC_TEMPLATE.format(name=release, scope=scope, epsilon=epsilon_per_run, public=public)
    assert text.count('  path: "data/') == 1, "SPEC_TEMPLATE's input path changed: update make_workspace"
    spec_path.write_text(text.replace('  path: "data/', f'  path: "{data}/'))
    generate_events(
        str(specs / data / "{start:%Y-%m-%d}.parquet"),
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


# Settings that change what `airflow db migrate` writes into a new metadata database besides the schema (the
# default pool's slots, the log template rows, the external managers' tables such as the FAB provider's): a
# template is only reused by stacks whose environment gives them the same values.
MIGRATE_INPUTS = ("AIRFLOW__CORE__DEFAULT_POOL_TASK_SLOT_COUNT", "AIRFLOW__LOGGING__LOG_FILENAME_TEMPLATE",
                  "AIRFLOW__ELASTICSEARCH__LOG_ID_TEMPLATE", "AIRFLOW__CORE__AUTH_MANAGER",
                  "AIRFLOW__DATABASE__EXTERNAL_DB_MANAGERS")
_TEMPLATE_LOCK = 0x6470_6F70_7354_4D50  # pg_advisory_lock key ("dpopsTMP"): one builder/cloner at a time


def metadata_template_name(env: dict[str, str]) -> str:
    """The name of the migrated template database for this Airflow and a stack environment ``env``: a digest of
    the versions of Airflow and its providers, Airflow's migration scripts and the settings that change what
    ``db migrate`` writes (``MIGRATE_INPUTS``), so an upgrade or a different setting never reuses a template
    migrated by another. Read from the installed files (Airflow is not imported here)."""
    import hashlib
    import importlib.metadata
    import importlib.util
    import json

    spec = importlib.util.find_spec("airflow")
    assert spec is not None and spec.submodule_search_locations, "Airflow is not installed"
    versions = Path(list(spec.submodule_search_locations)[0]) / "migrations" / "versions"
    dists = sorted({(d.metadata["Name"].lower(), d.version) for d in importlib.metadata.distributions()
                    if (d.metadata["Name"] or "").lower().startswith("apache-airflow")})
    key = json.dumps({"airflow": dists,  # the core and its providers (the FAB provider migrates its own tables)
                      "migrations": sorted(f.name for f in versions.glob("*.py")),
                      "settings": {k: env.get(k) for k in MIGRATE_INPUTS}}, sort_keys=True)
    return f"dpops_af_template_{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _template_env(home: Path, url: str) -> dict[str, str]:
    """The environment the template is migrated in: a stack's (``airflow_env``) without a stack's own settings."""
    return airflow_env(home, url, home)


def _ensure_template(admin, postgres_url: str, name: str) -> None:
    """Build the template ``name`` if it does not exist: ``airflow db migrate`` (the documented command) into a
    build database, which is renamed to ``name`` only once the migration succeeded, so a half-migrated database
    is never cloned. The caller holds the advisory lock."""
    import secrets

    if admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
        return
    build = f"{name}_build_{secrets.token_hex(3)}"
    admin.execute(f'CREATE DATABASE "{build}"')
    try:
        home = Path(tempfile.mkdtemp(prefix="dpops-airflow-template-"))
        try:
            url = postgres_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1) + f"/{build}"
            airflow_cli(_template_env(home, url), "db", "migrate", timeout=300)
        finally:
            shutil.rmtree(home, ignore_errors=True)
        admin.execute(f'ALTER DATABASE "{build}" RENAME TO "{name}"')
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{build}" WITH (FORCE)')


@contextmanager
def metadata_db(postgres_url: str, prefix: str) -> Iterator[str]:
    """A fresh, migrated PostgreSQL database ``<prefix>_<hex>`` for Airflow's metadata, dropped (FORCE)
    afterwards; yields its ``postgresql+psycopg://`` URL.

    The database is a copy (``CREATE DATABASE ... TEMPLATE``) of one that ``airflow db migrate`` created once for
    this Airflow (``metadata_template_name``; kept on the server for the next sessions), not a migration of its
    own: a migration costs ~7 CPU-s a stack, a copy well under one. A copy has the schema, the default pool and
    the log template that the migration wrote, and nothing else (no run, DAG or connection). Building and copying
    are serialized across processes by a PostgreSQL advisory lock (released if its holder dies), since PostgreSQL
    refuses to copy a database another session is using."""
    import secrets

    import psycopg

    name = f"{prefix}_{secrets.token_hex(4)}"
    template = metadata_template_name(_template_env(REPO, ""))
    with psycopg.connect(postgres_url, autocommit=True, connect_timeout=5) as admin:
        admin.execute("SELECT pg_advisory_lock(%s)", (_TEMPLATE_LOCK,))
        try:
            _ensure_template(admin, postgres_url, template)
            admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        finally:
            admin.execute("SELECT pg_advisory_unlock(%s)", (_TEMPLATE_LOCK,))
    try:
        yield postgres_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1) + f"/{name}"
    finally:
        pg_exec(postgres_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def airflow_cli(env: dict, *args: str, timeout: float = 240, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([AIRFLOW_BIN, *args], env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, f"airflow {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


# Runs each argv of argv[1] (JSON) as `airflow <argv>` through airflow.__main__.main, the `airflow` script's own
# entry point, one after another in this one interpreter; a command that fails (exception or non-zero exit)
# stops the batch with its exit code. A marker line before each command names it in the output.
_CLI_BATCH = """
import json, sys
from airflow.__main__ import main
for argv in json.loads(sys.argv[1]):
    print("[airflow_cli_batch] airflow " + " ".join(argv), flush=True)
    sys.argv = ["airflow", *argv]
    try:
        main()
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
print("[airflow_cli_batch] done", flush=True)
"""


def airflow_cli_batch(env: dict, commands: list[list[str]], *, cwd: Path | None = None,
                      timeout: float = 300) -> subprocess.CompletedProcess:
    """``airflow <argv>`` for each of ``commands``, in order, in one interpreter: what the ``airflow`` script runs
    (``airflow.__main__.main``), without starting and importing Airflow again for each command (~3 CPU-s each).
    For a test's setup commands only; a test about a CLI command's own behaviour (its exit code, its output)
    runs it with ``airflow_cli``. Asserts that every command ran and succeeded."""
    proc = subprocess.run([str(VENV_BIN / "python"), "-c", _CLI_BATCH, json.dumps(commands)], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)
    ran = [line for line in proc.stdout.splitlines() if line.startswith("[airflow_cli_batch] airflow ")]
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("[airflow_cli_batch] done"), (
        f"{ran[-1] if ran else 'airflow'} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    assert len(ran) == len(commands), ran
    return proc


def create_backfill(env: dict, meta_url: str, dag_id: str, *args: str, alive: Callable[[], None] | None = None,
                    timeout: float = 90) -> None:
    """``airflow backfill create --dag-id dag_id <args>`` (the runbook's command), once the scheduler has closed the
    DAG's earlier backfill.

    Airflow 3.3 accepts one open backfill per DAG (``AlreadyRunningBackfill`` while a ``backfill`` row of the DAG
    has ``completed_at`` NULL) and its scheduler closes a finished one on a 30 s loop. Retrying the CLI until it is
    accepted costs ~3 CPU s per refused call (a fresh ``airflow`` interpreter), so this waits on the row itself
    (the condition the CLI checks) and then runs the command; a failure after that is retried, as before, until
    ``timeout``. ``alive`` (e.g. ``Stack.alive``) fails fast when a stack process died while waiting."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        while pg_exec(meta_url, "SELECT count(*) FROM backfill WHERE dag_id = %s AND completed_at IS NULL",
                      (dag_id,), fetch=True)[0][0]:
            assert time.monotonic() < deadline, f"the scheduler did not close the earlier backfill of {dag_id}"
            if alive is not None:
                alive()
            time.sleep(0.5)
        proc = airflow_cli(env, "backfill", "create", "--dag-id", dag_id, *args, check=False)
        if proc.returncode == 0:
            return
        assert time.monotonic() < deadline, (
            f"airflow backfill create failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        time.sleep(1)


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


def stop_stack_processes(procs: list, meta_url: str) -> None:
    """Stop a stack's processes (each by its own PID/group id) side by side instead of one after the other.

    Stopping one takes seconds of wall time (SIGTERM; the scheduler's LocalExecutor waits for its running tasks,
    then an interpreter with GX and Beam preloaded tears down; the api-server's teardown garbage-collects a large
    heap), so one by one a stack took ~10-34 s to stop. Every process except the api-server is signalled at once;
    the api-server too when no task instance is queued or running, since only a task needs it (the Execution API)
    while the scheduler shuts down: otherwise it is signalled once the others have exited, as before. Each
    process is signalled once, waited for by its own PID and its group SIGKILLed if it has not exited 20 s
    after its signal (as ``stop_process``)."""
    import signal
    import time

    live = [p for p in procs if p.poll() is None]
    api = [p for p in live if p.args[1] == "api-server"]
    rest = [p for p in live if p not in api]
    try:
        busy = pg_exec(meta_url, "SELECT count(*) FROM task_instance WHERE state IN ('queued', 'running')",
                       fetch=True)[0][0]
    except Exception:  # noqa: BLE001 - no answer: keep the api-server up until the others are gone
        busy = 1
    first, last = (rest, api) if busy else (live, [])
    for group in (first, last):
        for p in group:  # once each: a second SIGTERM makes the scheduler stop without waiting for its tasks
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 20
        for p in group:  # as stop_process: 20 s after the signal, the group is killed
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)


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


# ------------------------------------------------------------------- a running stack, driven over REST


class Stack:
    """A running api-server + scheduler + dag-processor, driven over the REST API as an operator would."""

    def __init__(self, env: dict, port: int, home: Path, ws, procs: list, meta_url: str):
        self.env, self.port, self.home, self.ws, self.procs, self.meta_url = env, port, home, ws, procs, meta_url
        self._token: str | None = None

    def token(self) -> str:
        """The admin login's bearer token (fetched once)."""
        import httpx

        if self._token is None:
            r = httpx.post(f"http://127.0.0.1:{self.port}/auth/token",
                           json={"username": "dpops", "password": self.env["_PW"]}, timeout=30)
            r.raise_for_status()
            self._token = r.json()["access_token"]
        return self._token

    def client(self):
        import httpx

        return httpx.Client(base_url=f"http://127.0.0.1:{self.port}/api/v2",
                            headers={"Authorization": f"Bearer {self.token()}"}, timeout=30)

    def alive(self) -> None:
        for p in self.procs:
            assert p.poll() is None, f"{p.args[1]} died with {p.returncode}"

    def wait_run(self, dag_id: str, run_id: str, timeout: float = 300, min_clear: int = 0) -> dict:
        """The run as the REST API returns it, once it has ended (success or failed) after at least ``min_clear``
        clears. The wait polls the metadata database on one connection (a query costs well under a millisecond;
        a REST poll costs the api-server a request); the REST API gives the answer, and is asked again if it does
        not agree yet."""
        import time

        import psycopg

        deadline = time.monotonic() + timeout
        run: dict = {}
        row = None
        with psycopg.connect(self.meta_url.replace("postgresql+psycopg://", "postgresql://", 1), autocommit=True,
                             connect_timeout=5) as db, self.client() as c:
            while time.monotonic() < deadline:
                self.alive()
                row = db.execute("SELECT state, clear_number FROM dag_run WHERE dag_id = %s AND run_id = %s",
                                 (dag_id, run_id)).fetchone()
                if row is not None and row[0] in ("success", "failed") and row[1] >= min_clear:
                    run = c.get(f"/dags/{dag_id}/dagRuns/{run_id}").json()
                    if run.get("state") in ("success", "failed") and self.clear_number(run_id) >= min_clear:
                        return run
                time.sleep(0.5)
        raise AssertionError(f"run {run_id} did not finish in {timeout} s: {run or row}")

    def clear_number(self, run_id: str) -> int:
        rows = pg_exec(self.meta_url, "SELECT clear_number FROM dag_run WHERE run_id = %s", (run_id,), fetch=True)
        return int(rows[0][0]) if rows else -1

    def tis(self, dag_id: str, run_id: str) -> dict[str, dict]:
        with self.client() as c:
            items = c.get(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances").json()["task_instances"]
        return {t["task_id"]: t for t in items}

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1) -> str:
        files = list((self.home / "logs").glob(f"dag_id={dag_id}/run_id={run_id}/task_id={task_id}/attempt={try_number}.log"))
        assert files, f"no log file for {dag_id} {run_id} {task_id}"
        return files[0].read_text()


def start_stack(es, tmp: Path, meta_url: str, ws, *, dags_folder: Path | None = None,
                more_dags: tuple[str, ...] = (), triggerer: bool = False, api_env: dict[str, str] | None = None,
                **extra: str) -> Stack:
    """Start api-server, scheduler and dag-processor (LocalExecutor, PARALLELISM=4) on the migrated metadata
    database ``meta_url`` (from ``metadata_db``) for the workspace ``ws``, and the triggerer with ``triggerer``; every process is stopped by its own id when
    ``es`` (an ExitStack) closes. ``api_env`` overrides the api-server's environment only (deploy/ gives it the
    ledger's reader role, never the application role). The REST login is ``dpops`` (admin);
    ``AIRFLOW_CONN_DPOPS_AIRFLOW_API`` lets tasks set DAG-run notes. Returns once the dag-processor registered
    ``ws.dag_id`` and the ``more_dags`` of ``dags_folder``."""
    import json
    import secrets
    import time

    home = tmp / "airflow"
    home.mkdir()
    # The deployment's local settings (deploy/airflow_config): the scheduler preloads the task code, so every
    # task forked from it skips importing GX and Beam again (the stacks run tens of tasks).
    shutil.copytree(REPO / "deploy" / "airflow_config", home / "config")
    pw = secrets.token_hex(12)
    (home / "passwords.json").write_text(json.dumps({"dpops": pw}))
    port = free_port()
    env = airflow_env(
        home, meta_url, ws.specs_dir, **ws.env(),
        AIRFLOW__CORE__DAGS_FOLDER=str(dags_folder or DAGS_FOLDER),
        AIRFLOW__CORE__EXECUTOR="LocalExecutor",
        AIRFLOW__CORE__PARALLELISM="4",
        AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION="False",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS="dpops:admin",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE=str(home / "passwords.json"),
        AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"http://127.0.0.1:{port}/execution/",
        AIRFLOW__API__PORT=str(port),
        AIRFLOW__API_AUTH__JWT_SECRET=secrets.token_hex(16),
        AIRFLOW__API__SECRET_KEY=secrets.token_hex(16),
        AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC="2",
        AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="20",
        # Every spec and DAG file of a test stack is written before it starts, so the first parse is the one that
        # counts; re-parsing each file every 30 s (the default) cost the dag-processor 2.2 CPU-s a minute, 0.8 at
        # 600 s (measured, load 11). A new file is still found within REFRESH_INTERVAL.
        AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL="600",
        AIRFLOW__LOGGING__BASE_LOG_FOLDER=str(home / "logs"),
        AIRFLOW__LOGGING__LOGGING_LEVEL="INFO",
        AIRFLOW_CONN_DPOPS_AIRFLOW_API=f"http://dpops:{pw}@127.0.0.1:{port}",
        DPOPS_RETRY_DELAY_SECONDS="2",
        **extra,
    )
    env["_PW"] = pw
    assert metadata_template_name(env) == metadata_template_name(_template_env(REPO, "")), (
        "this stack's settings change what `airflow db migrate` writes: give metadata_db the same environment")
    procs = [start_airflow({**env, **(api_env or {})}, home, es, "api-server", "--port", str(port)),
             start_airflow(env, home, es, "scheduler"),
             start_airflow(env, home, es, "dag-processor")]
    if triggerer:
        procs.append(start_airflow(env, home, es, "triggerer"))
    # Registered last, so run first when ``es`` closes: all of them side by side (``Stack.procs`` is this list, so
    # a process a test replaced is the one stopped); each one's own callback then finds it gone.
    es.callback(stop_stack_processes, procs, meta_url)
    wait_health(port, procs)
    stack = Stack(env, port, home, ws, procs, meta_url)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # the dag-processor's first pass over the folder
        stack.alive()
        rows = pg_exec(meta_url, "SELECT dag_id FROM dag WHERE is_stale = false", fetch=True)
        if {r[0] for r in rows} >= {ws.dag_id, *more_dags}:
            return stack
        time.sleep(1)
    raise AssertionError("the dag-processor did not register the DAG")
