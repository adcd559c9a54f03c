"""Versioned schema migrations of the ledger database.

``entries`` is the append-only, hash-chained record of everything (the truth).
``chain_head`` holds the id and hash of the last entry: one row that every writer
locks last, so entry ids are gap-free and in commit order, and truncating the
tail of the chain is detected by ``verify`` (as long as ``chain_head`` itself is
not reset). ``scopes``, ``buckets`` and ``runs`` are caches derived from the
entries in the same transaction; ``verify`` recomputes them.

What the database guards do, and what they do not (docs/threat-model.md):

- Triggers refuse UPDATE, DELETE and (PostgreSQL, migration 2) TRUNCATE on
  ``entries``, and let ``chain_head`` only move forward by one to an entry that
  exists. They stop mistakes and an *application* role (``dpops ledger init
  --app-role``), which has no right to drop or disable them.
- They do NOT stop the table owner or a superuser: they can disable the
  triggers, rewrite every entry and recompute every hash (the chain is an unkeyed
  sha256), and ``verify`` alone then passes. Only an anchor kept outside the
  database catches that: Ed25519-signed checkpoints of the chain head
  (``dpops.ledger.checkpoint``, ``dpops ledger verify --checkpoints``) or a head
  hash a reviewer wrote down (``--expect-head``).

Append a new migration to MIGRATIONS; never edit an applied one.
"""

from __future__ import annotations

from dpops.errors import LedgerError, PermissionRefused
from dpops.ledger.backend import Backend, redact
from dpops.ledger.model import utc_now

GENESIS_HASH = "0" * 64

