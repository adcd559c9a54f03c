"""The compose stack, run without Docker: the same processes, environment and secrets, as uid 50000.

deploy/docker-compose.yml is parsed (tests/deploy_support.py) and each service is started as
the compose file declares it: argv = entrypoint + command (the image's ENTRYPOINT for the
Airflow services), environment = the Dockerfile's ENV overlaid by the service's
``environment``, secrets = exactly the service's ``secrets:`` entries, each written with the
owner and mode its long syntax declares into a per-service directory that stands for that
container's /run/secrets. Every process runs as its compose ``user:`` (``setpriv``): uid/gid 50000,
the api-server as its own uid 50001 with group 50000 (it reads the outputs through the group, never
``staged/``, which is 0700). One-shot services run first in dependency order (airflow-init, ledger-init,
example-data), then api-server, scheduler, dag-processor and triggerer run together.

The documented mapping from the containers to this machine, and nothing else, is applied to
every environment value and argument:

| in the container                  | here                                                    |
| --- | --- |
| ``/run/secrets``                  | ``BASE/secrets/<service>``: only that service's secrets, root-owned dir 0755 like Docker's, bound read-only in the process's own mount namespace |
| ``/data`` (volume dpops-data)     | ``BASE/data`` (created owned by 50000, as in the image) |
| ``/opt/airflow`` (AIRFLOW_HOME)   | ``BASE/airflow`` (logs volume below it)                 |
| ``/opt/airflow/config`` (the image's ``COPY deploy/airflow_config/``) | ``BASE/airflow/config``, a copy of it |
| ``/var/lib/dpops/state``          | ``BASE/state`` (0700, owned by 50000)                   |
| ``/opt/dpops/specs``              | ``BASE/specs``: deploy/specs/*.yaml with this same mapping applied to their paths |
| ``/opt/dpops/dags``, ``/opt/dpops/deploy``, ``/opt/dpops/plugins`` | this repository's ``dags``, ``deploy``, ``plugins`` |
| ``/usr/bin/tini --``              | dropped (the container's init)                          |
| ``ledger-db:5432/dpops_ledger``   | ``127.0.0.1:5432/<fresh database>``                     |
| roles ``dpops_app``, ``dpops_ledger_owner``, ``dpops_reader`` | fresh role names (roles are server-wide) |
| ``airflow-apiserver:8080``, ``--port 8080`` | ``127.0.0.1:<free port>``                     |

The secret files' contents follow deploy/README.md's recipe with local hosts (the Airflow
metadata URL points at a fresh database on 127.0.0.1:5432). Added to every environment:
``PATH`` (this venv first), ``PYTHONPATH`` (this tree, not an installed copy),
``HOME``/``USER``/``LOGNAME`` (uid 50000 has no passwd entry on this machine). The ledger
roles are created by deploy/ledger-roles.sql through psql, as deploy/ledger-db-init.sh
does on the ledger database's first start. A read-only volume mount (``:ro``, ``read_only: true``) is
bound read-only in the process's mount namespace, like its secrets.

The test triggers the latest interval of ``dpops_example_daily`` through the REST API with a
FAB-auth token, unpauses it, waits for the run, and checks that it published: output files
under the output root owned by 50000, the ledger run committed, the manifest verifies with
``dpops manifest verify``, and the runbook's ``dpops report`` works in the scheduler's
environment (the image's ``[report]`` extra). The api-server's Privacy budget page (the plugin, as the
read-only ledger role, on the read-only outputs) shows the example scope with the figures of
``dpops ledger status --json`` run in the scheduler's environment, and lists the run's manifest. Every process is stopped by its own PID (its session), the
databases and roles are dropped.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from airflow_support import stop_process  # its group is stopped by its own PID
from deploy_support import (
    AIRFLOW_SERVICES,
    ONE_SHOT_SERVICES,
    REPO,
    Service,
    as_uid,
    interpreter_namespace,
    load_compose,
    service,
)

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(420)]

UID = GID = 50000
VENV_BIN = Path(sys.executable).parent
DAG_ID = "dpops_example_daily"
RELEASE = "example_daily"
WAIT_RUN_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pg(url: str, sql: str, params: tuple = (), fetch: bool = False):
    import psycopg

    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchall() if fetch else None


class Stack:
    """The mapping from container paths and hosts to this machine (the module docstring's table)."""

    def __init__(self, base: Path, port: int, ledger_db: str, airflow_db: str, suffix: str, pg_base: str):
        self.base, self.port, self.ledger_db, self.airflow_db = base, port, ledger_db, airflow_db
        self.app_role, self.owner_role = f"dpops_app_{suffix}", f"dpops_ledger_owner_{suffix}"
        self.reader_role = f"dpops_reader_{suffix}"
        self.pg_base = pg_base  # postgresql://postgres@127.0.0.1:5432
        self.paths = {
            "/data": base / "data",
            "/opt/airflow": base / "airflow",
            "/var/lib/dpops/state": base / "state",
            "/var/lib/dpops/gx": base / "gx",
            "/opt/dpops/specs": base / "specs",
            "/opt/dpops/dags": REPO / "dags",
            "/opt/dpops/plugins": REPO / "plugins",
            "/opt/dpops/deploy": REPO / "deploy",
        }
        self.logs = base / "proc-logs"

    def secrets_dir(self, svc: Service) -> Path:
        return self.base / "secrets" / svc.name

    def map_value(self, value: str, svc: Service) -> str:
        value = value.replace("/run/secrets", str(self.secrets_dir(svc)))
        for container, host in self.paths.items():
            value = value.replace(container, str(host))
        value = value.replace("ledger-db:5432/dpops_ledger", f"127.0.0.1:5432/{self.ledger_db}")
        value = value.replace("airflow-apiserver:8080", f"127.0.0.1:{self.port}")
        value = value.replace("dpops_ledger_owner@", f"{self.owner_role}@")
        value = value.replace("dpops_app@", f"{self.app_role}@")
        value = value.replace("dpops_reader@", f"{self.reader_role}@")
        return value

    def read_only_mounts(self, svc: Service) -> list[Path]:
        """The host directories of the service's read-only volume mounts (short ``:ro`` or ``read_only: true``)."""
        out = []
        for v in svc.volumes:
            if isinstance(v, dict):
                if v.get("read_only"):
                    out.append(Path(self.map_value(v["target"], svc)))
            elif not v.startswith((".", "/")) and len(v.split(":")) > 2 and "ro" in v.split(":")[2].split(","):
                out.append(Path(self.map_value(v.split(":")[1], svc)))
        return out

    def argv(self, svc: Service) -> list[str]:
        argv = list(svc.argv)
        if argv[:2] == ["/usr/bin/tini", "--"]:
            argv = argv[2:]
        out = []
        for i, a in enumerate(argv):
            if a == "8080" and i > 0 and argv[i - 1] == "--port":
                a = str(self.port)
            out.append(self.map_value(a, svc))
        if out[0] in ("airflow", "python", "dpops"):
            out[0] = str(VENV_BIN / out[0])
        # The service's secrets directory is mounted read-only, as compose mounts secrets; so are its :ro volumes.
        ns = interpreter_namespace(self.base / "python-install",
                                   read_only=(self.secrets_dir(svc), *self.read_only_mounts(svc)))
        uid, gid = (int(x) for x in (svc.user or f"{UID}:{GID}").split(":"))
        return [*ns, "setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--", *out]

    def env(self, svc: Service) -> dict[str, str]:
        env = {k: self.map_value(v, svc) for k, v in svc.env.items()}
        if svc.name == "ledger-init":
            env["DPOPS_LEDGER_APP_ROLE"] = self.app_role
            env["DPOPS_LEDGER_READER_ROLE"] = self.reader_role
        env.update({
            "PATH": f"{VENV_BIN}{os.pathsep}/usr/local/bin:/usr/bin:/bin",
            "PYTHONPATH": str(REPO),
            "HOME": str(self.paths["/opt/airflow"]),
            "USER": "dpops",
            "LOGNAME": "dpops",
        })
        return env

    # ------------------------------------------------------------------ secrets (README recipe)

    def secret_values(self, key_file: Path) -> dict[str, bytes]:
        from cryptography.fernet import Fernet

        from dpops.manifest.sign import generate_signing_key

        signing = self.base / "manifest-keygen"
        signing.mkdir(mode=0o700)
        generate_signing_key(signing / "manifest_signing_key", signing / "manifest_signing_key.pub")

        owner_pw, app_pw, reader_pw = (secrets.token_urlsafe(24) for _ in range(3))
        self.admin_password = secrets.token_urlsafe(24)
        return {
            "airflow_db_url": f"{self.pg_base.replace('postgresql://', 'postgresql+psycopg://')}/{self.airflow_db}".encode(),
            "airflow_fernet_key": Fernet.generate_key(),
            "airflow_jwt_secret": secrets.token_urlsafe(32).encode(),
            "airflow_api_secret_key": secrets.token_urlsafe(32).encode(),
            "airflow_admin_password": self.admin_password.encode(),
            "ledger_owner_password": owner_pw.encode(),
            "ledger_app_password": app_pw.encode(),
            "ledger_reader_password": reader_pw.encode(),
            "ledger_reader_pgpass": f"127.0.0.1:5432:{self.ledger_db}:{self.reader_role}:{reader_pw}\n".encode(),
            "ledger_pgpass": f"127.0.0.1:5432:{self.ledger_db}:{self.app_role}:{app_pw}\n".encode(),
            "ledger_owner_pgpass": f"127.0.0.1:5432:{self.ledger_db}:{self.owner_role}:{owner_pw}\n".encode(),
            "dpops_noise_key": key_file.read_bytes(),
            "dpops_manifest_signing_key": (signing / "manifest_signing_key").read_bytes(),
            "dpops_manifest_public_key": (signing / "manifest_signing_key.pub").read_bytes(),
            "airflow_task_connections": json.dumps({"dpops_airflow_api": {
                "conn_type": "http", "host": "127.0.0.1", "port": self.port, "login": "dpops-notes",
                "password": secrets.token_urlsafe(24)}}).encode(),
        }

    def install_secrets(self, svc: Service, values: dict[str, bytes]) -> None:
        d = self.secrets_dir(svc)
        d.mkdir(parents=True)
        os.chmod(d, 0o755)
        for ref in svc.secrets:
            path = d / Path(ref.target).name
            path.write_bytes(values[ref.name])
            os.chown(path, ref.uid if ref.uid is not None else 0, ref.gid if ref.gid is not None else 0)
            os.chmod(path, ref.mode if ref.mode is not None else 0o444)


def _run_one_shot(stack: Stack, svc: Service) -> str:
    proc = subprocess.run(stack.argv(svc), env=stack.env(svc), check=False, capture_output=True, text=True, timeout=240,
                          cwd=stack.base)
    assert proc.returncode == 0, f"{svc.name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _start(stack: Stack, svc: Service, es: ExitStack) -> subprocess.Popen:
    log = open(stack.logs / f"{svc.name}.log", "wb")
    es.callback(log.close)
    # A new session: the process's PID is its group id; it and its children are stopped by that id.
    proc = subprocess.Popen(stack.argv(svc), env=stack.env(svc), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=stack.base)
    es.callback(stop_process, proc)
    return proc


def _tail(stack: Stack, names: list[str], n: int = 2500) -> str:
    out = []
    for name in names:
        p = stack.logs / f"{name}.log"
        if p.exists():
            out.append(f"--- {name}\n{p.read_text(errors='replace')[-n:]}")
    return "\n".join(out)


def _http(method: str, url: str, body: dict | None = None, token: str | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=15) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else {}
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"raw": raw.decode(errors="replace")[:500]}


