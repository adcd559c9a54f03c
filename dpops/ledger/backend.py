"""Database connections for the ledger: SQLite (embedded default) and PostgreSQL (psycopg 3).

Plain DB-API rather than an ORM so that every transaction boundary and lock is
explicit. SQL is written once with ``?`` placeholders; the PostgreSQL backend
rewrites them to ``%s``. Serialization of writers:

- SQLite: WAL journal, ``BEGIN IMMEDIATE`` takes the database write lock at the
  start of every write transaction; a busy timeout makes concurrent writers queue.
- PostgreSQL: READ COMMITTED transactions that lock the scope row (and its
  bucket rows, then the chain head) with ``SELECT ... FOR UPDATE``, always in that
  order so two writers can never deadlock.
"""

from __future__ import annotations

import os
import re
import sqlite3
import time
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from dpops.errors import LedgerError, PermissionRefused

DEFAULT_URL = "sqlite:///dpops-ledger.sqlite"
BUSY_TIMEOUT_S = 60.0
# PostgreSQL lock_timeout of every statement outside a write transaction (status, verify, history, the budget
# page): a session that holds a conflicting lock (issue 25 item 11: the app role took ACCESS EXCLUSIVE locks and
# hung the owner's status/verify and the page) makes a read fail after this long, with LedgerError naming the
# cause, instead of hanging. Write transactions wait up to BUSY_TIMEOUT_S, as SQLite's writers do. Read when a
# connection opens (tests lower it).
READ_LOCK_TIMEOUT_S = 10.0
_SCHEMA_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")

# Test hook: called with a point name inside write transactions (see set_test_hook).
_TEST_HOOK: Callable[[str], None] | None = None


def set_test_hook(fn: Callable[[str], None] | None) -> None:
    """Tests only: ``fn(point)`` runs inside the open transaction, e.g. to block and be SIGKILLed.

    The env var ``DPOPS_LEDGER_TEST_PAUSE=<point>:<seconds>`` does the same across a CLI process.
    """
    global _TEST_HOOK
    _TEST_HOOK = fn


def hook(point: str) -> None:
    """Fault-injection point inside a write transaction; a no-op unless a test set a hook or a pause."""
    if _TEST_HOOK is not None:
        _TEST_HOOK(point)
    pause = os.environ.get("DPOPS_LEDGER_TEST_PAUSE")
    if pause and pause.rsplit(":", 1)[0] == point:
        time.sleep(float(pause.rsplit(":", 1)[1]))


# libpq connection parameters that carry a secret (or point at one) and may be given in a URL's query string
# (postgresql://host/db?password=...): never shown, never stored in an artifact.
# The database's own cap check (``db_cap.py``, schema version 5) refuses with this SQLSTATE and message prefix;
# defined here, where driver errors are translated, so the translation needs no import of the check itself.
REFUSAL_SQLSTATE = "23514"  # check_violation: a reservation that violates the cap is a violated constraint
REFUSAL_PREFIX = "dpops cap check"


def refusal_from(exc: BaseException) -> str | None:
    """The database's cap-check refusal in a driver error's text, or None when ``exc`` is not one."""
    text = str(exc)
    if REFUSAL_PREFIX not in text:
        return None
    return text[text.index(REFUSAL_PREFIX):].strip().splitlines()[0]


CREDENTIAL_PARAMS = frozenset({"password", "passfile", "sslpassword", "sslkey"})


