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

Which key (issue 19 item 9): the operator pins the expected key id in the deployment,
``DPOPS_NOISE_KEY_ID`` (``check_pinned_key_id``; a run whose key has another id is refused before anything
is reserved), and a run whose key id differs from the last run of its scope is refused unless the pin names
the new id, which is how a rotation is declared (``dpops.release.key_continuity``, docs/runbook.md "Key
rotation"). A key reference chosen in orchestrator metadata (the Airflow Variable ``dpops_noise_key_ref``) must
resolve under the operator's key directory ``DPOPS_KEY_DIR`` (``key_ref_under_key_dir``), never any path.

After a rotation (issue 28 items 3 and 11) the keys of earlier rotations are a ``KeyRing``: checks
(``manifest verify``, ``release status``, ``report``) use, for each manifest and each published version, the
key whose id its record names, so one report checks every file of a month across rotations; and a re-run of
an interval published under an old key compares the input under that key (``dpops.release.reservation``),
so an unchanged file is served instead of being taken for a changed one. Previous keys are files, named
by ``--previous-key-file`` (repeatable) or ``$DPOPS_PREVIOUS_NOISE_KEY_FILES`` (paths separated by
``os.pathsep``), each loaded with ``NoiseKey.from_file``'s checks; they never key new noise.

There is deliberately no environment-variable provider: a key in the environment leaks into process
listings and every child process (``dpops.release`` refuses the old variable). Other secret stores plug
in with ``register_provider(scheme, factory)``; the factory is called on first use.
"""

from __future__ import annotations

import hmac
import os
import re
from collections.abc import Callable
from typing import Protocol

from dpops.errors import InvalidParameter
from dpops.noise.randomness import MAX_KEY_FILE_BYTES, NoiseKey, parse_key_file

KEY_ID_ENV = "DPOPS_NOISE_KEY_ID"
KEY_DIR_ENV = "DPOPS_KEY_DIR"
_KEY_ID = re.compile(r"^[0-9a-f]{16}$")
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

    The payload must be the text of a ``dpops-noise-key v1`` file (``dpops.noise.randomness.parse_key_file``,
    the same rule as a key file: store the file ``dpops key generate`` wrote, e.g. ``gcloud secrets
    versions add S --data-file=noise_key``); any other secret is refused, never decoded as a key.
    There is no Secret Manager on the test machines: ``tests/test_keyref_gcp.py`` runs this provider
    against a stand-in client with the library's documented call shape."""

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
        from dpops.noise.randomness import key_for_run

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


PREVIOUS_KEYS_ENV = "DPOPS_PREVIOUS_NOISE_KEY_FILES"


def noise_key_id(recorded: str) -> str | None:
    """The noise key id in a run key's key id: ``<id>`` or ``<id>/retry-N`` in keyed mode; None for
    ``os/attempt-N`` (os mode: the ledger does not record which key fingerprinted it) and ``test/...``."""
    head = str(recorded).split("/", 1)[0]
    return None if head in ("os", "test") else head


class KeyRing:
    """The current noise key (may be absent: a reviewer holding only old keys) and the keys of earlier
    rotations, by id. Only ``current`` ever keys noise; the others only check what was made under them."""

    __slots__ = ("current", "_by_id")

    def __init__(self, current: NoiseKey | None, previous: tuple[NoiseKey, ...] = ()) -> None:
        self.current = current
        self._by_id: dict[str, NoiseKey] = {k.key_id: k for k in previous}
        if current is not None:
            self._by_id[current.key_id] = current

    @classmethod
    def load(cls, current_path: str | None, previous_paths: tuple[str, ...] | list[str] = ()) -> KeyRing:
        """Each file through ``NoiseKey.from_file`` (the same checks as the current key's)."""
        current = NoiseKey.from_file(current_path) if current_path else None
        return cls(current, tuple(NoiseKey.from_file(p) for p in previous_paths if p))

    def for_id(self, key_id: str | None) -> NoiseKey | None:
        """The key with this id (a run key's recorded id, ``<id>/retry-N`` accepted), or None."""
        kid = noise_key_id(key_id) if key_id else None
        return self._by_id.get(kid) if kid else None

    def key_for(self, recorded_key_id: str | None) -> NoiseKey | None:
        """The key to check a record made under ``recorded_key_id`` with: that key if the ring holds it, else the
        current one (whose checks then say "not the run's key", never a failure)."""
        return self.for_id(recorded_key_id) or self.current

    @property
    def ids(self) -> list[str]:
        return sorted(self._by_id)

    def __repr__(self) -> str:
        return f"KeyRing(current={getattr(self.current, 'key_id', None)!r}, ids={self.ids!r})"


def previous_key_paths(env: dict[str, str] | None = None) -> tuple[str, ...]:
    """``$DPOPS_PREVIOUS_NOISE_KEY_FILES``: the previous keys' files, separated by ``os.pathsep``."""
    raw = (os.environ if env is None else env).get(PREVIOUS_KEYS_ENV, "")
    return tuple(p for p in (x.strip() for x in raw.split(os.pathsep)) if p)


def key_for_record(key: NoiseKey | KeyRing | None, recorded_key_id: str | None) -> NoiseKey | None:
    """What a check made under ``recorded_key_id`` is checked with, given one key or a ring."""
    if isinstance(key, KeyRing):
        return key.key_for(recorded_key_id)
    return key


def pinned_key_id() -> str | None:
    """The key id the operator pinned in the deployment (``$DPOPS_NOISE_KEY_ID``), or None when unset."""
    raw = os.environ.get(KEY_ID_ENV, "").strip()
    if not raw:
        return None
    if not _KEY_ID.match(raw):
        raise InvalidParameter(f"${KEY_ID_ENV} must be a key id (16 lower-case hex digits, as `dpops key id PATH` "
                               "prints it); fix the operator setting; nothing was reserved")
    return raw


def check_pinned_key_id(key_id: str, ref: str | None) -> None:
    """Refuse a key whose id is not the operator's pin: a reference pointed at another file (by whoever can
    edit a Variable or a task's arguments) must not become the key a release is published under."""
    pinned = pinned_key_id()
    if pinned is not None and not hmac.compare_digest(pinned, str(key_id)):
        raise InvalidParameter(
            f"key reference {ref!r} holds key id {key_id}, but the operator pinned ${KEY_ID_ENV}={pinned}: "
            "point the reference at the pinned key, or (a rotation) set the pin to the new id in the deployment; "
            "nothing was reserved")


def key_ref_under_key_dir(name: str, setting: str) -> str:
    """The key file a reference from orchestrator metadata (``setting``, e.g. an Airflow Variable) names: an
    absolute path (or ``file:``/``file://`` reference) that resolves, after symlinks, below the operator's
    ``$DPOPS_KEY_DIR``. Anything else is refused (a relative value is most likely the key itself pasted in
    the wrong place, and is never shown).

    Privacy reason: whoever can edit the Variable must not be able to make the task load any readable
    file as the noise key (the Airflow DB URL, the Fernet key): the directory is fixed by the deployment,
    which a Variable editor cannot change. Errors name the setting and the directory, never the value
    (it may be a key pasted in the wrong place)."""
    root_raw = os.environ.get(KEY_DIR_ENV, "").strip()
    if not root_raw or not os.path.isabs(root_raw):
        raise InvalidParameter(
            f"{setting} names a noise key, but the operator's key directory ${KEY_DIR_ENV} is "
            f"{'not an absolute path' if root_raw else 'unset'}: set it in the deployment (the directory the "
            "key secrets are mounted in, e.g. /run/secrets) or unset the setting and use $DPOPS_NOISE_KEY_FILE; "
            "nothing was reserved")
    ref = name.strip()
    path = FileKeyProvider().path(ref) if scheme_of(ref) == "file" else ""
    if ref.startswith("file://"):
        from urllib.parse import unquote, urlparse

        path = unquote(urlparse(ref).path)
    if ref.startswith("gcp-secret:"):
        raise InvalidParameter(
            f"{setting} must name a key file under the operator's key directory ${KEY_DIR_ENV} ({root_raw}); a "
            "secret-manager reference is configured by the operator ($DPOPS_NOISE_KEY_FILE), not in orchestrator "
            "metadata; nothing was reserved")
    if not os.path.isabs(path):
        raise InvalidParameter(
            f"{setting} must be the absolute path (or file:// URI) of a key file under the operator's key directory "
            f"${KEY_DIR_ENV} ({root_raw}), never the key itself; its value is not shown. If the key was stored there, "
            "rotate it (dpops key generate PATH) and store only the path; nothing was reserved")
    root = os.path.realpath(root_raw)
    full = os.path.realpath(path)
    if os.path.commonpath([root, full]) != root or full == root:
        raise InvalidParameter(
            f"{setting} must name a key file under the operator's key directory ${KEY_DIR_ENV} ({root_raw}); it "
            "resolves elsewhere and is refused (its value is not shown): set it to the key's file name in that "
            "directory; nothing was reserved")
    return full
