"""Airflow DAG file: one DAG per loadable dpops release spec in ``$DPOPS_SPECS_DIR``.

Airflow records import errors per DAG *file*, and an exception here would drop every DAG of this
file. So this file builds the good specs' DAGs and says nothing about bad ones: the bad specs are
the import error of the sibling file ``dpops_spec_errors.py`` (``airflow dags list-import-errors``,
``/api/v2/importErrors``), one line per bad spec, while the good releases keep running. No warning
here: Airflow parses this file again in every task of every DAG, so a warning about one bad spec
would be in every other release's task logs (issue 21 item 14).
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # the dag-processor adds the DAGs folder; other importers may not
    sys.path.insert(0, _HERE)

from dpops_dag_factory import build_all, discover_specs

_dags, _ = build_all(discover_specs())  # the bad specs: dpops_spec_errors.py's import error
for _dag in _dags:
    globals()[_dag.dag_id] = _dag
