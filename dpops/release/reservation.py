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

import hmac
from typing import TYPE_CHECKING

from dpops.errors import (
    DpopsError,
    IntegrityError,
    InvalidParameter,
    LedgerError,
    NeedsOperator,
    SpecError,
    StorageError,
)
from dpops.inputs import time_rule_of
from dpops.release.context import RunContext, RunOutcome, make_outcome, pick_attempt
from dpops.release.key_continuity import check_key_continuity
from dpops.release.served import check_served_files, make_visible
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
    - the time rule (issue 19 item 1, ``_time_rule_mismatches``): the column, type and zone rule that put
      a row in a period; a bucketed scope's parallel composition rests on every release using the same.
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
    out.extend(_time_rule_mismatches(spec, scope))
    scope_period = getattr(scope, "unit_period", None)
    bucket = getattr(scope, "bucket", None)
    if bucket is not None and unit.period != bucket:
        out.append(f"scope {name!r} is bucketed by {bucket}, so the release's unit must be {bucket}-scoped: "
                   f"set privacy_unit.period: {bucket} (got {unit.period!r})")
    elif scope_period != unit.period:
        out.append(f"privacy_unit.period {unit.period!r} differs from scope {name!r}'s unit period "
                   f"{scope_period!r}: releases on one scope must protect the same unit")
    return out


def _time_rule_mismatches(spec: ReleaseSpec, scope: ScopeDefinition) -> list[str]:
    """Issue 19 item 1: which timestamp puts a row in a bucket is part of the unit definition.

    Two releases on one day-bucketed scope that place rows by different columns (purchase time ``ts``
    vs ``shipped_at``) each charge epsilon to the bucket of "their" day, while one person's rows of one
    day feed both: measured epsilon >= 1.61 against a per-day cap of 1. So a scope that records a time
    rule admits only releases with exactly that rule; a bucketed scope that records none (created before
    the field existed) admits none until its owner pins one with an explicit ledger entry.
    """
    name = spec.budget.scope
    bucket = getattr(scope, "bucket", None)
    recorded = getattr(scope, "time_rule", None)
    mine = time_rule_of(spec)
    if mine is None and bucket is not None:
        pinned = f": the scope records {recorded.describe()}" if recorded is not None else ""
        return [f"scope {name!r} composes its {bucket} buckets in parallel, which is sound only if runs "
                f"for different periods read disjoint rows: declare the event-time column (input.time_column, "
                f"type timestamp) so the pipeline keeps only the rows of the run's {bucket}{pinned}"]
    if recorded is not None:
        if mine is None:
            return [f"scope {name!r} records the time rule {recorded.describe()}, but the release declares no "
                    f"input.time_column: set input.time_column: {recorded.column} (declared {recorded.column}: "
                    f"{recorded.type}), or use a scope for releases that filter no rows by time"]
        if mine != recorded:
            return [f"the release's time rule {mine.describe()} (input.time_column in the spec) differs from the "
                    f"time rule {recorded.describe()} that scope {name!r} records: the same row would be charged to "
                    f"different {bucket or 'period'}s by the two definitions, so one unit-{bucket or 'period'} "
                    f"could lose more than the cap; set input.time_column: {recorded.column}, or charge this "
                    f"release to a scope created with --time-column {mine.column}"]
        return []
    if bucket is None or mine is None:
        return []  # an unbucketed scope composes every release against one cap, whatever rows each reads
    return [f"scope {name!r} is bucketed by {bucket} but was created before scopes recorded their time rule, so "
            f"the column that puts a row in a {bucket} is not fixed and no release can be checked against it; "
            f"its owner pins it with an explicit ledger entry, after checking that every release charged to it "
            f"so far used that column (their manifests embed their specs): dpops ledger scope pin-time {name} "
            f"--time-column {mine.column} --reason \"...\""]


