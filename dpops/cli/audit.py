"""``dpops audit``: empirical lower bounds on the ε a mechanism or a release really spends.

Exit code 0 when every audited lower bound is at most the claimed ε, 7 (verification failed)
when any exceeds it: that is statistical evidence, at the stated confidence, of a privacy bug.
"""

from __future__ import annotations

import json

import click

from dpops.cli.common import HelpGroup, ledger_option, ledger_url, mark_json_printed, say
from dpops.errors import IntegrityError, InvalidParameter


def _render(results, title: str, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in results], indent=2, sort_keys=True))
        mark_json_printed()  # a failed audit exits 7 after this list: no second JSON document
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col, just in (("target", "left"), ("mechanism", "left"), ("claimed ε", "right"), ("δ", "right"),
                      ("audited ε ≥", "right"), ("trials", "right"), ("confidence", "right"),
                      ("scenario / event", "left"), ("sec", "right"), ("result", "left")):
        table.add_column(col, justify=just)
    for r in results:
        table.add_row(r.target, r.mechanism, f"{r.claimed_epsilon:.4g}", f"{r.delta:.3g}", f"{r.epsilon_lb:.3f}",
                      str(r.trials), f"{r.confidence:g}", f"{r.scenario}: {r.event}", f"{r.seconds:.1f}",
                      "[green]PASS[/green]" if r.passed else "[bold red]FAIL[/bold red]")
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # piped or captured output: do not squeeze the table to 80 columns
    console.print(table)


def _finish(results) -> None:
    failed = [r for r in results if not r.passed]
    if failed:
        raise IntegrityError(
            "audit FAILED for " + ", ".join(f"{r.target} (audited ε ≥ {r.epsilon_lb:.3f} > claimed {r.claimed_epsilon:.4g})"
                                            for r in failed)
            + ": the code spends more privacy than it claims; do not publish with it")


@click.group(name="audit", cls=HelpGroup)
def cli() -> None:
    """Audit the privacy of mechanisms and releases empirically (lower bounds on ε; see docs/audit.md)."""


@cli.command("mechanisms")
@click.option("--profile", type=click.Choice(["ci", "thorough"]), default="ci", show_default=True,
              help="ci: about a minute on 2 cores; thorough: 10x the trials, confidence 0.999")
@click.option("--mechanism", "names", multiple=True, help="audit only these (repeatable); default: all")
@click.option("--seed", type=int, default=0, show_default=True, help="test seed of the audit's randomness")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def mechanisms_cmd(profile: str, names: tuple[str, ...], seed: int, as_json: bool) -> None:
    """count, sum, mean, unit_count, top_k, partition selection, quantiles, noise-key reuse, and the
    float-sum attack (float_sum: the sum case in the ci profile, sum/mean/variance in thorough)."""
    from dpops.audit.float_sums import audit_float_sums
    from dpops.audit.key_reuse import audit_key_reuse
    from dpops.audit.suite import MECHANISMS, PROFILES, audit_mechanisms

    extra = ["key_reuse", "float_sum"]
    known = list(MECHANISMS) + extra
    bad = [n for n in names if n not in known]
    if bad:
        raise InvalidParameter(f"--mechanism: unknown {bad}; choose from {known}")
    wanted = list(names) or known
    core = [n for n in wanted if n not in extra]
    results = audit_mechanisms(profile, core, seed=seed) if core else []  # [] would mean "all"
    if "key_reuse" in wanted:
        prof = PROFILES[profile]
        results.append(audit_key_reuse(trials=prof.trials, confidence=prof.confidence, seed=seed))
    if "float_sum" in wanted:
        results.extend(audit_float_sums(["sum"] if profile == "ci" else None, seed=seed))
    _render(results, f"dpops audit mechanisms (profile {profile})", as_json)
    _finish(results)


@cli.command("spec")
@click.argument("spec_path", type=click.Path(dir_okay=False))
@click.option("--metric", "metrics", multiple=True, help="metric key to audit (repeatable; 'partition_selection' too)")
@click.option("--trials", type=int, default=None,
              help="trials per neighbour and scenario (default: 4000, fewer for exponential-mechanism metrics "
                   "and for neighbours that need very many rows)")
@click.option("--confidence", type=float, default=0.99, show_default=True, help="confidence of each lower bound")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--beam", is_flag=True,
              help="also run each metric end to end through the Beam pipeline (run_release; public partitions only)")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def spec_cmd(spec_path: str, metrics: tuple[str, ...], trials: int, confidence: float, seed: int, beam: bool,
             as_json: bool) -> None:
    """Audit every metric of the release in SPEC_PATH (its bounds, adjacency, noise and budget split)."""
    from dpops.audit.runner import audit_plan
    from dpops.spec import load_spec

    if trials is not None and trials < 8:
        raise InvalidParameter(f"--trials must be at least 8, got {trials}")
    if not (0 < confidence < 1):
        raise InvalidParameter(f"--confidence must be in (0, 1), got {confidence}")
    spec = load_spec(spec_path)
    results = audit_plan(spec, metrics=list(metrics) or None, trials=trials, confidence=confidence, seed=seed)
    if beam:
        from dpops.audit.pipeline_path import audit_metric_via_pipeline

        for r in list(results):
            if r.target != "partition_selection":
                results.append(audit_metric_via_pipeline(spec, r.target, trials=min(r.trials, 2000),
                                                         confidence=confidence, seed=seed))
    _render(results, f"dpops audit spec {spec.name}", as_json)
    _finish(results)


@cli.command("scope")
@click.argument("spec_path", type=click.Path(dir_okay=False))
@ledger_option
@click.option("--rows-per-unit", type=int, default=40, show_default=True,
              help="rows of the scope's unit in the neighbour (a record-level release counts each as a unit)")
@click.option("--trials", type=int, default=2000, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def scope_cmd(spec_path: str, rows_per_unit: int, trials: int, seed: int, as_json: bool) -> None:
    """Audit SPEC_PATH against the unit of its budget scope (budget.scope in the ledger).

    A release whose unit definition differs from the scope's is refused by `dpops release run`;
    for a record-level release in a user scope this audit also shows the ε really spent per user.
    """
    from dpops.audit.scope_unit import audit_against_scope
    from dpops.ledger import open_ledger
    from dpops.spec import load_spec

    if rows_per_unit < 1 or trials < 8:
        raise InvalidParameter("--rows-per-unit must be >= 1 and --trials >= 8")
    spec = load_spec(spec_path)
    led = open_ledger(ledger_url())
    try:
        scope = led.scope(spec.budget.scope)
    finally:
        getattr(led, "close", lambda: None)()
    res = audit_against_scope(spec, scope, rows_per_unit=rows_per_unit, trials=trials, seed=seed)
    if as_json:
        click.echo(json.dumps({"refused": res.refused, "reasons": res.reasons,
                               "results": [r.to_dict() for r in res.results]}, indent=2, sort_keys=True))
        mark_json_printed()
    else:
        say(f"scope {scope.name!r}: " + ("REFUSED by dpops release run:\n  " + "\n  ".join(res.reasons)
                                                if res.refused else "the release's unit definition matches"))
        if res.results:
            _render(res.results, f"dpops audit scope {spec.name} (the scope's unit)", False)
    _finish(res.results)
