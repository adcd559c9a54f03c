"""``dpops release`` and ``dpops spec check`` through ``dpops.cli.main.main``: exit codes and output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dpops.release import computation
from dpops.release import preparation
from dpops.cli.main import main
from dpops.ledger import ScopeDefinition, open_ledger
from dpops.noise.randomness import NoiseKey

from test_runs import FakePipeline, planner, write_input  # the same stand-ins as the run tests

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "daily_purchases.yaml"


@pytest.fixture
def cli_env(tmp_path, monkeypatch):
    doc = {
        "name": "purchases_test",
        "input": {"path": "data/{start:%Y-%m-%d}.parquet", "format": "parquet",
                  "columns": {"user_id": "string", "region": "string", "amount": "float"}},
        "privacy_unit": {"column": "user_id", "description": "a user's purchases on one day", "adjacency": "add_remove"},
        "budget": {"scope": "shop", "epsilon": 0.5, "delta": 0},
        "contribution": {"max_partitions_per_unit": 1, "max_rows_per_unit_per_partition": 2},
        "partitions": {"columns": ["region"], "public": ["north", "south"]},
        "metrics": [{"type": "count"}, {"type": "sum", "column": "amount", "bounds": [0, 10]}],
    }
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(doc))
    write_input(tmp_path)
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    led = open_ledger(url)
    led.create_scope(ScopeDefinition(name="shop", unit="a user's purchases", unit_column="user_id",
                                     epsilon=0.7, delta=1e-6, rho=None, accountant="basic/1",
                                     adjacency="add_remove"), actor="test")
    led.close()
    key = tmp_path / "noise.key"
    NoiseKey.generate(key)
    pipe = FakePipeline()
    monkeypatch.setattr(computation, "_load_run_release", lambda: pipe)
    monkeypatch.setattr(preparation, "_default_planner", planner)
    base = ["--interval", "2024-01-01/2024-01-02", "--ledger", url, "--key-file", str(key)]
    return tmp_path, spec, url, base, pipe


def test_run_publish_then_rerun_and_status(cli_env, capsys):
    tmp, spec, url, base, pipe = cli_env
    assert main(["release", "run", str(spec), *base, "--publish", "--no-gx-checks", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["state"] == "published" and out["epsilon_charged"] == pytest.approx(0.5)
    assert out["scope_remaining"] == pytest.approx(0.2)
    assert main(["release", "run", str(spec), *base, "--publish", "--no-gx-checks"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("release=purchases_test interval=2024-01-01T00:00:00+00:00/2024-01-02T00:00:00+00:00 "
                           "outcome=already_published epsilon_charged=0")
    assert pipe.calls == 1
    assert main(["release", "status", str(spec), "--interval", "2024-01-01/2024-01-02", "--ledger", url, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["published_run"] == out["run_id"] and st["runs"][0]["state"] == "committed"


def test_stage_without_publish_then_publish(cli_env, capsys):
    tmp, spec, url, base, pipe = cli_env
    assert main(["release", "run", str(spec), *base]) == 0
    assert "outcome=staged" in capsys.readouterr().out
    assert not (tmp / "out/published").exists()
    assert main(["release", "run", str(spec), *base, "--publish", "--no-gx-checks"]) == 0
    assert "outcome=published" in capsys.readouterr().out and pipe.calls == 1


def test_gx_checks_run_on_publish(cli_env, capsys):
    tmp, spec, url, base, pipe = cli_env
    assert main(["release", "run", str(spec), *base, "--publish"]) == 0
    assert "outcome=published" in capsys.readouterr().out


def test_exit_codes(cli_env, capsys, monkeypatch):
    tmp, spec, url, base, pipe = cli_env
    bad = tmp / "bad.yaml"
    doc = yaml.safe_load(spec.read_text())
    doc["budget"]["epsilon"] = 0
    bad.write_text(yaml.safe_dump(doc))
    assert main(["release", "run", str(bad), *base]) == 3
    assert "bad.yaml: budget.epsilon" in capsys.readouterr().err
    assert main(["release", "run", str(spec), *base[:1], "2024-02-01/2024-02-02", *base[2:]]) == 4
    assert "2024-02-01.parquet does not exist" in capsys.readouterr().err
    # budget: cap 0.7, each run 0.5
    assert main(["release", "run", str(spec), *base, "--publish", "--no-gx-checks"]) == 0
    write_input(tmp, "2024-01-02")
    assert main(["release", "run", str(spec), "--interval", "2024-01-02/2024-01-03", *base[2:]]) == 5
    capsys.readouterr()
    # ledger unreachable
    assert main(["release", "run", str(spec), *base[:2], "--ledger", "postgresql://postgres@127.0.0.1:1/x",
                 *base[4:]]) == 6
    # changed input without restate -> refused (6), restate -> published
    write_input(tmp, amounts=(9.0, 9.0, 9.0, 9.0))
    assert main(["release", "run", str(spec), *base, "--publish"]) == 6
    assert "dpops release restate" in capsys.readouterr().err
    # internal error -> 1 with one line
    def boom(req):
        raise ZeroDivisionError("boom")
    monkeypatch.setattr(computation, "_load_run_release", lambda: boom)
    assert main(["release", "run", str(spec), "--interval", "2024-01-05/2024-01-06", *base[2:]]) == 4  # no input
    write_input(tmp, "2024-01-05")
    led = open_ledger(url)
    led.change_cap("shop", epsilon=10.0, reason="test", actor="test")
    led.close()
    assert main(["release", "run", str(spec), "--interval", "2024-01-05/2024-01-06", *base[2:]]) == 1
    assert "internal error" in capsys.readouterr().err


def test_restate_cli(cli_env, capsys):
    tmp, spec, url, base, pipe = cli_env
    assert main(["release", "run", str(spec), *base, "--publish", "--no-gx-checks", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    write_input(tmp, amounts=(9.0, 9.0, 9.0, 9.0))
    led = open_ledger(url)
    led.change_cap("shop", epsilon=2.0, reason="test", actor="test")
    led.close()
    assert main(["release", "restate", str(spec), *base, "--no-gx-checks", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["restates"] == first["run_id"] and out["state"] == "published"


def test_spec_check(capsys, tmp_path):
    assert main(["spec", "check", str(EXAMPLE), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["release"] == "daily_purchases" and sum(doc["epsilon_split"].values()) == pytest.approx(1.0)
    assert main(["spec", "check", str(EXAMPLE)]) == 0
    assert "valid release spec 'daily_purchases'" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(EXAMPLE.read_text().replace("bounds: [0, 100]}", "bounds: [5, 1]}", 1))
    assert main(["spec", "check", str(bad)]) == 3
    assert "bad.yaml: metrics[2].bounds: lower bound 5.0 is greater than upper bound 1.0" in capsys.readouterr().err


def test_abandon_cli(cli_env, capsys):
    tmp, spec, url, base, pipe = cli_env
    assert main(["release", "run", str(spec), *base]) == 0  # staged, started, not published
    capsys.readouterr()
    assert main(["release", "abandon", str(spec), *base, "--reason", "operator test", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "spent_unpublished"
