"""Issue 20 section 3: a release whose bounds came from ``dpops tune`` says so, in its manifest and in the report.

Through the real CLI: ``dpops tune`` on private data (``--i-understand-this-reads-private-data``) records a
``private_access`` ledger entry; ``dpops spec apply-patch`` writes the recommended bounds and the spec's
``tuning`` block; ``dpops release run`` carries it into the manifest's ``provenance.tuning``; ``dpops report``
shows "bounds chosen by looking at the private data on <date>" for that release; ``dpops manifest verify
--ledger`` checks the entry, and fails on a manifest naming another entry, another fingerprint or a milder
statement. The run's pipeline and plan are the run tests' stand-ins (``cli_support``); tune uses the real plan.
"""

from __future__ import annotations

import copy
import json

import yaml
from cli_support import make_env

import dpops.release_plan
from dpops import release
from dpops.ledger import open_ledger

REAL_PLAN = dpops.release_plan.plan_release


def _tuned_and_released(tmp_path, monkeypatch, capsys):
    env = make_env(tmp_path, monkeypatch, cap=5.0)
    u = ["--ledger", env.url]
    out = tmp_path / "tune-out"
    with monkeypatch.context() as m:  # tune predicts with the real plan; the run keeps the stand-in
        m.setattr(dpops.release_plan, "plan_release", REAL_PLAN)
        code, doc, err = env.json(capsys, *u, "tune", str(env.spec), "--sample", str(tmp_path / "data" / "2024-01-01.parquet"),
                                  "--i-understand-this-reads-private-data", "--reason", "first bounds, ticket DP-1",
                                  "--key-file", str(env.key), "--actor", "alice", "--l0", "1,2", "--linf", "1,3",
                                  "--out", str(out), "--json")
    assert code == 0, err
    with open_ledger(env.url) as led:
        (access,) = [e for e in led.history("shop") if e.kind == "private_access"]
    code, applied, err = env.json(capsys, "spec", "apply-patch", str(env.spec), str(out / "patch.yaml"), "--json")
    assert code == 0, err
    tuned = tmp_path / "spec.tuned.yaml"
    assert applied["written"] == str(tuned)
    statement = f"bounds chosen by looking at the private data on {access.ts[:10]}"
    assert applied["tuning"] == statement
    block = yaml.safe_load(tuned.read_text())["tuning"]
    assert block["data"]["ledger_entry"] == access.id and block["data"]["read_at"] == access.ts
    assert "sample_rows" not in json.dumps(block) and "loss_value" not in json.dumps(block)  # no sample statistics
    code, run, err = env.json(capsys, "release", "run", str(tuned), *env.base("2024-01-01"), *u, "--publish",
                              "--no-gx-checks", "--json")
    assert code == 0 and run["state"] == "published", err
    ctx = release.prepare(str(tuned), "2024-01-01", "2024-01-02", key_path=str(env.key))
    path = release.manifests_dir(ctx) / f"{run['run_id']}.published.json"
    return env, access, statement, path


def test_private_tuning_reaches_the_manifest_the_report_and_verify(tmp_path, monkeypatch, capsys):
    env, access, statement, path = _tuned_and_released(tmp_path, monkeypatch, capsys)
    u = ["--ledger", env.url]
    m = json.loads(path.read_text())
    t = m["provenance"]["tuning"]
    assert t["statement"] == statement and t["data"]["statement"] == statement
    assert t["data"]["ledger_entry"] == access.id and t["data"]["fingerprint"] == access.data["fingerprint"]
    assert t["data"]["scope"] == "shop" and "tuning" not in m["spec"]  # outside the spec (and its hash)
    assert m["contribution_bounds"]["max_partitions_per_unit"] in (1, 2)  # the recommended bounds were applied
    code, doc, err = env.json(capsys, "manifest", "verify", str(path), *u, "--key-file", str(env.key), "--json")
    assert code == 0, doc
    checks = {c["name"]: c for c in doc["checks"]}
    assert checks["tuning provenance"]["ok"] and checks["tuning provenance (ledger)"]["ok"]
    assert checks["tuning provenance (ledger)"]["skipped"] is None
    report = tmp_path / "report.html"
    code, out, err = env.run(capsys, "report", "--scope", "shop", *u, "--manifests", str(path.parent),
                             "--out", str(report))
    assert code == 0, err
    html = report.read_text()
    assert statement in html and "data-field='tuning' data-source='private'" in html
    assert f"entry #{access.id}" in html


