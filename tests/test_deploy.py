"""deploy/: the compose file, the Dockerfile and the README checked against each other.

There is no Docker engine here, so these are parse-level checks (the processes themselves run
in tests/test_deploy_stack.py). ``problems()`` lists every inconsistency it finds between
paths, secrets, volumes and users; the tests assert it finds none in the shipped files and
that it does find the ones planted in mutated copies (so the check can fail).
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from deploy_support import (
    AIRFLOW_SERVICES,
    COMPOSE_FILE,
    DEPLOY,
    DOCKERFILE,
    REPO,
    SECRETS_DIR,
    as_uid,
    dockerfile_created_dirs,
    dockerfile_env,
    dockerfile_instructions,
    load_compose,
    secret_refs,
    service,
)

README = DEPLOY / "README.md"
IMAGE = "dpops-worker:latest"
IMAGE_UID = 50000
WEB_UID = 50001  # the api-server's own uid (group IMAGE_UID): never the tasks' uid (issue 25 item 11)
SERVICE_USERS = {"airflow-apiserver": f"{WEB_UID}:{IMAGE_UID}"}  # every other image service: IMAGE_UID:IMAGE_UID
# The only parts of the outputs the api-server may mount (read-only): never /data/out itself, whose staged/
# holds unreleased noisy output.
WEB_OUTPUT_MOUNTS = ("/data/out/published", "/data/out/manifests")
POSTGRES_UID = 999  # postgres in the postgres:16 (Debian) image

# Least privilege: exactly these secrets per service. The noise key and the ledger's .pgpass only where
# tasks run (the scheduler, under LocalExecutor); the dag-processor parses DAGs and needs neither.
SECRETS_TABLE: dict[str, set[str]] = {
    "airflow-db": {"airflow_db_password"},
    "ledger-db": {"ledger_db_password", "ledger_owner_password", "ledger_app_password", "ledger_reader_password"},
    "airflow-init": {"airflow_db_url", "airflow_admin_password", "airflow_task_connections"},
    "ledger-init": {"ledger_owner_pgpass"},
    "example-data": set(),
    "airflow-apiserver": {"airflow_db_url", "airflow_fernet_key", "airflow_jwt_secret", "airflow_api_secret_key",
                          "ledger_reader_pgpass", "dpops_manifest_public_key"},
    "airflow-scheduler": {"airflow_db_url", "airflow_fernet_key", "airflow_jwt_secret", "ledger_pgpass",
                          "dpops_noise_key", "airflow_task_connections", "dpops_manifest_signing_key",
                          "dpops_manifest_public_key"},
    "airflow-dag-processor": {"airflow_db_url", "airflow_fernet_key"},
    "airflow-triggerer": {"airflow_db_url", "airflow_fernet_key"},
}
# Secrets that must never reach a service other than the one(s) named.
CONFINED = {"dpops_noise_key": {"airflow-scheduler"}, "ledger_pgpass": {"airflow-scheduler"},
            "ledger_owner_pgpass": {"ledger-init"}, "ledger_reader_pgpass": {"airflow-apiserver"},
            "airflow_admin_password": {"airflow-init"},
            "airflow_task_connections": {"airflow-scheduler", "airflow-init"},
            "dpops_manifest_signing_key": {"airflow-scheduler"}}
# Environment variables holding paths a dpops process reads or writes (comma-separated lists allowed).
PATH_VARS = ("DPOPS_DATA_ROOTS", "DPOPS_OUTPUT_ROOTS", "DPOPS_STATE_DIR", "DPOPS_GX_PROJECT")


def _named_mounts(svc: dict) -> dict[str, tuple[str, bool]]:
    """mount point -> (volume name, read-only) for named volumes (not bind mounts); a long-syntax volume with a
    ``subpath`` is named ``volume/subpath``."""
    out = {}
    for v in svc.get("volumes", []) or []:
        if isinstance(v, dict):
            if v.get("type", "volume") == "volume":
                sub = (v.get("volume") or {}).get("subpath")
                out[v["target"]] = (f"{v['source']}/{sub}" if sub else v["source"], bool(v.get("read_only")))
            continue
        parts = v.split(":")
        if parts[0].startswith((".", "/")):
            continue
        out[parts[1]] = (parts[0], len(parts) > 2 and "ro" in parts[2].split(","))
    return out


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _readme_modes(text: str, files: set[str]) -> dict[str, int]:
    """file -> mode from the recipe's ``chmod MODE file ...`` lines, in order (``*`` is every file)."""
    modes: dict[str, int] = {}
    for m in re.finditer(r"^\s*(?:sudo\s+)?chmod\s+([0-7]{3,4})\s+([^\n#]+)", text, re.MULTILINE):
        names = m.group(2).split()
        for name in (files if names == ["*"] else names):
            modes[name] = int(m.group(1), 8)
    return modes