def redact(url: str, *, public: bool = False) -> str:
    """The URL with every credential hidden: the one redaction of ledger URLs (errors, logs, checkpoints, reports).

    The password in the authority and every credential-bearing query parameter (``CREDENTIAL_PARAMS``, the libpq
    query form ``?password=...``) become ``***`` in errors and logs, so the reader sees that one was given.
    ``public=True`` (artifacts other people read: signed checkpoints, the HTML report) drops them, and the user
    name, entirely. Privacy/security reason: checkpoints are 0644 files copied beside the manifests, and an
    error text travels into task logs and alerts; a database password in either hands the ledger to its readers.

    Robust to what a person types (issue 25 item 11: a password holding ``/``, ``?`` or ``#`` printed in full,
    because a URL parser ends the authority at the first of them): the user part is taken to end at the LAST
    ``@`` of the URL (a host never holds one), whatever it contains, and it is shown only as a plain user name
    plus ``:***``; anything that does not look like a plain user name is shown as ``***``. A URL that is really
    ambiguous is refused by ``connect`` (``check_authority``), so this over-hides rather than guesses.
    """
    if not isinstance(url, str):
        return "<unparseable URL>"
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "<unparseable URL>" if "@" in url or "password" in url.lower() else url
    userinfo, at, location = rest.rpartition("@")
    if not at:
        location = rest
    try:
        parts = urlsplit("//" + location)
    except ValueError:
        return f"{scheme}://<unparseable URL>"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if public:
            kept = [(k, v) for k, v in pairs if k.lower() not in CREDENTIAL_PARAMS]
        else:
            kept = [(k, "***" if k.lower() in CREDENTIAL_PARAMS else v) for k, v in pairs]
        query = urlencode(kept, safe="*/:")
    shown_user = ""
    if at and not public:
        user, colon, _ = userinfo.partition(":")
        plain = bool(re.fullmatch(r"[A-Za-z0-9._~%!$'()*+,;-]*", user))
        shown_user = (f"{user}{':***' if colon else ''}" if plain else "***") + "@"
    if scheme.lower() == "sqlite":  # no authority: sqlite:///relative or sqlite:////absolute
        base = url.split("?", 1)[0].split("#", 1)[0] if not at else f"{scheme}://{shown_user}{parts.netloc}{parts.path}"
        return base + (f"?{query}" if query else "")
    return f"{scheme}://{shown_user}{parts.netloc}{parts.path}" + (f"?{query}" if query else "")


def check_authority(url: str) -> None:
    """LedgerError unless a PostgreSQL URL's user part is unambiguous: one raw ``@``, and no raw ``/``, ``?``, ``#``
    or ``@`` inside the password.

    Why: a URL parser (Python's, and libpq's for ``/``) ends the authority at the first ``/``, ``?`` or ``#``, so
    ``postgresql://app:pa/ss@db/ledger`` would connect to host ``app`` and show the password as part of a path.
    Refusing it (with the fix: percent-encode them) is the only reading that never leaks or misroutes."""
    rest = url.partition("://")[2]
    cut = min([i for i in (rest.find(c) for c in "/?#") if i >= 0] or [len(rest)])
    if "@" in rest[cut:] or rest[:cut].count("@") > 1:
        raise LedgerError(
            f"ledger URL {redact(url)}: its user or password holds a '/', '?', '#' or '@' that is not percent-encoded "
            "(or an '@' appears after the host): write them as %2F, %3F, %23 and %40 "
            "(e.g. python -c 'import urllib.parse,sys; print(urllib.parse.quote(sys.argv[1], safe=\"\"))' PASSWORD)"
        )


class Cursor(Protocol):
    """What the ledger uses of a DB-API cursor (``sqlite3.Cursor`` and psycopg's ``Cursor`` both fit)."""

    @property
    def rowcount(self) -> int:
        """Rows changed by the statement: how ``ON CONFLICT DO NOTHING`` tells a win from a lost race."""

    def fetchone(self) -> Any:
        """The next row as a tuple, or None."""

    def fetchall(self) -> Sequence[Any]:
        """All remaining rows as tuples."""


