"""dpops: differentially private batch releases with a durable, global budget ledger.

The core library. It imports neither Airflow nor Beam: orchestration lives in ``dags/`` and the
distributed compute in ``pipelines/``. Where to look, by concern:

- privacy accounting: ``events`` (the privacy-event algebra and its stable JSON), ``accounting/``
  (basic, zCDP, RDP, PLD accountants behind one interface);
- noise: ``noise/`` (randomness, exact samplers, sensitivity, calibration, mechanisms, selection);
- what a release is: ``spec`` (strict spec models and loading), ``release_plan`` (a spec's mechanisms
  and events), ``inputs`` (the input files of a run and their keyed fingerprint), ``dataroots`` (the operator's
  data, public and output roots), ``keyref`` (noise key files and references);
- running one release: ``release/`` (prepare, reserve, compute, publish as idempotent steps with the
  ledger between them), ``orchestration`` (what the DAG tasks call), ``dag_ids``;
- validation: ``gx_suites`` (team suites parsed against an allow-list), ``sandbox`` (the confined
  child that runs them), ``gx_project``, ``gx_docs``;
- storage: ``storage/`` (local and object-store backends behind one interface);
- the budget: ``ledger/`` (SQLite and PostgreSQL, hash-chained entries, roles, checkpoints),
  ``gaps``, ``budget_view`` (the Airflow page's model);
- evidence: ``manifest/`` (build, sign, verify), ``report/``, ``audit/`` (the empirical auditor);
- planning: ``analysis/`` (predicted accuracy, targets, tuning, private bound estimation);
- interfaces: ``cli/``, ``errors`` (exceptions and exit-code classes);
- ``testing/``: fault points and synthetic data for tests, benchmarks and the demo.
"""

__version__ = "0.1.0"