def _user(name: str, svc: dict) -> tuple[int, int]:
    """(uid, gid) a service's process runs as: its compose ``user:`` for the image, else postgres."""
    if svc.get("image") != IMAGE:
        return POSTGRES_UID, POSTGRES_UID
    uid, _, gid = str(svc.get("user") or "").partition(":")
    return (int(uid), int(gid or uid)) if uid.isdigit() else (-1, -1)


def _readme_owners(text: str) -> dict[str, int]:
    """file -> uid from the recipe's ``chown UID:GID file ...`` lines."""
    owners: dict[str, int] = {}
    for m in re.finditer(r"^\s*(?:sudo\s+)?chown\s+(\d+):(\d+)\s+([^\n#]+)", text, re.MULTILINE):
        for name in m.group(3).split():
            owners[name] = int(m.group(1))
    return owners


def problems(compose: dict, dockerfile: Path = DOCKERFILE, readme_text: str | None = None) -> list[str]:
    """Every inconsistency between the compose file, the Dockerfile and the README recipe."""
    out: list[str] = []
    readme_text = README.read_text() if readme_text is None else readme_text
    services = compose["services"]
    declared = compose.get("secrets", {})
    created = dockerfile_created_dirs(dockerfile)
    instructions = dockerfile_instructions(dockerfile)
    image_env = dockerfile_env(dockerfile)
    copies = {rest.split()[-1]: rest.split()[:-1] for word, rest in instructions if word == "COPY"}

    # -- secrets: declared, used, written by the README recipe with the owner the compose file declares
    owners = _readme_owners(readme_text)
    modes = _readme_modes(readme_text, {Path(d.get("file", "")).name for d in declared.values()})
    used: set[str] = set()
    for name, svc in services.items():
        refs = secret_refs(svc)
        names = {r.name for r in refs}
        used |= names
        want_uid, want_gid = _user(name, svc)
        for r in refs:
            if r.name not in declared:
                out.append(f"{name}: secret {r.name} is not declared under top-level secrets:")
            if r.uid != want_uid or r.gid != want_gid:
                out.append(f"{name}: secret {r.name} uid/gid {r.uid}/{r.gid}, expected {want_uid}/{want_gid} "
                           "(the reading user)")
            # 0440 only for a file two uids of one group read (the api-server and the scheduler).
            if r.mode not in (0o400, 0o600, 0o440):
                out.append(f"{name}: secret {r.name} mode {oct(r.mode) if r.mode is not None else None}, expected 0400")
            file = Path(declared.get(r.name, {}).get("file", "")).name
            # Plain compose bind-mounts the host file as it is: its owner must be the reader, or the reader's
            # group must own it with group read (0440) and no access for others.
            readable = owners.get(file) == want_uid or (owners.get(file) == want_gid and modes.get(file) == 0o440)
            if file and not readable:
                out.append(f"README recipe: {file} (secret {r.name}, read in {name}) is not chowned to {want_uid} "
                           f"(nor 0440 to its group {want_gid})")
            if file and modes.get(file) not in (0o400, 0o440):
                out.append(f"README recipe: {file} is not chmod 0400 (or 0440 for a shared file)")
        if name in SECRETS_TABLE and names != SECRETS_TABLE[name]:
            out.append(f"{name}: secrets {sorted(names)} differ from the least-privilege table {sorted(SECRETS_TABLE[name])}")
        for secret, allowed in CONFINED.items():
            if secret in names and name not in allowed:
                out.append(f"{name}: mounts {secret}, which only {sorted(allowed)} may mount")
        # Every /run/secrets path a service's environment (or the ledger init script) names is mounted there.
        env = svc.get("environment", {}) or {}
        targets = {r.target for r in refs}
        for key, value in env.items():
            for path in re.findall(rf"{SECRETS_DIR}/[A-Za-z0-9_.-]+", str(value)):
                if path not in targets:
                    out.append(f"{name}: {key} refers to {path}, which this service does not mount")
    for secret, spec in declared.items():
        if secret not in used:
            out.append(f"secret {secret} is declared but no service mounts it")
        file = Path(spec.get("file", "")).name
        if not re.search(rf"(?:>|generate|keygen)\s+(?:\S+\s+)?{re.escape(file)}(?:\s|$)", readme_text):
            out.append(f"README recipe does not write deploy/secrets/{file} (secret {secret})")
    init_script = (DEPLOY / "ledger-db-init.sh").read_text()
    ledger_targets = {r.target for r in secret_refs(services["ledger-db"])}
    for path in re.findall(rf"{SECRETS_DIR}/[A-Za-z0-9_.-]+", init_script):
        if path not in ledger_targets:
            out.append(f"ledger-db-init.sh reads {path}, which ledger-db does not mount")

    # -- users and image
    if not re.search(rf"useradd\b[^\n]*--uid {IMAGE_UID}\b", " ".join(r for w, r in instructions if w == "RUN")):
        out.append(f"Dockerfile: no user with uid {IMAGE_UID}")
    users = [rest for word, rest in instructions if word == "USER"]
    if not users or users[-1] not in (f"{IMAGE_UID}:{IMAGE_UID}", str(IMAGE_UID), "dpops"):
        out.append(f"Dockerfile: the final USER is {users[-1] if users else None}, not {IMAGE_UID}")
    for name, svc in services.items():
        want_user = SERVICE_USERS.get(name, f"{IMAGE_UID}:{IMAGE_UID}")
        if svc.get("image") == IMAGE and str(svc.get("user")) != want_user:
            out.append(f"{name}: user {svc.get('user')!r}, expected '{want_user}'")
    if not re.search(rf"useradd\b[^\n]*--uid {WEB_UID}\b", " ".join(r for w, r in instructions if w == "RUN")):
        out.append(f"Dockerfile: no user with uid {WEB_UID} (the api-server's)")

    # -- volumes: declared, mount points created in the image owned by the image user, env paths under them
    top_volumes = set(compose.get("volumes", {}) or {})
    mounted_volumes: set[str] = set()
    for name, svc in services.items():
        mounts = _named_mounts(svc)
        for point, (vol, _ro) in mounts.items():
            vol = vol.split("/")[0]
            mounted_volumes.add(vol)
            if vol not in top_volumes:
                out.append(f"{name}: volume {vol} is not declared under top-level volumes:")
            if svc.get("image") == IMAGE and created.get(point, ("", ""))[0] not in (str(IMAGE_UID), "dpops"):
                out.append(f"{name}: mount point {point} (volume {vol}) is not created in the Dockerfile owned by "
                           f"{IMAGE_UID}, so the volume would come up root-owned")
        for bind in [v for v in svc.get("volumes", []) or [] if isinstance(v, str) and v.startswith(".")]:
            if not (DEPLOY / bind.split(":")[0]).exists():
                out.append(f"{name}: bind mount source {bind.split(':')[0]} does not exist in deploy/")
        if svc.get("image") != IMAGE:
            continue
        env = service(compose, name).env
        if name in AIRFLOW_SERVICES:
            logs = f"{env.get('AIRFLOW_HOME', '/opt/airflow')}/logs"
            if logs not in mounts:
                out.append(f"{name}: {logs} (task logs) is not on a volume")
        if name == "airflow-apiserver":
            # The Privacy budget page reads the manifests and published pointers (outputs), read-only, and the
            # ledger as the reader role; never the inputs, the public files, the state volume or the key.
            for point, (vol, ro) in mounts.items():
                if _under(point, "/data") and not (point in WEB_OUTPUT_MOUNTS and ro
                                                   and vol == f"dpops-data/{point[len('/data/'):]}"):
                    out.append(f"{name}: mounts {point} ({vol}{', read-only' if ro else ''}); the api-server may "
                               f"mount only {' and '.join(WEB_OUTPUT_MOUNTS)}, read-only (never staged/)")
                if _under(point, "/var/lib/dpops"):
                    out.append(f"{name}: mounts {point}, the scheduler's private state")
            manifests = env.get("DPOPS_MANIFESTS_DIR", "")
            if manifests and not any(_under(manifests, p) for p in mounts):
                out.append(f"{name}: DPOPS_MANIFESTS_DIR={manifests} is not under a volume this service mounts")
            if not env.get("DPOPS_LEDGER_URL", "").startswith("postgresql://dpops_reader@"):
                out.append(f"{name}: DPOPS_LEDGER_URL is not the read-only ledger role dpops_reader")
            if not env.get("DPOPS_MANIFEST_PUBLIC_KEY"):
                out.append(f"{name}: no DPOPS_MANIFEST_PUBLIC_KEY: the page cannot check the publisher's signatures")
            continue
        if name == "airflow-scheduler":
            # The tasks sign manifests and published bindings; without a key deployed readers have nothing to check.
            for var in ("DPOPS_MANIFEST_SIGNING_KEY", "DPOPS_MANIFEST_PUBLIC_KEY"):
                if not env.get(var, "").startswith(f"{SECRETS_DIR}/"):
                    out.append(f"{name}: {var} is not set to a mounted secret file")
        for var in PATH_VARS:
            for path in filter(None, (p.strip() for p in env.get(var, "").split(","))):
                if "://" in path:
                    continue
                on_volume = [pt for pt in mounts if _under(path, pt)]
                if not on_volume:
                    out.append(f"{name}: {var}={path} is not under a volume this service mounts")
                elif var != "DPOPS_DATA_ROOTS" and name == "airflow-scheduler" and mounts[on_volume[0]][1]:
                    out.append(f"{name}: {var}={path} is on a read-only mount")
    for vol in top_volumes - mounted_volumes:
        out.append(f"volume {vol} is declared but never mounted")

    # -- specs: baked into the image from deploy/specs, never hidden by a mount, entry scripts copied
    specs_dir = image_env.get("DPOPS_SPECS_DIR", "")
    workdir = next((rest for word, rest in instructions if word == "WORKDIR"), "/")
    baked = {f"{workdir.rstrip('/')}/{dst.rstrip('/')}" if not dst.startswith("/") else dst.rstrip("/"): src
             for dst, src in copies.items()}
    if baked.get(specs_dir) != ["deploy/specs/"]:
        out.append(f"Dockerfile: DPOPS_SPECS_DIR={specs_dir} is not a COPY of deploy/specs/")
    if not list((DEPLOY / "specs").glob("*.yaml")):
        out.append("deploy/specs/ has no release spec")
    for name, svc in services.items():
        for v in svc.get("volumes", []) or []:
            target = v["target"] if isinstance(v, dict) else (v.split(":") + [""])[1]
            if target and _under(target, specs_dir or "/nonexistent"):
                out.append(f"{name}: mounts over {target}, hiding the baked specs")
        env = (svc.get("environment", {}) or {})
        if svc.get("image") == IMAGE and env.get("DPOPS_SPECS_DIR", specs_dir) != specs_dir:
            out.append(f"{name}: DPOPS_SPECS_DIR differs from the image's {specs_dir}")
        if svc.get("image") == IMAGE:
            for arg in service(compose, name).argv:
                if arg.startswith(f"{workdir.rstrip('/')}/deploy/"):
                    rel = arg[len(workdir.rstrip('/')) + 1:]
                    copied = any(rel.startswith(d.rstrip("/")) and rel.split("/")[-1] in " ".join(s)
                                 for d, s in copies.items())
                    if not copied or not (DEPLOY.parent / rel).exists():
                        out.append(f"{name}: runs {arg}, which the Dockerfile does not copy from {rel}")
    for src in [s for srcs in copies.values() for s in srcs]:
        if not (DEPLOY.parent / src).exists():
            out.append(f"Dockerfile copies {src}, which does not exist")
    return out


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose()


