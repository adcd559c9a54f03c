"""``dpops report``: the reviewer's self-contained HTML report of one budget scope."""

from __future__ import annotations

import click


@click.command("report")
@click.option("--scope", required=True, help="budget scope name")
@click.option("--from", "start", default=None, help="only runs whose interval starts at or after this (ISO-8601)")
@click.option("--to", "end", default=None, help="only runs whose interval ends at or before this (ISO-8601)")
@click.option("--ledger", "ledger_url", envvar="DPOPS_LEDGER_URL", default=None, help="ledger URL")
@click.option("--manifests", "manifests", envvar="DPOPS_MANIFESTS_DIR", type=click.Path(file_okay=False),
              default=None, help="directory holding the run manifests (refusals are known only from these)")
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False), help="HTML file to write")
def cli(scope: str, start: str | None, end: str | None, ledger_url: str | None, manifests: str | None, out: str) -> None:
    """Write one self-contained HTML report (no network) for a budget scope."""
    from dpops.ledger import open_ledger
    from dpops.report import write_report

    ledger = open_ledger(ledger_url)
    try:
        path = write_report(ledger, scope, out, manifests_dir=manifests, start=start, end=end)
    finally:
        ledger.close()
    click.echo(f"report written: {path}")
