"""Which files ``dpops tune`` may read, and what reading private data on purpose leaves behind.

Tuning is not differentially private: its output (drops, biases, the recommended bounds) is an exact
function of the rows it reads. So by default it reads only the operator's public roots
(``$DPOPS_PUBLIC_ROOTS``, checked by ``dpops.dataroots.check_public_path``: public, synthetic or
previously released data, kept apart from the data roots). A path that resolves under a data root
(``$DPOPS_DATA_ROOTS``, or the spec's directory when unset: where private inputs live) is refused
unless the caller passes ``allow_private=True`` (CLI: ``--i-understand-this-reads-private-data``) with
a reason; then, before a single row is read, the ledger records a ``private_access`` entry on the
spec's scope (who, when, the keyed input fingerprint, why), and the spec patch says so. The fact is
durable and reviewable even though no epsilon can describe it.

Anything else -- a path outside both kinds of root, or the key file -- is refused. The refusals
are ``SpecError`` (exit 3) naming the path and the setting to change, never the file's content.

The private input in disguise (issue 25 item 7a). A file under a public root may still be private data:
a hard link to one of the spec's input files, or a byte-identical copy. ``private_twin`` compares a
public sample with the spec's own input files (every file the ``input.path`` template can name) by file
identity (st_dev, st_ino) and, for files of the same size, by the sha256 of the bytes (computed here,
compared, never shown or stored); a match is treated as that private file: refused without the flag,
recorded with it. A private read is recorded on the spec's scope, so it must be data of that scope: a
file under a data root that is not one of the spec's input files is refused (tune the spec whose input
it is), so the entry always lands on the scope of the data actually read.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import stat as stat_mod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from dpops import dataroots
from dpops.errors import SpecError
from dpops.storage.location import Location, LocationError

if TYPE_CHECKING:
    from dpops.inputs import InputStats
    from dpops.spec import ReleaseSpec

PRIVATE_FLAG = "--i-understand-this-reads-private-data"
FIELD = "--sample"


@dataclass(frozen=True)
class SampleAccess:
    """The outcome of the check: where the sample resolves, whether it is private data, and for private
    data the ledger entry recording the access."""

    location: str
    private: bool
    when: str  # UTC ISO time of the check (for private data: the ledger entry's own time)
    fingerprint: str | None = None
    entry_id: int | None = None
    scope: str | None = None
    # A recorded private read of a local file or S3 object: its stat snapshot (``dpops.inputs.input_stat_snapshot``)
    # taken before the fingerprint the ledger entry records; the Beam read compares it afterwards
    # (``dpops.release.tuning``).
    stats: InputStats | None = None

    def provenance(self) -> dict[str, object]:
        """What a spec patch carries about the data its values came from: the ``data`` of the spec's
        ``tuning`` block (``dpops.spec.PublicTuningData`` / ``PrivateTuningData``)."""
        from dpops.spec import private_tuning_statement

        if not self.private:
            return {"source": "public", "sample": self.location, "checked_at": self.when}
        return {"source": "private", "scope": self.scope, "fingerprint": self.fingerprint,
                "ledger_entry": self.entry_id, "read_at": self.when,
                "statement": private_tuning_statement(self.when)}


def _resolve(path: str | os.PathLike[str]) -> Location:
    try:
        return Location.parse(os.path.expanduser(os.fspath(path)), base=Location.local(os.getcwd())).realpath()
    except LocationError as exc:
        raise SpecError(f"{FIELD} ({os.fspath(path)}): {exc}") from None


def spec_input_files(spec: ReleaseSpec) -> list[str]:
    """Every local file the spec's ``input.path`` template can name (each ``{...}`` field as ``*``), resolved.
    An object-store input lists nothing here (its twins are not looked for)."""
    pattern = re.sub(r"\{[^{}]*\}", "*", spec.input.path)
    loc = spec.resolve_path(pattern)
    if not loc.is_local:
        return []
    return sorted({os.path.realpath(f) for f in glob.glob(str(loc)) if os.path.isfile(f)})


def _sha256(path: str) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.digest()


def private_twin(spec: ReleaseSpec, location: str) -> str | None:
    """The spec's input file that ``location`` is in disguise (same inode, or the same bytes), else None.

    Privacy reason: a hard link or a copy of private input under a public root is the private data; read
    as public it would leave no ledger entry. The content hash stays in this function (never shown)."""
    if not os.path.isfile(location):
        return None
    st = os.stat(location)
    same_size: list[str] = []
    for f in spec_input_files(spec):
        fs = os.stat(f)
        if (fs.st_dev, fs.st_ino) == (st.st_dev, st.st_ino):
            return f
        if fs.st_size == st.st_size:
            same_size.append(f)
    if same_size:
        mine = _sha256(location)
        for f in same_size:
            if _sha256(f) == mine:
                return f
    return None


def is_private_path(spec: ReleaseSpec, path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` resolves under a data root of ``spec`` (``dpops.dataroots.data_root_locations``)."""
    resolved = _resolve(path)
    return any(resolved.is_under(r) for r in dataroots.data_root_locations(spec.base_dir))


