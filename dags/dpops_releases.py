"""Airflow DAG file: one DAG per loadable dpops release spec in ``$DPOPS_SPECS_DIR``.

Airflow records import errors per DAG *file*, and an exception here would drop every DAG of this
file. So this file builds the good specs' DAGs and only warns about bad ones; the bad specs are
the import error of the sibling file ``dpops_spec_errors.py`` (``airflow dags list-import-errors``,
``/api/v2/importErrors``), one line per bad spec, while the good releases keep running.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # the dag-processor adds the DAGs folder; other importers may not
    sys.path.insert(0, _HERE)

from dpops_dag_factory import build_all, discover_specs

_dags, _errors = build_all(discover_specs())
for _dag in _dags:
    globals()[_dag.dag_id] = _dag

if _errors:
    # Only dpops's own text (never a file's content); a foreign exception keeps only its class.
    warnings.warn("dpops: skipped invalid release spec(s), see the import error of dpops_spec_errors.py: "
                  + " | ".join(_errors), stacklevel=1)
