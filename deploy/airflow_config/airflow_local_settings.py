"""Airflow local settings of a dpops deployment: the scheduler preloads the task code once.

Airflow imports this module (from ``$AIRFLOW_HOME/config``) in every one of its processes. In the
**scheduler** only, it imports the modules dpops' tasks need: with the LocalExecutor every task runs in a
process forked from the scheduler (the executor's workers are forked from it, and Airflow 3's task
supervisor forks the task runner from the worker), so a module imported here is already loaded in every
task instead of being imported again by each one. Measured on 2 cores: ``import great_expectations`` costs
5-6 CPU s and ``apache_beam`` with the pipeline about 2.4 s; check_input and validate_output each import
GX, compute_release imports Beam.

What is preloaded is code only: no spec, key, ledger or data is read here, and nothing is configured (every
setting is still resolved when a task runs, from the task's environment). The GX sandbox child that runs a
team's suites is a fresh, confined interpreter (``dpops.sandbox``), not a fork of this process, and keeps
its isolation. Set ``DPOPS_PRELOAD=0`` to turn the preload off (each task then imports what it needs).
"""

from __future__ import annotations

import importlib
import os
import sys

__all__: list[str] = []  # Airflow takes the module's public names as policies: this module defines none

PRELOAD_MODULES = (
    "great_expectations",
    "great_expectations.expectations",
    "apache_beam",
    "pipelines.release_pipeline",
    "dpops.orchestration",
    "dpops.release.gx_checks",
)


def is_scheduler(argv: list[str]) -> bool:
    """``airflow scheduler ...``: the process the LocalExecutor's workers and tasks are forked from."""
    return len(argv) > 1 and os.path.basename(argv[0]) == "airflow" and argv[1] == "scheduler"


def preload(modules: tuple[str, ...] = PRELOAD_MODULES) -> list[str]:
    """Import ``modules``; the names of those that could not be imported (a task then imports it itself and
    reports the error where it belongs: preloading never stops the scheduler)."""
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a missing optional module must not stop the scheduler
            failed.append(name)
    return failed


if is_scheduler(sys.argv) and os.environ.get("DPOPS_PRELOAD", "1") != "0":
    preload()
