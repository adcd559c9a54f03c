"""Issue 13 false alarm: a legitimate cap change (epsilon and delta) must not break older manifests,
while an edited ``remaining`` or ``cap`` in a manifest is still caught against the ledger."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

from dpops.cli.main import main
from dpops.manifest import read_manifest, verify_manifest
from dpops.manifest.run_hook import write_run_manifest
from dpops.spec import load_spec
from manifest_support import ACTOR, EXAMPLE_SPEC, fp, make_ledger, run_key


@pytest.fixture()
def old_manifest(tmp_path):
    from dpops.release_plan import plan_release

    spec = load_spec(EXAMPLE_SPEC)
    plan = plan_release(spec)
    ledger = make_ledger(tmp_path, accountant="rdp/1", epsilon=10.0, delta=1e-7)
    key = run_key(spec.name, 1, spec_hash=spec.spec_hash)
    rec = ledger.reserve(key, "purchases", plan.events, actor=ACTOR)
    ledger.start(rec.run_id, actor=ACTOR)
    ctx = SimpleNamespace(spec=spec, run_key=key, plan=plan, randomness="keyed")
    path = write_run_manifest(ctx, ledger, {"state": "published", "output_uri": "file:///out/1"},
                              manifests_dir=tmp_path / "manifests",
                              validation={"checks": [{"name": "input_schema", "passed": True}], "proceeded": True},
                              output_fingerprints={"data.parquet": fp("noisy output")})
    ledger.commit(rec.run_id, output_uri="file:///out/1", actor=ACTOR)
    yield SimpleNamespace(ledger=ledger, path=path, manifest=read_manifest(path), plan=plan, spec=spec,
                          url=f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    ledger.close()


def ledger_problems(result):
    return [p for c in result.checks if c.name == "ledger" for p in c.problems]


def test_cap_changes_do_not_break_older_manifests(old_manifest, capsys):
    m, led = old_manifest.manifest, old_manifest.ledger
    assert m["privacy"]["scope"]["cap"]["value"] == 10.0
    assert verify_manifest(m, ledger=led).ok
    # epsilon raised, then delta lowered, then another run charged: three legitimate operations later
    assert main(["ledger", "--ledger", old_manifest.url, "cap", "purchases", "--epsilon", "12", "--reason",
                 "raise"]) == 0
    led.change_cap("purchases", delta=1e-8, reason="tighter delta", actor=ACTOR)
    rec = led.reserve(run_key(old_manifest.spec.name, 2, spec_hash=old_manifest.spec.spec_hash), "purchases",
                      old_manifest.plan.events, actor=ACTOR)
    led.start(rec.run_id, actor=ACTOR)
    result = verify_manifest(m, ledger=led)
    assert result.ok, ledger_problems(result)
    capsys.readouterr()
    assert main(["manifest", "verify", old_manifest.path, "--ledger", old_manifest.url]) == 0


@pytest.mark.parametrize("edit, field", [
    (lambda s: s["buckets"][0].__setitem__("remaining", s["buckets"][0]["remaining"] + 2.0),
     "privacy.scope.buckets[0].remaining"),
    (lambda s: s["cap"].__setitem__("value", 20.0), "privacy.scope.cap.value"),
    (lambda s: s["cap"].__setitem__("delta", 1e-5), "privacy.scope.cap.delta"),
])
def test_edited_position_still_caught_after_cap_change(old_manifest, edit, field):
    led = old_manifest.ledger
    led.change_cap("purchases", epsilon=12.0, delta=1e-8, reason="raise", actor=ACTOR)
    bad = copy.deepcopy(old_manifest.manifest)
    edit(bad["privacy"]["scope"])
    problems = ledger_problems(verify_manifest(bad, ledger=led))
    assert any(p.startswith(field) for p in problems), problems


def test_concurrent_reservation_while_the_position_is_read_is_no_false_alarm(tmp_path, monkeypatch):
    """A run reserved by another process between the reads of the position must not make the manifest
    disagree with its own history (a backfill writes many manifests while others reserve)."""
    from dpops.manifest.scope import scope_position
    from dpops.release_plan import plan_release

    spec = load_spec(EXAMPLE_SPEC)
    plan = plan_release(spec)
    led = make_ledger(tmp_path, accountant="rdp/1", epsilon=10.0, delta=1e-7)
    key = run_key(spec.name, 1, spec_hash=spec.spec_hash)
    rec = led.reserve(key, "purchases", plan.events, actor=ACTOR)
    led.start(rec.run_id, actor=ACTOR)
    real_status, real_history = led.status, led.history
    concurrent = iter([run_key(spec.name, 2, spec_hash=spec.spec_hash)])

    def interleaved(reader):
        def read(*a, **kw):
            out = reader(*a, **kw)
            k = next(concurrent, None)
            if k is not None:  # another writer commits right after this read
                led.reserve(k, "purchases", plan.events, actor="other")
            return out
        return read

    monkeypatch.setattr(led, "status", interleaved(real_status))
    monkeypatch.setattr(led, "history", interleaved(real_history))
    position = scope_position(led, "purchases", rec.buckets)
    monkeypatch.undo()
    from dpops.manifest.scope import replay_position

    replayed, problems = replay_position(led, position)
    assert problems == [] and replayed["buckets"] == position["buckets"]
    led.close()
