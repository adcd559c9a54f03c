"""Environmental faults during a real release run: the ledger database goes away, the output disk
is full or read-only, a staged file is corrupted. Each must fail cleanly (a dpops exit code and a
message naming the cause, no traceback, nothing published from the broken attempt, no double
charge) and succeed once the fault is gone, with the same values as an uncrashed run.

Mount-based faults need root (tmpfs mounts); the PostgreSQL fault uses a database created for the
test (its connections are terminated and it is made to refuse new ones; the shared server is never
stopped).
"""

from __future__ import annotations

import errno
import os
import secrets
import subprocess
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from fault_support import (RELEASE, SLUG, check_invariants, make_env, published_table, run_cli, warm_imports)
from test_faults import MATRIX, fault_matrix, key_file, reference  # noqa: F401 - shared fixtures and matrix

pytestmark = pytest.mark.timeout(300)


def _wait_for(path: Path, done, timeout: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not path.exists():
        assert not done(), f"the run ended before reaching {path.name}"
        assert time.monotonic() < deadline, f"{path.name} never reached"
        time.sleep(0.05)


def _paused_run(env, point: str, cue: Path, action, extra_env: dict | None = None):
    """Run the release, pause it at ``point``, call ``action()`` (break something), let it go on."""
    cue.mkdir(exist_ok=True)

    def on_start(pid, done):
        _wait_for(cue / f"{point}.reached", done)
        try:
            action()
        finally:
            (cue / f"{point}.go").touch()

    return run_cli(env.run_args(), fault=f"{point}=pause", env={"DPOPS_FAULT_DIR": str(cue), **(extra_env or {})},
                   on_start=on_start)


def _clean_failure(r, code: int, *fragments: str | tuple[str, ...]) -> None:
    """Exit ``code``, no traceback, and each fragment (or one of a tuple of alternatives) in the error."""
    assert r.rc == code, f"expected exit {code}, got {r.rc}:\n{r.err[-3000:]}"
    assert not r.traceback, r.err[-3000:]
    for f in fragments:
        alts = f if isinstance(f, tuple) else (f,)
        assert any(a.lower() in r.err.lower() for a in alts), f"none of {alts} in the error:\n{r.err[-3000:]}"


def _nothing_published(env) -> None:
    assert published_table(env) is None
    assert not (env.out / "published" / RELEASE / SLUG).exists() or not any(
        p.name.startswith("v") for p in (env.out / "published" / RELEASE / SLUG).iterdir())


# --------------------------------------------------------------------------- the ledger database goes away


@pytest.fixture
def doomed_database(postgres_url):
    """A PostgreSQL database of this test only, and an admin connection that can cut it off."""
    import psycopg

    name = f"dpops_faults_{secrets.token_hex(4)}"
    admin = psycopg.connect(postgres_url, autocommit=True)
    admin.execute(f'CREATE DATABASE "{name}"')
    parts = urlsplit(postgres_url)
    url = urlunsplit(parts._replace(path=f"/{name}"))

    def cut_off() -> None:
        admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))

    def restore() -> None:
        admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')

    try:
        yield url, cut_off, restore
    finally:
        restore()
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


@pytest.mark.postgres
@pytest.mark.parametrize("point,left", [("reserve.after", "reserved"), ("manifest.after", "started")])
def test_ledger_database_goes_away_mid_run(tmp_path, doomed_database, key_file, reference, point, left):
    url, cut_off, restore = doomed_database
    env = make_env(tmp_path / "rel", url, key_file)
    r = _paused_run(env, point, tmp_path / "cue", cut_off)
    _clean_failure(r, 6, "PostgreSQL ledger")
    # while the database refuses connections, a new attempt stops before reading any data
    again = run_cli(env.run_args())
    _clean_failure(again, 6, "cannot connect to PostgreSQL ledger")
    restore()
    with env.ledger() as led:
        assert [x.state for x in led.runs(release=RELEASE)] == [left]  # the cut left the run open, not lost
    retry = run_cli(env.run_args())
    assert retry.rc == 0 and retry.json()["state"] == "published", retry.err
    summary = check_invariants(env, reference=reference)
    assert summary["charged"] == pytest.approx(1.0) and summary["versions"] == 1
    MATRIX.append((point, "db goes away", "postgresql", f"exit 6 ({left} kept) -> restored -> published once"))


