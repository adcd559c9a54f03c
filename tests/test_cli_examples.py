"""The shipped examples run as they are with the shipped synthetic generator (issue 12).

Every ``examples/*.yaml`` is copied unchanged, given synthetic input by ``dpops spec synth``
(``dpops.testing.synthetic.generate_for_spec``), checked by ``dpops spec check`` and released in test mode
through the real pipeline (seeded noise, never publishable) against a scope with its unit definition.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dpops import release
from dpops.cli.main import main
from dpops.ledger import ScopeDefinition, open_ledger
from dpops.inputs import time_rule_of
from dpops.spec import load_spec

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.yaml"))
FIRST = {"day": ("2024-01-01", "2024-01-02"), "week": ("2024-01-01", "2024-01-08")}  # 2024-01-01 is a Monday


def test_there_are_examples():
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_checks_and_runs_on_synthetic_data(example, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DPOPS_DATA_ROOTS", raising=False)
    monkeypatch.delenv("DPOPS_MANIFESTS_DIR", raising=False)
    spec_path = tmp_path / example.name
    shutil.copy(example, spec_path)  # as shipped: not one field changed
    assert main(["spec", "check", str(spec_path), "--json"]) == 0
    checked = json.loads(capsys.readouterr().out)
    assert checked["ok"] is True and checked["release"] == load_spec(spec_path).name
    spec = load_spec(spec_path)
    period = spec.privacy_unit.period or "day"
    start, end = FIRST[period]
    # enough units per partition that private partition selection lets the common ones through
    assert main(["spec", "synth", str(spec_path), "--from", start, "--to", end, "--rows", "30000", "--users",
                 "5000", "--partitions", "3", "--json"]) == 0
    files = json.loads(capsys.readouterr().out)["files"]
    assert len(files) == 1 and Path(files[0]).is_file()
    if spec.public_partitions() is not None:  # the generator writes the spec's own partitions, nothing else
        cols = spec.partitions.columns
        if spec.input.format == "parquet":
            table = pq.read_table(files[0], columns=cols)
            seen = set(zip(*(table.column(c).to_pylist() for c in cols)))
            assert seen == set(spec.public_partitions())
    u = spec.privacy_unit
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    with open_ledger(url) as led:
        led.create_scope(ScopeDefinition(
            name=spec.budget.scope, unit=u.description, unit_column=u.column, epsilon=20.0, delta=1e-5, rho=None,
            accountant="rdp", adjacency=u.adjacency, record_level=bool(u.record_level), unit_period=u.period,
            bucket=u.period if spec.input.time_column else None, time_rule=time_rule_of(spec)), actor="test")
        out = release.execute_release(str(spec_path), start, end, ledger=led, randomness="test", test_seed=7,
                                   publish_output=False)
    assert out.state == "staged" and out.epsilon_charged > 0
    staged = Path(out.output_uri.removeprefix("file://"))
    table = pq.read_table(staged / "data.parquet")
    assert table.num_rows > 0
    for m in spec.metrics:
        if m.type in ("count", "sum", "mean"):
            assert m.key in table.column_names
    if spec.public_partitions() is not None:
        assert table.num_rows == len(spec.public_partitions())
