"""Messages an operator can act on (issue 21 item 13): spec check lists every problem once, with "did you
mean", checks budget.scope against a reachable ledger; empty listings and a missing scope say what to do;
``--help`` never cuts a command's description."""

from __future__ import annotations

import yaml
from cli_support import make_env


def _spec(env, **changes) -> str:
    doc = yaml.safe_load(env.spec.read_text())
    for dotted, value in changes.items():
        node = doc
        *parents, last = dotted.split(".")
        for p in parents:
            node = node[int(p)] if p.isdigit() else node[p]
        if value is None:
            node.pop(last)
        else:
            node[last] = value
    path = env.root / "changed.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_spec_check_lists_every_problem_once_with_did_you_mean(tmp_path, monkeypatch, capsys):
    env = make_env(tmp_path, monkeypatch)
    bad = _spec(env, **{"contribution.max_partitions_per_unit": None, "contribution.max_partition_per_unit": 1,
                        "metrics.1.bounds": [10, 0]})
    code, out, err = env.run(capsys, "spec", "check", bad)
    assert code == 3
    assert "contribution.max_partition_per_unit: unknown key; did you mean 'max_partitions_per_unit'?" in err, err
    assert "metrics[1].bounds: lower bound 10" in err and "bounds: bounds" not in err, err


def test_spec_check_refuses_a_scope_the_ledger_does_not_have(tmp_path, monkeypatch, capsys):
    env = make_env(tmp_path, monkeypatch)  # the ledger has scope "shop"
    typo = _spec(env, **{"budget.scope": "shpo"})
    monkeypatch.setenv("DPOPS_LEDGER_URL", env.url)
    code, _, err = env.run(capsys, "spec", "check", typo)
    assert code == 3 and "budget.scope: no scope 'shpo' in the ledger; did you mean 'shop'?" in err, err
    assert "ledger scope show" in err
    code, out, err = env.run(capsys, "spec", "check", str(env.spec))
    assert code == 0, err
    # together with a file problem: both in one run of spec check
    monkeypatch.setenv("DPOPS_DATA_ROOTS", str(tmp_path / "elsewhere"))
    code, _, err = env.run(capsys, "spec", "check", typo)
    assert code == 3 and "budget.scope" in err and "input.path" in err, err
    # no ledger: checked offline, and it says the scope was not checked
    monkeypatch.delenv("DPOPS_LEDGER_URL")
    monkeypatch.delenv("DPOPS_DATA_ROOTS")
    code, out, err = env.run(capsys, "spec", "check", typo)
    assert code == 0 and "budget.scope not checked" in out, out


def test_empty_listing_and_missing_scope_say_what_to_do(tmp_path, monkeypatch, capsys):
    env = make_env(tmp_path, monkeypatch)
    code, out, _ = env.run(capsys, "ledger", "runs", "--state", "started", "--ledger", env.url)
    assert code == 0 and out.strip() == "no runs in state started", out
    code, out, err = env.run(capsys, "ledger", "status", "--ledger", env.url)
    assert code == 2 and "dpops ledger scope show" in err, err


def test_help_never_cuts_a_description(tmp_path, monkeypatch, capsys):
    env = make_env(tmp_path, monkeypatch)
    monkeypatch.setenv("COLUMNS", "80")
    for group in ([], ["ledger"], ["release"], ["spec"], ["manifest"], ["key"], ["audit"], ["ledger", "scope"]):
        code, out, _ = env.run(capsys, *group, "--help")
        assert code == 0 and "..." not in out.split("Commands:")[-1], (group, out)
    code, out, _ = env.run(capsys, "--help")
    assert "publication, with the reason" in " ".join(out.split())  # gaps' whole first paragraph


def test_beam_import_warnings_are_silenced_and_dpops_warnings_are_not(tmp_path):
    """`release run` checks the runner first, which imports Beam: its root-logger "apitools not found"
    warning (printed on every run) is dropped, a dpops warning after it still shows."""
    import os
    import subprocess
    import sys

    code = ("import logging\n"
            "from dpops.release.computation import check_runner\n"
            "check_runner('FnApiRunner', ())\n"
            "logging.getLogger('dpops.release').warning('dpops-own-warning')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "apitools" not in done.stderr and "bigquery" not in done.stderr.lower(), done.stderr
    assert "dpops-own-warning" in done.stderr