@dataclass(frozen=True)
class PrivateSample:
    """A sample that is private data (under a data root, or the spec's input in disguise): ``path`` as given,
    ``twin`` the spec's input file it is when it sits under a public root. Reading it needs the ledger entry
    of ``dpops.release.private_reads.open_sample`` first."""

    path: str
    twin: str | None


def classify_sample(spec: ReleaseSpec, path: str | os.PathLike[str], *,
                    key_path: str | os.PathLike[str] | None = None) -> SampleAccess | PrivateSample:
    """A public sample's ``SampleAccess`` (checked against ``$DPOPS_PUBLIC_ROOTS``), or the ``PrivateSample`` it is.

    Reads no row and writes nothing: file identity and, for a same-size file, its bytes' sha256 (compared, never
    kept) decide whether a public path is the spec's private input in disguise (``private_twin``)."""
    when = datetime.now(UTC).replace(microsecond=0).isoformat()
    if is_private_path(spec, path):
        return PrivateSample(os.fspath(path), None)
    check_public = getattr(dataroots, "check_public_path", None)
    if check_public is None:  # a dpops without the public-roots allow-list: nothing is known to be public
        raise SpecError(f"{FIELD} ({os.fspath(path)}): this dpops has no public-roots allow-list "
                        "(dpops.dataroots.check_public_path), so no sample is known to be public data")
    pub = check_public(path, FIELD, source=spec.source, spec_dir=spec.base_dir, key_path=key_path)
    location = str(getattr(pub, "location", pub))
    twin = private_twin(spec, location)
    if twin is None:
        return SampleAccess(location, False, when)
    return PrivateSample(os.fspath(path), twin)


def refuse_private(sample: PrivateSample) -> SpecError:
    """The refusal of a private sample read without ``PRIVATE_FLAG`` (names the path and the setting, no content)."""
    if sample.twin is not None:
        return SpecError(
            f"{FIELD} ({sample.path}) is under a public root, but it is the spec's private input {sample.twin} "
            f"(the same file, or the same bytes): reading it is reading private data. Tune on public or "
            f"synthetic data, or pass {PRIVATE_FLAG} with --reason: the ledger will record the access for the "
            "spec's scope and the spec patch will say so")
    return SpecError(
        f"{FIELD} ({sample.path}) resolves under a data root, where private inputs live. Tuning is not "
        f"differentially private: its output is an exact function of the rows it reads. Tune on public or "
        f"synthetic data under $DPOPS_PUBLIC_ROOTS, or, if you must look at the private data, pass {PRIVATE_FLAG} "
        "with --reason: the ledger will record the access for the spec's scope and the spec patch will say so")


def check_private_sample(spec: ReleaseSpec, sample: PrivateSample, *,
                         key_path: str | os.PathLike[str] | None = None) -> str:
    """The resolved file a flagged private read may read: a release's input checks (under a data root, away from
    the noise key), and one of the spec's own input files, since the read is recorded on the spec's scope."""
    resolved = dataroots.check_data_path(sample.twin or sample.path, FIELD, source=spec.source,
                                         spec_dir=spec.base_dir, key_path=key_path)
    if "://" not in resolved and os.path.realpath(resolved) not in spec_input_files(spec):
        # the entry goes on this spec's scope: only data of this scope (the spec's own input) may be read under it
        raise SpecError(
            f"{FIELD} ({sample.path}) is under a data root but is not an input file of {spec.source} "
            f"(input.path {spec.input.path!r}): a private read is recorded on the scope of the spec, which would "
            f"not be the scope of this data; tune the spec whose input it is; nothing was recorded")
    return resolved


