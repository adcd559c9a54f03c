"""Where noise comes from: two production modes and one test mode (semantics.md section 2-3).

- ``os``    fresh noise from the operating system's CSPRNG (``os.urandom``). Never reproducible.
- ``keyed`` a deterministic CSPRNG stream: AES-256 in counter mode whose key is
            HMAC-SHA256(noise key, canonical label). The label is the run key (release, spec
            hash, interval, input fingerprint) plus partition shard and metric, so a retry of
            the same run over the same input reproduces the same noise (and reveals nothing
            new), while any change of label gives an independent stream.
- ``test``  the keyed construction with a key derived from a plain integer seed. Anyone who
            knows the seed can recompute the noise, so ``publishable`` is False: such output
            must be marked and may never reach a production output.

The noise key only ever comes from a file (``NoiseKey.from_file``: one open handle, owner/mode/
directory checks, the ``dpops-noise-key v1`` format, entropy check); never from the environment, where it would show in process
listings, crash dumps and child processes. A run loads it once (``load_key``) and every Beam
worker checks it holds the run's key id (``key_for_run``).

The secret ``NoiseKey`` is never shown by ``repr``/``str``/``describe``. It *can* be pickled,
because a Beam job must ship it to its workers; the pickle is as secret as the key file.
"""

from __future__ import annotations

import base64
import binascii
import errno
import hashlib
import hmac as _hmac
import os
import re
import stat
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from dpops.errors import InvalidParameter

MIN_KEY_BYTES = 32
MAX_KEY_FILE_BYTES = 4096  # a key file is at most a few hundred bytes of text; refuse reading anything bigger
MIN_DISTINCT = 16  # see _check_entropy
_KEY_ID_INFO = b"dpops/key-id"
_STREAM_INFO = b"dpops/noise-stream/v1\x00"
_TEST_SEED_INFO = b"dpops/test-seed/v1\x00"
_SEAL_INFO = b"dpops/staging-seal/v1\x00"
_BINDING_INFO = b"dpops/published-binding/v1\x00"
_U64_MAX = np.uint64(0xFFFFFFFFFFFFFFFF)


class NoiseKey:
    """The secret behind keyed noise (>= 32 bytes). Only ``key_id`` is ever shown."""

    __slots__ = ("_key", "key_id")

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, (bytes, bytearray)):
            raise InvalidParameter("noise key must be bytes")
        if len(key) < MIN_KEY_BYTES:
            raise InvalidParameter(
                f"noise key is {len(key)} bytes; at least {MIN_KEY_BYTES} are required "
                "(create one with `dpops key generate PATH`)"
            )
        self._key = bytes(key)
        self.key_id = _hmac.new(self._key, _KEY_ID_INFO, hashlib.sha256).hexdigest()[:16]

    # --- loading -----------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "NoiseKey":
        """Load a ``dpops-noise-key v1`` key file through ONE open handle.

        Privacy reasons, each one a way the key could be swapped or read by someone else:

        - a symlinked path is resolved once (Kubernetes mounts secrets through ``..data/``
          symlinks), then the parent directory is opened and the file is opened relative to that
          handle with ``O_NOFOLLOW``: a symlink flipped after resolution is refused, not followed;
        - the checks use ``fstat`` of the open handles and the bytes are read from the same handle,
          so what was checked is what is read (no stat-then-open race);
        - the file must be a regular file owned by this user (or root) with no group/other bits,
          and its directory owned by this user (or root) and not writable by group/others, so no
          other local user can read it or put another key in its place;
        - a low-entropy key (see ``_check_entropy``) is refused: noise under a guessable key is
          reproducible by anyone;
        - only a ``dpops-noise-key v1`` file is accepted (``parse_key_file``): any other readable
          high-entropy file (the Airflow DB URL, a Fernet key, a TLS key) is refused, so a mistyped or
          maliciously pointed reference never becomes the noise key of a release.

        Errors name the path and what to do; they never contain the file's bytes.
        """
        return parse_key_file(_read_key_bytes(path), f"noise key file {str(path)!r}")

    @classmethod
    def generate(cls, path: str | os.PathLike) -> "NoiseKey":
        """Write 32 fresh bytes from os.urandom as a ``dpops-noise-key v1`` file, mode 0600. Never overwrites."""
        return write_key_file(path, os.urandom(MIN_KEY_BYTES))

    # --- use -----------------------------------------------------------------------
    def hmac(self, data: bytes) -> bytes:
        """HMAC-SHA256 under the key: keyed fingerprints that do not let a reader confirm guesses."""
        return _hmac.new(self._key, _KEY_ID_INFO + b"/fingerprint\x00" + bytes(data), hashlib.sha256).digest()

    def _derive(self, info: bytes) -> bytes:
        return _hmac.new(self._key, info, hashlib.sha256).digest()

    def seal_mac(self, data: bytes) -> str:
        """The staging seal (``dpops.storage``): HMAC-SHA256 under a key derived from the noise key with
        its own label. A plain hash of the staged files could be recomputed by anyone who can write
        the staging area after swapping the noisy values for raw ones; this one needs the secret."""
        return "hmac-sha256:" + _hmac.new(self._derive(_SEAL_INFO), bytes(data), hashlib.sha256).hexdigest()

    def binding_mac(self, data: bytes) -> str:
        """The published binding (``dpops.storage.published``): HMAC-SHA256 under a key derived from the
        noise key with its own label, so no staging seal can ever pass as a binding or the reverse. Binds
        a published version to its run id, ledger entry and files: a writer of ``published/`` without the
        key cannot forge a version or move ``current`` to one that verifies."""
        return "hmac-sha256:" + _hmac.new(self._derive(_BINDING_INFO), bytes(data), hashlib.sha256).hexdigest()

    def __repr__(self) -> str:
        return f"NoiseKey(key_id={self.key_id!r})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NoiseKey) and _hmac.compare_digest(self._key, other._key)

    def __hash__(self) -> int:
        return hash(self.key_id)

    # Pickling is allowed on purpose: Beam ships the key to its workers inside the DoFn.
    def __reduce__(self) -> tuple:
        return (NoiseKey, (self._key,))


