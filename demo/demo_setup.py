"""Paths, the release spec and the Airflow environment of the demo (imports no Airflow)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO_RELEASE = "demo_purchases"
DEMO_SCOPE = "demo_shoppers"
START = "2024-03-01"
EPSILON_PER_DAY = 1.0
SCOPE_CAP = 10.0  # fits exactly 10 daily releases under basic composition
REGIONS = [f"p{i}" for i in range(8)]  # the synthetic generator's partition labels, declared public

SPEC = f"""\
# dpops demo release: daily purchases per region over synthetic data.
name: {DEMO_RELEASE}
description: Daily purchases per region (synthetic demo data)
schedule: "0 0 * * *"
input:
  path: "data/purchases/{{start:%Y-%m-%d}}.parquet"
  format: parquet
  columns: {{user_id: string, region: string, amount: float, category: string}}
privacy_unit:
  column: user_id
  description: "a shopper's purchases on one day"
  adjacency: add_remove
  record_level: false
budget:
  scope: {DEMO_SCOPE}
  epsilon: {EPSILON_PER_DAY}
  delta: 0
  noise: laplace
contribution:
  max_partitions_per_unit: 3
  max_rows_per_unit_per_partition: 2
partitions:
  columns: [region]
  public: [{", ".join(REGIONS)}]
metrics:
  - {{type: count}}
  - {{type: unit_count}}
  - {{type: sum, column: amount, bounds: [0, 100]}}
  - {{type: mean, column: amount, bounds: [0, 100]}}
postprocess: {{non_negative: true, integer_counts: true, clamp_means_to_bounds: true, suppress_below: null}}
output:
  root: "out"
# What the release must achieve (dpops plan checks these before the first run; docs/accuracy.md)
accuracy:
  confidence: 0.95
  targets:
    - {{kind: error, metric: count, max_relative_error: 0.1, at_units: 1000}}
    - {{kind: error, metric: mean_amount, max_error: 6.0, at_units: 1000}}
"""


@dataclass(frozen=True)
class DemoPaths:
    root: Path

    @property
    def airflow_home(self) -> Path:
        return self.root / "airflow"

    @property
    def specs_dir(self) -> Path:
        return self.root / "release"  # the spec, its data/ and its out/ (outputs live below the spec)

    @property
    def spec_path(self) -> Path:
        return self.specs_dir / f"{DEMO_RELEASE}.yaml"

    @property
    def data_dir(self) -> Path:
        return self.specs_dir / "data" / "purchases"

    @property
    def output_root(self) -> Path:
        return self.specs_dir / "out"

    @property
    def manifests_dir(self) -> Path:
        return self.output_root / "manifests" / DEMO_RELEASE

    @property
    def key_path(self) -> Path:
        return self.root / "secrets" / "noise.key"

    @property
    def ledger_url(self) -> str:
        return f"sqlite:///{self.root / 'ledger.sqlite'}"

    @property
    def task_log(self) -> Path:
        return self.root / "airflow-tasks.log"


def airflow_environment(paths: DemoPaths) -> dict[str, str]:
    home = paths.airflow_home
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "false",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "WARNING",
        "DPOPS_SPECS_DIR": str(paths.specs_dir),
        "DPOPS_LEDGER_URL": paths.ledger_url,
        "DPOPS_NOISE_KEY_FILE": str(paths.key_path),
        "DPOPS_RANDOMNESS": "keyed",
        "DPOPS_MANIFESTS_DIR": str(paths.manifests_dir),
        "DPOPS_TASK_RETRIES": "1",
        "DPOPS_RETRY_DELAY_SECONDS": "0",
        "GX_ANALYTICS_ENABLED": "false",
        "SCARF_ANALYTICS": "false",
        "DO_NOT_TRACK": "true",
    }
