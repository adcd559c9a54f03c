"""Is the published output still what was published? Fingerprint checks of the published files.

Two independent records of the published bytes exist:

* the manifest's ``output.fingerprints``: HMAC-SHA256 under the noise key (``NoiseKey.hmac``).
  Keyed, because a plain hash of a small output would let anyone holding the manifest confirm a
  guess of it (semantics.md section 5); so checking them needs the key;
* the ledger's commit entry (``details.commit.files``): the staged files' digests, written under
  the ledger's own protection. Checking a plain sha256 there needs no key.

A file edited after publication (the noise replaced by the exact values, say) would be served and
read as a DP release; every reader-facing path (``manifest verify``, ``release status``, and a
re-run that serves the interval) therefore checks the files and names the one that changed. The
messages name files only, never their content.
"""

from __future__ import annotations

import hmac as _hmac
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping
from urllib.parse import unquote, urlparse

from dpops.storage import files
from dpops.storage.location import Location, LocationError

if TYPE_CHECKING:
    from dpops.ledger import Ledger, RunRecord
    from dpops.storage import Store

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass
class FileCheck:
    """``checked``: file names compared; ``problems``: mismatches; ``not_checked``: why a check could not run."""

    checked: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def ran(self) -> bool:
        return bool(self.checked)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "checked": self.checked, "problems": self.problems, "not_checked": self.not_checked}


def uri_directory(uri: str | None) -> Location | None:
    """The location of a published ``output.uri``: a local ``file://`` directory or an object-store prefix
    (``s3://``, ``gs://``; read through ``dpops.storage.files``). None when there is no usable URI."""
    if not uri:
        return None
    u = urlparse(uri)
    if u.scheme == "file":
        if u.netloc not in ("", "localhost"):
            return None
        return Location.local(unquote(u.path))
    try:
        return Location.parse(uri)
    except LocationError:
        return None


def _safe_name(name: str) -> bool:
    # Fingerprint names are plain file names beside each other; never a path out of the directory.
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")


def _digest(path: Location, key: Any) -> str:
    if key is None:
        return files.sha256(path)
    data = files.read_bytes(path)
    assert data is not None
    return "hmac-sha256:" + key.hmac(data).hex()


def key_matches(manifest: Mapping[str, Any], key: Any) -> str | None:
    """None if ``key`` can be the run's fingerprint key, else why not (keyed runs carry the key id)."""
    kid = str(manifest["run_key"]["key_id"])
    mode = manifest["randomness"]["mode"]
    if mode == "keyed" and getattr(key, "key_id", None) is not None and kid.split("/")[0] != key.key_id:
        return (f"the noise key given (id {key.key_id}) is not the run's key (id {kid.split('/')[0]}): "
                "its keyed fingerprints cannot be checked with it")
    return None


def check_files(directory: Path | Location | None, expected: Mapping[str, str], *, key: Any = None, what: str,
                field_prefix: str) -> FileCheck:
    """Compare each file named in ``expected`` under ``directory`` with its recorded digest.

    ``key``: the fingerprint key for ``hmac-sha256:`` values (None: plain sha256 values only).
    """
    out = FileCheck()
    if directory is None:
        out.not_checked.append(f"{what}: the published location is not a file:// or object-store URI")
        return out
    directory = directory if isinstance(directory, Location) else Location.local(directory)
    try:
        reachable = files.exists(directory)
    except OSError:
        reachable = False
    if not reachable:
        out.not_checked.append(f"{what}: the published directory {directory} is not reachable from here")
        return out
    for name in sorted(expected):
        want = str(expected[name])
        keyed = want.startswith("hmac-sha256:")
        if not _safe_name(name):
            out.problems.append(f"{field_prefix}.{name}: not a plain file name; refusing to read it")
            continue
        if keyed and key is None:
            out.not_checked.append(f"{what}: {name} has a keyed fingerprint and no noise key was given (--key-file)")
            continue
        if not keyed and not _SHA256.match(want):
            out.not_checked.append(f"{what}: {name} has a digest of an unknown form")
            continue
        path = directory / name
        try:
            present = files.is_file(path)
        except OSError:
            present = False
        if not present:
            out.problems.append(f"{field_prefix}.{name}: published file {path} is missing")
            continue
        try:
            got = _digest(path, key if keyed else None)
        except OSError as exc:
            out.not_checked.append(f"{what}: cannot read {path} ({exc.strerror or type(exc).__name__})")
            continue
        out.checked.append(name)
        if not _hmac.compare_digest(got, want):
            out.problems.append(f"{field_prefix}.{name}: published file {path} changed after publication "
                                f"(its {'keyed fingerprint' if keyed else 'sha256'} differs from {what}'s)")
    return out


