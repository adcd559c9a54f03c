"""The example notebook (examples/planning_notebook.py, percent format) runs end to end and plots."""

from __future__ import annotations

import runpy
from pathlib import Path

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "planning_notebook.py"


def test_planning_notebook_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DPOPS_NOTEBOOK_OUT", str(tmp_path))
    runpy.run_path(str(NOTEBOOK), run_name="__main__")
    out = capsys.readouterr().out
    assert "feasible: True" in out and "intervals fit" in out
    assert (tmp_path / "planning.png").stat().st_size > 1000
