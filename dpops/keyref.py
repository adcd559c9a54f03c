"""Key references: how a worker finds the noise key without the key travelling with the job.

A run carries a *reference* to its noise key (``ComputeRequest.key_ref``), never the key: the
reference goes into the pipeline's configuration, each worker resolves it itself in
``DoFn.setup`` and checks the key id against the run's (``resolve_key_for_run``), so a worker that
sees another key never draws noise the ledger and the manifest do not describe. The key value never
enters pipeline options, the job graph, logs or a manifest, and neither does anything derived from
it except its public id.

References:

- a plain path, or ``file:PATH`` / ``file://PATH``: a key file mounted on every worker (a Kubernetes
  secret volume, a file shipped by the cluster manager). Loaded with the strict checks of
  ``NoiseKey.from_file`` (regular file, owner, mode, no symlink swap, the ``dpops-noise-key v1``
  format, entropy).
- ``gcp-secret://projects/P/secrets/S/versions/V``: Google Secret Manager. The client library
  (``google-cloud-secret-manager``) is imported only when such a reference is resolved; it is not a
  dependency of dpops and this provider is not exercised by the test suite (no Secret Manager here).

There is deliberately no environment-variable provider: a key in the environment leaks into process
listings and every child process (``dpops.release`` refuses the old variable). Other secret stores plug
in with ``register_provider(scheme, factory)``; the factory is called on first use.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Callable
from typing import Protocol

from dpops.errors import InvalidParameter
from dpops.randomness import MAX_KEY_FILE_BYTES, NoiseKey, parse_key_file

_SCHEME = re.compile(r"^(?P<scheme>[a-zA-Z][-a-zA-Z0-9+.]*):")


class KeyProvider(Protocol):
    """Loads the noise key a reference points to. Errors name the reference, never the key."""

    def load(self, ref: str) -> NoiseKey: ...


class FileKeyProvider:
    """A key file on this machine (plain path, ``file:PATH`` or ``file://PATH``)."""

    def path(self, ref: str) -> str:
        if ref.startswith("file://"):
            return ref[len("file://"):]
        if ref.startswith("file:"):
            return ref[len("file:"):]
        return ref

    def load(self, ref: str) -> NoiseKey:
        return NoiseKey.from_file(self.path(ref))


class GcpSecretKeyProvider:
    """``gcp-secret://projects/P/secrets/S/versions/V`` through Google Secret Manager (lazy import).

    The payload must be the text of a ``dpops-noise-key v1`` file (``dpops.randomness.parse_key_file``,
    the same rule as a key file: store the file ``dpops key generate`` wrote, e.g. ``gcloud secrets
    versions add S --data-file=noise_key``); any other secret is refused, never decoded as a key. There is no Secret Manager on the test machines: ``tests/test_keyref_gcp.py`` runs
    this provider against a stand-in client with the library's documented call shape."""

    _NAME = re.compile(r"^projects/[^/]+/secrets/[^/]+/versions/[^/]+$")

    def load(self, ref: str) -> NoiseKey:
        name = ref[len("gcp-secret://"):]
        if not self._NAME.match(name):
            raise InvalidParameter(f"key reference {ref!r}: expected gcp-secret://projects/P/secrets/S/versions/V")
        try:
            from google.cloud import secretmanager
        except ImportError:
            raise InvalidParameter(f"key reference {ref!r} needs the google-cloud-secret-manager package on this "
                                   "machine (pip install google-cloud-secret-manager)") from None
        try:
            data = secretmanager.SecretManagerServiceClient().access_secret_version(name=name).payload.data
        except Exception as exc:  # noqa: BLE001 - the client's error classes; its text names the secret only
            raise InvalidParameter(f"key reference {ref!r} cannot be read ({type(exc).__name__}): check the "
                                   "secret exists and this worker's service account may access it") from None
        if len(data) > MAX_KEY_FILE_BYTES:
            raise InvalidParameter(f"noise key secret {ref!r} is larger than {MAX_KEY_FILE_BYTES} bytes: it is not a "
                                   "noise key")
        return parse_key_file(bytes(data), f"noise key secret {ref!r}")


_FACTORIES: dict[str, Callable[[], KeyProvider]] = {
    "file": FileKeyProvider,
    "gcp-secret": GcpSecretKeyProvider,
}
_PROVIDERS: dict[str, KeyProvider] = {}
_LOADED: dict[tuple[str, str], NoiseKey] = {}  # (reference, key id) -> key, per process


def register_provider(scheme: str, factory: Callable[[], KeyProvider]) -> None:
    """Make ``scheme:...`` references resolve through ``factory()`` (created on first use)."""
    _FACTORIES[scheme.lower()] = factory
    _PROVIDERS.pop(scheme.lower(), None)


def scheme_of(ref: str) -> str:
    """The provider scheme of a reference: ``file`` for a plain path (also ``C:\\...``-free POSIX paths)."""
    m = _SCHEME.match(ref)
    return m.group("scheme").lower() if m and not ref.startswith("/") else "file"


def provider(ref: str) -> KeyProvider:
    s = scheme_of(ref)
    if s not in _PROVIDERS:
        factory = _FACTORIES.get(s)
        if factory is None:
            raise InvalidParameter(f"key reference {ref!r}: unknown scheme {s!r} (known: {', '.join(sorted(_FACTORIES))}"
                                   " or a plain path)")
        _PROVIDERS[s] = factory()
    return _PROVIDERS[s]


def resolve_key(ref: str) -> NoiseKey:
    """The key ``ref`` points to, loaded now (errors name the reference, never the key)."""
    if not ref:
        raise InvalidParameter("no noise key reference given (a key file path, file:PATH or gcp-secret://...)")
    return provider(ref).load(ref)


def resolve_key_for_run(ref: str, key_id: str) -> NoiseKey:
    """The run's key on a worker: resolved once per process and refused unless its id is ``key_id``."""
    if scheme_of(ref) == "file":
        from dpops.randomness import key_for_run

        return key_for_run(FileKeyProvider().path(ref), key_id)  # shares the process cache with load_key
    cached = _LOADED.get((ref, key_id))
    if cached is not None:
        return cached
    key = resolve_key(ref)
    if not hmac.compare_digest(key.key_id, str(key_id)):
        raise InvalidParameter(
            f"key reference {ref!r} holds key id {key.key_id}, but the run was prepared with key id {key_id}: every "
            "worker must see the same key (check the secret this worker can read)")
    _LOADED[(ref, key_id)] = key
    return key
