"""The reviewer's view of a budget scope: one self-contained HTML file.

    write_report(ledger, scope, out_path, manifests_dir=None, start=None, end=None, key=None, public_key=None) -> str
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dpops.errors import StorageError
from dpops.report.data import ReportData, gather


def build_report(ledger: Any, scope: str, out_path: str | os.PathLike[str], *, manifests_dir: str | None = None,
                 start: str | None = None, end: str | None = None, key: Any = None,
                 public_key: str | None = None, gx_project: str | None = None,
                 specs: Sequence[str] = ()) -> tuple[str, ReportData]:
    """Gather the scope's facts (verifying every manifest) and render the HTML; returns (html, data).

    ``specs``: release specs whose backfill gaps (``dpops.gaps``) the report lists."""
    from dpops.report.data import backfill_gaps
    from dpops.report.render import render_html

    data = gather(ledger, scope, manifests_dir, start, end, key=key, public_key=public_key, gx_project=gx_project)
    if specs:
        data.backfill_gaps, notes = backfill_gaps(ledger, specs, start, end, manifests_dir)
        data.gap_specs = [str(s) for s in specs]
        data.warnings = [*data.warnings, *notes]
    return render_html(data, out_path), data


def write_report(ledger: Any, scope: str, out_path: str | os.PathLike[str], *, manifests_dir: str | None = None,
                 start: str | None = None, end: str | None = None, key: Any = None,
                 public_key: str | None = None, gx_project: str | None = None) -> str:
    """Render, then write atomically: a fresh ``mkstemp`` file in the target directory (unpredictable
    name, created O_EXCL, so nobody can pre-plant it or a symlink in its place), then ``os.replace``
    onto the target (a rename replaces a symlink at ``out_path`` itself, never the file it points to)."""
    text, _ = build_report(ledger, scope, out_path, manifests_dir=manifests_dir, start=start, end=end, key=key,
                           public_key=public_key, gx_project=gx_project)
    return write_html(text, out_path)


def write_html(text: str, out_path: str | os.PathLike[str]) -> str:
    """Write ``text`` to ``out_path`` atomically without following planted symlinks (see ``write_report``)."""
    out = Path(out_path)
    directory = out.parent if str(out.parent) else Path(".")
    tmp_name = None
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=".report-", suffix=".tmp", dir=directory)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(fh.fileno(), 0o666 & ~umask)  # public facts only: readable as any file the user writes
        os.replace(tmp_name, out)
        tmp_name = None
    except OSError as exc:
        raise StorageError(f"cannot write report {out}: {exc.strerror or exc}") from None
    finally:
        if tmp_name is not None and os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return str(out)


__all__ = ["ReportData", "build_report", "gather", "write_html", "write_report"]
