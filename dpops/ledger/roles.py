"""PostgreSQL owner and application roles for the ledger (issue 14 item 4, docs/threat-model.md).

The **owner** role creates and migrates the schema (``dpops ledger init``) and owns
the tables and triggers. The **application** role is what DAG tasks and operators'
``dpops release`` runs connect as. It may:

- SELECT and INSERT ``entries`` (append), never UPDATE, DELETE or TRUNCATE them, and only
  run entries (reserved, started, committed, spent_unpublished, released) that record it
  as their writer (trigger ``entries_writer``, schema version 3);
- SELECT and UPDATE of ``chain_head``'s two columns (the triggers let it move forward by one only);
- SELECT ``scopes``, and UPDATE of one column only because ``SELECT ... FOR UPDATE`` (the row
  lock every reservation takes) needs an UPDATE privilege; the trigger ``scopes_owner_only``
  refuses every actual INSERT, UPDATE or DELETE by a role other than the owner (issue 19
  item 10: the application role could raise caps and create scopes);
- SELECT ``runs`` only: since schema version 4 the database derives it from the entries (an owner-owned
  SECURITY DEFINER trigger, ``schema.py``), and the cap check composes from it, so nothing the cap check
  reads is writable by the app role (issue 25 item 8: resetting the old ``buckets`` cache let it commit
  epsilon 2.4 on a cap of 1);
- no table-level UPDATE, DELETE or TRUNCATE anywhere, so no ``LOCK TABLE`` stronger than ROW EXCLUSIVE;
- SELECT ``schema_version``.

Owner-only, refused by the database for every other role (and named so by the CLI, exit 3):
``dpops ledger scope create`` (a new scope), ``ledger cap``, ``ledger import``, ``ledger init``
(schema changes and grants); every UPDATE/DELETE/TRUNCATE of history was already refused.

The **reader** role (``dpops ledger init --reader-role``, issue 21 item 1) is what the Airflow
api-server's Privacy budget page connects as: SELECT on every ledger table, nothing else. PostgreSQL
refuses its every INSERT, UPDATE, DELETE and TRUNCATE (no privilege), and ``deploy/ledger-roles.sql``
also sets ``default_transaction_read_only`` on it. Privacy reason: the web tier is the most exposed
process of a deployment; whoever takes it over must not be able to write, and so not lower, what was
charged. What it reads (budget figures, run states, reasons, output URIs) is what a manifest reader sees.

The app role is not the tables' owner and not a member of the owner role, so it can neither
drop nor disable the triggers nor ALTER the tables. Privacy reason: whoever runs
releases must not be able to lower what was charged; the budget is only as
trustworthy as the least-privileged writer that can rewrite it. The owner (and any
superuser) can still rewrite everything; only signed checkpoints held outside the
database (``dpops.ledger.checkpoint``) catch that.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from dpops.errors import LedgerError, PermissionRefused

if TYPE_CHECKING:
    from dpops.ledger.backend import Backend, OpenLedger

_ROLE_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")

# Column-level UPDATE only, never a table-level UPDATE, DELETE or TRUNCATE: PostgreSQL lets ``LOCK TABLE`` take
# a lock stronger than ROW EXCLUSIVE only with one of those table privileges, so the app role cannot take the
# ACCESS EXCLUSIVE lock that would hang the owner's status/verify and the budget page (issue 25 item 11).
TABLE_GRANTS = (
    ("entries", "SELECT, INSERT"),
    ("chain_head", "SELECT, UPDATE (last_id, last_hash)"),  # the triggers let it move forward by one only
    ("scopes", "SELECT, UPDATE (last_entry)"),  # UPDATE only for FOR UPDATE row locks; the trigger refuses writes
    ("runs", "SELECT"),  # written by the owner's trigger from the entries (schema version 4), never by the app
    ("run_charges", "SELECT"),  # the settled runs grouped, maintained by the same trigger (PostgreSQL only)
    ("schema_version", "SELECT"),
)


# The reader role: read every ledger table, write none (a web page that shows the budget).
READER_TABLES = tuple(t for t, _ in TABLE_GRANTS)


def table_owner(db: Backend) -> str | None:
    """The role owning the ledger tables in the current schema (None when there are none yet)."""
    row = db.one("SELECT tableowner FROM pg_tables WHERE schemaname = current_schema() AND tablename = 'entries'")
    return str(row[0]) if row else None


def session_write_privileges(db: Backend) -> list[str]:
    """PostgreSQL: ``table: PRIVILEGES`` for every ledger table this session's role may write (INSERT, UPDATE,
    DELETE, TRUNCATE); empty for the reader role, and on SQLite (no roles: the file's permissions decide).

    The Privacy budget page shows a non-empty answer as a warning: a web tier that can write the ledger is a
    deployment error (deploy/README.md), not something the page can correct."""
    if db.dialect != "postgresql":
        return []
    out = []
    for table in READER_TABLES:
        privs = [p for p in ("INSERT", "UPDATE", "DELETE", "TRUNCATE")
                 if db.row("SELECT has_table_privilege(current_user, to_regclass(?), ?)", (table, p))[0]]
        if privs:
            out.append(f"{table}: {', '.join(privs)}")
    return out


def require_owner(db: Backend, action: str) -> None:
    """PostgreSQL: PermissionRefused (exit 3) unless this session's login role may act as the tables' owner.

    The same rule as the database's guard triggers (``schema.py`` version 3): ``session_user`` is a member of the
    owner role (the owner itself, a role that may SET ROLE to it, or a superuser). Checked up front by owner-only
    commands so that a no-op (an identical scope, an up-to-date schema) is refused too, with the owner named;
    the database refuses the writes themselves whatever the client does. SQLite has no roles.
    """
    if db.dialect != "postgresql":
        return
    owner = table_owner(db)
    if owner is None:
        return  # no tables yet: creating them is what makes this session the owner
    me = db.row("SELECT session_user, pg_has_role(session_user, ?, 'MEMBER')", (owner,))
    if not me[1]:
        raise PermissionRefused(
            f"connected as {me[0]!r}, which is not the ledger owner role {owner!r}: only {owner!r} may {action}; "
            f"the application role only reserves and settles runs; connect as {owner!r} (the role that ran "
            "`dpops ledger init`) and run the command again; nothing was changed"
        )


def check_role_name(role: str) -> str:
    """``role`` if it is a plain lower-case SQL identifier (it is interpolated into GRANTs), else LedgerError."""
    if not isinstance(role, str) or not _ROLE_RE.match(role):
        raise LedgerError(f"application role must be a lower-case SQL identifier (letters, digits, _), got {role!r}")
    return role


def app_role_sql(role: str, schema: str) -> list[str]:
    """The statements that give ``role`` exactly the application rights on the ledger in ``schema``.

    Everything is revoked first, so running it again (or on a role that had more) converges.
    """
    check_role_name(role)
    if not _ROLE_RE.match(schema):
        raise LedgerError(f"schema must be a lower-case SQL identifier, got {schema!r}")
    tables = ", ".join(f'"{schema}"."{t}"' for t, _ in TABLE_GRANTS)
    out = [
        f'REVOKE ALL ON {tables} FROM PUBLIC',
        f'REVOKE ALL ON {tables} FROM "{role}"',
        f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"',
    ]
    out += [f'GRANT {privs} ON "{schema}"."{table}" TO "{role}"' for table, privs in TABLE_GRANTS]
    return out


def reader_role_sql(role: str, schema: str) -> list[str]:
    """The statements that give ``role`` exactly SELECT on the ledger in ``schema`` (everything else revoked)."""
    check_role_name(role)
    if not _ROLE_RE.match(schema):
        raise LedgerError(f"schema must be a lower-case SQL identifier, got {schema!r}")
    tables = ", ".join(f'"{schema}"."{t}"' for t in READER_TABLES)
    return [
        f'REVOKE ALL ON {tables} FROM PUBLIC',
        f'REVOKE ALL ON {tables} FROM "{role}"',
        f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"',
        f'GRANT SELECT ON {tables} TO "{role}"',
    ]


def _checked_role(ledger: OpenLedger, role: str, option: str) -> str:
    """The schema ``role`` may be granted on, after the checks both grants share (run as the owner).

    Refuses a role that could undo the guards: a superuser, the tables' owner, or a member of the owner role."""
    db = ledger.db
    if db.dialect != "postgresql":
        raise LedgerError(f"{option} applies to PostgreSQL ledgers only: a SQLite ledger is guarded by its file's "
                          "permissions (make the file and its directory writable only by the service account)")
    check_role_name(role)
    row = db.one("SELECT rolsuper FROM pg_roles WHERE rolname = ?", (role,))
    if row is None:
        raise LedgerError(f"role {role!r} does not exist: create it first (deploy/ledger-roles.sql), "
                          f"then run `dpops ledger init {option} {role}` again as the owner")
    if row[0]:
        raise LedgerError(f"role {role!r} is a superuser: it could disable every guard; use an ordinary role")
    owner = db.one("SELECT tableowner FROM pg_tables WHERE schemaname = current_schema() AND tablename = 'entries'")
    if owner is None:
        raise LedgerError("the ledger tables are not in the current schema: run `dpops ledger init` first")
    member = db.one("SELECT pg_has_role(?, ?, 'MEMBER')", (role, owner[0]))
    if role == owner[0] or (member and member[0]):
        raise LedgerError(f"role {role!r} owns the ledger tables (or is a member of their owner {owner[0]!r}): "
                          f"it could drop the triggers; the {option[2:].replace('-', ' ')} must be a separate role")
    me = db.row("SELECT current_user, pg_has_role(current_user, ?, 'USAGE')", (owner[0],))
    if not me[1]:
        # PostgreSQL only warns when a non-owner GRANTs or REVOKEs; refuse instead of pretending it worked.
        raise LedgerError(f"connected as {me[0]!r}, which does not own the ledger tables (owner {owner[0]!r}): "
                          f"run `dpops ledger init {option}` as the owner role")
    return str(db.row("SELECT current_schema()")[0])


def grant_reader_role(ledger: OpenLedger, role: str) -> list[str]:
    """Grant SELECT-only rights on the ledger to an existing ``role``; run as the owner. Returns the SQL it ran."""
    statements = reader_role_sql(role, _checked_role(ledger, role, "--reader-role"))
    with ledger.db.transaction():
        for sql in statements:
            ledger.db.execute(sql)
    return statements


def grant_app_role(ledger: OpenLedger, role: str) -> list[str]:
    """Grant the application rights to an existing ``role``; run as the owner. Returns the SQL it ran.

    Refuses a role that could undo the guards: a superuser, the tables' owner, or a member of the owner role.
    """
    schema = _checked_role(ledger, role, "--app-role")
    db = ledger.db
    from dpops.ledger import db_cap

    if not db_cap.installed(db):
        # Privacy reason (schema version 5): the database refuses every app-role reservation while it cannot check
        # them against the cap; granting the role now would only defer that refusal to the first release.
        owner = table_owner(db)
        raise LedgerError(
            f"the database cannot enforce the cap for role {role!r}: {db_cap.FUNCTION} is not installed in schema "
            f"{schema!r}. Ask the database superuser to run `dpops ledger --ledger <superuser URL with "
            f"?schema={schema}> install-cap-check --owner-role {owner}` (deploy/ledger-db-init.sh does it on the "
            "ledger database's first start), then run this again; nothing was changed"
        )
    statements = app_role_sql(role, schema)
    with db.transaction():
        for sql in statements:
            db.execute(sql)
    return statements
