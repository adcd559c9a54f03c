"""The cap enforced by the database itself (PostgreSQL): a reservation the app role writes around dpops is refused.

Why (issue 25 item 8, last part): since schema version 4 nothing the cap check reads is writable by the application
role, but the check ran in the client. A task or operator holding the app role's credentials could INSERT a
reservation entry with a correct hash chain by hand and exceed the cap; the ledger recorded it and ``verify``
flagged it afterwards, but nothing refused it. The accountants (PLD, RDP) are Python and cannot be written as SQL
without a second implementation of every one of them (two rules that could disagree). So the database runs the
same Python:

- ``dpops_cap_check(body, buckets)`` is a PL/Python (``plpython3u``) function, created by a **superuser**
  (``dpops ledger install-cap-check``; only superusers may create functions in an untrusted language, so neither
  the app role nor the ledger owner can replace its body). It imports this module from the site directories named
  when it was installed and calls ``check_in_database``, which runs ``dpops.ledger.cap.check_cap``: the very
  function ``Ledger.reserve`` calls, over the same tables (``runs``, ``run_charges``: derived by the owner's
  trigger, never writable by the app role) under the same scope-row lock. One rule, two callers.
- The owner's trigger ``entries_cap_guard`` (schema version 5, ``schema.py``) calls it before every reservation
  entry inserted by a session that is not the owner. If the function is missing (a superuser has not installed
  it), such reservations are refused outright: a database that cannot check the cap admits no app-role
  reservation. ``dpops ledger init --app-role`` refuses to grant an app role on such a database, naming the fix.
- Owner sessions are not checked by the database: the owner can drop triggers anyway (only signed checkpoints
  held outside the database catch what it rewrites), ``dpops ledger import`` copies verified history verbatim,
  and a single-role deployment's reservations are checked by dpops as on SQLite.

Besides the cap, the database checks what the cap check depends on and a hand-written entry could forge: the
reservation's buckets are the scope's buckets of its run key's interval (a forged bucket label would charge an
empty bucket), the interval recorded beside the key is the key's, the accountant is the scope's, and the epsilon
recorded for the run (what run tables and reports show) is the composition of its own events.

Refusals carry SQLSTATE 23514 (check_violation) and a message starting ``dpops cap check``; ``dpops`` turns one
into ``LedgerError`` (it checked first, so a database refusal means the two disagree, e.g. different dpops
versions on the database server and in the tasks).

Trust: the site directories are read by the database server's OS user. They must be writable only by whoever
administers the database (deploy/: the ledger database image installs dpops under /opt/dpops-ledger).
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from dpops.errors import DpopsError, LedgerError
from dpops.ledger.backend import REFUSAL_PREFIX, REFUSAL_SQLSTATE, Backend, Cursor

CHECK_ID = "dpops.db-cap-check/1"
FUNCTION = "dpops_cap_check"
SIGNATURE = f"{FUNCTION}(text, text)"
_IDENT_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class Plpy(Protocol):
    """What this module uses of PL/Python's ``plpy`` module."""

    def prepare(self, query: str, argtypes: list[str]) -> Any:
        """A prepared plan."""

    def execute(self, plan: Any, args: list[Any]) -> Any:
        """Rows of a plan (a result with ``colnames()``)."""


class _Rows:
    """A DB-API-like cursor over a PL/Python result (what ``Backend.one``/``all`` read)."""

    def __init__(self, rows: list[tuple]) -> None:
        self._rows = rows
        self._pos = 0

    @property
    def rowcount(self) -> int:
        return len(self._rows)

    def fetchone(self) -> Any:
        if self._pos >= len(self._rows):
            return None
        self._pos += 1
        return self._rows[self._pos - 1]

    def fetchall(self) -> Sequence[Any]:
        rest, self._pos = self._rows[self._pos:], len(self._rows)
        return rest


