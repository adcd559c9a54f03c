"""Issue 21 items 2-4: the run's attempt (one owner), publishing a spent interval on purpose, and a
refusal manifest that stays true after the same run key is published later.

Fast: the stand-in pipeline and plan of the run tests (``cli_support``), the real ledger (SQLite),
the real CLI. The same procedures through real Airflow processes: ``tests/test_airflow_operations.py``.
"""

from __future__ import annotations

import json

from cli_support import make_env

from dpops import orchestration, release
from dpops.errors import NeedsOperator
from dpops.ledger import open_ledger


def _step(env, day: str, nxt: str) -> orchestration.Step:
    settings = orchestration.Settings(ledger_url=env.url, key_path=str(env.key))
    return orchestration.Step(str(env.spec), f"{day}T00:00:00+00:00", f"{nxt}T00:00:00+00:00", settings, "test")


def _reserved(ledger, scope: str) -> list[str]:
    return [e.run_id for e in ledger.history(scope) if e.kind == "reserved"]


def test_every_orchestrator_step_works_on_the_attempt_reserve_chose_after_a_refund(tmp_path, monkeypatch):
    """Item 2: after `ledger recover` refunds a reserved run, the next DAG run reserves attempt 2; every later
    task (validate, publish, record) must work on attempt 2, not look up the refunded run id."""
    env = make_env(tmp_path, monkeypatch, cap=5.0)
    step = _step(env, "2024-01-01", "2024-01-02")
    assert orchestration.check_input_step(step)["state"] == "checked"
    first = orchestration.reserve_step(step)
    assert first.state == "reserved"
    with open_ledger(env.url) as led:
        assert [r.run_id for r in led.recover(older_than_seconds=0, actor="test")] == [first.run_id]
    second = orchestration.reserve_step(step)
    assert second.state == "reserved" and second.run_id != first.run_id
    assert orchestration.compute_step(step)["run_id"] == second.run_id
    assert orchestration.validate_step(step)["run_id"] == second.run_id
    published = orchestration.publish_step(step)
    assert published.state == "published" and published.run_id == second.run_id
    recorded = orchestration.record_step(step, charged=0.5)
    assert recorded.state == "published" and recorded.run_id == second.run_id
    with open_ledger(env.url) as led:
        assert _reserved(led, "shop") == [first.run_id, second.run_id]
        assert led.run(first.run_id).state == "released" and led.run(second.run_id).state == "committed"
    # a later DAG run of the interval is served, on the same attempt, nothing charged
    assert orchestration.reserve_step(step).state == "already_published"


def test_spent_interval_is_published_only_by_an_explicit_fresh_attempt(tmp_path, monkeypatch, capsys):
    """Item 3: a started run that `recover` made spent_unpublished. `release run` and the DAG say what to do
    (and the DAG fails at once: a retry cannot fix it); `release run --fresh-attempt --reason` publishes with
    fresh noise, charged again, linked to the spent run in the ledger, the manifest (verified) and the report."""
    env = make_env(tmp_path, monkeypatch, cap=5.0)
    u = ["--ledger", env.url]
    spec = str(env.spec)
    day = "2024-01-01"
    assert env.run(capsys, "release", "run", spec, *env.base(day), *u, "--no-gx-checks")[0] == 0  # started, staged
    with open_ledger(env.url) as led:
        (spent,) = led.recover(older_than_seconds=0, actor="test")
        assert spent.state == "spent_unpublished"
    code, out, err = env.run(capsys, "release", "run", spec, *env.base(day), *u, "--publish", "--no-gx-checks")
    assert code == 6 and "--fresh-attempt --reason" in err, err
    code, out, err = env.run(capsys, "release", "restate", spec, *env.base(day), *u, "--no-gx-checks")
    assert code == 6 and "--fresh-attempt --reason" in err, err
    step = _step(env, day, "2024-01-02")
    try:
        orchestration.reserve_step(step)
    except NeedsOperator as exc:
        assert orchestration.is_fatal(exc) and "--fresh-attempt" in str(exc)
    else:
        raise AssertionError("the DAG's reserve step must fail on a spent interval")
    # --fresh-attempt without a reason is a usage error; with one it publishes
    assert env.run(capsys, "release", "run", spec, *env.base(day), *u, "--publish", "--fresh-attempt")[0] == 2
    code, doc, err = env.json(capsys, "release", "run", spec, *env.base(day), *u, "--publish", "--no-gx-checks",
                              "--fresh-attempt", "--reason", "recovered after a node loss, ticket OPS-7", "--json")
    assert code == 0 and doc["state"] == "published", err
    fresh_id = doc["run_id"]
    assert fresh_id != spent.run_id and doc["epsilon_charged"] == 0.5
    labels = [r.noise_label for r in env.pipe.requests]
    assert labels[0] != labels[-1] and labels[-1]["replaces_spent"] == spent.run_id  # fresh noise
    with open_ledger(env.url) as led:
        assert _reserved(led, "shop") == [spent.run_id, fresh_id]  # charged again; the spent charge stays
        assert led.status("shop").total == 1.0
        assert led.run(fresh_id).details["replaces_spent"]["run_id"] == spent.run_id
    ctx = release.prepare(spec, day, "2024-01-02", key_path=str(env.key))
    mdir = release.manifests_dir(ctx)
    m = json.loads((mdir / f"{fresh_id}.published.json").read_text())
    assert m["replaces_spent"] == {"run_id": spent.run_id, "reason": "recovered after a node loss, ticket OPS-7"}
    code, out, err = env.run(capsys, "manifest", "verify", str(mdir / f"{fresh_id}.published.json"), *u,
                             "--key-file", str(env.key))
    assert code == 0, out + err
    # verification catches an edited link
    forged = dict(m, replaces_spent={"run_id": spent.run_id, "reason": "nothing happened"})
    (tmp_path / "forged.json").write_text(json.dumps(forged))
    code, out, err = env.run(capsys, "manifest", "verify", str(tmp_path / "forged.json"), *u)
    assert code == 7 and "replaces_spent" in out + err
    # repeating the command (and every later DAG run) is served: nothing charged, same run
    code, doc, _ = env.json(capsys, "release", "run", spec, *env.base(day), *u, "--publish", "--no-gx-checks",
                            "--fresh-attempt", "--reason", "again", "--json")
    assert code == 0 and doc["state"] == "already_published" and doc["run_id"] == fresh_id
    assert orchestration.reserve_step(step).state == "already_published"
    code, out, err = env.run(capsys, "report", "--scope", "shop", *u, "--manifests", str(mdir),
                             "--out", str(tmp_path / "r.html"), "--key-file", str(env.key))
    assert code == 0, out + err
    html = (tmp_path / "r.html").read_text()
    assert "Fresh attempts after a spent run (1)" in html and spent.run_id[:16] in html
    # Issue 28 item 10: the operator's reason is in the report's table and in `manifest show`
    assert "<td data-field='fresh_reason'>recovered after a node loss, ticket OPS-7</td>" in html
    monkeypatch.setenv("COLUMNS", "400")
    code, out, err = env.run(capsys, "manifest", "show", str(mdir / f"{fresh_id}.published.json"))
    assert code == 0, err
    assert f"fresh attempt: replaces the spent_unpublished run {spent.run_id}" in out
    assert "reason: recovered after a node loss, ticket OPS-7" in out