def _check_scope(ctx: RunContext, ledger: Ledger) -> ScopeDefinition:
    name = ctx.spec.budget.scope
    try:
        scope = ledger.scope(name)
    except SpecError:
        # The spec names a scope this ledger does not have: a spec problem, exit 3 as in `dpops spec check`
        # (issue 28 item 9); an orchestrator fails it at once (a retry cannot create the scope).
        raise SpecError(
            f"budget scope {name!r} (budget.scope in {ctx.spec.source}) is not in the ledger: scopes are created "
            f"explicitly by an operator (dpops ledger scope create {name} ...); nothing was reserved") from None
    except DpopsError as exc:
        raise LedgerError(
            f"budget scope {name!r} (budget.scope in {ctx.spec.source}) is not in the ledger: scopes are created "
            f"explicitly by an operator (dpops ledger scope create ...); nothing was reserved ({exc})"
        ) from None
    if scope is None:
        raise LedgerError(f"budget scope {name!r} is not in the ledger; create it with dpops ledger scope create")
    problems = unit_definition_mismatches(ctx.spec, scope)
    declared = ctx.spec.budget.accountant
    if declared is not None and declared != scope.accountant:
        # The Gaussian sigmas were calibrated so that THIS accountant composes the run to the declared epsilon;
        # another one may count the same events as more (basic/1 charges them through rho), over the budget.
        problems.append(f"budget.accountant is {declared} but scope {name!r} is checked by {scope.accountant}: the "
                        f"noise was calibrated for {declared}; set budget.accountant: {scope.accountant} (or remove "
                        "it for the zCDP split every accountant certifies)")
    if problems:
        raise SpecError("\n".join(f"{ctx.spec.source}: {p}" for p in problems) + "\nnothing was reserved")
    # Bounds learned from the data are only sound through a charged estimation on this scope (issue 20
    # section 4): a spec naming one must name a committed estimation of this release in this ledger.
    from dpops.manifest.dependencies import check_dependency

    problems = check_dependency(ctx.spec, ledger, ctx.randomness)
    if problems:
        raise SpecError("\n".join(f"{ctx.spec.source}: {p}" for p in problems) + "\nnothing was reserved")
    return scope


def check_scope(ctx: RunContext, ledger: Ledger) -> ScopeDefinition:
    """The spec's budget scope, after checking that it exists and protects the spec's unit definition
    (and that any ``estimated_from`` names a committed estimation on it); ``SpecError``/``LedgerError``
    before anything is reserved."""
    return _check_scope(ctx, ledger)


def served_across_rotation(ctx: RunContext, published: RunRecord | None, restates: str | None) -> bool:
    """True when ``published`` is this interval's publication under an EARLIER noise key, the spec is the same,
    and the input, fingerprinted under that earlier key (one of ``ctx.previous_key_paths``), is byte-identical
    to what was published (issue 28 item 3).

    Why it is sound: the run key differs only because the key did (the keyed fingerprint and the key id are
    both functions of the key), so this is a re-run of the published release over the same input, and
    semantics section 3 says a re-run serves the published result and charges nothing. Nothing new is
    computed from the data (a keyed hash of the files, as every run takes). Without the old key the two
    inputs cannot be compared, and ``refuse_changed_input`` says so instead of calling the input changed."""
    if published is None or published.run_id == ctx.run_id or restates == published.run_id:
        return False
    from dpops.keyref import KeyRing, noise_key_id

    old_kid, kid = noise_key_id(published.key.key_id), noise_key_id(ctx.run_key_id)
    if old_kid is None or kid is None or old_kid == kid or published.key.spec_hash != ctx.spec.spec_hash:
        return False
    if not ctx.previous_key_paths:
        return False
    old = KeyRing.load(None, ctx.previous_key_paths).for_id(old_kid)
    if old is None:
        return False
    from dpops.inputs import input_fingerprint, public_file_rows

    fingerprint = input_fingerprint(ctx.input_paths, old, public_file_rows(ctx.spec))
    return hmac.compare_digest(fingerprint, published.key.input_fingerprint)


