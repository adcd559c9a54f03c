"""The privacy budget as an operator reads it inside the Airflow UI (issue 21 item 17), Airflow-free.

``budget_page(ledger, manifests_dir, specs)`` builds the page model: every scope's cap, spent
(committed), in flight (started, reserved) and remaining, the scope total after each charge (the
"spend over time" chart), the intervals left open with their reasons (``dpops.gaps``, refusal
manifests), and the manifests one may download. ``run_view`` builds a DAG run's tab: its epsilon, the
scope total after it, the mechanisms, its manifest and that manifest's verification.
``render_page`` / ``render_run`` turn them into self-contained HTML (inline SVG, no script, no CDN).

Privacy: the page shows only what a manifest reader may see. The ledger's figures are budget figures
(public in every manifest); reasons are those the manifests and ``dpops gaps`` show. It never shows
exact counts (the private run log is not read), the noise key, the ledger URL (a failure to open the
ledger is named by its class only), input paths or the content of any input. ``manifest_file`` serves
only ``<run_id>.<outcome>.json`` files of the manifests directory, for a run id that is exactly 32
lowercase hex digits (``RunKey.run_id``): no other name, no path, no symlink leaves the directory.

Every figure a person reads goes through ``dpops.ledger.budget.format_budget`` (its one owner), so
the page agrees with ``dpops ledger status`` to the digit.

Who sees what (issue 25 item 11): Airflow grants read access per DAG, one DAG per release
(``dpops.dag_ids``). ``readable`` (given a set of DAG ids, those the reader may read; None: all) filters
everything: a manifest, a refusal or a gap is shown or downloaded only for a release whose DAG the reader
may read. A scope's figures (cap, total, remaining, spend over time) compose the charges of EVERY release
drawing from it, so they tell how much the other releases spent and when: a scope is shown only to a reader
who may read every release DAG drawing from it (``scope_dags``: its ledger runs, the specs and the manifests
naming it); otherwise the page says it is withheld and why, naming neither the unreadable DAGs nor a scope
none of whose DAGs the reader may read.
"""

from __future__ import annotations

import html
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dpops.dag_ids import dag_id_for, release_of_dag
from dpops.errors import DpopsError, InvalidParameter, StorageError
from dpops.ledger import Ledger, RunRecord, ScopeStatus
from dpops.ledger.budget import format_budget
from dpops.ledger.roles import session_write_privileges

RUN_ID = re.compile(r"[0-9a-f]{32}")
# Given DAG ids, those the reader may read (the plugin asks Airflow's auth manager); None: every DAG.
Readable = Callable[[set[str]], set[str]]
_MANIFEST_NAME = re.compile(r"([0-9a-f]{32})\.([a-z_]+)(?:\.corrects-[0-9a-f]{12})?\.json")


@dataclass(frozen=True)
class SpendPoint:
    """One point of the spend-over-time chart."""

    at: str  # when the run was charged (ledger created_at, UTC)
    run_id: str
    total: float  # the scope total after this charge (fullest bucket), in the cap's unit


@dataclass(frozen=True)
class OpenInterval:
    """An interval left unpublished, with the reason ``dpops gaps`` (or its refusal manifest) gives."""

    release: str
    interval_start: str
    interval_end: str
    status: str  # dpops.gaps.REASONS, or "refused" from a manifest
    reason: str
    run_id: str | None


@dataclass(frozen=True)
class ManifestRow:
    """A manifest one may download (by run id)."""

    run_id: str
    file: str  # base name only
    release: str
    scope: str
    interval_start: str
    interval_end: str
    outcome: str


@dataclass
class BudgetPage:
    """The Privacy budget page's model."""

    scopes: list[ScopeStatus] = field(default_factory=list)  # ``Ledger.status``, the one owner of the figures
    spend: dict[str, list[SpendPoint]] = field(default_factory=dict)
    open_intervals: list[OpenInterval] = field(default_factory=list)
    manifests: list[ManifestRow] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # what could not be read, without secrets


@dataclass(frozen=True)
class CheckRow:
    """One verification check of a run's manifest, as the run tab shows it."""

    name: str
    result: str  # ok | FAILED | skipped
    detail: str