def test_fresh_attempt_without_a_spent_run_is_refused(tmp_path, monkeypatch, capsys):
    env = make_env(tmp_path, monkeypatch, cap=5.0)
    code, out, err = env.run(capsys, "release", "run", str(env.spec), *env.base("2024-01-01"), "--ledger", env.url,
                             "--publish", "--no-gx-checks", "--fresh-attempt", "--reason", "why not")
    assert code == 3 and "no spent_unpublished run to replace" in err
    with open_ledger(env.url) as led:
        assert led.runs(release="purchases_test") == []


def test_refusal_manifest_stays_verified_after_the_run_key_is_published_later(tmp_path, monkeypatch, capsys):
    """Item 4: refused, cap raised, released again. The old refusal manifest is a true record of its moment:
    `manifest verify` accepts it, and `dpops report` shows the refusal and the publication and exits 0."""
    env = make_env(tmp_path, monkeypatch, cap=0.7)
    u = ["--ledger", env.url]
    spec = str(env.spec)
    assert env.run(capsys, "release", "run", spec, *env.base("2024-01-01"), *u, "--publish", "--no-gx-checks")[0] == 0
    assert env.run(capsys, "release", "run", spec, *env.base("2024-01-02"), *u, "--publish", "--no-gx-checks")[0] == 5
    assert env.run(capsys, "ledger", "cap", "shop", "--epsilon", "2", "--reason", "board approval", *u)[0] == 0
    code, doc, err = env.json(capsys, "release", "run", spec, *env.base("2024-01-02"), *u, "--publish",
                              "--no-gx-checks", "--json")
    assert code == 0 and doc["state"] == "published", err
    ctx = release.prepare(spec, "2024-01-02", "2024-01-03", key_path=str(env.key))
    mdir = release.manifests_dir(ctx)
    assert doc["run_id"] == ctx.run_id
    refused = mdir / f"{ctx.run_id}.refused.json"
    assert refused.exists()
    code, out, err = env.run(capsys, "manifest", "verify", str(refused), *u)
    assert code == 0, out + err
    code, out, err = env.run(capsys, "report", "--scope", "shop", *u, "--manifests", str(mdir),
                             "--out", str(tmp_path / "r.html"), "--key-file", str(env.key))
    assert code == 0, out + err
    html = (tmp_path / "r.html").read_text()
    assert "FAILED</span>" not in html or "0 FAILED" in html
    rows = [line for line in html.split("<tr") if ctx.run_id[:16] in line and "data-kind='run'" in line]
    assert sorted("state-refused" in r for r in rows) == [False, True], rows  # both: the refusal and the publication


def test_a_refusal_written_after_the_run_was_charged_still_fails(tmp_path, monkeypatch, capsys):
    """The acceptance above is not a blanket pass: a refusal claiming "nothing charged" for a run the ledger
    had already charged at that moment is a false record."""
    env = make_env(tmp_path, monkeypatch, cap=5.0)
    u = ["--ledger", env.url]
    spec = str(env.spec)
    assert env.run(capsys, "release", "run", spec, *env.base("2024-01-01"), *u, "--publish", "--no-gx-checks")[0] == 0
    from dpops.manifest.run_hook import write_run_manifest

    ctx = release.prepare(spec, "2024-01-01", "2024-01-02", key_path=str(env.key))
    with open_ledger(env.url) as led:
        path = write_run_manifest(ctx, led, {"state": "refused", "reason": "forged"}, manifests_dir=tmp_path / "m")
    code, out, err = env.run(capsys, "manifest", "verify", str(path), *u)
    assert code == 7 and ("already had ledger entry" in out + err or "but names the ledger entries" in out + err)
