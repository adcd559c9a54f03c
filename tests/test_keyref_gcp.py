"""The Secret Manager key provider (``gcp-secret://``) against a stand-in client.

There is no Secret Manager on these machines, so ``google.cloud.secretmanager`` is replaced by a
module object with the one call the provider makes (``SecretManagerServiceClient().
access_secret_version(name=...).payload.data``, the client library's documented shape). What is
tested is dpops's side: the reference is parsed, the payload is decoded and checked like a key
file, the key id matches the same key read from a file, and a client error never carries its text
(which could name more than the secret) into dpops's message.
"""

from __future__ import annotations

import hashlib
import sys
import types

import pytest

from dpops import keyref
from dpops.errors import InvalidParameter
from dpops.randomness import NoiseKey

NAME = "projects/p1/secrets/dpops-noise/versions/3"


class _Payload:
    def __init__(self, data: bytes) -> None:
        self.data = data


class _Response:
    def __init__(self, data: bytes) -> None:
        self.payload = _Payload(data)


def _install_client(monkeypatch, answer):
    """``google.cloud.secretmanager`` whose client answers ``answer(name)`` (bytes, or raises)."""
    calls: list[str] = []

    class Client:
        def access_secret_version(self, *, name):
            calls.append(name)
            return _Response(answer(name))

    google = types.ModuleType("google")
    cloud = types.ModuleType("google.cloud")
    sm = types.ModuleType("google.cloud.secretmanager")
    sm.SecretManagerServiceClient = Client
    cloud.secretmanager = sm
    google.cloud = cloud
    monkeypatch.setitem(sys.modules, "google", google)
    monkeypatch.setitem(sys.modules, "google.cloud", cloud)
    monkeypatch.setitem(sys.modules, "google.cloud.secretmanager", sm)
    return calls


def test_gcp_secret_payload_gives_the_same_key_as_the_file(tmp_path, monkeypatch):
    path = tmp_path / "noise.key"
    NoiseKey.generate(path)
    from_file = NoiseKey.from_file(path)
    calls = _install_client(monkeypatch, lambda name: path.read_bytes())  # the file's hex text as the secret
    loaded = keyref.GcpSecretKeyProvider().load(f"gcp-secret://{NAME}")
    assert calls == [NAME]
    assert loaded.key_id == from_file.key_id


def test_gcp_secret_raw_bytes_payload(monkeypatch):
    raw = hashlib.sha256(b"dpops test key").digest()  # 32 bytes that pass the entropy check, not ASCII
    _install_client(monkeypatch, lambda name: raw)
    assert keyref.GcpSecretKeyProvider().load(f"gcp-secret://{NAME}").key_id == NoiseKey(raw).key_id


def test_gcp_secret_weak_payload_is_refused_naming_the_reference(monkeypatch):
    _install_client(monkeypatch, lambda name: b"00" * 32)
    with pytest.raises(InvalidParameter, match=r"noise key secret 'gcp-secret://projects/p1/.*too little entropy"):
        keyref.GcpSecretKeyProvider().load(f"gcp-secret://{NAME}")


def test_gcp_client_error_text_is_not_repeated(monkeypatch):
    leaked = "PermissionDenied: caller sa@x may not read; payload preview deadbeefcafe"

    def deny(name):
        raise PermissionError(leaked)

    _install_client(monkeypatch, deny)
    with pytest.raises(InvalidParameter) as info:
        keyref.GcpSecretKeyProvider().load(f"gcp-secret://{NAME}")
    msg = str(info.value)
    assert "cannot be read (PermissionError)" in msg and "service account" in msg
    assert "deadbeefcafe" not in msg and "sa@x" not in msg
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_gcp_reference_shape_and_missing_package(monkeypatch):
    with pytest.raises(InvalidParameter, match="expected gcp-secret://projects/P/secrets/S/versions/V"):
        keyref.GcpSecretKeyProvider().load("gcp-secret://projects/p1/secrets/s")
    monkeypatch.setitem(sys.modules, "google.cloud.secretmanager", None)  # import fails as if not installed
    with pytest.raises(InvalidParameter, match="pip install google-cloud-secret-manager"):
        keyref.GcpSecretKeyProvider().load(f"gcp-secret://{NAME}")
