"""``dpops ledger``: inspect and administer the global privacy-budget ledger.

Rich tables for humans, ``--json`` for machines (one object with ``ok`` and ``exit_code``). The
ledger URL comes from ``--ledger`` (before or after the command, see ``dpops.cli.common``) or
DPOPS_LEDGER_URL; there is no default file, and only ``init`` and ``scope create`` may create a
SQLite ledger that does not exist yet.
"""

from __future__ import annotations

import getpass
import json
import math
import sys
from typing import TYPE_CHECKING, Any

import click

from dpops.cli.common import (
    HelpGroup,
    LEDGER_HELP,
    attach,
    echo_ok,
    json_option,
    key_file_option,
    ledger_option,
    ledger_url,
    open_cli_ledger,
    print_table,
    say,
)
from dpops.errors import IntegrityError
from dpops.ledger import ScopeDefinition, TimeRule
from dpops.ledger.budget import budget_json, format_budget
from dpops.ledger import model
from dpops.ledger.model import RUN_STATES, ScopeStatus

if TYPE_CHECKING:
    from dpops.ledger.checkpoint import Checkpoint

LEDGER_OPTION_HELP = LEDGER_HELP
CHARGED_STATES = model.CHARGED_STATES  # the one owner: dpops.ledger.model


def default_actor() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except Exception:  # no user name in this environment
        return "cli"


def fmt(x: float | None, scale: float | None = None) -> str:
    """A budget figure as people read it (``dpops.ledger.budget.format_budget``, the one owner)."""
    return format_budget(x, scale)


fmt_budget = fmt


def echo_json(obj) -> None:
    """The success object of a command (``ok``/``exit_code`` added; a list goes under ``key``)."""
    echo_ok(obj if isinstance(obj, dict) else {"items": obj})


def _ledger(ctx: click.Context, *, create: bool = False):
    return open_cli_ledger(ctx, create=create)


def per_run_sums(led, st: ScopeStatus) -> dict[str, float]:
    """Per bucket, the plain sum of each charged run's own figure (its ``epsilon`` as the accountant
    counts that run alone). Shown beside the composed total so a reviewer sees why they differ: the
    accountant composes all runs together (e.g. RDP), which is tighter than adding them up."""
    sums = {b.bucket: 0.0 for b in st.buckets}
    for r in led.runs(scope=st.scope, states=list(CHARGED_STATES)):
        for b in r.buckets or ["*"]:
            if b in sums and r.epsilon is not None:
                sums[b] += float(r.epsilon)
    return sums


def composition_note(st: ScopeStatus, sums: dict[str, float]) -> str:
    unit = "ε" if st.unit == "epsilon" else "ρ"
    top = max(st.buckets, key=lambda b: b.total).bucket if st.buckets else None
    added = f"; the plain sum of the runs' own {unit} is {fmt(sums[top], st.cap)}" if top in sums else ""
    return (f"total = every charged run (committed, spent unpublished, started, reserved) composed by the "
            f"{st.accountant} accountant{' at δ=' + format(st.delta, 'g') if st.unit == 'epsilon' else ''}, "
            f"not the sum of per-run {unit}{added}; remaining = cap - total")


def status_table(st: ScopeStatus, sums: dict[str, float] | None = None) -> tuple[str, list[str], list[list[str]], str]:
    unit = "ε" if st.unit == "epsilon" else "ρ"
    title = f"scope {st.scope}: cap {unit}={fmt(st.cap)}" + (f" at δ={st.delta:g}" if st.unit == "epsilon" else "")
    sums = sums or {}
    cols = ["bucket", "committed", "spent unpublished", "started", "reserved", f"sum of runs' {unit}",
            f"scope total {unit} (composed)", "cap", "remaining", "runs"]
    rows = []
    for b in st.buckets:
        runs = ", ".join(f"{k} {v}" for k, v in sorted(b.runs.items()))
        c = st.cap  # every figure at the cap's precision: no float crumbs (issue 21 item 8)
        rows.append([b.bucket, fmt(b.committed, c), fmt(b.spent_unpublished, c), fmt(b.started, c),
                     fmt(b.reserved, c), fmt(sums.get(b.bucket), c) if b.bucket in sums else "?", fmt(b.total, c),
                     fmt(st.cap), fmt(b.remaining, c), runs])
    return f"{title} ({st.accountant} accountant)", cols, rows, composition_note(st, sums)


