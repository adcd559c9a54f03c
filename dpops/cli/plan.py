"""``dpops plan``: what a backfill (or a list of planned runs) would cost on a scope, and what fits. Writes nothing."""

from __future__ import annotations

import json
from typing import Any

import click

from dpops.cli.common import (
    attach,
    json_option,
    ledger_option,
    open_cli_ledger,
    print_table,
    say,
    terminal_width,
    wrap_words,
)
from dpops.cli.ledger import echo_json, fmt
from dpops.errors import BudgetExceeded, InvalidParameter


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


FREE = {"published": "skip: published", "in_progress": "wait: already charged (reserved), not counted again"}


def _action_words(action: str) -> tuple[str, str]:
    """An action as its short word for the table ("run", "REFUSED", "skip") and the reason printed under the row."""
    word, sep, why = action.partition(": ")
    return (word, why) if sep else (action, "")


def _action(st) -> tuple[str, bool]:
    """What a backfill would do with this interval, and whether it costs a new charge."""
    if st.status in FREE:
        return FREE[st.status], False
    last = st.runs[-1]["state"] if st.runs else None
    if st.status == "spent_unpublished" and last in ("started", "committed"):
        return "retry: already charged, a keyed retry costs nothing", False
    return "run", True


def plan_json(doc: dict[str, Any], cap: float, figures: tuple[str, ...]) -> dict[str, Any]:
    """A plan's JSON with its budget figures as the table shows them and the exact ones under ``exact``
    (``dpops.ledger.budget.budget_json``): a run's cost alone, scope totals and what is left at the cap's precision."""
    from dpops.ledger.budget import budget_json

    items = [budget_json(it, {"cost": None, "total_after": cap, "remaining_after": cap}) for it in doc["items"]]
    scales: dict[str, float | None] = {f: (None if f == "per_run_cost" else cap) for f in figures}
    return budget_json({**doc, "items": items}, {**scales, "cap": None})


@click.command()
@click.argument("target", metavar="SPEC|SCOPE")
@click.argument("plan_file", type=click.File("r"), metavar="[PLAN.json]", required=False)
@click.option("--from", "start", default=None, help="with SPEC: first day of the backfill (ISO-8601, UTC)")
@click.option("--to", "end", default=None, help="with SPEC: end of the backfill, exclusive (ISO-8601, UTC)")
@click.option("--manifests", "manifests", envvar="DPOPS_MANIFESTS_DIR", type=click.Path(file_okay=False), default=None,
              help="with SPEC: the run manifests (refusals are known only from these)")
@ledger_option
@json_option
@click.option("--check", is_flag=True, help="Exit 5 if any planned run would not fit.")
@click.option("--at", "at_units", type=int, default=None, metavar="N",
              help="accuracy view: the partition size (units) errors and keep probabilities are shown at [1000]")
@click.option("--value", "values", multiple=True, metavar="KEY=V",
              help="accuracy view: the true value of metric KEY a relative error is measured against (repeatable)")
@click.option("--confidence", type=float, default=None, help="accuracy view: interval confidence [0.95]")
@click.option("--gap", type=int, default=None,
              help="accuracy view: top-k lead (rows) for the top-pick probability [10]")
@click.option("--intervals", type=int, default=365, show_default=True,
              help="horizon: total epsilon after this many intervals")
@click.option("--scope-cap", "scope_cap", type=float, default=None, metavar="EPSILON",
              help="the scope's cap (epsilon) when the ledger or the scope is not reachable: the horizon counts "
                   "intervals against it and --solve fits one interval in it (nothing assumed spent)")
@click.option("--run-cap", "run_cap", type=float, default=None, metavar="EPSILON",
              help="with --solve: the most one interval may cost (epsilon under the scope's accountant), on top of "
                   "what remains of the scope")
@click.option("--cap", "old_cap", type=float, default=None, hidden=True, expose_value=True,
              help="removed: it meant the scope cap in the horizon and the run's cap with --solve")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default=None, metavar="PATCH.yaml",
              help="with --solve: write the solved split as a patch for `dpops spec apply-patch` (never overwrites)")
@click.option("--scope-delta", type=float, default=None,
              help="horizon: the scope's delta when the ledger is not reachable [the spec's delta x --intervals]")
@click.option("--accountants", default="basic,zcdp,rdp,pld", show_default=True,
              help="horizon: the accountants to compose with (comma-separated names or name/version)")
