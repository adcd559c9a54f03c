"""The demo's steps: set up the workspace, load the DAG, run intervals through ``dag.test()``.

Imported after ``demo_setup.airflow_environment`` is in ``os.environ`` (Airflow reads it
at import time).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterator

from demo_setup import DEMO_RELEASE, DEMO_SCOPE, REPO, SCOPE_CAP, SPEC, START, DemoPaths

DAG_ID = f"dpops_{DEMO_RELEASE}"


@dataclass
class IntervalResult:
    start: str
    end: str
    outcome: str  # published | served | refused | failed
    charged: float  # epsilon charged by this run (0 when served or refused)
    remaining: float | None
    seconds: float
    run_id: str | None = None
    reason: str = ""

    @property
    def day(self) -> str:
        return self.start[:10]


def intervals(days: int) -> list[tuple[datetime, datetime]]:
    d0 = datetime.fromisoformat(START).replace(tzinfo=timezone.utc)
    return [(d0 + timedelta(days=i), d0 + timedelta(days=i + 1)) for i in range(days)]


# --------------------------------------------------------------------------- setup


def setup(paths: DemoPaths, *, days: int, rows_per_day: int, console: Any) -> None:
    from dpops.noise.randomness import NoiseKey
    from dpops.testing.synthetic import generate_events

    paths.specs_dir.mkdir(parents=True, exist_ok=True)
    if not paths.spec_path.exists():
        paths.spec_path.write_text(SPEC)
    elif paths.spec_path.read_text() != SPEC:
        console.print(f"[yellow]keeping the existing, edited spec {paths.spec_path}[/]", soft_wrap=True)

    missing = [s for s, _ in intervals(days) if not (paths.data_dir / f"{s:%Y-%m-%d}.parquet").exists()]
    if missing:
        with console.status(f"generating {days} days x {rows_per_day:,} synthetic purchases ..."):
            # Same seed every time: regenerated files are identical, so their fingerprints (and run keys) too.
            generate_events(str(paths.data_dir / "{start:%Y-%m-%d}.parquet"), n_rows=rows_per_day,
                            n_users=max(100, rows_per_day // 4), n_partitions=8, days=days, seed=2024, start=START)
    console.print(f"data      {days} days of synthetic purchases in {paths.data_dir}", soft_wrap=True)

    if not paths.key_path.exists():
        paths.key_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        NoiseKey.generate(paths.key_path)
        console.print(f"noise key created at {paths.key_path} (mode 0600; only its path is ever passed on)", soft_wrap=True)
    else:
        console.print(f"noise key {paths.key_path} (reused: same key, same noise, no new charge)", soft_wrap=True)

    _create_scope(paths)
    console.print(f"ledger    {paths.ledger_url}: scope {DEMO_SCOPE!r} with cap epsilon={SCOPE_CAP:g} (10 daily releases)", soft_wrap=True)

    if not (paths.airflow_home / "airflow.db").exists():
        with console.status("creating Airflow's SQLite metadata database ..."):
            airflow = str(Path(sys.executable).parent / "airflow")
            proc = subprocess.run([airflow, "db", "migrate"], env=dict(os.environ), capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"airflow db migrate failed:\n{proc.stderr[-2000:]}")
    console.print(f"airflow   {paths.airflow_home} (SQLite metadata DB), DAGs from {REPO / 'dags'}", soft_wrap=True)


def _create_scope(paths: DemoPaths) -> None:
    from dpops.ledger import ScopeDefinition, open_ledger

    ledger = open_ledger(paths.ledger_url)
    try:
        ledger.create_scope(
            ScopeDefinition(name=DEMO_SCOPE, unit="a shopper's purchases on one day", unit_column="user_id",
                            epsilon=SCOPE_CAP, delta=0.0, rho=None, accountant="basic/1", owner="demo",
                            description="synthetic shoppers of the dpops demo", adjacency="add_remove"),
            actor="demo",
        )  # idempotent when identical
    finally:
        ledger.close()


def load_dag(paths: DemoPaths, *, console: Any) -> Any:
    with _quiet(paths.task_log):
        from airflow.dag_processing.dagbag import DagBag

        bag = DagBag(dag_folder=str(REPO / "dags"))
    if bag.import_errors or DAG_ID not in bag.dags:
        raise SystemExit(f"the DAG {DAG_ID} did not load: {bag.import_errors or bag.captured_warnings}")
    dag = bag.dags[DAG_ID]
    console.print(f"DAG       {DAG_ID}: {' -> '.join(t.task_id for t in dag.tasks)}")
    return dag


# --------------------------------------------------------------------------- runs


@contextlib.contextmanager
def _quiet(log_path: Path) -> Iterator[None]:
    """Send everything Airflow writes (to fds 1 and 2) to the task log; keep the terminal readable."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log_path, "ab") as fh:
        os.dup2(fh.fileno(), 1)
        os.dup2(fh.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _ledger_view(paths: DemoPaths, run_id: str) -> tuple[str | None, float, float | None, str | None]:
    """(this run's state, epsilon it was charged, scope remaining, output uri)."""
    from dpops.ledger import open_ledger

    ledger = open_ledger(paths.ledger_url)
    try:
        rec = ledger.run(run_id)
        remaining = ledger.status(DEMO_SCOPE).remaining
        charged = rec.epsilon if rec is not None and rec.state != "released" else 0.0
        return (rec.state if rec else None), charged, remaining, (rec.output_uri if rec else None)
    finally:
        ledger.close()


def _refusal_reason(paths: DemoPaths, run_id: str) -> str:
    f = paths.manifests_dir / f"{run_id}.refused.json"
    if f.exists():
        outcome = json.loads(f.read_text()).get("outcome", {})
        return str(outcome.get("reason") or "budget refused")
    return f"see {paths.task_log}"


def run_intervals(dag: Any, ivs: list[tuple[datetime, datetime]], paths: DemoPaths, *, console: Any) -> list[IntervalResult]:
    from dpops import release

    results = []
    for i, (start, end) in enumerate(ivs, 1):
        ctx = release.prepare(str(paths.spec_path), start, end, randomness="keyed", key_path=str(paths.key_path))
        state_before, *_ = _ledger_view(paths, ctx.run_id)
        t = time.monotonic()
        with _quiet(paths.task_log):
            dr = dag.test(logical_date=end)  # dag.test covers the interval ENDING at its logical date
        seconds = time.monotonic() - t
        state, charged, remaining, _ = _ledger_view(paths, ctx.run_id)
        if state == "committed" and state_before == "committed":
            res = IntervalResult(ctx.interval.start_iso, ctx.interval.end_iso, "served", 0.0, remaining, seconds, ctx.run_id,
                                 "already published: served, nothing charged")
        elif state == "committed":
            res = IntervalResult(ctx.interval.start_iso, ctx.interval.end_iso, "published", charged, remaining, seconds,
                                 ctx.run_id)
        elif state is None and (paths.manifests_dir / f"{ctx.run_id}.refused.json").exists():
            res = IntervalResult(ctx.interval.start_iso, ctx.interval.end_iso, "refused", 0.0, remaining, seconds,
                                 ctx.run_id, _refusal_reason(paths, ctx.run_id))
        else:
            res = IntervalResult(ctx.interval.start_iso, ctx.interval.end_iso, "failed", charged, remaining, seconds,
                                 ctx.run_id, f"DAG run {getattr(dr, 'state', '?')}, ledger state {state}; see {paths.task_log}")
        results.append(res)
        colour = {"published": "green", "served": "cyan", "refused": "yellow", "failed": "red"}[res.outcome]
        rem = "?" if res.remaining is None else f"{max(0.0, round(res.remaining, 6)):.3g}"
        console.print(f"  [{i:>2}/{len(ivs)}] {res.day}  [{colour}]{res.outcome:<9}[/]  epsilon charged "
                      f"{res.charged:.3g}  scope remaining {rem}  ({seconds:.1f} s)")
    return results
