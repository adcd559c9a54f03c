"""Issue 13: a file-backed GX project per deployment, user suites on the noisy output, checkpoints, Data Docs."""

from __future__ import annotations

import json

import pytest

from dpops.cli.main import main
from test_cli_release import cli_env  # noqa: F401 - the CLI release fixture (fake pipeline, real ledger)
from test_runs import write_input


def _add_user_suite(root, name, **kwargs):
    import great_expectations as gx
    import great_expectations.expectations as gxe

    from dpops.gx_project import open_project

    ctx = open_project(root)
    ctx.suites.add_or_update(gx.ExpectationSuite(name=name, expectations=[gxe.ExpectColumnValuesToBeBetween(**kwargs)]))


def test_user_suites_run_through_the_checkpoint_with_data_docs(cli_env, monkeypatch, capsys):
    tmp, spec, url, base, _ = cli_env
    root = tmp / "gx_project"
    monkeypatch.setenv("DPOPS_GX_PROJECT", str(root))
    monkeypatch.delenv("DPOPS_MANIFESTS_DIR", raising=False)
    _add_user_suite(root, "output.purchases_test.team", column="count", min_value=0)
    _add_user_suite(root, "output.other_release.team", column="count", max_value=-1)  # not this release's
    assert (root / "gx" / "expectations" / "output" / "purchases_test" / "team.json").is_file()  # a file a team edits

    assert main(["release", "run", str(spec), *base, "--publish", "--no-gx-checks", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["state"] == "published"
    manifest = json.loads(next(tmp.rglob(f"{out['run_id']}.published.json")).read_text())
    names = [c["name"] for c in manifest["validation"]["checks"]]
    assert "great expectations checkpoint dpops.purchases_test: suite dpops.output.purchases_test" in names
    assert "great expectations checkpoint dpops.purchases_test: suite output.purchases_test.team" in names
    assert not any("other_release" in n for n in names)
    assert any((root / "gx" / "uncommitted" / "validations").rglob("*.json"))  # results copied back from the sandbox
    docs = root / "gx" / "uncommitted" / "data_docs" / "local_site" / "index.html"
    assert docs.is_file() and out["run_id"] in docs.read_text()


def test_a_failing_user_suite_blocks_the_publish(cli_env, monkeypatch, capsys):
    tmp, spec, url, base, _ = cli_env
    root = tmp / "gx_project"
    monkeypatch.setenv("DPOPS_GX_PROJECT", str(root))
    _add_user_suite(root, "output.all.impossible", column="count", max_value=-1)
    assert main(["release", "run", str(spec), *base, "--publish", "--no-gx-checks"]) == 7
    err = capsys.readouterr().err
    assert "output.all.impossible" in err and "not publishing" in err
    assert not (tmp / "out" / "published").exists() or not any((tmp / "out" / "published").rglob("data.parquet"))


def test_report_links_the_data_docs(cli_env, monkeypatch, capsys):
    from dpops.ledger import open_ledger
    from dpops.report import write_report

    tmp, spec, url, base, _ = cli_env
    root = tmp / "gx_project"
    monkeypatch.setenv("DPOPS_GX_PROJECT", str(root))
    assert main(["release", "run", str(spec), *base, "--publish", "--no-gx-checks"]) == 0
    led = open_ledger(url)
    try:
        out = write_report(led, "shop", tmp / "report.html", gx_project=str(root))
    finally:
        led.close()
    text = (tmp / "report.html").read_text()
    assert 'href="./gx_project/gx/uncommitted/data_docs/local_site/index.html"' in text, out


# ------------------------------------------------------------------ issue 19 item 5: suites are code


def _exploit_suite(root, payload_cmd, name="evil"):
    """The exact suite from issue 19 item 5: a row_condition GX hands to DataFrame.query."""
    d = root / "gx" / "expectations" / "output" / "all"
    d.mkdir(parents=True, exist_ok=True)
    doc = {"name": f"output.all.{name}", "meta": {}, "expectations": [{
        "type": "expect_column_values_to_be_between",
        "kwargs": {"column": "count", "min_value": 0, "condition_parser": "pandas",
                   "row_condition": f"index >= @pd.io.common.os.system({payload_cmd!r})"},
        "meta": {}}]}
    (d / f"{name}.json").write_text(json.dumps(doc))
    return d / f"{name}.json"


def test_exploit_suite_is_refused_before_reservation_and_runs_nothing(cli_env, monkeypatch, capsys):
    from dpops.ledger import open_ledger

    tmp, spec, url, base, pipe = cli_env
    root = tmp / "gx_project"
    root.mkdir(mode=0o700)
    loot = tmp / "loot"
    loot.mkdir()
    key = base[base.index("--key-file") + 1]
    sentinel = loot / "SENTINEL"
    cmd = f"cp {key} {loot}/stolen.key; cp {tmp}/data/2024-01-01.parquet {loot}/stolen.parquet; touch {sentinel}"
    path = _exploit_suite(root, cmd)
    monkeypatch.setenv("DPOPS_GX_PROJECT", str(root))
    code = main(["release", "run", str(spec), *base, "--publish"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert f"{path}: expectations[0].kwargs.condition_parser: row conditions are refused" in err
    assert not sentinel.exists() and not (loot / "stolen.key").exists() and not (loot / "stolen.parquet").exists()
    assert pipe.calls == 0 and not (tmp / "out" / "published").exists()
    led = open_ledger(url)
    try:
        assert led.status("shop").total == 0  # refused before anything was reserved
    finally:
        led.close()


def test_a_bad_suite_appearing_after_reservation_refuses_the_publish_and_a_retry_publishes(cli_env, monkeypatch,
                                                                                               capsys):
    tmp, spec, url, base, pipe = cli_env
    root = tmp / "gx_project"
    monkeypatch.setenv("DPOPS_GX_PROJECT", str(root))
    sentinel = tmp / "SENTINEL"
    real_call = type(pipe).__call__

    def compute_then_drop_suite(self, req):
        out = real_call(self, req)
        _exploit_suite(root, f"touch {sentinel}", name="late")  # written while the run holds its reservation
        return out

    monkeypatch.setattr(type(pipe), "__call__", compute_then_drop_suite)
    assert main(["release", "run", str(spec), *base, "--publish", "--json"]) == 3
    captured = capsys.readouterr()
    assert "late.json: expectations[0].kwargs.condition_parser" in captured.err and not sentinel.exists()
    assert json.loads(captured.out)["state"] == "failed"  # charged once, staged, nothing published
    assert not (tmp / "out" / "published").exists()
    (root / "gx" / "expectations" / "output" / "all" / "late.json").unlink()
    assert main(["release", "run", str(spec), *base, "--publish", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["state"] == "published" and out["epsilon_charged"] == 0 and pipe.calls == 1  # no new charge


def test_project_dir_is_created_0700_and_a_writable_one_is_refused(cli_env, monkeypatch, capsys):
    import stat

    tmp, spec, url, base, _ = cli_env
    root = tmp / "gx_project"
    monkeypatch.setenv("DPOPS_GX_PROJECT", str(root))
    assert main(["release", "run", str(spec), *base, "--publish", "--no-gx-checks"]) == 0
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    capsys.readouterr()
    write_input(tmp, "2024-01-02")
    later = ["--interval", "2024-01-02/2024-01-03", *base[2:]]
    root.chmod(0o777)
    assert main(["release", "run", str(spec), *later, "--publish"]) == 3
    assert f"GX project directory {root} is writable by group or others" in capsys.readouterr().err
    root.chmod(0o700)
    suite = root / "gx" / "expectations" / "output" / "purchases_test" / "team.json"
    suite.parent.mkdir(parents=True)
    suite.write_text(json.dumps({"name": "output.purchases_test.team", "expectations": []}))
    suite.chmod(0o666)
    assert main(["release", "run", str(spec), *later, "--publish"]) == 3
    assert f"GX suite file {suite} is writable by group or others" in capsys.readouterr().err


def test_a_failing_team_suite_fails_the_validate_task_not_only_the_publish(tmp_path, monkeypatch):
    """Issue 28 item 6: the DAG's validate_output runs the deployment's checkpoint (dpops' suite and the team
    suites) as publish does, so a failing team suite fails validate_output, and publish_release never runs on
    an output its checks refuse; publish still refuses it on its own (it is the gate)."""
    from cli_support import make_env

    from dpops import orchestration
    from dpops.errors import IntegrityError

    env = make_env(tmp_path, monkeypatch, cap=5.0)
    root = tmp_path / "gx_project"
    monkeypatch.setenv("DPOPS_GX_PROJECT", str(root))
    _add_user_suite(root, "output.purchases_test.team", column="count", max_value=-1)  # impossible: always fails
    settings = orchestration.Settings(ledger_url=env.url, key_path=str(env.key))
    step = orchestration.Step(str(env.spec), "2024-01-01T00:00:00+00:00", "2024-01-02T00:00:00+00:00", settings,
                              "test")
    assert orchestration.reserve_step(step).state == "reserved"
    orchestration.compute_step(step)
    with pytest.raises(IntegrityError, match="output.purchases_test.team"):
        orchestration.validate_step(step)
    with pytest.raises(IntegrityError, match="output.purchases_test.team"):
        orchestration.publish_step(step)
    _add_user_suite(root, "output.purchases_test.team", column="count", min_value=0)  # the team fixes its suite
    checked = orchestration.validate_step(step)["checks"]
    assert any("suite output.purchases_test.team" in c for c in checked)
    assert orchestration.publish_step(step).state == "published"