def refuse_changed_input(ctx: RunContext, published: RunRecord | None, restates: str | None) -> None:
    """Refuse a run whose run key differs from the interval's published run (a changed input, spec or key)
    unless it is the restatement of that run: an interval is published once per run key, and a silent second
    publication would be a second, uncharged look at the same data."""
    if published is None or published.run_id == ctx.run_id or restates == published.run_id:
        return
    old = published.key
    from dpops.keyref import noise_key_id

    old_kid, kid = noise_key_id(old.key_id), noise_key_id(ctx.run_key_id)
    rotated = old_kid is not None and kid is not None and old_kid != kid
    what = []
    if rotated:
        # The keyed fingerprint differs because the key did: whether the input changed is unknown, not "changed".
        given = bool(ctx.previous_key_paths)
        what.append(f"the noise key changed since that publication (key {old_kid} then, {kid} now): the input's "
                    "keyed fingerprint depends on the key, so the two inputs cannot be compared under the new one; "
                    + (f"the previous keys given do not include key {old_kid} (or, under it, the input differs)"
                       if given else "give the old key ($DPOPS_PREVIOUS_NOISE_KEY_FILES or --previous-key-file) to "
                       "compare under it: an unchanged input is then served, nothing charged"))
    elif old.input_fingerprint != ctx.input_fingerprint:
        what.append("the input changed (different keyed fingerprint)")
    if old.spec_hash != ctx.spec.spec_hash:
        what.append("the spec changed")
    if old.key_id != ctx.run_key_id and not rotated:
        what.append(f"the randomness key differs ({old.key_id} vs {ctx.run_key_id})")
    raise LedgerError(
        f"{ctx.spec.name} {ctx.interval} is already published by run {published.run_id} and "
        f"{' and '.join(what) or 'the run key differs'}: a second release of this interval is a fresh, charged "
        f"restatement and is never done silently; if that is intended run: dpops release restate {ctx.spec_path} "
        f"--interval {ctx.interval.start_iso}/{ctx.interval.end_iso}"
    )


def refuse_new_estimation_of_published(ctx: RunContext, published: RunRecord | None) -> None:
    """``bounds: estimate``: refuse to charge a new estimation of an interval whose release is published,
    unless the run is its explicit restatement (issue 25 item 7d). ``ctx`` is the estimation's context (the
    spec as written, the interval's input fingerprint and key).

    A new estimation means a new run key for the release (its spec names the estimation run): the release
    would then be refused by ``refuse_changed_input`` AFTER the estimation had been charged. So the same
    rule is applied first, before anything is reserved, with the same advice."""
    if published is None:
        return
    old = published.key
    what = []
    if old.input_fingerprint != ctx.input_fingerprint:
        what.append("the input changed (different keyed fingerprint)")
    if old.key_id != ctx.run_key_id:
        what.append(f"the randomness key differs ({old.key_id} vs {ctx.run_key_id})")
    raise LedgerError(
        f"{ctx.spec.name} {ctx.interval} is already published by run {published.run_id} and "
        f"{' and '.join(what) or 'its bounds: estimate estimation would be a new one (the spec changed)'}: a "
        "second release of this interval is a fresh, charged restatement and is never done silently; nothing was "
        f"reserved (no estimation charged); if that is intended run: dpops release restate {ctx.spec_path} "
        f"--interval {ctx.interval.start_iso}/{ctx.interval.end_iso}"
    )


def spent_message(ctx: RunContext, state: str = "spent_unpublished") -> str:
    """What to do with an interval whose current run is spent_unpublished (one wording for the CLI and
    the DAG): only an explicit fresh attempt publishes it."""
    return (f"run {ctx.run_id} of {ctx.spec.name} {ctx.interval} is {state}: noise may have been drawn, so its "
            "charge stays and the same run key is never computed again. To publish this interval, start a fresh "
            f"attempt (fresh noise, charged again, linked to the spent run): dpops release run {ctx.spec_path} "
            f"--interval {ctx.interval.start_iso}/{ctx.interval.end_iso} --publish --fresh-attempt --reason \"...\"; "
            "or leave the interval unpublished on purpose (dpops gaps lists it). A retry cannot change this")


