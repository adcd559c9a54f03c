"""Load a ``dpops ledger export`` into another, empty ledger: ``dpops ledger import`` (SQLite <-> PostgreSQL).

The rules, and why each one is there (a budget forgotten or counted twice is a privacy breach):

1. **The export is verified from the file alone first** (``verify.replay_export``: chain, state machine,
   totals, and any ``--expect-head`` / checkpoints). A file that was edited, truncated or reordered on its
   way between machines is refused, naming the first bad entry and its line, before the target is opened
   for writing.
2. **The target must be empty** (no entries, scopes or runs; chain head at genesis). Two
   histories cannot become one hash chain, and merging caches would double count or forget spends.
3. **Entries are inserted verbatim** (ids, timestamps, bodies, ``prev_hash``, ``hash``) so the chain and
   its head are the same chain: anchors taken on the old ledger (signed checkpoints, a head written down)
   still hold on the new one. The chain head walks forward one entry at a time, as the database guards
   (``schema.py``, version 2) require of every writer; they are never disabled.
4. **The caches are rebuilt by the replay ``verify`` uses** (``verify._Replay.cache_rows``), never by a
   second implementation that could drift from what ``verify`` expects. (On PostgreSQL the owner's trigger
   derives each run row as its entries are inserted, schema version 4; the replay's rows are then upserted.)
5. **One transaction, verified before it commits**: the written tables are verified in full on the open
   transaction; any failure (a bad row, a lost connection, a verification problem) rolls back to the empty
   ledger. The committed ledger is verified again afterwards, as any reader would.
6. **PostgreSQL: only the owner role imports.** The application role may append entries (``roles.py``), which
   is enough to write an import's entries; but filling a ledger from a file is an
   administrative act that must not be open to whoever runs releases, so it is refused with a pointer
   to the owner role.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from dpops.errors import IntegrityError, InvalidParameter, LedgerError
from dpops.ledger.backend import Backend, hook, redact
from dpops.ledger.model import VerifyReport
from dpops.ledger.schema import GENESIS_HASH
from dpops.ledger.verify import ExportReplay, replay_export, verify_tables

if TYPE_CHECKING:
    from dpops.ledger.checkpoint import Checkpoint
    from dpops.ledger.store import Ledger

_ENTRY_INSERT = ("INSERT INTO entries (id, ts, kind, scope, run_id, buckets, actor, body, prev_hash, hash, writer) "
                 "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")  # writer verbatim: only the owner may (schema v3)
_HEAD_STEP = "UPDATE chain_head SET last_id = ?, last_hash = ? WHERE singleton = 1"
_SCOPE_INSERT = "INSERT INTO scopes (name, definition, accountant, last_entry) VALUES (?, ?, ?, ?)"
_RUN_COLUMNS = ("run_id", "scope", "release", "interval_start", "interval_end", "run_key", "state", "events",
                "buckets", "restates", "output_uri", "details", "entry_ids", "entry_hashes", "created_at", "updated_at",
                "epsilon", "last_entry")
# An upsert: on PostgreSQL the owner's trigger (schema version 4) already derived each run row while the entries
# were inserted; the replay's rows then set what an older entry did not carry (its normalised interval, epsilon).
_RUN_INSERT = (f"INSERT INTO runs ({', '.join(_RUN_COLUMNS)}) VALUES ({', '.join('?' for _ in _RUN_COLUMNS)}) "
               "ON CONFLICT (run_id) DO UPDATE SET "
               + ", ".join(f"{c} = excluded.{c}" for c in _RUN_COLUMNS[1:]))
# PostgreSQL keeps every version of the one chain_head row a transaction updates, and an UPDATE by key follows
# that chain of versions: N steps by key cost O(N^2) (measured: 10k entries 1.8 s, 20k 6.5 s). Each step here
# goes to the current version by its ctid instead: linear (100k steps ~4 s). The guard trigger still checks
# every step; the table lock taken before (below) keeps every other writer out, so the ctid cannot move.
_PG_HEAD_WALK = """DO $$
DECLARE t tid; r record;
BEGIN
  SELECT ctid INTO t FROM chain_head WHERE singleton = 1;
  FOR r IN SELECT id, hash FROM entries WHERE id > (SELECT last_id FROM chain_head WHERE singleton = 1)
           ORDER BY id LOOP
    UPDATE chain_head SET last_id = r.id, last_hash = r.hash WHERE ctid = t RETURNING ctid INTO t;
    IF t IS NULL THEN RAISE EXCEPTION 'dpops ledger import: lost the chain head row'; END IF;
  END LOOP;
