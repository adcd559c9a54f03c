"""The same store tests on the local backend and on S3 (moto's server): stage, seal, verify, publish,
pointer resolution, immutability, crash healing."""

from __future__ import annotations

import json
import os

import pytest

from dpops.errors import IntegrityError, StorageError
from dpops.noise.randomness import NoiseKey
from dpops.storage import Location, Store, files, open_store
from dpops.storage.objectstore import ObjectReleaseStore


IV = "20240101T000000Z_20240102T000000Z"
KEY = NoiseKey(os.urandom(32))


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path) -> Location:
    if request.param == "local":
        return Location.local(tmp_path / "out")
    env = request.getfixturevalue("s3")
    return Location.parse(env.uri("dp/out"))


def store_at(root: Location, sealer=KEY) -> Store:
    return open_store(root, "rel", sealer=sealer)


def stage(store: Store, run_id: str, payload: bytes = b"PAR1 noisy", test_mode: bool = False):
    tmp = store.new_staging(IV, run_id)
    assert ".tmp-" in tmp.name
    # What the pipeline does through Beam FileSystems: write the two files under the staging location.
    files.write_bytes(tmp / "data.parquet", payload)
    files.write_bytes(tmp / "summary.json", json.dumps({"release": "rel", "test_mode": test_mode}).encode())
    return store.finish_staging(tmp, IV, run_id, internal={"rows_dropped": {"null_unit": 3}})


def tamper(loc: Location, data: bytes) -> None:
    if loc.is_local:
        os.chmod(loc.local_path, 0o600)
    files.write_bytes(loc, data)


def test_stage_seal_publish_and_pointer(root):
    store = store_at(root)
    assert isinstance(store, Store)
    staged = stage(store, "run1")
    assert staged.location == root.join("staged/rel", IV, "run1")
    assert sorted(files.list_files(staged.location)) == ["_STAGED.json", "data.parquet", "summary.json"]
    assert files.list_files(root.join("staged/rel", IV)) == [f"run1/{n}" for n in
                                                             ("_STAGED.json", "data.parquet", "summary.json")]
    assert store.read_internal_log(IV, "run1") == {"rows_dropped": {"null_unit": 3}}  # private, local, not under root
    assert not str(store.internal_log_path(IV, "run1")).startswith(str(root))
    assert store.find_staged(IV, "run1") == staged
    assert store.find_staged(IV, "other") is None
    assert store.current(IV) is None
    target = store.next_version_location(IV, "run1")
    pub = store.publish(staged, IV)
    assert pub.version == 1 and pub.location == target
    assert files.read_bytes(pub.location / "data.parquet") == b"PAR1 noisy"
    marker = files.read_json(pub.location / "_PUBLISHED.json")
    assert marker["run_id"] == "run1" and set(marker["files"]) == {"data.parquet", "summary.json"}
    cur = store.current(IV)
    assert cur is not None and cur.run_id == "run1" and cur.location == pub.location
    assert store.publish(staged, IV).location == pub.location  # idempotent per run
    assert len(store.versions(IV)) == 1


def test_tampered_staged_object_refused(root):
    store = store_at(root)
    staged = stage(store, "run1")
    tamper(staged.location / "data.parquet", b"PAR1 exact values")
    with pytest.raises(IntegrityError, match="does not match the sealed sha256"):
        store.verify_staged(IV, "run1")
    with pytest.raises(IntegrityError):
        store.publish(staged, IV)
    assert store.current(IV) is None and store.versions(IV) == []


def test_resealed_without_key_refused(root):
    store = store_at(root)
    stage(store, "run1", b"noisy")
    other = store_at(root, sealer=NoiseKey(os.urandom(32)))
    with pytest.raises(IntegrityError, match="seal does not verify"):
        other.verify_staged(IV, "run1")


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(test_mode=False), "seal does not verify"),  # a test-mode run relabelled as real
    (lambda m: m.pop("seal"), "carries no keyed seal"),
    (lambda m: m.update(run_id="run2"), "does not describe run run1"),
    (lambda m: m.update(test_mode="no"), "test_mode is not a boolean"),
    (lambda m: m["files"].pop("summary.json"), "does not describe run run1"),
])
def test_edited_staged_marker_refused_on_every_backend(root, edit, message):
    """The marker checks (dpops.storage.base.check_staged_seal) hold for the local and the S3 backend."""
    store = store_at(root)
    staged = stage(store, "run1", b"noisy", test_mode=True)
    marker_loc = staged.location / "_STAGED.json"
    marker = json.loads(files.read_bytes(marker_loc))
    edit(marker)
    tamper(marker_loc, json.dumps(marker).encode())
    with pytest.raises(IntegrityError, match=message):
        store.verify_staged(IV, "run1")
    assert store.current(IV) is None and store.versions(IV) == []