@dataclass
class RunView:
    """A DAG run's Privacy budget tab: its ledger run, manifest and that manifest's verification."""

    dag_id: str
    release: str | None
    interval_start: str | None
    interval_end: str | None
    run_id: str | None = None
    state: str | None = None
    epsilon: float | None = None
    scope: str | None = None
    cap: float | None = None
    scope_total_after: float | None = None
    mechanisms: list[str] = field(default_factory=list)
    manifest: str | None = None
    verification: str = "no manifest"  # verified | verified (partly) | FAILED | no manifest
    checks: list[CheckRow] = field(default_factory=list)
    note: str = ""


def _spend(ledger: Ledger, scope: str) -> list[SpendPoint]:
    """The scope total after each charged run, in the ledger's order (``Ledger.totals_after``, its one owner);
    the last point is ``ledger status``'s total."""
    return [SpendPoint(r.created_at, r.run_id, total) for r, total in ledger.totals_after(scope)]


def manifest_rows(manifests_dir: str | os.PathLike[str] | None
                  ) -> tuple[list[ManifestRow], list[dict[str, Any]], list[str]]:
    """Manifest files directly in ``manifests_dir`` or one level below (``<release>/``), newest first.

    Returns (rows, the manifests read, problems). A file that is not a readable manifest is named, not shown."""
    from dpops.manifest.io import read_manifest

    if manifests_dir is None:
        return [], [], ["no manifests directory configured (DPOPS_MANIFESTS_DIR)"]
    root = Path(manifests_dir)
    if not root.is_dir():
        return [], [], [f"the manifests directory {root.name} does not exist"]
    rows, docs, problems = [], [], []
    for p in sorted([*root.glob("*.json"), *root.glob("*/*.json")]):
        if not _MANIFEST_NAME.fullmatch(p.name) or p.is_symlink():
            continue
        try:
            m = read_manifest(p)
        except DpopsError as exc:
            problems.append(f"{p.name}: not a readable manifest ({type(exc).__name__})")
            continue
        k = m["run_key"]
        rows.append(ManifestRow(m["run_id"], p.name, k["release"], m["spec"]["budget"]["scope"],
                                k["interval_start"], k["interval_end"], m["outcome"]["state"]))
        docs.append(m)
    rows.sort(key=lambda r: (r.interval_start, r.file), reverse=True)
    return rows, docs, problems


def _open_intervals(ledger: Ledger, docs: list[dict[str, Any]], specs: list[str],
                    manifests_dir: str | os.PathLike[str] | None) -> tuple[list[OpenInterval], list[str]]:
    """Intervals of each spec between its first and last known run that are not published, with the reason
    ``dpops gaps`` gives; refusal manifests of releases without a spec here are listed as they are."""
    from dpops.gaps import interval_statuses
    from dpops.ledger.model import parse_utc
    from dpops.spec import load_spec

    out: list[OpenInterval] = []
    problems: list[str] = []
    covered: set[str] = set()
    for path in specs:
        try:
            spec = load_spec(path)
        except DpopsError as exc:
            problems.append(f"spec {Path(path).name} does not load ({type(exc).__name__}); its gaps are not shown")
            continue
        known = [(r.key.interval_start, r.key.interval_end) for r in ledger.runs(release=spec.name)]
        known += [(m["run_key"]["interval_start"], m["run_key"]["interval_end"]) for m in docs
                  if m["run_key"]["release"] == spec.name]
        covered.add(spec.name)
        if not known:
            continue
        lo = min(parse_utc(s, "interval_start") for s, _ in known)
        hi = max(parse_utc(e, "interval_end") for _, e in known)
        try:
            sts = interval_statuses(spec, ledger, lo, hi, manifests_dir=manifests_dir)
        except DpopsError as exc:
            problems.append(f"gaps of {spec.name} could not be read ({type(exc).__name__})")
            continue
        out += [OpenInterval(spec.name, s.interval_start, s.interval_end, s.status, s.detail, s.run_id)
                for s in sts if s.is_gap]
    for m in docs:
        if m["outcome"]["state"] == "refused" and m["run_key"]["release"] not in covered:
            k = m["run_key"]
            out.append(OpenInterval(k["release"], k["interval_start"], k["interval_end"], "refused",
                                    m["outcome"].get("reason") or "refused", m["run_id"]))
    out.sort(key=lambda o: (o.release, o.interval_start))
    return out, problems


