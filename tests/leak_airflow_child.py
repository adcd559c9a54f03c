"""The Airflow half of ``tests/test_leaks_airflow.py``, run in its own Python process.

Why a process of its own: ``DagBag`` parsing and ``dag.test`` configure Airflow's logging (stdlib handlers and
structlog) against whatever ``sys.stdout``/``sys.stderr`` are at that moment. Inside a pytest worker those are
pytest's capture files; the configuration outlives the test, and CI once saw every later test of that worker
fail with "I/O operation on closed file" in pytest's own capture. Here the streams are this process's pipes,
which the parent test reads whole, and nothing is left behind in the test worker.

Usage: ``python leak_airflow_child.py RESULT.json SENTINEL_TEXT SENTINEL_NUMBER`` with the workspace's environment (AIRFLOW_HOME, the SQLite
metadata DB, DPOPS_SPECS_DIR, the ledger, the key). Writes the parse texts, the DAG-run states and every log
record (DEBUG and up, with tracebacks) to RESULT.json; the parent asserts and scans.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from datetime import datetime, timezone
from pathlib import Path

class _Keep(logging.Handler):
    """Every record, DEBUG and up, as caplog would hold it."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _attach(keep: _Keep) -> None:
    """Airflow may reconfigure logging (dictConfig drops the root handlers): put the recorder back."""
    root = logging.getLogger()
    root.setLevel(logging.DEBUG)
    if keep not in root.handlers:
        root.addHandler(keep)


def _day(d: int) -> datetime:
    return datetime(2024, 1, d, tzinfo=timezone.utc)


def main(result_path: str, sent_str: str, sent_num: str) -> int:
    import airflow  # noqa: F401  (Airflow configures its logging at import)

    keep = _Keep()
    _attach(keep)
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=os.environ["AIRFLOW__CORE__DAGS_FOLDER"])
    parse_texts = " ".join(str(w) for ws_ in bag.captured_warnings.values() for w in ws_)
    parse_texts += " ".join(map(str, bag.import_errors.values()))
    states: dict[str, str] = {}
    if "dpops_af_leak" in bag.dags and "dpops_af_leak_input" in bag.dags:
        good = bag.dags["dpops_af_leak"]
        _attach(keep)
        states["good"] = str(good.test(logical_date=_day(2)).state)  # [Jan 1, Jan 2): publishes
        _attach(keep)
        states["input_is_key"] = str(bag.dags["dpops_af_leak_input"].test(logical_date=_day(2)).state)
        import pipelines.io as pio  # the read transform looks prepare_batch up on pipelines.io at run time

        real = pio.prepare_batch
        hexkey = Path(os.environ["DPOPS_NOISE_KEY_FILE"]).read_text().split()[-1]  # as the parent plants it

        def leaky_prepare(batch, *a, **k):  # a future bug whose text quotes the data
            raise ValueError(f"Could not convert {sent_str} {sent_num} {hexkey}")

        pio.prepare_batch = leaky_prepare
        try:
            _attach(keep)
            states["leaky_bug"] = str(good.test(logical_date=_day(3)).state)  # [Jan 2, Jan 3): fails in Beam
        finally:
            pio.prepare_batch = real
    sys.stdout.flush()
    sys.stderr.flush()
    records = []
    for r in keep.records:
        tb = ""
        if r.exc_info and r.exc_info[1] is not None:  # chained causes included
            tb = "".join(traceback.format_exception(r.exc_info[1]))
        records.append({"name": r.name, "message": r.getMessage(), "exc_text": r.exc_text or "", "traceback": tb})
    with open(result_path, "w", encoding="utf-8") as fh:
        json.dump({"dag_ids": sorted(bag.dag_ids), "parse_texts": parse_texts, "states": states,
                   "records": records}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