class PlpyBackend(Backend):
    """The ledger's ``Backend`` over the database session a PL/Python trigger runs in (read-only use).

    Every parameter of the queries the cap check runs is text (scope names, states); values are bound, never
    interpolated. The transaction is the inserting statement's: the check sees exactly what the insert will.
    """

    dialect = "postgresql"
    url = "postgresql:///(this database)"

    def __init__(self, plpy: Plpy) -> None:
        self._plpy = plpy
        self._plans: dict[tuple[str, int], Any] = {}

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Cursor:
        """Run one ``?``-placeholder query through a cached ``plpy`` plan (every parameter bound as text)."""
        key = (sql, len(params))
        plan = self._plans.get(key)
        if plan is None:
            parts = sql.split("?")
            if len(parts) - 1 != len(params):
                raise LedgerError(f"{REFUSAL_PREFIX}: {len(params)} parameters for {len(parts) - 1} placeholders")
            text = parts[0] + "".join(f"${i}{p}" for i, p in enumerate(parts[1:], start=1))
            plan = self._plpy.prepare(text, ["text"] * len(params))
            self._plans[key] = plan
        result = self._plpy.execute(plan, [None if p is None else str(p) for p in params])
        cols = result.colnames() if len(result) else []
        return _Rows([tuple(r[c] for c in cols) for r in result])

    def close(self) -> None:
        """Nothing to close: the session belongs to the server."""

    @contextmanager
    def transaction(self, write: bool = True) -> Iterator[None]:
        """The trigger runs inside the inserting statement's transaction; nothing to open."""
        yield

    @property
    def for_update(self) -> str:
        """Lock the scope row as ``Ledger.reserve`` does."""
        return " FOR UPDATE"


def check_entry(db: Backend, body_text: str, buckets_text: str) -> None:
    """Raise DpopsError unless the reservation entry ``body_text`` (with its ``buckets`` column) fits the cap.

    Runs inside the database (``check_in_database``); also callable on any Backend (tests). The scope row is
    locked first (``FOR UPDATE``), as ``Ledger.reserve`` does, so concurrent reservations, dpops' own or
    hand-written, are checked one after the other against the history each commits.
    """
    from dpops.ledger import budget
    from dpops.ledger.cap import check_cap, coerce_events
    from dpops.ledger.model import RunKey, ScopeDefinition, bucket_labels, check_scope_name

    try:
        body = json.loads(body_text)
        data = body["data"]
        scope = check_scope_name(body["scope"])
        key = RunKey.from_dict(data["run_key"])
        buckets = json.loads(buckets_text)
    except (KeyError, TypeError, ValueError, DpopsError) as exc:
        raise LedgerError(f"the reservation cannot be read ({type(exc).__name__}: {exc})") from None
    row = db.one("SELECT definition FROM scopes WHERE name = ?" + db.for_update, (scope,))
    if row is None:
        raise LedgerError(f"unknown budget scope {scope!r}")
    sdef = ScopeDefinition.from_dict(json.loads(row[0]))
    acct = budget.accountant_for(sdef)
    if data.get("accountant") != acct.ref:
        raise LedgerError(f"the reservation names accountant {data.get('accountant')!r}, scope {scope!r} is "
                          f"checked by {acct.ref}")
    if body.get("run_id") != key.run_id:
        raise LedgerError(f"the reservation's run id {body.get('run_id')!r} is not its run key's ({key.run_id})")
    start, end = key.start_utc, key.end_utc
    if data.get("interval_start") != start or data.get("interval_end") != end:
        raise LedgerError(f"the reservation records interval [{data.get('interval_start')}, "
                          f"{data.get('interval_end')}) beside a run key for [{start}, {end})")
    labels = bucket_labels(sdef.bucket, start, end)
    if buckets != labels or body.get("buckets") != labels:
        raise LedgerError(f"the reservation names buckets {buckets} where scope {scope!r} puts [{start}, {end}) "
                          f"in {labels}")
    events = coerce_events(data.get("events"))
    eps = budget.epsilon_of(acct, sdef, events)
    recorded = data.get("epsilon")
    expected = eps if math.isfinite(eps) else None
    if recorded != expected and not (isinstance(recorded, (int, float)) and expected is not None
                                     and math.isclose(float(recorded), expected, rel_tol=1e-12, abs_tol=0.0)):
        raise LedgerError(f"the reservation records epsilon {recorded!r} where its events compose to {expected!r}")
    check_cap(db, sdef, acct, labels, events)


# The (entry id, run id) of the last reservation this database session admitted (this module is imported once per
# session, by the function's GD; nothing outside this process can change it).
_LAST_CHECKED: list[Any] = []