def scope_dags(ledger: Ledger, scope: str, docs: list[dict[str, Any]], specs: list[str]) -> set[str]:
    """The DAG ids of every release drawing from ``scope``: its ledger runs, the manifests and the specs that
    name it (a spec that does not load is skipped: ``_open_intervals`` names it)."""
    from dpops.spec import load_spec

    releases = {r.key.release for r in ledger.runs(scope=scope)}
    releases |= {m["run_key"]["release"] for m in docs if m["spec"]["budget"]["scope"] == scope}
    for path in specs:
        try:
            spec = load_spec(path)
        except DpopsError:
            continue
        if spec.budget.scope == scope:
            releases.add(spec.name)
    return {dag_id_for(r) for r in releases}


def _may_read(readable: Readable | None, releases: set[str]) -> set[str]:
    """The releases (of ``releases``) whose DAG the reader may read."""
    if readable is None:
        return set(releases)
    allowed = readable({dag_id_for(r) for r in releases})
    return {r for r in releases if dag_id_for(r) in allowed}


def budget_page(ledger: Ledger, manifests_dir: str | os.PathLike[str] | None, specs: list[str] | None = None,
                readable: Readable | None = None) -> BudgetPage:
    """The Privacy budget page's model (module docstring): read-only, public facts only, and of those only
    what ``readable`` lets the reader see (the module docstring's "Who sees what")."""
    page = BudgetPage()
    specs = list(specs or [])
    writable = session_write_privileges(ledger.db)
    if writable:  # the deployed page reads as the reader role (deploy/README.md): say so when it does not
        page.problems.append(f"this page connects to the ledger as a role that may write it ({', '.join(writable)}): "
                             "connect the api-server as the read-only role instead (deploy/README.md, "
                             "'The privacy budget in the Airflow UI')")
    rows, docs, problems = manifest_rows(manifests_dir)
    withheld_unseen = 0
    for sdef in sorted(ledger.scopes(), key=lambda s: s.name):
        dags = scope_dags(ledger, sdef.name, docs, specs)
        allowed = dags if readable is None else readable(set(dags))
        if dags - allowed:
            if allowed:  # the reader sees some of its releases, hence the scope's name in their manifests
                page.problems.append(
                    f"scope {sdef.name}: its figures are not shown: they compose the charges of {len(dags)} release "
                    f"DAGs and you may not read {len(dags - allowed)} of them (ask for read access to every DAG "
                    "drawing from the scope)")
            else:
                withheld_unseen += 1
            continue
        page.scopes.append(ledger.status(sdef.name))
        page.spend[sdef.name] = _spend(ledger, sdef.name)
    if withheld_unseen:
        page.problems.append(f"{withheld_unseen} more scope(s) not shown: you may read none of their release DAGs")
    releases = {r.release for r in rows}
    mine = _may_read(readable, releases)
    page.manifests = [r for r in rows if r.release in mine]
    docs = [m for m in docs if m["run_key"]["release"] in mine]
    page.problems += problems
    if readable is not None:
        from dpops.spec import load_spec

        loaded = []
        for path in specs:
            try:
                name = load_spec(path).name
            except DpopsError:
                continue  # a spec that does not load names no release the reader could be allowed
            if _may_read(readable, {name}):
                loaded.append(path)
        specs = loaded
    page.open_intervals, problems = _open_intervals(ledger, docs, specs, manifests_dir)
    page.problems += problems
    return page