def _page(url: str, token: str) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def _scope_cells(page: str, scope: str) -> dict[str, str]:
    """The Privacy budget page's figures of one scope (``<td data-field=...>`` of its ``<tr data-scope>``)."""
    row = re.search(rf'<tr data-scope="{re.escape(scope)}">(.*?)</tr>', page, re.S)
    assert row, f"scope {scope} is not on the page: {page[:3000]}"
    return dict(re.findall(r'data-field="([a-z_]+)">([^<]*)<', row.group(1)))


def _wait(what: str, fn, timeout: float, procs: dict[str, subprocess.Popen], stack: Stack, every: float = 2.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, p in procs.items():
            assert p.poll() is None, f"{name} exited with {p.returncode}\n{_tail(stack, [name])}"
        got = fn()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}\n{_tail(stack, list(procs))}")


@pytest.fixture
def stack(postgres_url):
    suffix = secrets.token_hex(4)
    pg_base = postgres_url.rsplit("/", 1)[0]
    ledger_db, airflow_db = f"dpops_ledger_{suffix}", f"airflow_{suffix}"
    # Not pytest's tmp_path: that lives under a root-only 0700 directory uid 50000 cannot enter.
    base = Path(tempfile.mkdtemp(prefix="dpops-stack-"))
    os.chmod(base, 0o755)
    st = Stack(base, _free_port(), ledger_db, airflow_db, suffix, pg_base)
    for p in (st.paths["/data"], st.paths["/opt/airflow"], st.paths["/opt/airflow"] / "logs", st.logs):
        p.mkdir(parents=True, exist_ok=True)
        os.chown(p, UID, GID)
    shutil.copytree(REPO / "deploy" / "airflow_config", st.paths["/opt/airflow"] / "config")  # the image's COPY
    for private in ("/var/lib/dpops/state", "/var/lib/dpops/gx"):  # 0700 volumes of uid 50000, as in the image
        st.paths[private].mkdir(mode=0o700)
        os.chown(st.paths[private], UID, GID)
    specs = st.paths["/opt/dpops/specs"]
    specs.mkdir(mode=0o755)
    for spec in sorted((REPO / "deploy" / "specs").glob("*.y*ml")):
        text = spec.read_text()
        for container in ("/data",):
            text = text.replace(f'"{container}/', f'"{st.paths[container]}/').replace(f'"{container}"', f'"{st.paths[container]}"')
        (specs / spec.name).write_text(text)
    for sub in ("input", "out"):
        (st.paths["/data"] / sub).mkdir(mode=0o750)
        os.chown(st.paths["/data"] / sub, UID, GID)
    _pg(postgres_url, f'CREATE DATABASE "{ledger_db}"')
    _pg(postgres_url, f'CREATE DATABASE "{airflow_db}"')
    try:
        yield st
    finally:
        _pg(postgres_url, f'DROP DATABASE IF EXISTS "{ledger_db}" WITH (FORCE)')
        _pg(postgres_url, f'DROP DATABASE IF EXISTS "{airflow_db}" WITH (FORCE)')
        for role in (st.app_role, st.reader_role, st.owner_role):
            _pg(postgres_url, f'DROP ROLE IF EXISTS "{role}"')
        shutil.rmtree(base, ignore_errors=True)