def _refuse_a_second_reservation_in_one_statement(plpy: Any) -> None:
    """Refuse while the reservation this session admitted last has no ``runs`` row yet although its entry is there.

    Why: ``runs`` is derived by a row-level AFTER trigger, and PostgreSQL fires those at the END of the statement.
    In one multi-row INSERT (or a data-modifying CTE) the second reservation's check ran before the first one's
    run existed, so it composed a history without it: two reservations that fit one at a time were both admitted
    (0.3 + 0.3 with 0.4 left). The earlier rows of the same statement are visible here (a BEFORE ROW trigger sees
    the rows its command inserted before), so an entry that is there with no run derived from it is a reservation
    of this very statement: refused, and with it the statement. dpops writes one reservation per statement."""
    if not _LAST_CHECKED:
        return
    entry_id, run_id = _LAST_CHECKED
    plan = plpy.prepare("SELECT 1 FROM entries e WHERE e.id = $1 AND e.run_id = $2 AND e.kind = 'reserved' "
                        "AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.run_id = e.run_id)", ["bigint", "text"])
    if len(plpy.execute(plan, [entry_id, run_id])):
        raise LedgerError(f"entry {entry_id}'s reservation (run {run_id}) is in the same statement and its run is not "
                          "derived yet, so this one cannot be checked against it: write one reservation per statement")


def check_in_database(plpy: Any, body_text: str, buckets_text: str) -> str:
    """The body of ``dpops_cap_check``: ``check_entry`` over the trigger's session; refuse with SQLSTATE 23514.

    ``body_text`` ``{"probe": true}`` from a superuser session only answers which dpops the database runs (``install``
    asks it once, so a wrong site directory is found at install time, not at the first reservation).
    """
    # The probe is answered only to a superuser session (the installer): an entry whose body is the probe text,
    # inserted by any other role, is checked like every entry (and refused as unreadable), never waved through.
    if body_text == '{"probe": true}' and plpy.execute(
            "SELECT rolsuper FROM pg_roles WHERE rolname = session_user")[0]["rolsuper"]:
        import dpops

        return json.dumps({"check": CHECK_ID, "dpops": dpops.__version__, "python": sys.version.split()[0],
                           "module": __file__})
    try:
        entry_id = json.loads(body_text).get("id")
    except (ValueError, AttributeError):
        entry_id = None
    try:
        # The scope row lock orders reservations only if each query after it sees what committed before it was
        # granted: READ COMMITTED. In a REPEATABLE READ or SERIALIZABLE transaction every query reads the
        # snapshot taken at its first statement, so a session that took a snapshot, let another reservation
        # commit and then inserted its own was checked against a history without that reservation (the lock on
        # a row the other transaction had not changed raises no serialization error): both fitted, the cap did
        # not. Refused whoever asks: dpops itself always writes in READ COMMITTED (``PostgresBackend.transaction``).
        level = plpy.execute("SELECT current_setting('transaction_isolation') AS level")[0]["level"]
        if level != "read committed":
            raise LedgerError(f"a reservation is checked against the cap only in a READ COMMITTED transaction, this "
                              f"one is {str(level).upper()} (its queries would read a snapshot older than the scope "
                              "lock); write it in READ COMMITTED")
        _refuse_a_second_reservation_in_one_statement(plpy)
        check_entry(PlpyBackend(plpy), body_text, buckets_text)
        body = json.loads(body_text)
        _LAST_CHECKED[:] = [int(body["id"]), str(body["run_id"])]
    except DpopsError as exc:
        plpy.error(f"{REFUSAL_PREFIX}: ledger entry {entry_id} refused by the database: {exc}",
                   sqlstate=REFUSAL_SQLSTATE)
    return "ok"


def default_site_dirs() -> list[str]:
    """Where the database server finds this dpops and its dependencies: the directory holding the ``dpops``
    package first (a checkout or an editable install), then this interpreter's site-packages."""
    import site

    import dpops

    dirs = [str(Path(dpops.__file__).resolve().parent.parent)]
    for d in site.getsitepackages():
        if d not in dirs:
            dirs.append(d)
    return dirs


def function_sql(schema: str, site_dirs: Sequence[str]) -> str:
    """``CREATE OR REPLACE FUNCTION`` of ``dpops_cap_check`` in ``schema``, importing dpops from ``site_dirs``.

    The directories go first on the server's ``sys.path`` (so a different numpy of the server's own Python cannot
    shadow the one dpops was tested with); ``.pth`` files in them are honoured (editable installs).
    ``search_path`` is pinned to the ledger's schema then ``pg_temp`` (last: a temporary table cannot shadow
    ``runs``).
    """
    _check_ident(schema, "schema")
    for d in site_dirs:
        if not isinstance(d, str) or not d.startswith("/") or "$" in d or "\n" in d:
            raise LedgerError(f"site directory {d!r} must be an absolute path without '$' or newlines")
    return f'''CREATE OR REPLACE FUNCTION "{schema}".{FUNCTION}(entry_body text, entry_buckets text) RETURNS text
LANGUAGE plpython3u SET search_path = "{schema}", pg_temp AS $dpops$
if {CHECK_ID!r} not in GD:
    import site, sys
    before = list(sys.path)
    for d in {list(site_dirs)!r}:
        site.addsitedir(d)
    added = [p for p in sys.path if p not in before]
    sys.path[:] = added + before
    from dpops.ledger.db_cap import check_in_database
    GD[{CHECK_ID!r}] = check_in_database
return GD[{CHECK_ID!r}](plpy, entry_body, entry_buckets)
$dpops$'''