def test_compose_dockerfile_and_readme_agree(compose):
    assert problems(compose) == []


@pytest.mark.parametrize(
    "mutate, expected",
    [
        # The scheduler loses its noise key: its env then names a secret it does not mount.
        (lambda c: c["services"]["airflow-scheduler"].__setitem__(
            "secrets", [s for s in c["services"]["airflow-scheduler"]["secrets"] if s["source"] != "dpops_noise_key"]),
         "airflow-scheduler: DPOPS_NOISE_KEY_FILE refers to /run/secrets/dpops_noise_key"),
        # The dag-processor gains the noise key.
        (lambda c: c["services"]["airflow-dag-processor"]["secrets"].append(
            {"source": "dpops_noise_key", "uid": "50000", "gid": "50000", "mode": "0o400"}),
         "airflow-dag-processor: mounts dpops_noise_key"),
        # A world-readable secret.
        (lambda c: c["services"]["airflow-scheduler"]["secrets"][0].__setitem__("mode", "0o444"),
         "expected 0400"),
        # A secret owned by root, unreadable by uid 50000.
        (lambda c: c["services"]["ledger-init"]["secrets"][0].__setitem__("uid", "0"),
         "ledger-init: secret ledger_owner_pgpass uid/gid 0/50000"),
        # A volume mounted where the image did not create a directory.
        (lambda c: c["services"]["airflow-scheduler"]["volumes"].append("dpops-data:/srv/dp"),
         "mount point /srv/dp"),
        # The output allow-list outside every volume.
        (lambda c: c["services"]["airflow-scheduler"]["environment"].__setitem__("DPOPS_OUTPUT_ROOTS", "/srv/out"),
         "DPOPS_OUTPUT_ROOTS=/srv/out is not under a volume"),
        # A mount that hides the baked specs.
        (lambda c: c["services"]["airflow-dag-processor"]["volumes"].append("./specs:/opt/dpops/specs:ro"),
         "hiding the baked specs"),
        # A new secret nobody documents.
        (lambda c: (c["secrets"].__setitem__("smtp_password", {"file": "./secrets/smtp_password"}),
                    c["services"]["airflow-scheduler"]["secrets"].append(
                        {"source": "smtp_password", "uid": "50000", "gid": "50000", "mode": "0o400"})),
         "README recipe does not write deploy/secrets/smtp_password"),
        # The api-server reads the inputs, or writes the outputs, or uses the application role.
        (lambda c: c["services"]["airflow-apiserver"]["volumes"].append("dpops-data:/data:ro"),
         "airflow-apiserver: mounts /data (dpops-data, read-only)"),
        (lambda c: c["services"]["airflow-apiserver"]["volumes"][1].__setitem__("read_only", False),
         "airflow-apiserver: mounts /data/out/published (dpops-data/out/published)"),
        # Issue 25 item 11: the api-server mounts the whole output root (staged/ included) ...
        (lambda c: c["services"]["airflow-apiserver"]["volumes"].append(
            {"type": "volume", "source": "dpops-data", "target": "/data/out", "read_only": True,
             "volume": {"subpath": "out"}}),
         "airflow-apiserver: mounts /data/out (dpops-data/out, read-only)"),
        # ... or runs as the tasks' uid ...
        (lambda c: c["services"]["airflow-apiserver"].__setitem__("user", "50000:50000"),
         "airflow-apiserver: user '50000:50000', expected '50001:50000'"),
        # ... and deploy/ sets no signing key, so deployed readers have nothing to check.
        (lambda c: c["services"]["airflow-scheduler"]["environment"].pop("DPOPS_MANIFEST_SIGNING_KEY"),
         "airflow-scheduler: DPOPS_MANIFEST_SIGNING_KEY is not set"),
        (lambda c: c["services"]["airflow-apiserver"]["secrets"].append(
            {"source": "dpops_manifest_signing_key", "uid": "50001", "gid": "50000", "mode": "0o400"}),
         "airflow-apiserver: mounts dpops_manifest_signing_key"),
        (lambda c: c["services"]["airflow-apiserver"]["environment"].__setitem__(
            "DPOPS_LEDGER_URL", "postgresql://dpops_app@ledger-db:5432/dpops_ledger?schema=dpops"),
         "not the read-only ledger role"),
        # The reader's .pgpass reaches the scheduler.
        (lambda c: c["services"]["airflow-scheduler"]["secrets"].append(
            {"source": "ledger_reader_pgpass", "uid": "50000", "gid": "50000", "mode": "0o400"}),
         "airflow-scheduler: mounts ledger_reader_pgpass"),
        # A service running as root.
        (lambda c: c["services"]["airflow-triggerer"].__setitem__("user", "0:0"), "airflow-triggerer: user '0:0'"),
    ],
)
def test_problems_catches_planted_inconsistencies(compose, mutate, expected):
    mutated = copy.deepcopy(compose)
    mutate(mutated)
    found = problems(mutated)
    assert any(expected in p for p in found), found