def check_public_sample(spec: ReleaseSpec, path: str | os.PathLike[str], *,
                        key_path: str | os.PathLike[str] | None = None) -> SampleAccess:
    """``path`` as a public sample, or the refusal (``SpecError``) when it is private data: what ``tune`` applies
    to a path, so the Python API never reads private data without the ledger entry."""
    checked = classify_sample(spec, path, key_path=key_path)
    if isinstance(checked, PrivateSample):
        raise refuse_private(checked)
    return checked


def _descriptor_twin(spec: ReleaseSpec, fd: int, st: os.stat_result) -> str | None:
    """``private_twin`` for an open descriptor: the spec's input file it is (same inode, or the same bytes read
    through the descriptor itself, so a rename at the name cannot show the hash another file)."""
    same_size = []
    for f in spec_input_files(spec):
        fs = os.stat(f)
        if (fs.st_dev, fs.st_ino) == (st.st_dev, st.st_ino):
            return f
        if fs.st_size == st.st_size:
            same_size.append(f)
    if not same_size:
        return None
    h, offset = hashlib.sha256(), 0
    while block := os.pread(fd, 1 << 20, offset):
        h.update(block)
        offset += len(block)
    mine = h.digest()
    return next((f for f in same_size if _sha256(f) == mine), None)


@contextmanager
def pinned_sample(spec: ReleaseSpec, access: SampleAccess, *,
                  key_path: str | os.PathLike[str] | None = None) -> Iterator[str]:
    """The path to read ``access``'s sample by: the very file that passes the checks, opened once.

    Privacy reason (the rule ``dpops.dataroots.read_public_file`` applies to ``partitions.public_file``, issue 25
    item 11): the sample was checked by name, and reading it by name again lets whoever can write a public root
    swap the checked file for a symlink to (or a copy of) the private input in between; tune and simulate would
    then print exact functions of private rows with no ledger entry. So the file is opened ONCE, and the file the
    descriptor holds (its path as the kernel reports it, ``/proc/self/fd/N``) is checked again: a public sample
    must still resolve under a public root, outside every data root and away from the key, and not be the
    spec's input by inode or by the bytes read through the descriptor; a recorded private read must be the very
    file the ledger entry names. The reader then opens ``/proc/self/fd/N``, which is that same open file whatever
    the name now points at. Where the kernel reports no descriptor path, the checked name must still be the
    held file (``st_dev``/``st_ino``) and is read by name: a narrower race remains there. Object stores have no
    symlinks: the location itself. ``O_NONBLOCK`` so a planted FIFO cannot hang; only a regular file is read.
    Refusals are ``SpecError`` naming the path, never the content."""
    loc = access.location
    if "://" in loc:
        yield loc
        return
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(loc, flags)
    except OSError as exc:
        raise SpecError(f"{FIELD} ({loc}): cannot read: {exc.strerror or exc}") from None
    changed = SpecError(f"{FIELD} ({loc}): the file changed after it was checked (a symlink or a rename raced the "
                        "check); nothing was read. Keep samples at stable paths that only their owner can change")
    try:
        st = os.fstat(fd)
        if not stat_mod.S_ISREG(st.st_mode):
            raise SpecError(f"{FIELD} ({loc}): not a regular file; nothing was read")
        opened = dataroots.opened_path(fd)
        if access.private:
            if opened is not None and opened != os.path.realpath(loc):
                raise changed
        else:
            held = opened or loc
            if is_private_path(spec, held):
                raise refuse_private(PrivateSample(held, None))
            dataroots.check_public_path(held, FIELD, source=spec.source, spec_dir=spec.base_dir, key_path=key_path)
            twin = _descriptor_twin(spec, fd, st)
            if twin is not None:
                raise refuse_private(PrivateSample(loc, twin))
        if opened is None:
            try:
                now = os.stat(loc)
            except OSError:
                raise changed from None
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                raise changed
            yield loc
        else:
            yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


__all__ = ["PRIVATE_FLAG", "FIELD", "PrivateSample", "SampleAccess", "check_private_sample", "check_public_sample",
           "classify_sample", "is_private_path", "pinned_sample", "private_twin", "refuse_private", "spec_input_files"]
