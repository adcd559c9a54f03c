"""Signed checkpoints of the ledger's chain head: an anchor kept outside the database.

The chain is an unkeyed sha256, so whoever can write the database as its owner can
rebuild every entry (a raised cap, a run charged half, a truncated history) and
recompute every hash; ``verify`` alone then passes. A checkpoint is a small JSON
file stating "this ledger had N entries and entry N had hash H", signed with an
Ed25519 key (the same signing support as manifests, ``dpops.manifest.sign``) that the
database administrator does not hold. Because each hash covers all earlier entries,
a chain that still has hash H at entry N has exactly the same first N entries; one
that does not was rewritten (or truncated) after the checkpoint.

Where they live: a directory the reviewer keeps (``DPOPS_LEDGER_CHECKPOINTS_DIR``,
recommended beside the manifests, e.g. ``<output root>/manifests/checkpoints``, and
copied to the reviewer's own storage). Files are never overwritten. They are written
by ``dpops ledger checkpoint`` and, when both ``DPOPS_LEDGER_CHECKPOINTS_DIR`` and
``DPOPS_LEDGER_CHECKPOINT_KEY`` (the private key file) are set, after every commit.

A checkpoint holds no private data: a count and a hash of entries whose content is
budget metadata only.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.exceptions import InvalidSignature

from dpops.errors import IntegrityError, InvalidParameter
from dpops.ledger.backend import redact
from dpops.ledger.model import utc_now

if TYPE_CHECKING:
    from dpops.ledger.backend import OpenLedger

log = logging.getLogger(__name__)

SCHEMA = "dpops.ledger-checkpoint/1"
DIR_ENV = "DPOPS_LEDGER_CHECKPOINTS_DIR"
KEY_ENV = "DPOPS_LEDGER_CHECKPOINT_KEY"
PUBLIC_KEY_ENV = "DPOPS_LEDGER_CHECKPOINT_PUBLIC_KEY"


def make_checkpoint(entries: int, head_hash: str, ledger_url: str, private_key_path: str | os.PathLike[str]) -> dict:
    """A signed checkpoint document for a chain of ``entries`` entries ending in ``head_hash``."""
    from dpops.manifest.sign import load_private_key, public_key_id, signed_bytes

    key = load_private_key(private_key_path)
    body = {"schema": SCHEMA, "entries": int(entries), "head_hash": str(head_hash), "created_at": utc_now(),
            "ledger": redact(ledger_url, public=True)}  # a 0644 file: no credential, no user
    sig = key.sign(signed_bytes(body))
    body["signature"] = {"algorithm": "ed25519", "public_key_id": public_key_id(key.public_key()),
                         "value": base64.b64encode(sig).decode("ascii")}
    return body


def write_checkpoint(directory: str | os.PathLike[str], doc: dict) -> Path:
    """Write ``doc`` as ``checkpoint-<entries>-<hash12>.json`` (0644; never overwrites; atomic)."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"checkpoint-{int(doc['entries']):012d}-{doc['head_hash'][:12]}.json"
    if target.exists():
        return target  # the same head was already checkpointed
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        os.chmod(tmp, 0o644)  # public: a count and a hash, meant for reviewers
        try:
            os.link(tmp, target)  # fails if it exists: never overwrite a checkpoint
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)
    return target


def checkpoint_ledger(ledger: OpenLedger, directory: str | os.PathLike[str],
                      private_key_path: str | os.PathLike[str]) -> Path:
    """Sign the ledger's current chain head (read in one snapshot) into ``directory``."""
    with ledger.snapshot() as db:
        head = db.row("SELECT last_id, last_hash FROM chain_head WHERE singleton = 1")
    return write_checkpoint(directory, make_checkpoint(int(head[0]), head[1], ledger.url, private_key_path))


def auto_checkpoint(ledger: OpenLedger) -> Path | None:
    """After a commit: checkpoint if DPOPS_LEDGER_CHECKPOINTS_DIR and DPOPS_LEDGER_CHECKPOINT_KEY are both set.

    A failure is logged, not raised: the commit is already durable, and the next checkpoint covers it.
    """
    directory, key = os.environ.get(DIR_ENV), os.environ.get(KEY_ENV)
    if not directory or not key:
        return None
    try:
        return checkpoint_ledger(ledger, directory, key)
    except Exception as exc:  # noqa: BLE001 - never fail a committed run over its checkpoint
        log.warning("could not write a ledger checkpoint to %s: %s", directory, type(exc).__name__)
        return None


