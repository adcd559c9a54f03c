"""Staging and atomic, never-overwriting publishing."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from dpops.errors import IntegrityError, StorageError
from dpops.noise.randomness import NoiseKey
from dpops.storage import ReleaseStore

IV = "20240101T000000Z_20240102T000000Z"
KEY = NoiseKey(os.urandom(32))


def stage(store: ReleaseStore, run_id: str, payload: bytes = b"PAR1 noisy", test_mode: bool = False):
    tmp = store.new_staging_dir(IV, run_id)
    assert tmp.name.startswith(".tmp-")
    (tmp / "data.parquet").write_bytes(payload)
    (tmp / "summary.json").write_text(json.dumps({"release": "rel", "test_mode": test_mode}))
    return store.finish_staging(tmp, IV, run_id, internal={"rows_dropped": {"null_unit": 3}})


def visible(root: Path) -> list[str]:
    """Every non-temporary path a reader could see."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".tmp-" not in str(p))


def test_stage_and_publish(tmp_path):
    store = ReleaseStore(tmp_path, "rel", sealer=KEY)
    staged = stage(store, "run1")
    assert staged.directory == tmp_path / "staged/rel" / IV / "run1"
    assert not (staged.directory / "internal.json").exists()  # the run log is private, outside output.root
    assert store.read_internal_log(IV, "run1") == {"rows_dropped": {"null_unit": 3}}
    assert not str(store.internal_log_path(IV, "run1").resolve()).startswith(str(tmp_path.resolve()))
    assert store.find_staged(IV, "run1") == staged
    assert store.find_staged(IV, "other") is None
    pub = store.publish(staged, IV)
    assert pub.version == 1 and pub.directory == tmp_path / "published/rel" / IV / "v1"
    assert sorted(os.listdir(pub.directory)) == ["_PUBLISHED.json", "data.parquet", "summary.json"]  # no internal.json
    marker = json.loads((pub.directory / "_PUBLISHED.json").read_text())
    assert marker["run_id"] == "run1" and set(marker["files"]) == {"data.parquet", "summary.json"}
    assert (tmp_path / "published/rel" / IV / "current" / "data.parquet").read_bytes() == b"PAR1 noisy"
    assert store.current(IV).run_id == "run1"
    assert not [p for p in tmp_path.rglob(".tmp-*")]  # no temporary left behind


def test_publish_is_idempotent_per_run(tmp_path):
    store = ReleaseStore(tmp_path, "rel", sealer=KEY)
    staged = stage(store, "run1")
    a = store.publish(staged, IV)
    b = store.publish(staged, IV)
    assert a.directory == b.directory and len(store.versions(IV)) == 1


def test_never_overwrite_and_restatement_versions(tmp_path):
    store = ReleaseStore(tmp_path, "rel", sealer=KEY)
    p1 = store.publish(stage(store, "run1", b"first"), IV)
    s2 = stage(store, "run2", b"second")
    with pytest.raises(StorageError, match="already published .*explicit restatement"):
        store.publish(s2, IV)
    with pytest.raises(StorageError, match="already published"):
        store.publish(s2, IV, restates="wrong-run")
    p2 = store.publish(s2, IV, restates="run1")
    assert p2.version == 2 and p2.restates == "run1"
    assert (p1.directory / "data.parquet").read_bytes() == b"first"  # old version kept
    assert (tmp_path / "published/rel" / IV / "current" / "data.parquet").read_bytes() == b"second"
    # publishing run1 again (a late retry) returns v1 and does not move the pointer back
    assert store.publish(store.find_staged(IV, "run1"), IV).version == 1
    assert store.current(IV).run_id == "run2"


def test_corrupted_staged_file_refused(tmp_path):
    store = ReleaseStore(tmp_path, "rel", sealer=KEY)
    staged = stage(store, "run1")
    original = staged.data_file.read_bytes()
    with open(staged.data_file, "r+b") as fh:
        fh.write(b"X")
    with pytest.raises(IntegrityError, match=r"data.parquet does not match the sealed sha256.*not be published") \
            as info:
        store.publish(staged, IV)
    assert info.value.exit_code == 7
    assert not (tmp_path / "published").exists() or not list((tmp_path / "published").rglob("data.parquet"))
    with pytest.raises(IntegrityError, match="changed after it was written"):
        store.find_staged(IV, "run1")
    staged.data_file.write_bytes(original)
    assert store.find_staged(IV, "run1") == staged
    (staged.directory / "summary.json").unlink()
    with pytest.raises(IntegrityError, match="summary.json is unreadable"):
        store.verify_staged(IV, "run1")


