"""After a key rotation (issue 28 items 3 and 11): a re-run of a day published under the old key compares the
input under that key, and the checks take a key ring so one report checks every published file.

Through the real CLI (`dpops release run`, `manifest verify`, `report`) against a real ledger and pipeline."""

from __future__ import annotations

import json
import shutil

import pytest

from dpops.cli.main import main as dpops_main
from dpops.keyref import KeyRing, noise_key_id
from dpops.noise.randomness import NoiseKey

DAY1, DAY2 = "2024-01-01/2024-01-02", "2024-01-02/2024-01-03"


@pytest.fixture
def env(tmp_path, monkeypatch):
    from test_storage import _release_env

    for var in ("DPOPS_NOISE_KEY_ID", "DPOPS_KEY_DIR", "DPOPS_NOISE_KEY_FILE", "DPOPS_PREVIOUS_NOISE_KEY_FILES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DPOPS_STATE_DIR", str(tmp_path / "state"))
    e = _release_env(tmp_path)
    shutil.copy(tmp_path / "data/2024-01-01.parquet", tmp_path / "data/2024-01-02.parquet")
    e["tmp"] = tmp_path
    return e


def _dpops(e, *argv: str, capsys) -> tuple[int, str, str]:
    code = dpops_main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _run(e, interval, key, capsys, *extra: str) -> tuple[int, str, str]:
    base = list(e["base"])
    base[base.index("--interval") + 1] = interval
    base[base.index("--key-file") + 1] = str(key)
    return _dpops(e, "release", "run", e["spec"], *base, "--publish", *extra, capsys=capsys)


def _ledger(e):
    from dpops.ledger import open_ledger

    return open_ledger(e["url"])


def _rotate(e, monkeypatch) -> tuple[object, object]:
    """Day 1 published under key A; then the declared rotation to key B (the runbook's pin)."""
    old = e["key"]
    new = old.parent / "noise.key.new"
    new_id = NoiseKey.generate(new).key_id
    monkeypatch.setenv("DPOPS_NOISE_KEY_ID", new_id)
    return old, new