# --------------------------------------------------------------------------- full and read-only output disks


@pytest.fixture
def mount_tmpfs():
    """``mount_tmpfs(dir, size, ro)``: a tmpfs over ``dir``; every mount is removed afterwards."""
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("the disk fault tests need root (tmpfs mounts) under CI=true")
        pytest.skip("needs root to mount a tmpfs")
    mounted: list[Path] = []

    def mount(path: Path, size: str = "64k", ro: bool = False) -> None:
        path.mkdir(parents=True, exist_ok=True)
        opts = f"size={size}" + (",ro" if ro else "")
        subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=True)
        mounted.append(path)

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], check=False)


def _remount(path: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True)


def _fill(folder: Path) -> Path:
    """Fill the filesystem of ``folder`` to the last byte."""
    filler = folder / "filler.bin"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    for _ in range(64):  # the last blocks: down to a single byte
        try:
            with open(folder / f"filler-{_}.bin", "wb", buffering=0) as fh:
                fh.write(b"\0")
        except OSError:
            break
    return filler


@pytest.mark.parametrize("manifests", ["same disk", "elsewhere"])
def test_full_disk_during_publish(tmp_path, mount_tmpfs, key_file, reference, manifests):
    """The disk fills between staging and publishing. With the manifests on the same disk the manifest
    write fails first; with them elsewhere (DPOPS_MANIFESTS_DIR) the copy into published/ does."""
    env = make_env(tmp_path / "rel", f"sqlite:///{tmp_path / 'ledger.sqlite'}", key_file)
    extra = {} if manifests == "same disk" else {"DPOPS_MANIFESTS_DIR": str(tmp_path / "manifests")}
    mount_tmpfs(env.out, "1m")
    r = _paused_run(env, "stage.after", tmp_path / "cue", lambda: _fill(env.out), extra)
    _clean_failure(r, 6, ("the disk is full", "no space left on device"))
    _nothing_published(env)
    # with the manifests elsewhere the ledger commit precedes the failed copy: committed, not yet visible
    check_invariants(env, settled=False)
    for f in env.out.glob("filler*.bin"):
        f.unlink()
    retry = run_cli(env.run_args(), env=extra)
    assert retry.rc == 0 and retry.json()["state"] in ("published", "already_published"), retry.err
    assert retry.json()["epsilon_charged"] == 0  # the retry reused the sealed staged output
    check_invariants(env, reference=reference)
    MATRIX.append(("publish", f"disk full ({manifests})", "sqlite",
                   f"exit 6 '{r.err.strip()[-40:]}' -> freed -> published once"))


def test_full_disk_before_the_run(tmp_path, mount_tmpfs, key_file, reference):
    """No room even for the staged output: the pipeline's write fails after noise was drawn, so the
    run stays charged (started); once space is freed the keyed retry reproduces the same output."""
    env = make_env(tmp_path / "rel", f"sqlite:///{tmp_path / 'ledger.sqlite'}", key_file)
    mount_tmpfs(env.out, "64k")
    filler = _fill(env.out)
    r = run_cli(env.run_args())
    assert r.rc == 6 and not r.traceback, r.err[-3000:]
    assert "No space left on device" in r.err or "the disk is full" in r.err, r.err[-3000:]
    _nothing_published(env)
    check_invariants(env)
    for f in env.out.glob("filler*.bin"):
        f.unlink()
    retry = run_cli(env.run_args())
    assert retry.rc == 0 and retry.json()["state"] == "published", retry.err
    check_invariants(env, reference=reference)
    MATRIX.append(("compute", "disk full", "sqlite", f"exit {r.rc} -> freed -> published once"))


