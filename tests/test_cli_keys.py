"""Issue 21 items 7, 10 and 11: the key, the manifests directory and the catchup setting an operator relies on.

- one owner for the noise key in the CLI: ``$DPOPS_NOISE_KEY_FILE`` is read by ``manifest verify``,
  ``release status`` and ``report`` exactly as by ``release run``; a check that could not run for want
  of the key says "skip ... no noise key", never "ok"; the report says "verified", not "verified
  (partly)", when the key is available;
- ``manifest verify RUN_ID`` finds the manifest with the deployment's ``DPOPS_MANIFESTS_DIR`` or
  ``--spec``, and says how when neither is given;
- ``dpops gaps`` says "input missing (waited N s)" for an interval whose sensor timed out;
- ``DPOPS_CATCHUP`` sets the DAGs' catchup (default false).
"""

from __future__ import annotations

import json

import pytest
from cli_support import make_env

from dpops import release


def _publish(env, capsys, day: str = "2024-01-01") -> str:
    code, doc, err = env.json(capsys, "release", "run", str(env.spec), *env.base(day), "--ledger", env.url,
                              "--publish", "--no-gx-checks", "--json")
    assert code == 0, err
    return doc["run_id"]


def test_checks_read_the_key_from_the_environment_like_release_run(tmp_path, monkeypatch, capsys):
    env = make_env(tmp_path, monkeypatch)
    run_id = _publish(env, capsys)
    ctx = release.prepare(str(env.spec), "2024-01-01", "2024-01-02", key_path=str(env.key))
    mdir = release.manifests_dir(ctx)
    u = ["--ledger", env.url]
    # without any key: the keyed check is skipped and says why; the ledger digests are ok
    code, out, _ = env.run(capsys, "manifest", "verify", run_id, "--manifests", str(mdir), *u)
    assert code == 0 and "skip  published files  (no noise key" in out
    assert "ok    published files (ledger digests)" in out and "not checked: published files" in out
    code, out, _ = env.run(capsys, "release", "status", str(env.spec), "--interval", "2024-01-01", *u)
    assert code == 0 and "published files: partly checked" in out and "skipped: no noise key" in out
    # the key in $DPOPS_NOISE_KEY_FILE, as release run reads it: every check runs
    monkeypatch.setenv("DPOPS_NOISE_KEY_FILE", str(env.key))
    code, out, _ = env.run(capsys, "manifest", "verify", run_id, "--manifests", str(mdir), *u)
    assert code == 0 and "ok    published files\n" in out and "skip" not in out, out
    code, out, _ = env.run(capsys, "release", "status", str(env.spec), "--interval", "2024-01-01", *u)
    assert code == 0 and "published files: ok" in out and "skipped" not in out
    code, out, err = env.run(capsys, "report", "--scope", "shop", "--manifests", str(mdir), *u,
                             "--out", str(tmp_path / "r.html"))
    assert code == 0, err
    html = (tmp_path / "r.html").read_text()
    assert "data-field='verification'>verified<" in html and "verified (partly)" not in html.split("<h2>Timeline")[1]


def test_manifest_verify_run_id_finds_the_deployments_manifests(tmp_path, monkeypatch, capsys):
    env = make_env(tmp_path, monkeypatch)
    run_id = _publish(env, capsys)
    ctx = release.prepare(str(env.spec), "2024-01-01", "2024-01-02", key_path=str(env.key))
    code, out, err = env.run(capsys, "manifest", "verify", run_id, "--ledger", env.url)
    assert code == 3 and "DPOPS_MANIFESTS_DIR" in err and "--spec SPEC" in err
    code, out, err = env.run(capsys, "manifest", "verify", run_id, "--ledger", env.url, "--spec", str(env.spec))
    assert code == 0, out + err
    monkeypatch.setenv("DPOPS_MANIFESTS_DIR", str(release.manifests_dir(ctx)))
    code, out, err = env.run(capsys, "manifest", "verify", run_id, "--ledger", env.url)
    assert code == 0 and f"verified: run {run_id}" in out, out + err


def test_deploy_sets_the_manifests_dir_for_every_service_that_runs_dpops():
    from pathlib import Path

    import yaml

    compose = yaml.safe_load((Path(__file__).resolve().parent.parent / "deploy" / "docker-compose.yml").read_text())
    dirs = {name: (svc.get("environment") or {}).get("DPOPS_MANIFESTS_DIR")
            for name, svc in compose["services"].items() if name.startswith("airflow-") and name != "airflow-db"}
    assert dirs and all(d == "/data/out/manifests" for d in dirs.values()), dirs