@dataclass(frozen=True)
class Checkpoint:
    """One verified checkpoint file: the ledger had ``entries`` entries, the last with hash ``head_hash``."""

    source: str
    entries: int
    head_hash: str
    created_at: str
    public_key_id: str


def load_checkpoints(directory: str | os.PathLike[str], public_key_path: str | os.PathLike[str]) -> list[Checkpoint]:
    """Every ``checkpoint-*.json`` in ``directory``, each signature verified; IntegrityError names a bad file."""
    from dpops.manifest.sign import load_public_key, public_key_id, signed_bytes

    folder = Path(directory)
    if not folder.is_dir():
        raise InvalidParameter(f"checkpoints directory {folder} does not exist")
    key = load_public_key(public_key_path)
    kid = public_key_id(key)
    out = []
    for path in sorted(folder.glob("checkpoint-*.json")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise IntegrityError(f"checkpoint {path.name}: not readable JSON; restore it from the reviewer's "
                                 "copy") from None
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise IntegrityError(f"checkpoint {path.name}: not a {SCHEMA} document")
        raw_sig = doc.get("signature")
        sig = raw_sig if isinstance(raw_sig, dict) else {}
        if sig.get("public_key_id") != kid:
            raise IntegrityError(f"checkpoint {path.name}: signed by key {sig.get('public_key_id')!r}, not by the "
                                 f"given public key {kid!r}")
        try:
            key.verify(base64.b64decode(sig.get("value", ""), validate=True), signed_bytes(doc))
        except (InvalidSignature, binascii.Error, ValueError, TypeError):
            raise IntegrityError(f"checkpoint {path.name}: the Ed25519 signature does not match its content "
                                 "(the file was changed or forged)") from None
        entries, head = doc.get("entries"), doc.get("head_hash")
        if isinstance(entries, bool) or not isinstance(entries, int) or entries < 0 or not isinstance(head, str):
            raise IntegrityError(f"checkpoint {path.name}: entries/head_hash malformed")
        out.append(Checkpoint(path.name, entries, head, str(doc.get("created_at", "")), kid))
    if not out:
        raise IntegrityError(f"no checkpoint-*.json files in {folder}: nothing to check the chain against "
                             "(create one with `dpops ledger checkpoint`, or restore the reviewer's copies)")
    return out


def check_anchors(hashes: list[str], checkpoints: Iterable[Checkpoint] = (),
                  expect_heads: Iterable[str] = ()) -> list[str]:
    """Problems if the verified chain (``hashes[i]`` = hash of entry i+1) does not extend every anchor.

    An expected head is ``HASH`` (anywhere in the chain) or ``N:HASH`` (entry N has that hash).
    """
    problems = []
    for cp in checkpoints:
        if cp.entries == 0:
            continue
        if cp.entries > len(hashes):
            problems.append(f"checkpoint {cp.source} ({cp.created_at}) records {cp.entries} entries but the chain "
                            f"has only {len(hashes)}: entries were removed after the checkpoint")
        elif hashes[cp.entries - 1] != cp.head_hash:
            problems.append(f"checkpoint {cp.source} ({cp.created_at}): entry {cp.entries} has hash "
                            f"{hashes[cp.entries - 1]}, the signed checkpoint says {cp.head_hash}: the history up "
                            "to that entry was rewritten after the checkpoint")
    for spec in expect_heads:
        n_text, sep, want = spec.rpartition(":")
        if sep:
            if not n_text.isdigit() or int(n_text) < 1:
                raise InvalidParameter(f"--expect-head {spec!r}: expected HASH or N:HASH with N >= 1")
            n = int(n_text)
            if n > len(hashes) or hashes[n - 1] != want:
                problems.append(f"expected head {want} at entry {n}, the chain has "
                                + (f"{hashes[n - 1]}" if n <= len(hashes) else f"only {len(hashes)} entries"))
        elif want not in hashes:
            problems.append(f"expected head {want} is not the hash of any entry: the chain was rewritten or "
                            "truncated since it was recorded")
    return problems


def default_public_key(value: str | None) -> str | None:
    """The public key given on the command line, else ``$DPOPS_LEDGER_CHECKPOINT_PUBLIC_KEY``, else None."""
    return value or os.environ.get(PUBLIC_KEY_ENV) or None


def summary(checkpoints: list[Checkpoint]) -> dict[str, Any]:
    """Count and the newest checkpoint (most entries), for ``ledger verify`` output."""
    latest = max(checkpoints, key=lambda c: c.entries)
    return {"checkpoints": len(checkpoints), "latest": latest.source, "latest_entries": latest.entries,
            "latest_head": latest.head_hash, "public_key_id": latest.public_key_id}