def test_compose_stack_publishes_the_example_as_uid_50000(stack: Stack):
    from dpops.noise.randomness import NoiseKey

    compose = load_compose()
    t0 = time.monotonic()
    timings: dict[str, float] = {}

    # The noise key as the README makes it (dpops key generate), then every service's own secrets.
    key_src = stack.base / "noise_key"
    NoiseKey.generate(key_src)
    values = stack.secret_values(key_src)
    services = {name: service(compose, name) for name in (*ONE_SHOT_SERVICES, *AIRFLOW_SERVICES)}
    for svc in services.values():
        stack.install_secrets(svc, values)
    scheduler_key = stack.secrets_dir(services["airflow-scheduler"]) / "dpops_noise_key"
    assert scheduler_key.stat().st_uid == UID and (scheduler_key.stat().st_mode & 0o777) == 0o400

    # ledger-db's first start: deploy/ledger-db-init.sh runs deploy/ledger-roles.sql as the superuser.
    pw_dir = stack.base / "secrets" / "ledger-db"
    pw_dir.mkdir()
    (pw_dir / "ledger_owner_password").write_bytes(values["ledger_owner_password"])
    (pw_dir / "ledger_app_password").write_bytes(values["ledger_app_password"])
    (pw_dir / "ledger_reader_password").write_bytes(values["ledger_reader_password"])
    psql = subprocess.run(
        ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", f"{stack.pg_base}/{stack.ledger_db}",
         "-v", f"owner_role={stack.owner_role}", "-v", f"app_role={stack.app_role}",
         "-v", f"reader_role={stack.reader_role}",
         "-v", f"reader_password_file={pw_dir / 'ledger_reader_password'}",
         "-v", f"owner_password_file={pw_dir / 'ledger_owner_password'}",
         "-v", f"app_password_file={pw_dir / 'ledger_app_password'}",
         "-f", str(REPO / "deploy" / "ledger-roles.sql")], check=False, capture_output=True, text=True, timeout=60)
    assert psql.returncode == 0, psql.stderr[-2000:]
    # ... then installs the database's cap check as the superuser (this dpops: the server runs on this machine)
    install = subprocess.run(
        [sys.executable, "-m", "dpops.cli.main", "ledger", "--ledger",
         f"{stack.pg_base}/{stack.ledger_db}?schema=dpops", "install-cap-check", "--owner-role", stack.owner_role],
        check=False, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert install.returncode == 0, install.stderr[-2000:]

    for name in ONE_SHOT_SERVICES:
        _run_one_shot(stack, services[name])
        timings[name] = round(time.monotonic() - t0, 1)
    inputs = sorted((stack.paths["/data"] / "input" / "example_daily").glob("*.parquet"))
    assert len(inputs) == 7 and all(p.stat().st_uid == UID for p in inputs)

    with ExitStack() as es:
        procs = {name: _start(stack, services[name], es) for name in AIRFLOW_SERVICES}
        api = f"http://127.0.0.1:{stack.port}"

        def healthy():
            try:
                with urllib.request.urlopen(f"{api}/api/v2/monitor/health", timeout=3):
                    return True
            except OSError:
                return False

        _wait("api-server health", healthy, 150, procs, stack)
        timings["api healthy"] = round(time.monotonic() - t0, 1)

        code, body = _http("POST", f"{api}/auth/token", {"username": "admin", "password": stack.admin_password})
        assert code in (200, 201), (code, body)
        token = body["access_token"]
        # airflow-init also created the tasks' login for refusal notes (FAB role User), from the connections file.
        notes = json.loads(values["airflow_task_connections"])["dpops_airflow_api"]
        code, body = _http("POST", f"{api}/auth/token", {"username": notes["login"], "password": notes["password"]})
        assert code in (200, 201), ("the dpops_airflow_api login does not work", code, body)
        code, _ = _http("GET", f"{api}/api/v2/dags", token="not-a-token")
        assert code in (401, 403), "the REST API must refuse a request without a valid token"
        # The image's plugin folder (AIRFLOW__CORE__PLUGINS_FOLDER) is loaded; its page refuses anonymous requests.
        code, body = _http("GET", f"{api}/api/v2/plugins", token=token)
        assert code == 200 and "dpops_budget" in {p["name"] for p in body["plugins"]}, (code, body)
        code, _ = _http("GET", f"{api}/dpops-budget/")
        assert code in (401, 403), "the Privacy budget page must refuse an anonymous request"

        def dag_parsed():
            c, b = _http("GET", f"{api}/api/v2/dags/{DAG_ID}", token=token)
            if c == 200:
                return b
            c, errs = _http("GET", f"{api}/api/v2/importErrors", token=token)
            assert c == 200 and errs["total_entries"] == 0, f"DAG import errors: {errs}"
            return None

        _wait("the example DAG to be parsed", dag_parsed, 120, procs, stack)
        code, errors = _http("GET", f"{api}/api/v2/importErrors", token=token)
        assert code == 200 and errors["total_entries"] == 0, errors
        timings["dag parsed"] = round(time.monotonic() - t0, 1)

        # The latest complete interval [yesterday, today): the run the scheduler would create itself once
        # unpaused; triggering it first with that logical date means the scheduler adds no second run.
        today = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
        start, end = today - timedelta(days=1), today
        run_id = f"deploy_test_{start:%Y%m%d}"
        code, body = _http("POST", f"{api}/api/v2/dags/{DAG_ID}/dagRuns", {
            "dag_run_id": run_id, "logical_date": start.isoformat(),
            "data_interval_start": start.isoformat(), "data_interval_end": end.isoformat()}, token=token)
        assert code == 200, (code, body)
        code, body = _http("PATCH", f"{api}/api/v2/dags/{DAG_ID}", {"is_paused": False}, token=token)
        assert code == 200 and body["is_paused"] is False, (code, body)

        def finished():
            c, b = _http("GET", f"{api}/api/v2/dags/{DAG_ID}/dagRuns/{run_id}", token=token)
            return b if c == 200 and b.get("state") in ("success", "failed") else None

        run = _wait("the DAG run", finished, WAIT_RUN_S, procs, stack, every=1)
        timings["run finished"] = round(time.monotonic() - t0, 1)
        if run["state"] != "success":
            _, tis = _http("GET", f"{api}/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances", token=token)
            states = {t["task_id"]: t["state"] for t in tis.get("task_instances", [])}
            logs = sorted((stack.paths["/opt/airflow"] / "logs").rglob("*.log"))
            tail = "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-2500:]}" for p in logs[-3:])
            raise AssertionError(f"run {run_id} {run['state']}: {states}\n{tail}\n{_tail(stack, ['airflow-scheduler'])}")

        # The Privacy budget page, served by this api-server: the reader role, the read-only outputs.
        page_code, page = _page(f"{api}/dpops-budget/", token)
        assert page_code == 200, (page_code, page[:2000], _tail(stack, ["airflow-apiserver"]))
        # Issue 25 item 11: the api-server runs as its own uid, so even here (where /data is one directory for
        # every process) it cannot enter staged/, the tasks' unreleased noisy output (0700, uid 50000).
        web_uid, web_gid = (int(x) for x in str(services["airflow-apiserver"].user).split(":"))
        assert web_uid != UID
        staged = stack.paths["/data"] / "out" / "staged"
        assert staged.is_dir() and staged.stat().st_uid == UID
        peek = subprocess.run(as_uid(web_uid, web_gid, ["ls", "-R", str(staged)], stack.base / "python-install"),
                              check=False, capture_output=True, timeout=60)
        assert peek.returncode != 0 and b"Permission denied" in peek.stderr, peek

    print(f"[deploy stack] timings (s since start): {timings}", flush=True)

    # Published under the output root, as the dpops uid.
    out_root = stack.paths["/data"] / "out"
    published = [p for p in (out_root / "published" / RELEASE).rglob("*") if p.is_file()]
    assert published, f"nothing published under {out_root}: {sorted(str(p) for p in out_root.rglob('*'))}"
    assert all(p.stat().st_uid == UID for p in published)

    # The ledger (read as the database superuser) has the interval committed, charged once.
    from dpops.ledger import open_ledger

    ledger_url = f"{stack.pg_base}/{stack.ledger_db}?schema=dpops"
    ledger = open_ledger(ledger_url)
    try:
        committed = ledger.runs(release=RELEASE, states=["committed"])
        assert [r.key.interval_start[:10] for r in committed] == [start.date().isoformat()], committed
        assert ledger.status("example").total == pytest.approx(0.5)
        assert ledger.verify().ok
        run_id_dpops = committed[0].run_id
    finally:
        ledger.close()

    # The manifest verifies against the ledger and the published files (keyed fingerprints).
    # DPOPS_MANIFESTS_DIR (deploy/docker-compose.yml): one manifests directory for the deployment.
    manifests = [p for p in (out_root / "manifests").glob("*.json") if run_id_dpops in p.read_text()]
    assert manifests, f"no manifest for {run_id_dpops} under {out_root / 'manifests'}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DPOPS_", "AIRFLOW"))}
    env.update(PYTHONPATH=str(REPO), DPOPS_OUTPUT_ROOTS=str(out_root), DPOPS_DATA_ROOTS=str(stack.paths["/data"] / "input"))
    verify = subprocess.run([str(VENV_BIN / "python"), "-m", "dpops.cli.main", "manifest", "verify", str(manifests[0]),
                             "--ledger", ledger_url, "--key-file", str(key_src)],
                            check=False, capture_output=True, text=True, timeout=120, env=env)
    assert verify.returncode == 0, verify.stdout[-2000:] + verify.stderr[-2000:]
    # The runbook's report command, as `docker compose exec airflow-scheduler` runs it (uid 50000, its env).
    sched = services["airflow-scheduler"]
    # README's `dpops manifest verify RUN_ID` in the deployed environment (issue 21 item 11): found through
    # DPOPS_MANIFESTS_DIR, checked with the key from DPOPS_NOISE_KEY_FILE and the ledger from DPOPS_LEDGER_URL.
    verify_svc = Service(sched.name, ["dpops", "manifest", "verify", run_id_dpops], sched.env, sched.secrets)
    verify = subprocess.run(stack.argv(verify_svc), env=stack.env(verify_svc), check=False, capture_output=True,
                            text=True, timeout=180, cwd=stack.base)
    assert verify.returncode == 0 and "skip" not in verify.stdout, verify.stdout[-2000:] + verify.stderr[-2000:]
    report_svc = Service(sched.name, ["dpops", "report", "--scope", "example", "--out",
                                      "/data/out/report-example.html"], sched.env, sched.secrets)
    report = subprocess.run(stack.argv(report_svc), env=stack.env(report_svc), check=False, capture_output=True, text=True,
                            timeout=180, cwd=stack.base)
    assert report.returncode == 0, report.stdout[-2000:] + report.stderr[-2000:]
    html = (out_root / "report-example.html").read_text()
    assert run_id_dpops[:16] in html, "the report does not list the published run"
    assert "verified (partly)" not in html.split("<h2>Timeline")[1], "the key is available: fully verified"
    # The page's figures are `dpops ledger status --json`'s, as the scheduler's environment reads the ledger
    # (the application role), shown through format_budget; the api-server read them as the reader role.
    from dpops.ledger.budget import format_budget

    status_svc = Service(sched.name, ["dpops", "ledger", "status", "example", "--json"], sched.env, sched.secrets)
    st_proc = subprocess.run(stack.argv(status_svc), env=stack.env(status_svc), check=False, capture_output=True,
                             text=True, timeout=120, cwd=stack.base)
    assert st_proc.returncode == 0, st_proc.stdout[-2000:] + st_proc.stderr[-2000:]
    status = json.loads(st_proc.stdout)
    cells = _scope_cells(page, "example")
    assert cells["cap"] == format_budget(status["cap"])
    for field in ("committed", "spent_unpublished", "started", "reserved", "total", "remaining"):
        assert cells[field] == format_budget(status[field], status["cap"]), (field, cells, status)
    assert status["committed"] == pytest.approx(0.5) and cells["committed"] == "0.5"
    assert f"manifests/{run_id_dpops}" in page, "the page does not offer the run's manifest (read-only /data/out)"
    assert "Not shown" not in page, page[page.find("Not shown"):][:1500]
    assert ledger_url not in page and "dpops_reader" not in page
    # The private run log went to the state volume, not next to the outputs.
    assert any(stack.paths["/var/lib/dpops/state"].rglob("*")), "no private run log in DPOPS_STATE_DIR"