STATUS_FIGURES = ("committed", "spent_unpublished", "started", "reserved", "total", "remaining", "sum_of_runs")


def status_json(st: ScopeStatus, sums: dict[str, float]) -> dict[str, Any]:
    """``ledger status --json``: the figures the table shows (``budget_json``: rounded as people read them,
    ``remaining`` exactly 0 at the cap), the exact ones under ``exact``, per bucket too."""
    doc = st.to_dict()
    top = max(st.buckets, key=lambda b: b.total).bucket if st.buckets else None
    doc["sum_of_runs"] = sums.get(top, 0.0) if top else 0.0
    doc["composition"] = composition_note(st, sums)
    scales: dict[str, float | None] = {f: st.cap for f in STATUS_FIGURES}
    buckets = []
    for b in doc["buckets"]:
        b["sum_of_runs"] = sums.get(b["bucket"])
        buckets.append(budget_json(b, scales))
    doc["buckets"] = buckets
    return budget_json(doc, {**scales, "cap": None})


def writer_lines(writers: dict) -> list[str]:
    """What ``verify`` knows of who wrote the entries (issue 19 item 10), in words."""
    out = []
    if writers.get("access"):
        out.append(writers["access"])
    elif writers.get("owner"):
        by = ", ".join(f"{w} {n}" for w, n in writers.get("owner_only_by_writer", {}).items()) or "none recorded"
        out.append(f"owner role {writers['owner']}: scope and cap entries written by {by}")
        if writers.get("unknown_roles"):
            out.append(f"writer role(s) {', '.join(writers['unknown_roles'])} do not exist in this database "
                       "(history imported from another cluster?): their scope and cap entries cannot be judged")
    if writers.get("unrecorded"):
        out.append(f"{writers['unrecorded']} entr{'y has' if writers['unrecorded'] == 1 else 'ies have'} no recorded "
                   "writer (written on SQLite or before schema version 3)")
    return out


@click.group(cls=HelpGroup)
@ledger_option
def cli() -> None:
    """The global privacy-budget ledger: scopes, caps, runs, history and verification."""


@cli.command()
@click.option("--app-role", "app_roles", multiple=True, metavar="ROLE",
              help="PostgreSQL: give existing ROLE the application rights only (append entries, update the derived "
                   "tables; no UPDATE/DELETE/TRUNCATE of entries, no DDL). Run as the owner role. Repeatable.")
@click.option("--reader-role", "reader_roles", multiple=True, metavar="ROLE",
              help="PostgreSQL: give existing ROLE SELECT on the ledger tables and nothing else (the Airflow "
                   "api-server's Privacy budget page). Run as the owner role. Repeatable.")
@click.option("--print-sql", is_flag=True, help="With --app-role/--reader-role: print the GRANT statements run.")
@ledger_option
@json_option
@click.pass_context
def init(ctx: click.Context, app_roles, reader_roles, print_sql, as_json) -> None:
    """Create the ledger database (or migrate it to the current schema).

    The only command, with ``scope create``, that may create a new SQLite file."""
    from dpops.errors import InvalidParameter
    from dpops.ledger.backend import redact
    from dpops.ledger.roles import grant_app_role, grant_reader_role, require_owner

    both = sorted(set(app_roles) & set(reader_roles))
    if both:
        raise InvalidParameter(f"role(s) {', '.join(both)} given as both --app-role and --reader-role: the reader "
                               "must be a separate role (its grant revokes every other right); nothing was changed")
    granted: list[dict[str, object]] = []
    readers: list[dict[str, object]] = []
    with _ledger(ctx, create=True) as led:
        # Owner-only even when the schema is up to date (a no-op): an application role is told so, by name.
        require_owner(led.db, "initialise or migrate the ledger and grant roles (`dpops ledger init`)")
        url, version = redact(led.url), led.schema_version
        if not as_json:
            say(f"ledger ready at {url} (schema version {version})")
        grants = ((app_roles, grant_app_role, granted,
                   "may append entries (the database derives the run cache from them); cannot UPDATE, DELETE "
                   "or TRUNCATE entries or write any cache, nor drop or disable triggers"),
                  (reader_roles, grant_reader_role, readers, "may read the ledger (SELECT) and nothing else"))
        for roles, grant, record, rights in grants:
            for role in roles:
                statements = grant(led, role)
                record.append({"role": role, "statements": statements})
                if as_json:
                    continue
                if print_sql:
                    click.echo(";\n".join(statements) + ";")
                say(f"role {role}: {rights}")
    if as_json:
        echo_ok({"ledger": url, "schema_version": version, "app_roles": granted, "reader_roles": readers})


