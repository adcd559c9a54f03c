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

Refusals are ``SpecError`` (exit 3) naming the spec field and the path, never the
file's content. Privacy reason: a file's content may be a secret (the key) or a
private value; the only thing a refusal reveals is the path the spec author wrote.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from dpops.errors import SpecError

DATA_ROOTS_ENV = "DPOPS_DATA_ROOTS"
KEY_FILE_ENV = "DPOPS_NOISE_KEY_FILE"


def data_roots(spec_dir: str | os.PathLike[str] | None) -> list[str]:
    """The resolved data roots: ``DPOPS_DATA_ROOTS`` if set, else the spec's own directory."""
    raw = os.environ.get(DATA_ROOTS_ENV, "")
    roots = [r for r in raw.split(os.pathsep) if r.strip()]
    if not roots:
        roots = [str(spec_dir)] if spec_dir is not None else []
    return [os.path.realpath(os.path.expanduser(r)) for r in roots]


def key_paths(key_path: str | os.PathLike[str] | None = None) -> list[str]:
    """The resolved noise key files known to this process (``key_path`` and ``DPOPS_NOISE_KEY_FILE``)."""
    out = []
    for p in (key_path, os.environ.get(KEY_FILE_ENV)):
        if p:
            out.append(os.path.realpath(os.path.expanduser(str(p))))
    return list(dict.fromkeys(out))


def _under(path: str, root: str) -> bool:
    try:
        return os.path.commonpath([path, root]) == root
    except ValueError:  # different drives (Windows) or a relative/absolute mix
        return False


def check_data_path(path: str | os.PathLike[str], field: str, *, source: str,
                    spec_dir: str | os.PathLike[str] | None, key_path: str | os.PathLike[str] | None = None) -> str:
    """Refuse ``path`` unless it resolves under a data root and away from the key; return the resolved path.

    ``field`` is the spec field that named the file (``input.path``), ``source`` the spec's file name.
    """
    resolved = os.path.realpath(os.path.expanduser(str(path)))
    for key in key_paths(key_path):
        if resolved == key or os.path.dirname(resolved) == os.path.dirname(key):
            raise SpecError(
                f"{source}: {field} ({path}) resolves to the noise key file or to a file in the key's directory; "
                "it is refused: point it at a data file under the data roots"
            )
    roots = data_roots(spec_dir)
    if not any(_under(resolved, r) for r in roots):
        where = f"${DATA_ROOTS_ENV} ({os.pathsep.join(roots)})" if os.environ.get(DATA_ROOTS_ENV, "").strip() \
            else f"the spec's directory {roots[0] if roots else '?'} (${DATA_ROOTS_ENV} is unset)"
        raise SpecError(
            f"{source}: {field} ({path}) resolves outside the allowed data roots, {where}; move the file under a "
            f"data root or have the operator add its directory to ${DATA_ROOTS_ENV}"
        )
    return resolved


def check_data_paths(paths: Iterable[str | os.PathLike[str]], field: str, *, source: str,
                     spec_dir: str | os.PathLike[str] | None, key_path: str | os.PathLike[str] | None = None) -> None:
    for p in paths:
        check_data_path(p, field, source=source, spec_dir=spec_dir, key_path=key_path)


def check_spec_paths(spec, key_path: str | os.PathLike[str] | None = None) -> None:
    """``dpops spec check``: the spec's files under the data roots and away from the key, for today's interval.

    ``input.path`` is a template, so this checks it formatted with today's date; ``release run`` checks the
    actual files of its interval again (after glob expansion) before anything is reserved.
    """
    from datetime import datetime, timedelta, timezone

    today = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    formatted = spec.input.path.format(start=today, end=today + timedelta(days=1))
    check_data_path(spec.resolve_path(formatted), "input.path", source=spec.source, spec_dir=spec.base_dir,
                    key_path=key_path)
    if spec.partitions.public_file is not None:
        check_data_path(spec.resolve_path(spec.partitions.public_file), "partitions.public_file",
                        source=spec.source, spec_dir=spec.base_dir, key_path=key_path)


__all__ = ["DATA_ROOTS_ENV", "KEY_FILE_ENV", "data_roots", "key_paths", "check_data_path", "check_data_paths",
           "check_spec_paths"]
