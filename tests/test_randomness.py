"""Random sources: keyed reproducibility, independence, key secrecy, exact uniform integers."""

from __future__ import annotations

import base64
import os
import pickle

import numpy as np
import pytest
from click.testing import CliRunner
from scipy import stats

from dpops.cli.key import cli as key_cli
from dpops.cli.main import main as dpops_main
from dpops.errors import InvalidParameter
from dpops.noise.randomness import KEY_FILE_HEADER, NoiseKey, format_key_file, keyed_random, os_random, test_random

KEY = NoiseKey(bytes(range(32)))
OTHER_KEY = NoiseKey(bytes(range(1, 33)))
LABEL = {"release": "daily_visits", "spec": "abc123", "interval": "2026-01-01/2026-01-02", "input": "f00d"}
ALPHA = 1e-4  # per-test false-failure rate of every statistical check in this file


def test_same_key_and_label_give_the_same_stream():
    a = keyed_random(KEY, LABEL).uint64(1000)
    b = keyed_random(KEY, dict(reversed(list(LABEL.items())))).uint64(1000)  # key order is irrelevant
    assert np.array_equal(a, b)


def test_stream_is_consumed_in_order_not_restarted():
    src = keyed_random(KEY, LABEL)
    first, second = src.uint64(10), src.uint64(10)
    assert np.array_equal(np.concatenate([first, second]), keyed_random(KEY, LABEL).uint64(20))


@pytest.mark.parametrize(
    "other",
    [
        lambda: keyed_random(KEY, {**LABEL, "interval": "2026-01-02/2026-01-03"}),
        lambda: keyed_random(KEY, {**LABEL, "input": "f00e"}),
        lambda: keyed_random(OTHER_KEY, LABEL),
        lambda: keyed_random(KEY, list(LABEL.values())),  # a list label never collides with a mapping
        lambda: keyed_random(KEY, LABEL).child("shard", 0),
    ],
)
def test_any_change_of_key_or_label_changes_the_stream(other):
    a = keyed_random(KEY, LABEL).uint64(64)
    b = other().uint64(64)
    assert not np.array_equal(a, b)
    assert np.mean(a == b) < 0.05


def test_children_are_deterministic_and_distinct():
    root = keyed_random(KEY, LABEL)
    c1 = root.child("count", 3).uint64(50)
    root.uint64(5)  # drawing from the parent does not move its children
    assert np.array_equal(c1, keyed_random(KEY, LABEL).child("count", 3).uint64(50))
    assert not np.array_equal(c1, root.child("count", 4).uint64(50))
    assert not np.array_equal(c1, root.child("count").child(3).uint64(50))
    assert root.child("count", 3).describe()["label"] != root.describe()["label"]


def test_os_mode_differs_call_to_call():
    assert not np.array_equal(os_random().uint64(8), os_random().uint64(8))
    src = os_random()
    assert not np.array_equal(src.uint64(8), src.uint64(8))
    assert not np.array_equal(src.child("a").uint64(8), src.child("a").uint64(8))
    assert os_random().describe() == {"mode": "os", "key_id": None, "label": None, "publishable": True}


def test_test_mode_is_reproducible_and_never_publishable():
    a, b = test_random(7, ["x"]), test_random(7, ["x"])
    assert np.array_equal(a.uint64(16), b.uint64(16))
    assert not np.array_equal(test_random(8, ["x"]).uint64(16), test_random(7, ["x"]).uint64(16))
    assert a.publishable is False and a.mode == "test" and a.describe()["publishable"] is False
    assert a.child("p").publishable is False
    assert keyed_random(KEY, LABEL).publishable is True


def test_the_key_never_shows():
    raw = bytes(range(32))
    src = keyed_random(KEY, LABEL)
    texts = [repr(KEY), str(KEY), repr(src), str(src), repr(src.describe()), repr(src.child("x").describe())]
    for t in texts:
        for form in (raw.hex(), base64.b64encode(raw).decode(), repr(raw)):
            assert form not in t
    assert KEY.key_id in repr(KEY) and len(KEY.key_id) == 16
    assert src.describe()["key_id"] == KEY.key_id


