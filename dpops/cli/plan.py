"""``dpops plan``: what planned runs would cost on a scope and whether they fit. Writes nothing."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

from dpops.cli.ledger import LEDGER_OPTION_HELP, echo_json, fmt
from dpops.errors import BudgetExceeded, InvalidParameter
from dpops.ledger import open_ledger


def load_plan(fp, name: str) -> list[tuple[str, str, list]]:
    """A JSON list of {"interval_start", "interval_end", "events": [...]} (or {"runs": [that list]})."""
    try:
        data = json.load(fp)
    except json.JSONDecodeError as exc:
        raise InvalidParameter(f"plan file {name}: not valid JSON ({exc})") from None
    if isinstance(data, dict) and "runs" in data:
        data = data["runs"]
    if not isinstance(data, list):
        raise InvalidParameter(f"plan file {name}: expected a JSON list of planned runs (or {{\"runs\": [...]}})")
    out = []
    for i, item in enumerate(data):
        if not isinstance(item, dict) or not {"interval_start", "interval_end", "events"} <= set(item):
            raise InvalidParameter(
                f"plan file {name}: run #{i} must be an object with interval_start, interval_end and events"
            )
        out.append((item["interval_start"], item["interval_end"], item["events"]))
    return out


@click.command()
@click.argument("scope")
@click.argument("plan_file", type=click.File("r"), metavar="PLAN.json")
@click.option("--ledger", "url", default=None, help=LEDGER_OPTION_HELP)
@click.option("--json", "as_json", is_flag=True)
@click.option("--check", is_flag=True, help="Exit 5 if any planned run would not fit.")
def cli(scope, plan_file, url, as_json, check) -> None:
    """Cost of the runs in PLAN.json on SCOPE, in order, and which would fit (nothing is written).

    PLAN.json is a list of {"interval_start": ISO, "interval_end": ISO, "events": [privacy events]}.
    A run that fits is counted as charged for the runs after it.
    """
    runs = load_plan(plan_file, getattr(plan_file, "name", "PLAN"))
    with open_ledger(url) as led:
        result = led.plan(scope, runs)
    if as_json:
        echo_json(result.to_dict())
    else:
        unit = "ε" if result.unit == "epsilon" else "ρ"
        table = Table(title=f"plan on scope {scope}: cap {unit}={fmt(result.cap)}")
        for col in ("interval", "buckets", "cost", "fits", "total after", "remaining after"):
            table.add_column(col)
        for it in result.items:
            table.add_row(f"{it.interval_start} .. {it.interval_end}", ",".join(it.buckets)[:30], fmt(it.cost),
                          "yes" if it.fits else "NO", fmt(it.total_after), fmt(it.remaining_after))
        Console().print(table)
        click.echo(f"{result.admitted} of {len(result.items)} planned runs fit")
    if check and not result.fits_all:
        raise BudgetExceeded(f"{len(result.items) - result.admitted} planned run(s) would not fit on scope {scope!r}")
