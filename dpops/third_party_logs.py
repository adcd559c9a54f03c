"""Third-party loggers quieted where dpops imports their libraries (issue 21 item 13), one owner for the policy.

Measured: 209 of 223 lines of a check_input/validate_output task log were Great Expectations INFO; every
``dpops release run`` printed ``INFO:great_expectations.data_context.types.base:Created temporary directory
'...' for ephemeral docs site`` (GX's ephemeral context, ``dpops.release.gx_checks``) and Beam's root-logger
"apitools not found, and bigquery client libraries are not available" warning, even with ``--no-progress``.
Levels are set per logger, so dpops' own warnings (``dpops.*`` loggers) always show; the root logger keeps
its level and only drops Beam's own sub-ERROR records.

Called by the code that imports the library, right before (Beam: its warnings are import-time) or right
after the import (GX: its ``data_context/types/base.py`` does ``logger.setLevel(logging.INFO)`` when
imported, so that logger also gets a filter, which an import does not reset). Idempotent.
"""

from __future__ import annotations

import logging
import os

# Third-party loggers whose INFO/WARNING lines drown a task log (measured: 209 of 223 lines of a
# check_input/validate_output log were Great Expectations INFO; every task printed Beam's optional
# GCP-client import warnings). Levels are set per logger so dpops' own warnings still show.
NOISY_LOGGERS: dict[str, int] = {
    "great_expectations": logging.WARNING,
    "great_expectations.core": logging.WARNING,
    "great_expectations.data_context": logging.WARNING,
    "great_expectations.expectations": logging.WARNING,
    "great_expectations.datasource": logging.WARNING,
    "apache_beam.io.gcp": logging.ERROR,
    "apache_beam.internal.gcp": logging.ERROR,
    "apache_beam.runners.interactive": logging.ERROR,
    "apitools": logging.ERROR,
    "google.auth": logging.ERROR,
    "root.apache_beam": logging.ERROR,
}


# Loggers that set their own level when their module is imported (great_expectations'
# data_context/types/base.py does ``logger.setLevel(logging.INFO)``), overriding a level set
# earlier: they also get a per-logger filter, which an import does not reset.
LEVEL_RESETTING_LOGGERS: dict[str, int] = {"great_expectations.data_context.types.base": logging.WARNING}


class _MinLevel(logging.Filter):
    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level


class _BeamRootRecords(logging.Filter):
    """Beam modules that log through the ROOT logger (``logging.warning(...)`` in
    apache_beam/io/gcp/internal/clients/bigquery/__init__.py: "apitools not found, and bigquery client
    libraries are not available") below ERROR. A filter on the root logger sees only records logged
    directly on it, never those of named loggers (dpops logs only through ``dpops.*`` loggers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        path = record.pathname.replace(os.sep, "/")
        return not (record.name == "root" and "/apache_beam/" in path and record.levelno < logging.ERROR)


def quiet_third_party_loggers() -> None:
    """Raise the level of the noisy third-party loggers (never dpops'; the root logger keeps its level and
    only drops Beam's own sub-ERROR records)."""
    root = logging.getLogger()
    if not any(isinstance(f, _BeamRootRecords) for f in root.filters):
        root.addFilter(_BeamRootRecords())
    for name, level in NOISY_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    for name, level in LEVEL_RESETTING_LOGGERS.items():
        lg = logging.getLogger(name)
        lg.setLevel(level)
        if not any(isinstance(f, _MinLevel) for f in lg.filters):
            lg.addFilter(_MinLevel(level))
