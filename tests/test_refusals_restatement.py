"""Issue 28 item 1: a refused restatement, released after a cap raise, keeps a refusal manifest that verifies,
from the CLI (``release restate``) and from the DAG (``orchestration.reserve_step(restate=True)``) alike.

Fast: the stand-in pipeline and plan of the CLI tests (``cli_support``), the real ledger (SQLite), the real CLI.
"""

from __future__ import annotations

import json
import re

from cli_support import make_env
from test_runs import write_input

from dpops import orchestration, release
from dpops.ledger import open_ledger


def _step(env, day: str, nxt: str) -> orchestration.Step:
    settings = orchestration.Settings(ledger_url=env.url, key_path=str(env.key))
    return orchestration.Step(str(env.spec), f"{day}T00:00:00+00:00", f"{nxt}T00:00:00+00:00", settings, "test")


def test_refused_restatement_manifest_links_the_published_run_and_verifies_after_release(tmp_path, monkeypatch,
                                                                                        capsys):
    env = make_env(tmp_path, monkeypatch, cap=1.2)
    u = ["--ledger", env.url]
    spec = str(env.spec)
    first = {}
    for day in ("2024-01-01", "2024-01-02"):
        code, doc, err = env.json(capsys, "release", "run", spec, *env.base(day), *u, "--publish", "--no-gx-checks",
                                  "--json")
        assert code == 0, err
        first[day] = doc["run_id"]
        write_input(tmp_path, day, amounts=(1.0, 2.0, 3.0, 7.0))  # a corrected input: a restatement, 0.5 more
    # 0.2 left: both restatements are refused, one from the CLI, one from the DAG's reserve task
    code, out, err = env.run(capsys, "release", "restate", spec, *env.base("2024-01-01"), *u, "--no-gx-checks")
    assert code == 5, out + err
    refused_dag = orchestration.reserve_step(_step(env, "2024-01-02", "2024-01-03"), restate=True)
    assert refused_dag.state == "refused"
    ctxs = {day: release.prepare(spec, day, nxt, key_path=str(env.key))
            for day, nxt in (("2024-01-01", "2024-01-02"), ("2024-01-02", "2024-01-03"))}
    mdir = release.manifests_dir(ctxs["2024-01-01"])
    refusals = {day: mdir / f"{ctx.run_id}.refused.json" for day, ctx in ctxs.items()}
    for day, path in refusals.items():
        assert path.exists(), f"no refusal manifest for the refused restatement of {day}"
        assert json.loads(path.read_text())["restates"] == {"run_id": first[day]}
    # the cap is raised; the same restatements are released under the same run keys
    assert env.run(capsys, "ledger", "cap", "shop", "--epsilon", "3", "--reason", "board approval", *u)[0] == 0
    code, doc, err = env.json(capsys, "release", "restate", spec, *env.base("2024-01-01"), *u, "--no-gx-checks",
                              "--json")
    assert code == 0 and doc["state"] == "published" and doc["run_id"] == ctxs["2024-01-01"].run_id, err
    step = _step(env, "2024-01-02", "2024-01-03")
    assert orchestration.reserve_step(step, restate=True).state == "reserved"
    orchestration.compute_step(step)
    assert orchestration.publish_step(step).state == "published"
    with open_ledger(env.url) as led:
        for day, ctx in ctxs.items():
            assert led.run(ctx.run_id).restates == first[day] and led.run(ctx.run_id).state == "committed"
    for path in refusals.values():
        code, out, err = env.run(capsys, "manifest", "verify", str(path), *u)
        assert code == 0, out + err
    code, out, err = env.run(capsys, "report", "--scope", "shop", *u, "--manifests", str(mdir),
                             "--out", str(tmp_path / "r.html"), "--key-file", str(env.key))
    assert code == 0, out + err
    html = (tmp_path / "r.html").read_text()
    assert re.findall(r"(\d+) FAILED</span>", html) == ["0"], "the report counts a failed manifest"
    # issue 28 item 4: a refusal's block says it charged nothing (its ε is what it asked)
    blocks = re.findall(r"<div class='release' data-run='([0-9a-f]{32})' data-trusted='true'><h3>[^<]*— (\w+)</h3>"
                        r"(.*?)</div>", html)
    refusal_blocks = [b for b in blocks if b[1] == "refused"]
    assert len(refusal_blocks) == 2 and all("this run charged nothing" in b[2] for b in refusal_blocks)
    assert not any("charged nothing" in b[2] for b in blocks if b[1] != "refused")


