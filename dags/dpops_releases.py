"""Airflow DAG file: one DAG per dpops release spec in ``$DPOPS_SPECS_DIR``.

One bad spec must not take the other releases' DAGs down with it (an exception here
would drop every DAG of this file), so an invalid spec is skipped and reported as a
warning, which the dag-processor records for this file. Only when no spec at all can be
built is it an import error (``airflow dags list-import-errors``).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # the dag-processor adds the DAGs folder; other importers may not
    sys.path.insert(0, _HERE)

from dpops_dag_factory import build_release_dag, discover_specs  # noqa: E402

from dpops.errors import public_message  # noqa: E402

_specs = discover_specs()
_errors: list[str] = []
for _spec_path in _specs:
    try:
        _dag = build_release_dag(_spec_path)
    except Exception as _exc:  # noqa: BLE001 - see module docstring
        # Only dpops's own text (never a file's content); a foreign exception keeps only its class.
        _errors.append(f"{_spec_path}: {public_message(_exc)}")
        continue
    globals()[_dag.dag_id] = _dag

if _errors and len(_errors) == len(_specs):
    raise ImportError("no dpops release spec could be loaded: " + " | ".join(_errors))
if _errors:
    warnings.warn("dpops: skipped invalid release spec(s): " + " | ".join(_errors), stacklevel=1)
