"""Airflow DAG file that defines no DAG: it fails to import while a dpops release spec cannot be loaded.

A spec that does not load must be visible where operators look for broken DAGs (``airflow dags
list-import-errors``, ``/api/v2/importErrors``, the UI banner), not only as a warning line in the
dag-processor log. Airflow keys import errors by file, so this file carries them (one line per bad
spec, naming the file and what to fix, never its content) while ``dpops_releases.py`` keeps the good
specs' DAGs alive. It parses the same specs the same way (``build_all``).
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from dpops_dag_factory import build_all, discover_specs

_, _errors = build_all(discover_specs(), register=False)  # the DAGs themselves belong to dpops_releases.py
if _errors:
    raise ImportError(f"dpops: {len(_errors)} release spec(s) could not be loaded; their DAGs are missing until "
                      "fixed:\n" + "\n".join(f"- {e}" for e in _errors))
