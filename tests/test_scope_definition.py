"""Issue 11 item 1: a scope records the whole unit definition and refuses a release with another one.

Each refusal happens before any reservation: the ledger holds no run afterwards.
"""

from __future__ import annotations

import json

import pytest
import yaml

from dpops import release
from dpops.errors import SpecError
from dpops.ledger import ScopeDefinition, open_ledger
from tests.test_runs import IV, FakeKey, FakePipeline, planner, write_input

BASE_UNIT = {"column": "user_id", "description": "a user's purchases", "adjacency": "add_remove"}


def _spec(tmp_path, **unit):
    doc = {
        "name": "purchases_test",
        "input": {"path": "data/{start:%Y-%m-%d}.parquet", "format": "parquet",
                  "columns": {"user_id": "string", "region": "string", "amount": "float"}},
        "privacy_unit": {**BASE_UNIT, **unit},
        "budget": {"scope": "shop", "epsilon": 0.5, "delta": 0},
        "contribution": {"max_partitions_per_unit": 1, "max_rows_per_unit_per_partition": 1},
        "partitions": {"columns": ["region"], "public": ["north", "south"]},
        "metrics": [{"type": "count"}],
    }
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(doc))
    write_input(tmp_path)
    return p


def _scope(**kw):
    base = dict(name="shop", unit="a user's purchases", unit_column="user_id", epsilon=5.0, delta=1e-6, rho=None,
                accountant="basic/1", adjacency="add_remove")
    base.update(kw)
    return ScopeDefinition(**base)


@pytest.fixture
def ledger(tmp_path):
    led = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    yield led
    led.close()


def _run(spec, ledger):
    return release.execute_release(spec, *IV, ledger=ledger, key=FakeKey(), run_release=FakePipeline(), planner=planner)


@pytest.mark.parametrize("scope_kw, unit_kw, needle", [
    # record-level release (each row a unit) in a scope whose unit is one user: refused
    ({}, {"record_level": True}, "privacy_unit.record_level is true but scope 'shop' protects whole units"),
    # the reverse: a user-level release charged to a record-level scope
    ({"record_level": True}, {}, "scope 'shop' is record-level"),
    # adjacency mismatch in both directions
    ({}, {"adjacency": "replace"}, "privacy_unit.adjacency 'replace' differs"),
    ({"adjacency": "replace"}, {}, "privacy_unit.adjacency 'add_remove' differs"),
    # a user-day release in a (non-bucketed) scope protecting users
    ({}, {"period": "day"}, "privacy_unit.period 'day' differs"),
    ({"unit_period": "day"}, {}, "privacy_unit.period None differs"),
    # a scope from before adjacency was recorded: cannot be checked, so refused
    ({"adjacency": None}, {}, "created before scopes recorded their adjacency"),
])
def test_unit_definition_mismatch_is_refused_before_reservation(tmp_path, ledger, scope_kw, unit_kw, needle):
    ledger.create_scope(_scope(**scope_kw), actor="test")
    spec = _spec(tmp_path, **unit_kw)
    with pytest.raises(SpecError) as err:
        _run(spec, ledger)
    assert needle in str(err.value) and "nothing was reserved" in str(err.value)
    assert ledger.runs() == []
    assert ledger.status("shop").total == 0


def test_matching_definition_is_charged(tmp_path, ledger):
    ledger.create_scope(_scope(record_level=True, adjacency="replace"), actor="test")
    spec = _spec(tmp_path, record_level=True, adjacency="replace")
    out = _run(spec, ledger)
    assert out.state == "published" and out.epsilon_charged == pytest.approx(0.5)
    m = json.loads(next((tmp_path / "out/manifests/purchases_test").glob("*.published.json")).read_text())
    assert m["privacy"]["scope"]["definition"] == {"unit_column": "user_id", "record_level": True,
                                                   "adjacency": "replace", "period": None, "bucket": None,
                                                   "time": None}


def test_legacy_scope_definition_reads_back_byte_identical():
    """A scope stored before adjacency/record_level existed re-serialises exactly (ledger verify compares it)."""
    legacy = {"name": "old", "unit": "u", "unit_column": "user_id", "epsilon": 1.0, "delta": 0.0, "rho": None,
              "accountant": "basic/1", "bucket": None, "population": None, "owner": "", "description": "",
              "unit_period": None}
    s = ScopeDefinition.from_dict(legacy)
    assert s.adjacency is None and s.record_level is False
    assert s.to_dict() == legacy
    assert ScopeDefinition.from_dict(_scope().to_dict()).adjacency == "add_remove"



def test_legacy_scope_in_a_ledger_still_verifies(ledger):
    import dataclasses

    legacy = dataclasses.replace(_scope(), adjacency=None)
    ledger.create_scope(legacy, actor="test")
    stored = ledger.db.one("SELECT definition FROM scopes WHERE name = ?", ("shop",))[0]
    assert "adjacency" not in stored and "record_level" not in stored  # the pre-change stored form
    assert ledger.verify().ok


def test_scope_show_lists_the_definition(tmp_path, capsys, monkeypatch):
    from dpops.cli.main import main

    monkeypatch.setenv("COLUMNS", "300")  # rich would abbreviate the table's cells

    url = f"sqlite:///{tmp_path / 'l.sqlite'}"
    assert main(["ledger", "--ledger", url, "scope", "create", "rl", "--unit", "a row", "--unit-column", "row_id",
                 "--epsilon", "1", "--delta", "0", "--accountant", "basic", "--adjacency", "replace",
                 "--record-level"]) == 0
    capsys.readouterr()
    assert main(["ledger", "--ledger", url, "scope", "show", "rl", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["scopes"][0]
    assert shown["adjacency"] == "replace" and shown["record_level"] is True and shown["unit_column"] == "row_id"
    assert main(["ledger", "--ledger", url, "scope", "show"]) == 0
    text = capsys.readouterr().out
    assert "replace" in text and "yes" in text
    # --adjacency is required: a new scope always records it
    assert main(["ledger", "--ledger", url, "scope", "create", "x", "--unit", "u", "--unit-column", "u",
                 "--epsilon", "1", "--delta", "0", "--accountant", "basic"]) != 0


def test_manifest_verify_detects_an_edited_unit_definition(tmp_path, ledger):
    from dpops.manifest import read_manifest
    from dpops.manifest.scope import replay_position

    ledger.create_scope(_scope(), actor="test")
    out = _run(_spec(tmp_path), ledger)
    m = read_manifest(next((tmp_path / "out/manifests/purchases_test").glob(f"{out.run_id}*.json")))
    _, problems = replay_position(ledger, m["privacy"]["scope"])
    assert problems == []
    edited = {**m["privacy"]["scope"], "definition": {**m["privacy"]["scope"]["definition"], "record_level": True}}
    _, problems = replay_position(ledger, edited)
    assert any(p.startswith("privacy.scope.definition") for p in problems)