def test_dockerfile_problems_are_caught(tmp_path, compose):
    text = DOCKERFILE.read_text()
    no_logs = tmp_path / "Dockerfile"
    no_logs.write_text(text.replace(" /opt/airflow/logs", ""))
    assert any("/opt/airflow/logs" in p and "root-owned" in p for p in problems(compose, no_logs))
    as_root = tmp_path / "Dockerfile.root"
    as_root.write_text(text.replace("USER 50000:50000", "USER root"))
    assert any("final USER is root" in p for p in problems(compose, as_root))


def test_readme_recipe_owner_is_checked(compose):
    text = README.read_text().replace("sudo chown 50000:50000 noise_key", "sudo chown 0:0 noise_key")
    assert any("noise_key" in p and "chowned to 50000" in p for p in problems(compose, readme_text=text))


def test_compose_has_airflow3_components(compose):
    services = compose["services"]
    for name, command in AIRFLOW_SERVICES.items():
        assert services[name]["command"][0] == command
        for init in ("airflow-init", "ledger-init", "example-data"):
            assert services[name]["depends_on"][init]["condition"] == "service_completed_successfully"
    assert service(compose, "airflow-init").argv[-1].endswith("airflow-init.sh")
    assert "airflow db migrate" in (DEPLOY / "airflow-init.sh").read_text()


