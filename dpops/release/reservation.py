"""Step 2, ``reserve``: the ledger write that comes before any private data is touched.

In order: serve an already published interval for free (after making sure its files are the
published ones); refuse a changed input without an explicit restatement (a second release of an
interval is a fresh, charged restatement and is never done silently); refuse a storage
publication this ledger does not know (never spend budget on a run that could not be published);
refuse a release whose unit definition differs from the scope's (a scope's cap is a statement
about one unit definition); else reserve the plan's events under the scope's lock. The scope's
accountant composes everything charged plus the request and refuses over the cap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dpops.errors import DpopsError, LedgerError, SpecError, StorageError
from dpops.release.context import RunContext, RunOutcome, _outcome, _pick_attempt
from dpops.release.served import _make_visible, check_served_files
from dpops.spec import ReleaseSpec

if TYPE_CHECKING:
    from dpops.ledger import Ledger, RunRecord, ScopeDefinition


def unit_definition_mismatches(spec: ReleaseSpec, scope: ScopeDefinition) -> list[str]:
    """Why ``spec``'s privacy unit is not the unit ``scope`` protects (empty: it is the same).

    A scope's cap is a statement about one unit definition: unit column, record-level or not,
    adjacency and period (semantics.md section 4, issue 11 item 1). Every part must match:

    - record_level: a record-level release (each row a unit) in a user scope would let one user
      with r rows move a count by r, so the user's real loss is r*epsilon while epsilon is charged;
      the opposite direction would charge a record-level scope for a statement about users.
    - adjacency: an add_remove release at epsilon is only 2*epsilon-DP under replace, and a replace
      release says nothing about add_remove; a scope mixing both has no well-defined total. A
      conversion (charging 2*epsilon) would have to be applied to every mechanism kind (noise,
      partition selection, exponential mechanism) and its delta as (1+e^eps)*delta; we refuse
      instead, which is simple and sound.
    - period: a period-scoped unit (user-day) only makes sense in a scope that says so.
    - A scope recorded before adjacency existed (``adjacency`` None) cannot be checked: refused.
    """
    unit = spec.privacy_unit
    name = spec.budget.scope
    out: list[str] = []
    if scope.unit_column != unit.column:
        out.append(f"privacy_unit.column {unit.column!r} differs from scope {name!r}'s unit column "
                   f"{scope.unit_column!r}: releases on one scope must protect the same unit")
    scope_adj = getattr(scope, "adjacency", None)
    if scope_adj is None:
        out.append(f"scope {name!r} was created before scopes recorded their adjacency, so no release can be "
                   f"checked against its unit definition: create a new scope with the whole definition "
                   f"(dpops ledger scope create NAME ... --adjacency {unit.adjacency}"
                   f"{' --record-level' if unit.record_level else ''}) and set budget.scope to it")
    elif scope_adj != unit.adjacency:
        out.append(f"privacy_unit.adjacency {unit.adjacency!r} differs from scope {name!r}'s adjacency "
                   f"{scope_adj!r}: epsilon under one adjacency is not epsilon under the other (add_remove epsilon "
                   f"is 2*epsilon under replace); use a scope declared with --adjacency {unit.adjacency}")
    scope_rl = bool(getattr(scope, "record_level", False))
    if scope_rl != bool(unit.record_level):
        if unit.record_level:
            out.append(f"privacy_unit.record_level is true but scope {name!r} protects whole units "
                       f"({scope.unit_column}): a unit with many rows would lose many times the charged epsilon; "
                       f"bound contributions per unit (record_level: false) or use a record-level scope")
        else:
            out.append(f"scope {name!r} is record-level (each row is a unit) but the release protects whole units: "
                       f"set privacy_unit.record_level: true or use a scope whose unit is {unit.column}")
    if getattr(scope, "bucket", None) is not None and spec.input.time_column is None:
        out.append(f"scope {name!r} composes its {scope.bucket} buckets in parallel, which is sound only if runs "
                   f"for different periods read disjoint rows: declare the event-time column (input.time_column, "
                   f"type timestamp) so the pipeline keeps only the rows of the run's {scope.bucket}")
    scope_period = getattr(scope, "unit_period", None)
    bucket = getattr(scope, "bucket", None)
    if bucket is not None and unit.period != bucket:
        out.append(f"scope {name!r} is bucketed by {bucket}, so the release's unit must be {bucket}-scoped: "
                   f"set privacy_unit.period: {bucket} (got {unit.period!r})")
    elif scope_period != unit.period:
        out.append(f"privacy_unit.period {unit.period!r} differs from scope {name!r}'s unit period "
                   f"{scope_period!r}: releases on one scope must protect the same unit")
    return out


def _check_scope(ctx: RunContext, ledger: Ledger) -> ScopeDefinition:
    name = ctx.spec.budget.scope
    try:
        scope = ledger.scope(name)
    except DpopsError as exc:
        raise LedgerError(
            f"budget scope {name!r} (budget.scope in {ctx.spec.source}) is not in the ledger: scopes are created "
            f"explicitly by an operator (dpops ledger scope create ...); nothing was reserved ({exc})"
        ) from None
    if scope is None:
        raise LedgerError(f"budget scope {name!r} is not in the ledger; create it with dpops ledger scope create")
    problems = unit_definition_mismatches(ctx.spec, scope)
    if problems:
        raise SpecError("\n".join(f"{ctx.spec.source}: {p}" for p in problems) + "\nnothing was reserved")
    return scope


def _refuse_changed(ctx: RunContext, published: RunRecord | None, restates: str | None) -> None:
    if published is None or published.run_id == ctx.run_id or restates == published.run_id:
        return
    old = published.key
    what = []
    if old.input_fingerprint != ctx.input_fingerprint:
        what.append("the input changed (different keyed fingerprint)")
    if old.spec_hash != ctx.spec.spec_hash:
        what.append("the spec changed")
    if old.key_id != ctx.run_key_id:
        what.append(f"the randomness key differs ({old.key_id} vs {ctx.run_key_id})")
    raise LedgerError(
        f"{ctx.spec.name} {ctx.interval} is already published by run {published.run_id} and "
        f"{' and '.join(what) or 'the run key differs'}: a second release of this interval is a fresh, charged "
        f"restatement and is never done silently; if that is intended run: dpops release restate {ctx.spec_path} "
        f"--interval {ctx.interval.start_iso}/{ctx.interval.end_iso}"
    )


def reserve(ctx: RunContext, ledger: Ledger, *, restates: str | None = None) -> RunOutcome:
    """Reserve the plan's events for this run, or serve the interval if this very run is published."""
    _pick_attempt(ctx, ledger)
    published = ledger.published(ctx.spec.name, ctx.interval.start_iso, ctx.interval.end_iso)
    if published is not None and published.run_id == ctx.run_id:
        _make_visible(ctx, published)  # a crash between the ledger commit and the file publish is healed here
        check_served_files(ctx, published, ledger)
        return _outcome(ctx, ledger, "already_published", record=published,
                        message="served from the published result, nothing charged")
    _refuse_changed(ctx, published, restates)
    if restates is not None and (published is None or published.run_id != restates):
        raise LedgerError(f"run {restates} is not the published run of {ctx.spec.name} {ctx.interval}; "
                          "only the current publication can be restated")
    # Storage may hold a publication this ledger does not know (another ledger, a restore): never spend
    # budget on a run that could not be published.
    current = ctx.store.current(ctx.interval.slug)
    if current is not None and current.run_id != ctx.run_id and current.run_id != restates:
        raise StorageError(f"{ctx.store.published_interval_dir(ctx.interval.slug)} already holds run "
                           f"{current.run_id}, unknown to this ledger as the published run; nothing reserved")
    _check_scope(ctx, ledger)
    existing = ledger.run(ctx.run_id)
    if existing is not None and existing.state == "committed":
        return _outcome(ctx, ledger, "already_published", record=existing, message="nothing charged")
    if existing is not None and existing.state in ("released", "spent_unpublished"):
        raise LedgerError(
            f"run {ctx.run_id} of {ctx.spec.name} {ctx.interval} is {existing.state}: the same run key cannot be "
            "reserved again (keyed mode: same key and input => same run); change the input, the spec or the key"
        )
    record = ledger.reserve(ctx.run_key, ctx.spec.budget.scope, ctx.events, actor=ctx.actor, restates=restates,
                            details={"randomness": ctx.randomness, "spec": ctx.spec.source,
                                     "plan_hash": getattr(ctx.plan, "plan_hash", None)})
    charged = float(record.epsilon) if existing is None else 0.0
    return _outcome(ctx, ledger, record.state if existing else "reserved", record=record, charged=charged)
