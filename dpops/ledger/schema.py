"""Versioned schema migrations of the ledger database.

``entries`` is the append-only, hash-chained record of everything (the truth).
``chain_head`` holds the id and hash of the last entry: one row that every writer
locks last, so entry ids are gap-free and in commit order, and truncating the
tail of the chain is detected by ``verify``. ``scopes``, ``buckets`` and ``runs``
are caches derived from the entries in the same transaction; ``verify``
recomputes them. Triggers refuse UPDATE and DELETE on ``entries`` so that only a
deliberate act (dropping the trigger) can alter history, and ``verify`` catches it.

Append a new migration to MIGRATIONS; never edit an applied one.
"""

from __future__ import annotations

from dpops.errors import LedgerError
from dpops.ledger.backend import Backend
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


MIGRATIONS = [(1, _v1)]
SCHEMA_VERSION = MIGRATIONS[-1][0]


def migrate(db: Backend) -> int:
    """Bring the schema to SCHEMA_VERSION; safe when many processes open the ledger at once."""
    with db.transaction():
        if db.dialect == "postgresql":
            # One migrator per schema at a time; released at commit.
            db.execute("SELECT pg_advisory_xact_lock(hashtext(current_schema()))")
        db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, applied_at TEXT NOT NULL)")
        row = db.one("SELECT MAX(version) FROM schema_version")
        current = row[0] or 0 if row else 0
        if current > SCHEMA_VERSION:
            raise LedgerError(
                f"ledger {db.url} has schema version {current}, newer than this dpops ({SCHEMA_VERSION}): upgrade dpops"
            )
        for version, step in MIGRATIONS:
            if version > current:
                step(db)
                db.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, ?)", (version, utc_now()))
    return SCHEMA_VERSION


def entry_hash(prev_hash: str, body_text: str) -> str:
    """hash = sha256(prev_hash || canonical body); the body holds the entry's id and timestamp."""
    import hashlib

    return hashlib.sha256((prev_hash + body_text).encode()).hexdigest()