def test_test_mode_never_published(tmp_path):
    store = ReleaseStore(tmp_path, "rel", sealer=KEY)
    staged = stage(store, "run1", test_mode=True)
    assert staged.test_mode
    with pytest.raises(StorageError, match="test mode .*can never be published"):
        store.publish(staged, IV)


def test_unfinished_staging_is_invisible(tmp_path):
    store = ReleaseStore(tmp_path, "rel", sealer=KEY)
    tmp = store.new_staging_dir(IV, "run1")
    (tmp / "data.parquet").write_bytes(b"half")  # pipeline crashed before summary.json
    assert store.find_staged(IV, "run1") is None
    with pytest.raises(StorageError, match="did not write summary.json"):
        store.finish_staging(tmp, IV, "run1", {})
    assert not tmp.exists() and store.find_staged(IV, "run1") is None


@pytest.mark.parametrize("code,words", [(errno.ENOSPC, "the disk is full"), (errno.EROFS, "read-only")])
def test_disk_full_or_read_only_during_publish(tmp_path, monkeypatch, code, words):
    # The tests run as root, for whom chmod does not make a directory read-only: inject the OS error instead.
    store = ReleaseStore(tmp_path, "rel", sealer=KEY)
    staged = stage(store, "run1")
    import shutil

    real = shutil.copyfile
    calls = {"n": 0}

    def failing_copy(src, dst, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:  # the second file: the first is already half-way in the temporary dir
            raise OSError(code, os.strerror(code))
        return real(src, dst, *a, **k)

    monkeypatch.setattr(shutil, "copyfile", failing_copy)
    with pytest.raises(StorageError, match=words) as info:
        store.publish(staged, IV)
    assert "nothing was published" in str(info.value)
    assert not [p for p in (tmp_path / "published").rglob("*") if p.is_file() or p.is_symlink()]
    assert store.current(IV) is None and store.versions(IV) == []
    assert not list(tmp_path.rglob(".tmp-*"))
    monkeypatch.setattr(shutil, "copyfile", real)
    assert store.publish(staged, IV).version == 1  # a retry after the fix succeeds


def test_read_only_root(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions; covered by the injected EROFS case")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    store = ReleaseStore(ro, "rel", sealer=KEY)
    with pytest.raises(StorageError, match="permission denied"):
        store.new_staging_dir(IV, "run1")


def test_unsafe_names(tmp_path):
    with pytest.raises(StorageError):
        ReleaseStore(tmp_path, "../x")
    with pytest.raises(StorageError):
        ReleaseStore(tmp_path, "rel", sealer=KEY).staged_dir(IV, "../../etc")


# --------------------------------------------------------------------------- issue 14 item 2: who can read staging


NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
_SCAN = r"""
import json, os, sys
root, needles = sys.argv[1], sys.argv[2:]
out = {"read": [], "denied": [], "hits": []}
for dirpath, dirnames, filenames in os.walk(root, onerror=lambda e: out["denied"].append(e.filename)):
    for name in filenames:
        path = os.path.join(dirpath, name)
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError:
            out["denied"].append(path)
            continue
        out["read"].append(os.path.relpath(path, root))
        out["hits"] += [[os.path.relpath(path, root), n] for n in needles if n.encode() in data]
print(json.dumps(out))
"""


def as_nobody_scan(root: Path, *needles: str) -> dict:
    """What an unprivileged local user (uid 65534) can read under ``root``, and which needles it finds."""
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as an unprivileged uid")
    res = subprocess.run([*NOBODY, sys.executable, "-I", "-c", _SCAN, str(root), *needles],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.fixture
def shared_dir():
    """A directory other local users can traverse (pytest's own tmp tree is 0700 to them)."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="dpops-perm-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_staging_is_private_whatever_the_umask(shared_dir):
    """Modes are set explicitly: even under umask 000 the staged tree is 0700/0600 and another uid
    reads nothing in it; the published copy is readable (it is the product)."""
    out = shared_dir / "out"
    store = ReleaseStore(out, "rel", sealer=KEY, state_dir=shared_dir / "state")
    old = os.umask(0)
    try:
        staged = stage(store, "run1", payload=b"PAR1 noisy-staged-sentinel")
    finally:
        os.umask(old)
    for d in (out / "staged", out / "staged/rel", out / "staged/rel" / IV, staged.directory):
        assert (d.stat().st_mode & 0o777) == 0o700, d
    for f in staged.directory.iterdir():
        assert (f.stat().st_mode & 0o777) == 0o600, f
    log = store.internal_log_path(IV, "run1")
    assert (log.stat().st_mode & 0o777) == 0o600
    for d in (shared_dir / "state", shared_dir / "state/runs", log.parent):
        assert (d.stat().st_mode & 0o777) == 0o700, d
    seen = as_nobody_scan(shared_dir, "noisy-staged-sentinel", "null_unit")
    assert seen["read"] == [] and seen["hits"] == []
    assert str(out / "staged") in seen["denied"] and str(shared_dir / "state") in seen["denied"]
    pub = store.publish(staged, IV)
    assert ((pub.directory / "data.parquet").stat().st_mode & 0o777) == 0o644
    seen = as_nobody_scan(out / "published")
    assert f"rel/{IV}/v1/data.parquet" in seen["read"] and seen["denied"] == []


def test_older_loose_staged_tree_is_tightened(tmp_path):
    out = tmp_path / "out"
    (out / "staged/rel" / IV).mkdir(parents=True)
    for d in (out / "staged", out / "staged/rel", out / "staged/rel" / IV):
        d.chmod(0o755)
    stage(ReleaseStore(out, "rel", sealer=KEY), "run1")
    for d in (out / "staged", out / "staged/rel", out / "staged/rel" / IV):
        assert (d.stat().st_mode & 0o777) == 0o700, d
    assert (out.stat().st_mode & 0o777) != 0o700  # output.root itself stays traversable for readers


def test_state_dir_under_output_root_is_refused(tmp_path):
    with pytest.raises(StorageError, match="DPOPS_STATE_DIR.*outside output.root"):
        ReleaseStore(tmp_path, "rel", sealer=KEY, state_dir=tmp_path / "private")


# --------------------------------------------------------------------------- real releases through the CLI


def _release_env(root: Path) -> dict:
    """A real release (real planner, real Beam pipeline, keyed noise) with ONE public partition, so
    published - rows_kept would be the noise if rows_kept leaked."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    from dpops.ledger import ScopeDefinition, open_ledger

    doc = {
        "name": "shop_daily",
        "input": {"path": "data/{start:%Y-%m-%d}.parquet", "format": "parquet",
                  "columns": {"user_id": "string", "region": "string", "amount": "float"}},
        "privacy_unit": {"column": "user_id", "description": "a user's purchases on one day",
                         "adjacency": "add_remove"},
        "budget": {"scope": "shop", "epsilon": 1.0, "delta": 0},
        "contribution": {"max_partitions_per_unit": 1, "max_rows_per_unit_per_partition": 1},
        "partitions": {"columns": ["region"], "public": ["north"]},
        "metrics": [{"type": "count"}, {"type": "sum", "column": "amount", "bounds": [0, 10]}],
        "output": {"root": "out"},
    }
    (root / "spec.yaml").write_text(yaml.safe_dump(doc))
    (root / "data").mkdir()
    n = 120
    pq.write_table(pa.table({"user_id": [f"u{i}" for i in range(n)] + [None, None],
                             "region": ["north"] * (n + 2), "amount": [1.0] * n + [2.0, 2.0]}),
                   root / "data/2024-01-01.parquet")
    (root / "secret").mkdir(mode=0o700)
    key = root / "secret/noise.key"
    NoiseKey.generate(key)
    url = f"sqlite:///{root / 'secret/ledger.sqlite'}"
    with open_ledger(url) as led:
        led.create_scope(ScopeDefinition(name="shop", unit="a user's purchases on one day", unit_column="user_id",
                                         epsilon=10.0, delta=1e-6, rho=None, accountant="basic/1",
                                         adjacency="add_remove"), actor="test")
    base = ["--interval", "2024-01-01/2024-01-02", "--ledger", url, "--key-file", str(key), "--no-gx-checks"]
    return {"spec": str(root / "spec.yaml"), "base": base, "url": url, "key": key, "out": root / "out",
            "slug": IV, "true_count": n}


def test_published_output_root_reveals_no_exact_counts(shared_dir, monkeypatch, capsys):
    from dpops.cli.main import main

    monkeypatch.setenv("DPOPS_STATE_DIR", str(shared_dir / "state"))
    env = _release_env(shared_dir)
    assert main(["release", "run", env["spec"], *env["base"], "--json"]) == 0  # staged, not yet published
    run_id = json.loads(capsys.readouterr().out)["run_id"]
    before = as_nobody_scan(env["out"])
    assert not [p for p in before["read"] if p.startswith("staged/")], before["read"]
    assert str(env["out"] / "staged") in before["denied"]
    assert main(["release", "run", env["spec"], *env["base"], "--publish", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "published"
    store = ReleaseStore(env["out"], "shop_daily", sealer=NoiseKey.from_file(env["key"]))
    internal = store.read_internal_log(IV, run_id)
    assert internal["rows_kept"] == env["true_count"] and internal["dropped_null_unit"] == 2
    counters = [k for k in internal if any(w in k for w in ("rows", "dropped", "clamped", "malformed"))]
    assert "rows_kept" in counters and "rows_read" in counters
    after = as_nobody_scan(env["out"], *counters, "internal")
    assert f"published/shop_daily/{IV}/v1/data.parquet" in after["read"]  # readers still get the product
    assert after["hits"] == [], after["hits"]
    assert not [p for p in after["read"] if p.startswith("staged/") or "internal" in p]


# --------------------------------------------------------------------------- issue 14 item 3: the keyed seal


def test_swapped_staged_counts_with_recomputed_sha256_are_not_published(tmp_path, monkeypatch, capsys):
    """The exploit: replace ``count`` in the staged data.parquet with the raw counts, recompute the
    sha256 into _STAGED.json, then --publish. The HMAC seal needs the key: refused, exit 7, nothing
    published, the run stays started (charged) and is not committed."""
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    from dpops.cli.main import main
    from dpops.ledger import open_ledger

    monkeypatch.setenv("DPOPS_STATE_DIR", str(tmp_path / "state"))
    env = _release_env(tmp_path)
    assert main(["release", "run", env["spec"], *env["base"], "--json"]) == 0
    run_id = json.loads(capsys.readouterr().out)["run_id"]
    run_dir = env["out"] / "staged/shop_daily" / IV / run_id
    data = run_dir / "data.parquet"
    table = pq.read_table(data)
    for col, value in (("count", env["true_count"]), ("sum_amount", float(env["true_count"]))):  # the raw values
        raw = pa.array([value] * table.num_rows, table.schema.field(col).type)
        table = table.set_column(table.schema.get_field_index(col), col, raw)
    pq.write_table(table, data)
    marker = json.loads((run_dir / "_STAGED.json").read_text())
    swapped = hashlib.sha256(data.read_bytes()).hexdigest()
    assert swapped != marker["files"]["data.parquet"]  # the swap really changed the staged values
    marker["files"]["data.parquet"] = swapped
    (run_dir / "_STAGED.json").write_text(json.dumps(marker))
    assert main(["release", "run", env["spec"], *env["base"], "--publish"]) == 7
    err = capsys.readouterr().err
    assert "seal does not verify" in err and "_STAGED.json" in err
    assert not (env["out"] / "published").exists() or not list((env["out"] / "published").rglob("data.parquet"))
    with open_ledger(env["url"]) as led:
        assert led.run(run_id).state == "started" and led.published("shop_daily", *_iso()) is None
    # a seal without the keyed MAC (an older dpops, or written by hand) is refused the same way
    del marker["seal"]
    (run_dir / "_STAGED.json").write_text(json.dumps(marker))
    assert main(["release", "run", env["spec"], *env["base"], "--publish"]) == 7
    assert "no keyed seal" in capsys.readouterr().err


def _iso() -> tuple[str, str]:
    return "2024-01-01T00:00:00Z", "2024-01-02T00:00:00Z"


def test_seal_is_bound_to_the_key_and_the_run(tmp_path):
    store = ReleaseStore(tmp_path, "rel", sealer=KEY)
    stage(store, "run1")
    with pytest.raises(IntegrityError, match="seal does not verify"):
        ReleaseStore(tmp_path, "rel", sealer=NoiseKey(os.urandom(32))).verify_staged(IV, "run1")
    with pytest.raises(StorageError, match="without the noise key"):
        ReleaseStore(tmp_path, "rel").verify_staged(IV, "run1")
    marker = json.loads((tmp_path / "staged/rel" / IV / "run1/_STAGED.json").read_text())
    assert marker["seal"]["key_id"] == KEY.key_id and marker["seal"]["mac"].startswith("hmac-sha256:")
    # flipping test_mode off in the marker (to publish seeded noise) breaks the seal
    stage(store, "run2", test_mode=True)
    path = tmp_path / "staged/rel" / IV / "run2/_STAGED.json"
    doc = json.loads(path.read_text())
    doc["test_mode"] = False
    path.write_text(json.dumps(doc))
    with pytest.raises(IntegrityError, match="seal does not verify"):
        store.find_staged(IV, "run2")


def test_unwritable_state_dir_fails_before_start_and_is_refunded(tmp_path, monkeypatch, capsys):
    """The private run log's directory is prepared before ledger.start, so a bad state dir costs nothing."""
    from dpops.cli.main import main
    from dpops.ledger import open_ledger

    bad = tmp_path / "not-a-dir"
    bad.write_text("")
    monkeypatch.setenv("DPOPS_STATE_DIR", str(bad))
    env = _release_env(tmp_path)
    assert main(["release", "run", env["spec"], *env["base"], "--publish"]) == 6
    assert "private state directory" in capsys.readouterr().err
    with open_ledger(env["url"]) as led:
        assert [r.state for r in led.runs()] == ["released"] and led.status("shop").total == 0
    assert not list((env["out"] / "staged").rglob("*.parquet"))
