"""Issue 28 item 13: ``--json`` budget figures are the ones people read, and prose fits ``COLUMNS``.

1. A scope at its cap holds accountant slack (committed 4.4999999955, remaining 4.5e-09). The tables, the report
   and the Privacy budget page show 4.5 and 0 (``dpops.ledger.budget.format_budget``); ``--json`` showed the floats,
   so a script read "budget left" where every person was told there is none. Now every budget figure of a JSON
   document is the number people read (``budget_json``: remaining exactly 0 within the cap's resolution) and the
   exact float is under ``exact``.
2. Non-table output (outcome lines, ``spec check``, verification lines, errors on stderr) ignored ``COLUMNS``: lines
   up to 582 characters. Now it wraps at whitespace (``dpops.cli.common.say``); an id, a date or a URI longer than
   the line stays whole on its own line. Without ``COLUMNS`` on a pipe, lines stay whole (grep, logs).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_support import make_env
from test_runs import FakePlan

from dpops.cli.main import main
from dpops.events import Laplace
from dpops.ledger import RunKey, ScopeDefinition, open_ledger
from dpops.ledger.budget import format_budget

REPO = Path(__file__).resolve().parent.parent
SLACK = 1 - 1e-9  # dpops.release_plan.SAFETY: a plan's share is its declared epsilon times this


class SlackPlan(FakePlan):
    """0.5 per run as a real plan charges it: 0.5 * (1 - 1e-9)."""

    events = [Laplace(scale=2.0 / SLACK, l1_sensitivity=1.0)]


def cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def at_the_cap(tmp_path):
    """Cap 4.5 filled by nine runs of 0.5 * (1 - 1e-9): remaining is 4.5e-09, committed 4.4999999955."""
    url = f"sqlite:///{tmp_path}/l.sqlite"
    with open_ledger(url) as led:
        led.create_scope(ScopeDefinition(name="s", unit="u", unit_column="user_id", epsilon=4.5, delta=0.0, rho=None,
                                         accountant="basic", adjacency="add_remove"), actor="t")
        for day in range(1, 10):
            key = RunKey("daily", "spechash", f"2024-03-{day:02d}T00:00:00Z", f"2024-03-{day + 1:02d}T00:00:00Z",
                         "fp", "key1")
            rec = led.reserve(key, "s", [Laplace(scale=2.0 / SLACK, l1_sensitivity=1.0)], actor="t")
            led.start(rec.run_id, actor="t")
            led.commit(rec.run_id, output_uri=f"file:///out/{day}", actor="t")
        st = led.status("s")
    return url, st


def test_ledger_status_json_figures_are_the_tables_and_keep_the_exact_ones(tmp_path, capsys, monkeypatch):
    url, st = at_the_cap(tmp_path)
    assert 0 < st.remaining < 1e-8 and st.committed != 4.5
    code, out, _ = cli(capsys, "ledger", "--ledger", url, "status", "s", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["remaining"] == 0 and doc["committed"] == 4.5 and doc["total"] == 4.5, doc
    assert doc["cap"] == 4.5 and doc["sum_of_runs"] == 4.5
    assert doc["exact"]["remaining"] == st.remaining and doc["exact"]["committed"] == st.committed
    (bucket,) = doc["buckets"]
    assert bucket["remaining"] == 0 and bucket["committed"] == 4.5 and bucket["exact"]["total"] == st.total
    monkeypatch.setenv("COLUMNS", "200")
    code, table, _ = cli(capsys, "ledger", "--ledger", url, "status", "s")
    row = next(line for line in table.splitlines() if line.strip("│ ").startswith("* "))
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    for i, f in ((1, "committed"), (6, "total"), (8, "remaining")):  # JSON = what the table shows, to the digit
        assert format_budget(doc[f], doc["cap"]) == cells[i] == format_budget(doc["exact"][f], doc["cap"]), (f, cells)
    code, out, _ = cli(capsys, "ledger", "--ledger", url, "runs", "--json")
    runs = json.loads(out)["runs"]
    assert {r["epsilon"] for r in runs} == {0.5} and all(0.5 * (1 - 2e-9) < r["exact"]["epsilon"] < 0.5 for r in runs)


def test_budget_figure_rule():
    """One rule: the digits ``format_budget`` shows, 0 below the cap's resolution, None where it says inf."""
    from dpops.ledger.budget import budget_figure

    assert budget_figure(16.999999982991294, 17.0) == 17.0 and budget_figure(1.0005e-08, 17.0) == 0.0
    assert budget_figure(2e-5, 17.0) == 2e-5  # above the resolution: real budget, kept
    assert budget_figure(-0.5, 4.5) == -0.5 and budget_figure(None) is None and budget_figure(float("inf")) is None
    assert budget_figure(0.30000000000000004) == 0.3


@pytest.fixture
def slack_env(tmp_path, monkeypatch):
    return make_env(tmp_path, monkeypatch, cap=1.0, planner_fn=lambda spec: SlackPlan())