def test_full_disk_inside_the_beam_job_is_a_storage_error(tmp_path, mount_tmpfs, key_file):
    env = make_env(tmp_path / "rel", f"sqlite:///{tmp_path / 'ledger.sqlite'}", key_file)
    mount_tmpfs(env.out, "64k")
    _fill(env.out)
    _clean_failure(run_cli(env.run_args()), 6, ("the disk is full",))


@pytest.mark.parametrize("manifests", ["same disk", "elsewhere"])
def test_read_only_output_during_publish(tmp_path, mount_tmpfs, key_file, reference, manifests):
    env = make_env(tmp_path / "rel", f"sqlite:///{tmp_path / 'ledger.sqlite'}", key_file)
    extra = {} if manifests == "same disk" else {"DPOPS_MANIFESTS_DIR": str(tmp_path / "manifests")}
    mount_tmpfs(env.out, "4m")
    r = _paused_run(env, "stage.after", tmp_path / "cue", lambda: _remount(env.out, "ro"), extra)
    _clean_failure(r, 6, ("read-only",))
    _nothing_published(env)
    check_invariants(env, settled=False)  # committed before the copy failed, when manifests live elsewhere
    _remount(env.out, "rw")
    retry = run_cli(env.run_args(), env=extra)
    assert retry.rc == 0 and retry.json()["state"] in ("published", "already_published"), retry.err
    check_invariants(env, reference=reference)
    MATRIX.append(("publish", f"read-only output ({manifests})", "sqlite",
                   f"exit 6 '{r.err.strip()[-40:]}' -> rw again -> published once"))


def test_read_only_output_before_the_run(tmp_path, mount_tmpfs, key_file, reference):
    """The staging directory cannot be created: the run fails before any noise, its reservation is
    refunded, and once the output is writable again the same release must go through."""
    env = make_env(tmp_path / "rel", f"sqlite:///{tmp_path / 'ledger.sqlite'}", key_file)
    mount_tmpfs(env.out, "4m", ro=True)
    r = run_cli(env.run_args())
    _clean_failure(r, 6, "read-only")
    _nothing_published(env)
    summary = check_invariants(env, recovered=True)
    assert summary["states"] == ["released"] and summary["charged"] == 0  # refunded: no noise was drawn
    _remount(env.out, "rw")
    retry = run_cli(env.run_args())
    MATRIX.append(("stage", "read-only output", "sqlite",
                   f"exit 6, refunded -> rw again -> retry exit {retry.rc}"))
    assert retry.rc == 0 and retry.json()["state"] == "published", retry.err
    check_invariants(env, reference=reference)


# --------------------------------------------------------------------------- corrupted staged output


@pytest.mark.parametrize("what", ["data.parquet", "_STAGED.json"])
def test_corrupted_staged_file_is_never_published(tmp_path, key_file, reference, what):
    env = make_env(tmp_path / "rel", f"sqlite:///{tmp_path / 'ledger.sqlite'}", key_file)
    staged = run_cli(env.run_args(publish=False))
    assert staged.rc == 0 and staged.json()["state"] == "staged", staged.err
    run_dir = next((env.out / "staged" / RELEASE / SLUG).iterdir())
    target = run_dir / what
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    target.write_bytes(bytes(data))
    r = run_cli(env.run_args())
    _clean_failure(r, 7, str(target))  # tampering/verification: IntegrityError
    _nothing_published(env)
    check_invariants(env)
    # the fault gone: the operator removes the corrupt staged output; the keyed retry recomputes the same
    # noise under the same charge and publishes it
    import shutil

    shutil.rmtree(run_dir)
    retry = run_cli(env.run_args())
    assert retry.rc == 0 and retry.json()["state"] == "published" and retry.json()["epsilon_charged"] == 0, retry.err
    check_invariants(env, reference=reference)
    MATRIX.append(("publish", f"corrupt staged {what}", "sqlite", "exit 7 naming the file -> removed -> "
                   "recomputed, same values, published once"))