@cli.command("install-cap-check")
@click.option("--owner-role", required=True, metavar="ROLE",
              help="The ledger owner role (the one that runs `dpops ledger init`): the only role granted EXECUTE.")
@click.option("--site-dir", "site_dirs", multiple=True, metavar="DIR",
              help="Where the database server's Python finds dpops and its dependencies (repeatable; default: this "
                   "dpops' own directory and site-packages, right when the server runs on this machine).")
@ledger_option
@json_option
@click.pass_context
def install_cap_check(ctx: click.Context, owner_role, site_dirs, as_json) -> None:
    """PostgreSQL, as a superuser: make the database refuse any reservation over the cap (schema version 5).

    Installs the PL/Python function the owner's trigger calls on every reservation an application role
    writes, so that one written around dpops is refused by the database, with the same rule dpops applies.
    Run once per ledger schema, before or after `dpops ledger init`; idempotent."""
    from dpops.errors import InvalidParameter
    from dpops.ledger import db_cap
    from dpops.ledger.backend import postgres_target, redact

    url = str(ledger_url(ctx))
    if url.split("://", 1)[0].lower().startswith("sqlite"):
        raise InvalidParameter(f"install-cap-check applies to PostgreSQL ledgers only, not {redact(url)}: a SQLite "
                               "ledger has no roles (its file's permissions decide who may write it)")
    conninfo, schema = postgres_target(url)
    probe = db_cap.install(conninfo, schema=schema or "public", owner_role=owner_role,
                           site_dirs=list(site_dirs) or None)
    if as_json:
        echo_ok({"ledger": redact(url), **probe})
        return
    click.echo(f"cap check {probe['check']} installed in schema {schema} of {redact(url)}: the database runs "
               f"dpops {probe['dpops']} on Python {probe['python']} from {', '.join(probe['site_dirs'])}; EXECUTE "
               f"granted to {owner_role} only. Reservations by any other role are now checked against the cap by "
               "the database.")


@cli.command()
@click.option("--dir", "directory", default=None, metavar="DIR",
              help="Where checkpoints are kept (env DPOPS_LEDGER_CHECKPOINTS_DIR), e.g. beside the manifests.")
@click.option("--signing-key", default=None, metavar="PEM",
              help="Ed25519 private key PEM (env DPOPS_LEDGER_CHECKPOINT_KEY), e.g. from `dpops ledger keygen`.")
@ledger_option
@json_option
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
        say(f"checkpoint {path}: {doc['entries']} entries, head {doc['head_hash']}")


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
@click.option("--time-column", default=None,
              help="Event-time column whose time puts a row in a period (required with --bucket); every release "
                   "must declare it as input.time_column (type timestamp; naive times are UTC).")
