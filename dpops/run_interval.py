"""The one rule for which data interval an orchestrator run releases (issue 28 items 2 and 5).

An Airflow DAG run of a release names its interval in one of two ways: a scheduled or backfill run
by its data interval ``[start, end)``; a run triggered the documented way (REST ``logical_date: null``)
by the DAG's ``interval`` param (``conf: {"interval": "2024-01-03"}``, the text ``dpops release run
--interval`` takes). ``resolve_run_interval`` is the only place that decides between them: the DAG's
tasks (what is read, reserved and charged), the Privacy budget tab (which ledger run the DAG run is
about) and the alerts (which day on-call is told about) all call it, so none of them can name another
day than the one the tasks released.

Privacy reason: an interval is the unit a charge is made for. A run whose data interval and named
interval disagree, or that names none, is refused before anything is read or reserved (an operator
who named one day must never get another day released and charged). This module is Airflow-free
(plain values in, ISO strings out) so the api-server's plugin can use it without importing the DAGs.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from dpops.errors import DpopsError, InvalidParameter, public_message

if TYPE_CHECKING:
    from dpops.inputs import Interval
    from dpops.spec import ReleaseSpec

Instant = datetime | str | None


def _utc(value: Instant, what: str) -> datetime | None:
    if value is None or value == "":
        return None
    if isinstance(value, datetime):
        return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    from dpops.ledger.model import parse_utc

    return parse_utc(str(value), what)


def resolve_run_interval(spec_path: str | os.PathLike[str] | None, *, data_interval_start: Instant,
                         data_interval_end: Instant, logical_date: Instant = None, named: object = None,
                         dag_id: str = "DAG_ID") -> tuple[str, str]:
    """The run's interval as ISO strings (UTC), or ``InvalidParameter`` saying why none can be released.

    ``named``: the run's ``interval`` param (None or "" when not given). ``spec_path``: the release spec,
    needed only to expand a single START to the spec's one period starting there (``requested_interval``).
    """
    start, end = _utc(data_interval_start, "data interval start"), _utc(data_interval_end, "data interval end")
    if named not in (None, ""):
        if spec_path is None and "/" not in str(named):
            raise InvalidParameter(f"param interval {named!r}: the release spec is needed to expand one START to "
                                   "its period, and none was found")
        try:
            iv = requested_interval(spec_path or "", str(named))
        except DpopsError as exc:
            raise InvalidParameter(f"param interval {named!r}: {public_message(exc)}; nothing was read, reserved "
                                   "or charged") from None
        chosen = (iv.start_iso, iv.end_iso)
        if start is not None and end is not None and start < end and \
                (start.astimezone(UTC).isoformat(), end.astimezone(UTC).isoformat()) != chosen:
            raise InvalidParameter(
                f"this run names the interval {chosen[0]}/{chosen[1]} (param interval) but Airflow gave it the data "
                f"interval {start.isoformat()}/{end.isoformat()}; nothing was read, reserved or charged. Trigger "
                'with "logical_date": null and only conf {"interval": ...}; see README "Releasing a given day"')
        return chosen
    if start is None or end is None or start >= end:
        raise InvalidParameter(
            "this DAG run has no data interval (it was triggered without a logical date, e.g. REST "
            "logical_date: null, and without the param interval); a dpops run releases exactly one data interval, "
            "so nothing was read, reserved or charged. Release one day D with: airflow backfill create --dag-id "
            f"{dag_id} --from-date D --to-date D, or trigger with logical_date null and conf "
            '{"interval": "D"}; see README "Releasing a given day"')
    logical = _utc(logical_date, "logical date")
    if logical is not None and logical < start:
        # `airflow dags trigger -l D` keeps D as the logical date but computes the data interval from the
        # trigger time: the operator named one day and would get another released (and charged).
        raise InvalidParameter(
            f"this run names the logical date {logical.isoformat()} but Airflow gave it the data interval "
            f"{start.isoformat()}/{end.isoformat()} (airflow dags trigger -l computes the interval from the trigger "
            "time); nothing was read, reserved or charged. Release the day D with: airflow backfill create "
            f"--dag-id {dag_id} --from-date D --to-date D, or trigger with logical_date null and conf "
            '{"interval": "D"}; see README "Releasing a given day"')
    return (start.astimezone(UTC).isoformat(), end.astimezone(UTC).isoformat())


__all__ = ["resolve_run_interval"]


def requested_interval(spec_path: str | os.PathLike[str] | ReleaseSpec, text: str) -> Interval:
    """An interval named by an operator: ``START/END`` as given, or one ``START`` (e.g. ``2024-01-03``) for the
    one period / schedule interval of the spec starting there. The one convention for naming a day, shared
    by ``dpops release run --interval``, the Airflow DAG's ``interval`` param (a REST trigger with
    ``logical_date: null`` and ``conf: {"interval": "2024-01-03"}``) and the Python API (``dpops.analysis``
    takes the spec itself, hence a ``ReleaseSpec`` too). ``prepare`` still checks the interval is releasable
    (one period, on the spec's grid)."""
    from dpops.inputs import Interval, parse_interval
    from dpops.ledger.model import parse_utc  # a value parser; no database is touched
    from dpops.spec import ReleaseSpec, load_spec

    text = str(text).strip()
    # Both forms are accepted, so an error names both (issue 28 item 15: "must be START/END" misled).
    both = (f"interval {text!r}: give START/END (ISO-8601 UTC, e.g. 2024-01-01/2024-01-02) or the start of one "
            "period of the spec (e.g. 2024-01-03)")
    if "/" in text:
        try:
            return parse_interval(text)
        except InvalidParameter as exc:
            if text.count("/") != 1:
                raise InvalidParameter(both) from None
            raise InvalidParameter(f"interval {text!r}: {exc}") from None  # e.g. its start is not before its end
    from dpops.spec import one_period_interval

    try:
        start = parse_utc(text, "interval start")
    except InvalidParameter:
        raise InvalidParameter(both) from None
    spec = spec_path if isinstance(spec_path, ReleaseSpec) else load_spec(spec_path)
    return Interval(*one_period_interval(spec, start))