def check_manifest_files(manifest: Mapping[str, Any], *, key: Any = None,
                         directory: Path | Location | None = None) -> FileCheck:
    """The manifest's keyed fingerprints against the files at its ``output.uri`` (or ``directory``)."""
    out = manifest.get("output") or {}
    fps = out.get("fingerprints") or {}
    if manifest["outcome"]["state"] != "published" or not fps:
        return FileCheck(not_checked=["the manifest records no published files"])
    from dpops.keyref import key_for_record

    key = key_for_record(key, str(manifest["run_key"]["key_id"]))  # a key ring: the run's own key when it holds it
    if key is not None:
        why = key_matches(manifest, key)
        if why:
            return FileCheck(not_checked=[why])
    return check_files(directory or uri_directory(out.get("uri")), fps, key=key, what="the manifest",
                       field_prefix="output.fingerprints")


def ledger_file_digests(record: Any) -> dict[str, str]:
    """The published files' digests the ledger's commit entry recorded (empty if none)."""
    commit = ((getattr(record, "details", None) or {}).get("commit") or {}) if record is not None else {}
    files = commit.get("files") if isinstance(commit, dict) else None
    return {str(k): str(v) for k, v in files.items()} if isinstance(files, dict) else {}


def check_ledger_files(record: Any, directory: Path | Location | None, *, key: Any = None) -> FileCheck:
    """The files at ``directory`` against the ledger's commit entry of ``record``."""
    digests = ledger_file_digests(record)
    if not digests:
        return FileCheck(not_checked=["the ledger's commit entry records no file digests"])
    return check_files(directory, digests, key=key, what="the ledger's commit entry", field_prefix="ledger commit files")


def merge(*checks: FileCheck) -> FileCheck:
    out = FileCheck()
    for c in checks:
        out.checked.extend(f for f in c.checked if f not in out.checked)
        out.problems.extend(c.problems)
        out.not_checked.extend(c.not_checked)
    return out


def check_interval_pointer(store: Store, slug: str, ledger: Ledger, release: str, interval_start: str,
                           interval_end: str, *, key: Any = None) -> FileCheck:
    """Every version of the interval against the ledger's committed runs of THAT release and interval, and
    ``current`` against the newest one (``dpops.storage.published.check_published``, the one owner of the
    rule), whether or not the ledger committed any run for it: a version whose run the ledger never
    committed, a pointer moved to another version, or a binding naming another ledger is a problem naming
    the version. With the noise ``key`` each committed version's keyed binding is checked too.

    Privacy reason: readers take ``current`` as the DP release; a writer of ``published/`` who adds a
    version with exact counts (also on a day the ledger refused or never ran) and moves the pointer must
    not pass any check dpops offers (issue 25 item 10)."""
    from dpops.storage.published import check_published, committed_runs

    runs = ledger.runs(release=release, interval_start=interval_start, interval_end=interval_end,
                       states=["committed"])
    newest = ledger.published(release, interval_start, interval_end)
    res = check_published(store, slug, committed=committed_runs(runs), newest=newest.run_id if newest else None,
                          key=key, key_ids={r.run_id: r.key.key_id for r in runs}, ledger_id=ledger.ledger_id())
    # ``checked`` lists file names (callers show and compare them); the pointer adds only findings. The files
    # of the run's one version are compared with the ledger's commit entry by the callers (check_ledger_files);
    # one run is one version (check_published), so current's bytes are covered by that comparison.
    return FileCheck(problems=[f"published pointer: {p}" for p in res.problems],
                     not_checked=[f"published pointer: {p}" for p in res.not_checked])


def check_published_pointer(store: Store, slug: str, ledger: Ledger, record: RunRecord, *,
                            key: Any = None) -> FileCheck:
    """``check_interval_pointer`` for ``record``'s release and interval."""
    k = record.key
    return check_interval_pointer(store, slug, ledger, k.release, k.start_utc, k.end_utc, key=key)
