"""``dpops gaps SPEC --from DATE --to DATE``: intervals of a date range with no publication, and why."""

from __future__ import annotations

import click

from dpops.cli.common import (
    echo_ok,
    json_option,
    ledger_option,
    open_cli_ledger,
    print_table,
    say,
)

WORDS = {"never_run": "never run", "input_missing": "input missing",
         "refused": "refused", "failed": "failed", "spent_unpublished": "spent unpublished",
         "abandoned": "abandoned", "in_progress": "in progress", "published": "published",
         "forged": "FORGED (not in the ledger)"}


@click.command("gaps")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--from", "start", required=True, help="first day (ISO-8601, UTC): intervals starting at or after it")
@click.option("--to", "end", required=True, help="end (exclusive, ISO-8601, UTC): intervals starting before it")
@click.option("--manifests", "manifests", envvar="DPOPS_MANIFESTS_DIR", type=click.Path(file_okay=False), default=None,
              help="the run manifests (refusals are known only from these; default $DPOPS_MANIFESTS_DIR or "
                   "<output root>/manifests/<release>)")
@click.option("--all", "show_all", is_flag=True, help="also list the published intervals")
@click.option("--check", is_flag=True, help="exit 7 if there is any gap (for monitoring)")
@ledger_option
@json_option
def cli(spec: str, start: str, end: str, manifests: str | None, show_all: bool, check: bool, as_json: bool) -> None:
    """List the intervals of SPEC in [--from, --to) that have no publication, with the reason: never run,
    refused, failed, spent unpublished (started or committed but not visible), abandoned, in progress.

    Intervals follow the spec's grid (its unit period, else its cron schedule). Reads the ledger, the
    published outputs and the manifests; never the input."""
    from dpops.errors import IntegrityError
    from dpops.gaps import interval_statuses, parse_day
    from dpops.spec import load_spec

    sp = load_spec(spec)
    lo, hi = parse_day(start, "--from"), parse_day(end, "--to")
    with open_cli_ledger() as led:
        rows = interval_statuses(sp, led, lo, hi, manifests_dir=manifests)
    gaps = [r for r in rows if r.is_gap]
    counts = {k: sum(1 for r in rows if r.status == k) for k in WORDS}
    # A version the ledger did not commit is a forgery: exit 7 always, not only with --check.
    forged = [r for r in rows if r.status == "forged"]

    def failure() -> IntegrityError:
        if forged:
            return IntegrityError(f"{sp.name}: {len(forged)} interval(s) hold a published version or pointer the "
                                  "ledger did not commit (forged): " + "; ".join(r.interval_start for r in forged))
        return IntegrityError(f"{sp.name}: {len(gaps)} of {len(rows)} interval(s) have no publication")
    if as_json:
        doc = {"release": sp.name, "from": start, "to": end, "intervals": len(rows), "gaps": len(gaps),
               "counts": counts, "items": [r.to_dict() for r in (rows if show_all else gaps)]}
        if (check and gaps) or forged:
            from dpops.cli.common import attach

            raise attach(failure(), doc)
        echo_ok(doc)
        return
    shown = rows if show_all else gaps
    if not shown:  # a table of headers alone reads as "something is missing here" (issue 28 item 15)
        say(f"{sp.name}: no gaps: every one of the {len(rows)} interval(s) in [{start}, {end}) is published"
                   if rows else f"{sp.name}: no interval of the spec's grid in [{start}, {end})")
        if not rows:
            return
        say(", ".join(f"{WORDS[k]}: {v}" for k, v in counts.items() if v))
        return
    print_table(f"{sp.name}: {len(gaps)} of {len(rows)} interval(s) in [{start}, {end}) have no publication",
                ["interval start", "interval end", "status", "run", "why"],
                [[r.interval_start, r.interval_end, WORDS[r.status], r.run_id or "-", r.detail] for r in shown],
                keep=("interval start", "interval end", "status"), below=("run", "why"))
    say(", ".join(f"{WORDS[k]}: {v}" for k, v in counts.items() if v) or "no intervals in range")
    if (check and gaps) or forged:
        raise failure()
