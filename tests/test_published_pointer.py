"""Issue 19 item 7: a forged version plus a moved ``current`` pointer fails every check (exit 7, naming it).

A writer of ``published/`` (not dpops: no noise key, no ledger access) copies the published version to
a new one holding the exact counts, writes a ``_PUBLISHED.json`` with a run id the ledger never saw and
correct sha256s, and points ``current`` at it (the local symlink, or the object-store pointer object).
Each of the four readers dpops offers must then exit 7 naming the forged version, through the real CLI:
``release status --key-file``, a served re-run, ``manifest verify --ledger`` and ``report``. The reader's
own check (``release check-pointer``, no ledger) refuses it with the publisher's public key or the noise
key. Local and S3 (moto) both.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cli_support import make_env
from dpops.cli.main import main
from dpops.manifest.sign import generate_signing_key
from dpops.errors import IntegrityError
from dpops.storage import Location, files, open_store
from dpops.storage.published import verified_current

import test_storage_s3_runs

s3_run = test_storage_s3_runs.s3_run
SLUG = "20240101T000000Z_20240102T000000Z"
FORGED_RUN = "f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0"


def _exact_table() -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table({"region": ["north", "south"], "count": [2.0, 1.0]}), buf)
    return buf.getvalue()


def _forge(published: Location, genuine: Location, forged_name: str, version: int, *, pointer_doc: bool,
          run_id: str = FORGED_RUN) -> None:
    """What an attacker with write access to published/ does: a new version and the pointer moved to it."""
    data = _exact_table()
    summary = files.read_bytes(genuine / "summary.json") or b"{}"
    forged = published / forged_name
    if forged.is_local:
        forged.local_path.mkdir()
    files.write_bytes(forged / "data.parquet", data)
    files.write_bytes(forged / "summary.json", summary)
    hashes = {"data.parquet": hashlib.sha256(data).hexdigest(), "summary.json": hashlib.sha256(summary).hexdigest()}
    marker = files.read_json(genuine / "_PUBLISHED.json")
    marker.update({"run_id": run_id, "version": version, "files": hashes})
    files.write_bytes(forged / "_PUBLISHED.json", json.dumps(marker).encode())  # binding copied from the genuine one
    if pointer_doc:
        ptr = files.read_json(published / "current")
        ptr.update({"version": version, "run_id": run_id, "prefix": forged_name, "files": hashes})
        files.write_bytes(published / "current", json.dumps(ptr).encode())
    else:
        link = published.local_path / "current"
        os.unlink(link)
        os.symlink(forged_name, link)


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, (out.out if "--json" in argv else out.out + out.err)


def _four_readers_fail(capsys, *, spec: str, url: str, key: str, manifests: str, run_id: str, forged: str,
                       tmp: Path) -> None:
    base = ["--interval", "2024-01-01/2024-01-02", "--ledger", url, "--key-file", key]
    code, out = _run(capsys, "release", "status", spec, *base)
    assert code == 7 and forged in out and "not committed in the ledger" in out, out
    code, out = _run(capsys, "release", "run", spec, *base, "--publish", "--no-gx-checks")
    assert code == 7 and forged in out, out
    code, out = _run(capsys, "manifest", "verify", run_id, "--manifests", manifests, "--ledger", url, "--key-file", key)
    assert code == 7 and forged in out, out
    if manifests.startswith("s3://"):  # `report --manifests s3://` is issue 19 item 11 (another change): a local copy
        local = tmp / "manifest-copy"
        local.mkdir()
        for name in files.list_dir(Location.parse(manifests)):
            (local / name).write_bytes(files.read_bytes(Location.parse(manifests) / name) or b"")
        manifests = str(local)
    code, out = _run(capsys, "report", "--scope", "shop", "--ledger", url, "--manifests", manifests,
                     "--out", str(tmp / "report.html"), "--key-file", key)
    assert code == 7 and forged in out, out


def _reader_checks(capsys, root: str, pub_key: Path, key: str, *, expect: int, needle: str = "") -> None:
    args = ["release", "check-pointer", "--root", root, "--release", "purchases_test",
            "--interval", "2024-01-01/2024-01-02"]
    for extra in (["--public-key", str(pub_key)], ["--key-file", key]):
        code, out = _run(capsys, *args, *extra)
        assert code == expect and needle in out, out


@pytest.fixture
def signing(tmp_path, monkeypatch):
    priv, pub = tmp_path / "publisher.pem", tmp_path / "publisher.pub.pem"
    generate_signing_key(priv, pub)
    monkeypatch.setenv("DPOPS_MANIFEST_SIGNING_KEY", str(priv))
    monkeypatch.delenv("DPOPS_MANIFEST_PUBLIC_KEY", raising=False)
    return pub


def test_local_forged_version_and_moved_symlink_fail_every_reader(tmp_path, monkeypatch, capsys, signing):
    env = make_env(tmp_path, monkeypatch)
    code, out = _run(capsys, "release", "run", str(env.spec), "--interval", "2024-01-01/2024-01-02", "--ledger",
                     env.url, "--key-file", str(env.key), "--publish", "--no-gx-checks", "--json")
    assert code == 0, out
    run_id = json.loads(out)["run_id"]
    spec_dir = tmp_path
    roots = [p for p in spec_dir.rglob("published/purchases_test/" + SLUG)]
    assert len(roots) == 1
    published = Location.local(roots[0])
    root = str(roots[0].parent.parent.parent)
    manifests = str(Path(root) / "manifests" / "purchases_test")
    _reader_checks(capsys, root, signing, str(env.key), expect=0, needle="binding verified")
    _forge(published, published / "v1", "v2", 2, pointer_doc=False)
    _four_readers_fail(capsys, spec=str(env.spec), url=env.url, key=str(env.key), manifests=manifests,
                       run_id=run_id, forged="v2", tmp=tmp_path)
    assert os.readlink(roots[0] / "current") == "v2"  # a failed check never moves the pointer itself
    # the reader's API: store.current() follows the pointer, verified_current() refuses it
    store = open_store(root, "purchases_test")
    assert store.current(SLUG).run_id == FORGED_RUN
    with pytest.raises(IntegrityError, match="v2"):
        verified_current(store, SLUG, public_key=signing)
    os.unlink(roots[0] / "current")
    os.symlink("v1", roots[0] / "current")
    # Without the ledger a reader cannot tell a forged v2 from a damaged genuine one: any newer version
    # makes the older pointer fail (issue 25 item 10), until the repair below moves v2 aside.
    with pytest.raises(IntegrityError, match="newer version v2"):
        verified_current(store, SLUG, public_key=signing)
    os.unlink(roots[0] / "current")
    os.symlink("v2", roots[0] / "current")
    _reader_checks(capsys, root, signing, str(env.key), expect=7, needle="v2")
    # the runbook's repair: forged version moved aside as evidence, current pointed back, checks pass again
    import shutil
    import subprocess

    shutil.move(str(roots[0] / "v2"), str(tmp_path / "evidence-v2"))
    subprocess.run("ln -sfn v1 current.new && mv -T current.new current", shell=True, check=True, cwd=roots[0])
    code, out = _run(capsys, "release", "status", str(env.spec), "--interval", "2024-01-01/2024-01-02", "--ledger",
                     env.url, "--key-file", str(env.key))
    assert code == 0 and "published files: ok" in out, out
    _reader_checks(capsys, root, signing, str(env.key), expect=0, needle="binding verified")


def test_forged_copy_claiming_the_committed_run_id_fails_without_the_key(tmp_path, monkeypatch, capsys):
    """The forger reuses the committed run's id: the ledger knows it, but one run is one version, and
    current's bytes must be the committed ones (no noise key needed for either)."""
    env = make_env(tmp_path, monkeypatch)
    args = ["--interval", "2024-01-01/2024-01-02", "--ledger", env.url]
    assert _run(capsys, "release", "run", str(env.spec), *args, "--key-file", str(env.key), "--publish",
                "--no-gx-checks")[0] == 0
    interval = next(tmp_path.rglob("published/purchases_test/" + SLUG))
    published = Location.local(interval)
    run_id = files.read_json(published / "v1" / "_PUBLISHED.json")["run_id"]
    _forge(published, published / "v1", "v2", 2, pointer_doc=False, run_id=run_id)
    code, out = _run(capsys, "release", "status", str(env.spec), *args)
    assert code == 7 and "v2" in out and "both claim run" in out, out


def test_s3_forged_version_and_moved_pointer_fail_every_reader(s3_run, tmp_path, capsys, signing):
    env = s3_run
    code, out = _run(capsys, "release", "run", env["spec"], *env["base"], "--publish", "--no-gx-checks", "--json")
    assert code == 0, out
    run_id = json.loads(out)["run_id"]
    published = env["root"].join("published", "purchases_test", SLUG)
    manifests = str(env["root"].join("manifests", "purchases_test"))
    root = str(env["root"])
    _reader_checks(capsys, root, signing, env["key"], expect=0, needle="binding verified")
    forged = f"v0002-{FORGED_RUN}"
    _forge(published, published / f"v0001-{run_id}", forged, 2, pointer_doc=True)
    _four_readers_fail(capsys, spec=env["spec"], url=env["url"], key=env["key"], manifests=manifests,
                       run_id=run_id, forged=forged, tmp=tmp_path)
    assert files.read_json(published / "current")["prefix"] == forged
    _reader_checks(capsys, root, signing, env["key"], expect=7, needle=forged)
