"""Run manifests: schema, atomic immutable files, signing, and verification with negative controls."""

from __future__ import annotations

import copy
import json
import os
import re
import sqlite3
from types import SimpleNamespace

import pytest

from dpops.cli.main import main
from dpops.errors import IntegrityError, InvalidParameter, StorageError
from dpops.manifest import (
    SCHEMA_VERSION, read_manifest, sign_manifest, verify_manifest, verify_signature, write_manifest,
    write_run_manifest,
)
from dpops.manifest.schema import schema_problems, upgrade
from dpops.manifest.sign import generate_signing_key
from dpops.spec import load_spec
from manifest_support import ACTOR, EXAMPLE_SPEC, fp, make_ledger, run_key, synthetic_manifest


# --------------------------------------------------------------------------- schema and files


def test_schema_accepts_a_built_manifest_and_names_bad_fields():
    m = synthetic_manifest()
    assert m["schema_version"] == SCHEMA_VERSION and schema_problems(m) == []
    bad = copy.deepcopy(m)
    del bad["privacy_unit"]["adjacency"]
    bad["contribution_bounds"]["max_partitions_per_unit"] = "5"
    probs = schema_problems(bad)
    assert any(p.startswith("privacy_unit:") and "adjacency" in p for p in probs)
    assert any(p.startswith("contribution_bounds.max_partitions_per_unit:") for p in probs)


def test_no_input_statistics_can_enter_a_manifest():
    m = synthetic_manifest(validation={"checks": [{"name": "input_schema", "passed": True, "rows": 10432}],
                                       "proceeded": True, "unexpected_count": 3})
    assert m["validation"] == {"checks": [{"name": "input_schema", "passed": True}], "proceeded": True}
    for path in (("rows_read",), ("validation", "checks", 0, "unexpected_percent"), ("timings", "rows")):
        bad = copy.deepcopy(m)
        target = bad
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = 12
        assert any("Additional properties" in p or "is not of type" in p for p in schema_problems(bad)), path
    # a plain (unkeyed) output hash is refused: only HMAC fingerprints are reviewer-safe
    bad = copy.deepcopy(m)
    bad["output"]["fingerprints"]["data.parquet"] = "ab" * 32
    assert any(p.startswith("output.fingerprints.data.parquet") for p in schema_problems(bad))
    assert m["timings"]["steps_seconds"] == {"compute": 3}  # whole seconds only


def test_write_is_atomic_readonly_and_immutable(tmp_path):
    m = synthetic_manifest()
    path = write_manifest(m, tmp_path)
    assert os.path.basename(path) == f"{m['run_id']}.published.json"
    assert read_manifest(path) == json.loads(json.dumps(m))
    assert not os.access(path, os.W_OK) or os.geteuid() == 0
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(path)]  # no temp file left behind
    with pytest.raises(StorageError, match="immutable"):
        write_manifest(m, tmp_path)
    # a correction is a new document pointing at the old one
    from dpops.manifest.io import file_sha256

    fixed = dict(m, corrects={"manifest": os.path.basename(path), "sha256": file_sha256(path), "reason": "typo"})
    path2 = write_manifest(fixed, tmp_path)
    assert path2 != path and read_manifest(path2)["corrects"]["sha256"] == file_sha256(path)


def test_read_rejects_bad_files_naming_the_field(tmp_path):
    m = synthetic_manifest()
    for mutate, field in (
        (lambda d: d.pop("accountant"), "'accountant' is a required property"),
        (lambda d: d["privacy"]["run"].__setitem__("epsilon", "0.5"), "privacy.run.epsilon"),
        (lambda d: d["randomness"].__setitem__("mode", "urandom"), "randomness.mode"),
    ):
        d = copy.deepcopy(m)
        mutate(d)
        p = tmp_path / f"{len(list(tmp_path.iterdir()))}.json"
        p.write_text(json.dumps(d))
        with pytest.raises(IntegrityError, match=field.replace("[", r"\[").replace(".", r"\.")):
            read_manifest(p)
    p = tmp_path / "future.json"
    p.write_text(json.dumps(dict(m, schema_version="dpops.manifest/9")))
    with pytest.raises(IntegrityError, match="dpops.manifest/9"):
        read_manifest(p)
    p = tmp_path / "nan.json"
    p.write_text(json.dumps(m).replace('"delta": 1e-07', '"delta": NaN', 1))
    with pytest.raises(IntegrityError, match="NaN"):
        read_manifest(p)
    assert upgrade(m) is m