class _PendingRefusal(Exception):
    """A privilege error raised inside a transaction; ``PostgresBackend.transaction`` turns it into
    ``PermissionRefused`` after the rollback, when the owner role can be looked up."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


class Backend:
    """One ledger database connection: the SQL dialect, explicit transactions and ``?`` placeholders.

    The ledger code above is written once against this class; the two subclasses differ only in
    how they lock (see the module docstring) and how they report conflicts as ``LedgerError``.
    """

    dialect: str
    url: str

    @abstractmethod
    def execute(self, sql: str, params: Sequence[Any] = ()) -> Cursor:
        """Run one statement with ``?`` placeholders; a write conflict is raised as ``LedgerError``."""

    @abstractmethod
    def close(self) -> None:
        """Close the connection; an open transaction is rolled back by the database."""

    @abstractmethod
    @contextmanager
    def transaction(self, write: bool = True) -> Iterator[None]:  # pragma: no cover
        """One transaction, committed on normal exit and rolled back on any exception.

        ``write=True`` takes the write lock at the start (no lock upgrade, so no deadlock);
        ``write=False`` reads one consistent snapshot.
        """
        yield

    def execute_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        """Run one statement once per row, in order (a bulk load, e.g. ``dpops ledger import``).

        The default runs them one by one; the backends override it with their driver's batch call so that
        thousands of rows do not cost thousands of round trips. Errors are reported as by ``execute``.
        """
        for params in rows:
            self.execute(sql, params)

    def one(self, sql: str, params: Sequence[Any] = ()) -> tuple | None:
        """The first row of a query, or None."""
        return self.execute(sql, params).fetchone()

    def row(self, sql: str, params: Sequence[Any] = ()) -> tuple:
        """The row of a query that always returns one (a function call, the chain head singleton).

        None there means a ledger without its schema (or a broken one): a LedgerError, not a TypeError later.
        """
        found = self.one(sql, params)
        if found is None:
            raise LedgerError(f"ledger {redact(self.url)}: no row from {sql!r}; is it initialised (dpops ledger init)?")
        return found

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        """Every row of a query."""
        return list(self.execute(sql, params).fetchall())

    @property
    def for_update(self) -> str:
        """Row-lock suffix for a ``SELECT`` inside a write transaction (empty where the whole DB is locked)."""
        return ""

    def session_role(self) -> str | None:
        """The database role this connection logged in as (PostgreSQL ``session_user``); None for SQLite.

        Every entry records it (``entries.writer``, schema version 3). SQLite has no roles: whoever can write
        the file is the ledger's owner, so there is nothing to record.
        """
        return None


class SqliteBackend(Backend):
    """The embedded default: one SQLite file in WAL mode, writers serialised by ``BEGIN IMMEDIATE``."""

    dialect = "sqlite"

    def __init__(self, url: str, path: str, synchronous: str = "full") -> None:
        self.url = url
        if path != ":memory:":
            parent = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(parent):
                raise LedgerError(f"ledger {redact(url)}: directory {parent} does not exist; create it first")
        try:
            # isolation_level=None: no implicit BEGIN; every transaction is opened explicitly below.
            self.conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
            self.conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            mode = self.conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            # FULL (default): a committed reservation survives power loss; NORMAL may lose the last transactions
            # on power loss (not on a process crash) and is offered only as an explicit opt-out for scratch ledgers.
            self.conn.execute(f"PRAGMA synchronous = {synchronous.upper()}")
        except sqlite3.DatabaseError as exc:
            raise LedgerError(f"cannot open SQLite ledger {redact(url)}: {exc}") from None
        if path != ":memory:" and str(mode).lower() != "wal":
            raise LedgerError(f"ledger {redact(url)}: could not switch to WAL journal mode (got {mode!r})")

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Cursor:
        """Run one statement; a constraint violation or a busy timeout becomes a retryable ``LedgerError``."""
        try:
            return self.conn.execute(sql, tuple(params))
        except sqlite3.IntegrityError as exc:
            raise LedgerError(f"ledger {redact(self.url)}: conflicting write ({exc}); retry") from None
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise LedgerError(f"ledger {redact(self.url)} is busy (another writer held it for "
                                  f"{BUSY_TIMEOUT_S:.0f}s); retry later") from None
            raise

    def execute_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        """``sqlite3``'s ``executemany``; a constraint violation becomes ``LedgerError`` as in ``execute``."""
        try:
            self.conn.executemany(sql, [tuple(r) for r in rows])
        except sqlite3.IntegrityError as exc:
            raise LedgerError(f"ledger {redact(self.url)}: conflicting write ({exc}); retry") from None

    @contextmanager
    def transaction(self, write: bool = True) -> Iterator[None]:
        """``BEGIN IMMEDIATE`` for writes, a deferred ``BEGIN`` (WAL snapshot) for reads."""
        # IMMEDIATE takes the write lock now, not at the first write: no lock upgrade, no deadlock.
        self.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
            yield
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def close(self) -> None:
        """Close the connection."""
        self.conn.close()