def test_release_outcome_and_refusal_json_at_the_cap(slack_env, capsys):
    env = slack_env
    u = ["--ledger", env.url, "--publish", "--no-gx-checks", "--json"]
    assert env.json(capsys, "release", "run", str(env.spec), *env.base("2024-01-01"), *u)[0] == 0
    code, doc, _ = env.json(capsys, "ledger", "reserve", str(env.spec), *env.base("2024-01-02"), "--ledger", env.url,
                            "--json")  # the reservation's line and JSON read the same figures
    assert code == 0 and doc["state"] == "reserved" and doc["scope_total"] == 1.0 and doc["scope_remaining"] == 0, doc
    assert 0 < 1.0 - doc["exact"]["scope_total"] < 1e-8
    code, doc, _ = env.json(capsys, "release", "run", str(env.spec), *env.base("2024-01-02"), *u)
    assert code == 0 and doc["state"] == "published"
    # charged when `ledger reserve` reserved it: the run's own ε is the figure that carries the slack
    assert doc["scope_remaining"] == 0 and doc["scope_total"] == 1.0 and doc["run_epsilon"] == 0.5, doc
    assert 0 < doc["exact"]["scope_remaining"] < 1e-8 and 0.5 * (1 - 2e-9) < doc["exact"]["run_epsilon"] < 0.5
    assert "remaining=0:" in doc["budget"] or "remaining" not in doc["budget"]
    code, doc, _ = env.json(capsys, "release", "run", str(env.spec), *env.base("2024-01-03"), *u)
    assert code == 5 and doc["scope_remaining"] == 0 and doc["exact"]["scope_remaining"] > 0, doc
    code, doc, _ = env.json(capsys, "release", "status", str(env.spec), "--interval", "2024-01-02", "--ledger",
                            env.url, "--json")
    assert code == 0 and doc["scope_total"] == 1.0 and {r["epsilon"] for r in doc["runs"]} == {0.5}, doc
    code, doc, _ = env.json(capsys, "plan", str(env.spec), "--from", "2024-01-01", "--to", "2024-01-05", "--ledger",
                            env.url, "--json")
    assert code == 0 and doc["scope_total_before"] == 1.0 and doc["per_run_cost"] == 0.5, doc
    assert 0 < 1.0 - doc["exact"]["scope_total_before"] < 1e-8
    assert {it["cost"] for it in doc["items"] if it["cost"]} == {0.5}


# --- 2. prose at COLUMNS -------------------------------------------------------------------------------------------


def check_width(text: str, width: int, what: str) -> None:
    """No line wider than ``width`` unless it is (a label and) one token that cannot fit."""
    for line in text.splitlines():
        if len(line) > width:
            words = line.split()
            assert len(words) <= 2 and max(map(len, words)) > width - 12, (
                f"{what}: a line of {len(line)} > {width} columns that could have wrapped:\n{line}")




@pytest.mark.parametrize("columns", [60, 80])
def test_non_table_output_wraps_at_columns(slack_env, capsys, monkeypatch, columns):
    env = slack_env
    u = ["--ledger", env.url]
    run = ["release", "run", str(env.spec), *u, "--publish", "--no-gx-checks", "--no-progress"]
    monkeypatch.delenv("COLUMNS", raising=False)
    code, whole, _ = env.run(capsys, *run, *env.base("2024-01-01"))
    assert code == 0 and len(whole.strip().splitlines()) == 1, whole  # a pipe without COLUMNS: one whole line
    assert len(whole) > columns
    monkeypatch.setenv("COLUMNS", str(columns))
    outputs = {
        "release run (outcome)": env.run(capsys, *run, *env.base("2024-01-02")),
        "release run (refused, stderr)": env.run(capsys, *run, *env.base("2024-01-03")),
        "release run (served)": env.run(capsys, *run, *env.base("2024-01-01")),
        "ledger verify": env.run(capsys, "ledger", "verify", *u),
        "manifest verify": env.run(capsys, "manifest", "verify",
                                   str(next((env.root / "out" / "manifests").rglob("*.published.json"))), *u),
        "spec check": env.run(capsys, "spec", "check", str(REPO / "examples" / "daily_purchases.yaml")),
        "gaps": env.run(capsys, "gaps", str(env.spec), "--from", "2024-01-01", "--to", "2024-01-03", *u),
        "key generate": env.run(capsys, "key", "generate", str(env.root / "k2.key")),
    }
    assert outputs["release run (refused, stderr)"][0] == 5
    for what, (_code, out, err) in outputs.items():
        check_width(out, columns, what)
        check_width(err, columns, what + " (stderr)")
    # the words survive the wrapping: the refusal still names both figures, the run id stays whole
    refused = " ".join(outputs["release run (refused, stderr)"][2].split())
    assert "budget refused" in refused and "cap epsilon=1," in refused and "0 left" in refused, refused
    published = outputs["release run (outcome)"][1]
    with open_ledger(env.url) as led:
        ids = [r.run_id for r in led.runs()]
    assert any(i in published for i in ids) or "outcome=published" in " ".join(published.split())
