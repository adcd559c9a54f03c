"""The demo's final report (rich): one day's published statistics, the ledger, refusals, gaps, manifests."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from demo_setup import DEMO_RELEASE, DEMO_SCOPE, DemoPaths
from demo_steps import IntervalResult


def report(paths: DemoPaths, ivs: list, scheduled: list[IntervalResult], backfill: list[IntervalResult], *,
           console: Any) -> None:
    from rich.table import Table

    published = [r for r in backfill if r.outcome in ("published", "served")]
    if published:
        _published_table(paths, published[0], console)

    from dpops.ledger import open_ledger

    ledger = open_ledger(paths.ledger_url)
    try:
        st = ledger.status(DEMO_SCOPE)
        verify = ledger.verify()
    finally:
        ledger.close()
    t = Table(title=f"Ledger scope {DEMO_SCOPE!r} ({st.accountant}, {paths.ledger_url})")
    for col in ("cap", "published", "spent, unpublished", "in flight", "remaining", "verify"):
        t.add_column(col, justify="right")
    ok = getattr(verify, "ok", getattr(verify, "valid", None))
    t.add_row(f"{st.cap:g}", f"{st.committed:.6g}", f"{st.spent_unpublished:.6g}", f"{st.reserved + st.started:.6g}",
              f"{max(0.0, round(st.remaining, 6)):.6g}", "[green]passed[/]" if ok else f"[red]{verify}[/]")
    console.print(t)

    t = Table(title="Every interval: daily schedule, then the backfill")
    for col in ("day", "schedule", "backfill", "epsilon charged by this demo run", "why"):
        t.add_column(col, no_wrap=col == "day", overflow="fold")
    by_day = {r.day: r for r in scheduled}
    for r in backfill:
        first = by_day.get(r.day)
        charged = (first.charged if first else 0.0) + r.charged
        t.add_row(r.day, _fmt(first), _fmt(r), f"{charged:.3g}", _why(r))
    console.print(t)

    refused = [r for r in backfill if r.outcome == "refused"]
    if refused:
        console.print(f"[yellow]{len(refused)} interval(s) refused[/] ({', '.join(r.day for r in refused)}): the scope "
                      "cap would be exceeded; nothing was charged and nothing was published for them. The ledger said:")
        console.print(f"  [dim]{refused[0].reason}[/]")
    _gaps(paths, ivs, console)
    manifests = sorted(paths.manifests_dir.glob("*.json")) if paths.manifests_dir.is_dir() else []
    console.print(f"\nManifests ({len(manifests)}): {paths.manifests_dir}", soft_wrap=True)
    if manifests:
        console.print(f"  check one: dpops manifest verify {manifests[0]} --ledger {paths.ledger_url}", soft_wrap=True)
    console.print(f"Published outputs: {paths.output_root / 'published' / DEMO_RELEASE}", soft_wrap=True)
    _verify_and_report(paths, manifests, console)


def _gaps(paths: DemoPaths, ivs: list, console: Any) -> None:
    """What an operator runs after a backfill: ``dpops gaps`` over the fortnight and the day after it.

    Airflow alone would show every backfill run as successful (a refusal ends ``reserve_budget``
    *skipped*), so the holes are found from the ledger, the published outputs and the refusal
    manifests. The extra day has no data and no run: it shows as "never run"."""
    import os
    import subprocess
    import sys

    first, last = ivs[0][0], ivs[-1][1]
    cmd = ["gaps", str(paths.spec_path), "--from", f"{first:%Y-%m-%d}",
           "--to", f"{last + (last - ivs[-1][0]):%Y-%m-%d}", "--ledger", paths.ledger_url]
    console.print("\n[bold]3. Gaps[/]: what an operator runs after a backfill")
    console.print(f"  $ dpops {' '.join(cmd)}", markup=False, highlight=False, soft_wrap=True)
    env = {**os.environ, "COLUMNS": str(console.width)}  # the CLI fits its table to the terminal
    proc = subprocess.run([sys.executable, "-c", "from dpops.cli.main import main; main()", *cmd],
                          capture_output=True, text=True, env=env, check=False)
    console.print(proc.stdout.rstrip(), markup=False, highlight=False, soft_wrap=True)  # already laid out
    if proc.returncode != 0:
        console.print(f"[red]dpops gaps exited {proc.returncode}[/]: {proc.stderr.strip()[-2000:]}")


def _verify_and_report(paths: DemoPaths, manifests: list, console: Any) -> None:
    """What a reviewer does next: recompute every published claim, then read the scope report."""
    from dpops.ledger import open_ledger
    from dpops.manifest.io import read_manifest
    from dpops.manifest.verify import verify_manifest
    from dpops.report import write_report

    published = [m for m in manifests if m.name.endswith(".published.json")]
    with open_ledger(paths.ledger_url) as ledger:
        bad = [m.name for m in published if not verify_manifest(read_manifest(m), ledger=ledger).ok]
        out = write_report(ledger, DEMO_SCOPE, paths.root / "report.html", manifests_dir=str(paths.manifests_dir))
    status = "[green]all verified[/]" if not bad else f"[red]{len(bad)} FAILED: {', '.join(bad)}[/]"
    console.print(f"Manifest verification (claims recomputed from each manifest + ledger): "
                  f"{len(published)} published, {status}")
    console.print(f"Reviewer report (self-contained HTML): {out}", soft_wrap=True)


def _value(row: dict, m: str) -> str:
    """``541 ±72``: the interval comes from public parameters only (noise scale), never from the data."""
    half = (row[m + "_ci95_high"] - row[m + "_ci95_low"]) / 2
    v = row[m]
    return f"{v:,.0f} [dim]±{half:,.0f}[/]" if abs(v) >= 100 or half >= 100 else f"{v:.3g} [dim]±{half:.2g}[/]"


def _why(r: IntervalResult) -> str:
    """A refusal's figures in one short line (the full reason is printed once below the table)."""
    if r.outcome not in ("refused", "failed"):
        return ""
    figures = {k: re.search(rf"\b{k}[ =]([\d.e+-]+)", r.reason) for k in ("spent", "reserved", "requested")}
    cap = re.search(r"cap (\w+)=([\d.e+-]+)", r.reason)
    if r.outcome == "refused" and cap and all(figures.values()):
        unit, total = cap.groups()
        spent, reserved, asked = (float(m.group(1)) for m in figures.values() if m)
        left = max(0.0, float(total) - spent - reserved)
        return f"budget: {unit} {left:.3g} left of {total}, run asked {asked:g}"
    return r.reason


