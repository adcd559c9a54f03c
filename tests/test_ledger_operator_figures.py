"""Issue 21 items 1, 8 and 9: what an operator running dpops every day reads.

1. ``deploy/ledger-init.sh`` (the compose ``ledger-init`` one-shot) run again after the runbook's
   ``dpops ledger cap example --epsilon 14`` exits 0, leaves the cap alone and says so; a scope whose
   definition really differs is still refused, naming commands (not Python functions).
8. Figures at the precision that means something: a scope at its cap shows ``remaining 0`` and
   ``committed 4.5``, a refusal's numbers agree with each other, the report shows the CLI's figure.
9. A run charged before the ledger stopped answering says it is started and charged, and that the total
   could not be read, instead of "charged ε=0 ... total unknown".
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dpops.cli.main import main
from dpops.errors import LedgerError
from dpops.events import Laplace
from dpops.ledger import RunKey, ScopeBudgetExceeded, ScopeDefinition, open_ledger
from dpops.ledger.budget import format_budget
from dpops.ledger.store import Ledger
from dpops.release import computation

from pg_roles_support import catalog_execute, ledger_roles
from test_cli_release import cli_env  # noqa: F401  (fixture: a spec, a SQLite ledger, a fake pipeline)

REPO = Path(__file__).resolve().parent.parent
INIT = REPO / "deploy" / "ledger-init.sh"
DAY = "2024-03-{:02d}T00:00:00Z"


def cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def key(day):
    return RunKey("daily_counts", "spechash", DAY.format(day), DAY.format(day + 1), "fp", "key1")


def _drop_role(postgres_url: str, role: str) -> None:
    import psycopg

    with psycopg.connect(postgres_url, autocommit=True) as admin:
        if admin.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone():
            catalog_execute(admin, f'DROP OWNED BY "{role}"')
            catalog_execute(admin, f'DROP ROLE "{role}"')


def run_init(env):
    return subprocess.run(["sh", str(INIT)], env=env, capture_output=True, text=True, timeout=120)


# --- item 1 ------------------------------------------------------------------------------------------------------


@pytest.mark.postgres
def test_ledger_init_is_idempotent_after_a_cap_raise(postgres_url, capsys, request):
    with ledger_roles(postgres_url, "t_init") as r:
        owner_url = r.owner_url
        # ledger-init.sh also grants the api-server's reader role (deploy/ledger-roles.sql creates it)
        reader = f"{r.app}_reader"
        r.admin.execute(f'CREATE ROLE "{reader}" LOGIN NOSUPERUSER NOINHERIT')
        request.addfinalizer(lambda: _drop_role(postgres_url, reader))
        env = {**os.environ, "DPOPS_LEDGER_URL": owner_url, "DPOPS_LEDGER_APP_ROLE": r.app,
               "DPOPS_LEDGER_READER_ROLE": reader,
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        first = run_init(env)
        assert first.returncode == 0, first.stderr
        assert "scope example created: cap epsilon=10" in first.stdout
        again = run_init(env)  # a plain restart: nothing to do
        assert again.returncode == 0 and "exists with this definition" in again.stdout, again.stderr
        # the runbook's cap raise, as the owner
        code, _, err = cli(capsys, "ledger", "--ledger", owner_url, "cap", "example", "--epsilon", "14",
                           "--reason", "approved by the privacy board", "--actor", "alice")
        assert code == 0, err
        third = run_init(env)
        assert third.returncode == 0, third.stderr
        assert "its cap was changed since through `dpops ledger cap`" in third.stdout
        assert "created with epsilon=10" in third.stdout and "now cap epsilon=14" in third.stdout
        with open_ledger(owner_url) as led:
            assert led.scope("example").epsilon == 14.0
            assert [e.kind for e in led.history()] == ["scope_created", "cap_changed"]  # init wrote nothing more
            assert led.verify().ok
        # a definition that really differs is refused, naming commands, not functions
        code, out, err = cli(capsys, "ledger", "--ledger", owner_url, "scope", "create", "example", "--unit",
                             "something else", "--unit-column", "user_id", "--epsilon", "10", "--delta", "0",
                             "--accountant", "basic", "--adjacency", "add_remove")
        assert code == 6 and re.search(r"differs in: [a-z_, ]*\bunit\b", err) and "epsilon" not in err.split(";")[0]
        assert "`dpops ledger cap example" in err
        assert "change_cap" not in err and "`dpops ledger scope show example`" in err


def test_scope_create_again_after_a_cap_change_on_sqlite(tmp_path, capsys):
    url = f"sqlite:///{tmp_path}/l.sqlite"
    create = ["ledger", "--ledger", url, "scope", "create", "example", "--unit", "u", "--unit-column", "user_id",
              "--epsilon", "10", "--delta", "0", "--accountant", "basic", "--adjacency", "add_remove"]
    assert cli(capsys, *create)[0] == 0
    assert cli(capsys, "ledger", "--ledger", url, "cap", "example", "--epsilon", "14", "--reason", "r")[0] == 0
    assert cli(capsys, "ledger", "--ledger", url, "cap", "example", "--delta", "1e-9", "--reason", "r")[0] == 0
    code, out, err = cli(capsys, *create, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["epsilon"] == 14.0 and doc["created"] is False and doc["cap_changed_since_creation"]
    code, out, err = cli(capsys, *create[:-1], "replace")  # another adjacency: a different scope
    assert code == 6 and "differs in: adjacency" in err


# --- item 8 ------------------------------------------------------------------------------------------------------


def at_the_cap(tmp_path):
    """A basic scope of cap 4.5 filled by nine runs planned at 0.5 * (1 - 1e-9) (release_plan.SAFETY)."""
    url = f"sqlite:///{tmp_path}/l.sqlite"
    led = open_ledger(url)
    led.create_scope(ScopeDefinition(name="s", unit="u", unit_column="user_id", epsilon=4.5, delta=0.0, rho=None,
                                     accountant="basic", adjacency="add_remove"), actor="t")
    share = 0.5 * (1 - 1e-9)
    for day in range(1, 10):
        rec = led.reserve(key(day), "s", [Laplace(scale=1.0 / share, l1_sensitivity=1.0)], actor="t")
        led.start(rec.run_id, actor="t")
        led.commit(rec.run_id, output_uri=f"file:///out/{day}", actor="t")
    return url, led


def test_figures_at_the_cap_show_no_float_crumbs(tmp_path, capsys, monkeypatch):
    url, led = at_the_cap(tmp_path)
    st = led.status("s")
    assert 0 < st.remaining < 1e-8 and st.committed != 4.5  # the exact representation is kept
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = cli(capsys, "ledger", "--ledger", url, "status", "s")
    assert code == 0 and "e-09" not in out and "4.4999" not in out
    row = next(line for line in out.splitlines() if line.strip("│ ").startswith("* "))
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    assert cells[1] == "4.5" and cells[8] == "0", cells  # committed, remaining
    code, out, _ = cli(capsys, "ledger", "--ledger", url, "status", "s", "--json")
    doc = json.loads(out)  # the figure people read (issue 28 item 13); machines keep the exact one under "exact"
    assert doc["remaining"] == 0 and doc["exact"]["remaining"] == st.remaining
    code, out, _ = cli(capsys, "ledger", "--ledger", url, "runs")
    assert "0.5 " in out and "0.4999" not in out
    # the refusal: every number at one precision, and they agree (0 left - 0.5 asked = -0.5)
    with pytest.raises(ScopeBudgetExceeded) as refused:
        led.reserve(key(20), "s", [Laplace(scale=2.0, l1_sensitivity=1.0)], actor="t")
    text = str(refused.value)
    nums = dict(re.findall(r"(spent|reserved|requested|would remain) (-?[0-9.e+-]+)", text))
    left = re.search(r"(-?[0-9.e+-]+) left", text).group(1)
    assert (nums["spent"], nums["reserved"], left, nums["requested"], nums["would remain"]) == \
        ("4.5", "0", "0", "0.5", "-0.5"), text
    assert float(left) - float(nums["requested"]) == float(nums["would remain"])
    led.close()


def test_refusal_reason_and_report_use_the_same_figures(tmp_path, capsys):
    from dpops.release.context import RunOutcome
    from dpops.report import build_report

    url, led = at_the_cap(tmp_path)
    html, _data = build_report(led, "s", tmp_path / "r.html")
    assert "0.4999999995" not in html and ">0.5<" in html
    remaining = re.search(r"data-field='remaining'><span data-value='([^']+)'>([^<]+)<", html)
    assert remaining and float(remaining.group(1)) == led.status("s").remaining and remaining.group(2) == "0"
    st = led.status("s")
    out = RunOutcome(release="r", interval="i", state="published", run_id="x", epsilon_charged=0.4999999995,
                     run_epsilon=0.4999999995, scope="s", scope_remaining=st.remaining, scope_total=st.total,
                     scope_cap=st.cap, accountant="basic/1")
    line = out.line()
    assert "epsilon_charged=0.5 " in line and "remaining=0:" in line and "total ε=4.5 of cap 4.5" in line
    assert format_budget(st.remaining, st.cap) == "0" and format_budget(0.4999999995) == "0.5"
    led.close()


# --- item 9 ------------------------------------------------------------------------------------------------------


def test_a_charged_run_whose_ledger_stopped_answering_says_so(cli_env, capsys, monkeypatch):  # noqa: F811
    tmp, spec, url, base, pipe = cli_env
    real = pipe.__call__

    def lose_the_ledger(req):
        real(req)  # the noise is drawn ...
        for name in ("run", "status", "release", "mark_spent_unpublished", "runs", "published"):
            monkeypatch.setattr(Ledger, name, _unreachable)  # ... then the ledger stops answering
        raise LedgerError("PostgreSQL ledger postgresql://db/ledger failed: server closed the connection")

    monkeypatch.setattr(computation, "_load_run_release", lambda: lose_the_ledger)
    code, out, err = cli(capsys, "release", "run", str(spec), *base, "--json")
    assert code == 6
    doc = json.loads(out)
    monkeypatch.undo()
    words = doc["budget"]
    assert not re.search(r"charged ε=0(?![.0-9])", words) and "total unknown" not in words, words
    assert words.startswith("the run is started in the ledger and charged ε=0.5"), words
    assert "ε=0.5 of it by this invocation" in words and "total could not be read" in words
    assert doc["ledger_state"] == "started" and doc["epsilon_charged"] == pytest.approx(0.5)
    with open_ledger(url) as led:  # and that is the truth
        assert [r.state for r in led.runs()] == ["started"]


def _unreachable(*args, **kwargs):
    raise LedgerError("PostgreSQL ledger postgresql://db/ledger failed: server closed the connection")