TAMPERINGS = [
    ("another entry id", lambda d: d.__setitem__("ledger_entry", 1), "provenance.tuning.data.ledger_entry: entry 1 is a"),
    ("an entry id the scope does not have", lambda d: d.__setitem__("ledger_entry", 9999),
     "is not an entry of scope 'shop'"),
    ("another fingerprint", lambda d: d.__setitem__("fingerprint", "hmac-sha256:" + "0" * 64),
     "provenance.tuning.data.fingerprint"),
    ("another time", lambda d: d.update(read_at="2020-01-01T00:00:00+00:00",
                                        statement="bounds chosen by looking at the private data on 2020-01-01"),
     "provenance.tuning.data.read_at"),
]


def test_a_tampered_provenance_fails_verify(tmp_path, monkeypatch, capsys):
    """Each edit of the private read's record fails ``manifest verify --ledger`` naming the field; a milder
    statement fails even without the ledger."""
    env, access, statement, path = _tuned_and_released(tmp_path, monkeypatch, capsys)
    m = json.loads(path.read_text())
    bad = tmp_path / "forged.json"
    for what, edit, needle in TAMPERINGS:
        forged = copy.deepcopy(m)
        edit(forged["provenance"]["tuning"]["data"])
        t = forged["provenance"]["tuning"]
        t["statement"] = t["data"]["statement"]  # a consistent forgery: only the ledger can tell
        bad.write_text(json.dumps(forged))
        code, out, err = env.run(capsys, "manifest", "verify", str(bad), "--ledger", env.url)
        assert code == 7 and needle in out + err, (what, out, err)
    # a real private_access entry, but written after the release: it cannot have chosen the release's bounds
    with open_ledger(env.url) as led:
        late = led.record_private_access("shop", actor="mallory", fingerprint=access.data["fingerprint"],
                                         reason="after the fact", purpose="tune purchases_test")
        late_ts = next(e.ts for e in led.history("shop") if e.id == late)
    forged = copy.deepcopy(m)
    forged["provenance"]["tuning"]["data"].update(ledger_entry=late, read_at=late_ts)
    forged["provenance"]["tuning"]["data"]["statement"] = forged["provenance"]["tuning"]["statement"] = \
        f"bounds chosen by looking at the private data on {late_ts[:10]}"
    bad.write_text(json.dumps(forged))
    code, out, err = env.run(capsys, "manifest", "verify", str(bad), "--ledger", env.url)
    assert code == 7 and "written after this run's first ledger entry" in out + err, out + err
    forged = copy.deepcopy(m)
    forged["provenance"]["tuning"]["statement"] = "bounds chosen with care"
    bad.write_text(json.dumps(forged))
    code, out, err = env.run(capsys, "manifest", "verify", str(bad))
    assert code == 7 and "provenance.tuning.statement" in out + err
    # the untouched manifest still verifies (the forgeries above are what failed)
    code, out, err = env.run(capsys, "manifest", "verify", str(path), "--ledger", env.url)
    assert code == 0, out + err


def test_apply_patch_refuses_a_foreign_patch_and_a_scope_mismatch(tmp_path, monkeypatch, capsys):
    env = make_env(tmp_path, monkeypatch, cap=5.0)
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({"schema": "dpops.tune-patch/1", "spec": "another_release", "patch": {}}))
    code, out, err = env.run(capsys, "spec", "apply-patch", str(env.spec), str(other))
    assert code == 3 and "another_release" in err
    wrong_scope = {"schema": "dpops.tune-patch/1", "spec": "purchases_test", "patch": {"tuning": {
        "candidate": "L0=1 Linf=2", "loss": "targets", "candidates": 2,
        "data": {"source": "private", "scope": "elsewhere", "fingerprint": "hmac-sha256:" + "a" * 64,
                 "ledger_entry": 3, "read_at": "2024-01-01T00:00:00+00:00"}}}}
    p = tmp_path / "wrong.yaml"
    p.write_text(yaml.safe_dump(wrong_scope))
    code, out, err = env.run(capsys, "spec", "apply-patch", str(env.spec), str(p))
    assert code == 3 and "tuning.data.scope" in err
    assert not (tmp_path / "spec.tuned.yaml").exists()
    milder = copy.deepcopy(wrong_scope)
    milder["patch"]["tuning"]["data"].update(scope="shop", statement="bounds chosen with care")
    p.write_text(yaml.safe_dump(milder))
    code, out, err = env.run(capsys, "spec", "apply-patch", str(env.spec), str(p))
    assert code == 3 and "statement must be" in err
