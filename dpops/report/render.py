"""One self-contained HTML file: inline CSS, PNGs as data URIs, no script, no network.

Hardening (issue 14 item 6): a Content-Security-Policy meta forbids every script, every fetch and
every form, and allows only the report's own style (by hash) and inline images; every link is a
percent-encoded *relative* path (a manifest file named ``javascript:...;x.json`` cannot become a
script link); everything from a manifest or the ledger is HTML-escaped; a manifest that failed
verification is shown as FAILED and none of its numbers are presented as facts.
"""

from __future__ import annotations

import base64
import hashlib
import html
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

from dpops.ledger.budget import format_budget
from dpops.ledger.model import CHARGED_STATES as CHARGED  # the one owner of the charged states
from dpops.report.plots import cumulative_plot, per_interval_plot

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.6em}h2{font-size:1.2em;border-bottom:1px solid #ccc;margin-top:1.6em}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 6px;text-align:left}
th{background:#f3f3f3}td.num{text-align:right;font-variant-numeric:tabular-nums}
.warn{background:#fff4e5;border-left:4px solid #f0a020;padding:.4em .8em;margin:.3em 0}
.state-refused{color:#b00}.state-spent_unpublished{color:#b60}.state-released{color:#070}
code{font-size:.9em}.bad{color:#b00;font-weight:bold}.ok{color:#070}.flag{color:#a50}
tr.gap td{background:#f7f7f7;font-style:italic}td.iv{white-space:nowrap}#provenance td:first-child{font-weight:bold;width:16em}
"""


def _per_metric_bounds(c: Mapping[str, Any]) -> str:
    """The metrics bounded with their own contribution bounds (``contribution_bounds.per_metric``), escaped; ""
    without any (a report of releases without per-metric bounds reads as before)."""
    own = c.get("per_metric") or {}
    return "".join(f" (metric {_e(k)}: at most {_e(b['max_partitions_per_unit'])} partitions and "
                   f"{_e(b['max_rows_per_unit_per_partition'])} rows per partition)" for k, b in sorted(own.items()))


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x))


def _n(x: Any, digits: int = 6) -> str:
    if x is None:
        return "inf"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return _e(x)


def _sens(x: Any, mechanism: Any, norm: str) -> str:
    """A charged sensitivity; an unbounded or absent one says why instead of printing ``inf``
    (``dpops.manifest.build.sensitivity_not_charged``, shared with ``dpops manifest show``)."""
    from dpops.manifest.build import sensitivity_not_charged

    why = sensitivity_not_charged(x, mechanism, norm)
    return _n(x) if why is None else _e(why)


def _b(x: Any, cap: float | None = None) -> str:
    """A budget figure as the CLI shows it (``format_budget``: the cap's precision, no float crumbs); the exact
    value the ledger holds stays in ``data-value`` for machines and reviewers who want every digit."""
    if x is None or not isinstance(x, (int, float)):
        return _n(x)
    return f"<span data-value='{float(x)!r}'>{_e(format_budget(x, cap))}</span>"


def _charged_cell(r: Any) -> str:
    """The timeline's ε cell: what the run charged (``RunRow.charged_epsilon``); a refused or refunded run
    shows 0 and, in brackets, what it asked, so a column a reviewer adds up is the sum of real charges."""
    charged = r.charged_epsilon
    if charged is None or r.state in CHARGED or r.epsilon is None:
        return _b(charged)
    word = "refused" if r.state == "refused" else "refunded"
    return f"{_b(charged)} <span class='asked'>({word}; asked {_e(format_budget(r.epsilon))})</span>"


def _rel(path: str | None, out_dir: Path) -> str | None:
    if not path:
        return None
    try:
        return os.path.relpath(path, out_dir)
    except ValueError:
        return path


def href(path: str | None, out_dir: Path) -> str | None:
    """A link that can only ever be a relative file path: percent-encoded (no ':' survives, so no
    scheme such as ``javascript:`` or ``data:``), and prefixed with ``./`` when it does not start
    with ``.`` or ``/``. The result still needs HTML attribute escaping (done by the caller)."""
    rel = _rel(path, out_dir)
    if rel is None:
        return None
    q = quote(rel.replace(os.sep, "/"), safe="/._-~")
    return q if q.startswith(("./", "../", "/")) else "./" + q


def csp() -> str:
    digest = base64.b64encode(hashlib.sha256(CSS.encode("utf-8")).digest()).decode("ascii")
    return ("default-src 'none'; script-src 'none'; object-src 'none'; base-uri 'none'; form-action 'none'; "
            f"img-src data:; style-src 'sha256-{digest}'")


def _a(link: str | None, text: str) -> str:
    return f'<a href="{html.escape(link, quote=True)}" rel="noopener noreferrer">{_e(text)}</a>' if link else "—"


def render_html(data: Any, out_path: str | os.PathLike[str]) -> str:
    s, st = data.scope, data.status
    out_dir = Path(out_path).resolve().parent
    window = f" from {data.start or 'the beginning'} to {data.end or 'now'}" if (data.start or data.end) else ""
    adj_words = {"add_remove": "adding or removing all of one unit's data",
                 "replace": "replacing one unit's data by another's"}
    cap = f"epsilon = {s.cap:g} at delta = {s.delta:g}" if s.cap_unit == "epsilon" else f"zCDP rho = {s.cap:g}"
    adj = " and ".join(data.adjacencies) or "not recorded (no verified manifest)"
    p: list[str] = []
    a = p.append
    a(f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
      f"<meta http-equiv='Content-Security-Policy' content=\"{html.escape(csp(), quote=True)}\">"
      f"<meta name='referrer' content='no-referrer'>"
      f"<title>dpops privacy report: {_e(s.name)}</title><style>{CSS}</style></head><body>")
    a(f"<h1>Privacy report for budget scope <code>{_e(s.name)}</code>{_e(window)}</h1>")
    a(_provenance_html(data, out_dir))
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
          f"partitions and {c['max_rows_per_unit_per_partition']} rows per partition ({_e(c['adjacency'])})"
          f"{_per_metric_bounds(c)}; values clamped to {_e(c['value_bounds'])}.</li>")
    for est in data.estimations:
        r = est["result"]
        got = [f"L0 = {r['max_partitions_per_unit']}, Linf = {r['max_rows_per_unit_per_partition']}"
               ] if r.get("max_partitions_per_unit") is not None else []
        got += [f"{col} in [{lo:g}, {hi:g}]" for col, (lo, hi) in sorted((r.get("bounds") or {}).items())]
        a(f"<li id='estimation-{_e(est['run_id'])}'><b>Bounds estimated privately for release {_e(est['release'])}</b> "
          f"(dpops estimate, run <code>{_e(est['run_id'])}</code>, interval {_e(est['interval'][0])}): "
          f"{_e('; '.join(got))}, at epsilon = {est['epsilon']:g} charged to this scope (quantile "
          f"{est['quantile']:g} of the bounded data). Releases naming this run use these bounds.</li>")
    a("</ul>")

    a("<h2>Budget position (ledger status)</h2><table id='status'><tr><th>bucket</th><th>committed</th>"
      "<th>spent, unpublished</th><th>started</th><th>reserved</th><th>total</th><th>remaining</th><th>runs</th></tr>")
    for b in st.buckets:
        a(f"<tr data-bucket='{_e(b.bucket)}'>" + f"<td>{_e(b.bucket)}</td>" + "".join(
            f"<td class='num' data-field='{f}'>{_b(getattr(b, f), st.cap)}</td>"
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
        shown = _b(eps, s.cap) if eps is not None else _e(
            f"n/a (pure ε-DP: {ref} gives no finite ε at δ={s.delta:g}; it needs δ > 0)" if s.delta == 0
            else f"n/a ({ref} gives no finite ε at δ={s.delta:g} for this history)")
        a(f"<tr data-accountant='{_e(ref)}'><td>{_e(ref)}{' (the scope’s)' if ref == s.accountant else ''}</td>"
          f"<td class='num'>{shown}</td></tr>")
    a("</table><p>Every accountant gives a valid upper bound; tighter ones (PLD, RDP) admit more releases "
      "under the same cap. Only the scope's own accountant decides what the ledger admits.</p>")

    a("<h2>Timeline (date order; refusals and gaps in place)</h2><table id='runs'><tr><th>interval</th>"
      "<th>release</th><th>outcome</th><th>epsilon charged (alone)</th><th>schedule</th><th>manifest verification</th>"
      "<th>run</th><th>restates</th><th>key id</th><th>manifest</th></tr>")
    for r in data.runs:
        if r.kind == "gap":
            a(f"<tr class='gap' data-kind='gap'><td class='iv'>[{_e(r.interval_start)}, {_e(r.interval_end)})</td>"
              f"<td>{_e(r.release)}</td><td data-field='state'>gap</td><td class='num'>—</td>"
              f"<td class='flag'>{_e('; '.join(r.flags))}</td><td></td><td></td><td></td><td></td><td></td></tr>")
            continue
        vclass = "bad" if r.verification == "FAILED" else ("ok" if r.verification.startswith("verified") else "")
        a(f"<tr data-kind='run' data-run='{_e(r.run_id)}'><td class='iv'>[{_e(r.interval_start)}, {_e(r.interval_end)})</td>"
          f"<td>{_e(r.release)}</td><td class='state-{_e(r.state)}' data-field='state'>{_e(r.state)}"
          f"{' (test mode)' if r.test_mode else ''}</td>"
          f"<td class='num' data-field='epsilon'>{_charged_cell(r)}</td>"
          f"<td class='flag'>{_e('; '.join(r.flags))}</td>"
          f"<td class='{vclass}' data-field='verification'>{_e(r.verification)}</td>"
          f"<td><code>{_e(r.run_id[:16])}</code></td><td>{_e(r.restates[:16] if r.restates else '')}</td>"
          f"<td>{_e(r.key_id)}</td><td>{_a(href(r.manifest, out_dir), 'manifest')}</td></tr>")
    charged_runs = [r for r in data.runs if r.kind == "run" and r.charged_epsilon is not None]
    column_sum = sum(float(r.charged_epsilon or 0.0) for r in charged_runs)
    a(f"</table><p id='runs-sum'>The epsilon column is what each run charged on its own: refused and refunded runs "
      f"charged nothing (0; what they asked is in brackets). The column adds up to "
      f"<span data-field='column_sum'>{_b(column_sum, st.cap)}</span> (every charge added, basic composition, an "
      f"upper bound of what these runs composed); the ledger's scope total, every charged run composed by the "
      f"{_e(s.accountant)} accountant, is <span data-field='scope_total'>{_b(float(st.total), st.cap)}</span>, "
      f"the figure checked against the cap {_b(float(st.cap))}.</p>")
    a(_gaps_html(data))
    a(_releases_html(data))
    a(_verification_html(data, out_dir))

    refused = [r for r in data.runs if r.kind == "run" and r.state in ("refused", "released")]
    a(f"<h2>Refused and refunded runs ({len(refused)})</h2><table id='refused'><tr><th>run</th><th>interval</th>"
      "<th>outcome</th><th>why</th></tr>")
    for r in refused:
        a(f"<tr><td><code>{_e(r.run_id[:16])}</code></td><td class='iv'>[{_e(r.interval_start)}, {_e(r.interval_end)})</td>"
          f"<td>{_e(r.state)}</td><td>{_e(r.reason or 'no reason recorded')}</td></tr>")
    a("</table>")

    fresh = [r for r in data.runs if r.kind == "run" and r.replaces_spent]
    a(f"<h2>Fresh attempts after a spent run ({len(fresh)})</h2><table id='fresh-attempts'><tr><th>run</th>"
      "<th>interval</th><th>replaces spent run</th><th>outcome</th><th>reason (the operator's)</th></tr>")
    for r in fresh:
        # The reason is why the interval was charged twice: a reviewer must read it beside the second charge.
        a(f"<tr><td><code>{_e(r.run_id[:16])}</code></td><td>[{_e(r.interval_start)}, {_e(r.interval_end)})</td>"
          f"<td><code>{_e((r.replaces_spent or '')[:16])}</code></td><td>{_e(r.state)}</td>"
          f"<td data-field='fresh_reason'>{_e(r.fresh_reason or 'no reason recorded')}</td></tr>")
    a("</table><p>A fresh attempt (dpops release run --fresh-attempt) publishes an interval whose run was spent "
      "unpublished (its noise may exist, so that charge stays): fresh noise, charged again.</p>")

    restated = [r for r in data.runs if r.kind == "run" and r.restates]
    a(f"<h2>Restatements ({len(restated)})</h2><table id='restatements'><tr><th>run</th><th>interval</th>"
      "<th>restates</th><th>outcome</th></tr>")
    for r in restated:
        a(f"<tr><td><code>{_e(r.run_id[:16])}</code></td><td class='iv'>[{_e(r.interval_start)}, {_e(r.interval_end)})</td>"
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


def _provenance_html(data: Any, out_dir: Path | None = None) -> str:
    pv = data.provenance
    lv = pv.get("ledger_verify", {})
    mf, fl, sg = pv.get("manifests", {}), pv.get("files", {}), pv.get("signatures", {})
    ledger_ok = "verified" if lv.get("ok") else "FAILED"
    rows = [
        ("generated_at", "generated at", _e(pv.get("generated_at"))),
        ("dpops_version", "dpops version", _e(pv.get("dpops_version"))),
        ("ledger_url", "ledger", f"<code>{_e(pv.get('ledger_url'))}</code>"),
        ("head_hash", "chain head", f"<code>{_e(lv.get('head_hash'))}</code> ({_e(lv.get('entries'))} entries)"),
        ("ledger_verify", "ledger verify",
         f"<span class='{'ok' if lv.get('ok') else 'bad'}'>{ledger_ok}</span>"
         + (f" — first bad entry {_e(lv.get('first_bad_entry'))}: {_e('; '.join(lv.get('problems') or []))}"
            if not lv.get("ok") else "")),
        ("checkpoint", "checkpoint", _e(pv.get("checkpoint"))),
        ("manifests", "manifest verification",
         f"<span data-verified='{mf.get('verified', 0)}' data-partly='{mf.get('partly', 0)}' "
         f"data-failed='{mf.get('failed', 0)}'>{mf.get('verified', 0)} verified, {mf.get('partly', 0)} verified "
         f"with checks that could not run, <span class='{'bad' if mf.get('failed') else ''}'>{mf.get('failed', 0)} "
         f"FAILED</span> of {mf.get('total', 0)}</span>"),
        ("files", "published-file fingerprints",
         f"{fl.get('ok', 0)} match, <span class='{'bad' if fl.get('changed') else ''}'>{fl.get('changed', 0)} "
         f"CHANGED</span>, {fl.get('not_checked', 0)} not checked"),
        ("data_docs", "Great Expectations Data Docs",
         (_a(href(pv["data_docs"], out_dir), "Data Docs of the output checkpoints")
          + f" (not inside this file: on the machine that wrote it, at <code>{_e(pv['data_docs'])}</code>; a copy "
            "of the report keeps this path, not the pages)") if pv.get("data_docs") and out_dir
         else "none (no GX project given)"),
        ("signatures", "manifest signatures",
         f"{sg.get('valid', 0)} valid, {sg.get('unverified', 0)} unverified (no public key), "
         f"{sg.get('FAILED', 0)} FAILED, {sg.get('none', 0)} unsigned"),
    ]
    return ("<h2>Provenance</h2><table id='provenance'>"
            + "".join(f"<tr data-field='{f}'><td>{label}</td><td>{value}</td></tr>" for f, label, value in rows)
            + "</table>")


def _gaps_html(data: Any) -> str:
    """Intervals of each given spec's grid with no publication, and why (dpops gaps)."""
    specs = getattr(data, "gap_specs", [])
    gaps = getattr(data, "backfill_gaps", [])
    if not specs:
        return ("<h2>Backfill gaps</h2><p id='gaps'>Not listed: give <code>--spec SPEC</code> to list the intervals "
                "of each release's schedule that have no publication and why (<code>dpops gaps</code>).</p>")
    out = [f"<h2>Backfill gaps ({len(gaps)})</h2><table id='gaps'><tr><th>release</th><th>interval</th>"
           "<th>why</th><th>run</th><th>detail</th></tr>"]
    for g in gaps:
        out.append(f"<tr data-status='{_e(g['status'])}'><td>{_e(g['release'])}</td>"
                   f"<td class='iv'>[{_e(g['interval_start'])}, {_e(g['interval_end'])})</td>"
                   f"<td data-field='status'>{_e(g['status'].replace('_', ' '))}</td>"
                   f"<td><code>{_e(g['run_id'] or '')}</code></td><td>{_e(g['detail'])}</td></tr>")
    out.append(f"</table><p>Specs checked: {_e(', '.join(specs))}. Intervals follow each spec's grid (unit period "
               "or cron schedule); refusals are known from their manifests only.</p>")
    return "".join(out)


def _releases_html(data: Any) -> str:
    out = ["<h2>Each release: what was protected and what it cost</h2><div id='releases'>"]
    for d in data.releases:
        iv = f"[{_e(d['interval'][0])}, {_e(d['interval'][1])})"
        if not d["trusted"]:
            out.append(f"<div class='release' data-run='{_e(d['run_id'])}' data-trusted='false'><h3>{_e(d['release'])} "
                       f"{iv}</h3><p class='bad'>manifest {_e(d['status'])}: not trusted, its numbers are not "
                       "shown</p></div>")
            continue
        u, c = d["unit"], d["contribution"]
        unit = (f"{_e(u['description'])} (column <code>{_e(u['column'])}</code>, {_e(u['adjacency'])} adjacency"
                + (f", per {_e(u['period'])}" if u.get("period") else "")
                + (", record-level" if u.get("record_level") else "") + ")")
        out.append(f"<div class='release' data-run='{_e(d['run_id'])}' data-trusted='true'>"
                   f"<h3>{_e(d['release'])} {iv} — {_e(d['outcome'])}</h3><ul>"
                   f"<li><b>Unit:</b> {unit}</li>"
                   f"<li><b>Bounds:</b> at most {_e(c['max_partitions_per_unit'])} partitions per unit and "
                   f"{_e(c['max_rows_per_unit_per_partition'])} rows per unit per partition{_per_metric_bounds(c)}; "
                   f"values clamped to {_e(d['value_bounds'])}</li>"
                   + (f"<li><b>Privacy:</b> this run alone epsilon = <span data-field='run_epsilon'>"
                      f"{_b(d['run_epsilon'])}</span> at delta = {_n(d['delta'])}" if d.get("charged", True) else
                      "<li><b>Privacy:</b> this run charged nothing (refused or refunded: not a charge to add up); it "
                      f"asked epsilon = <span data-field='run_epsilon'>{_b(d['run_epsilon'])}</span> at delta = "
                      f"{_n(d['delta'])}")
                   + "; the scope's total after it "
                   f"<span data-field='scope_total_after'>{_b(d['scope_total_after'], data.scope.cap)}</span> "
                   f"({_e(d['scope_unit'])}); accountant <code data-field='accountant'>{_e(d['accountant'])}</code>"
                   f"</li>{_tuning_item(d.get('tuning'))}</ul><table class='mechanisms'><tr><th>metric</th><th>vector</th><th>mechanism</th>"
                   "<th>scale</th><th>std</th><th>L1 sensitivity</th><th>L2 sensitivity</th></tr>")
        for m in d["mechanisms"]:
            out.append(f"<tr><td>{_e(m['metric'])}</td><td>{_e(m['vector'])}</td><td>{_e(m['mechanism'])}</td>"
                       f"<td class='num'>{_n(m['scale'])}</td><td class='num'>{_n(m['std'])}</td>"
                       f"<td class='num'>{_sens(m['l1'], m['mechanism'], 'L1')}</td>"
                       f"<td class='num'>{_sens(m['l2'], m['mechanism'], 'L2')}</td></tr>")
        out.append("</table>")
        targets = d.get("accuracy_targets") or []
        if targets:
            out.append("<table class='targets'><tr><th>accuracy target</th><th>target</th><th>predicted</th>"
                       "<th>met</th></tr>")
            for t in targets:
                out.append(f"<tr data-met='{'true' if t['met'] else 'false'}'><td>{_e(t['description'])}</td>"
                           f"<td class='num'>{_n(t['target'])}</td><td class='num'>{_n(t['predicted'])}</td>"
                           f"<td class='{'ok' if t['met'] else 'bad'}'>{'yes' if t['met'] else 'NO'}</td></tr>")
            out.append("</table>")
        out.append("</div>")
    out.append("</div>")
    return "".join(out)


def _tuning_item(t: dict[str, Any] | None) -> str:
    """The release's ``provenance.tuning`` as one list item: the statement first, in words a reviewer reads."""
    if not t:
        return ""
    d = t["data"]
    if d["source"] == "private":
        where = (f"recorded in the ledger as entry #{_e(d['ledger_entry'])} on scope <code>{_e(d['scope'])}</code> "
                 f"at {_e(d['read_at'])}; not differentially private")
        cls = "bad"
    else:
        where = f"public sample <code>{_e(d['sample'])}</code>"
        cls = "ok"
    return (f"<li data-field='tuning' data-source='{_e(d['source'])}'><b>Parameters:</b> "
            f"<span class='{cls}'>{_e(t['statement'])}</span> (dpops tune, {_e(t['candidates'])} candidates, "
            f"chose {_e(t['candidate'])}; {where})</li>")


def _verification_html(data: Any, out_dir: Path) -> str:
    out = ["<h2>Manifest verification</h2><table id='verification'><tr><th>manifest</th><th>result</th>"
           "<th>published files</th><th>signature</th><th>problems / not checked</th></tr>"]
    for path, c in sorted(data.checks.items()):
        detail = "; ".join(c.problems[:3]) + (f" (and {len(c.problems) - 3} more)" if len(c.problems) > 3 else "")
        if not c.problems:
            detail = "; ".join(c.not_checked)
        out.append(f"<tr data-status='{_e(c.status)}'><td>{_a(href(path, out_dir), os.path.basename(path))}</td>"
                   f"<td class='{'bad' if not c.ok else 'ok'}'>{_e(c.status)}</td><td>{_e(c.files)}</td>"
                   f"<td>{_e(c.signature)}</td><td>{_e(detail)}</td></tr>")
    out.append("</table>")
    return "".join(out)
