"""The accuracy view through the real CLI: ``dpops plan SPEC``, ``--solve``, ``spec check --require-targets``,
the ``accuracy:`` schema, and the half-width regression at huge epsilon."""

from __future__ import annotations

import json

import pytest
import yaml
from cli_support import make_env

from dpops.cli.main import main
from dpops.errors import SpecError
from dpops.ledger import open_ledger
from dpops.ledger.model import RunKey
from dpops.noise.mechanisms import laplace_mechanism
from dpops.release_plan import plan_release
from dpops.spec import load_spec, parse_spec

TARGETS = {"confidence": 0.95, "targets": [
    {"kind": "error", "metric": "count", "max_error": 10},
    {"kind": "error", "metric": "sum_amount", "max_relative_error": 0.05, "at_value": 5000},
]}


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _with_targets(env, targets=TARGETS):
    doc = yaml.safe_load(env.spec.read_text())
    doc["accuracy"] = targets
    env.spec.write_text(yaml.safe_dump(doc))
    return load_spec(env.spec)


def test_plan_accuracy_view_reads_the_scope_from_the_ledger(tmp_path, monkeypatch, capsys):
    env = make_env(tmp_path, monkeypatch, cap=1.2, planner_fn=plan_release)
    spec = load_spec(env.spec)
    with open_ledger(env.url) as led:  # one interval already charged on the scope
        key = RunKey(release=spec.name, spec_hash=spec.spec_hash, interval_start="2024-01-01T00:00:00Z",
                     interval_end="2024-01-02T00:00:00Z", input_fingerprint="f" * 64, key_id="k")
        led.reserve(key, "shop", plan_release(spec).events, actor="test")
        before = len(led.history())
    code, out, _ = _run(capsys, "plan", str(env.spec), "--ledger", env.url, "--accountants", "basic,rdp", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ledger"]["reachable"] and doc["ledger"]["accountant"] == "basic/1"
    rows = {r["accountant"]: r for r in doc["horizon"]["rows"]}
    # 0.5 per run, 0.5 already charged, cap 1.2: one more interval fits, the next one is refused
    assert rows["basic/1"]["per_interval"] == pytest.approx(0.5, rel=1e-6)
    assert rows["basic/1"]["intervals_fit"] == 1 and rows["basic/1"]["cap_reached_on"] is not None
    assert rows["rdp/1"]["intervals_fit"] >= 1
    preds = {p["metric"]: p for p in doc["accuracy"]["predictions"]}
    assert preds["count"]["distribution"] == "discrete_laplace on the integers"
    assert preds["count"]["abs_error"] > 0 and preds["count"]["coverage"] >= 0.95
    assert any("Protected unit" in line for line in doc["accuracy"]["explain"])
    code, out, _ = _run(capsys, "plan", str(env.spec), "--ledger", env.url, "--accountants", "basic")
    assert code == 0 and "for a reviewer" in out and "predicted accuracy" in out
    with open_ledger(env.url) as led:
        assert len(led.history()) == before  # the accuracy view writes nothing


def test_plan_without_ledger_says_so_and_uses_cap(tmp_path, monkeypatch, capsys):
    env = make_env(tmp_path, monkeypatch, planner_fn=plan_release)
    code, out, _ = _run(capsys, "plan", str(env.spec), "--scope-cap", "5", "--accountants", "basic", "--json")
    doc = json.loads(out)
    assert code == 0 and not doc["ledger"]["reachable"] and "no ledger" in doc["ledger"]["note"]
    assert doc["horizon"]["rows"][0]["intervals_fit"] == 10  # 5 / 0.5
    code, _, err = _run(capsys, "plan", str(env.spec), "--from", "2024-01-01")
    assert code == 3 and "both --from and --to" in err


def test_spec_check_reports_targets_and_require_targets_fails_ci(tmp_path, monkeypatch, capsys):
    env = make_env(tmp_path, monkeypatch, planner_fn=plan_release)
    _with_targets(env)
    code, out, _ = _run(capsys, "spec", "check", str(env.spec), "--json")
    doc = json.loads(out)
    assert code == 0 and [t["met"] for t in doc["accuracy"]["targets"]] == [False, True]
    code, out, _ = _run(capsys, "spec", "check", str(env.spec))
    assert code == 0 and "target NOT MET: count" in out and "target met: sum_amount" in out
    code, _, err = _run(capsys, "spec", "check", str(env.spec), "--require-targets")
    assert code == 3 and "does not meet 1 accuracy target" in err and "plan --solve" in err
    code, out, _ = _run(capsys, "spec", "check", str(env.spec), "--require-targets", "--json")
    assert code == 3 and json.loads(out)["ok"] is False


def test_plan_solve_finds_a_split_and_require_targets_respects_the_remaining_budget(tmp_path, monkeypatch, capsys):
    env = make_env(tmp_path, monkeypatch, cap=1.2, planner_fn=plan_release)
    spec = _with_targets(env)
    code, out, _ = _run(capsys, "plan", str(env.spec), "--solve", "--require-targets", "--ledger", env.url,
                        "--accountants", "basic", "--json")
    doc = json.loads(out)
    sol = doc["solution"]
    assert code == 0 and sol["feasible"] and sol["accountant"] == "basic/1"
    assert all(t["met"] for t in sol["targets"]) and sol["cost"] <= 1.2
    # the solved split, written back into the spec, passes spec check --require-targets
    solved = yaml.safe_load(env.spec.read_text())
    solved["budget"].update(sol["spec_patch"]["budget"])
    env.spec.write_text(yaml.safe_dump(solved))
    assert _run(capsys, "spec", "check", str(env.spec), "--require-targets")[0] == 0
    # spend most of the cap: the least-cost split no longer fits; the failing targets are named
    with open_ledger(env.url) as led:
        key = RunKey(release=spec.name, spec_hash=spec.spec_hash, interval_start="2024-01-01T00:00:00Z",
                     interval_end="2024-01-02T00:00:00Z", input_fingerprint="f" * 64, key_id="k")
        big = load_spec(env.spec).with_budget(1.2 - sol["cost"] / 2, None)
        led.reserve(key, "shop", plan_release(big).events, actor="test")
    code, out, err = _run(capsys, "plan", str(env.spec), "--solve", "--require-targets", "--ledger", env.url,
                          "--accountants", "basic")
    assert code == 3 and "accuracy target(s) not met" in err and "count" in err
    assert "the split that fits with the smallest largest shortfall" in " ".join(out.split())


def test_accuracy_schema_is_strict_and_outside_the_spec_hash(tmp_path, monkeypatch):
    env = make_env(tmp_path, monkeypatch, planner_fn=plan_release)
    before = load_spec(env.spec).spec_hash
    assert _with_targets(env).spec_hash == before  # a target changes no mechanism, so no new release version
    doc = yaml.safe_load(env.spec.read_text())
    bad = [
        ({"kind": "error", "metric": "nope", "max_error": 1}, "accuracy.targets[0].metric"),
        ({"kind": "error", "metric": "count", "max_error": 1, "max_relative_error": 0.1}, "exactly one of"),
        ({"kind": "keep", "at_units": 10, "min_probability": 0.9}, "needs private partition selection"),
        ({"kind": "error", "metric": "sum_amount", "max_relative_error": 0.1}, "set at_value"),
        ({"kind": "rank_error", "metric": "count", "max_rank_error": 0.1}, "applies to quantiles"),
        ({"kind": "error", "metric": "count", "max_eror": 1}, "unknown key"),
    ]
    for target, msg in bad:
        doc["accuracy"] = {"targets": [target]}
        with pytest.raises(SpecError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            parse_spec(doc, source="t.yaml", base_dir=tmp_path)


def test_halfwidth_at_a_huge_epsilon_is_zero_not_a_crash():
    """Regression: a Laplace scale far below one lattice step made p underflow to 0 and log(0) raise."""
    p = laplace_mechanism(2000.0, 1.0, integer_valued=True)
    assert p.halfwidth(0.95) == 0.0 and p.ci95_halfwidth() == 0.0


def _manifest_for(spec):
    from dpops.analysis.document import manifest_section
    from dpops.manifest.build import build_manifest

    plan = plan_release(spec)
    key = {"release": spec.name, "spec_hash": spec.spec_hash, "interval_start": "2024-01-01T00:00:00Z",
           "interval_end": "2024-01-02T00:00:00Z", "input_fingerprint": "f" * 64, "key_id": "k"}
    return build_manifest(run_key=key, spec_document=spec.canonical_document(), release_plan=plan.describe(),
                          events=plan.events, accountant="basic/1", outcome="refused", randomness_mode="test",
                          accuracy=manifest_section(spec, plan))


def test_manifest_records_targets_and_verify_recomputes_them(tmp_path, monkeypatch):
    from dpops.manifest.schema import schema_problems
    from dpops.manifest.verify import verify_manifest

    env = make_env(tmp_path, monkeypatch, planner_fn=plan_release)
    m = _manifest_for(_with_targets(env))
    assert schema_problems(m) == []
    assert [t["met"] for t in m["accuracy"]["targets"]] == [False, True]

    def accuracy_check(doc):
        return next(c for c in verify_manifest(doc).checks if c.name == "accuracy")

    assert accuracy_check(m).ok
    forged = json.loads(json.dumps(m))
    forged["accuracy"]["targets"][0]["met"] = True  # a manifest claiming a target it does not meet
    assert not accuracy_check(forged).ok
    # a manifest without targets (and every older one) has no accuracy field and no such check
    old = _manifest_for(load_spec(tmp_path / "spec.yaml").with_budget(0.5, None).model_copy(update={"accuracy": None}))
    assert "accuracy" not in old and schema_problems(old) == []
    assert all(c.name != "accuracy" for c in verify_manifest(old).checks)


def test_a_version_1_accuracy_section_still_verifies_and_version_2_is_exact(tmp_path, monkeypatch):
    """Old manifests recorded the first-order mean prediction (``dpops.accuracy/1``); verify recomputes each
    section with the version it names, so both verify, and a section relabelled with the other version does
    not (at 100 rows the two predictions differ)."""
    from dpops.analysis.accuracy import first_order_mean_halfwidth
    from dpops.analysis.document import MANIFEST_SCHEMA
    from dpops.manifest.verify import verify_manifest

    env = make_env(tmp_path, monkeypatch, planner_fn=plan_release)
    doc = yaml.safe_load(env.spec.read_text())
    doc["metrics"].append({"type": "mean", "column": "amount", "bounds": [0, 100]})
    env.spec.write_text(yaml.safe_dump(doc))
    target = {"kind": "error", "metric": "mean_amount", "max_error": 5, "at_units": 100, "at_value": 62.5}
    spec = _with_targets(env, {"confidence": 0.95, "targets": [target]})
    m = _manifest_for(spec)
    assert m["accuracy"]["schema"] == MANIFEST_SCHEMA == "dpops.accuracy/3"
    plan = plan_release(spec)
    mean = next(x for x in plan.metrics if x.key == "mean_amount")
    v1 = first_order_mean_halfwidth(plan, mean, 100, 12.5, 0.95)
    v2 = m["accuracy"]["targets"][0]["predicted"]
    assert abs(v2 / v1 - 1) > 0.05, (v1, v2)  # the two predictions differ at 100 rows

    def accuracy_check(doc):
        return next(c for c in verify_manifest(doc).checks if c.name == "accuracy")

    assert accuracy_check(m).ok
    old = json.loads(json.dumps(m))
    old["accuracy"]["schema"] = "dpops.accuracy/1"
    old["accuracy"]["targets"][0]["predicted"] = v1
    old["accuracy"]["targets"][0]["met"] = v1 <= 5
    old["accuracy"]["targets"][0]["shortfall"] = 0.0 if v1 <= 5 else v1 / 5 - 1.0
    assert accuracy_check(old).ok, accuracy_check(old).problems
    relabelled = json.loads(json.dumps(m))
    relabelled["accuracy"]["schema"] = "dpops.accuracy/1"
    assert not accuracy_check(relabelled).ok


def test_a_version_2_section_with_variance_and_sum_targets_still_verifies(tmp_path, monkeypatch):
    """Version 3 changed the variance (exact at every n) and a sum with a true value (its clamp at 0); a
    ``dpops.accuracy/2`` section recorded the first-order variance and the raw sum noise, and verify recomputes
    it with those (a version-3 section relabelled as 2 does not verify: the predictions differ)."""
    from dpops.analysis.accuracy import first_order_variance_error, vector_error
    from dpops.manifest.verify import verify_manifest

    env = make_env(tmp_path, monkeypatch, planner_fn=plan_release)
    doc = yaml.safe_load(env.spec.read_text())
    doc["metrics"].append({"type": "variance", "column": "amount", "bounds": [0, 100]})
    env.spec.write_text(yaml.safe_dump(doc))
    targets = [{"kind": "error", "metric": "variance_amount", "max_error": 500, "at_units": 300},
               {"kind": "error", "metric": "sum_amount", "max_error": 5000, "at_units": 100, "at_value": 100}]
    spec = _with_targets(env, {"confidence": 0.95, "targets": targets})
    m = _manifest_for(spec)
    plan = plan_release(spec)
    var = next(x for x in plan.metrics if x.key == "variance_amount")
    total = next(x for x in plan.metrics if x.key == "sum_amount")
    old_values = [first_order_variance_error(plan, var, 300, 0.0, 2500.0, 0.95)[1],
                  vector_error(total.vectors[0].params, 0.95)[1]]
    for t, v in zip(m["accuracy"]["targets"], old_values, strict=True):
        assert abs(t["predicted"] / v - 1) > 1e-3, (t, v)  # version 3 differs from version 2 on both

    def accuracy_check(doc):
        return next(c for c in verify_manifest(doc).checks if c.name == "accuracy")

    assert accuracy_check(m).ok
    relabelled = json.loads(json.dumps(m))
    relabelled["accuracy"]["schema"] = "dpops.accuracy/2"
    assert not accuracy_check(relabelled).ok
    old = json.loads(json.dumps(relabelled))
    for t, v in zip(old["accuracy"]["targets"], old_values, strict=True):
        t["predicted"] = v
        t["met"] = v <= t["target"]
        t["shortfall"] = 0.0 if t["met"] else v / t["target"] - 1.0
    assert accuracy_check(old).ok, accuracy_check(old).problems


def test_plan_on_a_pure_dp_scope_names_what_zcdp_cannot_certify(tmp_path, monkeypatch, capsys):
    """Issue 28 item 12: on a delta = 0 scope, zcdp/1 cannot certify any run; plan says so instead of
    "0 intervals fit, cap reached today", and the horizon heading names the scope once."""
    from dpops.ledger.model import ScopeDefinition

    env = make_env(tmp_path, monkeypatch, planner_fn=plan_release)
    url = f"sqlite:///{tmp_path / 'pure.sqlite'}"
    with open_ledger(url) as led:
        led.create_scope(ScopeDefinition(name="shop", unit="a user's purchases", unit_column="user_id", epsilon=20.0,
                                         delta=0.0, rho=None, accountant="basic/1", adjacency="add_remove"),
                         actor="test")
    code, out, _ = _run(capsys, "plan", str(env.spec), "--ledger", url, "--accountants", "basic,zcdp", "--json")
    rows = {r["accountant"]: r for r in json.loads(out)["horizon"]["rows"]}
    assert code == 0 and rows["basic/1"]["intervals_fit"] == 40
    z = rows["zcdp/1"]
    assert z["intervals_fit"] is None and z["cap_reached_on"] is None and "pure DP" in z["note"]
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = _run(capsys, "plan", str(env.spec), "--ledger", url, "--accountants", "basic,zcdp")
    assert code == 0 and ("horizon of the declared budget on scope shop (read from the ledger, 0 charged event(s) so "
                          "far)") in " ".join(out.split())
    assert "zcdp/1: the scope is pure DP (delta = 0)" in " ".join(out.split())
    assert max(len(line) for line in out.splitlines()) <= 80