def test_gaps_names_an_input_that_never_came(tmp_path, monkeypatch, capsys):
    from dpops.orchestration import input_timed_out

    env = make_env(tmp_path, monkeypatch)
    monkeypatch.setenv("DPOPS_STATE_DIR", str(tmp_path / "state"))
    late = tmp_path / "data" / "2024-01-02.parquet"
    late.rename(tmp_path / "late.parquet")  # the day's input has not arrived
    input_timed_out(str(env.spec), "2024-01-02T00:00:00+00:00", "2024-01-03T00:00:00+00:00", waited_seconds=21600,
                    missing_files=1)
    code, doc, _ = env.json(capsys, "gaps", str(env.spec), "--from", "2024-01-01", "--to", "2024-01-04",
                            "--ledger", env.url, "--json")
    by_day = {i["interval_start"][:10]: i for i in doc["items"]}
    assert by_day["2024-01-02"]["status"] == "input_missing"
    assert by_day["2024-01-02"]["detail"].startswith("input missing (waited 21600 s")
    assert by_day["2024-01-03"]["status"] == "never_run"
    code, out, _ = env.run(capsys, "gaps", str(env.spec), "--from", "2024-01-01", "--to", "2024-01-04",
                           "--ledger", env.url)
    assert "input missing: 1" in out
    # the input arrives (issue 28 item 7): the day is no longer "input missing", it only needs a run, and the
    # advice clears the sensor WITH its downstream tasks and names the way to fill a REST-triggered run
    (tmp_path / "late.parquet").rename(late)
    code, doc, _ = env.json(capsys, "gaps", str(env.spec), "--from", "2024-01-02", "--to", "2024-01-03",
                            "--ledger", env.url, "--json")
    item = doc["items"][0]
    assert item["status"] == "never_run" and item["detail"].startswith("the input arrived after a run gave up")
    assert "--downstream" in item["detail"] and "conf.interval" in item["detail"]
    # once the day is published, the record no longer matters
    _publish(env, capsys, "2024-01-02")
    code, doc, _ = env.json(capsys, "gaps", str(env.spec), "--from", "2024-01-02", "--to", "2024-01-03",
                            "--ledger", env.url, "--json")
    assert doc["gaps"] == 0


@pytest.mark.parametrize("value,expected", [(None, False), ("false", False), ("true", True), ("1", True)])
def test_catchup_is_a_deployment_setting(tmp_path, monkeypatch, value, expected):
    import airflow_support  # noqa: F401  (environment before airflow)

    import sys
    from pathlib import Path

    dags = Path(__file__).resolve().parent.parent / "dags"
    monkeypatch.syspath_prepend(str(dags))
    if value is None:
        monkeypatch.delenv("DPOPS_CATCHUP", raising=False)
    else:
        monkeypatch.setenv("DPOPS_CATCHUP", value)
    sys.modules.pop("dpops_dag_factory", None)
    import dpops_dag_factory

    dag = dpops_dag_factory.build_release_dag(dags.parent / "examples" / "daily_purchases.yaml", register=False)
    assert dag.catchup is expected
    assert json.dumps(sorted(dag.params.keys())) == '["interval", "restate"]'


def test_a_catchup_typo_is_refused(monkeypatch):
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "dags"))
    monkeypatch.setenv("DPOPS_CATCHUP", "ture")
    sys.modules.pop("dpops_dag_factory", None)
    import dpops_dag_factory

    with pytest.raises(ValueError, match="DPOPS_CATCHUP"):
        dpops_dag_factory.catchup_setting()


def test_a_wait_record_that_cannot_be_written_is_an_error_with_its_reason_in_the_log(tmp_path, monkeypatch, caplog):
    """The sensor's timeout path swallows this failure (the timeout is the task's error); it must still reach the
    task log at ERROR with the reason, or ``dpops gaps`` says never_run with nothing to explain it."""
    import logging

    from dpops.orchestration import input_timed_out

    env = make_env(tmp_path, monkeypatch)
    blocker = tmp_path / "state"
    blocker.write_text("a file where the state directory belongs")
    monkeypatch.setenv("DPOPS_STATE_DIR", str(blocker))
    with caplog.at_level(logging.WARNING, logger="dpops.orchestration"):
        input_timed_out(str(env.spec), "2024-01-02T00:00:00+00:00", "2024-01-03T00:00:00+00:00",
                        waited_seconds=20, missing_files=1)
    (rec,) = [r for r in caplog.records if "could not record the input wait" in r.getMessage()]
    assert rec.levelno == logging.ERROR
    assert str(blocker) in rec.getMessage() and "ENOTDIR" in rec.getMessage(), rec.getMessage()
