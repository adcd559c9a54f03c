"""Issue 28 item 8: which earlier DAG runs of a day its publication settles (dpops.run_notes), without Airflow.

The real-Airflow half (the REST calls, a failed run turning success with its tasks kept) is in
tests/test_year_in_the_life_airflow.py."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from dpops.run_notes import OrchestratorRun, settled_runs

SPEC = str(Path(__file__).resolve().parent.parent / "examples" / "daily_purchases.yaml")
DAY3 = ("2024-01-03T00:00:00+00:00", "2024-01-04T00:00:00+00:00")
COMMIT = datetime(2024, 2, 1, 12, tzinfo=UTC)
BEFORE, AFTER = datetime(2024, 2, 1, 9, tzinfo=UTC), datetime(2024, 2, 1, 13, tzinfo=UTC)


def _run(run_id: str, state: str, *, note: str | None = None, started: datetime | None = BEFORE,
         day: str | None = "2024-01-03", named: str | None = None) -> OrchestratorRun:
    start = None if day is None else f"{day}T00:00:00+00:00"
    end = None if day is None else f"{day[:8]}{int(day[8:]) + 1:02d}T00:00:00+00:00"
    return OrchestratorRun(run_id, state, note, started, start, end, start, named)


def _settle(runs: list[OrchestratorRun], **kw: object) -> dict[str, tuple[str, bool]]:
    args = {"spec_path": SPEC, "interval": DAY3, "ledger_run_id": "abc123", "committed_at": COMMIT,
            "own_run_id": "manual__fill", "publisher": "manual__fill", **kw}
    return {s.run_id: (s.note, s.mark_success) for s in settled_runs(runs, **args)}  # type: ignore[arg-type]


def test_a_failed_run_and_a_refused_run_of_the_day_are_settled_naming_the_publication():
    got = _settle([
        _run("scheduled__d3", "failed"),
        _run("manual__rest_refused", "success", note="REFUSED: scope s: 9.5 spent + 0.5 > cap 10", day=None,
             named="2024-01-03"),
    ])
    note, success = got["scheduled__d3"]
    assert success and note.startswith("PUBLISHED: the interval was published by ledger run abc123, DAG run "
                                       "manual__fill at 2024-02-01T12:00:00+00:00")
    note, success = got["manual__rest_refused"]
    assert not success and note.endswith("this run was refused then: scope s: 9.5 spent + 0.5 > cap 10")
    assert "ledger run abc123" in note


def test_runs_of_other_days_in_flight_started_after_the_commit_or_the_publisher_itself_are_left_alone():
    got = _settle([
        _run("scheduled__d2", "failed", day="2024-01-02"),  # another day
        _run("manual__d4", "failed", day=None, named="2024-01-04"),  # another day, by conf
        _run("backfill__d3", "running"),  # in flight
        _run("manual__restate_after", "failed", started=AFTER),  # a restatement begun after this version
        _run("manual__fill", "failed"),  # the caller
        _run("manual__no_interval", "failed", day=None),  # named nothing: released nothing
        _run("scheduled__ok", "success", note="an operator's note"),  # neither failed nor refused
    ])
    assert got == {}


def test_a_served_run_names_only_the_ledger_run_and_an_operators_note_is_kept():
    got = _settle([_run("scheduled__d3", "failed", note="paged alice")], publisher=None)
    note, success = got["scheduled__d3"]
    assert success and "published by ledger run abc123 at" in note and "DAG run" not in note.split(";")[0]
    assert note.endswith("Earlier note: paged alice")
