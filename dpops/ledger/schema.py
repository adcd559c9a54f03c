"""Versioned schema migrations of the ledger database.

``entries`` is the append-only, hash-chained record of everything (the truth).
``chain_head`` holds the id and hash of the last entry: one row that every writer
locks last, so entry ids are gap-free and in commit order, and truncating the
tail of the chain is detected by ``verify`` (as long as ``chain_head`` itself is
not reset). ``scopes`` and ``runs`` are caches derived from the entries in the same
transaction (``runs`` by the database itself on PostgreSQL, version 4; the running-state
cache ``buckets`` of versions 1-3 is dropped); ``verify`` recomputes them.

What the database guards do, and what they do not (docs/threat-model.md):

- Triggers refuse UPDATE, DELETE and (PostgreSQL, migration 2) TRUNCATE on
  ``entries``, and let ``chain_head`` only move forward by one to an entry that
  exists. They stop mistakes and an *application* role (``dpops ledger init
  --app-role``), which has no right to drop or disable them. Version 4 derives
  ``runs`` from each inserted entry and refuses an illegal state-machine step.
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
from dpops.ledger import db_cap
from dpops.ledger.backend import REFUSAL_PREFIX, REFUSAL_SQLSTATE, Backend, redact
from dpops.ledger.model import TRANSITIONS, utc_now

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


# --- version 4: the database derives the run cache; nothing the cap check reads is writable by the app role --------
# Why (issue 25 item 8): ``reserve`` composed the cap check from the ``buckets`` (running accountant states) and
# ``runs`` caches, which the application role could UPDATE; resetting the bucket cache let it commit epsilon 2.4 on
# a cap of 1 while ``ledger status`` and the budget page showed 0. Decision (docs/threat-model.md, "What the cap
# check reads"):
# - ``buckets`` is dropped. A running accountant state cannot be maintained by the database (PLD, RDP curves are
#   composed in Python), and a cache the app role writes cannot be trusted, so the cap check composes the events
#   of the scope's charged runs on every reservation (``Ledger._charged``).
# - ``runs`` becomes owner-maintained on PostgreSQL: the SECURITY DEFINER trigger function below, owned by the
#   owner role that runs this migration, derives each row from the hashed body of the entry just inserted
#   (reserved -> a new row; started, committed, spent_unpublished, released -> the state machine step). It refuses
#   what ``verify`` would flag in a hand-written entry: columns that differ from the hashed body, a transition the
#   state machine does not allow, a step naming other scope/buckets than the reservation, a reservation on an
#   unknown scope or with another accountant, a second publication of an interval that does not restate the first.
#   Every INSERT/UPDATE/DELETE/TRUNCATE privilege on ``runs`` is revoked from every other role here (not only by
#   ``init --app-role``), so a ledger migrated without re-granting is closed too.
# - What it cannot do: compose privacy events (the accountants are Python). A reservation written by hand with raw
#   SQL is therefore not compared with the cap by the database; it is recorded (append-only, hash-chained), counted
#   by ``ledger status``, the budget page and every later reservation (they compose from these rows), and flagged
#   by ``verify`` ("reserved over the cap"). The role that runs releases holds the data anyway; what it must never
#   do is make the ledger show less than it charged, or make dpops' own check admit more than the cap.
# - SQLite has no roles (whoever can write the file owns the ledger): ``store.py`` keeps writing ``runs`` itself.
_RUN_STEPS = ", ".join(f"('{a}', '{b}')" for a, b in sorted(TRANSITIONS))  # the one state machine (model.py)

# ``run_charges``: the settled runs of each scope grouped by (state, buckets, events) with their count,
# maintained by the same owner trigger when a run becomes committed or spent_unpublished (a terminal state), so the
# cap check reads a few rows instead of grouping the scope's whole history (reserve p50 at 10,000 entries: see
# docs/threat-model.md). The app role may only SELECT it. ``digest`` is sha256 (a collision chosen by whoever writes
# entries would merge its run into another event list's count), over text the trigger itself wrote. SQLite (no
# roles): the same table, kept by triggers on ``runs`` (which store.py writes), keyed by the text itself.
_V4_CHARGES_TABLE = """CREATE TABLE IF NOT EXISTS run_charges (
        scope TEXT NOT NULL,
        state TEXT NOT NULL,
        digest TEXT NOT NULL,
        buckets TEXT NOT NULL,
        events TEXT NOT NULL,
        runs BIGINT NOT NULL,
        PRIMARY KEY (scope, state, digest))"""

_V4_SQLITE = [
    "DROP TABLE IF EXISTS buckets",
    _V4_CHARGES_TABLE,
    """INSERT INTO run_charges (scope, state, digest, buckets, events, runs)
       SELECT scope, state, buckets || '|' || events, buckets, events, COUNT(*) FROM runs
       WHERE state IN ('committed', 'spent_unpublished') GROUP BY scope, state, buckets, events""",
    """CREATE TRIGGER IF NOT EXISTS runs_charges_settle AFTER UPDATE OF state ON runs
       WHEN NEW.state IN ('committed', 'spent_unpublished') AND OLD.state IS NOT NEW.state
       BEGIN
         INSERT INTO run_charges (scope, state, digest, buckets, events, runs)
         VALUES (NEW.scope, NEW.state, NEW.buckets || '|' || NEW.events, NEW.buckets, NEW.events, 1)
         ON CONFLICT (scope, state, digest) DO UPDATE SET runs = runs + 1;
       END""",
    # dpops ledger import inserts runs already settled
    """CREATE TRIGGER IF NOT EXISTS runs_charges_insert AFTER INSERT ON runs
       WHEN NEW.state IN ('committed', 'spent_unpublished')
       BEGIN
         INSERT INTO run_charges (scope, state, digest, buckets, events, runs)
         VALUES (NEW.scope, NEW.state, NEW.buckets || '|' || NEW.events, NEW.buckets, NEW.events, 1)
         ON CONFLICT (scope, state, digest) DO UPDATE SET runs = runs + 1;
       END""",
]
_CHARGE_DIGEST = "encode(sha256(convert_to({b} || '|' || {e}, 'UTF8')), 'hex')"

_V4_POSTGRES = [
    "DROP TABLE IF EXISTS buckets",
    _V4_CHARGES_TABLE,
    "DELETE FROM run_charges",
    f"""INSERT INTO run_charges (scope, state, digest, buckets, events, runs)
        SELECT scope, state, {_CHARGE_DIGEST.format(b="buckets", e="events")}, buckets, events, COUNT(*) FROM runs
        WHERE state IN ('committed', 'spent_unpublished') GROUP BY scope, state, buckets, events""",
    """CREATE OR REPLACE FUNCTION dpops_entries_derive_runs() RETURNS trigger
       LANGUAGE plpgsql SECURITY DEFINER SET search_path = {schema}, pg_temp AS $$
       DECLARE
         b jsonb := NEW.body::jsonb;
         d jsonb := (NEW.body::jsonb) -> 'data';
         r runs%ROWTYPE;
         acct text;
         published text;
       BEGIN
         IF (b ->> 'id')::bigint IS DISTINCT FROM NEW.id OR b ->> 'ts' IS DISTINCT FROM NEW.ts
            OR b ->> 'kind' IS DISTINCT FROM NEW.kind OR b ->> 'scope' IS DISTINCT FROM NEW.scope
            OR b ->> 'run_id' IS DISTINCT FROM NEW.run_id OR (b -> 'buckets') IS DISTINCT FROM NEW.buckets::jsonb
            OR b ->> 'actor' IS DISTINCT FROM NEW.actor THEN
           RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = format(
             'ledger entry %s: its columns differ from its hashed body; entries are written by dpops', NEW.id);
         END IF;
         IF NEW.kind = 'reserved' THEN
           SELECT accountant INTO acct FROM scopes WHERE name = NEW.scope;
           IF acct IS NULL OR d ->> 'accountant' IS DISTINCT FROM acct OR NEW.run_id IS NULL
              OR jsonb_typeof(d -> 'events') IS DISTINCT FROM 'array'
              OR jsonb_typeof(d -> 'run_key') IS DISTINCT FROM 'object' THEN
             RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = format(
               'ledger entry %s: a reservation must name an existing scope, its accountant, a run key and events',
               NEW.id);
           END IF;
           INSERT INTO runs (run_id, scope, release, interval_start, interval_end, run_key, state, events, buckets,
                             restates, output_uri, details, entry_ids, entry_hashes, created_at, updated_at, epsilon,
                             last_entry)
           VALUES (NEW.run_id, NEW.scope, d -> 'run_key' ->> 'release',
                   COALESCE(d ->> 'interval_start', d -> 'run_key' ->> 'interval_start'),
                   COALESCE(d ->> 'interval_end', d -> 'run_key' ->> 'interval_end'),
                   (d -> 'run_key')::text, 'reserved', (d -> 'events')::text, NEW.buckets, d ->> 'restates', NULL,
                   COALESCE(d -> 'details', '{{}}'::jsonb)::text, jsonb_build_array(NEW.id)::text,
                   jsonb_build_array(NEW.hash)::text, NEW.ts, NEW.ts, (d ->> 'epsilon')::double precision, NEW.id);
         ELSIF NEW.kind IN ('started', 'committed', 'spent_unpublished', 'released') THEN
           SELECT * INTO r FROM runs WHERE run_id = NEW.run_id FOR UPDATE;
           IF NOT FOUND OR (r.state, NEW.kind) NOT IN ({steps}) THEN
             RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = format(
               'ledger entry %s: run %s cannot become %s from %s', NEW.id, NEW.run_id, NEW.kind,
               COALESCE(r.state, 'unreserved'));
           END IF;
           IF r.scope IS DISTINCT FROM NEW.scope OR r.buckets::jsonb IS DISTINCT FROM NEW.buckets::jsonb THEN
             RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = format(
               'ledger entry %s: run %s %s names other scope/buckets than its reservation', NEW.id, NEW.run_id,
               NEW.kind);
           END IF;
           IF NEW.kind = 'committed' THEN
             SELECT run_id INTO published FROM runs WHERE release = r.release AND interval_start = r.interval_start
               AND interval_end = r.interval_end AND state = 'committed' ORDER BY last_entry DESC LIMIT 1;
             IF d ->> 'output_uri' IS NULL OR (published IS NOT NULL AND published IS DISTINCT FROM r.restates) THEN
               RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = format(
                 'ledger entry %s: run %s may not be committed (no output, or its interval is published as run %s '
                 'and it does not restate that)', NEW.id, NEW.run_id, published);
             END IF;
           END IF;
           UPDATE runs SET state = NEW.kind,
             output_uri = CASE WHEN NEW.kind = 'committed' THEN d ->> 'output_uri' ELSE output_uri END,
             details = CASE WHEN NEW.kind = 'committed' AND COALESCE(d -> 'details', '{{}}'::jsonb) <> '{{}}'::jsonb
                            THEN (details::jsonb || jsonb_build_object('commit', d -> 'details'))::text
                            ELSE details END,
             entry_ids = (entry_ids::jsonb || to_jsonb(NEW.id))::text,
             entry_hashes = (entry_hashes::jsonb || to_jsonb(NEW.hash))::text,
             updated_at = NEW.ts, last_entry = NEW.id
           WHERE run_id = NEW.run_id;
           IF NEW.kind IN ('committed', 'spent_unpublished') THEN
             INSERT INTO run_charges (scope, state, digest, buckets, events, runs)
             VALUES (r.scope, NEW.kind, {digest}, r.buckets, r.events, 1)
             ON CONFLICT (scope, state, digest) DO UPDATE SET runs = run_charges.runs + 1;
           END IF;
         END IF;
         RETURN NULL;
       END; $$""",
    "REVOKE ALL ON FUNCTION dpops_entries_derive_runs() FROM PUBLIC",
    "DROP TRIGGER IF EXISTS entries_derive_runs ON entries",
    """CREATE TRIGGER entries_derive_runs AFTER INSERT ON entries
       FOR EACH ROW EXECUTE FUNCTION dpops_entries_derive_runs()""",
    "REVOKE ALL ON run_charges FROM PUBLIC",
    # Whoever may read the run cache may read its grouped charges (an app or reader role granted before v4).
    """DO $$ DECLARE g record; BEGIN
         FOR g IN SELECT DISTINCT grantee FROM information_schema.role_table_grants
                  WHERE table_schema = current_schema() AND table_name = 'runs' AND privilege_type = 'SELECT'
                    AND grantee <> (SELECT tableowner FROM pg_tables WHERE schemaname = current_schema()
                                    AND tablename = 'runs') LOOP
           EXECUTE format('GRANT SELECT ON run_charges TO %I', g.grantee);
         END LOOP;
       END $$""",
    # Whoever was granted writes on the run cache before (the app role: INSERT, UPDATE) loses them now.
    """DO $$ DECLARE g record; BEGIN
         FOR g IN SELECT DISTINCT grantee FROM information_schema.role_table_grants
                  WHERE table_schema = current_schema() AND table_name = 'runs'
                    AND privilege_type IN ('INSERT', 'UPDATE', 'DELETE', 'TRUNCATE')
                    AND grantee <> (SELECT tableowner FROM pg_tables WHERE schemaname = current_schema()
                                    AND tablename = 'runs') LOOP
           EXECUTE format('REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON runs FROM %I', g.grantee);
         END LOOP;
         REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON runs FROM PUBLIC;
       END $$""",
]


def _v4(db: Backend) -> None:
    if db.dialect == "sqlite":
        for sql in _V4_SQLITE:
            db.execute(sql)
        return
    schema = str(db.row("SELECT quote_ident(current_schema())")[0])
    for sql in _V4_POSTGRES:
        if "{schema}" in sql:
            sql = sql.format(schema=schema, steps=_RUN_STEPS, digest=_CHARGE_DIGEST.format(b="r.buckets", e="r.events"))
        db.execute(sql.replace("%", "%%"))


# --- version 5: the database refuses a reservation over the cap, whoever writes it (issue 25 item 8) ---------------
# Why: version 4 left the cap check in the client, so the app role could INSERT an over-cap reservation by hand
# (recorded and flagged by ``verify``, not refused). Decision (``db_cap.py``, docs/threat-model.md): a
# superuser-installed PL/Python function runs dpops' own cap rule (``cap.check_cap``) inside the database; this
# owner-owned SECURITY DEFINER trigger calls it before every reservation entry a non-owner session inserts, and
# refuses every such reservation while the function is missing (a database that cannot check the cap admits no
# app-role reservation). Owner sessions are not checked here: the owner can drop triggers anyway, and
# ``dpops ledger import`` copies verified history verbatim. SQLite has no roles: dpops checks, as before.
_V5_POSTGRES = [
    f"""CREATE OR REPLACE FUNCTION dpops_entries_cap_guard() RETURNS trigger
       LANGUAGE plpgsql SECURITY DEFINER SET search_path = {{schema}}, pg_temp AS $$
       DECLARE owner_name name;
       BEGIN
         SELECT pg_get_userbyid(relowner) INTO owner_name FROM pg_class WHERE oid = TG_RELID;
         IF pg_has_role(session_user, owner_name, 'MEMBER') THEN
           RETURN NEW;
         END IF;
         IF to_regprocedure(quote_ident(TG_TABLE_SCHEMA) || '.{db_cap.SIGNATURE}') IS NULL THEN
           RAISE EXCEPTION USING ERRCODE = '{REFUSAL_SQLSTATE}', MESSAGE = format(
             '{REFUSAL_PREFIX}: ledger entry %s refused by the database: it cannot check reservations '
             'against the cap because {db_cap.FUNCTION} is not installed in schema %s; a superuser must run '
             '`dpops ledger install-cap-check --owner-role %s` (deploy/ledger-db-init.sh does)',
             NEW.id, TG_TABLE_SCHEMA, owner_name);
         END IF;
         PERFORM {db_cap.FUNCTION}(NEW.body, NEW.buckets);
         RETURN NEW;
       END; $$""",
    "REVOKE ALL ON FUNCTION dpops_entries_cap_guard() FROM PUBLIC",
    "DROP TRIGGER IF EXISTS entries_cap_guard ON entries",
    """CREATE TRIGGER entries_cap_guard BEFORE INSERT ON entries
       FOR EACH ROW WHEN (NEW.kind = 'reserved') EXECUTE FUNCTION dpops_entries_cap_guard()""",
]


def _v5(db: Backend) -> None:
    if db.dialect == "sqlite":
        return
    schema = str(db.row("SELECT quote_ident(current_schema())")[0])
    for sql in _V5_POSTGRES:
        db.execute(sql.replace("{schema}", schema).replace("%", "%%"))


# --- version 6: every guard function resolves names in the ledger's schema and the catalog only (review 5) ----------
# Why: the guards of versions 1-3 (``dpops_entries_writer``, ``dpops_scopes_owner_only``,
# ``dpops_chain_head_forward_only``, ``dpops_entries_append_only``) ran with the inserting SESSION's search_path, and
# PostgreSQL searches a session's temporary schema first, even before pg_catalog, for tables. So the app role (which
# holds TEMP on a database where PUBLIC keeps its default rights, e.g. one set up by `dpops ledger init --app-role`)
# could ``CREATE TEMP TABLE pg_class (oid oid, relowner oid)`` naming itself the owner of ``entries``: the writer
# guard then took it for the owner and let it append a hash-chained ``cap_changed`` entry raising the cap, with
# ``writer`` forged as the owner. The database's cap check (``scopes``) did not move, but ``ledger verify`` blamed
# the scopes table, and ``ledger export`` + ``import`` (the documented move to another database) rebuilt the scope
# with the forged cap and verified OK. A temporary ``entries`` table likewise let it move the chain head onto an
# entry that does not exist. Decision: every trigger function is pinned to ``pg_catalog, <schema>, pg_temp``
# (pg_temp last: a temporary object can never shadow a catalog or ledger table), as versions 4 and 5 already were;
# ``tests/test_ledger_search_path.py`` holds every function of the ledger's schema to it.
_V6_PINNED = ("dpops_entries_append_only", "dpops_chain_head_forward_only", "dpops_entries_writer",
              "dpops_scopes_owner_only", "dpops_entries_derive_runs", "dpops_entries_cap_guard")


def _v6(db: Backend) -> None:
    if db.dialect == "sqlite":
        return
    schema = str(db.row("SELECT quote_ident(current_schema())")[0])
    for name in _V6_PINNED:
        db.execute(f"ALTER FUNCTION {schema}.{name}() SET search_path = pg_catalog, {schema}, pg_temp")


MIGRATIONS = [(1, _v1), (2, _v2), (3, _v3), (4, _v4), (5, _v5), (6, _v6)]
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
