"""Issue 13: a file-backed GX project per deployment, user suites on the noisy output, checkpoints, Data Docs."""

from __future__ import annotations

import json

import pytest

from dpops.cli.main import main
from test_cli_release import cli_env  # noqa: F401 - the CLI release fixture (fake pipeline, real ledger)


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
