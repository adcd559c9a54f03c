"""The example notebook (examples/planning_notebook.py, percent format) runs end to end and plots: plan, solve,
simulate on a public sample (its predictions must hold), estimate the bounds (charged, test mode), the horizon."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "planning_notebook.py"


def test_planning_notebook_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DPOPS_NOTEBOOK_OUT", str(tmp_path))
    # the notebook declares its sample's directory public (it plays the operator); restored after the test
    monkeypatch.setenv("DPOPS_PUBLIC_ROOTS", str(tmp_path / "public"))
    for v in ("DPOPS_DATA_ROOTS", "DPOPS_LEDGER_URL"):
        monkeypatch.delenv(v, raising=False)
    runpy.run_path(str(NOTEBOOK), run_name="__main__")
    out = capsys.readouterr().out
    assert "feasible: True" in out and "intervals fit" in out
    assert (tmp_path / "planning.png").stat().st_size > 1000
    # simulate: the predictions held on the sample (the notebook asserts it too) and the plot was written
    assert "simulate: predictions hold" in out and "partition_selection" in out
    assert (tmp_path / "simulate" / "simulation.png").stat().st_size > 5000
    doc = json.loads((tmp_path / "simulate" / "simulation.json").read_text())
    assert doc["holds"] is True and doc["publishable"] is False and doc["draws"] == 1000
    assert {r["metric"] for r in doc["rows"]} == {"count", "mean_amount", "partition_selection"}
    # estimate: charged to the notebook's scope, bounds for the amount
    assert "estimated:" in out and "charged epsilon 0.5" in out
