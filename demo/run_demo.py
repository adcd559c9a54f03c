"""End-to-end dpops demo: a real Airflow release DAG over 14 days of synthetic purchases.

    python demo/run_demo.py            (what ``make demo`` runs)

0. shows the plan of the release (predicted accuracy, its accuracy targets, the horizon),
1. generates 14 days of synthetic purchase events (``dpops.testing.synthetic``; never real data),
2. creates a noise key and a SQLite ledger scope whose cap fits 10 daily releases,
3. runs the release DAG through Airflow (SQLite metadata DB, ``dag.test()`` per interval)
   for the first week, as the daily schedule would,
4. backfills the whole fortnight: the published week is served for free, the scope's cap
   is hit part way and the remaining intervals are refused (nothing charged or published),
5. prints the published statistics of one day, the ledger status, the refused intervals,
   the gaps an operator finds with ``dpops gaps`` (refused and never-run days) and where the
   manifests are.

Everything lives under ``demo-output/`` (git-ignored). Running it again is safe: published
intervals are served, nothing is charged twice, refused ones are refused again for free.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_setup import DEMO_RELEASE, DemoPaths, airflow_environment  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "demo-output"), help="output folder (default: demo-output/)")
    parser.add_argument("--days", type=int, default=14, help="days of synthetic data (default 14)")
    parser.add_argument("--scheduled-days", type=int, default=7, help="days run as the daily schedule would (7)")
    parser.add_argument("--rows-per-day", type=int, default=20_000, help="synthetic rows per day (20000)")
    args = parser.parse_args(argv)

    paths = DemoPaths(Path(args.out).resolve())
    # Airflow reads its configuration when first imported: set it before anything imports it.
    os.environ.update(airflow_environment(paths))

    from rich.console import Console

    import demo_report
    import demo_steps

    console = Console()
    t0 = time.monotonic()
    console.rule("[bold]dpops demo: differentially private daily releases through Airflow")
    demo_steps.setup(paths, days=args.days, rows_per_day=args.rows_per_day, console=console)
    console.print("\n[bold]0. Plan before spending[/]: predicted accuracy, the spec's targets and the horizon "
                  "(no data read, nothing charged)")
    from dpops.cli.main import main as dpops_main

    dpops_main(["plan", str(paths.spec_path), "--ledger", paths.ledger_url, "--accountants", "basic,rdp"])
    dag = demo_steps.load_dag(paths, console=console)
    intervals = demo_steps.intervals(args.days)

    console.print(f"\n[bold]1. Daily schedule[/]: the DAG runs day by day for the first {args.scheduled_days} days")
    scheduled = demo_steps.run_intervals(dag, intervals[: args.scheduled_days], paths, console=console)
    console.print(
        f"\n[bold]2. Backfill[/] of all {args.days} days: published days are served free; the scope's cap is hit part way"
    )
    backfill = demo_steps.run_intervals(dag, intervals, paths, console=console)

    demo_report.report(paths, intervals, scheduled, backfill, console=console)
    console.print(f"\n[dim]finished in {time.monotonic() - t0:.0f} s; Airflow task logs: {paths.task_log}[/]", soft_wrap=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
