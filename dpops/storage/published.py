"""The binding of a published version, and the one owner of "is ``current`` a version dpops published?".

Why (issue 19 item 7): ``published/`` is written by more parties than dpops (a sync job, an operator
with bucket rights, anyone who can write the product's storage). A writer of ``published/`` could add
``v2`` with the exact counts and a run id the ledger never saw, and point ``current`` at it; every check
then compared files with *their own* ``_PUBLISHED.json`` and passed. Two defences, both here:

- **Against the ledger** (``check_published`` with ``committed=``): every version's run id must be a
  run the ledger committed for this interval, and ``current`` must name the newest committed run
  (``Ledger.published``). ``release status``, served re-runs, ``manifest verify --ledger`` and the
  report all call it; a failure is an ``IntegrityError`` (exit 7) naming the version.
  The ledger check runs for every interval, whether or not the ledger committed a run for it: a
  version on a never-committed interval is a forgery like any other (issue 25 item 10).
- **For readers without the ledger** (``check_published`` with ``committed=None``, the
  ``dpops release check-pointer`` command): each version's ``_PUBLISHED.json`` carries a *binding*
  over release, interval, version, run id, the ledger's commit-entry hash and every data file's sha256,
  and (``dpops.published-binding/2``, issue 25 item 10) the output root as configured
  (``Location.uri``) and the ledger's id (``Ledger.ledger_id``: its genesis entry hash), so a version
  signed by another deployment that shares the signing key names another root or ledger and fails.
  Versions bound by an older dpops (``dpops.published-binding/1``, no root or ledger) still verify;
  the reader's check lists them as "not checked" for root and ledger, and a reader that pins the
  ledger id refuses them (a /1 binding cannot say which ledger committed it). The binding is
  authenticated two ways:

  - ``mac``: HMAC-SHA256 under a key derived from the noise key with its own label
    (``NoiseKey.binding_mac``; never the staging seal's key, so a seal cannot pass as a binding). Always
    present. Only holders of the noise key (the operator, the reviewer) can check it.
  - ``signature``: Ed25519 by the publisher's manifest signing key (``$DPOPS_MANIFEST_SIGNING_KEY``,
    the same key and code, ``dpops.manifest.sign``, that signs manifests) when one is configured.
    Readers verify it with the public key alone (``--public-key`` / ``$DPOPS_MANIFEST_PUBLIC_KEY``):
    this is the reader's check, since a reader must never hold the noise key.

  The reader's check refuses a ``current`` whose binding is missing or does not verify, whose files do
  not match the bound sha256, or that names an older version than any other version of the interval,
  valid or not (a moved-back pointer: damaging the newer version must not make the older pointer pass).
  What a reader cannot detect without the ledger: a pointer moved back after the newer version was
  deleted outright; the ledger-side checks catch that.

Storage never imports the ledger: callers pass the committed runs as ``{run_id: commit entry hash}``.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from dpops.errors import DpopsError, IntegrityError, StorageError
from dpops.storage import files
from dpops.storage.base import PUBLISHED_FILES, PUBLISHED_MARKER, PublishedRun, Store

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

BINDING_VERSION = "dpops.published-binding/2"  # what publish writes: names the output root and the ledger id
BINDING_VERSION_1 = "dpops.published-binding/1"  # older versions: still verified (no root, no ledger id)
BINDING_VERSIONS = (BINDING_VERSION_1, BINDING_VERSION)
LEDGER_ID_ENV = "DPOPS_LEDGER_ID"  # a reader's pin: the ledger id versions must be bound to
SIGNING_KEY_ENV = "DPOPS_MANIFEST_SIGNING_KEY"  # the publisher's Ed25519 key: the one that signs manifests
PUBLIC_KEY_ENV = "DPOPS_MANIFEST_PUBLIC_KEY"


class BindingKey(Protocol):
    """The noise key as the binding needs it (``dpops.noise.randomness.NoiseKey``)."""

    key_id: str

    def binding_mac(self, data: bytes) -> str:
        """HMAC under the binding's derived key, ``hmac-sha256:<hex>``."""


