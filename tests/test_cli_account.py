"""``dpops account`` through click's runner and through main()'s exit codes."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dpops.accounting import get_accountant
from dpops.cli.account import cli as account_cli
from dpops.cli.main import main
from dpops.events import Gaussian, SelfComposed

EVENTS = [{"kind": "self_composed", "count": 10, "event": {"kind": "gaussian", "sigma": 8.0, "l2_sensitivity": 1.0}}]
ZCDP_10_8 = 2.1559476703363876  # shared vector: k=10, sigma=8, delta=1e-6


@pytest.fixture
def events_file(tmp_path):
    p = tmp_path / "events.json"
    p.write_text(json.dumps(EVENTS))
    return str(p)


def test_epsilon_at_delta_json(events_file):
    res = CliRunner().invoke(account_cli, [events_file, "--accountant", "zcdp", "--delta", "1e-6", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["accountant"] == "zcdp/1" and out["events"] == 1
    assert out["epsilon"] == pytest.approx(ZCDP_10_8, abs=1e-12)


def test_delta_at_epsilon_text(events_file):
    res = CliRunner().invoke(account_cli, [events_file, "--epsilon", "2.0"])
    assert res.exit_code == 0, res.output
    expected = get_accountant("rdp").delta([SelfComposed(Gaussian(8.0, 1.0), 10)], 2.0)
    assert res.output.startswith("rdp/1: delta = ")
    assert float(res.output.split("delta = ")[1].split()[0]) == pytest.approx(expected, rel=1e-5)


def test_compare_lists_every_accountant_in_order(events_file):
    res = CliRunner().invoke(account_cli, [events_file, "--delta", "1e-6", "--compare", "--json"])
    assert res.exit_code == 0, res.output
    cmp = {r["accountant"]: r["epsilon"] for r in json.loads(res.output)["compare"]}
    assert set(cmp) == {"basic/1", "zcdp/1", "rdp/1", "pld/1"}
    assert cmp["pld/1"] < cmp["rdp/1"] < cmp["zcdp/1"] == pytest.approx(ZCDP_10_8, abs=1e-12)
    text = CliRunner().invoke(account_cli, [events_file, "--delta", "1e-6", "--compare"])
    assert text.exit_code == 0 and "compared with:" in text.output and "basic/1" in text.output


def test_stdin():
    res = CliRunner().invoke(account_cli, ["-", "--accountant", "zcdp/1", "--delta", "1e-6", "--json"], input=json.dumps(EVENTS))
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["epsilon"] == pytest.approx(ZCDP_10_8, abs=1e-12)


def test_infinite_epsilon_is_null_in_json(tmp_path):
    p = tmp_path / "e.json"
    p.write_text(json.dumps([{"kind": "approx_dp", "epsilon": 0.1, "delta": 1e-5}, {"kind": "zcdp", "rho": 0.1}]))
    res = CliRunner().invoke(account_cli, [str(p), "--delta", "1e-6", "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["epsilon"] is None


def test_main_exit_codes(events_file, tmp_path, capsys):
    assert main(["account", events_file, "--delta", "1e-6"]) == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(EVENTS + [{"kind": "gaussian", "sigma": -1.0, "l2_sensitivity": 1.0}]))
    assert main(["account", str(bad), "--delta", "1e-6"]) == 3
    err = capsys.readouterr().err
    assert "bad.json: event #1" in err and "sigma" in err
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps([{"kind": "poisson", "rate": 2}]))
    assert main(["account", str(unknown), "--delta", "1e-6"]) == 3
    assert "unknown privacy event kind 'poisson'" in capsys.readouterr().err
    notjson = tmp_path / "x.json"
    notjson.write_text("[{")
    assert main(["account", str(notjson), "--delta", "1e-6"]) == 3
    assert main(["account", events_file, "--delta", "1.5"]) == 3  # delta outside [0, 1)
    assert main(["account", events_file, "--epsilon", "0"]) == 3
    assert main(["account", events_file, "--accountant", "moments", "--delta", "1e-6"]) == 3
    assert "unknown accountant 'moments'" in capsys.readouterr().err
    assert main(["account", events_file]) == 2  # neither --delta nor --epsilon
    assert main(["account", events_file, "--delta", "1e-6", "--epsilon", "1"]) == 2
    assert main(["account", str(tmp_path / "missing.json"), "--delta", "1e-6"]) == 3
    assert "missing.json" in capsys.readouterr().err


def test_help_explains_event_format():
    res = CliRunner().invoke(account_cli, ["--help"])
    assert res.exit_code == 0
    for word in ("gaussian", "self_composed", "approx_dp", "--delta", "--compare", "stdin"):
        assert word in res.output