END $$"""
# Every write transaction of store.py starts by locking a scopes row (then buckets, the chain head, entries,
# runs). Locking the scopes table first means an import that starts while a writer is mid-transaction waits
# for it to commit (and then finds the ledger not empty), and a writer that starts later waits at its first
# statement holding nothing: no deadlock either way. No other session writes during the import.
_PG_LOCK = "LOCK TABLE scopes, runs, chain_head, entries IN EXCLUSIVE MODE"


@dataclass
class ImportResult:
    """What ``import_export`` loaded, and the full verification of the target after the commit."""

    ledger: str
    source: str
    entries: int
    scopes: list[str]
    runs: int
    runs_by_state: dict[str, int]
    head_id: int
    head_hash: str
    report: VerifyReport
    anchors: dict[str, Any] = field(default_factory=dict)

    @property
    def head(self) -> str:
        """``N:HASH``, the form ``--expect-head`` takes."""
        return f"{self.head_id}:{self.head_hash}"

    def to_dict(self) -> dict[str, Any]:
        """JSON form for ``--json``: counts, the head, and the post-import verification."""
        doc = asdict(self)
        doc["head"] = self.head
        doc["scope_count"] = len(self.scopes)
        doc["verify"] = doc.pop("report")
        return doc


def read_export(lines: Iterable[str], source: str, checkpoints: Sequence[Checkpoint] | None = None,
                expect_heads: Sequence[str] = ()) -> ExportReplay:
    """Parse and verify an export from the file alone; IntegrityError (exit 7) names the first bad entry and line.

    An export without entries is refused too: importing nothing is almost always the wrong file, and an
    empty ledger is made with ``dpops ledger init``.
    """
    export = replay_export(lines, source, checkpoints, expect_heads)
    report = export.report
    if not report.ok:
        line = export.line_of(report.first_bad_entry)
        where = (f" at entry {report.first_bad_entry}" + (f" (line {line})" if line is not None else "")
                 if report.first_bad_entry is not None else "")
        raise IntegrityError(f"{source} does not verify{where}: {report.problems[0]}; nothing was imported")
    if not export.rows:
        raise InvalidParameter(f"{source} holds no entries: nothing to import (is it the right file? an empty "
                               "ledger is made with `dpops ledger init`)")
    return export


def check_owner(db: Backend) -> None:
    """PostgreSQL: refuse (PermissionRefused, exit 3) unless the session may act as the ledger tables' owner.

    The rule is ``roles.require_owner`` (the database's guard triggers refuse the writes in any case).
    SQLite has no roles: its file's permissions decide who may write it.
    """
    from dpops.ledger.roles import require_owner, table_owner

    if db.dialect != "postgresql":
        return
    if table_owner(db) is None:
        raise LedgerError(f"ledger {redact(db.url)}: no ledger tables in this schema; run `dpops ledger init` as "
                          "the owner role first")
    require_owner(db, "import history (`dpops ledger import`); nothing was imported")


def check_empty(db: Backend) -> None:
    """Refuse a target that holds anything (LedgerError, exit 6), saying what is there."""
    entries = int(db.row("SELECT COUNT(*) FROM entries")[0])
    scopes = [r[0] for r in db.all("SELECT name FROM scopes ORDER BY name")]
    runs = int(db.row("SELECT COUNT(*) FROM runs")[0])
    head = db.row("SELECT last_id, last_hash FROM chain_head WHERE singleton = 1")
    if not entries and not scopes and not runs and (int(head[0]), head[1]) == (0, GENESIS_HASH):
        return
    shown = ", ".join(scopes[:5]) + (f" and {len(scopes) - 5} more" if len(scopes) > 5 else "")
    raise LedgerError(
        f"ledger {redact(db.url)} is not empty: it holds {entries} entries (head {int(head[0])}:{head[1][:16]}...), "
        f"{len(scopes)} scope(s){' (' + shown + ')' if scopes else ''} and {runs} run(s); "
        "`dpops ledger import` never merges into a used ledger (two histories cannot be one chain, and merged "
        "totals would forget or double count spends): import into a newly initialised, empty ledger; "
        "nothing was imported"
    )


def import_export(ledger: Ledger, export: ExportReplay, *, checkpoints: Sequence[Checkpoint] | None = None,
                  expect_heads: Sequence[str] = ()) -> ImportResult:
    """Load a verified export (``read_export``) into the empty ``ledger`` in one transaction, then verify it.

    The head of the export (its last entry) is required of the result, besides any ``expect_heads`` and
    ``checkpoints`` (taken on the old ledger: the same chain extends them).
    """
    rows = export.rows
    head_id, head_hash = int(rows[-1][0]), str(rows[-1][9])
    anchors = [*expect_heads, f"{head_id}:{head_hash}"]
    caches = export.cache_rows()
    with ledger._write() as db:
        check_owner(db)
        if db.dialect == "postgresql":
            db.execute(_PG_LOCK)  # SQLite: BEGIN IMMEDIATE already holds the whole database
        check_empty(db)
        # Scopes first: the database checks each reservation against its scope as the entry is inserted (v4).
        db.execute_many(_SCOPE_INSERT, caches.scopes)
        db.execute_many(_ENTRY_INSERT, rows)
        # The guard lets the head move only one entry forward, to an entry that exists: walk it.
        if db.dialect == "postgresql":
            db.execute(_PG_HEAD_WALK)
        else:  # SQLite updates the row in place: one step per entry is linear
            db.execute_many(_HEAD_STEP, [(r[0], r[9]) for r in rows])
        hook("import:entries")
        hook("import:caches")
        db.execute_many(_RUN_INSERT, caches.runs)
        report = verify_tables(db, checkpoints, anchors)
        if not report.ok:  # rolled back by the transaction
            raise IntegrityError(f"the imported ledger does not verify before commit: {report.problems[0]}; "
                                 "it was rolled back, nothing was imported")
        hook("import:before_commit")
    final = ledger.verify(checkpoints=checkpoints, expect_heads=anchors)
    if not final.ok:
        raise IntegrityError(f"ledger {redact(ledger.url)} does not verify after the import: {final.problems[0]}")
    return ImportResult(
        ledger=redact(ledger.url), source=export.source, entries=len(rows),
        scopes=[s[0] for s in caches.scopes], runs=len(caches.runs),
        runs_by_state=dict(sorted(Counter(str(r[6]) for r in caches.runs).items())),
        head_id=head_id, head_hash=head_hash, report=final, anchors=final.anchors,
    )
