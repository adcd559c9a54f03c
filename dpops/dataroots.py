"""Which files a release spec may make dpops read: the operator's data roots, never the noise key.

A release spec is written by people who may not hold the noise key or the data of
other releases. Whatever a spec names (``input.path``, ``partitions.public_file``)
is read by a process that does hold the key, so the spec author must not be able to
point it at the key file, at another secret, or at another release's private input.

Rules (applied before any ledger reservation, and at ``dpops spec check``):

- The path is resolved with ``os.path.realpath`` (symlinks followed), and the
  resolved path must lie under one of the **data roots**:
  ``DPOPS_DATA_ROOTS``, a list of directories separated by ``os.pathsep`` (``:``
  on POSIX). When it is unset or empty the only data root is the directory of the
  spec file itself (and everything below it), which is the layout of the examples,
  the demo and the tests. A deployment whose data does not live below its specs
  sets ``DPOPS_DATA_ROOTS`` (deploy/ sets ``/data``).
- A path resolving to the noise key file, or to any file in the key file's own
  directory, is refused even under a data root. The key file is the one given by
  ``--key-file`` (``key_path``) or ``DPOPS_NOISE_KEY_FILE``; both are checked when
  both are known. Its directory is refused too because secrets are mounted side by
  side (``/run/secrets``, a Kubernetes secret volume).

- ``DPOPS_DATA_ROOTS`` entries may also be URI prefixes (``s3://bucket/data``). Entries are separated
  by commas; a comma-free local list separated by ``os.pathsep`` keeps working. A URI is compared with
  the URI roots as a normalised prefix on path-segment boundaries (``Location.is_under``), never
  with ``..`` (refused by the parse); object stores have no symlinks to follow and never hold the
  noise key, which is a local file.

Output roots (``output.root``, checked by ``check_output_root`` when a spec is parsed, so at DAG
parse, ``dpops spec check`` and in ``prepare`` before anything is reserved): a relative root below
the spec's directory is always allowed; an absolute path or a URI only under an entry of
``DPOPS_OUTPUT_ROOTS`` (the operator's allow-list, comma-separated absolute paths or URI prefixes;
local entries and values compared after ``realpath``). Reason: a process that holds the noise key
writes there, so the spec author must not choose another release's directory or a foreign bucket.

Public files (``partitions.public_file``; issue 19 item 6), checked by ``check_public_path``: a public file
becomes partition labels that are published in ``data.parquet`` without noise, so it must be public data
chosen by the operator, never a file of the data roots (which hold every release's private input):

- it must resolve (``realpath``, symlinks followed) under an entry of the operator's **public roots**
  ``DPOPS_PUBLIC_ROOTS`` (same syntax as ``DPOPS_DATA_ROOTS``: comma-separated absolute paths or URI
  prefixes; a comma-free local list may use ``os.pathsep``). Unset means no public file is accepted;
- a public root that overlaps a data root in either direction (one equal to or below the other; with
  ``DPOPS_DATA_ROOTS`` unset the data root is the spec's directory) is refused as an operator error, and a
  public file whose real path lies under a data root is refused even if it is also under a public root
  (a symlink from a public root into the data);
- the key file and its directory are refused as for data paths;
- the bytes read are those of the file that passed the check (``read_public_file``: one open, the
  descriptor's own path checked, its inode compared with the checked path's), never a second open by
  name that a symlink flipped in between could redirect (issue 25 item 11);
- whether the file's rows may appear in the manifest is the operator's decision, per root:
  ``DPOPS_PUBLIC_ROOTS_PUBLISHABLE`` lists public roots (each equal to or below an entry of
  ``DPOPS_PUBLIC_ROOTS``) whose files are publishable as lists. A public file elsewhere is recorded in the
  manifest only by its row count, and its content enters the run's *keyed* input fingerprint
  (``dpops.inputs.input_fingerprint``), not the spec document. A spec field cannot set this: the spec's
  author is the party the rule protects against. Tuning samples (public sample data) are meant to use the
  same roots through ``public_root_locations``/``check_public_path``.

Refusals are ``SpecError`` (exit 3) naming the spec field and the path, never the
file's content. Privacy reason: a file's content may be a secret (the key) or a
private value; the only thing a refusal reveals is the path the spec author wrote.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Iterable

from dpops.errors import SpecError
from dpops.storage.location import Location, LocationError, is_uri

DATA_ROOTS_ENV = "DPOPS_DATA_ROOTS"
OUTPUT_ROOTS_ENV = "DPOPS_OUTPUT_ROOTS"
KEY_FILE_ENV = "DPOPS_NOISE_KEY_FILE"
PUBLIC_ROOTS_ENV = "DPOPS_PUBLIC_ROOTS"
PUBLISHABLE_PUBLIC_ROOTS_ENV = "DPOPS_PUBLIC_ROOTS_PUBLISHABLE"
_URI_START = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def split_roots(raw: str) -> list[str]:
    """Entries of a roots variable: comma-separated; a piece that is not a URI may also use ``os.pathsep``."""
    out: list[str] = []
    for piece in raw.split(","):
        piece = piece.strip()
        if not piece:
            continue
        if _URI_START.match(piece):
            out.append(piece)
        else:
            out.extend(p.strip() for p in piece.split(os.pathsep) if p.strip())
    return out


def _root_locations(entries: list[str], env: str) -> list[Location]:
    out = []
    for e in entries:
        if not is_uri(e) and ".." in e.replace("\\", "/").split("/"):
            raise SpecError(f"${env}: entry {e!r} contains '..'; give the directory itself (fix the operator setting)")
        try:
            loc = Location.parse(os.path.expanduser(e)) if not is_uri(e) else Location.parse(e)
        except LocationError as exc:
            raise SpecError(f"${env}: entry {e!r} is not an absolute path or a URI prefix ({exc}); fix the "
                            "operator setting") from None
        out.append(loc.realpath())
    return out


def data_roots(spec_dir: str | os.PathLike[str] | None) -> list[str]:
    """The resolved data roots: ``DPOPS_DATA_ROOTS`` if set, else the spec's own directory (local paths
    realpath-resolved, URIs normalised)."""
    return [str(r) for r in data_root_locations(spec_dir)]


def data_root_locations(spec_dir: str | os.PathLike[str] | None) -> list[Location]:
    entries = split_roots(os.environ.get(DATA_ROOTS_ENV, ""))
    if not entries:
        entries = [os.path.abspath(str(spec_dir))] if spec_dir is not None else []
    return _root_locations(entries, DATA_ROOTS_ENV)


def output_root_locations() -> list[Location]:
    """The operator's allow-list ``DPOPS_OUTPUT_ROOTS`` (empty when unset: only relative roots are allowed)."""
    return _root_locations(split_roots(os.environ.get(OUTPUT_ROOTS_ENV, "")), OUTPUT_ROOTS_ENV)