@click.option("--owner", default="")
@click.option("--description", default="")
@click.option("--actor", default=None, help="Who creates the scope (default cli:<user>).")
@ledger_option
@json_option
@click.pass_context
def scope_create(ctx, name, unit, unit_column, epsilon, rho, delta, accountant, bucket, unit_period, adjacency,
                 record_level, population, time_column, owner, description, actor, as_json) -> None:
    """Create scope NAME (idempotent when identical).

    On an existing scope that records no time rule (created before time rules existed), the same
    definition with --time-column pins it (an explicit ``scope_time_pinned`` entry), as ``scope pin-time``."""
    definition = ScopeDefinition(name=name, unit=unit, unit_column=unit_column, epsilon=epsilon, delta=delta, rho=rho,
                                 accountant=accountant, bucket=bucket, population=population, owner=owner,
                                 description=description, unit_period=unit_period, adjacency=adjacency,
                                 record_level=record_level,
                                 time_rule=TimeRule(column=time_column) if time_column is not None else None)
    with _ledger(ctx, create=True) as led:
        existed = any(s.name == name for s in led.scopes())
        created = led.create_scope(definition, actor=actor or default_actor())
        asked = led.normalized_scope(definition)
    cap_changed = created.to_dict() != asked.to_dict()
    if as_json:
        echo_json({**created.to_dict(), "created": not existed, "cap_changed_since_creation": cap_changed})
        return
    desc = (f"cap {created.cap_unit}={fmt_budget(created.cap)}, delta={created.delta:g}, accountant "
            f"{created.accountant}" + (f", per {created.bucket}" if created.bucket else ""))
    if not existed:
        say(f"scope {created.name} created: {desc}")
    elif cap_changed:
        say(f"scope {created.name} exists as created; its cap was changed since through `dpops ledger cap` "
                   f"(created with {asked.cap_unit}={fmt_budget(asked.cap)}, delta={asked.delta:g}; now {desc}): "
                   f"left as it is (history: `dpops ledger history {created.name}`)")
    else:
        say(f"scope {created.name} exists with this definition: {desc}; nothing to do")


@scope.command("show")
@click.argument("name", required=False)
@ledger_option
@json_option
@click.pass_context
def scope_show(ctx, name, as_json) -> None:
    """Show scope NAME, or all scopes."""
    with _ledger(ctx) as led:
        scopes = [led.scope(name)] if name else led.scopes()
    if as_json:
        echo_ok({"scopes": [{**s.to_dict(), "adjacency": s.adjacency, "record_level": s.record_level,
                             "time_rule": s.time_rule.to_dict() if s.time_rule is not None else None,
                             "unit_definition": s.unit_definition} for s in scopes]})
        return
    cols = ["name", "cap", "delta", "accountant", "bucket", "unit", "unit column", "record level", "adjacency",
            "unit period", "time rule", "owner"]
    rows = [[s.name, f"{'ρ' if s.rho is not None else 'ε'}={s.cap:g}", f"{s.delta:g}", s.accountant,
             s.bucket or "-", s.unit, s.unit_column, "yes" if s.record_level else "no",
             s.adjacency or "not recorded (legacy scope: releases refused)", s.unit_period or "-", _time_text(s),
             s.owner]
            for s in scopes]
    print_table("budget scopes", cols, rows,
                keep=("name", "accountant", "cap", "delta", "bucket", "unit column", "owner"),
                below=("unit", "adjacency", "time rule"))


def _time_text(s: ScopeDefinition) -> str:
    if s.time_rule is not None:
        return s.time_rule.describe()
    if s.bucket is not None:
        return f"not recorded (legacy scope: releases refused; pin with dpops ledger scope pin-time {s.name})"
    return "-"


@scope.command("pin-time")
@click.argument("name")
@click.option("--time-column", required=True,
              help="The event-time column every release on the scope must declare as input.time_column.")
@click.option("--reason", required=True, help="Why, and how the releases already charged were checked (kept forever).")
@click.option("--actor", default=None, help="Who pins the rule (default cli:<user>).")
@ledger_option
@json_option
@click.pass_context
def scope_pin_time(ctx, name, time_column, reason, actor, as_json) -> None:
    """Record the time rule of scope NAME, created before scopes recorded one.

    Which column's time puts a row in a period is part of the unit definition (issue 19): until it is
    recorded, a bucketed scope refuses every release. A recorded rule is never changed. Check first,
    from the manifests of the releases already charged to NAME, that they all used this column."""
    rule = TimeRule(column=time_column)
    with _ledger(ctx) as led:
        new = led.pin_time_rule(name, rule, reason=reason, actor=actor or default_actor())
    if as_json:
        echo_ok({"scope": new.to_dict(), "time_rule": rule.to_dict(), "reason": reason})
    else:
        say(f"scope {new.name}: time rule {rule.describe()}")


