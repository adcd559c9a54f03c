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
from dpops.noise.randomness import NoiseKey

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


@pytest.mark.parametrize("payload", [hashlib.sha256(b"dpops test key").digest(),  # raw bytes, not ASCII
                                     hashlib.sha256(b"dpops test key").hexdigest().encode(),  # an old bare-hex key
                                     b"postgresql://airflow:pw@db:5432/airflow",
                                     b"ZmVybmV0LWtleS1mZXJuZXQta2V5LWZlcm5ldC1rZXk="])
def test_gcp_secret_payload_must_be_a_v1_key_file(monkeypatch, payload):
    """Issue 19 item 9: the Secret Manager provider follows the key-file rule; any other secret is refused."""
    _install_client(monkeypatch, lambda name: payload)
    with pytest.raises(InvalidParameter, match=r"noise key secret 'gcp-secret://projects/p1/.*not a dpops noise key "
                                               r"file.*dpops key convert") as err:
        keyref.GcpSecretKeyProvider().load(f"gcp-secret://{NAME}")
    assert payload.decode("latin-1") not in str(err.value)


def test_gcp_secret_weak_payload_is_refused_naming_the_reference(monkeypatch):
    weak = b"\x00" * 32
    payload = f"dpops-noise-key v1\nkey-id {NoiseKey(weak).key_id}\n{weak.hex()}\n".encode()
    _install_client(monkeypatch, lambda name: payload)
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