_V1_TABLES = [
    """CREATE TABLE IF NOT EXISTS chain_head (
        singleton INTEGER PRIMARY KEY CHECK (singleton = 1),
        last_id BIGINT NOT NULL,
        last_hash TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS entries (
        id BIGINT PRIMARY KEY,
        ts TEXT NOT NULL,
        kind TEXT NOT NULL,
        scope TEXT,
        run_id TEXT,
        buckets TEXT NOT NULL,
        actor TEXT NOT NULL,
        body TEXT NOT NULL,
        prev_hash TEXT NOT NULL,
        hash TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS entries_scope ON entries (scope, id)",
    "CREATE INDEX IF NOT EXISTS entries_run ON entries (run_id)",
    """CREATE TABLE IF NOT EXISTS scopes (
        name TEXT PRIMARY KEY,
        definition TEXT NOT NULL,
        accountant TEXT NOT NULL,
        last_entry BIGINT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS buckets (
        scope TEXT NOT NULL,
        bucket TEXT NOT NULL,
        settled_state TEXT NOT NULL,
        committed_state TEXT NOT NULL,
        spent_state TEXT NOT NULL,
        PRIMARY KEY (scope, bucket))""",
    """CREATE TABLE IF NOT EXISTS runs (
        run_id TEXT PRIMARY KEY,
        scope TEXT NOT NULL,
        release TEXT NOT NULL,
        interval_start TEXT NOT NULL,
        interval_end TEXT NOT NULL,
        run_key TEXT NOT NULL,
        state TEXT NOT NULL,
        events TEXT NOT NULL,
        buckets TEXT NOT NULL,
        restates TEXT,
        output_uri TEXT,
        details TEXT NOT NULL,
        entry_ids TEXT NOT NULL,
        entry_hashes TEXT NOT NULL,
        created_at TEXT NOT NULL,
        updated_at TEXT NOT NULL,
        epsilon DOUBLE PRECISION,
        last_entry BIGINT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS runs_scope_state ON runs (scope, state)",
    "CREATE INDEX IF NOT EXISTS runs_interval ON runs (release, interval_start, interval_end, state)",
]

_V1_SQLITE_GUARDS = [
    """CREATE TRIGGER IF NOT EXISTS entries_no_update BEFORE UPDATE ON entries
       BEGIN SELECT RAISE(ABORT, 'ledger entries are append-only'); END""",
    """CREATE TRIGGER IF NOT EXISTS entries_no_delete BEFORE DELETE ON entries
       BEGIN SELECT RAISE(ABORT, 'ledger entries are append-only'); END""",
]

_V1_POSTGRES_GUARDS = [
    """CREATE OR REPLACE FUNCTION dpops_entries_append_only() RETURNS trigger AS $$
       BEGIN RAISE EXCEPTION 'ledger entries are append-only'; END; $$ LANGUAGE plpgsql""",
    "DROP TRIGGER IF EXISTS entries_append_only ON entries",
    """CREATE TRIGGER entries_append_only BEFORE UPDATE OR DELETE ON entries
       FOR EACH ROW EXECUTE FUNCTION dpops_entries_append_only()""",
]


def _v1(db: Backend) -> None:
    for sql in _V1_TABLES:
        db.execute(sql)
    for sql in _V1_SQLITE_GUARDS if db.dialect == "sqlite" else _V1_POSTGRES_GUARDS:
        db.execute(sql)
    if db.one("SELECT 1 FROM chain_head WHERE singleton = 1") is None:
        db.execute("INSERT INTO chain_head (singleton, last_id, last_hash) VALUES (1, 0, ?)", (GENESIS_HASH,))


# --- version 2: TRUNCATE refused, chain head only moves forward ------------------------------------
# Why: an application role that may INSERT entries and UPDATE chain_head could otherwise reset the head
# to 0 and truncate history; these refuse that for every role that cannot disable triggers (i.e. is not
# the table owner or a superuser).

_V2_SQLITE_GUARDS = [
    # SQLite has no TRUNCATE: "DELETE FROM entries" is already refused by entries_no_delete.
    """CREATE TRIGGER IF NOT EXISTS chain_head_forward_only BEFORE UPDATE ON chain_head
       WHEN NEW.singleton != 1 OR NEW.last_id != OLD.last_id + 1
            OR NOT EXISTS (SELECT 1 FROM entries WHERE id = NEW.last_id AND hash = NEW.last_hash)
       BEGIN SELECT RAISE(ABORT, 'the ledger chain head only moves forward to the entry just appended'); END""",
    """CREATE TRIGGER IF NOT EXISTS chain_head_no_delete BEFORE DELETE ON chain_head
       BEGIN SELECT RAISE(ABORT, 'the ledger chain head cannot be deleted'); END""",
]

_V2_POSTGRES_GUARDS = [
    "DROP TRIGGER IF EXISTS entries_no_truncate ON entries",
    """CREATE TRIGGER entries_no_truncate BEFORE TRUNCATE ON entries
       FOR EACH STATEMENT EXECUTE FUNCTION dpops_entries_append_only()""",
    """CREATE OR REPLACE FUNCTION dpops_chain_head_forward_only() RETURNS trigger AS $$
       BEGIN
         IF TG_OP <> 'UPDATE' THEN
           RAISE EXCEPTION 'the ledger chain head cannot be deleted or truncated';
         END IF;
         IF NEW.singleton <> 1 OR NEW.last_id <> OLD.last_id + 1 OR NOT EXISTS (
              SELECT 1 FROM entries WHERE id = NEW.last_id AND hash = NEW.last_hash) THEN
           RAISE EXCEPTION 'the ledger chain head only moves forward to the entry just appended';
         END IF;
         RETURN NEW;
       END; $$ LANGUAGE plpgsql""",
    "DROP TRIGGER IF EXISTS chain_head_forward_only ON chain_head",
    """CREATE TRIGGER chain_head_forward_only BEFORE UPDATE OR DELETE ON chain_head
       FOR EACH ROW EXECUTE FUNCTION dpops_chain_head_forward_only()""",
    "DROP TRIGGER IF EXISTS chain_head_no_truncate ON chain_head",
    """CREATE TRIGGER chain_head_no_truncate BEFORE TRUNCATE ON chain_head
       FOR EACH STATEMENT EXECUTE FUNCTION dpops_chain_head_forward_only()""",
]


def _v2(db: Backend) -> None:
    for sql in _V2_SQLITE_GUARDS if db.dialect == "sqlite" else _V2_POSTGRES_GUARDS:
        db.execute(sql)


# --- version 3: every entry records the database role that wrote it; owner-only writes (issue 19 item 10) --------
# Why: the application role (DAG tasks, operators' `dpops release`) could raise caps and create scopes, and the
# history recorded only the actor the caller typed. Decision (docs/threat-model.md, "Owner-only operations"):
# triggers that check ``session_user`` against the tables' owner, plus privileges as a second layer
# (``roles.py``: no INSERT on scopes, UPDATE only on one column so ``SELECT ... FOR UPDATE`` row locks work).
# - A trigger, not a SECURITY DEFINER function: the application role must keep writing entries and the caches
#   for reserve/start/commit/release through plain statements, and a definer function would be a second write
#   path to keep in step with store.py. The trigger inspects every INSERT whatever its path.
# - ``session_user``, not ``current_user``: the login role cannot be changed by ``SET ROLE`` (the application role
#   is NOINHERIT and no member of the owner), and it is what ``entries.writer`` records.
# - "Owner" = a member of the role owning the table (``pg_has_role(..., 'MEMBER')``): the owner itself, a role
#   that may SET ROLE to it, or a superuser. They can disable triggers anyway; the guard is for everyone else.
# - ``writer`` is set by the database's rule, not the client's word: for any non-owner session the row must say
#   ``session_user`` (column default too), and the hashed body must carry the same value, so the chain covers it.
#   An owner may insert another writer (``dpops ledger import`` copies entries verbatim, with their writer).
# - Entries written before this version have no writer (NULL, no ``writer`` in the body): their hashes are
#   unchanged, so old chains, exports and checkpoints keep verifying.
APP_ENTRY_KINDS = ("reserved", "started", "committed", "spent_unpublished", "released", "private_access")
OWNER_ONLY_KINDS = ("scope_created", "cap_changed", "scope_time_pinned")

_V3_POSTGRES = [
    "ALTER TABLE entries ADD COLUMN IF NOT EXISTS writer TEXT",  # no default here: old rows stay NULL
    "ALTER TABLE entries ALTER COLUMN writer SET DEFAULT session_user",
    f"""CREATE OR REPLACE FUNCTION dpops_entries_writer() RETURNS trigger AS $$
       DECLARE owner_name name;
       BEGIN
         SELECT pg_get_userbyid(relowner) INTO owner_name FROM pg_class WHERE oid = TG_RELID;
         IF NOT pg_has_role(session_user, owner_name, 'MEMBER') THEN
           IF NEW.kind NOT IN ({", ".join(f"'{k}'" for k in APP_ENTRY_KINDS)}) THEN
             RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = format(
               'role %s may not write a %s entry: only the ledger owner role %s may create scopes, change caps '
               'or import history', session_user, NEW.kind, owner_name);
           END IF;
           IF NEW.writer IS DISTINCT FROM session_user::text THEN
             RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = format(
               'role %s must record itself as the writer of a ledger entry (the entry says %s); only the ledger '
               'owner role %s may copy entries written by another role', session_user, NEW.writer, owner_name);
           END IF;
         END IF;
         IF (NEW.body::json ->> 'writer') IS DISTINCT FROM NEW.writer THEN
           RAISE EXCEPTION 'ledger entry %: its writer column (%) differs from the writer in its hashed body',
             NEW.id, NEW.writer;
         END IF;
         RETURN NEW;
       END; $$ LANGUAGE plpgsql""",
    "DROP TRIGGER IF EXISTS entries_writer ON entries",
    """CREATE TRIGGER entries_writer BEFORE INSERT ON entries
       FOR EACH ROW EXECUTE FUNCTION dpops_entries_writer()""",
    """CREATE OR REPLACE FUNCTION dpops_scopes_owner_only() RETURNS trigger AS $$
       DECLARE owner_name name;
       BEGIN
         SELECT pg_get_userbyid(relowner) INTO owner_name FROM pg_class WHERE oid = TG_RELID;
         IF NOT pg_has_role(session_user, owner_name, 'MEMBER') THEN
           RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = format(
             'role %s may not %s budget scopes: only the ledger owner role %s may create scopes or change caps',
             session_user, lower(TG_OP), owner_name);
         END IF;
         IF TG_OP = 'DELETE' THEN RETURN OLD; END IF;
         RETURN NEW;
       END; $$ LANGUAGE plpgsql""",
    "DROP TRIGGER IF EXISTS scopes_owner_only ON scopes",
    """CREATE TRIGGER scopes_owner_only BEFORE INSERT OR UPDATE OR DELETE ON scopes
       FOR EACH ROW EXECUTE FUNCTION dpops_scopes_owner_only()""",
    "DROP TRIGGER IF EXISTS scopes_owner_only_truncate ON scopes",
    """CREATE TRIGGER scopes_owner_only_truncate BEFORE TRUNCATE ON scopes
       FOR EACH STATEMENT EXECUTE FUNCTION dpops_scopes_owner_only()""",
]


def _v3(db: Backend) -> None:
    if db.dialect == "sqlite":
        # No roles (whoever can write the file is the owner): the column exists so exports and imports keep the
        # writer an entry had on a PostgreSQL ledger.
        if "writer" not in {r[1] for r in db.all("PRAGMA table_info(entries)")}:
            db.execute("ALTER TABLE entries ADD COLUMN writer TEXT")
        return
    for sql in _V3_POSTGRES:
        db.execute(sql.replace("%", "%%"))  # format('%s') in plpgsql: not a driver placeholder


MIGRATIONS = [(1, _v1), (2, _v2), (3, _v3)]
SCHEMA_VERSION = MIGRATIONS[-1][0]


def migrate(db: Backend) -> int:
    """Bring the schema to SCHEMA_VERSION; safe when many processes open the ledger at once."""
    current = _current_version(db)
    if current == SCHEMA_VERSION:
        # Up to date: no DDL at all, so an application role without CREATE rights can open the ledger.
        return SCHEMA_VERSION
    if current is not None and current > SCHEMA_VERSION:
        raise LedgerError(f"ledger {redact(db.url)} has schema version {current}, newer than this dpops "
                          f"({SCHEMA_VERSION}): upgrade dpops")
    try:
        return _migrate(db)
    except PermissionRefused:  # insufficient_privilege: an application role
        raise PermissionRefused(
            f"ledger {redact(db.url)} needs schema version {SCHEMA_VERSION} (it has {current or 0}) but role "
            f"{db.session_role()!r} may not change the schema: run `dpops ledger init` once as the ledger's owner role"
        ) from None


def _migrate(db: Backend) -> int:
    with db.transaction():
        if db.dialect == "postgresql":
            # One migrator per schema at a time; released at commit.
            db.execute("SELECT pg_advisory_xact_lock(hashtext(current_schema()))")
        db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, applied_at TEXT NOT NULL)")
        row = db.one("SELECT MAX(version) FROM schema_version")
        current = row[0] or 0 if row else 0
        if current > SCHEMA_VERSION:
            raise LedgerError(
                f"ledger {redact(db.url)} has schema version {current}, newer than this dpops ({SCHEMA_VERSION}): "
                "upgrade dpops"
            )
        for version, step in MIGRATIONS:
            if version > current:
                step(db)
                db.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, ?)", (version, utc_now()))
    return SCHEMA_VERSION


def _current_version(db: Backend) -> int | None:
    """The applied schema version, or None when the version table does not exist yet (read only)."""
    if db.dialect == "sqlite":
        exists = db.one("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'")
    else:
        exists = db.one("SELECT to_regclass('schema_version')")
        exists = exists if exists and exists[0] is not None else None
    if not exists:
        return None
    row = db.one("SELECT MAX(version) FROM schema_version")
    return int(row[0]) if row and row[0] is not None else None


def entry_hash(prev_hash: str, body_text: str) -> str:
    """hash = sha256(prev_hash || canonical body); the body holds the entry's id and timestamp."""
    import hashlib

    return hashlib.sha256((prev_hash + body_text).encode()).hexdigest()
