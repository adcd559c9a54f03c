"""The binding of a published version, and the one owner of "is ``current`` a version dpops published?".

Why (issue 19 item 7): ``published/`` is written by more parties than dpops (a sync job, an operator
with bucket rights, anyone who can write the product's storage). A writer of ``published/`` could add
``v2`` with the exact counts and a run id the ledger never saw, and point ``current`` at it; every check
then compared files with *their own* ``_PUBLISHED.json`` and passed. Two defences, both here:

- **Against the ledger** (``check_published`` with ``committed=``): every version's run id must be a
  run the ledger committed for this interval, and ``current`` must name the newest committed run
  (``Ledger.published``). ``release status``, served re-runs, ``manifest verify --ledger`` and the
  report all call it; a failure is an ``IntegrityError`` (exit 7) naming the version.
- **For readers without the ledger** (``check_published`` with ``committed=None``, the
  ``dpops release check-pointer`` command): each version's ``_PUBLISHED.json`` carries a *binding*
  (``dpops.published-binding/1``) over release, interval, version, run id, the ledger's commit-entry
  hash and every data file's sha256, authenticated two ways:

  - ``mac``: HMAC-SHA256 under a key derived from the noise key with its own label
    (``NoiseKey.binding_mac``; never the staging seal's key, so a seal cannot pass as a binding). Always
    present. Only holders of the noise key (the operator, the reviewer) can check it.
  - ``signature``: Ed25519 by the publisher's manifest signing key (``$DPOPS_MANIFEST_SIGNING_KEY``,
    the same key and code, ``dpops.manifest.sign``, that signs manifests) when one is configured.
    Readers verify it with the public key alone (``--public-key`` / ``$DPOPS_MANIFEST_PUBLIC_KEY``):
    this is the reader's check, since a reader must never hold the noise key.

  The reader's check refuses a ``current`` whose binding is missing or does not verify, whose files do
  not match the bound sha256, or that names an older version than another validly bound one (a moved-back
  pointer). What a reader cannot detect without the ledger: a pointer moved back to the newest *bound*
  version after a newer one was deleted as well; the ledger-side checks catch that.

Storage never imports the ledger: callers pass the committed runs as ``{run_id: commit entry hash}``.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from dpops.errors import DpopsError, IntegrityError, StorageError
from dpops.storage import files
from dpops.storage.base import PUBLISHED_FILES, PUBLISHED_MARKER, PublishedRun, Store

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

BINDING_VERSION = "dpops.published-binding/1"
SIGNING_KEY_ENV = "DPOPS_MANIFEST_SIGNING_KEY"  # the publisher's Ed25519 key: the one that signs manifests
PUBLIC_KEY_ENV = "DPOPS_MANIFEST_PUBLIC_KEY"


class BindingKey(Protocol):
    """The noise key as the binding needs it (``dpops.noise.randomness.NoiseKey``)."""

    key_id: str

    def binding_mac(self, data: bytes) -> str:
        """HMAC under the binding's derived key, ``hmac-sha256:<hex>``."""


def binding_payload(*, release: str, interval: str, version: int, run_id: str, ledger_entry_hash: str | None,
                    files: Mapping[str, str]) -> bytes:
    """The bytes the MAC and the signature cover (canonical JSON, tagged with ``BINDING_VERSION``)."""
    from dpops.events import canonical_json

    return canonical_json({"binding": BINDING_VERSION, "release": release, "interval": interval,
                           "version": int(version), "run_id": run_id, "ledger_entry_hash": ledger_entry_hash,
                           "files": dict(files)}).encode("utf-8")


