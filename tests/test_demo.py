"""``make demo`` end to end (README's first command): the real script, a real DAG run per interval.

The demo is the README's first promise, so it gets its own test: it runs ``demo/run_demo.py`` (what
``make demo`` runs) on a smaller fortnight (12 days of 1,000 rows; the cap fits 10 daily releases, so
the backfill still crosses the cap), at an 80-column terminal, and then runs it again, as its docstring
says is safe: the second run charges nothing and leaves the ledger's totals as they were.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ARGS = ["--days", "12", "--scheduled-days", "2", "--rows-per-day", "1000"]


def _run_demo(out: Path) -> str:
    env = {**os.environ, "COLUMNS": "80", "GX_ANALYTICS_ENABLED": "false", "SCARF_ANALYTICS": "false",
           "DO_NOT_TRACK": "true"}
    env.pop("AIRFLOW_HOME", None)  # the demo sets its own
    proc = subprocess.run([sys.executable, str(REPO / "demo" / "run_demo.py"), "--out", str(out), *ARGS],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, f"demo exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def _status(out: Path) -> dict[str, float]:
    from dpops.ledger import open_ledger

    with open_ledger(f"sqlite:///{out / 'ledger.sqlite'}") as ledger:
        st = ledger.status("demo_shoppers")
        return {"committed": st.committed, "reserved": st.reserved, "started": st.started,
                "spent_unpublished": st.spent_unpublished}


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_demo_end_to_end_then_again_for_free(tmp_path: Path) -> None:
    out = tmp_path / "demo-output"
    first = _run_demo(out)

    # 0. the plan with its targets comes before the first release
    assert first.index("Plan before spending") < first.index("1. Daily schedule")
    assert "accuracy targets at the declared budget" in first
    # the backfill crosses the cap: 10 intervals published, 2 refused, nothing else
    progress = re.findall(r"\[\s*\d+/12\] (\d{4}-\d\d-\d\d)\s+(\w+)\s+epsilon charged ([\d.]+)", first)
    backfill = progress[2:]  # the first two lines are the daily schedule
    assert [o for _, o, _ in backfill].count("refused") == 2, first
    assert all(float(c) == 0 for _, o, c in backfill if o in ("served", "refused")), first
    words = " ".join(first.split())  # prose wraps at 80 columns; compare its words
    assert "10 published, all verified" in words
    assert "FAILED" not in first
    # the command a reader copies names a manifest that exists, whole on one line
    check = next(line for line in first.splitlines() if "check one: dpops manifest verify" in line)
    manifest = check.split("verify ", 1)[1].split(" --ledger")[0]
    assert Path(manifest).is_file(), check
    # at 80 columns only lines that carry one unbroken path or command may be longer, never a table row
    for line in first.splitlines():
        if len(line) > 80:
            assert str(tmp_path) in line and not line.lstrip().startswith(("│", "┃", "┡", "└", "┏")), line
    # a refusal's reason is one short line in the table, not a column of fragments
    rows = [line for line in first.splitlines() if line.startswith("│")]
    assert sum("budget: epsilon 0" in line for line in rows) == 2, first
    assert not any("ScopeBudgetExceeded" in line for line in rows), first
    assert (out / "report.html").is_file()

    before = _status(out)
    again = _run_demo(out)
    progress = re.findall(r"\[\s*\d+/12\] (\d{4}-\d\d-\d\d)\s+(\w+)\s+epsilon charged ([\d.]+)", again)
    assert progress and all(float(c) == 0 for _, _, c in progress), again
    assert {o for _, o, _ in progress} <= {"served", "refused"}, again
    assert _status(out) == before