class PostgresBackend(Backend):
    """A shared PostgreSQL ledger: writers serialise on ``SELECT ... FOR UPDATE`` of the scope row."""

    dialect = "postgresql"

    def __init__(self, url: str, conninfo: str, schema: str | None) -> None:
        import psycopg  # optional dependency: only needed for PostgreSQL ledgers

        self._psycopg = psycopg
        self.url = url
        self._session_role: str | None = None
        try:
            # autocommit: transactions are opened with an explicit BEGIN, as for SQLite.
            self.conn = psycopg.connect(conninfo, autocommit=True)
        except psycopg.Error as exc:
            raise LedgerError(f"cannot connect to PostgreSQL ledger {redact(url)}: {str(exc).strip()}") from None
        if schema:
            try:
                # Only when missing: an application role has no CREATE right on the database.
                if self.conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)).fetchone() is None:
                    self.conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
            except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateSchema):
                pass  # created concurrently by another process
            self.conn.execute(f'SET search_path TO "{schema}"')
        self.conn.execute(f"SET lock_timeout = '{int(READ_LOCK_TIMEOUT_S * 1000)}ms'")

    @property
    def for_update(self) -> str:
        """PostgreSQL locks rows, so reads that decide a write lock them."""
        return " FOR UPDATE"

    def session_role(self) -> str | None:
        """``session_user`` (the login role; ``SET ROLE`` does not change it), read once per connection."""
        if self._session_role is None:
            self._session_role = str(self.row("SELECT session_user")[0])
        return self._session_role

    def _refused(self, exc: Exception) -> PermissionRefused:
        """A privilege error as ``PermissionRefused`` (exit 3) that names the ledger's owner role.

        The database refuses owner-only writes from any other role (privileges and the guard triggers of schema
        version 3, ``schema.py``); the trigger's message names the owner already, a bare "permission denied"
        does not, so the owner is looked up here (the connection is usable again: the transaction was rolled back
        or none was open).
        """
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        owner = None
        try:
            row = self.conn.execute(
                "SELECT tableowner FROM pg_tables WHERE schemaname = current_schema() AND tablename = 'entries'"
            ).fetchone()
            owner = row[0] if row else None
        except self._psycopg.Error:
            pass
        if owner and "owner role" in text:
            return PermissionRefused(f"ledger {redact(self.url)}: {text}; nothing was changed")
        try:
            row = self.conn.execute("SELECT has_table_privilege(current_user, to_regclass('entries'), 'INSERT')"
                                    ).fetchone()
        except self._psycopg.Error:
            row = None
        if row is not None and row[0] is False:  # a reader role (SELECT only, read-only transactions)
            return PermissionRefused(
                f"ledger {redact(self.url)}: {text}: connected as {self.session_role_or_unknown()!r}, which may only "
                "read the ledger (a reader role, such as the Privacy budget page's); releases connect as the "
                "application role, scope, cap and schema changes as the owner; nothing was changed")
        who = (f"the ledger owner role {owner!r}" if owner
               else "the ledger owner role (the one that ran `dpops ledger init`)")
        return PermissionRefused(
            f"ledger {redact(self.url)}: {text}: connected as {self.session_role_or_unknown()!r}, but only {who} may "
            "create scopes, change caps, import history or change the schema; connect as the owner and run the "
            "command again; nothing was changed"
        )

    def session_role_or_unknown(self) -> str:
        """``session_role()`` for a message (never raises)."""
        try:
            return self.session_role() or "?"
        except Exception:  # noqa: BLE001 - a message must not fail
            return "?"

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Cursor:
        """Run one statement (``?`` rewritten to ``%s``); conflicts and lost connections become ``LedgerError``."""
        try:
            return self.conn.execute(sql.replace("?", "%s"), tuple(params))
        except (self._psycopg.errors.InsufficientPrivilege, self._psycopg.errors.ReadOnlySqlTransaction) as exc:
            raise self._privilege_error(exc) from None
        except self._psycopg.errors.LockNotAvailable as exc:
            raise self._lock_timeout(exc) from None
        except self._psycopg.errors.CheckViolation as exc:
            raise self._check_refusal(exc) from None
        except self._psycopg.IntegrityError as exc:
            # e.g. the same run key reserved at the same moment on two different scopes
            raise LedgerError(f"ledger {redact(self.url)}: conflicting concurrent write ({str(exc).strip()}); "
                              "retry") from None
        except self._psycopg.OperationalError as exc:
            raise LedgerError(f"PostgreSQL ledger {redact(self.url)} failed: {str(exc).strip()}") from None

    def execute_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        """psycopg's ``executemany`` (pipelined: one round trip per batch, not per row)."""
        try:
            with self.conn.cursor() as cur:
                cur.executemany(sql.replace("?", "%s"), [tuple(r) for r in rows])
        except (self._psycopg.errors.InsufficientPrivilege, self._psycopg.errors.ReadOnlySqlTransaction) as exc:
            raise self._privilege_error(exc) from None
        except self._psycopg.errors.LockNotAvailable as exc:
            raise self._lock_timeout(exc) from None
        except self._psycopg.IntegrityError as exc:
            raise LedgerError(f"ledger {redact(self.url)}: conflicting concurrent write ({str(exc).strip()}); "
                              "retry") from None
        except self._psycopg.OperationalError as exc:
            raise LedgerError(f"PostgreSQL ledger {redact(self.url)} failed: {str(exc).strip()}") from None

    def _check_refusal(self, exc: Exception) -> LedgerError:
        """The database's own cap check refused a reservation (schema version 5, ``db_cap.py``).

        dpops checks the cap before it writes, with the same rule, so this means the two disagree: most likely the
        database server runs another dpops version than this process, or the cap check is not installed."""
        reason = refusal_from(exc) or str(exc).strip().splitlines()[0]
        return LedgerError(
            f"ledger {redact(self.url)}: {reason}. dpops' own check had admitted it, so the database and this "
            "process disagree (a different dpops on the database server, or its cap check is not installed: "
            "`dpops ledger install-cap-check`); nothing was charged"
        )

    def _lock_timeout(self, exc: Exception) -> LedgerError:
        """A lock wait that hit ``lock_timeout``: say who to look for, never hang (the statement was cancelled)."""
        return LedgerError(
            f"ledger {redact(self.url)}: another database session holds a lock this statement needs and did not "
            f"release it within the lock timeout ({str(exc).strip().splitlines()[0]}); nothing was changed. Find it "
            "with SELECT pid, usename, state, query FROM pg_stat_activity WHERE pid = ANY(pg_blocking_pids(<pid>)) "
            "and end it (pg_terminate_backend), then retry"
        )

    @contextmanager
    def transaction(self, write: bool = True) -> Iterator[None]:
        """READ COMMITTED for writes (rows are locked explicitly); a read-only REPEATABLE READ snapshot for reads.

        Writes may wait BUSY_TIMEOUT_S for a lock (another writer of the scope), reads READ_LOCK_TIMEOUT_S."""
        # Named, not the session default: a role may set its own default_transaction_isolation (and a server may
        # default to REPEATABLE READ), and a write transaction in a snapshot composes the cap check from the
        # history as of its first statement, not as of the scope row lock it takes (two reservations would then
        # each see the other's budget as free; the database's own check refuses to run outside READ COMMITTED).
        self.execute("BEGIN ISOLATION LEVEL READ COMMITTED" if write else
                     "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        if write:
            self.execute(f"SET LOCAL lock_timeout = '{int(BUSY_TIMEOUT_S * 1000)}ms'")
        try:
            yield
        except _PendingRefusal as pending:
            if not self.conn.closed:
                self.conn.execute("ROLLBACK")
            raise self._refused(pending.cause) from None
        except BaseException:
            if not self.conn.closed:
                self.conn.execute("ROLLBACK")
            raise
        self.execute("COMMIT")

    def _privilege_error(self, exc: Exception) -> Exception:
        """Inside a transaction the owner can only be looked up after the rollback (``transaction`` does it)."""
        from psycopg.pq import TransactionStatus

        if self.conn.info.transaction_status == TransactionStatus.IDLE:
            return self._refused(exc)
        return _PendingRefusal(exc)

    def close(self) -> None:
        """Close the connection."""
        self.conn.close()


class OpenLedger(Protocol):
    """What the ledger's own tools need of an open ``dpops.ledger.Ledger``: its URL, its connection and a read
    snapshot.

    ``checkpoint.py``, ``roles.py`` and ``verify.py`` take this instead of ``Ledger`` itself, so they do not
    import the module that calls them (``store.py`` signs checkpoints after commits, checks roles and verifies
    through them): the ledger package's import graph has no circle.
    """

    @property
    def url(self) -> str:
        """The ledger's URL (credentials are redacted wherever it is shown)."""

    @property
    def db(self) -> Backend:
        """The open connection."""

    def snapshot(self) -> AbstractContextManager[Backend]:
        """One consistent read transaction."""


def connect(url: str | None) -> Backend:
    """Parse a ledger URL and connect. Nothing is written here."""
    if url is None:
        url = os.environ.get("DPOPS_LEDGER_URL") or DEFAULT_URL
    if not isinstance(url, str) or "://" not in url:
        shown = redact(url) if isinstance(url, str) else repr(url)
        raise LedgerError(
            f"malformed ledger URL {shown}: expected sqlite:///relative/path.sqlite, sqlite:////absolute/path.sqlite "
            "or postgresql://user@host:port/database"
        )
    scheme = url.split("://", 1)[0].lower()
    if scheme == "sqlite":
        path = url[len("sqlite:///"):] if url.lower().startswith("sqlite:///") else ""
        path, _, query = path.partition("?")
        options = dict(parse_qsl(query))
        synchronous = options.pop("synchronous", "full").lower()
        if options or synchronous not in ("full", "normal"):
            raise LedgerError(f"ledger URL {redact(url)}: the only SQLite option is synchronous=full|normal")
        if not path:
            raise LedgerError(f"malformed ledger URL {redact(url)}: give a file, e.g. sqlite:///dpops-ledger.sqlite "
                              "(relative) or sqlite:////var/lib/dpops/ledger.sqlite (absolute)")
        return SqliteBackend(url, path, synchronous)
    if scheme in ("postgresql", "postgres", "postgresql+psycopg"):
        conninfo, schema = postgres_target(url)
        return PostgresBackend(url, conninfo, schema)
    raise LedgerError(f"unsupported ledger URL scheme {scheme!r} in {redact(url)}: use sqlite:/// or postgresql://")


def postgres_target(url: str) -> tuple[str, str | None]:
    """(libpq conninfo, schema or None) of a PostgreSQL ledger URL; LedgerError when malformed."""
    if url.split("://", 1)[0].lower() not in ("postgresql", "postgres", "postgresql+psycopg"):
        raise LedgerError(f"{redact(url)} is not a PostgreSQL ledger URL (postgresql://user@host:port/database)")
    check_authority(url)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise LedgerError(f"malformed ledger URL {redact(url)}: {exc}") from None
    if not parts.hostname and not parts.path.strip("/"):
        raise LedgerError(f"malformed ledger URL {redact(url)}: expected postgresql://user@host:port/database")
    pg_options = dict(parse_qsl(parts.query))
    schema = pg_options.pop("schema", None)  # dpops extension: keep the ledger in its own PostgreSQL schema
    if schema is not None and not _SCHEMA_RE.match(schema):
        raise LedgerError(f"ledger URL: schema must be a lower-case SQL identifier, got {schema!r}")
    pg_options.setdefault("connect_timeout", "5")
    conninfo = urlunsplit(parts._replace(scheme="postgresql", query=urlencode(pg_options)))
    return conninfo, schema
