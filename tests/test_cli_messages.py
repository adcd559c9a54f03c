"""Messages an operator can act on (issue 21 item 13): spec check lists every problem once, with "did you
mean", checks budget.scope against a reachable ledger; empty listings and a missing scope say what to do;
``--help`` never cuts a command's description."""

from __future__ import annotations

import json

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


def test_refusal_interval_and_gaps_wording(tmp_path, monkeypatch, capsys):
    """Issue 28 item 15: a refusal says "wait" only when a reservation in flight may still be refunded; an interval
    error names both accepted forms; `gaps` with nothing missing prints a sentence, not an empty table header."""
    from dpops.ledger import open_ledger
    from test_runs import write_input

    env = make_env(tmp_path, monkeypatch, cap=0.7)
    spec, u = str(env.spec), ["--ledger", env.url, "--no-gx-checks"]
    assert env.run(capsys, "release", "run", spec, *env.base("2024-01-01"), *u, "--publish")[0] == 0
    from dpops import release

    def refusal_reason(day: str, nxt: str) -> str:
        code, _, err = env.run(capsys, "release", "run", spec, *env.base(day), *u, "--publish")
        assert code == 5, err
        ctx = release.prepare(spec, day, nxt, key_path=str(env.key))
        path = release.manifests_dir(ctx) / f"{ctx.run_id}.refused.json"
        return json.loads(path.read_text())["outcome"]["reason"]  # the DAG's note and alert say the same

    reason = refusal_reason("2024-01-02", "2024-01-03")
    assert "Waiting frees nothing" in reason and "wait for budget" not in reason, reason
    # a reservation in flight (reserved, no noise drawn): waiting may free it, and the reason says so
    env.run(capsys, "ledger", "cap", "shop", "--epsilon", "1.2", "--reason", "test", "--ledger", env.url)
    with open_ledger(env.url) as led:
        ctx = release.prepare(spec, "2024-01-02", "2024-01-03", key_path=str(env.key), ledger=led)
        assert release.reserve(ctx, led).state == "reserved"
    write_input(tmp_path, "2024-01-03")
    reason = refusal_reason("2024-01-03", "2024-01-04")
    assert "wait for those runs" in reason and "Waiting frees nothing" not in reason, reason
    # an interval that is neither form names both forms
    code, _, err = env.run(capsys, "release", "run", spec, "--interval", "2024-01-03/2024/01/04", "--key-file",
                           str(env.key), *u)
    assert code == 3 and "START/END" in err and "or the start of one period of the spec" in err, err
    # gaps with none: one sentence, no header of an empty table
    code, out, _ = env.run(capsys, "gaps", spec, "--from", "2024-01-01", "--to", "2024-01-02", "--ledger", env.url)
    assert code == 0 and "no gaps: every one of the 1 interval(s)" in out and "interval start" not in out, out