@click.option("--solve", is_flag=True, help="find the least-epsilon split meeting the spec's accuracy targets")
@click.option("--require-targets", is_flag=True,
              help="exit 3 if an accuracy target is not met (by the declared budget, or with --solve by any split "
                   "that fits)")
def cli(target, plan_file, start, end, manifests, as_json, check, at_units, values, confidence, gap, intervals,
        scope_cap, run_cap, old_cap, out_path, scope_delta, accountants, solve, require_targets) -> None:
    """Plan before spending: predicted accuracy and the horizon, or what a backfill would cost. Writes nothing
    (but the --out patch).

    \b
    dpops plan SPEC [--at N] [--value KEY=V] [--solve [--run-cap E] [--out PATCH.yaml]] [--require-targets]
        the accuracy view, from the spec alone (no data read, nothing charged): per metric the noise
        actually drawn, its std and exact interval, errors at a partition size, keep probabilities,
        the spec's accuracy targets (met or not; --solve finds the least-epsilon split meeting them,
        --out writes it for dpops spec apply-patch), the horizon (intervals that still fit the scope's
        cap under basic, zCDP, RDP and PLD composition, the date the cap is reached; of the solved
        split with --solve), and plain-language lines for a reviewer.
    dpops plan SPEC --from DATE --to DATE
        the spec's intervals starting in [FROM, TO) (its unit period or cron schedule), each costing
        the spec's per-run privacy events, composed by the scope's accountant on top of the ledger's
        current position; published intervals are skipped, started ones retry for free.
    dpops plan SCOPE PLAN.json
        PLAN.json is a list of {"interval_start": ISO, "interval_end": ISO, "events": [privacy events]}.

    A run that fits is counted as charged for the runs after it.
    """
    if old_cap is not None:  # one spelling, two meanings: refuse it, naming both (issue 26 section 4)
        raise click.UsageError("--cap is gone: it was the horizon's scope cap and, with --solve, the cap on one "
                               f"interval's cost. Say which: --scope-cap {old_cap:g} (the scope's cap when the ledger "
                               f"is not reachable) or --run-cap {old_cap:g} (with --solve: the most one interval may "
                               "cost)")
    if out_path is not None and not solve:
        raise click.UsageError("--out writes the solved split: give --solve too")
    if run_cap is not None and not solve:
        raise click.UsageError("--run-cap caps the solved run's cost: give --solve too")
    if start is not None or end is not None:
        if plan_file is not None or start is None or end is None:
            raise InvalidParameter("dpops plan SPEC needs both --from and --to (and no PLAN.json)")
        return _plan_spec(target, start, end, manifests, as_json, check)
    if plan_file is None:
        from dpops.cli.plan_accuracy import AccuracyOptions, run

        return run(target, AccuracyOptions(
            at_units=at_units, values=tuple(values), confidence=confidence, gap=gap, intervals=intervals,
            scope_cap=scope_cap, run_cap=run_cap, out=out_path, scope_delta=scope_delta, solve=solve,
            require_targets=require_targets,
            accountants=tuple(a.strip() for a in accountants.split(",") if a.strip())), as_json)
    scope = target
    runs = load_plan(plan_file, getattr(plan_file, "name", "PLAN"))
    with open_cli_ledger() as led:
        result = led.plan(scope, runs)
    refused_error = None
    if check and not result.fits_all:
        refused_error = BudgetExceeded(f"{len(result.items) - result.admitted} planned run(s) would not fit on "
                                       f"scope {scope!r}")
    if as_json:
        doc = plan_json(result.to_dict(), result.cap, ("per_run_cost", "scope_total_before", "scope_total_after"))
        if refused_error is not None:
            raise attach(refused_error, doc)
        echo_json(doc)
    else:
        unit = "ε" if result.unit == "epsilon" else "ρ"
        # Short headers so the two whole dates and the figures fit 80 columns; the caption says what they are.
        print_table(f"plan on scope {scope}: cap {unit}={fmt(result.cap)}",
                    ["interval start", "interval end", "buckets", unit, "fits", f"scope {unit} after", "left after"],
                    [[it.interval_start, it.interval_end, ", ".join(it.buckets), fmt(it.cost),
                      "yes" if it.fits else "NO", fmt(it.total_after, result.cap), fmt(it.remaining_after, result.cap)]
                     for it in result.items], keep=("interval start", "interval end", "fits"), below=("buckets",),
                    right=(unit, f"scope {unit} after", "left after"),
                    caption=f"{unit}: the run alone; scope {unit} after: the scope total after it, all runs composed; "
                            "left after: cap minus that total")
        say(f"{result.admitted} of {len(result.items)} planned runs fit")
    if refused_error is not None:
        raise refused_error


