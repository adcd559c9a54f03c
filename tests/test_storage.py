"""Staging and atomic, never-overwriting publishing."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from dpops.errors import IntegrityError, StorageError
from dpops.randomness import NoiseKey
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
    with pytest.raises(IntegrityError, match=r"data.parquet does not match the sealed sha256.*not be published") as info:
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