def binding_payload(*, release: str, interval: str, version: int, run_id: str, ledger_entry_hash: str | None,
                    files: Mapping[str, str], output_root: str | None = None, ledger_id: str | None = None,
                    binding: str = BINDING_VERSION) -> bytes:
    """The bytes the MAC and the signature cover (canonical JSON, tagged with the binding version).

    ``binding`` /1 covers exactly what dpops wrote before /2 (so old versions keep verifying); /2 adds
    ``output_root`` and ``ledger_id``."""
    from dpops.events import canonical_json

    doc: dict[str, Any] = {"binding": binding, "release": release, "interval": interval,
                           "version": int(version), "run_id": run_id, "ledger_entry_hash": ledger_entry_hash,
                           "files": dict(files)}
    if binding != BINDING_VERSION_1:
        doc.update(output_root=output_root, ledger_id=ledger_id)
    return canonical_json(doc).encode("utf-8")


def make_binding(key: object, *, release: str, interval: str, version: int, run_id: str,
                 ledger_entry_hash: str | None, files: Mapping[str, str], output_root: str,
                 ledger_id: str | None, signing_key: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The ``binding`` field of a version's ``_PUBLISHED.json``: keyed MAC, plus a signature if configured.

    ``output_root`` is the store's root as configured (``Location.uri``) and ``ledger_id`` the committing
    ledger's id (``Ledger.ledger_id``): both are covered, so the version cannot pass as another
    deployment's (or another deployment's as this one's) under a shared key."""
    mac = getattr(key, "binding_mac", None)
    if not callable(mac):
        raise StorageError("cannot publish without the noise key: the published binding is an HMAC under a key "
                           "derived from it (pass --key-file / DPOPS_NOISE_KEY_FILE)")
    payload = binding_payload(release=release, interval=interval, version=version, run_id=run_id,
                              ledger_entry_hash=ledger_entry_hash, files=files, output_root=output_root,
                              ledger_id=ledger_id)
    doc: dict[str, Any] = {"version": BINDING_VERSION, "release": release, "interval": interval,
                           "published_version": int(version), "run_id": run_id,
                           "ledger_entry_hash": ledger_entry_hash, "files": dict(files),
                           "output_root": output_root, "ledger_id": ledger_id,
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


def binding_version(pub: PublishedRun) -> str | None:
    """The binding format of a version's ``_PUBLISHED.json`` (one of ``BINDING_VERSIONS``), else None."""
    try:
        b = _marker(pub).get("binding")
    except StorageError:
        return None
    v = b.get("version") if isinstance(b, dict) else None
    return v if v in BINDING_VERSIONS else None


def check_binding(pub: PublishedRun, *, release: str, interval: str, key: object = None,
                  public_key: str | os.PathLike[str] | Ed25519PublicKey | None = None,
                  output_root: str | None = None, ledger_id: str | None = None) -> tuple[list[str], str | None]:
    """Check one version's binding against its own name and files; return (problems, bound ledger entry hash).

    Missing binding, a field that differs from the version it sits in, a file whose sha256 differs, a
    MAC that does not verify under ``key``, or (with ``public_key``) a missing or bad signature: each is a
    problem naming the version. A /2 binding must also name ``output_root`` (the store's root as
    configured) and, when given, ``ledger_id``; a /1 binding names neither and is refused only when a
    ``ledger_id`` is required (the caller pins one): it cannot say which ledger committed it."""
    where = f"v{pub.version} ({pub.location})"
    try:
        b = _marker(pub).get("binding")
    except StorageError as exc:
        return [f"{where}: {exc}: a damaged version"], None
    if not isinstance(b, dict) or b.get("version") not in BINDING_VERSIONS:
        return [f"{where}: its _PUBLISHED.json carries no {BINDING_VERSION} binding: not a version dpops "
                "published (or published by a dpops older than the binding)"], None
    from dpops.keyref import key_for_record

    key = key_for_record(key, b.get("key_id"))  # type: ignore[arg-type]  # a key ring: the key the binding names
    out: list[str] = []
    wants: list[tuple[str, object]] = [("release", release), ("interval", interval),
                                       ("published_version", pub.version), ("run_id", pub.run_id)]
    fmt = str(b["version"])
    if fmt != BINDING_VERSION_1:
        if output_root is not None:
            wants.append(("output_root", output_root))
        if ledger_id is not None:
            wants.append(("ledger_id", ledger_id))
    elif ledger_id is not None:
        out.append(f"{where}: its binding ({BINDING_VERSION_1}, written by an older dpops) names no ledger, and "
                   f"ledger {ledger_id} is required: check it against the ledger (dpops release status)")
    for name, want in wants:
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
                              ledger_entry_hash=entry if isinstance(entry, str) else None, files=bound,
                              output_root=b.get("output_root"), ledger_id=b.get("ledger_id"), binding=fmt)
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


_ANY_VERSION_NAME = re.compile(r"^v0*(\d+)(?:-[A-Za-z0-9_-]{1,128})?$")  # v3 (local), v0003-<run> (object store)


def root_uri(store: Store) -> str:
    """The store's output root as configured, as the binding names it (``Location.uri``)."""
    root = getattr(store, "root_location", None)
    if root is None:
        raise StorageError(f"{type(store).__name__} has no root location to bind a published version to")
    return str(root.uri)


def _version_numbers_on_storage(store: Store, interval_slug: str) -> dict[int, str]:
    """Every version-named entry under the interval, complete or not: ``{number: name}`` (highest name wins).

    ``store.versions`` lists only versions with a readable ``_PUBLISHED.json``; a newer version whose marker
    was damaged or deleted must still count as newer, or damaging it would make a moved-back pointer pass."""
    out: dict[int, str] = {}
    for name in files.list_dir(store.published_interval_location(interval_slug)):
        m = _ANY_VERSION_NAME.match(name)
        if m:
            out[int(m.group(1))] = name
    return out


def check_published(store: Store, interval_slug: str, *, committed: Mapping[str, str] | None,
                    newest: str | None = None, key: object = None,
                    public_key: str | os.PathLike[str] | Ed25519PublicKey | None = None,
                    key_ids: Mapping[str, str] | None = None, ledger_id: str | None = None) -> PointerCheck:
    """Is every version of the interval one dpops published, and does ``current`` name the right one?

    ``committed``: the ledger's committed runs of this release and interval, ``{run_id: commit entry
    hash}``, and ``newest`` the newest of them (``Ledger.published``): every version's run must be in it,
    ``current`` must name ``newest``, and (with ``key``) each committed version's binding must verify and
    bind that entry hash. ``committed=None`` is the reader's check (no ledger): ``current``'s binding must
    verify under ``key`` or ``public_key`` (one is required) and no newer version may carry a valid one.
    ``key_ids`` (ledger path): ``{run_id: noise key id}`` the ledger recorded for each committed run; a version
    bound under its run's own recorded key, which is not ``key`` (a rotation since), is "not checked", not a
    problem: the ledger, not the version's own marker, vouches for that key id.
    ``ledger_id``: the ledger the versions must be bound to (``Ledger.ledger_id``; on the reader's path a
    pin such as ``$DPOPS_LEDGER_ID``); a /2 binding must also name this store's root (``root_uri``)."""
    res = PointerCheck()
    rel = store.release
    root = root_uri(store)
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
            from dpops.keyref import key_for_record

            for v in versions:
                if v.run_id not in committed:
                    continue
                bound_key = (_marker(v).get("binding") or {}).get("key_id") if key is not None else None
                # A key ring (issue 28 item 11): each version is checked with the key its own run used, when the
                # ring holds it (the ledger's record below still decides whether that key is the run's).
                vkey = key_for_record(key, key_ids.get(v.run_id) if key_ids else bound_key)  # type: ignore[arg-type]
                if (vkey is not None and key_ids is not None and bound_key != getattr(vkey, "key_id", None)
                        and bound_key == key_ids.get(v.run_id, "").split("/")[0]):  # "<id>/retry-N": same key
                    # A key rotation (runbook "Key rotation"): the ledger records that this run used the key
                    # its binding names, so the version is not forged by a key-id mismatch; the given key just
                    # cannot check its MAC. Reported as not checked (the keyless ledger checks above still hold),
                    # as the keyed fingerprints of such a run are; give the old key to check it fully.
                    res.not_checked.append(f"v{v.version} ({v.location}): bound under the run's own key "
                                           f"{bound_key!r} (the ledger's record), the given noise key is "
                                           f"{getattr(vkey, 'key_id', None)!r}: its MAC cannot be checked with it")
                    continue
                problems, entry = check_binding(v, release=rel, interval=interval_slug, key=vkey,
                                                public_key=public_key, output_root=root, ledger_id=None)
                if ledger_id is not None and binding_version(v) == BINDING_VERSION:
                    bound_ledger = (_marker(v).get("binding") or {}).get("ledger_id")
                    if bound_ledger != ledger_id:
                        problems.append(f"v{v.version} ({v.location}): the binding names ledger {bound_ledger!r}, "
                                        f"this ledger is {ledger_id!r}: a version committed in another ledger")
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
    problems, _ = check_binding(cur, release=rel, interval=interval_slug, key=key, public_key=public_key,
                                output_root=root, ledger_id=ledger_id)
    res.problems.extend(problems)
    if binding_version(cur) == BINDING_VERSION_1 and ledger_id is None:
        res.not_checked.append(f"v{cur.version}: bound by an older dpops ({BINDING_VERSION_1}): the binding names no "
                               "output root or ledger, so a copy from another deployment sharing the key cannot be "
                               "told apart here; dpops release status (with the ledger) can")
    elif ledger_id is None:
        res.not_checked.append(f"the ledger id (no pin: --ledger-id / ${LEDGER_ID_ENV}); the output root was checked")
    # Any newer version, valid or damaged, means current was moved back (or a publish is incomplete: a retry
    # completes it): a damaged newer version is a failure, never a reason to accept the older pointer.
    for number, name in sorted(_version_numbers_on_storage(store, interval_slug).items()):
        if number > cur.version:
            res.problems.append(f"current names v{cur.version}, but a newer version v{number} ({name}) exists: the "
                                "pointer was moved back (or the newer version was damaged to hide it)")
    return res


def verified_current(store: Store, interval_slug: str, *, key: object = None,
                     public_key: str | os.PathLike[str] | Ed25519PublicKey | None = None,
                     ledger_id: str | None = None) -> PublishedRun:
    """``store.current()`` for readers: the version ``current`` names, only if its binding verifies under
    ``public_key`` (the publisher's signature) or ``key`` and names this store's root (and ``ledger_id``,
    default ``$DPOPS_LEDGER_ID``, when pinned); else an ``IntegrityError`` naming the version."""
    res = check_published(store, interval_slug, committed=None, key=key, public_key=public_key,
                          ledger_id=ledger_id or os.environ.get(LEDGER_ID_ENV) or None)
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


__all__ = ["BINDING_VERSION", "BINDING_VERSION_1", "BINDING_VERSIONS", "LEDGER_ID_ENV", "binding_version", "root_uri",
           "BindingKey", "PointerCheck", "binding_payload", "make_binding", "check_binding",
           "check_published", "verified_current", "committed_runs", "LedgerRun", "SIGNING_KEY_ENV", "PUBLIC_KEY_ENV"]
