"""Create (or re-key) the Airflow admin of the FAB auth manager from a secret file.

Run by the compose ``airflow-init`` service after ``airflow db migrate``:

    python deploy/create_admin.py            # user $AIRFLOW_ADMIN_USER (default "admin"),
                                             # password read from $AIRFLOW_ADMIN_PASSWORD_FILE

Why not ``airflow users create --password ...``: the password would sit on a command line
(``ps``, shell history, container inspect); without ``--password`` the command prompts
through ``getpass``, which has no terminal in a container. This reads the mounted secret
and calls the same FAB security-manager methods the CLI calls.

Idempotent: an existing admin gets the secret's password again (``reset_password``), so
rotating the admin password is "replace the secret file, re-run airflow-init". The
password is never printed.

With ``$AIRFLOW_TASK_CONNECTIONS_FILE`` (the scheduler's task-side connections file, JSON),
the login of its ``dpops_airflow_api`` connection is created too, with FAB's ``User`` role:
the DAG's tasks use it to set the note of a refused run through the REST API (Airflow 3
tasks have no database access). It gets a role that can edit DAG runs, not the admin's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

PASSWORD_FILE_ENV = "AIRFLOW_ADMIN_PASSWORD_FILE"
USER_ENV = "AIRFLOW_ADMIN_USER"
DEFAULT_PASSWORD_FILE = "/run/secrets/airflow_admin_password"
TASK_CONNECTIONS_ENV = "AIRFLOW_TASK_CONNECTIONS_FILE"
NOTES_CONN_ID = "dpops_airflow_api"
NOTES_ROLE = "User"


def read_password(path: Path) -> str:
    try:
        password = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise SystemExit(f"create_admin: cannot read the admin password file {path} ({exc.strerror}); "
                         "create deploy/secrets/airflow_admin_password (deploy/README.md)") from None
    if len(password) < 12:
        raise SystemExit(f"create_admin: the admin password in {path} is shorter than 12 characters; "
                         "write a longer random one (deploy/README.md)")
    return password


def notes_login(path: Path) -> tuple[str, str]:
    """(login, password) of the ``dpops_airflow_api`` connection in the task connections file."""
    try:
        conn = json.loads(path.read_text(encoding="utf-8"))[NOTES_CONN_ID]
        login, password = str(conn["login"]), str(conn["password"])
    except OSError as exc:
        raise SystemExit(f"create_admin: cannot read the task connections file {path} ({exc.strerror})") from None
    except (ValueError, KeyError, TypeError):
        raise SystemExit(f"create_admin: {path} has no JSON connection {NOTES_CONN_ID!r} with a login and a "
                         "password (deploy/README.md)") from None
    if len(password) < 12:
        raise SystemExit(f"create_admin: the {NOTES_CONN_ID} password in {path} is shorter than 12 characters")
    return login, password


def ensure_user(sm, user: str, password: str, role_name: str) -> None:
    existing = sm.find_user(username=user)
    if existing is not None:
        if not sm.reset_password(existing.id, password):
            raise SystemExit(f"create_admin: could not set the password of Airflow user {user!r}")
        print(f"create_admin: Airflow user {user!r} exists; password set from the secret file")
        return
    role = sm.find_role(role_name)
    if role is None:
        raise SystemExit(f"create_admin: the FAB role {role_name!r} does not exist; run `airflow db migrate` with "
                         "AIRFLOW__CORE__AUTH_MANAGER set to the FAB auth manager first")
    if not sm.add_user(user, "dpops", user, f"{user}@localhost", role, password):
        raise SystemExit(f"create_admin: could not create Airflow user {user!r}")
    print(f"create_admin: Airflow user {user!r} created with role {role_name}")


def main() -> int:
    from airflow.providers.fab.auth_manager.cli_commands.utils import (
        get_application_builder,
    )

    user = os.environ.get(USER_ENV, "admin")
    password = read_password(Path(os.environ.get(PASSWORD_FILE_ENV, DEFAULT_PASSWORD_FILE)))
    notes = os.environ.get(TASK_CONNECTIONS_ENV)
    notes_user = notes_login(Path(notes)) if notes else None
    with get_application_builder() as appbuilder:
        ensure_user(appbuilder.sm, user, password, "Admin")
        if notes_user is not None:
            ensure_user(appbuilder.sm, notes_user[0], notes_user[1], NOTES_ROLE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