def _plan_spec(spec_path: str, start: str, end: str, manifests: str | None, as_json: bool, check: bool) -> None:
    from dpops.gaps import interval_statuses, parse_day
    from dpops.release_plan import plan_release
    from dpops.spec import load_spec

    spec = load_spec(spec_path)
    events = list(plan_release(spec).events)
    lo, hi = parse_day(start, "--from"), parse_day(end, "--to")
    scope = spec.budget.scope
    with open_cli_ledger() as led:
        statuses = interval_statuses(spec, led, lo, hi, manifests_dir=manifests)
        costing = [st for st in statuses if _action(st)[1]]
        result = led.plan(scope, [(st.interval_start, st.interval_end, events) for st in costing])
        sdef = led.scope(scope)
        before = led.status(scope)
    items = iter(result.items)
    unit = "ε" if result.unit == "epsilon" else "ρ"
    rows = []
    for st in statuses:
        action, costs = _action(st)
        row = {"interval_start": st.interval_start, "interval_end": st.interval_end, "status": st.status,
               "action": action, "cost": 0.0, "fits": True, "total_after": None, "remaining_after": None,
               "detail": st.detail}
        if costs:
            it = next(items)
            row.update(cost=it.cost, fits=it.fits, total_after=it.total_after, remaining_after=it.remaining_after,
                       action="run" if it.fits else "REFUSED: " + (it.reason or "over the cap"))
        rows.append(row)
    refused = [r for r in rows if not r["fits"]]
    admitted = [it for it in result.items if it.fits]
    after = max([it.total_after for it in admitted], default=before.total)
    doc = {"release": spec.name, "scope": scope, "accountant": sdef.accountant, "unit": result.unit,
           "cap": result.cap, "delta": result.delta, "per_run_cost": result.items[0].cost if result.items else None,
           "scope_total_before": before.total, "scope_total_after": after, "intervals": len(rows),
           "to_run": len(costing), "would_fit": len(admitted), "would_be_refused": len(refused),
           "refused_intervals": [f"{r['interval_start']}/{r['interval_end']}" for r in refused], "items": rows}
    summary = (f"{len(costing)} of {len(rows)} interval(s) to run at {unit}={fmt(doc['per_run_cost'])} each; "
               f"scope {scope} total {unit}={fmt(before.total, result.cap)} now, {fmt(after, result.cap)} after the "
               f"{len(admitted)} that fit, "
               f"of cap {fmt(result.cap)} ({sdef.accountant} accountant, all runs composed)"
               + (f"; {len(refused)} would be refused: " + ", ".join(doc["refused_intervals"]) if refused else ""))
    doc["summary"] = summary
    refused_error = None
    if check and refused:
        refused_error = BudgetExceeded(f"{spec.name}: {len(refused)} interval(s) of the backfill would be refused "
                                       f"by scope {scope!r}'s cap")
    if as_json:
        doc = plan_json(doc, result.cap, ("per_run_cost", "scope_total_before", "scope_total_after"))
        if refused_error is not None:
            raise attach(refused_error, doc)
        echo_json(doc)
    else:
        # Fits 80 columns: the two whole dates, dpops gaps' status words, one action word, the scope total after
        # the run; the cost of a run is the same for every interval (one spec), so it is in the title, and the
        # reason is on its own line under the row.
        from dpops.cli.gaps import WORDS

        cost = f", {unit}={fmt(doc['per_run_cost'])} per run" if doc["per_run_cost"] is not None else ""
        print_table(f"backfill plan of {spec.name} on scope {scope}: cap {unit}={fmt(result.cap)}{cost}",
                    ["interval start", "interval end", "status", "action", f"scope {unit} after", "why"],
                    [[r["interval_start"], r["interval_end"], WORDS.get(r["status"], r["status"]),
                      _action_words(r["action"])[0],
                      fmt(r["total_after"], result.cap) if r["total_after"] is not None else "-",
                      _action_words(r["action"])[1]]
                     for r in rows],
                    keep=("interval start", "interval end", "action"), below=("why",), right=(f"scope {unit} after",))
        click.echo("\n".join(wrap_words(summary, terminal_width())))  # at words: the refused intervals stay whole
    if refused_error is not None:
        raise refused_error
