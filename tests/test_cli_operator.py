"""Operator commands of issue 12: ε wording, stage progress, ``ledger reserve``, ``plan SPEC``, ``gaps``."""

from __future__ import annotations

import json
import re

import pytest
from cli_support import make_env
from test_runs import write_input

from dpops import release
from dpops.accounting import get_accountant
from dpops.events import Gaussian
from dpops.ledger import open_ledger


class GaussPlan:
    """One Gaussian event per run: under RDP, seven runs compose to far less than seven times one."""

    events = [Gaussian(sigma=6.0, l2_sensitivity=1.0)]
    plan_hash = "g" * 64

    def describe(self):
        return {"mechanisms": ["gaussian"]}


def gauss_planner(spec):
    return GaussPlan()


def days(n: int, start: int = 1) -> list[str]:
    return [f"2024-01-{d:02d}" for d in range(start, start + n)]


def _num(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    assert m, (pattern, text)
    return float(m.group(1))


# --------------------------------------------------------------------------- ε wording


def test_seven_runs_say_which_epsilon_is_which(tmp_path, monkeypatch, capsys):
    env = make_env(tmp_path, monkeypatch, cap=4.0, accountant="rdp", planner_fn=gauss_planner)
    for d in days(7):
        write_input(tmp_path, d)
    rdp, delta = get_accountant("rdp"), 1e-6
    one = rdp.epsilon(GaussPlan.events, delta)
    lines = []
    for i, d in enumerate(days(7), start=1):
        code, out, err = env.run(capsys, "ledger", "reserve", str(env.spec), *env.base(d), "--start", "--ledger", env.url)
        assert code == 0, err
        lines.append(out.strip())
        composed = rdp.epsilon(GaussPlan.events * i, delta)
        assert _num(r"charged ε=([0-9.e-]+) this run", out) == pytest.approx(one, rel=1e-5)
        assert _num(r"scope shop total ε=([0-9.e-]+) of cap 4 \(rdp/1 accountant", out) == pytest.approx(composed,
                                                                                                      rel=1e-5)
    total = rdp.epsilon(GaussPlan.events * 7, delta)
    assert 7 * one > 4.0 > total  # the sum of the per-run figures would exceed the cap; the composed total does not
    code, st, _ = env.json(capsys, "ledger", "status", "shop", "--ledger", env.url, "--json")
    assert code == 0 and st["total"] == pytest.approx(total, rel=1e-6)
    assert st["sum_of_runs"] == pytest.approx(7 * one, rel=1e-6) and st["sum_of_runs"] != pytest.approx(st["total"])
    assert "not the sum of per-run ε" in st["composition"]
    code, text, _ = env.run(capsys, "ledger", "status", "shop", "--ledger", env.url)
    flat = " ".join(text.split())
    assert f"{7 * one:.6g}" in flat and f"{total:.6g}" in flat and "rdp/1 accountant" in flat
    # a re-run of a charged run: nothing charged now, and the line says what the run itself cost
    code, out, _ = env.run(capsys, "ledger", "reserve", str(env.spec), *env.base("2024-01-01"), "--ledger", env.url)
    assert code == 0 and "charged ε=0 this run (the run's own ε=" in out and f"{one:.6g}" in out


def test_release_line_and_status_name_both_numbers(tmp_path, monkeypatch, capsys):
    env = make_env(tmp_path, monkeypatch, cap=1.2)
    code, out, _ = env.run(capsys, "release", "run", str(env.spec), *env.base(), "--ledger", env.url, "--publish",
                           "--no-gx-checks")
    assert code == 0
    assert "charged ε=0.5 this run; scope shop total ε=0.5 of cap 1.2 (basic/1 accountant, all runs composed)" in out
    code, out, _ = env.run(capsys, "release", "status", str(env.spec), "--interval", "2024-01-01", "--ledger", env.url)
    text = " ".join(out.split())  # the scope line wraps at words (80 columns); the runs are a table
    assert code == 0 and "scope total ε=0.5 of cap 1.2 (basic/1 accountant" in text, out
    assert "runs of this interval (ε: the run alone)" in text and "│ committed │ 0.5 │" in text, out


# --------------------------------------------------------------------------- progress


def test_progress_stages_in_order(tmp_path, monkeypatch, capsys):
    env = make_env(tmp_path, monkeypatch, cap=10.0)
    seen: list[str] = []
    with open_ledger(env.url) as led:
        out = release.execute_release(str(env.spec), "2024-01-01", "2024-01-02", ledger=led, key_path=str(env.key),
                                   progress=seen.append)
        assert out.state == "published"
        assert seen == list(release.STAGES)
        seen.clear()
        release.execute_release(str(env.spec), "2024-01-01", "2024-01-02", ledger=led, key_path=str(env.key),
                             progress=seen.append)
        assert seen == ["fingerprint", "reserve"]  # served from the publication: nothing computed
        seen.clear()
        release.execute_release(str(env.spec), "2024-01-02", "2024-01-03", ledger=led, key_path=str(env.key),
                             progress=seen.append, publish_output=False)
        assert seen == ["fingerprint", "reserve", "read, bound and noise", "write"]
    # the CLI: one plain line per stage on stderr (not a terminal), nothing of it on the --json stdout
    code, out, err = env.run(capsys, "release", "run", str(env.spec), *env.base("2024-01-03"), "--ledger", env.url,
                             "--publish", "--no-gx-checks", "--json")
    assert code == 0 and json.loads(out)["state"] == "published"
    stages = [line.split("dpops: stage: ", 1)[1] for line in err.splitlines() if line.startswith("dpops: stage: ")]
    assert stages == list(release.STAGES)
    code, _, err = env.run(capsys, "release", "run", str(env.spec), *env.base("2024-01-04"), "--ledger", env.url,
                           "--publish", "--no-gx-checks", "--no-progress")
    assert code == 0 and "dpops: stage" not in err


def test_progress_on_a_terminal_uses_rich(capsys):
    from dpops.cli.progress import stage_progress

    with stage_progress(True, tty=True) as progress:
        progress("fingerprint")
        progress("reserve")
    err = capsys.readouterr().err
    assert "done fingerprint" in err and "done reserve" in err
    with pytest.raises(RuntimeError), stage_progress(True, tty=True) as progress:
        progress("publish")
        raise RuntimeError("x")
    assert "stopped in publish" in capsys.readouterr().err


# --------------------------------------------------------------------------- ledger reserve


def test_ledger_reserve_start_commit_release_with_release_checks(tmp_path, monkeypatch, capsys):
    env = make_env(tmp_path, monkeypatch, cap=1.2)
    u = ["--ledger", env.url]
    code, doc, _ = env.json(capsys, "ledger", "reserve", str(env.spec), *env.base("2024-01-02"), *u, "--json")
    assert code == 0 and doc["state"] == "reserved" and doc["epsilon_charged"] == pytest.approx(0.5)
    run_id = doc["run_id"]
    code, doc, _ = env.json(capsys, "ledger", "reserve", str(env.spec), *env.base("2024-01-02"), *u, "--json")
    assert code == 0 and doc["run_id"] == run_id and doc["epsilon_charged"] == 0  # idempotent run key
    code, doc, _ = env.json(capsys, "ledger", "reserve", str(env.spec), *env.base("2024-01-02"), *u, "--release",
                            "--reason", "held for a test", "--json")
    assert code == 0 and doc["state"] == "released" and doc["scope_total"] == pytest.approx(0.0)
    code, doc, _ = env.json(capsys, "ledger", "reserve", str(env.spec), *env.base("2024-01-03"), *u, "--commit",
                            "--output-uri", "file:///nowhere", "--json")
    assert code == 0 and doc["state"] == "committed" and doc["scope_total"] == pytest.approx(0.5)
    with open_ledger(env.url) as led:
        assert [e.kind for e in led.history() if e.run_id == doc["run_id"]] == ["reserved", "started", "committed"]
    code, doc, _ = env.json(capsys, "ledger", "reserve", str(env.spec), *env.base("2024-01-04"), *u, "--start",
                            "--json")
    assert code == 0 and doc["state"] == "started"
    # the cap: 0.5 + 0.5 charged, another 0.5 is refused (exit 5) like a release
    code, doc, err = env.json(capsys, "ledger", "reserve", str(env.spec), *env.base("2024-01-01"), *u, "--json")
    assert code == 5 and doc["exit_code"] == 5 and "budget refused" in doc["refusal"]
    # a started run is never refunded
    code, _, err = env.run(capsys, "ledger", "reserve", str(env.spec), *env.base("2024-01-04"), *u, "--release",
                           "--reason", "x")
    assert code == 6 and "only a reserved run is refunded" in err
    # the scope's unit definition is checked as for a release
    other = tmp_path / "other.yaml"
    other.write_text(env.spec.read_text().replace("adjacency: add_remove", "adjacency: replace"))
    code, _, err = env.run(capsys, "ledger", "reserve", str(other), *env.base("2024-01-02"), *u)
    assert code == 3 and "privacy_unit.adjacency 'replace' differs from scope 'shop'" in err


# --------------------------------------------------------------------------- plan SPEC


def test_plan_spec_skips_published_and_names_refusals(tmp_path, monkeypatch, capsys):
    env = make_env(tmp_path, monkeypatch, cap=1.2)
    u = ["--ledger", env.url]
    assert env.run(capsys, "release", "run", str(env.spec), *env.base(), *u, "--publish", "--no-gx-checks")[0] == 0
    with open_ledger(env.url) as led:
        before = len(led.history())
    code, doc, _ = env.json(capsys, "plan", str(env.spec), "--from", "2024-01-01", "--to", "2024-01-05", *u, "--json")
    assert code == 0 and doc["intervals"] == 4 and doc["to_run"] == 3 and doc["per_run_cost"] == pytest.approx(0.5)
    assert [i["status"] for i in doc["items"]] == ["published", "never_run", "never_run", "never_run"]
    assert [i["fits"] for i in doc["items"]] == [True, True, False, False]
    assert doc["items"][0]["action"].startswith("skip") and doc["items"][0]["cost"] == 0
    assert doc["scope_total_before"] == pytest.approx(0.5) and doc["scope_total_after"] == pytest.approx(1.0)
    assert doc["refused_intervals"] == ["2024-01-03T00:00:00Z/2024-01-04T00:00:00Z",
                                        "2024-01-04T00:00:00Z/2024-01-05T00:00:00Z"]
    code, out, _ = env.run(capsys, "plan", str(env.spec), "--from", "2024-01-01", "--to", "2024-01-05", *u)
    assert code == 0 and "2 would be refused" in " ".join(out.split()) and "basic/1 accountant" in out
    code, doc, _ = env.json(capsys, "plan", str(env.spec), "--from", "2024-01-01", "--to", "2024-01-05", *u,
                            "--check", "--json")
    assert code == 5 and doc["ok"] is False and doc["would_be_refused"] == 2
    # a started run is already charged: planned as a free retry, not a second cost
    assert env.run(capsys, "release", "run", str(env.spec), *env.base("2024-01-02"), *u, "--no-gx-checks")[0] == 0
    code, doc, _ = env.json(capsys, "plan", str(env.spec), "--from", "2024-01-02", "--to", "2024-01-04", *u, "--json")
    assert doc["items"][0]["cost"] == 0 and "retry" in doc["items"][0]["action"] and doc["to_run"] == 1
    with open_ledger(env.url) as led:
        assert len(led.history()) == before + 2  # only the release run wrote (reserve, start); plans write nothing


# --------------------------------------------------------------------------- gaps


def test_cli_refusal_leaves_a_refusal_manifest_that_gaps_reads(tmp_path, monkeypatch, capsys):
    """`dpops release run` refused by the cap writes the same refusal manifest as the DAG (one owner,
    dpops.release.refusals), so `dpops gaps` says "refused" for it, not "never run"; a second refusal of
    the same run does not write a second manifest."""
    env = make_env(tmp_path, monkeypatch, cap=0.7)  # one 0.5 run fits, the second does not
    write_input(tmp_path, "2024-01-02")
    u = ["--ledger", env.url]
    spec = str(env.spec)
    assert env.run(capsys, "release", "run", spec, *env.base("2024-01-01"), *u, "--publish", "--no-gx-checks")[0] == 0
    for _ in range(2):
        code, doc, _ = env.json(capsys, "release", "run", spec, *env.base("2024-01-02"), *u, "--publish",
                                "--no-gx-checks", "--json")
        assert code == 5 and doc["ok"] is False
    ctx = release.prepare(spec, "2024-01-02", "2024-01-03", key_path=str(env.key))
    refusals = sorted(release.manifests_dir(ctx).glob("*.refused.json"))
    assert [p.name for p in refusals] == [f"{ctx.run_id}.refused.json"]
    code, doc, _ = env.json(capsys, "gaps", spec, "--from", "2024-01-01", "--to", "2024-01-04", *u, "--json")
    assert code == 0 and doc["gaps"] == 2
    by_day = {i["interval_start"][:10]: i for i in doc["items"]}
    assert by_day["2024-01-02"]["status"] == "refused" and by_day["2024-01-03"]["status"] == "never_run"
    assert "budget refused for" in by_day["2024-01-02"]["detail"] and "nothing was charged" in by_day["2024-01-02"]["detail"]


def test_gaps_name_each_reason(tmp_path, monkeypatch, capsys):
    env = make_env(tmp_path, monkeypatch, cap=10.0)
    for d in days(7):
        write_input(tmp_path, d)
    u = ["--ledger", env.url]
    spec = str(env.spec)
    # 01 published
    assert env.run(capsys, "release", "run", spec, *env.base("2024-01-01"), *u, "--publish", "--no-gx-checks")[0] == 0
    # 02 never run
    # 03 refused: the DAG's refusal manifest is the only record (nothing reaches the ledger)
    from dpops.manifest.run_hook import write_run_manifest

    ctx = release.prepare(spec, "2024-01-03", "2024-01-04", key_path=str(env.key))
    with open_ledger(env.url) as led:
        write_run_manifest(ctx, led, {"state": "refused", "reason": "budget refused on scope 'shop'"},
                           manifests_dir=release.manifests_dir(ctx))
    # 04 failed: refunded before any noise was drawn
    assert env.run(capsys, "ledger", "reserve", spec, *env.base("2024-01-04"), *u, "--release", "--reason",
                   "failed before any mechanism ran: InputDataError")[0] == 0
    # 05 spent unpublished: started (computed, staged), never published
    assert env.run(capsys, "release", "run", spec, *env.base("2024-01-05"), *u, "--no-gx-checks")[0] == 0
    # 06 committed in the ledger, nothing visible in storage
    assert env.run(capsys, "ledger", "reserve", spec, *env.base("2024-01-06"), *u, "--commit", "--output-uri",
                   "file:///lost")[0] == 0
    # 07 abandoned by the operator
    assert env.run(capsys, "release", "run", spec, *env.base("2024-01-07"), *u, "--no-gx-checks")[0] == 0
    assert env.run(capsys, "release", "abandon", spec, *env.base("2024-01-07"), *u, "--reason", "bad input")[0] == 0

    code, doc, _ = env.json(capsys, "gaps", spec, "--from", "2024-01-01", "--to", "2024-01-09", *u, "--all", "--json")
    assert code == 0 and doc["intervals"] == 8 and doc["gaps"] == 7
    by_day = {i["interval_start"][:10]: i for i in doc["items"]}
    assert {d: i["status"] for d, i in by_day.items()} == {
        "2024-01-01": "published", "2024-01-02": "never_run", "2024-01-03": "refused", "2024-01-04": "failed",
        "2024-01-05": "spent_unpublished", "2024-01-06": "spent_unpublished", "2024-01-07": "abandoned",
        "2024-01-08": "never_run"}
    assert "budget refused" in by_day["2024-01-03"]["detail"]
    assert "started" in by_day["2024-01-05"]["detail"] and "committed" in by_day["2024-01-06"]["detail"]
    assert "bad input" in by_day["2024-01-07"]["detail"]
    code, out, _ = env.run(capsys, "gaps", spec, "--from", "2024-01-01", "--to", "2024-01-09", *u)
    assert code == 0 and "2024-01-01T00:00:00Z" not in out  # published intervals are not gaps
    flat = " ".join(out.split())
    for words in ("never run: 2", "refused: 1", "failed: 1", "spent unpublished: 2", "abandoned: 1"):
        assert words in flat, flat
    assert env.run(capsys, "gaps", spec, "--from", "2024-01-01", "--to", "2024-01-02", *u, "--check")[0] == 0
    assert env.run(capsys, "gaps", spec, "--from", "2024-01-01", "--to", "2024-01-03", *u, "--check")[0] == 7
    # the report lists the same gaps
    html = tmp_path / "report.html"
    env.run(capsys, "report", "--scope", "shop", "--spec", spec, "--from", "2024-01-01", "--to", "2024-01-09",
            "--out", str(html), *u)
    text = html.read_text()
    assert "Backfill gaps (7)" in text
    for status in ("never_run", "refused", "failed", "spent_unpublished", "abandoned"):
        assert f"data-status='{status}'" in text
    assert "data-status='published'" not in text