def check_output_root(raw: str, root: Location, *, source: str) -> Location:
    """Refuse an absolute or URI ``output.root`` outside ``$DPOPS_OUTPUT_ROOTS``; return the root.

    ``raw`` is the spec's ``output.root`` as written, ``root`` its resolved location, ``source`` the spec's
    file name (plain values: this module sits below ``dpops.spec`` and never imports it). A relative root
    lies below the spec's directory by construction (``..`` is refused by the spec model) and needs no
    allow-list entry."""
    if not is_uri(raw) and not os.path.isabs(raw):
        return root
    allowed = output_root_locations()
    resolved = root.realpath()
    if any(resolved.is_under(a) for a in allowed):
        return root
    have = f"it is {os.environ.get(OUTPUT_ROOTS_ENV)!r}" if allowed else "it is unset"
    raise SpecError(
        f"{source}: output.root ({raw}) is an absolute path or URI outside the operator's allowed output "
        f"roots (${OUTPUT_ROOTS_ENV}, {have}); use a relative output.root or have the operator add a prefix of it "
        f"to ${OUTPUT_ROOTS_ENV} (comma-separated absolute paths or URI prefixes)"
    )


def check_scratch_location(raw: str, field: str, *, source: str, spec_dir: str | os.PathLike[str] | None,
                           output_root: Location, key_path: str | os.PathLike[str] | None = None) -> Location:
    """Refuse a private scratch location (``dpops estimate --staging``) that overlaps where others read; return it.

    What the workers write there is not differentially private: copies of the interval's rows split by unit
    bucket, and the exact counts before any noise. It is removed after each pass, but while it exists anyone
    who reads the location reads the private data. So it must lie apart, in either direction (one equal to or
    below the other), from every place whose readers are not trusted with the data or that a release reads as
    input:

    - the operator's public roots (``$DPOPS_PUBLIC_ROOTS``: their files are published or used as public data);
    - the spec's ``output.root`` (staged and published outputs, read by the release's consumers), and every entry
      of ``$DPOPS_OUTPUT_ROOTS`` (every release's outputs; a scratch under another release's root was admitted);
    - every data root (``$DPOPS_DATA_ROOTS``, or the spec's directory when it is unset): an input glob of any
      release there could match a scratch file and read a bucket's rows a second time, which would break the
      contribution bound that release charges for;
    - the noise key and its directory (``resolve_away_from_key``).

    Refusals are ``SpecError`` (exit 3) naming ``field`` and the location; nothing has been reserved yet."""
    loc = resolve_away_from_key(raw, field, source=source, key_path=key_path,
                                instead="a private directory or prefix of its own, apart from every data, public "
                                        "and output root")
    for root, what in _scratch_forbidden(spec_dir, output_root, key_path):
        if _overlaps(loc, root):
            raise SpecError(
                f"{source}: {field} ({raw}) overlaps {what}: the scratch files hold private rows and exact counts "
                "(not differentially private) while a pass runs, so they must live apart from every data, public and "
                "output root; give the scratch a private directory or prefix of its own (e.g. s3://bucket/scratch/ "
                "beside a data root s3://bucket/data/)")
    return loc