def test_key_pickles_for_beam_workers_but_used_streams_do_not():
    assert pickle.loads(pickle.dumps(KEY)) == KEY
    fresh = keyed_random(KEY, LABEL)
    clone = pickle.loads(pickle.dumps(fresh))
    assert np.array_equal(clone.uint64(5), keyed_random(KEY, LABEL).uint64(5))
    with pytest.raises(InvalidParameter, match="replay"):
        pickle.dumps(clone)


def _v1(raw: bytes) -> bytes:
    """A ``dpops-noise-key v1`` file's text for ``raw``, without the entropy check (for refusal tests)."""
    return f"{KEY_FILE_HEADER}\nkey-id {NoiseKey(raw).key_id}\n{raw.hex()}\n".encode()


def test_key_from_file_formats_and_refusals(tmp_path):
    raw = os.urandom(32)
    assert format_key_file(raw) == _v1(raw)
    good = _key_file(tmp_path / "v1", _v1(raw))
    assert NoiseKey.from_file(good) == NoiseKey(raw)
    crlf = _key_file(tmp_path / "crlf", _v1(raw).replace(b"\n", b"\r\n"))
    assert NoiseKey.from_file(crlf) == NoiseKey(raw)
    for name, content in [("hex", raw.hex().encode() + b"\n"), ("b64", base64.b64encode(raw)), ("raw", raw)]:
        p = _key_file(tmp_path / name, content)
        with pytest.raises(InvalidParameter, match="not a dpops noise key file.*dpops key convert"):
            NoiseKey.from_file(p)
    edited = _key_file(tmp_path / "edited", _v1(raw).replace(NoiseKey(raw).key_id.encode(), b"0" * 16))
    with pytest.raises(InvalidParameter, match="key-id line does not match"):
        NoiseKey.from_file(edited)
    truncated = _key_file(tmp_path / "truncated", _v1(raw)[:-20])
    with pytest.raises(InvalidParameter, match="truncated or edited"):
        NoiseKey.from_file(truncated)
    short_raw = os.urandom(16)
    short = _key_file(tmp_path / "short", f"{KEY_FILE_HEADER}\nkey-id {'0' * 16}\n{short_raw.hex()}\n".encode())
    with pytest.raises(InvalidParameter, match="truncated or edited"):
        NoiseKey.from_file(short)
    loose = _key_file(tmp_path / "loose", _v1(raw), 0o640)
    with pytest.raises(InvalidParameter, match="chmod 600"):
        NoiseKey.from_file(loose)
    with pytest.raises(InvalidParameter, match="does not exist"):
        NoiseKey.from_file(tmp_path / "missing")


def test_key_convert_keeps_the_key_and_refuses_raw_bytes(tmp_path, capsys):
    """The migration the refusal names: `dpops key convert OLD NEW` turns an old hex/base64 key file into a
    v1 file with the same key id (old runs stay reproducible); raw binary is not a recognisable key."""
    raw = os.urandom(32)
    for name, content in [("hex", raw.hex().encode() + b"\n"), ("b64", base64.b64encode(raw))]:
        old = _key_file(tmp_path / f"{name}.old", content)
        res = CliRunner().invoke(key_cli, ["convert", str(old), str(tmp_path / f"{name}.new"), "--json"])
        assert res.exit_code == 0, res.output
        assert NoiseKey.from_file(tmp_path / f"{name}.new") == NoiseKey(raw)
        assert (tmp_path / f"{name}.new").stat().st_mode & 0o777 == 0o600
        assert NoiseKey(raw).key_id in res.output and raw.hex() not in res.output
    binary = _key_file(tmp_path / "raw.old", raw)
    assert dpops_main(["key", "convert", str(binary), str(tmp_path / "raw.new")]) == 3
    assert not (tmp_path / "raw.new").exists() and "hex or base64" in capsys.readouterr().err
    assert dpops_main(["key", "convert", str(tmp_path / "hex.new"), str(tmp_path / "again")]) == 3
    assert "nothing to convert" in capsys.readouterr().err


def test_generate(tmp_path):
    p = tmp_path / "k"
    key = NoiseKey.generate(p)
    assert (p.stat().st_mode & 0o777) == 0o600
    assert NoiseKey.from_file(p) == key
    with pytest.raises(InvalidParameter, match="overwrite"):
        NoiseKey.generate(p)
    assert not hasattr(NoiseKey, "from_env")  # the key value is never read from the environment


