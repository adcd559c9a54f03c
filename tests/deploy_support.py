"""Read deploy/docker-compose.yml and deploy/Dockerfile the way Docker would, for the deploy tests.

There is no Docker engine here, so tests/test_deploy_stack.py runs the compose file's processes
directly; this module is the one place that says what a service is made of: its environment
(Dockerfile ``ENV`` overlaid by the service's ``environment``), its argv (``entrypoint`` +
``command``, or the image's ENTRYPOINT + ``command``), its secrets (name, owner, mode) and its
volumes.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
SECRETS_DIR = "/run/secrets"
AIRFLOW_SERVICES = {"airflow-apiserver": "api-server", "airflow-scheduler": "scheduler",
                    "airflow-dag-processor": "dag-processor", "airflow-triggerer": "triggerer"}
ONE_SHOT_SERVICES = ("airflow-init", "ledger-init", "example-data")


@dataclass(frozen=True)
class SecretRef:
    name: str
    target: str  # absolute path inside the container
    uid: int | None
    gid: int | None
    mode: int | None


@dataclass
class Service:
    name: str
    argv: list[str]
    env: dict[str, str]
    secrets: list[SecretRef]
    volumes: list[str] = field(default_factory=list)
    user: str | None = None


def load_compose(path: Path = COMPOSE_FILE) -> dict:
    return yaml.safe_load(path.read_text())


def _mode(value: object) -> int | None:
    """Compose reads ``0o400`` as octal (YAML 1.2); PyYAML keeps it a string."""
    if value is None:
        return None
    if isinstance(value, int):
        return value
    text = str(value)
    return int(text, 0) if text.startswith("0o") else int(text, 8)


def secret_refs(service: dict) -> list[SecretRef]:
    out = []
    for ref in service.get("secrets", []) or []:
        if isinstance(ref, str):
            out.append(SecretRef(ref, f"{SECRETS_DIR}/{ref}", None, None, None))
            continue
        target = ref.get("target", ref["source"])
        target = target if target.startswith("/") else f"{SECRETS_DIR}/{target}"
        uid = int(ref["uid"]) if "uid" in ref else None
        gid = int(ref["gid"]) if "gid" in ref else None
        out.append(SecretRef(ref["source"], target, uid, gid, _mode(ref.get("mode"))))
    return out


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined: list[str] = []
    buf = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        joined.append(buf + stripped)
        buf = ""
    out = []
    for line in joined:
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def dockerfile_env(path: Path = DOCKERFILE) -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in dockerfile_instructions(path):
        if word == "ENV":
            for token in shlex.split(rest):
                key, _, value = token.partition("=")
                env[key] = value
    return env


def dockerfile_entrypoint(path: Path = DOCKERFILE) -> list[str]:
    entry: list[str] = []
    for word, rest in dockerfile_instructions(path):
        if word == "ENTRYPOINT":
            entry = json.loads(rest)
    return entry


def dockerfile_created_dirs(path: Path = DOCKERFILE) -> dict[str, tuple[str, str]]:
    """Directories ``install -d -o U -g G -m M`` creates in RUN steps: path -> (owner, mode)."""
    out: dict[str, tuple[str, str]] = {}
    for word, rest in dockerfile_instructions(path):
        if word != "RUN":
            continue
        for cmd in re.split(r"&&|;", rest):
            args = shlex.split(cmd)
            if args[:2] != ["install", "-d"]:
                continue
            owner = mode = ""
            paths = []
            it = iter(args[2:])
            for a in it:
                if a == "-o":
                    owner = next(it)
                elif a == "-g":
                    next(it)
                elif a == "-m":
                    mode = next(it)
                else:
                    paths.append(a)
            for p in paths:
                out[p] = (owner, mode)
    return out


def service(compose: dict, name: str) -> Service:
    svc = compose["services"][name]
    env = dockerfile_env()
    raw = svc.get("environment", {}) or {}
    if isinstance(raw, list):
        raw = dict(e.split("=", 1) for e in raw)
    env.update({k: str(v) for k, v in raw.items()})
    command = list(svc.get("command", []) or [])
    entry = svc.get("entrypoint")
    argv = list(entry) + command if entry is not None else dockerfile_entrypoint() + command
    return Service(name, argv, env, secret_refs(svc), list(svc.get("volumes", []) or []), svc.get("user"))


def interpreter_namespace(hold: Path, read_only: tuple[Path, ...] = ()) -> list[str]:
    """argv prefix: a private mount namespace that lets a non-root uid reach this machine's Python.

    The venv's interpreter may live below a directory only root may enter (here /root, mode 0700).
    Rather than change that directory, the process runs in its own mount namespace where the
    blocking directory is an empty 0755 tmpfs with only the Python installation bound back at its
    path (``hold`` is an empty directory used as the bind's waypoint). ``read_only`` directories are
    bound onto themselves read-only, as compose mounts secrets. Nothing else about the process
    changes; its PID stays the one ``Popen`` returns (unshare and sh exec the next program).
    """
    steps = [f"mount --bind {d} {d} && mount -o remount,bind,ro {d}" for d in read_only]
    prefix = Path(sys.base_prefix).resolve()
    blocked = next((p for p in reversed(prefix.parents) if p != Path("/") and not p.stat().st_mode & 0o001), None)
    if blocked is not None:
        hold.mkdir(exist_ok=True)
        steps += [f"mount --bind {prefix} {hold}", f"mount -t tmpfs -o mode=0755 tmpfs {blocked}",
                  f"mkdir -p {prefix}", f"mount --bind {hold} {prefix}"]
    if not steps:
        return []
    script = " && ".join([*steps, 'exec "$@"'])
    return ["unshare", "-m", "--propagation", "private", "--", "sh", "-c", script, "sh"]


def as_uid(uid: int, gid: int, argv: list[str], hold: Path) -> list[str]:
    """argv run as ``uid``/``gid`` with no supplementary groups (the compose ``user:``)."""
    return [*interpreter_namespace(hold), "setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--", *argv]
