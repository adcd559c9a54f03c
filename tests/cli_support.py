"""A daily release with a ledger, a key and a few days of input, for the CLI tests (no Beam job)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml
from test_runs import (  # the same stand-ins as the run tests
    FakePipeline,
    planner,
    write_input,
)

from dpops.release import computation
from dpops.release import preparation
from dpops.cli.main import main
from dpops.ledger import ScopeDefinition, open_ledger
from dpops.noise.randomness import NoiseKey

DAYS = ("2024-01-01", "2024-01-02", "2024-01-03", "2024-01-04")


@dataclass
class CliEnv:
    root: Path
    spec: Path
    url: str
    key: Path
    pipe: FakePipeline

    def base(self, day: str = "2024-01-01") -> list[str]:
        return ["--interval", day, "--key-file", str(self.key)]

    def run(self, capsys, *argv: str) -> tuple[int, str, str]:
        code = main(list(argv))
        out = capsys.readouterr()
        return code, out.out, out.err

    def json(self, capsys, *argv: str) -> tuple[int, dict, str]:
        code, out, err = self.run(capsys, *argv)
        return code, json.loads(out), err


def make_env(root: Path, monkeypatch, *, cap: float = 1.2, accountant: str = "basic/1",
             planner_fn=planner) -> CliEnv:
    """Spec ``purchases_test`` on a daily schedule, input for DAYS, scope ``shop`` (cap ``cap``): 0.5 per run."""
    doc = {
        "name": "purchases_test",
        "schedule": "0 0 * * *",
        "input": {"path": "data/{start:%Y-%m-%d}.parquet", "format": "parquet",
                  "columns": {"user_id": "string", "region": "string", "amount": "float"}},
        "privacy_unit": {"column": "user_id", "description": "a user's purchases", "adjacency": "add_remove"},
        "budget": {"scope": "shop", "epsilon": 0.5, "delta": 0},
        "contribution": {"max_partitions_per_unit": 1, "max_rows_per_unit_per_partition": 2},
        "partitions": {"columns": ["region"], "public": ["north", "south"]},
        "metrics": [{"type": "count"}, {"type": "sum", "column": "amount", "bounds": [0, 10]}],
    }
    spec = root / "spec.yaml"
    spec.write_text(yaml.safe_dump(doc))
    for d in DAYS:
        write_input(root, d)
    url = f"sqlite:///{root / 'ledger.sqlite'}"
    with open_ledger(url) as led:
        led.create_scope(ScopeDefinition(name="shop", unit="a user's purchases", unit_column="user_id",
                                         epsilon=cap, delta=1e-6, rho=None, accountant=accountant,
                                         adjacency="add_remove"), actor="test")
    key = root / "noise.key"
    NoiseKey.generate(key)
    pipe = FakePipeline()
    monkeypatch.setattr(computation, "_load_run_release", lambda: pipe)
    monkeypatch.setattr(preparation, "_default_planner", planner_fn)
    import dpops.release_plan

    monkeypatch.setattr(dpops.release_plan, "plan_release", planner_fn)  # dpops plan SPEC uses the same plan
    monkeypatch.delenv("DPOPS_LEDGER_URL", raising=False)
    monkeypatch.delenv("DPOPS_MANIFESTS_DIR", raising=False)
    monkeypatch.delenv("DPOPS_NOISE_KEY_FILE", raising=False)
    return CliEnv(root, spec, url, key, pipe)