def test_a_reprocess_after_rotation_is_served_when_the_old_key_shows_the_input_unchanged(env, monkeypatch, capsys):
    code, _, err = _run(env, DAY1, env["key"], capsys)
    assert code == 0, err
    old, new = _rotate(env, monkeypatch)
    with _ledger(env) as led:
        total, entries = led.status("shop").total, len(led.history())
    # Without the old key: the input cannot be compared, and the message says so (not "the input changed").
    code, _, err = _run(env, DAY1, new, capsys)
    assert code != 0
    text = " ".join(err.split())
    assert "the noise key changed since that publication" in text and "the input changed" not in text
    assert "DPOPS_PREVIOUS_NOISE_KEY_FILES" in text and "--previous-key-file" in text
    # With it (the option, or the deployment's variable): served from the publication, nothing charged.
    code, out, err = _run(env, DAY1, new, capsys, "--previous-key-file", str(old), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["state"] == "already_published" and doc["epsilon_charged"] == 0
    monkeypatch.setenv("DPOPS_PREVIOUS_NOISE_KEY_FILES", str(old))
    code, out, err = _run(env, DAY1, new, capsys, "--json")
    assert code == 0 and json.loads(out)["state"] == "already_published", err
    with _ledger(env) as led:
        assert led.status("shop").total == total and len(led.history()) == entries  # nothing reserved


def test_a_changed_input_is_still_refused_under_the_old_key(env, monkeypatch, capsys):
    import pyarrow.parquet as pq

    code, _, err = _run(env, DAY1, env["key"], capsys)
    assert code == 0, err
    old, new = _rotate(env, monkeypatch)
    with _ledger(env) as led:
        entries = len(led.history())
    path = env["tmp"] / "data/2024-01-01.parquet"
    t = pq.read_table(path)
    pq.write_table(t.slice(1), path)  # one row less: a changed input
    code, _, err = _run(env, DAY1, new, capsys, "--previous-key-file", str(old))
    assert code != 0
    text = " ".join(err.split())
    assert "or, under it, the input differs" in text and "dpops release restate" in text
    with _ledger(env) as led:
        assert len(led.history()) == entries  # refused before anything was reserved


def test_checks_take_a_key_ring_and_check_every_rotation(env, monkeypatch, capsys):
    """Day 1 under key A, day 2 under key B: with B alone day 1's keyed checks cannot run; with the ring
    (B and --previous-key-file A) every published file of both days is checked, by manifest verify and by
    the report."""
    code, _, err = _run(env, DAY1, env["key"], capsys)
    assert code == 0, err
    old, new = _rotate(env, monkeypatch)
    code, _, err = _run(env, DAY2, new, capsys)
    assert code == 0, err
    with _ledger(env) as led:
        runs = {r.key.interval_start[:10]: r for r in led.runs(states=["committed"])}
    day1 = runs["2024-01-01"].run_id
    assert noise_key_id(runs["2024-01-01"].key.key_id) == NoiseKey.from_file(old).key_id

    def verify(*keys: str) -> dict:
        code, out, err = _dpops(env, "manifest", "verify", day1, "--spec", env["spec"], "--ledger", env["url"],
                                *keys, "--json", capsys=capsys)
        assert code == 0, err
        return {c["name"]: c for c in json.loads(out)["checks"]}

    only_new = verify("--key-file", str(new))
    assert only_new["published files"]["skipped"]  # the run's keyed fingerprints need key A
    ring = verify("--key-file", str(new), "--previous-key-file", str(old))
    assert not ring["published files"]["skipped"] and ring["published files"]["ok"]

    out_html = env["tmp"] / "report.html"
    code, out, err = _dpops(env, "report", "--scope", "shop", "--ledger", env["url"], "--out", str(out_html),
                            "--key-file", str(new), "--previous-key-file", str(old),
                            "--manifests", str(env["tmp"] / "out" / "manifests" / "shop_daily"), "--json",
                            capsys=capsys)
    assert code == 0, err
    from dpops.ledger import open_ledger
    from dpops.report.data import gather

    with open_ledger(env["url"]) as led:
        data = gather(led, "shop", str(env["tmp"] / "out" / "manifests" / "shop_daily"), None, None,
                      key=KeyRing.load(str(new), [str(old)]))
    checks = list(data.checks.values())
    assert checks and all(c.ok for c in checks)
    published = [c for c in checks if c.run_id in {r.run_id for r in runs.values()}]
    assert len(published) == 2 and all(c.files == "ok" for c in published), [(c.run_id, c.files) for c in published]
    with open_ledger(env["url"]) as led:  # with key B alone, day 1's files are not checked (the issue's finding)
        alone = gather(led, "shop", str(env["tmp"] / "out" / "manifests" / "shop_daily"), None, None,
                       key=NoiseKey.from_file(new))
    assert {c.run_id: c.files for c in alone.checks.values() if c.run_id == day1} == {day1: "not checked"}

def test_the_ring_picks_each_records_key_and_refuses_nothing_it_does_not_hold(tmp_path):
    a, b = tmp_path / "a.key", tmp_path / "b.key"
    ka, kb = NoiseKey.generate(a), NoiseKey.generate(b)
    ring = KeyRing.load(str(b), [str(a)])
    assert ring.current is not None and ring.current.key_id == kb.key_id
    assert ring.for_id(ka.key_id).key_id == ka.key_id and ring.for_id(f"{ka.key_id}/retry-2").key_id == ka.key_id
    assert ring.key_for("f" * 16).key_id == kb.key_id  # unknown: the current key (its check then says why)
    assert ring.for_id("os/attempt-1") is None and ring.for_id("test/seed-3") is None
    assert KeyRing.load(None, [str(a)]).key_for("0" * 16) is None  # a reviewer holding only old keys


def test_the_dags_reserve_task_serves_the_day_across_a_rotation(env, monkeypatch, capsys):
    """The runbook's "clearing its tasks" after a rotation: the DAG's reserve task (``orchestration.reserve_step``)
    with the old key in the deployment's ``DPOPS_PREVIOUS_NOISE_KEY_FILES`` serves the published day, nothing
    charged; without it the task refuses, saying the key changed."""
    from dpops import orchestration

    code, _, err = _run(env, DAY1, env["key"], capsys)
    assert code == 0, err
    old, new = _rotate(env, monkeypatch)
    settings = orchestration.Settings(ledger_url=env["url"], key_path=str(new))
    step = orchestration.Step(env["spec"], "2024-01-01T00:00:00+00:00", "2024-01-02T00:00:00+00:00", settings, "test")
    with _ledger(env) as led:
        entries = len(led.history())
    refused = orchestration.reserve_step(step)
    assert refused.state == "refused" and "the noise key changed since that publication" in refused.message
    monkeypatch.setenv("DPOPS_PREVIOUS_NOISE_KEY_FILES", str(old))
    served = orchestration.reserve_step(step)
    assert served.state == "already_published" and served.epsilon_charged == 0
    with _ledger(env) as led:
        assert len(led.history()) == entries