def test_unknown_scope_exits_as_spec_check_says(tmp_path, monkeypatch, capsys):
    """Issue 28 item 9: a spec naming a scope the ledger lacks exits 3 in `spec check` and in `release run` (and
    the DAG fails it at once: a retry cannot create the scope)."""
    import yaml

    from dpops.errors import SpecError

    env = make_env(tmp_path, monkeypatch)
    doc = yaml.safe_load(env.spec.read_text())
    doc["budget"]["scope"] = "shpo"
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump(doc))
    monkeypatch.setenv("DPOPS_LEDGER_URL", env.url)
    checked = env.run(capsys, "spec", "check", str(typo))[0]
    code, out, err = env.run(capsys, "release", "run", str(typo), *env.base("2024-01-01"), "--ledger", env.url,
                             "--publish", "--no-gx-checks")
    assert checked == code == 3, (checked, code, err)
    assert "budget scope 'shpo'" in err and "dpops ledger scope create shpo" in err
    step = orchestration.Step(str(typo), "2024-01-01T00:00:00+00:00", "2024-01-02T00:00:00+00:00",
                              orchestration.Settings(ledger_url=env.url, key_path=str(env.key)), "test")
    try:
        orchestration.reserve_step(step)
    except SpecError as exc:
        assert orchestration.is_fatal(exc)
    else:
        raise AssertionError("the DAG's reserve step must fail on an unknown scope")


def test_the_dag_outcome_lines_state_the_scope_total_beside_remaining(tmp_path, monkeypatch):
    """Issue 28 item 9: the DAG tasks' outcome lines (refused, recorded, failed) give the scope's composed total and
    cap beside `remaining=`, never "scope total unknown" while the ledger answered."""
    env = make_env(tmp_path, monkeypatch, cap=0.7)
    step = _step(env, "2024-01-01", "2024-01-02")
    assert orchestration.reserve_step(step).state == "reserved"
    orchestration.compute_step(step)
    orchestration.publish_step(step)
    recorded = orchestration.record_step(step, charged=0.5)
    refused = orchestration.reserve_step(_step(env, "2024-01-02", "2024-01-03"))
    failed = orchestration.failure_outcome(step, RuntimeError("worker lost"))
    assert refused.state == "refused" and failed is not None
    for out in (recorded, refused, failed):
        line = orchestration.summary_line(out)
        assert "unknown" not in line and "remaining=0.2" in line, line
        assert "scope shop total ε=0.5 of cap 0.7 (basic/1 accountant" in line, line


def test_refused_fresh_attempt_manifest_verifies_after_release(tmp_path, monkeypatch, capsys):
    """The same class as issue 28 item 1 for a fresh attempt: refused by the cap, then released under the same run
    key after a cap raise; the refusal manifest names the spent run it would replace, with the operator's reason,
    as the ledger later records, so it still verifies."""
    env = make_env(tmp_path, monkeypatch, cap=0.7)
    u = ["--ledger", env.url]
    spec = str(env.spec)
    assert env.run(capsys, "release", "run", spec, *env.base("2024-01-01"), *u, "--no-gx-checks")[0] == 0  # staged
    with open_ledger(env.url) as led:
        (spent,) = led.recover(older_than_seconds=0, actor="test")
    fresh = ["--publish", "--no-gx-checks", "--fresh-attempt", "--reason", "node lost, ticket OPS-9"]
    code, out, err = env.run(capsys, "release", "run", spec, *env.base("2024-01-01"), *u, *fresh)
    assert code == 5, out + err
    assert env.run(capsys, "ledger", "cap", "shop", "--epsilon", "3", "--reason", "board approval", *u)[0] == 0
    code, doc, err = env.json(capsys, "release", "run", spec, *env.base("2024-01-01"), *u, *fresh, "--json")
    assert code == 0 and doc["state"] == "published", err
    ctx = release.prepare(spec, "2024-01-01", "2024-01-02", key_path=str(env.key))
    refused = release.manifests_dir(ctx) / f"{doc['run_id']}.refused.json"
    assert refused.exists()
    assert json.loads(refused.read_text())["replaces_spent"] == {"run_id": spent.run_id,
                                                                 "reason": "node lost, ticket OPS-9"}
    code, out, err = env.run(capsys, "manifest", "verify", str(refused), *u)
    assert code == 0, out + err