def test_auth_manager_is_fab_not_simple(compose):
    for name in AIRFLOW_SERVICES:
        assert service(compose, name).env["AIRFLOW__CORE__AUTH_MANAGER"].endswith("fab_auth_manager.FabAuthManager")
    pins = (DEPLOY / "constraints-py3.11.txt").read_text()
    assert re.search(r"^apache-airflow-providers-fab==", pins, re.MULTILINE)


def test_airflow_metadata_and_ledger_are_separate_databases(compose):
    s = compose["services"]
    assert s["airflow-db"]["image"].startswith("postgres:") and s["ledger-db"]["build"]["dockerfile"] == \
        "deploy/ledger-db.Dockerfile"
    vols = {s["airflow-db"]["volumes"][0].split(":")[0], s["ledger-db"]["volumes"][0].split(":")[0]}
    assert len(vols) == 2 and vols <= set(compose["volumes"])
    env = service(compose, "airflow-scheduler").env
    assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
    assert env["DPOPS_LEDGER_URL"].startswith("postgresql://dpops_app@ledger-db:")
    # psycopg 3 for both sync and async metadata connections (else Airflow looks for asyncpg).
    assert "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_CMD" in env and "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC_CMD" in env


def test_no_secret_values_in_environment(compose):
    for name, svc in compose["services"].items():
        for key, value in (svc.get("environment", {}) or {}).items():
            # No credential or key material inline: only paths and *_CMD/_FILE indirections.
            assert not re.search(r"(PASSWORD|SECRET|FERNET|NOISE_KEY|SECRET_KEY)$", key) or key.endswith(("_FILE", "_CMD")), (name, key)
            assert not re.search(r"://[^/@]*:[^/@]*@", str(value)), f"{name}.{key} has a password in a URL"
            assert key != "DPOPS_NOISE_KEY", f"{name} puts a key value in the environment"
    assert (DEPLOY / "secrets" / ".gitignore").read_text().splitlines()[1:] == ["*", "!.gitignore"]