def make_binding(key: object, *, release: str, interval: str, version: int, run_id: str,
                 ledger_entry_hash: str | None, files: Mapping[str, str],
                 signing_key: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The ``binding`` field of a version's ``_PUBLISHED.json``: keyed MAC, plus a signature if configured."""
    mac = getattr(key, "binding_mac", None)
    if not callable(mac):
        raise StorageError("cannot publish without the noise key: the published binding is an HMAC under a key "
                           "derived from it (pass --key-file / DPOPS_NOISE_KEY_FILE)")
    payload = binding_payload(release=release, interval=interval, version=version, run_id=run_id,
                              ledger_entry_hash=ledger_entry_hash, files=files)
    doc: dict[str, Any] = {"version": BINDING_VERSION, "release": release, "interval": interval,
                           "published_version": int(version), "run_id": run_id,
                           "ledger_entry_hash": ledger_entry_hash, "files": dict(files),
                           "key_id": getattr(key, "key_id", None), "mac": mac(payload)}
    signing_key = signing_key if signing_key is not None else (os.environ.get(SIGNING_KEY_ENV) or None)
    if signing_key:
        from dpops.manifest.sign import load_private_key, public_key_id

        priv = load_private_key(signing_key)
        doc["signature"] = {"algorithm": "ed25519", "public_key_id": public_key_id(priv.public_key()),
                            "value": base64.b64encode(priv.sign(payload)).decode("ascii")}
    return doc


@dataclass
class PointerCheck:
    """What ``check_published`` found: ``problems`` (each names a version), what ran, what could not."""

    problems: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)
    current: PublishedRun | None = None


def _marker(pub: PublishedRun) -> dict[str, Any]:
    try:
        doc = files.read_json(pub.location / PUBLISHED_MARKER)
    except (OSError, ValueError) as exc:
        raise StorageError(f"{pub.location / PUBLISHED_MARKER} is not readable JSON ({type(exc).__name__})") from None
    return doc if isinstance(doc, dict) else {}


def _load_public_key(public_key: str | os.PathLike[str] | Ed25519PublicKey) -> Ed25519PublicKey:
    if isinstance(public_key, (str, os.PathLike)):
        from dpops.manifest.sign import load_public_key

        return load_public_key(public_key)
    return public_key


def check_binding(pub: PublishedRun, *, release: str, interval: str, key: object = None,
                  public_key: str | os.PathLike[str] | Ed25519PublicKey | None = None) -> tuple[list[str], str | None]:
    """Check one version's binding against its own name and files; return (problems, bound ledger entry hash).

    Missing binding, a field that differs from the version it sits in, a file whose sha256 differs, a
    MAC that does not verify under ``key``, or (with ``public_key``) a missing or bad signature: each is a
    problem naming the version."""
    where = f"v{pub.version} ({pub.location})"
    b = _marker(pub).get("binding")
    if not isinstance(b, dict) or b.get("version") != BINDING_VERSION:
        return [f"{where}: its _PUBLISHED.json carries no {BINDING_VERSION} binding: not a version dpops "
                "published (or published by a dpops older than the binding)"], None
    out: list[str] = []
    for name, want in (("release", release), ("interval", interval), ("published_version", pub.version),
                       ("run_id", pub.run_id)):
        if b.get(name) != want:
            out.append(f"{where}: the binding names {name} {b.get(name)!r}, the version is {want!r}")
    bound = b.get("files")
    if not isinstance(bound, dict) or set(bound) != set(PUBLISHED_FILES):
        out.append(f"{where}: the binding does not list the files {', '.join(PUBLISHED_FILES)}")
        bound = {}
    for name in PUBLISHED_FILES:
        try:
            got = files.sha256(pub.location / name)
        except OSError as exc:
            out.append(f"{where}: {name} is unreadable ({type(exc).__name__})")
            continue
        if name in bound and not hmac.compare_digest(got, str(bound[name])):
            out.append(f"{where}: {name} does not match the sha256 the binding names (the file was changed)")
    entry = b.get("ledger_entry_hash")
    payload = binding_payload(release=release, interval=interval, version=pub.version, run_id=pub.run_id,
                              ledger_entry_hash=entry if isinstance(entry, str) else None, files=bound)
    if key is not None:
        mac = getattr(key, "binding_mac", None)
        if not callable(mac):
            raise StorageError("the key given cannot check a published binding (not a dpops noise key)")
        if b.get("key_id") != getattr(key, "key_id", None):
            out.append(f"{where}: bound under key {b.get('key_id')!r}, the given noise key is "
                       f"{getattr(key, 'key_id', None)!r}")
        elif not hmac.compare_digest(str(b.get("mac", "")), mac(payload)):
            out.append(f"{where}: the binding's MAC does not verify under the noise key: the version or its "
                       "_PUBLISHED.json was written without the key (forged or edited)")
    if public_key is not None:
        from cryptography.exceptions import InvalidSignature

        from dpops.manifest.sign import public_key_id

        pk = _load_public_key(public_key)
        sig = b.get("signature")
        if not isinstance(sig, dict):
            out.append(f"{where}: the binding is not signed, but a public key was given (the publisher signs "
                       f"with ${SIGNING_KEY_ENV})")
        elif sig.get("public_key_id") != public_key_id(pk):
            out.append(f"{where}: the binding is signed by key {sig.get('public_key_id')!r}, the given public key "
                       f"is {public_key_id(pk)!r}")
        else:
            try:
                pk.verify(base64.b64decode(str(sig.get("value", "")), validate=True), payload)
            except (InvalidSignature, binascii.Error, ValueError):
                out.append(f"{where}: the binding's Ed25519 signature does not verify: the version or its "
                           "_PUBLISHED.json was not written by the publisher (forged or edited)")
    return out, entry if isinstance(entry, str) else None