@cli.command()
@click.argument("name")
@click.option("--epsilon", type=float, default=None)
@click.option("--rho", type=float, default=None)
@click.option("--delta", type=float, default=None)
@click.option("--reason", required=True, help="Why the cap changes (kept in the ledger forever).")
@click.option("--actor", default=None)
@ledger_option
@json_option
@click.pass_context
def cap(ctx, name, epsilon, rho, delta, reason, actor, as_json) -> None:
    """Change the cap of scope NAME."""
    with _ledger(ctx) as led:
        new = led.change_cap(name, epsilon=epsilon, rho=rho, delta=delta, reason=reason, actor=actor or default_actor())
    if as_json:
        echo_ok({"scope": new.to_dict(), "cap_unit": new.cap_unit, "cap": new.cap, "reason": reason})
    else:
        say(f"scope {new.name}: cap {new.cap_unit}={fmt(new.cap)}, delta={new.delta:g}")


@cli.command()
@click.argument("scope_name", metavar="SCOPE", required=False)
@ledger_option
@json_option
@click.pass_context
def status(ctx, scope_name, as_json) -> None:
    """Budget spent, reserved and remaining on SCOPE (per bucket when bucketed).

    The scope total is every charged run composed by the scope's accountant; the plain sum of the
    runs' own ε is shown beside it (it is larger under RDP/PLD/zCDP composition). `dpops ledger
    scope show` lists the scopes."""
    if scope_name is None:
        raise click.UsageError("give a SCOPE: `dpops ledger scope show` lists the scopes of this ledger", ctx)
    with _ledger(ctx) as led:
        st = led.status(scope_name)
        sums = per_run_sums(led, st)
    if as_json:
        echo_json(status_json(st, sums))
    else:
        title, cols, rows, note = status_table(st, sums)
        print_table(title, cols, rows, keep=[c for c in cols if c != "runs"], caption=note,
                    right=[c for c in cols if c not in ("bucket", "runs")])


@cli.command()
@click.argument("scope_name", metavar="[SCOPE]", required=False)
@ledger_option
@json_option
@click.pass_context
def history(ctx, scope_name, as_json) -> None:
    """Every ledger entry (of SCOPE), oldest first."""
    with _ledger(ctx) as led:
        entries = led.history(scope_name)
    if as_json:
        echo_ok({"entries": [e.to_dict() for e in entries]})
        return
    cols = ["id", "time (UTC)", "kind", "scope", "run", "buckets", "actor", "note", "hash"]
    rows = []
    for e in entries:
        note = e.data.get("reason") or e.data.get("output_uri") or ""
        rows.append([str(e.id), e.ts[:19], e.kind, e.scope or "", e.run_id or "", ", ".join(e.buckets), e.actor,
                     str(note), e.hash[:16]])
    # one line per entry with the short words; the run id, the reason or output URI and the hash under it
    print_table(f"ledger history{' of ' + scope_name if scope_name else ''}", cols, rows,
                keep=("id", "time (UTC)", "kind", "scope", "actor"), below=("run", "note", "hash"), right=("id",))


@cli.command()
@click.argument("private_key", metavar="PRIVATE_PEM")
@click.argument("public_key", metavar="PUBLIC_PEM")
@json_option
def keygen(private_key, public_key, as_json) -> None:
    """Create an Ed25519 key pair for checkpoints (private file 0600, never overwritten).

    Keep the private key with the operator or reviewer, never with the database administrator.
    """
    from dpops.manifest.sign import generate_signing_key

    try:
        kid = generate_signing_key(private_key, public_key)
    except FileExistsError:
        from dpops.errors import InvalidParameter

        raise InvalidParameter(f"{private_key} exists; a signing key is never overwritten") from None
    if as_json:
        echo_ok({"key_id": kid, "private_key": private_key, "public_key": public_key})
    else:
        say(f"Ed25519 key {kid}: private {private_key}, public {public_key}")


