"""PostgreSQL owner and application roles for the ledger tests (one copy, used by every file that needs them).

``ledger_roles(postgres_url, prefix)`` creates a fresh ``dpops_owner_<tag>`` (LOGIN NOSUPERUSER, may CREATE in
the database) and a fresh ``dpops_app_<tag>`` (LOGIN NOSUPERUSER, NOINHERIT unless ``app_inherit``), and a schema
name ``<prefix>_<tag>`` the owner will create; on exit it drops the schema, everything the two roles own and the
roles themselves (roles are server-wide: a leftover one would leak into the next run). ``roles`` is the same as a
function-scoped pytest fixture (import it into the test module).
"""

from __future__ import annotations

import time
import uuid
from contextlib import contextmanager
from typing import Iterator, NamedTuple

import psycopg
import pytest


class LedgerRoles(NamedTuple):
    """Unpacks as (owner_url, app_url, owner, app, admin, schema); ``admin`` is the superuser connection."""

    owner_url: str
    app_url: str
    owner: str
    app: str
    admin: psycopg.Connection
    schema: str


def catalog_execute(admin: psycopg.Connection, sql: str) -> None:
    """Run a statement that rewrites a shared catalog row (a database's ACL: GRANT ... ON DATABASE, DROP
    OWNED BY a role holding such a grant), retrying PostgreSQL's "tuple concurrently updated": the test
    processes run side by side (``make test``: three) and all grant and revoke on the one database
    ``test``, whose pg_database row each such statement rewrites in place."""
    for attempt in range(20):
        try:
            admin.execute(sql)
            return
        except psycopg.errors.InternalError as exc:
            if "tuple concurrently updated" not in str(exc) or attempt == 19:
                raise
            time.sleep(0.05 * (attempt + 1))


def install_cap_check(superuser_url: str, owner: str) -> None:
    """``dpops ledger install-cap-check`` as the superuser (deploy/ledger-db-init.sh's second step): the database
    refuses app-role reservations without it (schema version 5). Creates the schema, owned by ``owner``, if
    missing. This dpops is what the database server imports (it runs on this machine)."""
    from dpops.ledger.backend import postgres_target
    from dpops.ledger.db_cap import install

    conninfo, schema = postgres_target(superuser_url)
    install(conninfo, schema=schema or "public", owner_role=owner)


@contextmanager
def ledger_roles(postgres_url: str, prefix: str, *, schema: str | None = None,
                 app_inherit: bool = False) -> Iterator[LedgerRoles]:
    """Fresh owner and app roles and the URLs to connect as each to the schema (``schema`` or ``<prefix>_<tag>``)."""
    tag = uuid.uuid4().hex[:8]
    owner, app = f"dpops_owner_{tag}", f"dpops_app_{tag}"
    schema = schema or f"{prefix}_{tag}"
    admin = psycopg.connect(postgres_url, autocommit=True)
    try:
        admin.execute(f'CREATE ROLE "{owner}" LOGIN NOSUPERUSER')
        admin.execute(f'CREATE ROLE "{app}" LOGIN NOSUPERUSER{"" if app_inherit else " NOINHERIT"}')
        catalog_execute(admin, f'GRANT CREATE ON DATABASE test TO "{owner}"')
        install_cap_check(f"{postgres_url}?schema={schema}", owner)
        yield LedgerRoles(postgres_url.replace("postgres@", f"{owner}@") + f"?schema={schema}",
                          postgres_url.replace("postgres@", f"{app}@") + f"?schema={schema}",
                          owner, app, admin, schema)
    finally:
        admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        for role in (app, owner):
            if admin.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone():
                catalog_execute(admin, f'DROP OWNED BY "{role}"')
                catalog_execute(admin, f'DROP ROLE "{role}"')
        admin.close()


@pytest.fixture
def roles(postgres_url: str) -> Iterator[LedgerRoles]:
    """A fresh schema owned by a fresh owner role, and a NOINHERIT app role."""
    with ledger_roles(postgres_url, "t_roles") as r:
        yield r
