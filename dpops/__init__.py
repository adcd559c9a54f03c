"""dpops: differentially private batch releases with a durable, global budget ledger.

The core library. It imports neither Airflow nor Beam: orchestration lives in
``dags/`` and the distributed compute in ``pipelines/``.
"""

__version__ = "0.1.0"