def test_restatement_new_version_old_one_immutable(root):
    store = store_at(root)
    p1 = store.publish(stage(store, "run1", b"first"), IV)
    v1_before = {n: files.read_bytes(p1.location / n) for n in files.list_files(p1.location)}
    s2 = stage(store, "run2", b"second")
    with pytest.raises(StorageError, match="already published .*explicit restatement"):
        store.publish(s2, IV)
    with pytest.raises(StorageError, match="already published"):
        store.publish(s2, IV, restates="wrong-run")
    p2 = store.publish(s2, IV, restates="run1")
    assert p2.version == 2 and p2.restates == "run1" and p2.location != p1.location
    assert {n: files.read_bytes(p1.location / n) for n in files.list_files(p1.location)} == v1_before  # untouched
    assert store.current(IV).run_id == "run2"
    assert files.read_bytes(store.current(IV).location / "data.parquet") == b"second"
    # a late retry of run1 returns v1 and does not move the pointer back
    assert store.publish(store.find_staged(IV, "run1"), IV).version == 1
    assert store.current(IV).run_id == "run2"
    assert [v.run_id for v in store.versions(IV)] == ["run1", "run2"]


def test_test_mode_never_published(root):
    store = store_at(root)
    staged = stage(store, "run1", test_mode=True)
    assert staged.test_mode
    with pytest.raises(StorageError, match="test mode"):
        store.publish(staged, IV)


def test_crash_between_version_and_pointer_healed_by_retry(root):
    store = store_at(root)
    staged = stage(store, "run1")
    cls = type(store)

    def crash(*args, **kwargs):
        raise OSError("simulated crash before the pointer write")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cls, "_point_current", crash if cls is ObjectReleaseStore else staticmethod(crash))
        with pytest.raises(OSError, match="simulated crash"):
            store.publish(staged, IV)
    assert store.current(IV) is None  # not visible: readers resolve through the pointer only
    assert len(store.versions(IV)) == 1  # the complete version exists, waiting for its pointer
    pub = store_at(root).publish(staged, IV)  # the retry
    assert pub.version == 1 and store.current(IV).run_id == "run1"
    assert len(store.versions(IV)) == 1


def test_missing_pipeline_output_refused(root):
    store = store_at(root)
    tmp = store.new_staging(IV, "run1")
    files.write_bytes(tmp / "summary.json", b"{}")
    with pytest.raises(StorageError, match="did not write data.parquet"):
        store.finish_staging(tmp, IV, "run1", internal={})
    assert store.find_staged(IV, "run1") is None


def test_s3_pointer_is_conditional(s3):
    """Two publishers that read the same pointer: the second conditional write loses and nothing moves."""
    from dpops.storage.objectstore import PreconditionFailed, put_conditional, read_with_tag

    loc = Location.parse(s3.uri("p/current"))
    put_conditional(loc, b"1", if_none_match=True)
    with pytest.raises(PreconditionFailed):
        put_conditional(loc, b"2", if_none_match=True)
    data, tag = read_with_tag(loc)
    put_conditional(loc, b"3", if_match=tag)
    with pytest.raises(PreconditionFailed):
        put_conditional(loc, b"4", if_match=tag)  # stale tag
    assert read_with_tag(loc)[0] == b"3"


