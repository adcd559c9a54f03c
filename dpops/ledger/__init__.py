"""The global privacy-budget ledger (semantics.md section 4).

An append-only, hash-chained database (SQLite by default, PostgreSQL in
production) of budget scopes and of every run's reservation and outcome. Runs
reserve before touching private data, under a lock on their scope; the scope's
accountant composes everything charged plus the request and refuses over the cap.

    from dpops.ledger import open_ledger, ScopeDefinition, RunKey
    ledger = open_ledger("sqlite:///ledger.sqlite")   # or postgresql://user@host:5432/db[?schema=name]
"""

from __future__ import annotations

from dpops.ledger.backend import DEFAULT_URL
from dpops.ledger.cap import ScopeBudgetExceeded
from dpops.ledger.model import (
    Adjacency,
    BucketSize,
    BucketStatus,
    Entry,
    PlanItem,
    PlanResult,
    RunKey,
    RunRecord,
    RunState,
    ScopeDefinition,
    ScopeStatus,
    TimeRule,
    VerifyReport,
    bucket_labels,
)
from dpops.ledger.store import Ledger


def open_ledger(url: str | None = None) -> Ledger:
    """Open (creating or migrating the schema) the ledger at ``url``.

    ``None`` means env ``DPOPS_LEDGER_URL``, else ``sqlite:///dpops-ledger.sqlite``.
    ``sqlite:///rel/path.sqlite`` is relative to the working directory,
    ``sqlite:////abs/path.sqlite`` absolute. ``postgresql://user@host:port/db`` may add
    ``?schema=name`` to keep the ledger in its own PostgreSQL schema.
    A malformed URL or an unreachable database raises LedgerError; nothing is written.
    """
    return Ledger(url)


__all__ = [
    "DEFAULT_URL", "Adjacency", "BucketSize", "BucketStatus", "Entry", "Ledger", "PlanItem", "PlanResult", "RunKey",
    "RunRecord", "RunState", "ScopeBudgetExceeded", "ScopeDefinition", "ScopeStatus", "TimeRule", "VerifyReport",
    "bucket_labels", "open_ledger",
]
