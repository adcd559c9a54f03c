"""Optional Ed25519 signatures over a manifest (``cryptography``).

The signed bytes are the canonical JSON (``dpops.events.canonical_json``: sorted
keys, no whitespace) of the manifest *without* its ``signature`` field, so the
signature does not depend on how the file is indented. ``public_key_id`` is the
first 16 hex of sha256 of the raw 32-byte public key: it tells a reviewer which
key to fetch, and nothing about the private key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from dpops.errors import IntegrityError, InvalidParameter
from dpops.events import canonical_json


def signed_bytes(manifest: dict[str, Any]) -> bytes:
    """The bytes a signature covers: the canonical JSON of the manifest without its ``signature`` field."""
    body = {k: v for k, v in manifest.items() if k != "signature"}
    return canonical_json(body).encode("utf-8")


def public_key_id(key: Ed25519PublicKey) -> str:
    """First 16 hex digits of SHA-256 of the raw public key: names the key in a signature without embedding it."""
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def generate_signing_key(private_path: str | os.PathLike[str], public_path: str | os.PathLike[str]) -> str:
    """Write a new Ed25519 key pair as PEM (private file mode 0600, never overwritten); return the public key id."""
    priv = Ed25519PrivateKey.generate()
    pem = priv.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    pub = priv.public_key()
    Path(public_path).write_bytes(
        pub.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return public_key_id(pub)


def load_private_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """Read a PEM Ed25519 private key (unencrypted); an unreadable or wrong-type file is an InvalidParameter."""
    p = Path(path)
    try:
        data = p.read_bytes()
        key = serialization.load_pem_private_key(data, password=None)
    except OSError as exc:
        raise InvalidParameter(f"cannot read signing key {p}: {exc.strerror or exc}") from None
    except (ValueError, TypeError) as exc:
        raise InvalidParameter(f"{p}: not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise InvalidParameter(f"{p}: the signing key must be Ed25519, got {type(key).__name__}")
    return key


def load_public_key(path: str | os.PathLike[str]) -> Ed25519PublicKey:
    """Read a PEM Ed25519 public key; an unreadable or wrong-type file is an InvalidParameter."""
    p = Path(path)
    try:
        key = serialization.load_pem_public_key(p.read_bytes())
    except OSError as exc:
        raise InvalidParameter(f"cannot read public key {p}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise InvalidParameter(f"{p}: not a PEM public key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise InvalidParameter(f"{p}: the public key must be Ed25519, got {type(key).__name__}")
    return key


def sign_manifest(manifest: dict[str, Any], private_key_path: str | os.PathLike[str]) -> dict[str, Any]:
    """Return a copy of ``manifest`` carrying an Ed25519 ``signature`` (sign before ``write_manifest``)."""
    key = load_private_key(private_key_path)
    sig = key.sign(signed_bytes(manifest))
    out = {k: v for k, v in manifest.items() if k != "signature"}
    out["signature"] = {
        "algorithm": "ed25519",
        "public_key_id": public_key_id(key.public_key()),
        "value": base64.b64encode(sig).decode("ascii"),
    }
    return out


def verify_signature(manifest: dict[str, Any], public_key_path: str | os.PathLike[str]) -> str:
    """Raise ``IntegrityError`` unless ``manifest`` carries a valid signature by this key; return the key id."""
    key = load_public_key(public_key_path)
    kid = public_key_id(key)
    sig = manifest.get("signature")
    if not isinstance(sig, dict):
        raise IntegrityError("signature: the manifest is not signed, but a public key was given")
    if sig.get("public_key_id") != kid:
        raise IntegrityError(
            f"signature.public_key_id: signed by key {sig.get('public_key_id')!r}, the given public key is {kid!r}"
        )
    try:
        raw = base64.b64decode(sig.get("value", ""), validate=True)
        key.verify(raw, signed_bytes(manifest))
    except (InvalidSignature, binascii.Error, ValueError):
        raise IntegrityError("signature.value: the Ed25519 signature does not match the manifest's content "
                             "(the document was changed after signing)") from None
    return kid
