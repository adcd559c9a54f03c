"""deploy/: the compose file, the Dockerfile and the README promise what production needs.

There is no Docker engine here, so these are parse-level checks; the DagBag import check
of the same DAG files is in tests/test_dags.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
AIRFLOW_SERVICES = {"airflow-apiserver": "api-server", "airflow-scheduler": "scheduler",
                    "airflow-dag-processor": "dag-processor", "airflow-triggerer": "triggerer"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def _env(service: dict) -> dict:
    env = service.get("environment", {})
    return env if isinstance(env, dict) else dict(e.split("=", 1) for e in env)


def test_compose_has_airflow3_components(compose):
    services = compose["services"]
    for name, command in AIRFLOW_SERVICES.items():
        assert name in services, name
        assert services[name]["command"][0] == command
        assert services[name]["depends_on"]["airflow-init"]["condition"] == "service_completed_successfully"
    assert services["airflow-init"]["command"] == ["db", "migrate"]


def test_airflow_metadata_and_ledger_are_separate_databases(compose):
    s = compose["services"]
    assert s["airflow-db"]["image"].startswith("postgres:") and s["ledger-db"]["image"].startswith("postgres:")
    vols = {s["airflow-db"]["volumes"][0].split(":")[0], s["ledger-db"]["volumes"][0].split(":")[0]}
    assert len(vols) == 2 and vols <= set(compose["volumes"])
    env = _env(s["airflow-scheduler"])
    assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
    assert env["DPOPS_LEDGER_URL"].startswith("postgresql://") and "@ledger-db:" in env["DPOPS_LEDGER_URL"]
    # psycopg 3 for both sync and async metadata connections (else Airflow looks for asyncpg).
    assert "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_CMD" in env and "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC_CMD" in env


def test_secrets_are_mounted_files_never_env_values(compose):
    declared = compose["secrets"]
    assert all(set(v) == {"file"} and v["file"].startswith("./secrets/") for v in declared.values())
    for name, svc in compose["services"].items():
        env = _env(svc)
        for key, value in env.items():
            # No credential or key material inline: only paths and *_CMD/_FILE indirections.
            assert not re.search(r"(PASSWORD|SECRET|FERNET|NOISE_KEY)$", key) or key.endswith(("_FILE", "_CMD")), (name, key)
            assert not re.search(r"://[^/@]*:[^/@]*@", str(value)), f"{name}.{key} has a password in a URL"
        for ref in svc.get("secrets", []):
            assert ref in declared, (name, ref)
    worker = compose["services"]["airflow-scheduler"]
    assert "dpops_noise_key" in worker["secrets"]
    assert _env(worker)["DPOPS_NOISE_KEY_FILE"] == "/run/secrets/dpops_noise_key"
    assert (DEPLOY / "secrets" / ".gitignore").read_text().splitlines()[1:] == ["*", "!.gitignore"]


def test_every_airflow_service_shares_image_secrets_and_data(compose):
    for name in [*AIRFLOW_SERVICES, "airflow-init"]:
        svc = compose["services"][name]
        assert svc["image"] == "dpops-worker:latest" and svc["build"]["dockerfile"] == "deploy/Dockerfile"
        assert any(v.startswith("dpops-data:") for v in svc["volumes"])
        assert _env(svc)["DPOPS_SPECS_DIR"] == "/opt/dpops/specs"


def test_dockerfile_installs_with_constraints_and_runs_unprivileged():
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert lines[0].startswith("FROM python:3.11")
    installs = [ln for ln in lines if "pip install" in ln]
    assert installs and all("-c deploy/constraints-py3.11.txt" in ln for ln in installs)
    assert re.search(r"^USER (?!root)\S+", text, re.M)
    assert (DEPLOY / "constraints-py3.11.txt").is_file()
    for path in re.findall(r"^COPY (\S+)", text, re.M):
        assert (DEPLOY.parent / path).exists(), f"Dockerfile copies {path}, which does not exist"
    # The constraints file pins what the image promises.
    pins = (DEPLOY / "constraints-py3.11.txt").read_text()
    for pkg in ("apache-airflow==3.3.2", "apache-beam==2.77.0", "great_expectations==1.24.1"):
        assert pkg in pins


def test_readme_documents_runners_key_and_scaling():
    text = (DEPLOY / "README.md").read_text()
    for needle in ("FlinkRunner", "SparkRunner", "DataflowRunner", "PortableRunner", "DPOPS_NOISE_KEY_FILE",
                   "## Scaling", "BeamRunPythonPipelineOperator"):
        assert needle in text, needle


def test_ui_is_published_on_loopback_only(compose):
    """The api-server speaks plain HTTP: it must not listen on every interface of the host (issue 14 item 6)."""
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on all interfaces"