def check_temp_scratch(field: str, *, source: str, spec_dir: str | os.PathLike[str] | None,
                       output_root: Location, key_path: str | os.PathLike[str] | None = None) -> None:
    """Refuse the process's temporary directory (``tempfile.gettempdir()``: ``$TMPDIR``, else /tmp) as the parent
    of a pass's default scratch when it lies equal to or below a place ``check_scratch_location`` keeps scratch
    away from (a data, public or output root).

    Without ``--staging`` each pass makes a fresh 0700 directory there after ``ledger.start``; a fresh directory
    is below no root unless its parent is, so one direction suffices (a data root below /tmp is fine: the
    scratch is its sibling, not inside it). A ``$TMPDIR`` inside a data root would put private rows where another
    release's input glob reads. ``field`` names the command in the refusal (``SpecError``, exit 3); checked
    before anything is reserved or recorded."""
    import tempfile

    tmp = Location.local(os.path.realpath(tempfile.gettempdir()))
    # not the key's directory: a fresh directory below $TMPDIR is never the key's directory itself, so no scratch
    # file lands beside the key (the rule ``resolve_away_from_key`` and ``check_scratch_location`` enforce)
    for root, what in _scratch_forbidden(spec_dir, output_root, key_path, with_key_dir=False):
        if tmp.is_under(root):
            raise SpecError(
                f"{source}: {field}: the temporary directory {tmp.path!r} ($TMPDIR) is inside {what}; each pass "
                "writes private rows and exact counts (not differentially private) to a scratch directory there, "
                "so set $TMPDIR to a private directory outside every data, public and output root, or pass "
                "--staging with one")


