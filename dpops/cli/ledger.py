"""``dpops ledger``: inspect and administer the global privacy-budget ledger.

Rich tables for humans, ``--json`` for machines. The ledger URL comes from
``--ledger`` or the environment variable DPOPS_LEDGER_URL (default: a SQLite file
``dpops-ledger.sqlite`` in the working directory).
"""

from __future__ import annotations

import getpass
import json
import math
import sys

import click
from rich.console import Console
from rich.table import Table

from dpops.errors import IntegrityError
from dpops.ledger import ScopeDefinition, open_ledger
from dpops.ledger.model import RUN_STATES, ScopeStatus

LEDGER_OPTION_HELP = "Ledger URL: sqlite:///path.sqlite or postgresql://user@host:port/db (env DPOPS_LEDGER_URL)."


def default_actor() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except Exception:  # no user name in this environment
        return "cli"


def fmt(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isinf(x)):
        return "inf"
    return f"{x:.6g}"


def echo_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True, allow_nan=False))


def _ledger(ctx: click.Context):
    return open_ledger(ctx.obj.get("url") if ctx.obj else None)


def status_table(st: ScopeStatus) -> Table:
    unit = "ε" if st.unit == "epsilon" else "ρ"
    title = f"scope {st.scope}: cap {unit}={fmt(st.cap)}" + (f" at δ={st.delta:g}" if st.unit == "epsilon" else "")
    table = Table(title=f"{title} ({st.accountant})")
    for col in ("bucket", "committed", "spent unpublished", "started", "reserved", "total", "remaining", "runs"):
        table.add_column(col, justify="left" if col in ("bucket", "runs") else "right")
    for b in st.buckets:
        runs = ", ".join(f"{k} {v}" for k, v in sorted(b.runs.items()))
        table.add_row(b.bucket, fmt(b.committed), fmt(b.spent_unpublished), fmt(b.started), fmt(b.reserved),
                      fmt(b.total), fmt(b.remaining), runs)
    return table


@click.group()
@click.option("--ledger", "url", default=None, help=LEDGER_OPTION_HELP)
@click.pass_context
def cli(ctx: click.Context, url: str | None) -> None:
    """The global privacy-budget ledger: scopes, caps, runs, history and verification."""
    ctx.obj = {"url": url}


@cli.command()
@click.option("--app-role", "app_roles", multiple=True, metavar="ROLE",
              help="PostgreSQL: give existing ROLE the application rights only (append entries, update the derived "
                   "tables; no UPDATE/DELETE/TRUNCATE of entries, no DDL). Run as the owner role. Repeatable.")
@click.option("--print-sql", is_flag=True, help="With --app-role: print the GRANT statements run.")
@click.pass_context
def init(ctx: click.Context, app_roles, print_sql) -> None:
    """Create the ledger database (or migrate it to the current schema)."""
    from dpops.ledger.backend import redact
    from dpops.ledger.roles import grant_app_role

    with _ledger(ctx) as led:
        click.echo(f"ledger ready at {redact(led.url)} (schema version {led.schema_version})")
        for role in app_roles:
            statements = grant_app_role(led, role)
            if print_sql:
                click.echo(";\n".join(statements) + ";")
            click.echo(f"role {role}: may append entries and update the derived tables; cannot UPDATE, DELETE or "
                       "TRUNCATE entries, nor drop or disable triggers")


@cli.command()
@click.option("--dir", "directory", default=None, metavar="DIR",
              help="Where checkpoints are kept (env DPOPS_LEDGER_CHECKPOINTS_DIR), e.g. beside the manifests.")
