"""`dpops ledger ...` and `dpops plan` through the real entry point (exit codes included)."""

from __future__ import annotations

import json

import pytest

from dpops.cli.main import main
from dpops.events import Laplace, event_to_dict
from dpops.ledger import RunKey, open_ledger


@pytest.fixture
def url(tmp_path):
    return f"sqlite:///{tmp_path}/cli.sqlite"


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def make_scope(capsys, url, name="web", *extra):
    code, out, err = run(capsys, "ledger", "--ledger", url, "scope", "create", name, "--unit", "a user",
                         "--unit-column", "user_id", "--epsilon", "1.0", "--delta", "1e-7", "--accountant", "basic",
                         "--adjacency", "add_remove", *extra)
    assert code == 0, err
    return out


def test_init_scope_status_history_verify_export(capsys, url, tmp_path):
    assert run(capsys, "ledger", "--ledger", url, "init")[0] == 0
    assert "accountant basic/1" in make_scope(capsys, url)
    with open_ledger(url) as led:
        rec = led.reserve(RunKey("r", "h", "2024-01-01", "2024-01-02", "fp", "k"), "web",
                          [Laplace(scale=4.0, l1_sensitivity=1.0)], actor="t")
        led.start(rec.run_id, actor="t")
        led.commit(rec.run_id, output_uri="file:///o", actor="t")
    code, out, _ = run(capsys, "ledger", "--ledger", url, "status", "web", "--json")
    st = json.loads(out)
    assert code == 0 and st["committed"] == 0.25 and st["remaining"] == 0.75
    code, out, _ = run(capsys, "ledger", "--ledger", url, "status", "web")
    assert code == 0 and "0.75" in out
    code, out, _ = run(capsys, "ledger", "--ledger", url, "history", "web", "--json")
    assert [e["kind"] for e in json.loads(out)["entries"]] == ["scope_created", "reserved", "started", "committed"]
    assert run(capsys, "ledger", "--ledger", url, "history")[0] == 0
    code, out, _ = run(capsys, "ledger", "--ledger", url, "runs", "--json", "--state", "committed")
    assert code == 0 and json.loads(out)["runs"][0]["run_id"] == rec.run_id
    assert run(capsys, "ledger", "--ledger", url, "runs")[0] == 0
    assert run(capsys, "ledger", "--ledger", url, "scope", "show")[0] == 0
    code, out, _ = run(capsys, "ledger", "--ledger", url, "verify", "--json")
    assert code == 0 and json.loads(out)["ok"] is True
    target = tmp_path / "export.jsonl"
    assert run(capsys, "ledger", "--ledger", url, "export", str(target))[0] == 0
    lines = [json.loads(line) for line in target.read_text().splitlines()]
    assert [line["id"] for line in lines] == [1, 2, 3, 4]


def test_verify_exit_7_names_the_entry(capsys, url):
    make_scope(capsys, url)
    make_scope(capsys, url, "other")
    with open_ledger(url) as led:
        led.db.execute("DROP TRIGGER entries_no_update")
        led.db.execute("UPDATE entries SET actor = 'mallory' WHERE id = 2")
    code, out, err = run(capsys, "ledger", "--ledger", url, "verify")
    assert code == 7 and "entry 2" in err and "entry 2" in out


def test_cap_recover_and_errors(capsys, url, monkeypatch):
    make_scope(capsys, url)
    code, out, _ = run(capsys, "ledger", "--ledger", url, "cap", "web", "--epsilon", "2", "--reason", "review")
    assert code == 0 and "epsilon=2" in out
    assert run(capsys, "ledger", "--ledger", url, "recover", "--older-than", "0")[0] == 0
    code, _, err = run(capsys, "ledger", "--ledger", url, "status", "nope")
    assert code == 3 and "unknown budget scope 'nope'" in err
    code, _, err = run(capsys, "ledger", "--ledger", "postgresql://postgres@127.0.0.1:1/x", "init")
    assert code == 6 and "cannot connect" in err
    code, _, err = run(capsys, "ledger", "--ledger", url, "scope", "create", "daily", "--unit", "u", "--unit-column",
                       "c", "--epsilon", "1", "--delta", "0", "--accountant", "basic", "--bucket", "day",
                       "--adjacency", "add_remove")
    assert code == 3 and "unit_period='day'" in err
    monkeypatch.setenv("DPOPS_LEDGER_URL", url)  # the default comes from the environment
    code, out, _ = run(capsys, "ledger", "scope", "show", "web", "--json")
    assert code == 0 and json.loads(out)["scopes"][0]["epsilon"] == 2.0


def test_plan_command_writes_nothing(capsys, url, tmp_path):
    make_scope(capsys, url)
    ev = event_to_dict(Laplace(scale=2.5, l1_sensitivity=1.0))  # 0.4 each: two fit under 1.0
    plan = [{"interval_start": f"2024-01-0{d}T00:00:00Z", "interval_end": f"2024-01-0{d + 1}T00:00:00Z",
             "events": [ev]} for d in range(1, 4)]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"runs": plan}))
    code, out, _ = run(capsys, "plan", "web", str(path), "--ledger", url, "--json")
    result = json.loads(out)
    assert code == 0 and [i["fits"] for i in result["items"]] == [True, True, False] and result["admitted"] == 2
    code, out, _ = run(capsys, "plan", "web", str(path), "--ledger", url)
    assert code == 0 and "2 of 3 planned runs fit" in out
    assert run(capsys, "plan", "web", str(path), "--ledger", url, "--check")[0] == 5
    with open_ledger(url) as led:
        assert len(led.history()) == 1
    path.write_text(json.dumps([{"interval_start": "2024-01-01", "events": []}]))
    code, _, err = run(capsys, "plan", "web", str(path), "--ledger", url)
    assert code == 3 and "run #0" in err
