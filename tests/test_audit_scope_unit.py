"""The auditor's view of issue 11 item 1: a record-level release in a user scope really spends more.

One user with 40 rows moves a record-level count by 40 against noise calibrated for 1; the audit
against the scope's unit (the user) shows an ε far above the claim, and dpops refuses the release
on that scope before any reservation. The same spec on a record-level scope is not refused.
"""

from __future__ import annotations

from dpops.audit.scope_unit import audit_against_scope
from dpops.audit.suite import mechanism_spec
from dpops.ledger import ScopeDefinition


def _scope(**kw):
    return ScopeDefinition(**{"name": "audit", "unit": "a user", "unit_column": "user", "epsilon": 10.0,
                              "delta": 1e-6, "rho": None, "accountant": "basic/1", "adjacency": "add_remove", **kw})


def _record_level_count():
    import yaml

    from dpops.spec import parse_spec

    base = mechanism_spec("count")
    doc = base.canonical_document()
    doc["privacy_unit"]["record_level"] = True
    doc["contribution"] = {"max_partitions_per_unit": 1, "max_rows_per_unit_per_partition": 1}
    doc["privacy_unit"]["column"] = base.privacy_unit.column
    return parse_spec(yaml.safe_load(yaml.safe_dump(doc)))


def test_record_level_release_in_a_user_scope_fails_the_audit_and_is_refused():
    spec = _record_level_count()
    res = audit_against_scope(spec, _scope(), rows_per_unit=40, trials=2000, seed=3)
    assert res.refused and len(res.reasons) == 1 and "record_level is true" in res.reasons[0]
    (r,) = res.results
    # claimed eps = 1 per the plan; a 40-row user makes the count move by 40 Laplace scales
    assert not r.passed and r.epsilon_lb > 2.0, r


def test_same_release_on_a_record_level_scope_is_accepted():
    spec = _record_level_count()
    res = audit_against_scope(spec, _scope(record_level=True, unit="a row"))
    assert not res.refused and res.results == [] and res.passed


def test_cli_audit_scope(tmp_path, capsys):
    import json

    import yaml

    from dpops.cli.main import main
    from dpops.ledger import open_ledger

    spec = _record_level_count()
    doc = spec.canonical_document()
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(doc))
    url = f"sqlite:///{tmp_path / 'l.sqlite'}"
    with open_ledger(url) as led:
        led.create_scope(_scope(), actor="t")
    code = main(["audit", "scope", str(path), "--ledger", url, "--trials", "1000", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 7 and out["refused"] and not out["results"][0]["passed"]