@click.option("--signing-key", default=None, metavar="PEM",
              help="Ed25519 private key PEM (env DPOPS_LEDGER_CHECKPOINT_KEY), e.g. from `dpops ledger keygen`.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def checkpoint(ctx, directory, signing_key, as_json) -> None:
    """Sign the current chain head into DIR: an anchor a database administrator cannot recompute."""
    import os

    from dpops.errors import InvalidParameter
    from dpops.ledger.checkpoint import DIR_ENV, KEY_ENV, checkpoint_ledger

    directory = directory or os.environ.get(DIR_ENV)
    signing_key = signing_key or os.environ.get(KEY_ENV)
    if not directory or not signing_key:
        raise InvalidParameter(f"give --dir (or {DIR_ENV}) and --signing-key (or {KEY_ENV})")
    with _ledger(ctx) as led:
        path = checkpoint_ledger(led, directory, signing_key)
    doc = json.loads(path.read_text(encoding="utf-8"))
    if as_json:
        echo_json({"file": str(path), "entries": doc["entries"], "head_hash": doc["head_hash"]})
    else:
        click.echo(f"checkpoint {path}: {doc['entries']} entries, head {doc['head_hash']}")


@cli.group()
def scope() -> None:
    """Create and show budget scopes."""


@scope.command("create")
@click.argument("name")
@click.option("--unit", required=True, help="The privacy unit in words, e.g. \"a user's purchases on one day\".")
@click.option("--unit-column", required=True, help="Column holding the unit id, e.g. user_id.")
@click.option("--epsilon", type=float, default=None, help="Epsilon cap (checked at --delta).")
@click.option("--rho", type=float, default=None, help="zCDP rho cap instead of epsilon (needs --accountant zcdp).")
@click.option("--delta", type=float, required=True, help="Delta of the cap; must be well below 1/population.")
@click.option("--accountant", required=True, help="Accountant name or name/version, e.g. rdp or rdp/1 (pinned).")
@click.option("--bucket", type=click.Choice(["day", "week", "month"]), default=None,
              help="Separate cap per period; only for period-scoped units (needs the same --unit-period).")
@click.option("--unit-period", type=click.Choice(["day", "week", "month"]), default=None,
              help="The unit is scoped to one such period (e.g. a user-day).")
@click.option("--adjacency", type=click.Choice(["add_remove", "replace"]), required=True,
              help="Neighbouring datasets: a unit's data added/removed, or replaced. Releases must declare the same.")
@click.option("--record-level", is_flag=True, default=False,
              help="Each row is its own unit (releases must say privacy_unit.record_level: true).")
@click.option("--population", type=int, default=None, help="Declared number of units n (refuses delta >= 1/n).")
@click.option("--owner", default="")
@click.option("--description", default="")
@click.option("--actor", default=None, help="Who creates the scope (default cli:<user>).")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def scope_create(ctx, name, unit, unit_column, epsilon, rho, delta, accountant, bucket, unit_period, adjacency,
                 record_level, population, owner, description, actor, as_json) -> None:
    """Create scope NAME (idempotent when identical)."""
    definition = ScopeDefinition(name=name, unit=unit, unit_column=unit_column, epsilon=epsilon, delta=delta, rho=rho,
                                 accountant=accountant, bucket=bucket, population=population, owner=owner,
                                 description=description, unit_period=unit_period, adjacency=adjacency,
                                 record_level=record_level)
    with _ledger(ctx) as led:
        created = led.create_scope(definition, actor=actor or default_actor())
    if as_json:
        echo_json(created.to_dict())
    else:
        click.echo(f"scope {created.name}: cap {created.cap_unit}={created.cap:g}, delta={created.delta:g}, "
                   f"accountant {created.accountant}" + (f", per {created.bucket}" if created.bucket else ""))


@scope.command("show")
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def scope_show(ctx, name, as_json) -> None:
    """Show scope NAME, or all scopes."""
    with _ledger(ctx) as led:
        scopes = [led.scope(name)] if name else led.scopes()
    if as_json:
        echo_json([{**s.to_dict(), "adjacency": s.adjacency, "record_level": s.record_level} for s in scopes])
        return
    table = Table(title="budget scopes")
    for col in ("name", "cap", "delta", "accountant", "bucket", "unit", "unit column", "record level", "adjacency",
                "unit period", "owner"):
        table.add_column(col)
    for s in scopes:
        table.add_row(s.name, f"{'ρ' if s.rho is not None else 'ε'}={s.cap:g}", f"{s.delta:g}", s.accountant,
                      s.bucket or "-", s.unit, s.unit_column, "yes" if s.record_level else "no",
                      s.adjacency or "not recorded (legacy scope: releases refused)", s.unit_period or "-", s.owner)
    Console().print(table)


@cli.command()
@click.argument("name")
@click.option("--epsilon", type=float, default=None)
@click.option("--rho", type=float, default=None)
@click.option("--delta", type=float, default=None)
@click.option("--reason", required=True, help="Why the cap changes (kept in the ledger forever).")
@click.option("--actor", default=None)
@click.pass_context
def cap(ctx, name, epsilon, rho, delta, reason, actor) -> None:
    """Change the cap of scope NAME."""
    with _ledger(ctx) as led:
        new = led.change_cap(name, epsilon=epsilon, rho=rho, delta=delta, reason=reason, actor=actor or default_actor())
    click.echo(f"scope {new.name}: cap {new.cap_unit}={new.cap:g}, delta={new.delta:g}")


@cli.command()
@click.argument("scope_name", metavar="SCOPE")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def status(ctx, scope_name, as_json) -> None:
    """Budget spent, reserved and remaining on SCOPE (per bucket when bucketed)."""
    with _ledger(ctx) as led:
        st = led.status(scope_name)
    if as_json:
        echo_json(st.to_dict())
    else:
        Console().print(status_table(st))


@cli.command()
@click.argument("scope_name", metavar="[SCOPE]", required=False)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def history(ctx, scope_name, as_json) -> None:
    """Every ledger entry (of SCOPE), oldest first."""
    with _ledger(ctx) as led:
        entries = led.history(scope_name)
    if as_json:
        echo_json([e.to_dict() for e in entries])
        return
    table = Table(title=f"ledger history{' of ' + scope_name if scope_name else ''}")
    for col in ("id", "time (UTC)", "kind", "scope", "run", "buckets", "actor", "note", "hash"):
        table.add_column(col)
    for e in entries:
        note = e.data.get("reason") or e.data.get("output_uri") or ""
        table.add_row(str(e.id), e.ts[:19], e.kind, e.scope or "", (e.run_id or "")[:12], ",".join(e.buckets)[:24],
                      e.actor, str(note)[:40], e.hash[:12])
    Console().print(table)


@cli.command()
@click.argument("private_key", metavar="PRIVATE_PEM")
@click.argument("public_key", metavar="PUBLIC_PEM")
def keygen(private_key, public_key) -> None:
    """Create an Ed25519 key pair for checkpoints (private file 0600, never overwritten).

    Keep the private key with the operator or reviewer, never with the database administrator.
    """
    from dpops.manifest.sign import generate_signing_key

    try:
        kid = generate_signing_key(private_key, public_key)
    except FileExistsError:
        from dpops.errors import InvalidParameter

        raise InvalidParameter(f"{private_key} exists; a signing key is never overwritten") from None
    click.echo(f"Ed25519 key {kid}: private {private_key}, public {public_key}")


@cli.command()
@click.option("--export", "export_file", type=click.File("r"), default=None, metavar="FILE",
              help="Verify a `dpops ledger export` file alone (chain, state machine, totals); no database needed.")
@click.option("--checkpoints", "checkpoints_dir", default=None, metavar="DIR",
              help="Also require the chain to extend every signed checkpoint in DIR (needs --public-key). Default: "
                   "DPOPS_LEDGER_CHECKPOINTS_DIR when DPOPS_LEDGER_CHECKPOINT_PUBLIC_KEY is also set.")
@click.option("--public-key", default=None, metavar="PEM",
              help="Ed25519 public key of the checkpoints (env DPOPS_LEDGER_CHECKPOINT_PUBLIC_KEY).")
@click.option("--expect-head", "expect_heads", multiple=True, metavar="[N:]HASH",
              help="Also require an entry with this hash (at entry N), e.g. a head a reviewer wrote down. Repeatable.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def verify(ctx, export_file, checkpoints_dir, public_key, expect_heads, as_json) -> None:
    """Recompute the hash chain, the state machine and every cached total. Exit 7 on failure.

    Without --checkpoints or --expect-head this proves only that the database is self-consistent: its
    owner could have rebuilt it. The anchors prove it still extends what a reviewer saw.
    """
    from dpops.errors import InvalidParameter
    from dpops.ledger.checkpoint import default_public_key, load_checkpoints

    import os

    from dpops.ledger.checkpoint import DIR_ENV, PUBLIC_KEY_ENV

    if not checkpoints_dir and os.environ.get(DIR_ENV) and os.environ.get(PUBLIC_KEY_ENV):
        checkpoints_dir = os.environ[DIR_ENV]  # a reviewer's environment: anchored by default
    checkpoints = None
    if checkpoints_dir:
        key = default_public_key(public_key)
        if not key:
            raise InvalidParameter("--checkpoints needs --public-key (or DPOPS_LEDGER_CHECKPOINT_PUBLIC_KEY): "
                                   "an unverified checkpoint proves nothing")
        checkpoints = load_checkpoints(checkpoints_dir, key)
    if export_file is not None:
        from dpops.ledger.verify import verify_export

        report = verify_export(export_file, getattr(export_file, "name", "export"), checkpoints, expect_heads)
    else:
        with _ledger(ctx) as led:
            report = led.verify(checkpoints=checkpoints, expect_heads=expect_heads)
    if as_json:
        echo_json(report.to_dict())
    elif report.ok:
        what = "export" if export_file is not None else "ledger"
        click.echo(f"{what} OK: {report.entries} entries, head {report.head_hash}")
        if report.anchors.get("checkpoints"):
            click.echo(f"extends {report.anchors['checkpoints']} signed checkpoint(s), latest at entry "
                       f"{report.anchors['latest_entries']} (key {report.anchors['public_key_id']})")
        if report.anchors.get("expect_head"):
            click.echo(f"contains the expected head(s) {', '.join(report.anchors['expect_head'])}")
        if not report.anchors:
            click.echo("not anchored: give --checkpoints DIR --public-key PEM (or --expect-head) to show the chain "
                       "was not rebuilt by someone with database write access")
        for scope_name, t in sorted(report.totals.items()):
            spent = ", ".join(f"{b}: {fmt(v['settled'])}" for b, v in sorted(t["buckets"].items()))
            click.echo(f"scope {scope_name}: cap {t['unit']}={fmt(t['cap'])}; settled {spent}")
    else:
        for p in report.problems:
            click.echo(f"FAILED: {p}")
    if not report.ok:
        where = f" at entry {report.first_bad_entry}" if report.first_bad_entry is not None else ""
        raise IntegrityError(f"ledger verification failed{where}: {report.problems[0]}")


@cli.command()
@click.argument("file", type=click.File("w"), default="-")
@click.pass_context
def export(ctx, file) -> None:
    """Write every entry as one JSON line to FILE (default stdout)."""
    with _ledger(ctx) as led:
        n = led.export(file)
    if file is not sys.stdout and getattr(file, "name", "-") != "<stdout>":
        click.echo(f"exported {n} entries", err=True)


@cli.command()
@click.option("--older-than", "older_than", type=float, required=True,
              help="Only runs idle for longer than this many seconds.")
@click.option("--actor", default=None)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def recover(ctx, older_than, actor, as_json) -> None:
    """Close abandoned runs: reserved -> released (refund), started -> spent_unpublished (charge stays)."""
    with _ledger(ctx) as led:
        recs = led.recover(older_than_seconds=older_than, actor=actor or default_actor())
    if as_json:
        echo_json([{"run_id": r.run_id, "scope": r.scope, "state": r.state} for r in recs])
        return
    for r in recs:
        click.echo(f"{r.run_id} ({r.scope}, {r.key.release} {r.key.interval_start}): {r.state}")
    click.echo(f"recovered {len(recs)} run(s)")


@cli.command()
@click.option("--scope", "scope_name", default=None)
@click.option("--release", default=None)
@click.option("--state", "states", multiple=True, type=click.Choice(RUN_STATES))
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def runs(ctx, scope_name, release, states, as_json) -> None:
    """List runs and their states."""
    with _ledger(ctx) as led:
        recs = led.runs(scope=scope_name, release=release, states=list(states) or None)
    if as_json:
        echo_json([{"run_id": r.run_id, "scope": r.scope, "state": r.state, "key": r.key.to_dict(),
                    "buckets": r.buckets, "restates": r.restates, "output_uri": r.output_uri,
                    "epsilon": r.epsilon if math.isfinite(r.epsilon) else None, "entry_ids": r.entry_ids,
                    "created_at": r.created_at, "updated_at": r.updated_at} for r in recs])
        return
    table = Table(title="runs")
    for col in ("run", "scope", "release", "interval", "state", "ε", "restates", "output"):
        table.add_column(col)
    for r in recs:
        table.add_row(r.run_id[:12], r.scope, r.key.release, f"{r.key.interval_start} .. {r.key.interval_end}",
                      r.state, fmt(r.epsilon), (r.restates or "")[:12], r.output_uri or "")
    Console().print(table)
