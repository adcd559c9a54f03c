"""The one owner of the Airflow DAG naming rule: one DAG ``dpops_<release>`` per release spec.

The DAG factory (``dags/dpops_dag_factory.py``) names its DAGs with ``dag_id_for``; the Privacy budget
plugin (``dpops.budget_view``) maps a DAG run back to its release with ``release_of_dag``. A module of its own,
importing nothing, because the DAG factory calls it while Airflow parses DAG files (parsing must not import
the ledger, the key or the release code: ``tests/test_dags.py``).
"""

from __future__ import annotations

DAG_ID_PREFIX = "dpops_"


def dag_id_for(release: str) -> str:
    """The Airflow DAG id of ``release``'s DAG."""
    return f"{DAG_ID_PREFIX}{release}"


def release_of_dag(dag_id: str) -> str | None:
    """The release a dpops DAG publishes (``dag_id_for``'s inverse), or None for any other DAG."""
    if not dag_id.startswith(DAG_ID_PREFIX):
        return None
    return dag_id[len(DAG_ID_PREFIX):] or None