def check_published(store: Store, interval_slug: str, *, committed: Mapping[str, str] | None,
                    newest: str | None = None, key: object = None,
                    public_key: str | os.PathLike[str] | Ed25519PublicKey | None = None,
                    key_ids: Mapping[str, str] | None = None) -> PointerCheck:
    """Is every version of the interval one dpops published, and does ``current`` name the right one?

    ``committed``: the ledger's committed runs of this release and interval, ``{run_id: commit entry
    hash}``, and ``newest`` the newest of them (``Ledger.published``): every version's run must be in it,
    ``current`` must name ``newest``, and (with ``key``) each committed version's binding must verify and
    bind that entry hash. ``committed=None`` is the reader's check (no ledger): ``current``'s binding must
    verify under ``key`` or ``public_key`` (one is required) and no newer version may carry a valid one.
    ``key_ids`` (ledger path): ``{run_id: noise key id}`` the ledger recorded for each committed run; a version
    bound under its run's own recorded key, which is not ``key`` (a rotation since), is "not checked", not a
    problem: the ledger, not the version's own marker, vouches for that key id."""
    res = PointerCheck()
    rel = store.release
    try:
        versions = store.versions(interval_slug)
        res.current = cur = store.current(interval_slug)
    except DpopsError as exc:
        res.problems.append(f"the published versions or the current pointer cannot be read: {exc}")
        return res
    if committed is not None:
        res.checked.append("versions against the ledger")
        seen: dict[str, PublishedRun] = {}
        for v in versions:
            if v.run_id in seen:  # a copy of a committed run's version under another number: only one is dpops'
                res.problems.append(f"v{v.version} ({v.location}) and v{seen[v.run_id].version} both claim run "
                                    f"{v.run_id}: a run is published as one version only; one of them is forged")
            seen[v.run_id] = v
            if v.run_id not in committed:
                res.problems.append(f"v{v.version} ({v.location}): run {v.run_id!r} is not committed in the ledger "
                                    "for this interval: a version no dpops publish made (forged, or copied from "
                                    "elsewhere)")
        if cur is None:
            if newest is not None:
                res.not_checked.append(f"no current pointer yet: committed run {newest} is not visible (a retry "
                                       "or a served re-run completes the publish)")
        elif newest is None or cur.run_id != newest:
            res.problems.append(f"current names v{cur.version} (run {cur.run_id}), but the newest committed run "
                                f"of the interval is {newest or 'none'}: the pointer was moved by someone other "
                                "than dpops")
        if key is not None or public_key is not None:
            res.checked.append("published bindings")
            for v in versions:
                if v.run_id not in committed:
                    continue
                bound_key = (_marker(v).get("binding") or {}).get("key_id") if key is not None else None
                if (key is not None and key_ids is not None and bound_key != getattr(key, "key_id", None)
                        and bound_key == key_ids.get(v.run_id, "").split("/")[0]):  # "<id>/retry-N": same key
                    # A key rotation (runbook "Key rotation"): the ledger records that this run used the key
                    # its binding names, so the version is not forged by a key-id mismatch; the given key just
                    # cannot check its MAC. Reported as not checked (the keyless ledger checks above still hold),
                    # as the keyed fingerprints of such a run are; give the old key to check it fully.
                    res.not_checked.append(f"v{v.version} ({v.location}): bound under the run's own key "
                                           f"{bound_key!r} (the ledger's record), the given noise key is "
                                           f"{getattr(key, 'key_id', None)!r}: its MAC cannot be checked with it")
                    continue
                problems, entry = check_binding(v, release=rel, interval=interval_slug, key=key,
                                                public_key=public_key)
                if entry is None and len(problems) == 1 and "carries no" in problems[0]:
                    res.not_checked.append(problems[0])  # the ledger checks above still hold for it
                    continue
                res.problems.extend(problems)
                if not problems and entry != committed[v.run_id]:
                    res.problems.append(f"v{v.version} ({v.location}): the binding names ledger entry {entry}, the "
                                        f"ledger's commit entry of run {v.run_id} is {committed[v.run_id]}")
        # Without a key the ledger checks above are complete on their own (the binding adds the keyed
        # proof for readers); no "not checked" note, so a keyless verification is not reported as partial.
        return res
    if key is None and public_key is None:
        raise StorageError("checking the current pointer without the ledger needs the publisher's public key "
                           f"(--public-key / ${PUBLIC_KEY_ENV}) or the noise key")
    if cur is None:
        res.problems.append(f"{store.published_interval_location(interval_slug)} has no current pointer: "
                            "nothing is published")
        return res
    res.checked.append(f"current (v{cur.version}) binding")
    problems, _ = check_binding(cur, release=rel, interval=interval_slug, key=key, public_key=public_key)
    res.problems.extend(problems)
    for v in versions:
        if v.version > cur.version and not check_binding(v, release=rel, interval=interval_slug, key=key,
                                                         public_key=public_key)[0]:
            res.problems.append(f"current names v{cur.version}, but v{v.version} ({v.location}) is a newer validly "
                                "bound version: the pointer was moved back")
    return res