def test_hmac_is_keyed():
    assert KEY.hmac(b"data") == KEY.hmac(b"data")
    assert KEY.hmac(b"data") != OTHER_KEY.hmac(b"data")
    assert len(KEY.hmac(b"")) == 32


def test_randbelow_is_uniform_and_in_range():
    src = test_random(1, ["randbelow"])
    x = src.randbelow(7, 70_000)
    assert x.min() >= 0 and x.max() <= 6
    counts = np.bincount(x, minlength=7)
    assert stats.chisquare(counts).pvalue > ALPHA
    bounds = np.array([1, 2, 3, 2**62 + 1, 2**63 - 1] * 1000, dtype=np.int64)
    y = src.randbelow(bounds)
    assert np.all((y >= 0) & (y < bounds))
    assert np.all(y[bounds == 1] == 0)
    # a bound just above 2**62: nearly half of raw words are rejected, results still below the bound
    big = src.randbelow(2**62 + 1, 10_000)
    assert abs(np.mean(big > 2**61) - 0.5) < 4 * 0.5 / np.sqrt(10_000)
    assert 0 <= src.randbelow_int(10**40) < 10**40


def test_randbelow_rejects_bad_bounds():
    src = test_random(1)
    for bad in (0, -3, 2.5, np.array([3, 0])):
        with pytest.raises(InvalidParameter):
            src.randbelow(bad, 3)


def test_bad_labels_and_seeds():
    with pytest.raises(InvalidParameter):
        keyed_random(KEY, {"a": 1.5})
    with pytest.raises(InvalidParameter):
        keyed_random("not a key", LABEL)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameter):
        test_random("seed")  # type: ignore[arg-type]
    with pytest.raises(InvalidParameter):
        keyed_random(KEY, LABEL).child()


def test_key_cli(tmp_path):
    runner = CliRunner()
    p = tmp_path / "noise.key"
    res = runner.invoke(key_cli, ["generate", str(p), "--json"])
    assert res.exit_code == 0, res.output
    kid = NoiseKey.from_file(p).key_id
    assert kid in res.output and p.read_text().strip() not in res.output
    res = runner.invoke(key_cli, ["id", str(p)])
    assert res.output.strip() == kid
    assert dpops_main(["key", "generate", str(p)]) == 3  # refuses to overwrite
    p.chmod(0o644)
    assert dpops_main(["key", "id", str(p)]) == 3


# --------------------------------------------------------------------------- issue 14 item 6: loading the key


def _key_file(path, content: bytes, mode: int = 0o600):
    path.write_bytes(content)
    path.chmod(mode)
    return path


def test_kubernetes_style_symlinked_secret_is_resolved_once(tmp_path):
    """Kubernetes mounts a secret as ``key -> ..data/key``, ``..data -> ..<timestamp>``, in a 1777 mount."""
    mount = tmp_path / "secret"
    real_dir = mount / "..2026_01_01_00_00_00.123"
    real_dir.mkdir(parents=True)
    raw = os.urandom(32)
    _key_file(real_dir / "noise.key", _v1(raw))
    os.symlink(real_dir.name, mount / "..data")
    os.symlink("..data/noise.key", mount / "noise.key")
    mount.chmod(0o1777)
    assert NoiseKey.from_file(mount / "noise.key") == NoiseKey(raw)


def test_flipped_symlink_never_yields_the_other_key(tmp_path):
    """The race of issue 14: a symlink flipped between a proper key file and a world-readable one. Checks
    and read go through one handle, so every load returns the proper key or is refused as a whole."""
    import subprocess
    import sys
    import time

    good, bad = os.urandom(32), os.urandom(32)
    _key_file(tmp_path / "good.key", _v1(good))
    _key_file(tmp_path / "bad.key", _v1(bad), 0o644)
    link = tmp_path / "noise.key"
    os.symlink("good.key", link)
    flipper = subprocess.Popen([sys.executable, "-c", (
        "import os, sys\nd = sys.argv[1]\nwhile True:\n"
        "    for t in ('bad.key', 'good.key'):\n"
        "        os.symlink(t, d + '/tmp-link'); os.replace(d + '/tmp-link', d + '/noise.key')\n"), str(tmp_path)])
    results = {"good": 0, "bad": 0, "refused": 0}
    try:
        t0 = time.monotonic()  # at least 3 s, and until the race was really hit both ways (at most 20 s)
        while time.monotonic() - t0 < 3.0 or (not (results["good"] and results["refused"])
                                               and time.monotonic() - t0 < 20.0):
            try:
                k = NoiseKey.from_file(link)
            except InvalidParameter:
                results["refused"] += 1
                continue
            results["good" if k == NoiseKey(good) else "bad"] += 1
    finally:
        flipper.kill()
        flipper.wait()
    assert results["bad"] == 0, results
    assert results["good"] > 0 and results["refused"] > 0, results  # the flipper really raced the loads