def _checkpoints(checkpoints_dir: str | None, public_key: str | None) -> list[Checkpoint] | None:
    """Signed checkpoints for ``verify`` and ``import``; a reviewer's environment is anchored by default.

    An unverified checkpoint proves nothing, so a directory without a public key is refused."""
    import os

    from dpops.errors import InvalidParameter
    from dpops.ledger.checkpoint import DIR_ENV, PUBLIC_KEY_ENV, default_public_key, load_checkpoints

    if not checkpoints_dir and os.environ.get(DIR_ENV) and os.environ.get(PUBLIC_KEY_ENV):
        checkpoints_dir = os.environ[DIR_ENV]
    if not checkpoints_dir:
        return None
    key = default_public_key(public_key)
    if not key:
        raise InvalidParameter("--checkpoints needs --public-key (or DPOPS_LEDGER_CHECKPOINT_PUBLIC_KEY): "
                               "an unverified checkpoint proves nothing")
    return load_checkpoints(checkpoints_dir, key)

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
@ledger_option
@json_option
@click.pass_context
def verify(ctx, export_file, checkpoints_dir, public_key, expect_heads, as_json) -> None:
    """Recompute the hash chain, the state machine and every cached total. Exit 7 on failure.

    Without --checkpoints or --expect-head this proves only that the database is self-consistent: its
    owner could have rebuilt it. The anchors prove it still extends what a reviewer saw.
    """
    checkpoints = _checkpoints(checkpoints_dir, public_key)
    if export_file is not None:
        from dpops.ledger.verify import verify_export

        report = verify_export(export_file, getattr(export_file, "name", "export"), checkpoints, expect_heads)
    else:
        with _ledger(ctx) as led:
            report = led.verify(checkpoints=checkpoints, expect_heads=expect_heads)
    if as_json:
        if report.ok:
            echo_json(report.to_dict())
    elif report.ok:
        what = "export" if export_file is not None else "ledger"
        say(f"{what} OK: {report.entries} entries, head {report.head_hash}")
        if report.anchors.get("checkpoints"):
            say(f"extends {report.anchors['checkpoints']} signed checkpoint(s), latest at entry "
                       f"{report.anchors['latest_entries']} (key {report.anchors['public_key_id']})")
        if report.anchors.get("expect_head"):
            say(f"contains the expected head(s) {', '.join(report.anchors['expect_head'])}")
        if not report.anchors:
            say("not anchored: give --checkpoints DIR --public-key PEM (or --expect-head) to show the chain "
                       "was not rebuilt by someone with database write access")
        for line in writer_lines(report.writers):
            say(line)
        for scope_name, t in sorted(report.totals.items()):
            spent = ", ".join(f"{b}: {fmt(v['settled'], t['cap'])}" for b, v in sorted(t["buckets"].items()))
            say(f"scope {scope_name}: cap {t['unit']}={fmt(t['cap'])}; settled {spent}")
    else:
        for p in report.problems:
            say(f"FAILED: {p}")
    if not report.ok:
        where = f" at entry {report.first_bad_entry}" if report.first_bad_entry is not None else ""
        raise attach(IntegrityError(f"ledger verification failed{where}: {report.problems[0]}"), report.to_dict())


@cli.command()
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True), default="-")
@ledger_option
@json_option
@click.pass_context
def export(ctx, file, as_json) -> None:
    """Write every entry as one JSON line to FILE (default stdout; with --json a FILE is needed, and the
    JSON object says how many entries were written)."""
    from dpops.errors import InvalidParameter

    if as_json and file == "-":
        raise InvalidParameter("--json reports on the export: give a FILE for the entries")
    with _ledger(ctx) as led:
        if file == "-":
            n = led.export(sys.stdout)
            return
        with click.open_file(file, "w") as fh:
            n = led.export(fh)
    if as_json:
        echo_ok({"file": file, "entries": n})
    else:
        say(f"exported {n} entries", err=True)


@cli.command()
@click.option("--older-than", "older_than", type=float, required=True,
              help="Only runs idle for longer than this many seconds.")
