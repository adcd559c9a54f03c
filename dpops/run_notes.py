"""Which earlier orchestrator runs of an interval a publication settles, and what their notes say (issue 28 item 8).

A day can be published by another run than the one that first tried it: a REST fill or a backfill after a
cap raise, a ``--fresh-attempt`` after a spent run, a restatement after a refused one. Before, the earlier
runs kept saying what was true when they ended ("failed" in red, ``REFUSED: ...``) while ``dpops gaps``
showed no gap, and on-call could not tell which red runs still needed them. ``settled_runs`` decides, from
plain values (this module is Airflow-free), which of them the publication settles and the note each gets:

- only runs of **the same interval**, resolved by ``dpops.run_interval.resolve_run_interval``, the rule the
  tasks used to choose what they read and charged (a REST run by its ``conf.interval``), so a note can never
  be put on a run of another day;
- only runs that **began before the publication was committed**: a failed restatement started after the
  day's publication is not settled by that older publication (it asked for a new version that does not
  exist), so it stays failed; it is settled only by a later committed version;
- a **failed** run is marked ``success`` with a ``PUBLISHED:`` note (Airflow 3.3 keeps every finished task's
  state, so the red task and its log stay as the record of what went wrong);
- a run whose note says ``REFUSED:`` keeps its state (success) and gets a ``PUBLISHED:`` note that names the
  ledger run that published the day and keeps the refusal's reason, so the refusal stays on record;
- a run in flight, the publishing run itself and any other run are left alone, and an operator's own note
  is kept on a run that is marked success (it is appended to, never dropped).

Privacy reason: notes and DAG-run states are display only; nothing here reads data, reserves or charges.
What is settled is decided from the ledger's record of the commit (run id, commit time), never from the
orchestrator's metadata, which Op/Admin users can edit. The commit time (the ledger writer's clock) is compared
with the DAG run's start (the scheduler's clock): with skewed clocks, a run begun within the skew of the commit
can be misjudged either way; that only changes a display, never a charge or a publication.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import UTC, datetime

from dpops.errors import DpopsError

REFUSED_PREFIX = "REFUSED: "
PUBLISHED_PREFIX = "PUBLISHED: "
NOTE_LIMIT = 1000  # Airflow 3's DAG-run note column


@dataclass(frozen=True)
class OrchestratorRun:
    """One DAG run as the orchestrator's API lists it (the fields this decision needs)."""

    run_id: str
    state: str
    note: str | None
    started: datetime | None
    data_interval_start: datetime | str | None
    data_interval_end: datetime | str | None
    logical_date: datetime | str | None
    named_interval: str | None  # the run's ``conf.interval`` (a REST-triggered run)


@dataclass(frozen=True)
class Settlement:
    """What to write on one earlier run: its new note, and whether its state becomes success."""

    run_id: str
    note: str
    mark_success: bool


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def settled_runs(runs: list[OrchestratorRun], *, spec_path: str | os.PathLike[str], interval: tuple[str, str],
                 ledger_run_id: str, committed_at: datetime, own_run_id: str,
                 publisher: str | None = None) -> list[Settlement]:
    """The settlements of ``runs`` (any DAG runs of the release) once ``ledger_run_id`` is the interval's
    committed publication, committed at ``committed_at``. ``publisher``: the DAG run that committed it, when it is
    the caller (``None``: the caller only served the publication)."""
    from dpops.run_interval import resolve_run_interval

    committed_at = _aware(committed_at)
    by = f"ledger run {ledger_run_id}" + (f", DAG run {publisher}" if publisher else "")
    head = f"{PUBLISHED_PREFIX}the interval was published by {by} at {committed_at.isoformat(timespec='seconds')}"
    out: list[Settlement] = []
    for run in runs:
        if run.run_id == own_run_id or run.started is None or _aware(run.started) >= committed_at:
            continue
        failed = run.state == "failed"
        refused = isinstance(run.note, str) and run.note.startswith(REFUSED_PREFIX)
        if not (failed or refused) or run.state not in ("failed", "success"):
            continue
        try:
            if resolve_run_interval(spec_path, data_interval_start=run.data_interval_start,
                                    data_interval_end=run.data_interval_end, logical_date=run.logical_date,
                                    named=run.named_interval) != interval:
                continue
        except DpopsError:  # a run that named no releasable interval released nothing: nothing to settle
            continue
        if refused:
            reason = (run.note or "")[len(REFUSED_PREFIX):]
            note = f"{head}; this run was refused then: {reason}"
        else:
            note = (f"{head}; this run failed before (its task states and logs are kept): nothing is left to do "
                    "for this interval")
            if run.note:
                note += f". Earlier note: {run.note}"
        out.append(Settlement(run.run_id, note[:NOTE_LIMIT], mark_success=failed))
    return out


__all__ = ["NOTE_LIMIT", "PUBLISHED_PREFIX", "REFUSED_PREFIX", "OrchestratorRun", "Settlement", "settled_runs"]