def _scratch_forbidden(spec_dir: str | os.PathLike[str] | None, output_root: Location,
                       key_path: str | os.PathLike[str] | None, *,
                       with_key_dir: bool = True) -> list[tuple[Location, str]]:
    """The places private scratch stays apart from, each with its name for a refusal (``check_scratch_location``)."""
    out = output_root.realpath()
    forbidden = [(r, f"the public root {str(r)!r} (${PUBLIC_ROOTS_ENV})") for r in configured_public_roots()]
    forbidden.append((out, f"the spec's output.root {str(out)!r}, where staged and published outputs are read"))
    # every release's outputs, not only this spec's (as check_analysis_out refuses them)
    forbidden += [(r, f"the ${OUTPUT_ROOTS_ENV} entry {str(r)!r}, where releases' staged and published outputs are read")
                  for r in output_root_locations()]
    forbidden += [(d, f"the data root {str(d)!r}, where a release's input glob could read it as input")
                  for d in data_root_locations(spec_dir)]
    # the key's directory itself (resolve_away_from_key refuses the files in it, not the directory or its parents)
    if with_key_dir:
        forbidden += [(Location.local(os.path.dirname(k)), "the noise key's directory") for k in key_paths(key_path)]
    return forbidden


def check_analysis_out(out_dir: str | os.PathLike[str], field: str, *, source: str, output_root: Location,
                       what: str) -> None:
    """Refuse a directory for an analysis's outputs (``dpops tune --out``, ``dpops simulate --out``) that is equal
    to or below a place whose files are published or read as public data.

    What those commands write is not differentially private: tune's results and page are exact functions of the
    rows it read (private ones with ``--i-understand-this-reads-private-data``), and simulate's are test-mode
    draws marked not publishable. So they never go

    - under the spec's ``output.root`` (its staged and published outputs, read by the release's consumers);
    - under an entry of ``$DPOPS_OUTPUT_ROOTS`` (every release's staged and published outputs);
    - under an entry of ``$DPOPS_PUBLIC_ROOTS`` (files dpops reads as public data, samples and partition lists,
      published verbatim from a publishable one).

    Checked before anything is read or recorded, and again by the writer once the directory exists (a symlink
    into a root). ``what`` names the outputs in the refusal (``SpecError``, exit 3), which names the field, the
    directory and the root, never a file's content. Local directories only (both commands write with ``Path``)."""
    out = Location.parse(os.path.expanduser(os.fspath(out_dir)), base=Location.local(os.getcwd())).realpath()
    places = [(output_root.realpath(), f"the spec's output.root {str(output_root)!r}")] if output_root.is_local else []
    places += [(r, f"${OUTPUT_ROOTS_ENV} entry {str(r)!r}") for r in output_root_locations() if r.is_local]
    places += [(r, f"${PUBLIC_ROOTS_ENV} entry {str(r)!r}") for r in configured_public_roots() if r.is_local]
    for root, name in places:
        if out.is_under(root):
            raise SpecError(
                f"{source}: {field} {os.fspath(out_dir)} is under {name}, where files are published or read as public "
                f"data; {what} are not differentially private and are written nowhere there. Choose a directory "
                "outside every output and public root")