def test_key_file_owner_directory_type_and_size_checks(tmp_path):
    raw = os.urandom(32)
    d = tmp_path / "keys"
    d.mkdir(mode=0o700)
    p = _key_file(d / "noise.key", _v1(raw))
    assert NoiseKey.from_file(p) == NoiseKey(raw)
    if os.geteuid() == 0:  # only root can give a file away to another uid
        os.chown(p, 65534, 65534)
        with pytest.raises(InvalidParameter, match="owned by uid 65534"):
            NoiseKey.from_file(p)
        os.chown(p, 0, 0)
    d.chmod(0o770)
    with pytest.raises(InvalidParameter, match="directory .* writable by group/others"):
        NoiseKey.from_file(p)
    d.chmod(0o700)
    fifo = d / "fifo.key"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(InvalidParameter, match="not a regular file"):  # and no hang waiting for a writer
        NoiseKey.from_file(fifo)
    big = _key_file(d / "big.key", os.urandom(8192))
    with pytest.raises(InvalidParameter, match="larger than 4096 bytes"):
        NoiseKey.from_file(big)


@pytest.mark.parametrize("raw", [bytes(32), b"\xab" * 32, bytes(range(32)), bytes(range(100, 132)),
                                 b"\x07\x09" * 16])
def test_low_entropy_keys_are_refused_without_echoing_them(tmp_path, raw):
    p = _key_file(tmp_path / "weak.key", _v1(raw))
    with pytest.raises(InvalidParameter, match="too little entropy") as info:
        NoiseKey.from_file(p)
    assert raw.hex() not in str(info.value)


def test_generated_keys_pass_the_entropy_check(tmp_path):
    for i in range(200):  # a false refusal has probability < 5e-16 per key
        NoiseKey.generate(tmp_path / f"k{i}")
        NoiseKey.from_file(tmp_path / f"k{i}")


def test_refusals_never_contain_key_bytes(tmp_path):
    raw = os.urandom(32)
    text = raw.hex()
    loose = _key_file(tmp_path / "loose.key", _v1(raw), 0o644)
    short = _key_file(tmp_path / "short.key", _v1(raw)[:-30])
    legacy = _key_file(tmp_path / "legacy.key", text.encode())
    for p in (loose, short, legacy):
        with pytest.raises(InvalidParameter) as info:
            NoiseKey.from_file(p)
        assert text[:16] not in str(info.value) and text[-16:] not in str(info.value)


def test_worker_refuses_a_key_that_is_not_the_runs(tmp_path, monkeypatch):
    from dpops.noise import randomness

    monkeypatch.setattr(randomness, "_LOADED", {})
    a = NoiseKey.generate(tmp_path / "a.key")
    b = NoiseKey(os.urandom(32))
    with pytest.raises(InvalidParameter, match=f"holds key id {a.key_id}.*prepared with key id {b.key_id}"):
        randomness.key_for_run(tmp_path / "a.key", b.key_id)
    assert randomness.key_for_run(tmp_path / "a.key", a.key_id) == a