def manifest_file(manifests_dir: str | os.PathLike[str] | None, run_id: str, readable: Readable | None = None,
                  outcome: str | None = None) -> Path:
    """The newest manifest file of ``run_id`` for download; anything but a 32-hex run id is refused.

    The id is checked before it touches the filesystem; the file found must be a regular file (not a
    symlink) whose resolved path is inside the resolved manifests directory. With ``readable``, a manifest
    of a release whose DAG the reader may not read is "not found", like a missing one (the answer does not
    confirm that the run exists). ``outcome``: only a manifest of that outcome (e.g. a run's refusal, not
    its later publication)."""
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
        raise InvalidParameter("a run id is 32 lowercase hex digits")
    if manifests_dir is None:
        raise StorageError("no manifests directory configured (DPOPS_MANIFESTS_DIR)")
    root = Path(manifests_dir).resolve()
    hits = [p for p in [*root.glob(f"{run_id}.*.json"), *root.glob(f"*/{run_id}.*.json")]
            if (m := _MANIFEST_NAME.fullmatch(p.name)) and not p.is_symlink() and p.is_file()
            and p.resolve().is_relative_to(root) and outcome in (None, m.group(2))]
    if not hits:
        raise StorageError(f"no manifest for run {run_id}")
    newest = max(hits, key=lambda p: (p.stat().st_mtime_ns, p.name))
    if readable is not None:
        from dpops.manifest.io import read_manifest

        if not _may_read(readable, {read_manifest(newest)["run_key"]["release"]}):
            raise StorageError(f"no manifest for run {run_id}")
    return newest


@dataclass(frozen=True)
class DagRunOutcome:
    """What a DAG run's reserve task decided (its XCom ``dpops_outcome``): the ledger run id it worked on and
    the outcome (reserved, refused, already_published). The tab describes THIS run, never another DAG run's."""

    run_id: str
    state: str


def _current(recs: list[RunRecord]) -> RunRecord | None:
    """The interval's current run, for a DAG run that has not reserved yet: the newest committed one, else
    the newest of any state (the tab then says it may be another DAG run's)."""
    committed = [r for r in recs if r.state == "committed"]
    pool = committed or recs
    return max(pool, key=lambda r: (r.updated_at, r.run_id)) if pool else None


def _mechanisms(m: dict[str, Any]) -> list[str]:
    plan = m.get("release_plan") or {}
    found = {str(x) for x in plan.get("mechanisms") or []}
    for metric in plan.get("metrics") or []:
        for v in metric.get("vectors") or []:
            if v.get("mechanism"):
                found.add(str(v["mechanism"]))
    return sorted(found)