def test_s3_layout_and_pointer_document(s3):
    root = Location.parse(s3.uri("dp"))
    store = store_at(root)
    pub = store.publish(stage(store, "run1"), IV)
    # pyarrow leaves empty "directory" marker objects (keys ending in "/") when it deletes a prefix: not data
    keys = sorted(o["Key"] for o in s3.client().list_objects_v2(Bucket=s3.bucket)["Contents"]
                  if not o["Key"].endswith("/"))
    assert keys == [f"dp/published/rel/{IV}/current", f"dp/published/rel/{IV}/v0001-run1/_PUBLISHED.json",
                    f"dp/published/rel/{IV}/v0001-run1/data.parquet", f"dp/published/rel/{IV}/v0001-run1/summary.json",
                    f"dp/staged/rel/{IV}/run1/_STAGED.json", f"dp/staged/rel/{IV}/run1/data.parquet",
                    f"dp/staged/rel/{IV}/run1/summary.json"]  # no .tmp- prefix left, no internal log
    ptr = files.read_json(root.join("published/rel", IV, "current"))
    assert ptr["run_id"] == "run1" and ptr["prefix"] == "v0001-run1" and ptr["version"] == 1
    assert ptr["files"] == pub.hashes
    assert pub.uri == f"s3://{s3.bucket}/dp/published/rel/{IV}/v0001-run1"


def test_concurrent_first_publications_one_wins(root):
    """Two different runs publish the same interval at once: exactly one becomes current, nothing overwritten."""
    import threading

    store = store_at(root)
    staged = [stage(store, f"run{i}", f"payload {i}".encode()) for i in (1, 2)]
    results: dict[str, object] = {}
    barrier = threading.Barrier(2)

    def go(s):
        barrier.wait()
        try:
            results[s.run_id] = store_at(root).publish(s, IV)
        except StorageError as exc:
            results[s.run_id] = exc

    threads = [threading.Thread(target=go, args=(s,)) for s in staged]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    won = [r for r, v in results.items() if not isinstance(v, Exception)]
    assert len(results) == 2 and len(won) == 1, results
    cur = store.current(IV)
    assert cur is not None and cur.run_id == won[0]
    assert files.read_bytes(cur.location / "data.parquet") == f"payload {won[0][-1]}".encode()


def test_s3_same_version_publisher_that_reads_the_winners_pointer_loses(s3):
    """Both first publications compute v1 (B's listing predates A); B then reads A's pointer, which names
    the same version number: B must lose and withdraw, not replace the pointer at v1 (the interleaving that
    let both concurrent publishers win under load)."""
    root = Location.parse(s3.uri("dp"))
    a, b = store_at(root), store_at(root)
    sa, sb = stage(a, "runA", b"A"), stage(b, "runB", b"B")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(b, "current", lambda slug: None)  # B's view before A publishes
        b_versions = b.versions
        mp.setattr(b, "versions", lambda slug: [v for v in b_versions(slug) if v.run_id != "runA"])
        a.publish(sa, IV)
        with pytest.raises(StorageError, match="already names v1"):
            b.publish(sb, IV)  # B's pointer read is real: it sees A's v1
    assert [v.run_id for v in a.versions(IV)] == ["runA"]  # B's version withdrawn
    assert a.current(IV).run_id == "runA"
    assert files.read_bytes(a.current(IV).location / "data.parquet") == b"A"


def test_s3_losing_publisher_withdraws_and_late_retry_does_not_steal_pointer(s3):
    """Publisher B read "no pointer", A published meanwhile: B's conditional create loses, B's never-visible
    version is withdrawn, and a later retry of B neither moves the pointer nor overwrites A."""
    root = Location.parse(s3.uri("dp"))
    a, b = store_at(root), store_at(root)
    sa, sb = stage(a, "runA", b"A"), stage(b, "runB", b"B")
    real_pointer = ObjectReleaseStore._pointer
    calls = {"n": 0}

    def stale_then_real(self, slug):
        calls["n"] += 1
        if calls["n"] <= 2:  # B's view before A publishes: current() and the pointer write both see nothing
            return None, None
        return real_pointer(self, slug)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(b, "_pointer", stale_then_real.__get__(b))
        mp.setattr(b, "current", lambda slug: None)
        b_versions = b.versions
        mp.setattr(b, "versions", lambda slug: [v for v in b_versions(slug) if v.run_id != "runA"])
        a.publish(sa, IV)
        with pytest.raises(StorageError, match="moved concurrently"):
            b.publish(sb, IV)
    assert [v.run_id for v in a.versions(IV)] == ["runA"]  # B's version withdrawn
    assert a.current(IV).run_id == "runA"
    with pytest.raises(StorageError, match="already published"):
        store_at(root).publish(sb, IV)  # a late retry without a restatement: refused
    assert a.current(IV).run_id == "runA"