def _fmt(r: IntervalResult | None) -> str:
    if r is None:
        return "-"
    colour = {"published": "green", "served": "cyan", "refused": "yellow", "failed": "red"}[r.outcome]
    return f"[{colour}]{r.outcome}[/]"


def _published_table(paths: DemoPaths, r: IntervalResult, console: Any) -> None:
    import pyarrow.parquet as pq
    from rich.table import Table

    from dpops.inputs import parse_interval
    from dpops.storage import ReleaseStore

    store = ReleaseStore(paths.output_root, DEMO_RELEASE)
    cur = store.current(parse_interval(r.start, r.end).slug)
    if cur is None:
        return
    table = pq.read_table(Path(cur.directory) / "data.parquet").to_pylist()
    if not table:
        return
    cols = list(table[0])
    metrics = [c for c in cols if f"{c}_ci95_low" in cols]
    parts = [c for c in cols if not any(c == m or c.startswith(m + "_") for m in metrics)]
    t = Table(title=f"Published {DEMO_RELEASE} for {r.day}: noisy value ± half-width of its 95% interval")
    for c in parts:
        t.add_column(c)
    for m in metrics:
        t.add_column(m, justify="right")
    for row in table:
        t.add_row(*[str(row[c]) for c in parts],
                  *[_value(row, m) for m in metrics])
    console.print(t)
    console.print(f"[dim]from {cur.directory} (version v{cur.version}, run {cur.run_id})[/]", soft_wrap=True)