def run_view(ledger: Ledger, manifests_dir: str | os.PathLike[str] | None, dag_id: str,
             interval_start: str | None, interval_end: str | None, outcome: DagRunOutcome | None = None,
             note: str = "") -> RunView:
    """The DAG-run tab: the ledger run this DAG run worked on (``outcome``, from its reserve task) and its
    manifest, verified against the ledger (the api-server holds no noise key and reads no published file:
    those checks say "skipped" with the command that runs them). ``interval_start``/``interval_end``: the
    interval the DAG run releases (``dpops.run_interval.resolve_run_interval``, the DAG's own rule); none
    given: ``note`` says why. Without an ``outcome`` (the run has not reserved yet) the tab shows the
    interval's current run and says it may be another DAG run's."""
    from dpops.ledger.model import normalize_utc
    from dpops.manifest.io import read_manifest_and_digest
    from dpops.manifest.verify import verify_manifest

    release = release_of_dag(dag_id)
    view = RunView(dag_id, release, interval_start, interval_end)
    if release is None or not interval_start or not interval_end:
        view.note = note or "not a dpops release run (no release or no data interval)"
        return view
    s, e = normalize_utc(interval_start), normalize_utc(interval_end)
    path: Path | None = None
    if outcome is not None and RUN_ID.fullmatch(outcome.run_id):
        ledger_rec = ledger.run(outcome.run_id)
        if outcome.state == "refused" or ledger_rec is None:
            # A refusal never reaches the ledger; the same run key may be reserved later by another DAG run,
            # whose state is not this DAG run's outcome (issue 28 item 2).
            view.run_id, view.state = outcome.run_id, "refused" if outcome.state == "refused" else outcome.state
            try:
                path = manifest_file(manifests_dir, outcome.run_id,
                                     outcome="refused" if outcome.state == "refused" else None)
            except DpopsError:
                path = None
            if ledger_rec is not None:
                view.note = (f"this DAG run was refused; the same run was later {ledger_rec.state} by another "
                             "attempt (see that DAG run's tab)")
            rec = None
        else:
            rec = ledger_rec
    else:
        recs = [r for r in ledger.runs(release=release)
                if normalize_utc(r.key.interval_start) == s and normalize_utc(r.key.interval_end) == e]
        rec = _current(recs)
        if rec is not None:
            view.note = ("this DAG run has not reserved budget (yet): shown is the interval's current ledger run, "
                         "which another DAG run may have made")
    if view.run_id is None and rec is not None:  # (a refusal of this DAG run already set its run id above)
        view.run_id, view.state, view.scope = rec.run_id, rec.state, rec.scope
        view.epsilon = rec.epsilon if math.isfinite(rec.epsilon) else None
        view.cap = ledger.scope(rec.scope).cap
        try:
            path = manifest_file(manifests_dir, rec.run_id)
        except DpopsError:
            path = None
    elif view.run_id is None:  # a refusal never reaches the ledger: its manifest is the record
        view.note = ""
        rows, _, _ = manifest_rows(manifests_dir)
        mine = [r for r in rows if r.release == release and normalize_utc(r.interval_start) == s
                and normalize_utc(r.interval_end) == e]
        if mine:
            view.run_id, view.state = mine[0].run_id, mine[0].outcome
            path = manifest_file(manifests_dir, mine[0].run_id)
        else:
            view.note = "no ledger run and no manifest for this interval yet"
            return view
    if path is None:
        view.note = "; ".join(x for x in (view.note, "no manifest for this run yet") if x)
        return view
    m, digest = read_manifest_and_digest(path)  # one read: the digest checked is of the document shown
    view.manifest = path.name
    view.mechanisms = _mechanisms(m)
    view.scope = view.scope or m["spec"]["budget"]["scope"]
    scope_doc = m["privacy"]["scope"] or {}  # a manifest written without a ledger has no scope position
    buckets = scope_doc.get("buckets") or []
    view.scope_total_after = max((float(b["total"]) for b in buckets), default=None)
    if view.cap is None and scope_doc.get("cap"):
        view.cap = float(scope_doc["cap"]["value"])
    if view.epsilon is None and m["privacy"]["run"].get("epsilon") is not None:
        view.epsilon = float(m["privacy"]["run"]["epsilon"])
    r = verify_manifest(m, ledger=ledger, source=path.name, file_name=path.name, file_digest=digest,
                        check_files=False)
    for c in r.checks:
        if c.skipped:
            view.checks.append(CheckRow(c.name, "skipped", c.skipped))
        else:
            detail = "; ".join(c.problems)[:500] or c.note or ""
            view.checks.append(CheckRow(c.name, "ok" if c.ok else "FAILED", detail))
    if m["outcome"]["state"] == "published":
        view.checks.append(CheckRow("published files", "skipped",
                                    f"the api-server reads no published file and holds no noise key: run "
                                    f"`dpops manifest verify {rec.run_id if rec else view.run_id}` where the key is"))
    failed = not r.ok
    partly = any(c.result == "skipped" for c in view.checks)
    view.verification = "FAILED" if failed else ("verified (partly)" if partly else "verified")
    return view


# ------------------------------------------------------------------------------------------------ HTML