def reserve(ctx: RunContext, ledger: Ledger, *, restates: str | None = None,
            fresh_attempt: str | None = None) -> RunOutcome:
    """Reserve the plan's events for this run, or serve the interval if this very run is published.

    ``fresh_attempt``: the operator's reason for replacing a spent_unpublished run of the interval by a
    fresh attempt (fresh noise, charged again, linked to the spent run: ``pick_attempt``)."""
    pick_attempt(ctx, ledger, fresh=fresh_attempt is not None)
    if fresh_attempt is not None and ctx.replaces_spent is None:
        raise InvalidParameter(
            f"--fresh-attempt: {ctx.spec.name} {ctx.interval} has no spent_unpublished run to replace (its current "
            f"run {ctx.run_id} is {getattr(ledger.run(ctx.run_id), 'state', 'not in the ledger')}); run it without "
            "--fresh-attempt: a retry of a reserved or started keyed run costs nothing; nothing was reserved")
    published = ledger.published(ctx.spec.name, ctx.interval.start_iso, ctx.interval.end_iso)
    if published is not None and published.run_id == ctx.run_id:
        make_visible(ctx, published, ledger)  # a crash between the ledger commit and the file publish is healed here
        check_served_files(ctx, published, ledger)
        return make_outcome(ctx, ledger, "already_published", record=published,
                        message="served from the published result, nothing charged")
    if served_across_rotation(ctx, published, restates):
        assert published is not None
        check_served_files(ctx, published, ledger)
        return make_outcome(ctx, ledger, "already_published", record=published,
                            message=f"served from the published result: run {published.run_id} published it under "
                                    "the previous noise key, and under that key the input is byte-identical; "
                                    "nothing charged")
    refuse_changed_input(ctx, published, restates)
    if restates is not None and (published is None or published.run_id != restates):
        raise LedgerError(f"run {restates} is not the published run of {ctx.spec.name} {ctx.interval}; "
                          "only the current publication can be restated")
    # Storage may hold a publication this ledger does not know (another ledger, a restore): never spend
    # budget on a run that could not be published.
    current = ctx.store.current(ctx.interval.slug)
    if current is not None and current.run_id != ctx.run_id and current.run_id != restates:
        raise StorageError(f"{ctx.store.published_interval_dir(ctx.interval.slug)} already holds run "
                           f"{current.run_id}, unknown to this ledger as the published run; nothing reserved")
    # Any version the ledger did not commit for this interval (also without a pointer to it), or a moved
    # pointer, is a forgery (issue 25 item 10): publishing next to it would put dpops' name beside it, and
    # the charge would buy a release that every check then fails. Refused before anything is reserved; it
    # depends on storage only, never on the data.
    from dpops.manifest.files import check_interval_pointer

    stray = check_interval_pointer(ctx.store, ctx.interval.slug, ledger, ctx.spec.name, ctx.interval.start_iso,
                                   ctx.interval.end_iso).problems
    if stray:
        raise IntegrityError(f"{ctx.spec.name} {ctx.interval}: nothing reserved: " + "; ".join(stray)
                             + ". Move what the ledger did not commit aside (docs/runbook.md, 'A forged or moved "
                             "current') and run again; if another ledger publishes to this output root, that is the "
                             "cause: keep one ledger per output root")
    _check_scope(ctx, ledger)
    check_key_continuity(ctx, ledger)  # another key than the scope's only as a declared rotation (issue 19)
    existing = ledger.run(ctx.run_id)
    if existing is not None and existing.state == "committed":
        return make_outcome(ctx, ledger, "already_published", record=existing, message="nothing charged")
    if existing is not None and existing.state in ("released", "spent_unpublished"):
        raise NeedsOperator(spent_message(ctx, existing.state))
    details: dict[str, object] = {"randomness": ctx.randomness, "spec": ctx.spec.source,
                                  "plan_hash": getattr(ctx.plan, "plan_hash", None)}
    if ctx.replaces_spent is not None:
        ctx.fresh_reason = (fresh_attempt or "")[:500]  # a refusal's manifest records the same link
        details["replaces_spent"] = {"run_id": ctx.replaces_spent, "reason": ctx.fresh_reason}
    record = ledger.reserve(ctx.run_key, ctx.spec.budget.scope, ctx.events, actor=ctx.actor, restates=restates,
                            details=details, accountant=ctx.spec.budget.accountant)
    charged = float(record.epsilon) if existing is None else 0.0
    return make_outcome(ctx, ledger, record.state if existing else "reserved", record=record, charged=charged)