def verified_current(store: Store, interval_slug: str, *, key: object = None,
                     public_key: str | os.PathLike[str] | Ed25519PublicKey | None = None) -> PublishedRun:
    """``store.current()`` for readers: the version ``current`` names, only if its binding verifies under
    ``public_key`` (the publisher's signature) or ``key``; else an ``IntegrityError`` naming the version."""
    res = check_published(store, interval_slug, committed=None, key=key, public_key=public_key)
    if res.problems or res.current is None:
        raise IntegrityError(f"{store.release} {interval_slug}: the current pointer does not name a version dpops "
                             "published: " + "; ".join(res.problems or ["nothing is published"]))
    return res.current


class LedgerRun(Protocol):
    """What ``committed_runs`` reads of a ledger run (``dpops.ledger.RunRecord``)."""

    run_id: str
    state: str
    entry_hashes: list[str]


def committed_runs(records: Iterable[LedgerRun]) -> dict[str, str]:
    """``{run_id: commit entry hash}`` of the committed runs (a committed run's last entry is its commit)."""
    return {r.run_id: r.entry_hashes[-1] for r in records if r.state == "committed" and r.entry_hashes}


__all__ = ["BINDING_VERSION", "BindingKey", "PointerCheck", "binding_payload", "make_binding", "check_binding",
           "check_published", "verified_current", "committed_runs", "LedgerRun", "SIGNING_KEY_ENV", "PUBLIC_KEY_ENV"]