def test_pipeline_refuses_a_key_file_that_is_not_the_runs(tmp_path, monkeypatch):
    import dataclasses

    from dpops.noise import randomness
    from test_pipeline_helpers import request, write_input, write_spec

    monkeypatch.setattr(randomness, "_LOADED", {})
    NoiseKey.generate(tmp_path / "worker.key")
    prepared_with = NoiseKey(os.urandom(32)).key_id
    spec = write_spec(tmp_path, [{"type": "count"}], {"columns": ["region"], "public": ["north"]})
    inp = write_input(tmp_path, {"user_id": ["a", "b"], "region": ["north", "north"], "amount": [1.0, 2.0],
                                 "category": ["x", "x"]})
    req = dataclasses.replace(request(spec, [inp], tmp_path / "stage", randomness="keyed",
                                      key_path=str(tmp_path / "worker.key")), key_id=prepared_with)
    from pipelines.release_pipeline import run_release

    with pytest.raises(InvalidParameter, match="every worker must see the same key"):
        run_release(req)
    assert not (tmp_path / "stage" / "data.parquet").exists()


def test_key_is_loaded_once_per_run(tmp_path, monkeypatch, capsys):
    """A whole release (prepare, fingerprint, seal, pipeline driver and every DoFn) reads the key file once."""
    from dpops.noise import randomness
    from test_storage import _release_env

    monkeypatch.setenv("DPOPS_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(randomness, "_LOADED", {}, raising=False)
    env = _release_env(tmp_path)
    real = NoiseKey.from_file.__func__
    calls = []

    def counting(cls, path):
        calls.append(str(path))
        return real(cls, path)

    monkeypatch.setattr(NoiseKey, "from_file", classmethod(counting))
    assert dpops_main(["release", "run", env["spec"], *env["base"], "--publish", "--json"]) == 0
    assert '"published"' in capsys.readouterr().out
    assert len(calls) == 1, calls


def test_key_in_environment_is_refused_before_reserving(tmp_path, monkeypatch, capsys):
    from dpops.ledger import open_ledger
    from test_storage import _release_env

    monkeypatch.setenv("DPOPS_STATE_DIR", str(tmp_path / "state"))
    env = _release_env(tmp_path)
    value = os.urandom(32).hex()
    monkeypatch.setenv("DPOPS_NOISE_KEY", value)
    assert dpops_main(["release", "run", env["spec"], *env["base"], "--publish"]) == 3
    err = capsys.readouterr().err
    assert "DPOPS_NOISE_KEY" in err and "--key-file" in err and value not in err
    with open_ledger(env["url"]) as led:
        assert led.runs() == [] and led.status("shop").total == 0
    res = CliRunner().invoke(dpops_cli_group(), ["run", "--help"])
    assert "DPOPS_NOISE_KEY_FILE" in res.output and "$DPOPS_NOISE_KEY)" not in res.output
    assert "DPOPS_NOISE_KEY " not in res.output.replace("\n", " ").replace("DPOPS_NOISE_KEY_FILE", "")


@pytest.mark.parametrize("secret", [b"postgresql+psycopg2://airflow:Zq8vR2xLw9Tt4Kp7@postgres:5432/airflow\n",
                                    b"hJ4m0l2Qw8XbV3nK9sT1yU6eR5aZ7cD0fG2hJ4kL6mN=\n"],
                         ids=["airflow-db-url", "fernet-key"])
def test_a_foreign_secret_is_refused_as_the_noise_key_and_nothing_is_charged(tmp_path, monkeypatch, capsys, secret):
    """Issue 19 item 9: a readable high-entropy file that is not a dpops key (the Airflow DB URL, the Fernet
    key) passed the key checks and a release published keyed by it. Now `release run` refuses it with the
    format rule and the migration command, exit 3, before anything is reserved, and never echoes it."""
    from dpops.ledger import open_ledger
    from test_storage import _release_env

    monkeypatch.setenv("DPOPS_STATE_DIR", str(tmp_path / "state"))
    env = _release_env(tmp_path)
    foreign = tmp_path / "secret" / "airflow_secret"
    _key_file(foreign, secret)
    base = list(env["base"])
    base[base.index("--key-file") + 1] = str(foreign)
    assert dpops_main(["release", "run", env["spec"], *base, "--publish"]) == 3
    err = capsys.readouterr().err
    assert "is not a dpops noise key file" in err and "dpops key convert" in err and str(foreign) in err
    assert secret.decode().strip() not in err and secret.decode()[:12] not in err
    with open_ledger(env["url"]) as led:
        assert led.runs() == [] and led.status("shop").total == 0
    assert not (tmp_path / "out" / "shop_daily" / "published").exists()


def dpops_cli_group():
    from dpops.cli.release import cli

    return cli