def write_analysis_files(out_dir: str | os.PathLike[str], files: dict[str, bytes], field: str, *, source: str,
                         output_root: Location, what: str) -> dict[str, str]:
    """Write ``files`` (name -> bytes) into the analysis directory ``out_dir`` (created if missing), refused under
    an output or public root (``check_analysis_out``); return name -> path.

    Privacy reason: checking the directory by name and then writing ``out_dir/NAME`` by name follows whatever the
    names are when the write happens. Whoever can write the directory (a shared ``--out``) could leave
    ``results.json`` as a symlink, or a hard link, to a file in a public or output root, and tune's exact
    functions of the sample's rows (private ones under the private flag), or simulate's test-mode draws, were
    written through it into a published place. So the directory is opened once (``O_DIRECTORY | O_NOFOLLOW`` on
    its resolved path) and the directory the descriptor holds (``/proc/self/fd/N``) is checked; each file is
    written to a new name created exclusively in it (never through an existing link) and renamed over ``NAME``,
    which replaces a planted link instead of writing into its target."""
    import secrets

    check_analysis_out(out_dir, field, source=source, output_root=output_root, what=what)
    path = os.path.realpath(os.path.expanduser(os.fspath(out_dir)))
    os.makedirs(path, exist_ok=True)
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        dfd = os.open(path, flags)
    except OSError as exc:
        raise SpecError(f"{source}: {field} {os.fspath(out_dir)}: cannot open the directory "
                        f"({exc.strerror or exc}); nothing was written") from None
    try:
        held = opened_path(dfd) or path
        check_analysis_out(held, field, source=source, output_root=output_root, what=what)
        out = {}
        for name, data in files.items():
            if os.sep in name or name in ("", ".", ".."):
                raise ValueError(f"write_analysis_files: {name!r} is not a file name")
            tmp = f".{name}.{secrets.token_hex(8)}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                         0o666, dir_fd=dfd)
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except OSError:
                    pass
                raise
            out[name] = os.path.join(os.fspath(out_dir), name)
        return out
    finally:
        os.close(dfd)


def key_paths(key_path: str | os.PathLike[str] | None = None) -> list[str]:
    """The resolved noise key files known to this process (``key_path`` and ``DPOPS_NOISE_KEY_FILE``)."""
    out = []
    for p in (key_path, os.environ.get(KEY_FILE_ENV)):
        if p:
            out.append(os.path.realpath(os.path.expanduser(str(p))))
    return list(dict.fromkeys(out))


def resolve_away_from_key(path: str | os.PathLike[str] | Location, field: str, *, source: str,
                          key_path: str | os.PathLike[str] | None, instead: str) -> Location:
    """Resolve ``path`` (symlinks followed) and refuse it when it is the noise key file or lies in the key's
    directory: a spec that could name the key as an input, a public file or a sample would let its bytes reach
    a release or a manifest. ``instead`` says what the field should point at. One owner of this rule for
    every kind of file a spec names."""
    try:
        loc = path if isinstance(path, Location) else Location.parse(os.path.expanduser(os.fspath(path)),
                                                                     base=Location.local(os.getcwd()))
    except LocationError as exc:
        raise SpecError(f"{source}: {field} ({path}): {exc}") from None
    resolved = loc.realpath()
    if resolved.is_local:
        for key in key_paths(key_path):
            if resolved.path == key or os.path.dirname(resolved.path) == os.path.dirname(key):
                raise SpecError(
                    f"{source}: {field} ({path}) resolves to the noise key file or to a file in the key's directory; "
                    f"it is refused: point it at {instead}"
                )
    return resolved


def check_data_path(path: str | os.PathLike[str] | Location, field: str, *, source: str,
                    spec_dir: str | os.PathLike[str] | None, key_path: str | os.PathLike[str] | None = None) -> str:
    """Refuse ``path`` unless it resolves under a data root and away from the key; return the resolved path
    (a local path, or the URI of an object-store location).

    ``field`` is the spec field that named the file (``input.path``), ``source`` the spec's file name.
    """
    resolved = resolve_away_from_key(path, field, source=source, key_path=key_path,
                                     instead="a data file under the data roots")
    roots = data_root_locations(spec_dir)
    if not any(resolved.is_under(r) for r in roots):
        shown = ",".join(str(r) for r in roots)
        where = f"${DATA_ROOTS_ENV} ({shown})" if os.environ.get(DATA_ROOTS_ENV, "").strip() \
            else f"the spec's directory {shown or '?'} (${DATA_ROOTS_ENV} is unset)"
        raise SpecError(
            f"{source}: {field} ({path}) resolves outside the allowed data roots, {where}; move the file under a "
            f"data root or have the operator add its directory to ${DATA_ROOTS_ENV}"
        )
    return str(resolved)