@click.option("--actor", default=None)
@ledger_option
@json_option
@click.pass_context
def recover(ctx, older_than, actor, as_json) -> None:
    """Close abandoned runs: reserved -> released (refund), started -> spent_unpublished (charge stays)."""
    with _ledger(ctx) as led:
        recs = led.recover(older_than_seconds=older_than, actor=actor or default_actor())
    if as_json:
        echo_ok({"recovered": [{"run_id": r.run_id, "scope": r.scope, "state": r.state} for r in recs]})
        return
    for r in recs:
        say(f"{r.run_id} ({r.scope}, {r.key.release} {r.key.interval_start}): {r.state}")
    say(f"recovered {len(recs)} run(s)")


@cli.command()
@click.option("--scope", "scope_name", default=None)
@click.option("--release", default=None)
@click.option("--state", "states", multiple=True, type=click.Choice(RUN_STATES))
@ledger_option
@json_option
@click.pass_context
def runs(ctx, scope_name, release, states, as_json) -> None:
    """List runs and their states."""
    with _ledger(ctx) as led:
        recs = led.runs(scope=scope_name, release=release, states=list(states) or None)
    if as_json:
        # each run's ε as the table shows it (``budget_json``), the accountant's float under ``exact``
        echo_ok({"runs": [budget_json({
            "run_id": r.run_id, "scope": r.scope, "state": r.state, "key": r.key.to_dict(), "buckets": r.buckets,
            "restates": r.restates, "output_uri": r.output_uri,
            "epsilon": r.epsilon if math.isfinite(r.epsilon) else None, "entry_ids": r.entry_ids,
            "created_at": r.created_at, "updated_at": r.updated_at}, {"epsilon": None}) for r in recs]})
        return
    if not recs:  # an empty table reads like a failure to load; say what was asked and that none match
        asked = [f"in state {' or '.join(states)}" if states else "",
                 f"on scope {scope_name}" if scope_name else "", f"of release {release}" if release else ""]
        say(" ".join(["no runs", *[a for a in asked if a]]))
        return
    # Fits 80 columns: the interval's two instants stack in one cell (never shortened), the run id, what
    # it restates and its output URI go on their own lines under the row, whole for copying; so does a
    # release name too long for the row.
    cols = ["scope", "release", "interval", "state", "ε", "run", "restates", "output"]
    rows = [[r.scope, r.key.release, f"{r.key.interval_start}\n{r.key.interval_end}", r.state, fmt(r.epsilon),
             r.run_id, r.restates or "", r.output_uri or ""] for r in recs]
    print_table("runs (ε: each run alone, as its scope's accountant counts it)", cols, rows,
                keep=("interval", "scope", "state", "ε"), below=("run", "restates", "output"),
                below_if_needed=("release",), right=("ε",))


@cli.command("reserve")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--interval", required=True,
              help="data interval START/END (ISO-8601 UTC), or one START for the spec's period starting there")