def _read_key_bytes(path: str | os.PathLike) -> bytes:
    """The bytes of a key file, read through one handle after the owner/mode checks (see ``NoiseKey.from_file``)."""
    shown = str(path)
    where = f"noise key file {shown!r}"
    real = os.path.realpath(os.fspath(path))
    parent, name = os.path.split(real)
    try:
        dfd = os.open(parent or os.sep, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise InvalidParameter(f"{where} does not exist (create it with `dpops key generate`)") from None
    except OSError as exc:
        raise InvalidParameter(f"{where}: its directory cannot be opened: {exc.strerror}") from None
    try:
        _check_owner_and_mode(os.fstat(dfd), f"{where}: its directory {parent!r}", directory=True)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0),
                         dir_fd=dfd)
        except FileNotFoundError:
            raise InvalidParameter(f"{where} does not exist (create it with `dpops key generate`)") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise InvalidParameter(f"{where} was replaced by a symlink while it was being loaded; "
                                       "check who can write its directory") from None
            raise InvalidParameter(f"{where} cannot be read: {exc.strerror}") from None
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidParameter(f"{where} is not a regular file")
        _check_owner_and_mode(st, where, directory=False)
        chunks = []
        size = 0
        while size <= MAX_KEY_FILE_BYTES:
            chunk = os.read(fd, MAX_KEY_FILE_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise InvalidParameter(f"{where} cannot be read: {exc.strerror}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise InvalidParameter(f"{where} is larger than {MAX_KEY_FILE_BYTES} bytes: it is not a noise key file")
    return data


def _check_owner_and_mode(st: os.stat_result, where: str, *, directory: bool) -> None:
    """Owner must be this user or root; a file has no group/other bits, a directory no group/other write."""
    euid = os.geteuid()
    if st.st_uid not in (euid, 0):
        raise InvalidParameter(f"{where} is owned by uid {st.st_uid}, not by this user ({euid}) or root: "
                               "another user could replace the key")
    mode = stat.S_IMODE(st.st_mode)
    if directory and mode & 0o022:
        raise InvalidParameter(f"{where} is writable by group/others (mode {mode:04o}): someone else could put "
                               "another key in its place; restrict it with `chmod go-w` or move the key")
    if not directory and mode & 0o077:
        raise InvalidParameter(f"{where} is accessible by group/others (mode {mode:04o}); restrict it with "
                               "`chmod 600` on the file")


def _check_entropy(key: bytes) -> None:
    """Refuse keys an attacker could guess: fewer than ``MIN_DISTINCT`` (16) distinct byte values, or
    fewer than 16 distinct differences between consecutive bytes (counting sequences such as
    00 01 02 ...). 32 bytes from a CSPRNG fail either test with probability below 5e-16, so a
    generated key is never refused; 64 hex zeros, a repeated short pattern or a counter always are."""
    if len(set(key)) < MIN_DISTINCT or len({(b - a) & 0xFF for a, b in zip(key, key[1:])}) < MIN_DISTINCT:
        raise InvalidParameter("the noise key has too little entropy (repeated or sequential bytes); "
                               "create a random one with `dpops key generate PATH`")


# Keys loaded in this process, by key id: the driver loads the key once per run (``load_key``), and a
# Beam worker in the same process reuses it, while a worker in another process loads it once and
# checks it is the run's key (``key_for_run``).
_LOADED: dict[str, NoiseKey] = {}


def load_key(path: str | os.PathLike) -> NoiseKey:
    """Load the run's key from its file (checked as in ``NoiseKey.from_file``) and remember it in
    this process, so the rest of the run (fingerprints, seal, pipeline) does not re-read the file."""
    key = NoiseKey.from_file(path)
    _LOADED[key.key_id] = key
    return key


def key_for_run(path: str | os.PathLike, key_id: str) -> NoiseKey:
    """The run's key on a worker: the one already loaded in this process, else loaded once from
    ``path``. Refuses a key whose id differs from the run's: a worker that sees another key (a
    different secret mounted, a rotated or flipped file) must not draw noise the ledger and the
    manifest do not describe."""
    key = _LOADED.get(key_id)
    if key is not None:
        return key
    key = NoiseKey.from_file(path)
    if not _hmac.compare_digest(key.key_id, str(key_id)):
        raise InvalidParameter(
            f"noise key file {str(path)!r} holds key id {key.key_id}, but the run was prepared with key id "
            f"{key_id}: every worker must see the same key (check the secret mounted on this worker)"
        )
    _LOADED[key.key_id] = key
    return key


def test_seal_key() -> NoiseKey:
    """The public key that seals test-mode staging. Test-mode output is never publishable, and a
    production run's seal is always checked with the production key, so a public key is harmless."""
    return NoiseKey(hashlib.sha256(_TEST_SEED_INFO + b"staging-seal").digest())


test_seal_key.__test__ = False  # type: ignore[attr-defined]


def _decode_key(data: bytes, where: str, allow_raw: bool = True) -> bytes:
    text = data.strip()
    try:
        s = text.decode("ascii")
    except UnicodeDecodeError:
        s = None
    if s is not None and s:
        if len(s) % 2 == 0 and all(c in "0123456789abcdefABCDEF" for c in s):
            return bytes.fromhex(s)
        try:
            return base64.b64decode(s, validate=True)
        except (binascii.Error, ValueError):
            pass
    if allow_raw:
        return bytes(data)
    raise InvalidParameter(f"{where}: the noise key must be hex or base64 text")


KEY_FILE_HEADER = "dpops-noise-key v1"
_KEY_ID_LINE = re.compile(r"^key-id ([0-9a-f]{16})$")
_KEY_LINE = re.compile(r"^(?:[0-9a-f]{2}){32,256}$")


def format_key_file(key: bytes) -> bytes:
    """The text of a ``dpops-noise-key v1`` file holding ``key`` (the key material; at least 32 bytes).

    Three lines: the header ``dpops-noise-key v1``, ``key-id <public id>`` and the key in lower-case
    hex. The header is what makes a file a noise key: dpops refuses every file without it, so a
    secret of another system (a database URL, a Fernet key) can never be taken for the noise key.
    The id line lets an operator read the public id without dpops and catches a truncated or edited
    key (the id is recomputed and compared on load)."""
    nk = NoiseKey(key)
    _check_entropy(bytes(key))
    return f"{KEY_FILE_HEADER}\nkey-id {nk.key_id}\n{bytes(key).hex()}\n".encode("ascii")


def parse_key_file(data: bytes, where: str) -> NoiseKey:
    """The key in a ``dpops-noise-key v1`` file's bytes (a key file, or a secret manager's payload).

    Anything else is refused with a message naming ``where`` and never any of the bytes: an older
    dpops key file (bare hex, base64 or raw bytes) is converted once with ``dpops key convert OLD
    NEW`` (same key, same key id, so earlier runs stay reproducible)."""
    convert = (f"only files written by `dpops key generate` (first line {KEY_FILE_HEADER!r}) are accepted; "
               "a key file of an older dpops (bare hex or base64) is converted with `dpops key convert OLD NEW` "
               "(same key, same key id)")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise InvalidParameter(f"{where} is not a dpops noise key file: {convert}") from None
    lines = text.splitlines()
    while lines and lines[-1] == "":
        lines.pop()
    if not lines or lines[0].rstrip("\r") != KEY_FILE_HEADER:
        raise InvalidParameter(f"{where} is not a dpops noise key file: {convert}")
    body = [ln.rstrip("\r") for ln in lines[1:]]
    m = _KEY_ID_LINE.match(body[0]) if body else None
    if len(body) != 2 or m is None or not _KEY_LINE.match(body[1]):
        raise InvalidParameter(f"{where} has the {KEY_FILE_HEADER!r} header but not the 'key-id <16 hex>' and key "
                               "lines after it (truncated or edited?); restore it from the secret store")
    key = bytes.fromhex(body[1])
    try:
        loaded = NoiseKey(key)
        _check_entropy(key)
    except InvalidParameter as exc:
        raise InvalidParameter(f"{where}: {exc}") from None
    if not _hmac.compare_digest(loaded.key_id, m.group(1)):
        raise InvalidParameter(f"{where}: its key-id line does not match its key (the file was edited or "
                               "corrupted); restore it from the secret store")
    return loaded


def write_key_file(path: str | os.PathLike, key: bytes) -> NoiseKey:
    """Create ``path`` (mode 0600, never overwriting) as a ``dpops-noise-key v1`` file holding ``key``."""
    p = Path(path)
    content = format_key_file(key)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise InvalidParameter(f"noise key file {str(p)!r} already exists; refusing to overwrite it") from None
    except OSError as exc:
        raise InvalidParameter(f"cannot create noise key file {str(p)!r}: {exc.strerror}") from None
    try:
        os.fchmod(fd, 0o600)  # the umask may only remove bits; make the mode explicit anyway
        os.write(fd, content)
    finally:
        os.close(fd)
    return NoiseKey(key)


def convert_legacy_key_file(old: str | os.PathLike, new: str | os.PathLike) -> NoiseKey:
    """``dpops key convert``: read a key file of an older dpops (bare hex or base64 text of >= 32 bytes;
    loaded with the same owner/mode/entropy checks) and write the same key as a v1 file at ``new``.

    Raw binary key files are not converted: nothing tells them from any other secret, which is the
    point of the format. An old file that already is v1 is refused (nothing to do)."""
    where = f"noise key file {str(old)!r}"
    data = _read_key_bytes(old)
    if data.lstrip().startswith(KEY_FILE_HEADER.encode()):
        raise InvalidParameter(f"{where} already is a {KEY_FILE_HEADER!r} file; nothing to convert")
    key = _decode_key(data, where, allow_raw=False)
    try:
        NoiseKey(key)
        _check_entropy(key)
    except InvalidParameter as exc:
        raise InvalidParameter(f"{where}: {exc}") from None
    return write_key_file(new, key)


def canonical_label(label: Any) -> bytes:
    """Type-tagged canonical bytes of a label: a mapping and a list never collide."""
    from dpops.events import canonical_json

    def norm(x: Any) -> Any:
        if isinstance(x, bool):
            raise InvalidParameter(f"randomness label parts must be str or int, got bool {x!r}")
        if isinstance(x, (str, int)):
            return x
        if isinstance(x, (np.integer,)):
            return int(x)
        if isinstance(x, Mapping):
            out = {}
            for k, v in x.items():
                if not isinstance(k, str):
                    raise InvalidParameter(f"randomness label keys must be str, got {k!r}")
                out[k] = norm(v)
            return {"m": out}
        if isinstance(x, (list, tuple)):
            return {"s": [norm(v) for v in x]}
        raise InvalidParameter(f"randomness label parts must be str, int, mappings or sequences, got {type(x).__name__}")

    return canonical_json(norm(label)).encode()


class RandomSource:
    """A source of uniform bits. Subclasses provide ``_bytes``; everything else is built on it."""

    mode: str = ""
    publishable: bool = True

    def _bytes(self, n: int) -> bytes:  # pragma: no cover - abstract
        raise NotImplementedError

    def uint64(self, n: int) -> np.ndarray:
        if not isinstance(n, (int, np.integer)) or n < 0:
            raise InvalidParameter(f"number of random words must be an integer >= 0, got {n!r}")
        n = int(n)
        if n == 0:
            return np.empty(0, dtype=np.uint64)
        return np.frombuffer(self._bytes(8 * n), dtype="<u8").astype(np.uint64, copy=False)

    def random_bits(self, n: int) -> np.ndarray:
        """n fair bits as a bool array."""
        words = self.uint64((n + 63) // 64)
        bits = np.unpackbits(words.view(np.uint8))[:n]
        return bits.astype(bool)

    def randbelow(self, bound: int | np.ndarray, n: int | None = None) -> np.ndarray:
        """Exactly uniform integers in [0, bound) by rejection (no modulo bias).

        ``bound`` is a positive int (then ``n`` values, or a 0-d array if n is None) or an
        int64 array (one value per entry). Bounds up to 2**63 - 1 on this fast path.
        """
        scalar = np.ndim(bound) == 0
        b = np.asarray(bound)
        if b.dtype == object or not np.issubdtype(b.dtype, np.integer):
            if scalar and isinstance(bound, int) and bound > 0:
                if bound >= 2**63:
                    return self._randbelow_big_array([bound] * (1 if n is None else n), scalar=n is None)
                b = np.asarray(bound, dtype=np.int64)
            else:
                raise InvalidParameter(f"randbelow bound must be a positive integer or integer array, got {bound!r}")
        if b.size and int(b.min()) < 1:
            raise InvalidParameter("randbelow bound must be >= 1")
        if scalar:
            shape = () if n is None else (int(n),)
            return self._randbelow_scalar(int(b), shape)
        else:
            if n is not None and n != b.size:
                raise InvalidParameter(f"randbelow: n={n} does not match {b.size} bounds")
            b = b.astype(np.uint64)
        flat_b = b.reshape(-1)
        out = np.empty(flat_b.size, dtype=np.uint64)
        # x is accepted iff x <= 2**64 - 1 - (2**64 mod b): then x mod b is exactly uniform.
        with np.errstate(over="ignore"):
            cutoff = _U64_MAX - ((np.uint64(0) - flat_b) % flat_b)
        pending = np.arange(flat_b.size)
        while pending.size:
            x = self.uint64(pending.size)
            ok = x <= cutoff[pending]
            idx = pending[ok]
            out[idx] = x[ok] % flat_b[idx]
            pending = pending[~ok]
        return out.astype(np.int64).reshape(b.shape)

    def _randbelow_scalar(self, bound: int, shape: tuple) -> np.ndarray:
        size = int(np.prod(shape)) if shape else 1
        if bound & (bound - 1) == 0:  # a power of two: masking is exactly uniform
            return (self.uint64(size) & np.uint64(bound - 1)).astype(np.int64).reshape(shape)
        last_ok = np.uint64((1 << 64) - (1 << 64) % bound - 1)
        ub = np.uint64(bound)
        out = np.empty(size, dtype=np.uint64)
        pending = np.arange(size)
        while pending.size:
            x = self.uint64(pending.size)
            ok = x <= last_ok
            out[pending[ok]] = x[ok] % ub
            pending = pending[~ok]
        return out.astype(np.int64).reshape(shape)

    def randbelow_int(self, bound: int) -> int:
        """One exactly uniform Python int in [0, bound) for any size of bound."""
        if not isinstance(bound, int) or bound < 1:
            raise InvalidParameter(f"randbelow bound must be a positive integer, got {bound!r}")
        if bound == 1:
            return 0
        words = (bound.bit_length() + 63) // 64
        span = 1 << (64 * words)
        cutoff = span - span % bound
        while True:
            x = int.from_bytes(self._bytes(8 * words), "little")
            if x < cutoff:
                return x % bound

    def _randbelow_big_array(self, bounds: list[int], scalar: bool) -> np.ndarray:
        out = np.array([self.randbelow_int(int(b)) for b in bounds], dtype=object)
        return out.reshape(()) if scalar else out

    def uniform53(self, n: int) -> np.ndarray:
        """Floats k/2**53 (documented float paths only; exact samplers never use this)."""
        return (self.uint64(n) >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)

    def child(self, *label: str | int) -> "RandomSource":  # pragma: no cover - abstract
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError


class _OSRandom(RandomSource):
    mode = "os"
    publishable = True

    def _bytes(self, n: int) -> bytes:
        return os.urandom(n)

    def child(self, *label: str | int) -> RandomSource:
        # OS noise is fresh by definition: a child is simply another fresh stream.
        return _OSRandom()

    def describe(self) -> dict[str, Any]:
        return {"mode": "os", "key_id": None, "label": None, "publishable": True}

    def __repr__(self) -> str:
        return "RandomSource(mode='os')"


class _StreamRandom(RandomSource):
    """AES-256-CTR keystream under a derived key (keyed and test modes)."""

    def __init__(self, root: NoiseKey, path: tuple, mode: str, publishable: bool, key_id: str | None) -> None:
        self._root = root
        self._path = path
        self.mode = mode
        self.publishable = publishable
        self._key_id = key_id
        self._used = False
        derived = root._derive(_STREAM_INFO + canonical_label(list(path)))
        # Counter mode from block 0; the derived key is unique per label, so no nonce reuse.
        self._enc = Cipher(algorithms.AES(derived), modes.CTR(b"\x00" * 16)).encryptor()

    def _bytes(self, n: int) -> bytes:
        self._used = True
        return self._enc.update(bytes(n))

    def child(self, *label: str | int) -> RandomSource:
        """Independent deterministic sub-stream for (this label + label); the parent is not consumed."""
        if not label:
            raise InvalidParameter("child() needs at least one label part")
        for part in label:
            if isinstance(part, bool) or not isinstance(part, (str, int, np.integer)):
                raise InvalidParameter(f"child label parts must be str or int, got {part!r}")
        parts = tuple(int(p) if isinstance(p, np.integer) else p for p in label)
        return _StreamRandom(self._root, self._path + (list(parts),), self.mode, self.publishable, self._key_id)

    def describe(self) -> dict[str, Any]:
        import json

        return {
            "mode": self.mode,
            "key_id": self._key_id,
            "label": json.loads(canonical_label(list(self._path)).decode()),
            "publishable": self.publishable,
        }

    def __repr__(self) -> str:
        return f"RandomSource(mode={self.mode!r}, key_id={self._key_id!r})"

    # A pickled stream restarts from its beginning on the worker. That is only safe for a stream
    # nobody has drawn from yet; and every worker unpickling the same source gets the *same*
    # noise, so workers must derive ``child(shard, metric, ...)`` streams, never share one.
    def __reduce__(self) -> tuple:
        if self._used:
            raise InvalidParameter(
                "refusing to pickle a keyed/test random stream that has already produced output "
                "(it would replay the same noise); pickle the NoiseKey and label, or a fresh source, "
                "and derive child() streams on the worker"
            )
        return (_StreamRandom, (self._root, self._path, self.mode, self.publishable, self._key_id))


def os_random() -> RandomSource:
    """Fresh noise from the OS CSPRNG; every call and every child is independent."""
    return _OSRandom()


def keyed_random(key: NoiseKey, label: Mapping[str, str | int] | Sequence) -> RandomSource:
    """Deterministic CSPRNG stream for (key, label): same pair, same stream; any change, independent."""
    if not isinstance(key, NoiseKey):
        raise InvalidParameter("keyed_random needs a NoiseKey (load it with NoiseKey.from_file)")
    canonical_label(label)  # validate early, with a clear error
    return _StreamRandom(key, (label,), "keyed", True, key.key_id)


def test_random(seed: int, label: Mapping[str, str | int] | Sequence = ()) -> RandomSource:
    """Same construction from a plain seed. Not publishable: anyone with the seed can recompute it."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise InvalidParameter(f"test seed must be an integer, got {seed!r}")
    root = NoiseKey(hashlib.sha256(_TEST_SEED_INFO + str(int(seed)).encode()).digest())
    return _StreamRandom(root, (label,), "test", False, None)


test_random.__test__ = False  # type: ignore[attr-defined]  # not a pytest test function

__all__ = ["NoiseKey", "RandomSource", "os_random", "keyed_random", "test_random", "canonical_label", "load_key",
           "key_for_run", "KEY_FILE_HEADER", "format_key_file", "parse_key_file", "write_key_file",
           "convert_legacy_key_file"]