def test_example_spec_loads_under_the_compose_allow_lists(compose, monkeypatch):
    from dpops.spec import load_spec

    env = service(compose, "airflow-dag-processor").env
    for var in ("DPOPS_DATA_ROOTS", "DPOPS_OUTPUT_ROOTS"):
        monkeypatch.setenv(var, env[var])
    monkeypatch.delenv("DPOPS_NOISE_KEY_FILE", raising=False)
    for path in sorted((DEPLOY / "specs").glob("*.yaml")):
        spec = load_spec(path)
        assert str(spec.output.root).startswith(env["DPOPS_OUTPUT_ROOTS"])
        assert spec.input.path.startswith(env["DPOPS_DATA_ROOTS"] + "/")
    # The example's partitions are the ones the example generator writes (p0..p3).
    example = yaml.safe_load((DEPLOY / "specs" / "example_daily.yaml").read_text())
    gen = service(compose, "example-data").argv
    assert example["input"]["path"].startswith(gen[gen.index("--root") + 1] + "/")
    assert example["partitions"]["public"] == [f"p{i}" for i in range(4)]


def test_ledger_db_image_and_first_start_install_the_databases_cap_check(compose):
    """Schema version 5: the ledger database refuses app-role reservations until a superuser installed
    ``dpops_cap_check`` (PL/Python running dpops' cap rule). The compose stack does it on the database's first
    start: the image has PL/Python for its PostgreSQL major and dpops in a root-owned venv at the path the init
    script calls, built with the same constraints as the worker image; the init script runs the roles SQL, then
    ``install-cap-check`` for the owner role and schema the roles SQL created."""
    text = (DEPLOY / "ledger-db.Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    major = re.match(r"FROM postgres:(\d+)-bookworm$", lines[0]).group(1)
    assert f"postgresql-plpython3-{major}" in text
    assert "python3 -m venv /opt/dpops-ledger" in text and "-c /src/deploy/constraints-py3.11.txt" in text
    assert "chmod -R go-w /opt/dpops-ledger" in text
    init = (DEPLOY / "ledger-db-init.sh").read_text()
    roles_at, install_at = init.index("-f /opt/dpops/ledger-roles.sql"), init.rindex("install-cap-check --owner-role")
    assert roles_at < install_at
    assert '${DPOPS_LEDGER_BIN:-/opt/dpops-ledger/bin}/dpops" ledger' in init
    assert "schema=$LEDGER_SCHEMA" in init and '--owner-role "$OWNER_ROLE"' in init
    owner_default = re.search(r"OWNER_ROLE=\"\$\{DPOPS_LEDGER_OWNER_ROLE:-(\w+)\}\"", init).group(1)
    schema_default = re.search(r"LEDGER_SCHEMA=\"\$\{DPOPS_LEDGER_SCHEMA:-(\w+)\}\"", init).group(1)
    owner_url = service(compose, "ledger-init").env["DPOPS_LEDGER_URL"]
    assert owner_url.startswith(f"postgresql://{owner_default}@") and owner_url.endswith(f"?schema={schema_default}")
    assert compose["services"]["ledger-db"]["build"]["context"] == ".."


def test_dockerfile_installs_with_constraints_and_report_extra():
    text = DOCKERFILE.read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert lines[0].startswith("FROM python:3.11")
    installs = [ln for ln in lines if "pip install" in ln]
    assert installs and all("-c deploy/constraints-py3.11.txt" in ln for ln in installs)
    extras = re.search(r'"\.\[([a-z,]+)\]"', text).group(1).split(",")
    assert {"beam", "airflow", "validate", "postgres", "report"} <= set(extras)
    pins = (DEPLOY / "constraints-py3.11.txt").read_text()
    for pkg in ("apache-airflow==3.3.2", "apache-beam==2.77.0", "great_expectations==1.24.1",
                "apache-airflow-providers-apache-beam==", "matplotlib=="):
        assert pkg in pins


def test_readme_documents_runners_key_and_scaling():
    text = README.read_text()
    for needle in ("FlinkRunner", "SparkRunner", "DataflowRunner", "PortableRunner", "DPOPS_NOISE_KEY_FILE",
                   "## Scaling", "BeamRunPythonPipelineOperator", "DPOPS_OUTPUT_ROOTS"):
        assert needle in text, needle


def test_ui_is_published_on_loopback_only(compose):
    """The api-server speaks plain HTTP: it must not listen on every interface of the host (issue 14 item 6)."""
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on all interfaces"


def _shell_as_recipe(script: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run an operator recipe as root in ``cwd`` (``sudo`` is the identity here; dpops from this venv)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DPOPS_", "AIRFLOW"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(["sh", "-ec", "sudo() { \"$@\"; }\n" + script], cwd=cwd, env=env, check=False, capture_output=True,
                          text=True, timeout=120)


def _key_accepted_as_image_user(key: Path, hold: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DPOPS_", "AIRFLOW"))}
    env.update(PYTHONPATH=str(REPO), HOME=str(hold.parent), USER="dpops", LOGNAME="dpops")
    argv = as_uid(IMAGE_UID, IMAGE_UID, [sys.executable, "-m", "dpops.cli.main", "key", "id", str(key)], hold)
    return subprocess.run(argv, env=env, check=False, capture_output=True, text=True, timeout=120)


@pytest.fixture
def uid_dir():
    """A directory uid 50000 can enter (pytest's tmp_path is below a root-only 0700 directory)."""
    d = Path(tempfile.mkdtemp(prefix="dpops-recipe-"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("unshare"),
                                reason="runs the recipe's chown and reads the files as uid 50000 (root, setpriv)")


@needs_root
def test_compose_header_key_recipe_writes_a_key_dpops_accepts(uid_dir):
    header = [ln[1:].strip() for ln in COMPOSE_FILE.read_text().splitlines() if ln.startswith("#   ")]
    recipe = [ln for ln in header if "noise_key" in ln and not ln.startswith("(`")]
    assert recipe, "the compose header shows no noise key recipe"
    (uid_dir / "deploy" / "secrets").mkdir(parents=True)
    os.chmod(uid_dir / "deploy" / "secrets", 0o755)
    proc = _shell_as_recipe("\n".join(recipe), uid_dir)
    assert proc.returncode == 0, proc.stderr
    key = uid_dir / "deploy" / "secrets" / "noise_key"
    assert key.stat().st_uid == IMAGE_UID and (key.stat().st_mode & 0o077) == 0
    checked = _key_accepted_as_image_user(key, uid_dir / "python-install")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # The same file left root-owned 0600 (the old recipe) is unreadable by the task's uid: refused.
    os.chown(key, 0, 0)
    os.chmod(key, 0o600)
    assert _key_accepted_as_image_user(key, uid_dir / "python-install").returncode != 0


@needs_root
def test_readme_recipe_creates_every_secret_readable_by_its_reader(uid_dir, compose):
    text = README.read_text()
    section = text[text.index("## Secrets"):]
    block = section[section.index("```bash") + len("```bash"):]
    block = block[:block.index("```")]
    recipe = [ln for ln in block.splitlines() if ln.strip() and "docker compose" not in ln]
    assert recipe[0].strip() == "cd deploy/secrets"
    secrets_dir = uid_dir / "deploy" / "secrets"
    secrets_dir.mkdir(parents=True)
    os.chmod(secrets_dir, 0o755)
    proc = _shell_as_recipe("\n".join(recipe), uid_dir)
    assert proc.returncode == 0, proc.stderr
    # Each file's readers: the (uid, gid) of every service process that mounts it (the api-server is 50001:50000).
    readers: dict[str, set[tuple[int, int]]] = {}
    for name, svc in compose["services"].items():
        for ref in secret_refs(svc):
            readers.setdefault(Path(compose["secrets"][ref.name]["file"]).name, set()).add(_user(name, svc))
    for file, users in readers.items():
        st = (secrets_dir / file).stat()
        if len({uid for uid, _ in users}) == 1:  # one reader: owner-only
            ((uid, _),) = {(u, u) for u, _ in users}
            assert st.st_uid == uid and (st.st_mode & 0o777) == 0o400, (file, st.st_uid, oct(st.st_mode))
        else:  # the api-server and the scheduler: one group, group-read, nothing for others
            assert (st.st_mode & 0o777) == 0o440 and all(u == st.st_uid or g == st.st_gid for u, g in users), \
                (file, st.st_uid, st.st_gid, oct(st.st_mode), users)
    # What each image user must read, it can read, and nothing else (through the kernel's own permission check).
    hold = uid_dir / "python-install"
    for user in sorted({u for users in readers.values() for u in users if u[0] != POSTGRES_UID}):
        mine = sorted(f for f, users in readers.items() if user in users)
        cat = subprocess.run(as_uid(user[0], user[1], ["cat", *[str(secrets_dir / f) for f in mine]], hold),
                             check=False, capture_output=True, timeout=60)
        assert cat.returncode == 0, (user, cat.stderr)
        for f in sorted(f for f, users in readers.items() if user not in users):
            # the databases' passwords, the tasks' secrets for the api-server, the api-server's for the tasks
            if f.endswith(".pub"):
                continue
            denied = subprocess.run(as_uid(user[0], user[1], ["cat", str(secrets_dir / f)], hold), check=False,
                                    capture_output=True, timeout=60)
            assert denied.returncode != 0, (user, f)
    assert _key_accepted_as_image_user(secrets_dir / "noise_key", hold).returncode == 0
    # The metadata URL carries the password the database was given.
    url = (secrets_dir / "airflow_db_url").read_text()
    assert url == f"postgresql+psycopg://airflow:{(secrets_dir / 'airflow_db_password').read_text()}@airflow-db:5432/airflow"


def test_gx_project_is_0700_on_its_own_volume_in_the_scheduler_only(compose):
    """Issue 19 item 5 (c): the deployed GX project directory is created 0700 by the image user, and only the
    service that publishes (the scheduler) names it."""
    from deploy_support import dockerfile_created_dirs

    path = service(compose, "airflow-scheduler").env["DPOPS_GX_PROJECT"]
    assert dockerfile_created_dirs()[path] == (str(IMAGE_UID), "0700")
    assert [n for n in compose["services"] if "DPOPS_GX_PROJECT" in service(compose, n).env] == ["airflow-scheduler"]
