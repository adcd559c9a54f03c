"""Which noise key a run may use (issue 19 item 9): the operator's pin ``DPOPS_NOISE_KEY_ID``, a key change
only as a declared rotation, and key references from orchestrator metadata only under ``DPOPS_KEY_DIR``.
Through the real CLI (`dpops release run`) against a real ledger and pipeline."""

from __future__ import annotations

import os
import shutil

import pytest

from dpops.cli.main import main as dpops_main
from dpops.errors import InvalidParameter
from dpops.keyref import key_ref_under_key_dir
from dpops.noise.randomness import NoiseKey


@pytest.fixture
def env(tmp_path, monkeypatch):
    from test_storage import _release_env

    for var in ("DPOPS_NOISE_KEY_ID", "DPOPS_KEY_DIR", "DPOPS_NOISE_KEY_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DPOPS_STATE_DIR", str(tmp_path / "state"))
    e = _release_env(tmp_path)
    for day in ("02", "03"):
        shutil.copy(tmp_path / "data/2024-01-01.parquet", tmp_path / f"data/2024-01-{day}.parquet")
    return e


def _run(e, interval, key, capsys):
    base = list(e["base"])
    base[base.index("--interval") + 1] = interval
    base[base.index("--key-file") + 1] = str(key)
    code = dpops_main(["release", "run", e["spec"], *base, "--publish"])
    return code, capsys.readouterr().err


def _charged(e) -> float:
    from dpops.ledger import open_ledger

    with open_ledger(e["url"]) as led:
        return led.status("shop").total


def test_a_key_other_than_the_pinned_id_is_refused_before_reserving(env, monkeypatch, capsys):
    other = NoiseKey(os.urandom(32)).key_id
    monkeypatch.setenv("DPOPS_NOISE_KEY_ID", other)
    code, err = _run(env, "2024-01-01/2024-01-02", env["key"], capsys)
    assert code == 3 and f"DPOPS_NOISE_KEY_ID={other}" in err and "nothing was reserved" in err
    assert _charged(env) == 0
    monkeypatch.setenv("DPOPS_NOISE_KEY_ID", "not-a-key-id")
    code, err = _run(env, "2024-01-01/2024-01-02", env["key"], capsys)
    assert code == 3 and "16 lower-case hex digits" in err and _charged(env) == 0
    monkeypatch.setenv("DPOPS_NOISE_KEY_ID", NoiseKey.from_file(env["key"]).key_id)
    code, err = _run(env, "2024-01-01/2024-01-02", env["key"], capsys)
    assert code == 0, err


def test_a_new_key_on_a_scope_is_refused_unless_the_rotation_is_declared(env, monkeypatch, capsys):
    """Run 1 under key A; run 2 (next day, same scope) under key B is refused and charges nothing; with the
    operator's pin set to B (the declared rotation of docs/runbook.md) it runs."""
    code, err = _run(env, "2024-01-01/2024-01-02", env["key"], capsys)
    assert code == 0, err
    spent = _charged(env)
    new = env["key"].parent / "noise.key.new"
    new_id = NoiseKey.generate(new).key_id
    code, err = _run(env, "2024-01-02/2024-01-03", new, capsys)
    assert code == 3, err
    assert f"used key id {NoiseKey.from_file(env['key']).key_id}" in err and f"DPOPS_NOISE_KEY_ID={new_id}" in err
    assert _charged(env) == spent
    monkeypatch.setenv("DPOPS_NOISE_KEY_ID", new_id)
    code, err = _run(env, "2024-01-02/2024-01-03", new, capsys)
    assert code == 0, err
    monkeypatch.delenv("DPOPS_NOISE_KEY_ID")  # after the rotation the new key is the scope's key
    code, err = _run(env, "2024-01-03/2024-01-04", env["key"], capsys)  # the old key is now the odd one
    assert code == 3 and "used key id " + new_id in err


def test_key_references_from_orchestrator_metadata_only_under_the_key_dir(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    NoiseKey.generate(keys / "noise.key")
    (keys / "current").symlink_to("noise.key")
    outside = tmp_path / "outside.key"
    NoiseKey.generate(outside)
    (keys / "escape").symlink_to(outside)
    setting = "the Variable"
    monkeypatch.delenv("DPOPS_KEY_DIR", raising=False)
    with pytest.raises(InvalidParameter, match=r"\$DPOPS_KEY_DIR is unset"):
        key_ref_under_key_dir(str(keys / "noise.key"), setting)
    monkeypatch.setenv("DPOPS_KEY_DIR", str(keys))
    assert key_ref_under_key_dir(str(keys / "noise.key"), setting) == str((keys / "noise.key").resolve())
    assert key_ref_under_key_dir(f"file://{keys / 'current'}", setting) == str((keys / "noise.key").resolve())
    assert key_ref_under_key_dir(f"file:{keys / 'noise.key'}", setting) == str((keys / "noise.key").resolve())
    for bad in (str(outside), str(keys / "escape"), str(keys / ".." / "outside.key"), str(keys), "/etc/passwd",
                "gcp-secret://projects/p/secrets/s/versions/1"):
        with pytest.raises(InvalidParameter, match="under the operator's key directory") as err:
            key_ref_under_key_dir(bad, setting)
        assert bad == str(keys) or bad not in str(err.value)
    pasted = os.urandom(32).hex()
    with pytest.raises(InvalidParameter, match="never the key itself") as err:
        key_ref_under_key_dir(pasted, setting)
    assert pasted not in str(err.value)
