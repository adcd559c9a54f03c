"""An offline Data Docs index for the GX project, built from the validation results (issue 21 item 16).

GX 1.24's own ``index.html`` loads bootstrap, jQuery and bootstrap-table from public CDNs and lists
the validations with that JavaScript: offline (an operator's air-gapped host, a reviewer's laptop)
it renders unstyled and lists nothing. Its validation pages stay readable. So dpops writes its own
``index.html`` beside them, from the validation result files: one static table (release run, time,
suite, verdict, expectation counts, the failed expectations by type and column), inline CSS, no
script, a Content-Security-Policy that allows no network request at all, and relative links to GX's
pages. GX's own index is kept as ``gx_index.html``.

Privacy: the page holds what the validation results hold about the NOISY output, check names and
verdicts only (no observed values, which the results may quote), so it is post-processing like
the rest of the Data Docs. It is built inside the GX sandbox (``dpops.gx_project``); every string
from a result file is HTML-escaped.
"""

from __future__ import annotations

import html
import json
import os
from dataclasses import dataclass
from pathlib import Path

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; base-uri 'none'; form-action 'none'"
_MAX_RESULT_BYTES = 64 << 20


@dataclass(frozen=True)
class ValidationRow:
    """One validation result as the index shows it."""

    run_name: str
    run_time: str
    suite: str
    success: bool
    evaluated: int
    failed: list[str]
    page: str | None  # relative link to GX's page for this result


def _text(value: object, limit: int = 200) -> str:
    s = str(value) if value is not None else ""
    return s if len(s) <= limit else s[:limit] + "..."


def _obj(value: object) -> dict[str, object]:
    return value if isinstance(value, dict) else {}


def _row(path: Path, validations: Path, site: Path) -> ValidationRow | None:
    try:
        if path.stat().st_size > _MAX_RESULT_BYTES:
            return None
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    meta = _obj(doc.get("meta"))
    run = _obj(meta.get("run_id"))
    stats = _obj(doc.get("statistics"))
    failed = []
    results = doc.get("results")
    for r in results if isinstance(results, list) else []:
        if isinstance(r, dict) and r.get("success") is False:
            cfg = _obj(r.get("expectation_config"))
            kw = _obj(cfg.get("kwargs"))
            cols = [f"{k}={_text(kw[k], 64)}" for k in ("column", "column_A", "column_B") if k in kw]
            failed.append(_text(cfg.get("type")) + (f"({', '.join(cols)})" if cols else ""))
    rel = path.relative_to(validations).with_suffix(".html")
    page = site / "validations" / rel
    evaluated = stats.get("evaluated_expectations")
    return ValidationRow(run_name=_text(run.get("run_name")), run_time=_text(run.get("run_time")),
                         suite=_text(doc.get("suite_name")), success=doc.get("success") is True,
                         evaluated=evaluated if isinstance(evaluated, int) else 0, failed=failed,
                         page=f"validations/{rel.as_posix()}" if page.is_file() else None)


def collect(validations: Path, site: Path) -> list[ValidationRow]:
    """Every readable validation result under ``validations``, newest first."""
    rows = []
    for dirpath, _dirs, files in os.walk(validations, followlinks=False):
        for name in files:
            if name.endswith(".json") and not name.startswith("."):
                row = _row(Path(dirpath) / name, validations, site)
                if row is not None:
                    rows.append(row)
    return sorted(rows, key=lambda r: (r.run_time, r.suite), reverse=True)


_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5rem;color:#1b1b1b}
table{border-collapse:collapse;width:100%}th,td{border-bottom:1px solid #ddd;padding:.35rem .5rem;text-align:left;
vertical-align:top}th{background:#f3f3f3}td.ok{color:#0a6b2d;font-weight:600}td.bad{color:#a40e26;font-weight:600}
code{font-size:12px}.note{color:#555}
"""


def render(rows: list[ValidationRow]) -> str:
    """The offline index page (no script, no external resource)."""
    e = html.escape
    body = []
    for r in rows:
        suite = f'<a href="{e(r.page, quote=True)}">{e(r.suite)}</a>' if r.page else e(r.suite)
        failed = "<br>".join(f"<code>{e(f)}</code>" for f in r.failed) or "&ndash;"
        verdict = '<td class="ok">passed</td>' if r.success else '<td class="bad">FAILED</td>'
        body.append(f"<tr><td><code>{e(r.run_name)}</code></td><td>{e(r.run_time)}</td><td>{suite}</td>{verdict}"
                    f"<td>{r.evaluated}</td><td>{failed}</td></tr>")
    n_bad = sum(not r.success for r in rows)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">"
        "<title>dpops: Great Expectations validations</title>"
        f"<style>{_STYLE}</style></head><body>"
        "<h1>Great Expectations validations of the noisy outputs</h1>"
        f"<p id=\"summary\">{len(rows)} validation result(s), {n_bad} failed. Works offline; "
        "<a href=\"gx_index.html\">GX's own index</a> needs its CDN assets.</p>"
        "<table id=\"validations\"><thead><tr><th>release run</th><th>validated at</th><th>suite</th><th>verdict</th>"
        "<th>expectations</th><th>failed expectations</th></tr></thead><tbody>"
        + "".join(body) + "</tbody></table>"
        "<p class=\"note\">Check names and verdicts only; the values checked are the published, noisy ones.</p>"
        "</body></html>\n")


def write_offline_index(validations: Path, site: Path) -> Path:
    """Keep GX's index as ``gx_index.html`` and write dpops' offline ``index.html``; return its path."""
    site.mkdir(parents=True, exist_ok=True)
    gx_index, index = site / "gx_index.html", site / "index.html"
    if index.is_file():
        os.replace(index, gx_index)
    tmp = site / ".index.html.tmp"
    tmp.write_text(render(collect(validations, site)), encoding="utf-8")
    os.replace(tmp, index)
    return index