def _check_ident(name: str, what: str) -> str:
    if not isinstance(name, str) or not _IDENT_RE.match(name):
        raise LedgerError(f"{what} must be a lower-case SQL identifier (letters, digits, _), got {name!r}")
    return name


def install(conninfo: str, *, schema: str, owner_role: str, site_dirs: Sequence[str] | None = None) -> dict:
    """Create ``dpops_cap_check`` in ``schema`` as a superuser; return what the database answered to a probe.

    Creates the extension ``plpython3u`` if missing, the schema (owned by ``owner_role``) if missing, the
    function (EXECUTE revoked from PUBLIC, granted to ``owner_role`` only: the owner's trigger calls it), and
    calls it once with a probe so that a wrong site directory fails here. Idempotent.
    """
    import psycopg

    _check_ident(schema, "schema")
    _check_ident(owner_role, "owner role")
    dirs = list(site_dirs) if site_dirs else default_site_dirs()
    try:
        conn = psycopg.connect(conninfo, autocommit=True)
    except psycopg.Error as exc:
        raise LedgerError(f"cannot connect to the ledger database: {str(exc).strip()}") from None
    try:
        row = conn.execute("SELECT rolsuper, session_user FROM pg_roles WHERE rolname = session_user").fetchone()
        if not row or not row[0]:
            raise LedgerError(
                f"connected as {row[1] if row else '?'!r}, not a superuser: only a superuser may create a function "
                "in PL/Python (an untrusted language, so that neither the app role nor the ledger owner can change "
                "its body); connect as the database's superuser (deploy/ledger-db-init.sh does, on first start)")
        if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (owner_role,)).fetchone() is None:
            raise LedgerError(f"owner role {owner_role!r} does not exist: create it first (deploy/ledger-roles.sql)")
        with conn.transaction():
            # one installer at a time per database (CREATE EXTENSION IF NOT EXISTS races with itself)
            conn.execute("SELECT pg_advisory_xact_lock(hashtext('dpops-cap-check'))")
            try:
                with conn.transaction():
                    conn.execute("CREATE EXTENSION IF NOT EXISTS plpython3u")
            except psycopg.Error as exc:
                raise LedgerError(
                    f"the database server has no PL/Python ({str(exc).strip()}): install its package on the server "
                    "(Debian: postgresql-plpython3-<major version>; deploy/ledger-db.Dockerfile does) and run this "
                    "again") from None
            if conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)).fetchone() is None:
                conn.execute(f'CREATE SCHEMA "{schema}" AUTHORIZATION "{owner_role}"')
            conn.execute(function_sql(schema, dirs).encode())
            conn.execute(f'REVOKE ALL ON FUNCTION "{schema}".{SIGNATURE} FROM PUBLIC')
            conn.execute(f'GRANT EXECUTE ON FUNCTION "{schema}".{SIGNATURE} TO "{owner_role}"')
        try:
            answer = conn.execute(f'SELECT "{schema}".{FUNCTION}(%s, %s)', ('{"probe": true}', "[]")).fetchone()
        except psycopg.Error as exc:
            raise LedgerError(
                f"dpops_cap_check was created but cannot import dpops from {dirs}: {str(exc).strip()}; give the "
                "site directories of a dpops installation the database server's user can read (--site-dir)"
            ) from None
        if answer is None:
            raise LedgerError("dpops_cap_check returned no row to the install probe")
        probe = json.loads(answer[0])
        probe.update({"schema": schema, "owner_role": owner_role, "site_dirs": dirs})
        return probe
    finally:
        conn.close()


def installed(db: Backend) -> bool:
    """Is ``dpops_cap_check`` present in the ledger's schema (PostgreSQL)? Always False on SQLite."""
    if db.dialect != "postgresql":
        return False
    row = db.one("SELECT to_regprocedure(quote_ident(current_schema()) || '.' || ?) IS NOT NULL", (SIGNATURE,))
    return bool(row and row[0])