def check_data_paths(paths: Iterable[str | os.PathLike[str]], field: str, *, source: str,
                     spec_dir: str | os.PathLike[str] | None, key_path: str | os.PathLike[str] | None = None) -> None:
    for p in paths:
        check_data_path(p, field, source=source, spec_dir=spec_dir, key_path=key_path)


@dataclass(frozen=True)
class PublicFile:
    """A public file that passed ``check_public_path``: its resolved location (local path or URI) and whether
    the operator marked its root publishable (``$DPOPS_PUBLIC_ROOTS_PUBLISHABLE``)."""

    location: str
    publishable: bool


def _overlaps(a: Location, b: Location) -> bool:
    return a.is_under(b) or b.is_under(a)


def configured_public_roots() -> list[Location]:
    """The entries of ``$DPOPS_PUBLIC_ROOTS`` as locations (empty when unset), without the check against the data
    roots ``public_root_locations`` adds: the one parse of the setting, for the rules that keep private files
    away from public ones (scratch, analysis outputs) as well as for reading public files."""
    return _root_locations(split_roots(os.environ.get(PUBLIC_ROOTS_ENV, "")), PUBLIC_ROOTS_ENV)


def public_root_locations(spec_dir: str | os.PathLike[str] | None) -> list[Location]:
    """The operator's public roots ``$DPOPS_PUBLIC_ROOTS`` (empty when unset), refused as a whole when one of
    them overlaps a data root (``data_root_locations(spec_dir)``) in either direction: a public root that
    contains or lies inside the data would make every private input a "public" file."""
    roots = configured_public_roots()
    data = data_root_locations(spec_dir)
    for r in roots:
        for d in data:
            if _overlaps(r, d):
                what = f"${DATA_ROOTS_ENV}" if os.environ.get(DATA_ROOTS_ENV, "").strip() \
                    else f"the spec's directory (${DATA_ROOTS_ENV} is unset)"
                raise SpecError(
                    f"${PUBLIC_ROOTS_ENV}: entry {str(r)!r} overlaps the data root {str(d)!r} ({what}): public files "
                    f"must live apart from every private input; give the operator's public data its own directory "
                    f"or prefix, disjoint from the data roots (fix the operator setting)")
    return roots


def publishable_root_locations(spec_dir: str | os.PathLike[str] | None) -> list[Location]:
    """``$DPOPS_PUBLIC_ROOTS_PUBLISHABLE``: the public roots whose files may be published as lists (in the
    manifest). Each entry must be equal to or below an entry of ``$DPOPS_PUBLIC_ROOTS``."""
    marked = _root_locations(split_roots(os.environ.get(PUBLISHABLE_PUBLIC_ROOTS_ENV, "")),
                             PUBLISHABLE_PUBLIC_ROOTS_ENV)
    if not marked:
        return []
    roots = public_root_locations(spec_dir)
    for m in marked:
        if not any(m.is_under(r) for r in roots):
            raise SpecError(f"${PUBLISHABLE_PUBLIC_ROOTS_ENV}: entry {str(m)!r} is not equal to or below an entry of "
                            f"${PUBLIC_ROOTS_ENV}; list it there too (fix the operator setting)")
    return marked


