"""Alerting for the dpops DAGs.

``on_failure`` is every task's ``on_failure_callback``; ``refusal_alert`` is called by a refused
run (which ends skipped, not failed). Each logs ONE structured line
(``DPOPS_ALERT {json}``) that a log shipper can match, then hands the same dict to an
optional pluggable hook named by ``DPOPS_ALERT_HOOK=package.module:function`` (a pager,
a chat webhook...). A broken hook is logged, never raised: alerting must not mask the
original failure.

Alerts carry only public facts (release, interval, task, error class and message). dpops
error messages never contain private values (row counts stay in the internal run log); any
other exception contributes only its class name (``dpops.errors.public_message``), since
pyarrow/pandas/Beam error texts can quote a cell or a whole input line.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from collections.abc import Callable
from typing import Any

from dpops.errors import public_message

log = logging.getLogger("dpops.airflow")

ALERT_HOOK_ENV = "DPOPS_ALERT_HOOK"


def _load_hook(ref: str) -> Callable[[dict[str, Any]], Any]:
    module, _, attr = ref.partition(":")
    if not module or not attr:
        raise ValueError(f"{ALERT_HOOK_ENV}={ref!r} must look like package.module:function")
    return getattr(importlib.import_module(module), attr)


def _iso(value: Any) -> str | None:
    return value.isoformat() if hasattr(value, "isoformat") else (None if value is None else str(value))


def _interval(context: dict[str, Any], spec_path: str | None) -> dict[str, Any]:
    """The interval the run releases, by the tasks' own rule (``dpops.run_interval``): a REST-triggered run
    (``logical_date: null``, ``conf.interval``) has no data interval, and on-call must still be told the day
    (issue 28 item 5). A run whose interval cannot be resolved keeps Airflow's values and the text it named."""
    from dpops.errors import DpopsError
    from dpops.run_interval import resolve_run_interval

    named = (context.get("params") or {}).get("interval")
    try:
        start, end = resolve_run_interval(spec_path, data_interval_start=context.get("data_interval_start"),
                                          data_interval_end=context.get("data_interval_end"),
                                          logical_date=context.get("logical_date"), named=named)
        return {"interval_start": start, "interval_end": end}
    except DpopsError:
        out: dict[str, Any] = {"interval_start": _iso(context.get("data_interval_start")),
                               "interval_end": _iso(context.get("data_interval_end"))}
        if named not in (None, ""):
            out["interval_requested"] = str(named)[:100]  # the operator's conf text, not data
        return out


def alert_payload(context: dict[str, Any], spec_path: str | None = None) -> dict[str, Any]:
    """The alert's fields; ``spec_path`` (the DAG's release spec) expands a named single START to its period."""
    ti = context.get("ti") or context.get("task_instance")
    exc = context.get("exception")
    dag = context.get("dag")
    return {
        "event": "dpops.task_failed",
        "dag_id": getattr(dag, "dag_id", None) or getattr(ti, "dag_id", None),
        "task_id": getattr(ti, "task_id", None),
        "run_id": context.get("run_id"),
        "try_number": getattr(ti, "try_number", None),
        **_interval(context, spec_path),
        "error": type(exc).__name__ if exc is not None else None,
        "message": _message(exc),
    }


def _message(exc: BaseException | None) -> str | None:
    """dpops errors and Airflow's own exceptions keep their text: the DAG raises the latter only with text
    from a dpops error (``_fail_fast``) or about scheduling. Any other exception keeps only its class."""
    if exc is None:
        return None
    if type(exc).__module__.split(".")[0] == "airflow":
        return str(exc)
    return public_message(exc)


def on_failure(context: dict[str, Any], spec_path: str | None = None) -> None:
    _emit(alert_payload(context, spec_path))


def failure_callback(spec_path: str) -> Callable[[dict[str, Any]], None]:
    """A DAG's ``on_failure_callback``: ``on_failure`` knowing the DAG's spec (for the run's interval)."""

    def callback(context: dict[str, Any]) -> None:
        on_failure(context, spec_path)

    return callback


def refusal_alert(context: dict[str, Any], reason: str, spec_path: str | None = None) -> None:
    """A refused interval (budget cap, silent restatement): not a task failure, still an alert."""
    _emit({**alert_payload(context, spec_path), "event": "dpops.refused", "error": "Refused", "message": reason})


def _emit(payload: dict[str, Any]) -> None:
    log.error("DPOPS_ALERT %s", json.dumps(payload, sort_keys=True, default=str))
    ref = os.environ.get(ALERT_HOOK_ENV)
    if ref:
        try:
            _load_hook(ref)(payload)
        except Exception:
            log.exception("alert hook %s failed", ref)
