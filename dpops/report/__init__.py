"""The reviewer's view of a budget scope: one self-contained HTML file.

    write_report(ledger, scope, out_path, manifests_dir=None, start=None, end=None) -> str
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dpops.errors import StorageError
from dpops.report.data import ReportData, gather


def build_report(ledger: Any, scope: str, out_path: str | os.PathLike[str], *, manifests_dir: str | None = None,
                 start: str | None = None, end: str | None = None) -> tuple[str, ReportData]:
    """Gather the scope's facts and render the HTML; returns (html, data) without writing."""
    from dpops.report.render import render_html

    data = gather(ledger, scope, manifests_dir, start, end)
    return render_html(data, out_path), data


def write_report(ledger: Any, scope: str, out_path: str | os.PathLike[str], *, manifests_dir: str | None = None,
                 start: str | None = None, end: str | None = None) -> str:
    text, _ = build_report(ledger, scope, out_path, manifests_dir=manifests_dir, start=start, end=end)
    out = Path(out_path)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, out)
    except OSError as exc:
        raise StorageError(f"cannot write report {out}: {exc.strerror or exc}") from None
    return str(out)


__all__ = ["ReportData", "build_report", "gather", "write_report"]