@key_file_option("the run key holds the input's keyed fingerprint")
@click.option("--randomness", type=click.Choice(["keyed", "os", "test"]), default="keyed", show_default=True)
@click.option("--test-seed", type=int, default=None, help="with --randomness test: the seed (never publishable)")
@click.option("--start", "do_start", is_flag=True, help="then mark the run started (no refund after this)")
@click.option("--commit", "do_commit", is_flag=True, help="then commit it (needs --output-uri; implies --start)")
@click.option("--output-uri", default=None, help="with --commit: where the run's output is published")
@click.option("--release", "do_release", is_flag=True, help="then refund the reservation (only before --start)")
@click.option("--reason", default=None, help="with --release: why (kept in the ledger)")
@click.option("--actor", default=None)
@ledger_option
@json_option
def reserve_cmd(spec, interval, key_file, randomness, test_seed, do_start, do_commit, output_uri, do_release, reason,
                actor, as_json) -> None:
    """Reserve (and optionally start, commit or release) SPEC's run over --interval without a Beam job.

    The same checks as `dpops release run` (dpops.release.prepare and reserve): the input is checked and
    fingerprinted, the scope's unit definition must match the spec's, the cap is enforced by the
    scope's accountant, and the run key is idempotent (the same input, spec and key reserve once).
    For operators (hold budget for a run, close a stuck one) and tests."""
    from dpops import release
    from dpops.cli.release import parse_interval_option, scope_figures_json
    from dpops.errors import InvalidParameter, LedgerError

    if do_release and (do_start or do_commit):
        raise InvalidParameter("--release refunds a reservation; it cannot be combined with --start or --commit "
                               "(a started run may have drawn noise: its charge is never refunded)")
    if do_commit and not output_uri:
        raise InvalidParameter("--commit needs --output-uri: the ledger records where the run was published")
    if do_release and not reason:
        raise InvalidParameter("--release needs --reason (kept in the ledger)")
    iv = parse_interval_option(spec, interval)
    who = actor or default_actor()
    with open_cli_ledger() as led:
        ctx = release.prepare(spec, iv.start, iv.end, randomness=randomness, key_path=key_file, test_seed=test_seed,
                              actor=who, ledger=led)
        out = release.reserve(ctx, led)
        charged = out.epsilon_charged
        if out.state != "already_published":
            rec = led.run(ctx.run_id)
            if do_release:
                if rec.state != "reserved":
                    raise LedgerError(f"run {ctx.run_id} is {rec.state}: only a reserved run is refunded")
                rec = led.release(ctx.run_id, reason=reason, actor=who)
            if (do_start or do_commit) and rec.state == "reserved":
                rec = led.start(ctx.run_id, actor=who)
            if do_commit and rec.state == "started":
                rec = led.commit(ctx.run_id, output_uri=output_uri, actor=who,
                                 details={"note": "committed by dpops ledger reserve --commit (no Beam job)"})
            out = release.context.make_outcome(ctx, led, rec.state, record=rec, charged=charged)
    if as_json:
        echo_ok(scope_figures_json(out.as_dict()))  # the figures the line shows, exact under "exact"
    else:
        say(out.line())


@cli.command("import")
@click.argument("file", type=click.File("r", encoding="utf-8"), metavar="FILE")
@click.option("--expect-head", "expect_heads", multiple=True, metavar="[N:]HASH",
              help="Require the export (and the imported ledger) to hold this head, e.g. the one `dpops ledger "
                   "verify --export FILE` printed on the old machine. Repeatable.")
@click.option("--checkpoints", "checkpoints_dir", default=None, metavar="DIR",
              help="Also require the chain to extend every signed checkpoint in DIR, taken on the old ledger "
                   "(needs --public-key). Default: DPOPS_LEDGER_CHECKPOINTS_DIR when "
                   "DPOPS_LEDGER_CHECKPOINT_PUBLIC_KEY is also set.")
@click.option("--public-key", default=None, metavar="PEM",
              help="Ed25519 public key of the checkpoints (env DPOPS_LEDGER_CHECKPOINT_PUBLIC_KEY).")
@ledger_option
@json_option
@click.pass_context
def import_(ctx, file, expect_heads, checkpoints_dir, public_key, as_json) -> None:
    """Load a `dpops ledger export` FILE into this empty ledger (e.g. SQLite to PostgreSQL), verified.

    The export is verified from the file alone first; the ledger must be initialised and empty (never
    merged into); entries are copied verbatim (same chain, same head), the derived tables rebuilt by the
    replay `verify` uses, all in one transaction that is verified before it commits. PostgreSQL: run it
    as the owner role. Exit 7 for an export that does not verify, 6 for a target that is not empty.
    """

    from dpops.ledger.transfer import import_export, read_export

    checkpoints = _checkpoints(checkpoints_dir, public_key)
    source = getattr(file, "name", "export")
    export = read_export(file, source, checkpoints, expect_heads)  # before the target is opened for writing
    with _ledger(ctx) as led:
        result = import_export(led, export, checkpoints=checkpoints, expect_heads=expect_heads)
    if as_json:
        echo_ok(result.to_dict())
        return
    states = ", ".join(f"{k} {v}" for k, v in result.runs_by_state.items())
    say(f"imported {result.entries} entries from {source} into {result.ledger}: {len(result.scopes)} "
               f"scope(s), {result.runs} run(s)" + (f" ({states})" if states else ""))
    say(f"ledger OK: head {result.head}")
    if result.anchors.get("checkpoints"):
        say(f"extends {result.anchors['checkpoints']} signed checkpoint(s) of the old ledger")
