"""One self-contained HTML file: inline CSS, PNGs as data URIs, no script, no network."""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Any

from dpops.report.plots import cumulative_plot, per_interval_plot

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.6em}h2{font-size:1.2em;border-bottom:1px solid #ccc;margin-top:1.6em}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 6px;text-align:left}
th{background:#f3f3f3}td.num{text-align:right;font-variant-numeric:tabular-nums}
.warn{background:#fff4e5;border-left:4px solid #f0a020;padding:.4em .8em;margin:.3em 0}
.state-refused{color:#b00}.state-spent_unpublished{color:#b60}.state-released{color:#070}
code{font-size:.9em}
"""


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x))


def _n(x: Any, digits: int = 6) -> str:
    if x is None:
        return "inf"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return _e(x)


def _rel(path: str | None, out_dir: Path) -> str | None:
    if not path:
        return None
    try:
        return os.path.relpath(path, out_dir)
    except ValueError:
        return path


def render_html(data: Any, out_path: str | os.PathLike[str]) -> str:
    s, st = data.scope, data.status
    out_dir = Path(out_path).resolve().parent
    window = f" from {data.start or 'the beginning'} to {data.end or 'now'}" if (data.start or data.end) else ""
    adj = " and ".join(data.adjacencies) or "not recorded (no manifests given)"
    adj_words = {"add_remove": "adding or removing all of one unit's data",
                 "replace": "replacing one unit's data by another's"}
    cap = f"epsilon = {s.cap:g} at delta = {s.delta:g}" if s.cap_unit == "epsilon" else f"zCDP rho = {s.cap:g}"
    p: list[str] = []
    a = p.append
    a(f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>dpops privacy report: {_e(s.name)}</title>"
      f"<style>{CSS}</style></head><body>")
    a(f"<h1>Privacy report for budget scope <code>{_e(s.name)}</code>{_e(window)}</h1>")
    a("<h2>What is protected</h2><ul id='definition'>")
    a(f"<li><b>Who is protected:</b> {_e(s.unit)} (unit id column <code>{_e(s.unit_column)}</code>)"
      + (f"; declared population n = {s.population}" if s.population else "") + ".</li>")
    a(f"<li><b>Against what change:</b> {_e(adj)} adjacency — "
      + _e("; ".join(adj_words.get(x, x) for x in data.adjacencies) or "see the manifests") + ".</li>")
    a(f"<li><b>Cap:</b> {_e(cap)} for all releases drawing from this scope together"
      + (f", per {s.bucket} bucket (the unit is period-scoped)" if s.bucket else "") + ".</li>")
    a(f"<li><b>Accountant:</b> <code>{_e(s.accountant)}</code> composes the mechanisms themselves (noise scales and "
      "sensitivities), not only their epsilon labels.</li>")
    for c in data.contribution:
        a(f"<li><b>Release {_e(c['release'])}:</b> each unit contributes to at most {c['max_partitions_per_unit']} "
          f"partitions and {c['max_rows_per_unit_per_partition']} rows per partition ({_e(c['adjacency'])}); "
          f"values clamped to {_e(c['value_bounds'])}.</li>")
    a("</ul>")

    a("<h2>Budget position (ledger status)</h2><table id='status'><tr><th>bucket</th><th>committed</th>"
      "<th>spent, unpublished</th><th>started</th><th>reserved</th><th>total</th><th>remaining</th><th>runs</th></tr>")
    for b in st.buckets:
        a(f"<tr data-bucket='{_e(b.bucket)}'>" + f"<td>{_e(b.bucket)}</td>" + "".join(
            f"<td class='num' data-field='{f}'>{_n(getattr(b, f), 12)}</td>"
            for f in ("committed", "spent_unpublished", "started", "reserved", "total", "remaining"))
          + f"<td>{_e(', '.join(f'{k}: {v}' for k, v in sorted(b.runs.items())))}</td></tr>")
    a("</table>")
    a(f"<p>Figures are {_e(st.unit)} at delta = {st.delta:g}, each group composed alone by {_e(st.accountant)}; "
      "'total' composes everything charged.</p>")

    if data.warnings:
        a("<h2>Warnings</h2><div id='warnings'>")
        for w in data.warnings:
            a(f"<div class='warn'>{_e(w)}</div>")
        a("</div>")

    a("<h2>Cumulative epsilon against the cap</h2>")
    a(f"<img alt='cumulative epsilon' src='data:image/png;base64,{cumulative_plot(data)}'>")
    a(f"<img alt='epsilon per interval' src='data:image/png;base64,{per_interval_plot(data)}'>")

    a("<h2>Accounting compared (the same charged history)</h2><table id='comparison'><tr><th>accountant</th>"
      f"<th>epsilon at delta={s.delta:g}</th></tr>")
    for ref, eps in data.comparison.items():
        a(f"<tr data-accountant='{_e(ref)}'><td>{_e(ref)}{' (the scope’s)' if ref == s.accountant else ''}</td>"
          f"<td class='num'>{_n(eps, 12)}</td></tr>")
    a("</table><p>Every accountant gives a valid upper bound; tighter ones (PLD, RDP) admit more releases "
      "under the same cap. Only the scope's own accountant decides what the ledger admits.</p>")

    a("<h2>Every run</h2><table id='runs'><tr><th>run</th><th>release</th><th>interval</th><th>outcome</th>"
      "<th>epsilon (alone)</th><th>restates</th><th>key id</th><th>manifest</th></tr>")
    for r in data.runs:
        link = _rel(r.manifest, out_dir)
        a(f"<tr data-run='{_e(r.run_id)}'><td><code>{_e(r.run_id[:16])}</code></td><td>{_e(r.release)}</td>"
          f"<td>[{_e(r.interval_start)}, {_e(r.interval_end)})</td>"
          f"<td class='state-{_e(r.state)}' data-field='state'>{_e(r.state)}"
          f"{' (test mode)' if r.test_mode else ''}</td>"
          f"<td class='num'>{_n(r.epsilon)}</td><td>{_e(r.restates[:16] if r.restates else '')}</td>"
          f"<td>{_e(r.key_id)}</td><td>{f'<a href={html.escape(link, quote=True)!r}>manifest</a>' if link else '—'}</td></tr>")
    a("</table>")

    refused = [r for r in data.runs if r.state in ("refused", "released")]
    a(f"<h2>Refused and refunded runs ({len(refused)})</h2><table id='refused'><tr><th>run</th><th>interval</th>"
      "<th>outcome</th><th>why</th></tr>")
    for r in refused:
        a(f"<tr><td><code>{_e(r.run_id[:16])}</code></td><td>[{_e(r.interval_start)}, {_e(r.interval_end)})</td>"
          f"<td>{_e(r.state)}</td><td>{_e(r.reason or 'no reason recorded')}</td></tr>")
    a("</table>")

    restated = [r for r in data.runs if r.restates]
    a(f"<h2>Restatements ({len(restated)})</h2><table id='restatements'><tr><th>run</th><th>interval</th>"
      "<th>restates</th><th>outcome</th></tr>")
    for r in restated:
        a(f"<tr><td><code>{_e(r.run_id[:16])}</code></td><td>[{_e(r.interval_start)}, {_e(r.interval_end)})</td>"
          f"<td><code>{_e(r.restates[:16])}</code></td><td>{_e(r.state)}</td></tr>")
    a("</table><p>A restatement is a fresh release over a corrected input, charged again; the original stays "
      "published and recorded.</p>")

    a("<h2>Noise per metric</h2><table id='noise'><tr><th>release</th><th>spec</th><th>metric</th><th>vector</th>"
      "<th>mechanism</th><th>noise std</th><th>95% interval width</th></tr>")
    for n in data.noise:
        a(f"<tr><td>{_e(n['release'])}</td><td><code>{_e(n['spec_hash'])}</code></td><td>{_e(n['metric'])}</td>"
          f"<td>{_e(n['vector'])}</td><td>{_e(n['mechanism'])}</td><td class='num'>{_n(n['std'])}</td>"
          f"<td class='num' title='{_e(n['ci_method'])}'>{_n(n['ci95_width'])}</td></tr>")
    a("</table><p>Widths come from public noise parameters only; each published value carries its own std and "
      "interval columns.</p>")
    a("</body></html>")
    return "".join(p)