def test_ed25519_signature(tmp_path):
    kid = generate_signing_key(tmp_path / "k.pem", tmp_path / "k.pub")
    other = generate_signing_key(tmp_path / "o.pem", tmp_path / "o.pub")
    m = sign_manifest(synthetic_manifest(), tmp_path / "k.pem")
    assert m["signature"]["public_key_id"] == kid and schema_problems(m) == []
    assert verify_signature(m, tmp_path / "k.pub") == kid
    with pytest.raises(IntegrityError, match="signature.public_key_id"):
        verify_signature(m, tmp_path / "o.pub")
    assert other != kid
    tampered = copy.deepcopy(m)
    tampered["privacy"]["run"]["epsilon"] *= 0.5
    with pytest.raises(IntegrityError, match="signature.value"):
        verify_signature(tampered, tmp_path / "k.pub")
    assert oct((tmp_path / "k.pem").stat().st_mode & 0o777) == "0o600"


# --------------------------------------------------------------------------- a real run, verified


@pytest.fixture()
def published(tmp_path):
    """A published run of the example spec through the real ledger, its manifest written by the run hook."""
    from dpops.release_plan import plan_release

    spec = load_spec(EXAMPLE_SPEC)
    plan = plan_release(spec)
    ledger = make_ledger(tmp_path, accountant="rdp/1", epsilon=10.0, delta=1e-7)
    # an earlier release on the same scope, so the scope history has something to drop
    earlier = run_key(spec.name, 0, spec_hash=spec.spec_hash)
    r0 = ledger.reserve(earlier, "purchases", plan.events, actor=ACTOR)
    ledger.start(r0.run_id, actor=ACTOR)
    ledger.commit(r0.run_id, output_uri="file:///out/0", actor=ACTOR)
    key = run_key(spec.name, 1, spec_hash=spec.spec_hash)
    rec = ledger.reserve(key, "purchases", plan.events, actor=ACTOR)
    ledger.start(rec.run_id, actor=ACTOR)
    ctx = SimpleNamespace(spec=spec, run_key=key, plan=plan, randomness="keyed")
    outcome = {"state": "published", "output_uri": "file:///out/1"}
    mdir = tmp_path / "manifests"
    path = write_run_manifest(ctx, ledger, outcome, manifests_dir=mdir,
                              validation={"checks": [{"name": "input_schema", "passed": True}], "proceeded": True},
                              output_fingerprints={"data.parquet": fp("noisy output")})
    ledger.commit(rec.run_id, output_uri="file:///out/1", actor=ACTOR)
    # a retry of the same step finds the same claim and does not fail
    assert write_run_manifest(ctx, ledger, outcome, manifests_dir=mdir,
                              validation={"checks": [{"name": "input_schema", "passed": True}], "proceeded": True},
                              output_fingerprints={"data.parquet": fp("noisy output")}) == path
    yield SimpleNamespace(ledger=ledger, path=path, manifest=read_manifest(path), tmp=tmp_path, earlier=r0.run_id,
                          url=f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    ledger.close()


def test_manifest_content(published):
    m = published.manifest
    assert m["outcome"]["state"] == "published" and m["outcome"]["ledger_state"] == "started"
    assert m["privacy_unit"]["adjacency"] == "add_remove"
    assert m["contribution_bounds"] == {"max_partitions_per_unit": 5, "max_rows_per_unit_per_partition": 2}
    assert m["value_bounds"]["sum_amount"] == [0.0, 100.0]
    assert m["accountant"]["ref"] == "rdp/1" and m["randomness"] == {"mode": "keyed", "key_id": "k1", "test_mode": False}
    assert len(m["ledger"]["entry_ids"]) == 2 and m["privacy"]["scope"]["history"]["entries"] == 1 + 3 + 2  # created, earlier run, this run so far
    assert m["code"]["libraries"]["numpy"]
    text = json.dumps(m)
    assert "user_id" in text and "rows" not in text.replace("max_rows", "")


def test_verify_passes_alone_and_against_the_ledger(published):
    r = verify_manifest(published.manifest, source=published.path)
    assert r.ok, r.problems
    r = verify_manifest(published.manifest, ledger=published.ledger)
    assert r.ok, r.problems
    assert main(["manifest", "verify", published.path, "--ledger", published.url]) == 0


def _tamper(m, fn):
    d = copy.deepcopy(m)
    fn(d)
    return d


def _first_vector(d):
    return next(x for x in d["release_plan"]["metrics"] if x.get("vectors"))["vectors"][0]


# Each negative control must fail verification and name the field that does not recompute.
NEGATIVE_CONTROLS = {
    "drop one release from the plan": (lambda d: d["release_plan"]["metrics"].pop(0), "release_plan.metrics"),
    "drop one release's event": (lambda d: d["events"].pop(), "events"),
    "change a contribution bound": (
        lambda d: d["contribution_bounds"].__setitem__("max_partitions_per_unit", 4),
        "contribution_bounds.max_partitions_per_unit"),
    "change sigma": (lambda d: _first_vector(d).__setitem__("scale", _first_vector(d)["scale"] * 0.9),
                     "release_plan.metrics[0].vectors[0].scale"),
    "swap the adjacency": (lambda d: d["privacy_unit"].__setitem__("adjacency", "replace"), "privacy_unit.adjacency"),
    "change the accountant version": (lambda d: d["accountant"].update(version="2", ref="rdp/2"), "accountant.version"),
    "edit a ledger hash": (lambda d: d["ledger"]["entry_hashes"].__setitem__(0, "f" * 64), "ledger.entry_hashes[0]"),
    "understate the run's epsilon": (lambda d: d["privacy"]["run"].__setitem__("epsilon", 0.1), "privacy.run.epsilon"),
    "edit the embedded spec": (lambda d: d["spec"]["contribution"].__setitem__("max_partitions_per_unit", 1),
                               "spec_hash"),
    "publish a test-mode run": (lambda d: d["randomness"].update(mode="test", test_mode=True), "outcome.state"),
    # issue 13: edits that verify --ledger did not catch
    "raise the scope cap": (lambda d: d["privacy"]["scope"]["cap"].__setitem__("value", 20.0),
                            "privacy.scope.cap.value"),
    "raise the cap and the remaining budget together": (
        lambda d: (d["privacy"]["scope"]["cap"].__setitem__("value", 20.0),
                   [b.__setitem__("remaining", b["remaining"] + 10.0) for b in d["privacy"]["scope"]["buckets"]]),
        "privacy.scope.cap.value"),
    "point the output at another version": (lambda d: d["output"].__setitem__("uri", "file:///out/7"), "output.uri"),
    "claim os randomness with a keyed key id": (lambda d: d["randomness"].__setitem__("mode", "os"),
                                                "randomness.mode"),
    # tamperings tried beyond the list
    "edit the input fingerprint": (lambda d: d["run_key"].__setitem__("input_fingerprint", fp("other input")),
                                   "run_id"),
    "claim nothing was charged": (lambda d: d["privacy"]["run"].__setitem__("charged", False), "privacy.run.charged"),
    "relabel a published run as refused": (lambda d: d["outcome"].update(state="refused", ledger_state=None),
                                           "outcome.state"),
    "invent a ledger state": (lambda d: d["outcome"].__setitem__("ledger_state", "released"), "outcome.ledger_state"),
    "edit the accountant's method": (lambda d: d["accountant"]["details"].__setitem__("orders", [2.0]),
                                     "accountant.details.orders"),
}


@pytest.mark.parametrize("name", sorted(NEGATIVE_CONTROLS))
def test_negative_controls_fail_and_name_the_field(published, name):
    fn, field = NEGATIVE_CONTROLS[name]
    bad = _tamper(published.manifest, fn)
    r = verify_manifest(bad, ledger=published.ledger)
    assert not r.ok, name
    assert any(p.startswith(field) for p in r.problems), (name, r.problems)
    with pytest.raises(IntegrityError, match=field.replace("[", r"\[").replace(".", r"\.")):
        r.raise_for_problems()


def test_dropping_a_release_from_the_ledger_history_fails(published):
    db = published.tmp / "ledger.sqlite"
    with sqlite3.connect(db) as con:  # a deliberate act: drop the append-only guard, then delete history
        con.execute("DROP TRIGGER entries_no_delete")
        con.execute("DELETE FROM entries WHERE run_id = ?", (published.earlier,))
    r = verify_manifest(published.manifest, ledger=published.ledger)
    assert not r.ok
    assert any(p.startswith("privacy.scope.history.entries") for p in r.problems), r.problems
    assert any(p.startswith("privacy.scope.buckets[0].committed") for p in r.problems), r.problems


def test_cli_verify_show_schema(published, tmp_path, capsys):
    bad = _tamper(published.manifest, NEGATIVE_CONTROLS["change sigma"][0])
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(bad))
    assert main(["manifest", "verify", str(p)]) == 7
    assert "release_plan.metrics[0].vectors[0].scale" in capsys.readouterr().out
    assert main(["manifest", "verify", str(p), "--json"]) == 7
    out = capsys.readouterr().out
    assert json.loads(out[: out.rindex("}") + 1])["ok"] is False
    run_id = published.manifest["run_id"]
    assert main(["manifest", "show", run_id, "--manifests", os.path.dirname(published.path)]) == 0
    assert "add_remove" in capsys.readouterr().out
    assert main(["manifest", "show", published.path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run_id"] == run_id
    assert main(["manifest", "schema"]) == 0
    assert json.loads(capsys.readouterr().out)["properties"]["schema_version"]["const"] == SCHEMA_VERSION
    assert main(["manifest", "verify", "no-such-run", "--manifests", str(tmp_path)]) == 6


def test_manifest_show_says_what_the_ledger_state_and_sensitivities_are(published, capsys, monkeypatch):
    """Issue 28 item 14: a committed run's manifest (written while the run was started) is not shown as
    "published (ledger: started)"; the scope line lists every group its total composes, started included;
    a Laplace vector's L2 sensitivity is "n/a (...)", never "inf"."""
    monkeypatch.setenv("COLUMNS", "400")  # one line per statement: the assertions read whole lines
    assert published.ledger.run(published.manifest["run_id"]).state == "committed"
    assert main(["manifest", "show", published.path]) == 0
    out = capsys.readouterr().out
    assert "(ledger: started)" not in out
    (outcome,) = [ln for ln in out.splitlines() if ln.startswith("outcome: ")]
    assert "ledger state when the manifest was written: started" in outcome and "commit follows" in outcome
    (scope,) = [ln for ln in out.splitlines() if ln.startswith("scope purchases")]
    for part in ("committed", "spent unpublished", "started", "reserved"):
        assert re.search(rf"\b{part} [0-9]", scope), scope
    assert " inf" not in out and "inf " not in out
    assert "n/a (pure ε-DP: Laplace noise is calibrated to the L1 sensitivity)" in out


def test_signed_manifest_verifies_with_the_public_key(published, tmp_path):
    generate_signing_key(tmp_path / "k.pem", tmp_path / "k.pub")
    signed = sign_manifest(published.manifest, tmp_path / "k.pem")
    d = tmp_path / "signed"
    path = write_manifest(signed, d)
    assert main(["manifest", "verify", path, "--public-key", str(tmp_path / "k.pub")]) == 0
    edited = _tamper(signed, lambda x: x["outcome"].__setitem__("reason", "edited"))
    assert not verify_manifest(edited, public_key=str(tmp_path / "k.pub")).ok


def test_build_refuses_unknown_outcome_and_accountant():
    with pytest.raises(InvalidParameter, match="outcome"):
        synthetic_manifest(outcome="maybe")
    with pytest.raises(InvalidParameter, match="accountant"):
        synthetic_manifest(accountant="magic/7")


def test_code_version_never_imports_beam():
    """Library versions come from package metadata: building a manifest must not import Beam.

    Checked in a fresh interpreter because other tests in the same session import Beam.
    """
    import subprocess
    import sys

    code = ("import sys; from dpops.manifest.build import code_version; v = code_version(); "
            "assert 'apache_beam' not in sys.modules, 'Beam imported'; print(v['libraries'].get('apache-beam') "
            "or v['libraries'].get('apache_beam'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("2.")


# --------------------------------------------------------------------------- issue 13: edits --ledger missed


def test_edited_cap_is_caught_without_the_ledger_too(published):
    bad = _tamper(published.manifest, NEGATIVE_CONTROLS["raise the scope cap"][0])
    r = verify_manifest(bad)
    assert not r.ok and any(p.startswith("privacy.scope.buckets[0].remaining") for p in r.problems), r.problems


def test_cli_exits_7_naming_each_field(published, tmp_path, capsys):
    for name in ("raise the scope cap", "point the output at another version",
                 "claim os randomness with a keyed key id"):
        fn, field = NEGATIVE_CONTROLS[name]
        p = tmp_path / f"{abs(hash(name))}.json"
        p.write_text(json.dumps(_tamper(published.manifest, fn)))
        assert main(["manifest", "verify", str(p), "--ledger", published.url]) == 7, name
        assert field in capsys.readouterr().out, name


def test_randomness_mode_is_compared_with_the_ledger_reservation(tmp_path):
    """A keyed-looking key id alone does not prove the mode: the ledger's reservation says which it was."""
    from dpops.release_plan import plan_release

    spec = load_spec(EXAMPLE_SPEC)
    plan = plan_release(spec)
    ledger = make_ledger(tmp_path, epsilon=10.0, delta=1e-7)
    key = run_key(spec.name, 0, spec_hash=spec.spec_hash, key_id="os/attempt-1")
    rec = ledger.reserve(key, "purchases", plan.events, actor=ACTOR, details={"randomness": "os"})
    ledger.start(rec.run_id, actor=ACTOR)
    ctx = SimpleNamespace(spec=spec, run_key=key, plan=plan, randomness="os")
    path = write_run_manifest(ctx, ledger, {"state": "published", "output_uri": "file:///o/v1"},
                              manifests_dir=tmp_path / "m")
    m = read_manifest(path)
    assert verify_manifest(m, ledger=ledger).ok
    bad = _tamper(m, lambda d: d["randomness"].__setitem__("mode", "keyed"))
    r = verify_manifest(bad, ledger=ledger)
    assert any(p.startswith("randomness.mode") and "'os' randomness" in p for p in r.problems), r.problems
    ledger.close()


def test_a_later_cap_change_does_not_flag_the_recorded_cap(published):
    """The cap compared is the one in force at the manifest's last scope entry, not today's."""
    published.ledger.change_cap("purchases", epsilon=12.0, reason="raise", actor=ACTOR)
    r = verify_manifest(published.manifest, ledger=published.ledger)
    assert not any(p.startswith("privacy.scope.cap") for p in r.problems), r.problems
    bad = _tamper(published.manifest, lambda d: d["privacy"]["scope"]["cap"].__setitem__("value", 12.0))
    assert any(p.startswith("privacy.scope.cap.value") for p in verify_manifest(bad, ledger=published.ledger).problems)


# --------------------------------------------------------------------------- issue 13: published file edited


from test_cli_release import cli_env  # noqa: E402,F401 - the CLI release fixture (fake pipeline, real ledger)


@pytest.fixture
def real_plan(monkeypatch):
    """The CLI fixture stubs the plan for speed; a manifest must verify, so use the real planner."""
    from dpops.release import preparation
    from dpops.release_plan import plan_release

    monkeypatch.setattr(preparation, "_default_planner", plan_release)
    monkeypatch.delenv("DPOPS_MANIFESTS_DIR", raising=False)


def _publish_and_find(cli_env, capsys):
    tmp, spec, url, base, _ = cli_env
    assert main(["release", "run", str(spec), *base, "--publish", "--no-gx-checks", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    manifest = next(tmp.rglob(f"{out['run_id']}.published.json"))
    data = next(p for p in tmp.rglob("data.parquet") if "published" in p.parts)
    return out, manifest, data


def test_edited_published_file_is_caught_everywhere(cli_env, real_plan, capsys):
    tmp, spec, url, base, pipe = cli_env
    key = base[base.index("--key-file") + 1]
    out, manifest, data = _publish_and_find(cli_env, capsys)
    assert main(["manifest", "verify", str(manifest), "--ledger", url, "--key-file", key]) == 0
    text = capsys.readouterr().out
    assert "ok    published files" in text and "not checked" not in text
    status_args = ["release", "status", str(spec), "--interval", "2024-01-01/2024-01-02", "--ledger", url]
    assert main(status_args + ["--key-file", key]) == 0 and "published files: ok" in capsys.readouterr().out
    # without the key the keyed part is named as skipped, never "ok" (issue 21 item 11)
    assert main(status_args) == 0
    text = capsys.readouterr().out
    assert "published files: partly checked" in text and "skipped: no noise key" in text
    assert main(["manifest", "verify", str(manifest), "--ledger", url]) == 0
    text = capsys.readouterr().out
    assert "skip  published files  (no noise key" in text and "ok    published files (ledger digests)" in text

    # an insider swaps the published bytes (here: the file is rewritten with one byte changed)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    os.chmod(data, 0o644)
    data.write_bytes(bytes(raw))

    assert main(["manifest", "verify", str(manifest), "--ledger", url, "--key-file", key]) == 7
    text = capsys.readouterr().out
    assert "output.fingerprints.data.parquet" in text and "changed after publication" in text
    assert main(["manifest", "verify", str(manifest), "--ledger", url]) == 7  # no key: the ledger's digests
    assert "ledger commit files.data.parquet" in capsys.readouterr().out
    assert main(["manifest", "verify", str(manifest)]) == 0  # neither: says clearly that nothing was checked
    text = capsys.readouterr().out
    assert "skip  published files  (no noise key" in text and "not checked: ledger, published files" in text
    assert main(status_args) == 7
    captured = capsys.readouterr()
    assert "published files: CHANGED" in captured.out and "data.parquet" in captured.err
    assert main(status_args + ["--key-file", key, "--json"]) == 7
    st = json.loads(capsys.readouterr().out)
    # the ledger's digest, the manifest's keyed fingerprint and the version's keyed binding (issue 19 item 7)
    assert st["published_files"]["ok"] is False and len(st["published_files"]["problems"]) == 3
    assert any("does not match the sha256 the binding names" in p for p in st["published_files"]["problems"])
    # a re-run must not serve the edited file as published
    assert main(["release", "run", str(spec), *base, "--publish", "--no-gx-checks"]) == 7
    err = capsys.readouterr().err
    assert "refusing to serve" in err and "data.parquet" in err and pipe.calls == 1


def test_wrong_key_is_reported_not_checked(cli_env, real_plan, capsys, tmp_path):
    from dpops.noise.randomness import NoiseKey

    _, _, url, _, _ = cli_env
    out, manifest, data = _publish_and_find(cli_env, capsys)
    other = tmp_path / "other.key"
    NoiseKey.generate(other)
    assert main(["manifest", "verify", str(manifest), "--key-file", str(other)]) == 0
    assert "is not the run's key" in capsys.readouterr().out


# --------------------------------------------------------------------------- issue 14 item 6: signing


def test_unverified_signature_is_not_called_signed(published, tmp_path, capsys):
    import base64

    generate_signing_key(tmp_path / "k.pem", tmp_path / "k.pub")
    bogus = dict(published.manifest, signature={"algorithm": "ed25519", "public_key_id": "0" * 16,
                                                "value": base64.b64encode(b"x" * 64).decode()})
    path = write_manifest(bogus, tmp_path / "bogus")
    assert main(["manifest", "verify", path]) == 0
    out = capsys.readouterr().out
    assert "unverified signature" in out and "published files, signature)" in out
    assert "signed, but" not in out
    assert main(["manifest", "verify", path, "--require-signature"]) == 7
    assert "a valid signature is required" in capsys.readouterr().out
    assert main(["manifest", "verify", path, "--public-key", str(tmp_path / "k.pub"), "--require-signature"]) == 7
    unsigned = write_manifest(published.manifest, tmp_path / "unsigned")
    assert main(["manifest", "verify", unsigned, "--public-key", str(tmp_path / "k.pub"),
                 "--require-signature"]) == 7
    assert "not signed" in capsys.readouterr().out


def test_publish_signs_when_a_signing_key_is_configured(cli_env, real_plan, capsys, monkeypatch, tmp_path):
    assert main(["manifest", "keygen", str(tmp_path / "sign.pem"), str(tmp_path / "sign.pub")]) == 0
    capsys.readouterr()
    monkeypatch.setenv("DPOPS_MANIFEST_SIGNING_KEY", str(tmp_path / "sign.pem"))
    _, _, url, _, _ = cli_env
    out, manifest, _ = _publish_and_find(cli_env, capsys)
    assert read_manifest(manifest)["signature"]["algorithm"] == "ed25519"
    assert main(["manifest", "verify", str(manifest), "--ledger", url, "--public-key", str(tmp_path / "sign.pub"),
                 "--require-signature"]) == 0
    assert "ok    signature" in capsys.readouterr().out


def test_a_bad_signing_key_fails_before_anything_is_reserved(cli_env, real_plan, capsys, monkeypatch, tmp_path):
    from dpops.ledger import open_ledger

    bad = tmp_path / "bad.pem"
    bad.write_text("not a key\n")
    monkeypatch.setenv("DPOPS_MANIFEST_SIGNING_KEY", str(bad))
    _, spec, url, base, pipe = cli_env
    assert main(["release", "run", str(spec), *base, "--publish", "--no-gx-checks"]) == 3
    led = open_ledger(url)
    assert led.runs(scope="shop") == [] and pipe.calls == 0
    led.close()