def check_public_path(path: str | os.PathLike[str] | Location, field: str, *, source: str,
                      spec_dir: str | os.PathLike[str] | None,
                      key_path: str | os.PathLike[str] | None = None) -> PublicFile:
    """Refuse ``path`` unless it resolves under a public root, outside every data root and away from the key;
    return where it resolves and whether it is publishable (module docstring, "Public files")."""
    resolved = resolve_away_from_key(path, field, source=source, key_path=key_path,
                                     instead=f"a public file under ${PUBLIC_ROOTS_ENV}")
    roots = public_root_locations(spec_dir)
    if not roots:
        raise SpecError(
            f"{source}: {field} ({path}): public files are read only from the operator's public roots "
            f"(${PUBLIC_ROOTS_ENV}), which is unset: have the operator set it to the directory or prefix of "
            "approved public data (apart from the data roots), or list the partitions inline (partitions.public)")
    for d in data_root_locations(spec_dir):
        if resolved.is_under(d):
            raise SpecError(
                f"{source}: {field} ({path}) resolves under the data root {str(d)!r}, where private inputs live; "
                f"a public file is published verbatim as partition labels, so it must come from ${PUBLIC_ROOTS_ENV} "
                "and never from a data root: move the approved public file to a public root")
    if not any(resolved.is_under(r) for r in roots):
        raise SpecError(
            f"{source}: {field} ({path}) resolves outside the operator's public roots ${PUBLIC_ROOTS_ENV} "
            f"({','.join(str(r) for r in roots)}); move the file under a public root or have the operator add its "
            f"directory to ${PUBLIC_ROOTS_ENV}")
    publishable = any(resolved.is_under(m) for m in publishable_root_locations(spec_dir))
    return PublicFile(str(resolved), publishable)


def opened_path(fd: int) -> str | None:
    """The path of what ``fd`` refers to (Linux ``/proc/self/fd/N``), None where the kernel does not say."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return target if target.startswith("/") and not target.endswith(" (deleted)") else None


def read_public_file(path: Location, field: str, *, source: str, spec_dir: str | os.PathLike[str] | None,
                     limit: int, key_path: str | os.PathLike[str] | None = None) -> tuple[bytes | None, PublicFile]:
    """Read a public file's bytes (None when larger than ``limit``) after ``check_public_path``, from the very
    file that passed the check.

    Privacy reason (issue 25 item 11): checking a path and then opening it again by name lets whoever can
    write a public root flip a symlink between the two, so the check sees the public file and the read gets
    another release's private input (published verbatim as partition labels). A local file is therefore
    opened ONCE; the path the kernel reports for that descriptor (``/proc/self/fd/N``) is what is checked,
    and the checked path must still be that same file (``st_dev``/``st_ino`` of ``fstat`` equal those of the
    checked path), else nothing is read. ``O_NONBLOCK`` so a FIFO planted there cannot hang the load; only a
    regular file is read. Object stores have no symlinks: checked, then read, as before."""
    import stat as stat_mod

    if not path.is_local:
        checked = check_public_path(path, field, source=source, spec_dir=spec_dir, key_path=key_path)
        from dpops.storage import files

        return files.read_bytes(path, limit=limit), checked
    where = f"{source}: {field} ({path})"
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path.local_path, flags)
    except OSError as exc:
        # Checked first, so a path outside the roots is refused as such (and not told apart by errno).
        check_public_path(path, field, source=source, spec_dir=spec_dir, key_path=key_path)
        raise SpecError(f"{where}: cannot read: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        opened = opened_path(fd)
        checked = check_public_path(Location.local(opened) if opened else path, field, source=source,
                                    spec_dir=spec_dir, key_path=key_path)
        if not stat_mod.S_ISREG(st.st_mode):
            raise SpecError(f"{where}: not a regular file")
        try:
            now = os.stat(checked.location)
        except OSError:
            now = None
        if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise SpecError(f"{where}: the file changed while it was checked (a symlink or a rename raced the "
                            "check); nothing was read. Keep approved public files at stable paths that only the "
                            "operator can change")
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return (None if size > limit else b"".join(chunks)), checked


__all__ = ["DATA_ROOTS_ENV", "OUTPUT_ROOTS_ENV", "KEY_FILE_ENV", "split_roots", "check_output_root",
           "output_root_locations", "data_root_locations", "data_roots", "key_paths", "check_data_path", "check_data_paths",
           "PUBLIC_ROOTS_ENV", "PUBLISHABLE_PUBLIC_ROOTS_ENV", "PublicFile",
           "public_root_locations", "publishable_root_locations", "check_public_path", "read_public_file", "opened_path",
           "check_analysis_out", "check_scratch_location", "write_analysis_files",
           "check_temp_scratch", "configured_public_roots"]