def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:16px;color:#1b1f24;background:#fff}
h1{font-size:20px;margin:0 0 8px}h2{font-size:16px;margin:20px 0 6px}
table{border-collapse:collapse;margin:4px 0 12px}th,td{border:1px solid #d0d7de;padding:4px 8px;text-align:left}
td.n{text-align:right;font-variant-numeric:tabular-nums}th{background:#f6f8fa}
code{font-family:ui-monospace,monospace;font-size:12px;white-space:nowrap}.bad{color:#b42318;font-weight:600}.ok{color:#067647}
.muted{color:#57606a}svg{border:1px solid #d0d7de;background:#fff}
"""


def spend_svg(points: list[SpendPoint], cap: float, unit: str, width: int = 560, height: int = 200) -> str:
    """Scope total after each charge as a step line against the cap (inline SVG, x = charge order)."""
    left, right, top, bottom = 56, 12, 12, 30
    w, h = width - left - right, height - top - bottom
    ymax = max([cap, *[p.total for p in points]]) or 1.0
    n = max(len(points), 1)

    def x(i: float) -> float:
        return left + w * i / n

    def y(v: float) -> float:
        return top + h * (1.0 - v / ymax)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="scope total after each charge">']
    parts.append(f'<line x1="{left}" y1="{y(cap):.1f}" x2="{left + w}" y2="{y(cap):.1f}" stroke="#b42318" '
                 f'stroke-dasharray="4 3"/><text x="{left + w - 4}" y="{y(cap) - 4:.1f}" text-anchor="end" '
                 f'font-size="11" fill="#b42318">cap {_e(format_budget(cap))}</text>')
    # Charge i happens at x(i) and its total holds until the next charge: a step line.
    path = [f"M{x(0):.1f},{y(0):.1f}"]
    for i, p in enumerate(points):
        path.append(f"H{x(i):.1f}V{y(p.total):.1f}")
    if points:
        path.append(f"H{x(n):.1f}")
    parts.append(f'<path d="{"".join(path)}" fill="none" stroke="#0969da" stroke-width="2"/>')
    for i, p in enumerate(points):
        parts.append(f'<circle cx="{x(i):.1f}" cy="{y(p.total):.1f}" r="3" fill="#0969da"><title>'
                     f'{_e(p.at[:19])} run {_e(p.run_id[:12])}: total {_e(format_budget(p.total, cap))}'
                     '</title></circle>')
    parts.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + h}" stroke="#57606a"/>'
                 f'<line x1="{left}" y1="{top + h}" x2="{left + w}" y2="{top + h}" stroke="#57606a"/>')
    for v in (0.0, ymax / 2, ymax):
        parts.append(f'<text x="{left - 4}" y="{y(v) + 4:.1f}" text-anchor="end" font-size="11">'
                     f'{_e(format_budget(v))}</text>')
    if points:
        parts.append(f'<text x="{left}" y="{height - 10}" font-size="11">{_e(points[0].at[:10])}</text>'
                     f'<text x="{left + w}" y="{height - 10}" text-anchor="end" font-size="11">'
                     f'{_e(points[-1].at[:10])}</text>')
    parts.append(f'<text x="{left + w / 2:.0f}" y="{height - 10}" text-anchor="middle" font-size="11">'
                 f'charges, in the order made ({len(points)}); {_e(unit)}</text></svg>')
    return "".join(parts)


def _doc(title: str, body: str) -> str:
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f'<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; style-src \'unsafe-inline\'; '
            f'img-src data:"><style>{STYLE}</style></head><body>{body}</body></html>')


def render_page(page: BudgetPage, manifest_href: str = "manifests/") -> str:
    """The Privacy budget page; ``manifest_href`` + run id downloads a manifest (a relative link)."""
    b = [f"<h1>Privacy budget</h1><p class=muted>As of {_e(datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC'))}. "
         "Figures as <code>dpops ledger status</code> shows them; spent = committed (published).</p>"]
    b.append('<table id="scopes"><tr><th>scope</th><th>accountant</th><th>unit</th><th>cap</th><th>spent</th>'
             '<th>spent, unpublished</th><th>in flight: started</th><th>in flight: reserved</th><th>total</th>'
             '<th>remaining</th></tr>')
    for s in page.scopes:
        b.append(f'<tr data-scope="{_e(s.scope)}"><td>{_e(s.scope)}</td><td>{_e(s.accountant)}</td>'
                 f'<td>{_e(s.unit)}</td>'
                 + f'<td class="n" data-field="cap">{_e(format_budget(s.cap))}</td>'
                 + "".join(f'<td class="n" data-field="{f}">{_e(format_budget(getattr(s, f), s.cap))}</td>'
                           for f in ("committed", "spent_unpublished", "started", "reserved", "total", "remaining"))
                 + "</tr>")
    b.append("</table>")
    if not page.scopes:
        b.append("<p>No scope in the ledger yet (<code>dpops ledger scope create</code>).</p>")
    for s in page.scopes:
        b.append(f"<h2>Spend over time: {_e(s.scope)}</h2>{spend_svg(page.spend.get(s.scope, []), s.cap, s.unit)}")
    b.append("<h2>Refusals and gaps</h2>")
    if page.open_intervals:
        b.append('<table id="open"><tr><th>release</th><th>interval</th><th>status</th><th>why</th><th>run</th></tr>')
        for o in page.open_intervals:
            b.append(f"<tr><td>{_e(o.release)}</td><td><code>{_e(o.interval_start[:10])} → {_e(o.interval_end[:10])}"
                     f"</code></td><td class=bad>{_e(o.status)}</td><td>{_e(o.reason)}</td>"
                     f"<td><code>{_e((o.run_id or '')[:12])}</code></td></tr>")
        b.append("</table>")
    else:
        b.append("<p>None: every interval between the first and last run is published.</p>")
    b.append("<h2>Manifests</h2>")
    if page.manifests:
        b.append('<table id="manifests"><tr><th>release</th><th>interval</th><th>outcome</th><th>scope</th>'
                 '<th>manifest</th></tr>')
        for r in page.manifests:
            b.append(f"<tr><td>{_e(r.release)}</td><td><code>{_e(r.interval_start[:10])} → {_e(r.interval_end[:10])}"
                     f"</code></td><td>{_e(r.outcome)}</td><td>{_e(r.scope)}</td>"
                     f"<td><a href=\"{_e(manifest_href + r.run_id)}\" "
                     f"download>{_e(r.file)}</a></td></tr>")
        b.append("</table>")
    else:
        b.append("<p>No manifest yet.</p>")
    if page.problems:
        b.append("<h2>Not shown</h2><ul>" + "".join(f"<li>{_e(p)}</li>" for p in page.problems) + "</ul>")
    return _doc("Privacy budget", "".join(b))


def render_run(view: RunView, manifest_href: str = "../../manifests/") -> str:
    """A DAG run's Privacy budget tab."""
    b = ["<h1>Privacy budget of this run</h1>"]
    if view.run_id is None:
        b.append(f"<p>{_e(view.note)}</p>")
        return _doc("Privacy budget of this run", "".join(b))
    cap = view.cap
    rows = [("release", view.release), ("interval", f"{view.interval_start} → {view.interval_end}"),
            ("run", view.run_id), ("state", view.state), ("scope", view.scope),
            ("ε of this run", format_budget(view.epsilon, cap) if view.epsilon is not None else "—"),
            ("scope total after it",
             format_budget(view.scope_total_after, cap) if view.scope_total_after is not None else "—"),
            ("cap", format_budget(cap) if cap is not None else "—"),
            ("mechanisms", ", ".join(view.mechanisms) or "—")]
    b.append('<table id="run">' + "".join(f'<tr><th>{_e(k)}</th><td data-field="{_e(k)}">{_e(v)}</td></tr>'
                                          for k, v in rows))
    if view.manifest:
        b.append(f'<tr><th>manifest</th><td><a href="{_e(manifest_href + (view.run_id or ""))}" download>'
                 f'{_e(view.manifest)}</a></td></tr>')
    cls = "bad" if view.verification == "FAILED" else "ok"
    b.append(f'<tr><th>verification</th><td id="verification" class={cls}>{_e(view.verification)}</td></tr></table>')
    if view.checks:
        b.append('<table id="checks"><tr><th>check</th><th>result</th><th>detail</th></tr>'
                 + "".join(f"<tr><td>{_e(c.name)}</td><td class={'bad' if c.result == 'FAILED' else 'ok'}>"
                           f"{_e(c.result)}</td><td>{_e(c.detail)}</td></tr>" for c in view.checks) + "</table>")
    if view.note:
        b.append(f"<p class=muted>{_e(view.note)}</p>")
    return _doc("Privacy budget of this run", "".join(b))
