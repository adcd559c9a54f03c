"""Run orchestration: one release over one data interval, as idempotent steps.

The Airflow DAG calls the steps one by one (each task re-runs ``prepare``, which
writes nothing); ``execute_release`` chains them for ``dpops release run``:

1. ``prepare``  load the spec, refuse an interval that is not one period / one schedule
                interval, resolve and check the input, fingerprint it (keyed), build the run
                key and the plan. No ledger write, so bad input costs nothing.
2. ``reserve``  serve an already published interval for free; refuse a changed input
                without an explicit restatement; refuse a release whose unit definition
                differs from the scope's; else reserve the plan's events.
3. ``compute``  reuse a sealed staged output of this run, else ``ledger.start`` and run
                the pipeline (``pipelines.release_pipeline:run_release``, imported lazily);
                the input's keyed fingerprint is re-checked before start and before sealing.
4. ``publish``  post-processing checks on the noisy output, atomic versioned publish,
                then ``ledger.commit``.
5. ``restate``  the explicit operator action for a published interval whose input changed.

Retries (semantics.md section 3):

- keyed mode: noise is a function of (key, run key); the run key contains the input
  fingerprint. A retry after ``start`` recomputes the same noise over the same input,
  reveals nothing new and is not charged again.
- os mode: fresh OS randomness cannot be reproduced. A run that started but left no
  sealed staged output is marked ``spent_unpublished`` (its noise may exist somewhere)
  and the next invocation reserves a NEW attempt (``key_id`` ``os/attempt-N``, so a
  new run id) with a fresh charge. The operator sees this in the error and the ledger.
- test mode: seeded noise, runs through the ledger like any other run (it did read
  private data) but its output can never be published.
"""

from __future__ import annotations

import errno
import getpass
import importlib
import logging
import math
import os
import traceback
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from dpops.errors import (DEBUG_ENV, DpopsError, InputDataError, IntegrityError, InternalError, InvalidParameter,
                          LedgerError, SpecError, StorageError, public_message)
from dpops.inputs import Interval, TestFingerprintKey, check_input, input_fingerprint, parse_interval, resolve_input_paths
from dpops.spec import ReleaseSpec, interval_problems, load_spec
from dpops.storage import PUBLISHED_FILES, Location, StagedRun, Store, files, is_uri, open_store
from dpops.storage import ReleaseStore  # noqa: F401  (the local backend; tests patch runs.ReleaseStore)
from dpops.storage.base import version_number

log = logging.getLogger("dpops.runs")
_QUIET: ContextVar[bool] = ContextVar("dpops_runs_quiet", default=False)

RANDOMNESS = ("keyed", "os", "test")
# Stages reported to a ``progress`` callback, in order. Reading, bounding and noise are one Beam job
# (pipelines.release_pipeline), so they are one stage here: reporting them apart would need a hook
# inside the pipeline, and a stage line that claims noise is drawn before it is would mislead.
STAGES = ("fingerprint", "reserve", "read, bound and noise", "write", "check output", "publish")
Progress = Callable[[str], None]


def _stage(progress: Progress | None, name: str) -> None:
    if progress is not None:
        progress(name)
RUN_RELEASE = "pipelines.release_pipeline:run_release"
RUNNER_CHECK = "pipelines.runner_check:check_runner"
MAX_OS_ATTEMPTS = 100


def default_actor() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        user = "unknown"
    return f"dpops:{user}"


# --------------------------------------------------------------------------- context and outcome


@dataclass
class RunContext:
    """Everything a step needs; rebuilt cheaply by ``prepare`` in every DAG task."""

    spec_path: str
    spec: ReleaseSpec
    interval: Interval
    input_paths: list[str]
    input_fingerprint: str
    randomness: str
    key_id: str
    plan: Any
    store: Store
    key_path: str | None = None
    test_seed: int | None = None
    attempt: int = 1  # chosen by ``reserve``: os mode always; keyed mode only after a refunded attempt
    actor: str = field(default_factory=default_actor)
    # The key behind the keyed fingerprints (input and published files). Never shown or serialized.
    fingerprint_key: Any = field(default=None, repr=False, compare=False)
    output_checks: list[str] = field(default_factory=list, repr=False, compare=False)
    write_manifest: bool = field(default=True, repr=False, compare=False)

    @property
    def run_key_id(self) -> str:
        if self.randomness == "os":
            return f"os/attempt-{self.attempt}"
        # keyed/test: attempt 1 is the plain key id, so run ids stay stable; a later attempt exists only
        # after a refund (released: no noise was ever drawn), and its noise label is unchanged.
        return self.key_id if self.attempt == 1 else f"{self.key_id}/retry-{self.attempt}"

    @property
    def run_key(self) -> Any:
        from dpops.ledger import RunKey

        return RunKey(
            release=self.spec.name, spec_hash=self.spec.spec_hash, interval_start=self.interval.start_iso,
            interval_end=self.interval.end_iso, input_fingerprint=self.input_fingerprint, key_id=self.run_key_id,
        )

    @property
    def run_id(self) -> str:
        return self.run_key.run_id

    @property
    def noise_label(self) -> dict[str, str]:
        return {
            "release": self.spec.name, "spec_hash": self.spec.spec_hash, "interval_start": self.interval.start_iso,
            "interval_end": self.interval.end_iso, "input_fingerprint": self.input_fingerprint,
            **({"attempt": str(self.attempt)} if self.randomness == "os" else {}),
        }

    @property
    def events(self) -> list[Any]:
        return list(self.plan.events)


@dataclass
class RunOutcome:
    """What happened to one release over one interval. ``line()`` is the one log line.

    Two different ε appear and the line names both (issue 12): what THIS run charged (the run's own
    events as the scope's accountant counts them alone), and the scope total, which the accountant
    composes over every charged run of the scope (for RDP/PLD/zCDP well below the plain sum of the
    runs' own ε), with the cap it is checked against. A reviewer adding up seven "charged 0.94"
    lines gets 6.58, not the ledger's 3.93; the line says which number is which.
    """

    release: str
    interval: str
    state: str  # published | already_published | staged | reserved | released | spent_unpublished | refused
    run_id: str | None
    output_uri: str | None = None
    epsilon_charged: float = 0.0  # charged by THIS invocation (0 for a retry or a re-run of a published interval)
    run_epsilon: float | None = None  # the run's whole charge, as the scope's accountant counts it
    scope: str = ""
    scope_remaining: float | None = None
    restates: str | None = None
    message: str = ""
    scope_total: float | None = None  # every charged run of the scope, composed by its accountant
    scope_cap: float | None = None
    accountant: str | None = None  # e.g. rdp/1
    budget_unit: str = "epsilon"  # the scope's cap unit: epsilon (at its delta) or rho (zCDP)

    def budget_words(self) -> str:
        """``charged ε=0.94 this run; scope total ε=3.93 of cap 4 (rdp/1 accountant)``."""
        u = "ρ" if self.budget_unit == "rho" else "ε"
        if self.state == "refused":
            this = (f"charged {u}=0 this run" + (f" (it would have cost {u}={self.run_epsilon:.6g})"
                                                 if self.run_epsilon is not None else ""))
        else:
            this = f"charged {u}={self.epsilon_charged:.6g} this run"
            if self.run_epsilon is not None and not math.isclose(self.run_epsilon, self.epsilon_charged,
                                                                 rel_tol=1e-9, abs_tol=1e-12):
                this += f" (the run's own {u}={self.run_epsilon:.6g}, charged once when it was first reserved)"
        if self.scope_total is None:
            scope = f"scope {self.scope} total unknown"
        else:
            scope = f"scope {self.scope} total {u}={self.scope_total:.6g}"
            if self.scope_cap is not None:
                scope += f" of cap {self.scope_cap:.6g}"
            if self.accountant:
                scope += f" ({self.accountant} accountant, all runs composed)"
        return f"{this}; {scope}"

    def line(self) -> str:
        rem = "?" if self.scope_remaining is None else f"{self.scope_remaining:.6g}"
        text = (f"release={self.release} interval={self.interval} outcome={self.state} "
                f"epsilon_charged={self.epsilon_charged:.6g} scope={self.scope} remaining={rem}: "
                f"{self.budget_words()}")
        if self.restates:
            text += f" restates={self.restates}"
        if self.output_uri:
            text += f" output={self.output_uri}"
        if self.message:
            text += f" - {self.message}"
        return text

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["budget"] = self.budget_words()
        for k in ("epsilon_charged", "run_epsilon", "scope_remaining", "scope_total", "scope_cap"):
            if isinstance(d[k], float) and not math.isfinite(d[k]):
                d[k] = None
        return d


def scope_position(ledger: Any, scope: str, buckets: Sequence[str] | None = None) -> dict[str, Any]:
    """The scope's composed total, cap, remaining, accountant and unit, for an outcome line. For a
    bucketed scope: the fullest of the run's own buckets (the one its cap check bound), else the
    fullest bucket. Empty if the ledger cannot say (the line must not fail because a read did)."""
    try:
        st = ledger.status(scope)
    except Exception:  # noqa: BLE001
        return {}
    mine = [b for b in st.buckets if buckets and b.bucket in buckets]
    top = max(mine, key=lambda b: b.total) if mine else None
    total = float(top.total) if top else float(st.total)
    remaining = float(top.remaining) if top else float(st.remaining)
    return {"scope_total": total, "scope_remaining": remaining, "scope_cap": float(st.cap),
            "accountant": st.accountant, "budget_unit": "rho" if st.unit == "rho" else "epsilon"}


def _outcome(ctx: RunContext, ledger: Any, state: str, *, record: Any = None, charged: float = 0.0,
             message: str = "", output_uri: str | None = None) -> RunOutcome:
    pos = scope_position(ledger, ctx.spec.budget.scope, getattr(record, "buckets", None))
    remaining = pos.pop("scope_remaining", None)
    out = RunOutcome(
        release=ctx.spec.name, interval=str(ctx.interval), state=state,
        run_id=getattr(record, "run_id", None) or ctx.run_id,
        output_uri=output_uri or getattr(record, "output_uri", None),
        epsilon_charged=charged, run_epsilon=getattr(record, "epsilon", None), scope=ctx.spec.budget.scope,
        scope_remaining=remaining, restates=getattr(record, "restates", None), message=message, **pos,
    )
    # Inside execute_release the steps' lines are DEBUG: the whole run logs ONE line at the end.
    log.log(logging.DEBUG if _QUIET.get() else logging.INFO, out.line())
    return out


def _log_failure(ctx: RunContext, ledger: Any, exc: BaseException) -> RunOutcome:
    """The one line of a run that ended in an error (the error itself still propagates)."""
    from dpops.errors import BudgetExceeded

    state = "refused" if isinstance(exc, BudgetExceeded) else "failed"
    rec = None
    try:
        rec = ledger.run(ctx.run_id)
    except Exception:  # noqa: BLE001
        pass
    pos = scope_position(ledger, ctx.spec.budget.scope, getattr(rec, "buckets", None))
    remaining = pos.pop("scope_remaining", None)
    run_eps = getattr(rec, "epsilon", None)
    if run_eps is None and isinstance(getattr(exc, "requested", None), float):
        run_eps = exc.requested  # type: ignore[attr-defined] - a refusal: what this run would have cost
    out = RunOutcome(release=ctx.spec.name, interval=str(ctx.interval), state=state, run_id=ctx.run_id,
                     run_epsilon=run_eps, scope=ctx.spec.budget.scope, scope_remaining=remaining,
                     message=public_message(exc) + (f" (ledger state {rec.state})" if rec else ""), **pos)
    log.warning(out.line())
    return out


@contextmanager
def open_run_ledger(url: str | None = None) -> Iterator[Any]:
    """The ledger for one step (``None``: ``DPOPS_LEDGER_URL`` or the default SQLite file), closed afterwards."""
    from dpops.ledger import open_ledger

    ledger = open_ledger(url)
    try:
        yield ledger
    finally:
        close = getattr(ledger, "close", None)
        if callable(close):
            close()


def step_summary(result: Any) -> dict[str, Any]:
    """JSON-safe dict of a step's result (an Airflow XCom): never the key, never internal counters."""
    if isinstance(result, RunOutcome):
        return result.as_dict()
    if isinstance(result, StagedRun):
        return {"state": "staged", "run_id": result.run_id, "output_uri": result.directory.resolve().as_uri(),
                "test_mode": result.test_mode}
    raise TypeError(f"not a step result: {type(result).__name__}")


# --------------------------------------------------------------------------- 1. prepare


REMOVED_KEY_ENV = "DPOPS_NOISE_KEY"


def _refuse_key_in_env() -> None:
    """The key VALUE in the environment is refused before anything is reserved: environments leak
    (process listings, crash dumps, every child process, Airflow task metadata)."""
    if REMOVED_KEY_ENV in os.environ:
        raise InvalidParameter(
            f"the environment variable {REMOVED_KEY_ENV} is set, but dpops no longer reads a noise key from the "
            "environment (it leaks into process listings and child processes): put the key in a file "
            "(dpops key generate PATH), pass --key-file PATH or set DPOPS_NOISE_KEY_FILE, and unset "
            f"{REMOVED_KEY_ENV}; nothing was reserved"
        )


def _load_key(key_path: str | None) -> Any:
    """Load the noise key once per run (``randomness.load_key`` keeps it for the in-process pipeline).

    ``key_path`` is a key reference (``dpops.keyref``): a file path, file:PATH, or a secret-manager
    reference that the pipeline's workers resolve themselves."""
    from dpops.keyref import FileKeyProvider, resolve_key, scheme_of
    from dpops.randomness import load_key  # lazy: owned by the mechanisms module

    if not key_path:
        raise InvalidParameter("no noise key file given: pass --key-file PATH or set DPOPS_NOISE_KEY_FILE "
                               "(create a key with dpops key generate PATH)")
    if scheme_of(key_path) == "file":
        return load_key(FileKeyProvider().path(key_path))
    return resolve_key(key_path)


def _key_ref(key_path: str | None) -> str | None:
    """The key reference the workers get: a file path made absolute, any other reference as given."""
    from dpops.keyref import FileKeyProvider, scheme_of

    if not key_path:
        return None
    if scheme_of(key_path) == "file":
        return str(Path(FileKeyProvider().path(key_path)).resolve())
    return key_path


def _sealer(randomness: str, fp_key: Any) -> Any:
    """The key that seals this run's staged output (storage.py): the noise key in keyed and os mode
    (both always load it), the public test seal key in test mode (never publishable anyway)."""
    if randomness == "test":
        from dpops.randomness import test_seal_key

        return test_seal_key()
    return fp_key


def _default_planner(spec: ReleaseSpec) -> Any:
    from dpops.release_plan import plan_release

    return plan_release(spec)


def prepare(spec_path: str | os.PathLike[str], interval_start: Any, interval_end: Any = None, *,
            randomness: str = "keyed", key_path: str | None = None, test_seed: int | None = None,
            key: Any = None, planner: Callable[[ReleaseSpec], Any] | None = None,
            actor: str | None = None, progress: Progress | None = None) -> RunContext:
    """Load and check everything a run needs, without touching the ledger.

    ``key`` (an object with ``key_id`` and ``hmac(bytes)``) overrides ``key_path`` (tests, embedding);
    ``planner`` overrides ``dpops.release_plan.plan_release``.
    """
    if randomness not in RANDOMNESS:
        raise InvalidParameter(f"randomness must be one of {RANDOMNESS}, got {randomness!r}")
    _refuse_key_in_env()
    if randomness == "test":
        if test_seed is None:
            raise InvalidParameter("randomness 'test' needs a test seed")
        fp_key: Any = TestFingerprintKey()
        key_id = f"test/seed-{int(test_seed)}"
    else:
        if test_seed is not None:
            raise InvalidParameter(f"a test seed is allowed only with randomness 'test', not {randomness!r}")
        # os mode also needs the key: the input fingerprint is keyed (semantics.md section 5).
        fp_key = key if key is not None else _load_key(key_path)
        key_id = fp_key.key_id
    spec = load_spec(spec_path)
    interval = parse_interval(interval_start, interval_end)
    # Before anything is read or reserved: a period-scoped release covers exactly one period and a
    # scheduled one exactly one schedule interval (issue 11 item 2; see dpops.spec.interval_problems).
    misaligned = interval_problems(spec, interval.start, interval.end, spec_path=str(spec_path))
    if misaligned:
        raise SpecError("\n".join(f"{spec.source}: {m}" for m in misaligned) + "\nnothing was reserved")
    paths = resolve_input_paths(spec, interval.start, interval.end, key_path=key_path)
    _stage(progress, "fingerprint")
    check_input(spec, paths)
    fingerprint = input_fingerprint(paths, fp_key)
    plan = (planner or _default_planner)(spec)
    if not list(plan.events):
        raise SpecError(f"{spec.source}: the plan has no privacy events; nothing to release")
    from dpops.manifest.run_hook import check_signing_key

    check_signing_key()  # a configured manifest signing key must load before anything is reserved
    return RunContext(
        spec_path=str(Path(spec_path).resolve()), spec=spec, interval=interval, input_paths=paths,
        input_fingerprint=fingerprint, randomness=randomness, key_id=key_id, plan=plan,
        store=open_store(spec.output_root, spec.name, sealer=_sealer(randomness, fp_key)),
        key_path=_key_ref(key_path),
        test_seed=test_seed, actor=actor or default_actor(), fingerprint_key=fp_key,
    )


# --------------------------------------------------------------------------- 2. reserve


def unit_definition_mismatches(spec: ReleaseSpec, scope: Any) -> list[str]:
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


def _check_scope(ctx: RunContext, ledger: Any) -> Any:
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


def _refuse_changed(ctx: RunContext, published: Any, restates: str | None) -> None:
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


def _pick_attempt(ctx: RunContext, ledger: Any) -> None:
    """Choose the attempt number, i.e. the run key, this invocation works on.

    os mode: attempts whose noise may exist (spent_unpublished) or which were refunded
    (released) are closed: the next free attempt number gets a new run id and a fresh charge.
    keyed/test mode: only a refunded attempt is skipped (a transient failure before any noise was
    drawn must not block the interval forever); a spent_unpublished keyed run stays final.
    """
    closed = ("released", "spent_unpublished") if ctx.randomness == "os" else ("released",)
    for attempt in range(1, MAX_OS_ATTEMPTS + 1):
        ctx.attempt = attempt
        rec = ledger.run(ctx.run_id)
        if rec is None or rec.state not in closed:
            return
    raise LedgerError(f"{ctx.spec.name} {ctx.interval}: {MAX_OS_ATTEMPTS} os-mode attempts failed; investigate first")


def reserve(ctx: RunContext, ledger: Any, *, restates: str | None = None) -> RunOutcome:
    """Reserve the plan's events for this run, or serve the interval if this very run is published."""
    _pick_attempt(ctx, ledger)
    published = ledger.published(ctx.spec.name, ctx.interval.start_iso, ctx.interval.end_iso)
    if published is not None and published.run_id == ctx.run_id:
        _make_visible(ctx, published)  # a crash between the ledger commit and the file publish is healed here
        check_served_files(ctx, published)
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


# --------------------------------------------------------------------------- 3. compute


def _load_run_release() -> Callable[[Any], Any]:
    mod_name, func = RUN_RELEASE.split(":")
    return getattr(importlib.import_module(mod_name), func)


def check_runner(runner: str, runner_options: Sequence[str], run_release: Callable[[Any], Any] | None = None) -> str:
    """Validate the Beam runner, its options and endpoints (``pipelines.runner_check``, imported lazily:
    dpops never imports Beam); returns the runner name to hand to the pipeline.

    Called before ``reserve`` and before ``ledger.start``: an os-mode run is charged once started, so a
    typo'd runner or a dead job endpoint must fail (RunnerError, exit 6, bounded connect timeout) before
    that. An injected ``run_release`` (tests, a library caller) owns its runner and is not checked.
    """
    if run_release is not None:
        return runner
    mod_name, func = RUNNER_CHECK.split(":")
    checked = getattr(importlib.import_module(mod_name), func)(runner, tuple(runner_options))
    return str(checked.runner)


def _compute_request(ctx: RunContext, staging_dir: Location, runner: str, runner_options: Sequence[str]) -> Any:
    from dpops.compute import ComputeRequest

    kwargs: dict[str, Any] = dict(
        spec_path=ctx.spec_path, interval_start=ctx.interval.start_iso, interval_end=ctx.interval.end_iso,
        input_paths=tuple(ctx.input_paths), noise_label=ctx.noise_label, randomness=ctx.randomness,
        key_ref=ctx.key_path if ctx.randomness == "keyed" else None, test_seed=ctx.test_seed,
        key_id=ctx.key_id if ctx.randomness == "keyed" else None,
        staging_dir=str(staging_dir), runner=runner, runner_options=tuple(runner_options),
    )
    plan_hash = getattr(ctx.plan, "plan_hash", None)
    if plan_hash is not None and "expected_plan_hash" in getattr(ComputeRequest, "__dataclass_fields__", {}):
        kwargs["expected_plan_hash"] = plan_hash
    return ComputeRequest(**kwargs)


def compute(ctx: RunContext, ledger: Any, *, runner: str = "FnApiRunner", runner_options: Sequence[str] = (),
            run_release: Callable[[Any], Any] | None = None) -> RunOutcome:
    """Produce (or find) the sealed staged output of this run. Needs a reservation (``reserve`` first)."""
    staged = compute_staged(ctx, ledger, runner=runner, runner_options=runner_options, run_release=run_release)
    return _outcome(ctx, ledger, "staged", record=ledger.run(ctx.run_id),
                    output_uri=location_uri(staged.location), message="noisy output staged, not yet published")


def compute_staged(ctx: RunContext, ledger: Any, *, runner: str = "FnApiRunner", runner_options: Sequence[str] = (),
                   run_release: Callable[[Any], Any] | None = None, progress: Progress | None = None) -> StagedRun:
    """``compute`` returning the ``StagedRun`` itself."""
    _pick_attempt(ctx, ledger)
    record = ledger.run(ctx.run_id)
    if record is None:
        raise LedgerError(f"run {ctx.run_id} of {ctx.spec.name} {ctx.interval} is not reserved: reserve it first")
    staged = ctx.store.find_staged(ctx.interval.slug, ctx.run_id)
    if staged is not None and record.state == "reserved":
        # Sealed output exists only after ``start``, so this ledger never started this run: another ledger
        # (sharing this output root) or a ledger restored from an older backup computed it. No mechanism ran
        # under this reservation, so it is refunded rather than left stuck (issue 13).
        msg = (f"run {ctx.run_id} of {ctx.spec.name} {ctx.interval}: {ctx.store.staged_interval_location(ctx.interval.slug)} "
               "holds a staged output of this run that this ledger never started: another ledger shares this "
               "output root (or this ledger was restored from an older backup). The reservation was refunded. "
               "Use one ledger per output root: run with the ledger that computed it, or give this release "
               "its own output.root")
        ledger.release(ctx.run_id, reason="staged output computed under another ledger; nothing drawn here",
                       actor=ctx.actor)
        raise LedgerError(msg)
    if staged is not None:
        return staged  # a retry: the noisy output exists; reuse it, nothing drawn or charged again
    if record.state in ("committed", "released", "spent_unpublished"):
        raise LedgerError(f"run {ctx.run_id} is {record.state}; it cannot be computed again")
    if record.state == "started" and ctx.randomness == "os":
        # Fresh noise may have been drawn and cannot be reproduced: the charge stays, the attempt is closed.
        ledger.mark_spent_unpublished(ctx.run_id, reason="os-mode run started but left no staged output; "
                                      "fresh noise cannot be recomputed under the same charge", actor=ctx.actor)
        raise LedgerError(
            f"os-mode run {ctx.run_id} (attempt {ctx.attempt}) of {ctx.spec.name} {ctx.interval} had started but "
            "left no staged output; it is now spent_unpublished (the charge stays). Run again to reserve a new "
            "attempt with a fresh charge, or use keyed randomness, whose retries are free"
        )
    # Everything that can fail without drawing noise happens before start, so such a failure is refunded.
    fn = run_release or _load_run_release()
    runner = check_runner(runner, runner_options, run_release)
    if record.state == "reserved":
        _check_input_unchanged(ctx, "before the computation started; nothing was drawn, the reservation is refunded")
    # The staging location is a local directory or an object-store prefix; the pipeline gets it as a str
    # (ComputeRequest.staging_dir) and writes data.parquet + summary.json there through Beam FileSystems.
    tmp = ctx.store.new_staging(ctx.interval.slug, ctx.run_id)
    try:
        if record.state == "reserved":
            ledger.start(ctx.run_id, actor=ctx.actor)  # right before the first noise is drawn: no refund after this
    except BaseException:
        ctx.store.discard_staging(tmp)
        raise
    try:
        try:
            _stage(progress, "read, bound and noise")
            result = fn(_compute_request(ctx, tmp, runner, runner_options))
        except DpopsError:
            raise
        except Exception as exc:  # Beam wraps worker errors; a full or read-only disk is not a bug
            storage = _storage_error_from(exc, tmp)
            if storage is not None:
                raise storage from None
            if os.environ.get(DEBUG_ENV):
                raise
            # A bug inside the pipeline: its text (and its chained causes, which Airflow prints) may quote
            # a cell, so neither leaves this process (dpops.errors.public_message).
            last = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
            where = f" at {Path(last.filename).name}:{last.lineno}" if last else ""
            raise InternalError(f"internal error in the release pipeline: {type(exc).__name__}{where} (a bug, "
                                f"please report it; the error text is withheld because it may quote input data, "
                                f"{DEBUG_ENV}=1 shows it on a trusted terminal)") from None
        for f in (result.output_file, result.summary_file):
            if as_location(f).realpath().parent != tmp.realpath():
                raise StorageError(f"the pipeline wrote {f} outside its staging directory {tmp}")
        # The output is sealed only if the input is still the one the run was reserved with (its
        # fingerprint is in the run key and the noise label): a file swapped during the computation
        # would publish a release of other data under this run's key.
        _check_input_unchanged(ctx, "while the pipeline read it; noise was drawn, so the run stays charged and "
                                    "its output is discarded")
        _stage(progress, "write")
        staged = ctx.store.finish_staging(tmp, ctx.interval.slug, ctx.run_id, dict(result.internal or {}),
                                          test_mode=ctx.randomness == "test")
    except BaseException:
        ctx.store.discard_staging(tmp)
        if ctx.randomness == "os":
            try:
                ledger.mark_spent_unpublished(ctx.run_id, reason="os-mode computation failed after start",
                                              actor=ctx.actor)
            except Exception:  # noqa: BLE001 - keep the original error; recover() will close the run
                log.exception("could not mark run %s spent_unpublished", ctx.run_id)
        raise
    return staged


def _check_input_unchanged(ctx: RunContext, when: str) -> None:
    """Fail (InputDataError) if the input files no longer have the keyed fingerprint of the run key."""
    try:
        now = input_fingerprint(ctx.input_paths, ctx.fingerprint_key)
    except DpopsError as exc:
        raise InputDataError(f"{ctx.spec.name} {ctx.interval}: the input cannot be re-read to check its fingerprint "
                             f"({when}): {exc}") from None
    if now != ctx.input_fingerprint:
        raise InputDataError(
            f"{ctx.spec.name} {ctx.interval}: the input files changed since the run was prepared ({when}); "
            f"nothing is published. Run again when the input is final: a new input is a new run (and charge)"
        )


_DISK_ERRORS = {errno.ENOSPC: "the disk is full", errno.EROFS: "the file system is read-only",
                errno.EDQUOT: "the disk quota is exceeded"}


def _storage_error_from(exc: BaseException, where: Path | Location) -> StorageError | None:
    """A StorageError (exit 6) if ``exc`` is, or wraps, a full/read-only disk error; else None."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    found = None
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in _DISK_ERRORS:
            found = _DISK_ERRORS[cur.errno]
            break
        cur = cur.__cause__ or cur.__context__
    if found is None:  # Beam re-raises worker errors as RuntimeError with only the text kept
        text = str(exc)
        for code, words in _DISK_ERRORS.items():
            if os.strerror(code) in text:
                found = words
                break
    if found is None:
        return None
    return StorageError(f"the pipeline could not write its staged output under {where}: {found}. Noise was drawn, "
                        "so the run stays charged (started); fix the disk and run again: keyed noise reproduces "
                        "the same output at no new charge")


# --------------------------------------------------------------------------- 4. publish


def check_noisy_output(spec: ReleaseSpec, data_file: str | os.PathLike[str] | Location) -> list[str]:
    """Post-processing checks on the NOISY output (free to block a publish): returns the checks that ran.

    Partition columns and every metric's value/std/CI columns present; no NaN anywhere (nulls only where
    ``suppress_below`` blanks a value); public partitions all present, once, and nothing else.
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    where = f"noisy output {data_file}"
    try:
        loc = as_location(data_file)
        fs, inner = loc.filesystem()
        table = pq.read_table(inner, filesystem=fs)
    except Exception as exc:  # noqa: BLE001
        raise IntegrityError(f"{where}: cannot read it as Parquet ({type(exc).__name__}); not publishing") from None
    names = set(table.column_names)
    problems: list[str] = []
    checks = ["partition columns present", "metric, std and 95% CI columns present", "no NaN values"]
    for c in spec.partitions.columns:
        if c not in names:
            problems.append(f"partition column {c!r} missing")
    for m in spec.metrics:
        if m.type == "quantiles":
            want = [f"{m.key}_{s}" for s in m.column_suffixes()]
        elif m.type == "top_k":
            want = []
            if not any(n == m.key or n.startswith(m.key + "_") for n in names):
                problems.append(f"no column for top_k metric {m.key!r}")
        else:
            want = [m.key, f"{m.key}_std", f"{m.key}_ci95_low", f"{m.key}_ci95_high"]
        problems += [f"column {w!r} missing" for w in want if w not in names]
    for name in table.column_names:
        col = table.column(name)
        if pa.types.is_floating(col.type):
            if pc.any(pc.is_nan(col)).as_py():
                problems.append(f"column {name!r} has NaN values")
        if col.null_count and (spec.postprocess.suppress_below is None or name in spec.partitions.columns):
            problems.append(f"column {name!r} has {col.null_count} null values")
    public = spec.public_partitions()
    if public is not None and not any(p.startswith("partition column") for p in problems):
        checks.append("exactly the public partitions")
        rows = list(zip(*(table.column(c).to_pylist() for c in spec.partitions.columns)))
        want_set = set(public)
        missing = want_set - set(rows)
        extra = set(rows) - want_set
        if missing:
            problems.append(f"{len(missing)} public partition(s) missing, e.g. {sorted(map(str, missing))[:3]}")
        if extra:
            # No examples: a partition outside the public list is a raw value from the input, not public.
            problems.append(f"{len(extra)} partition(s) not in the public list")
        if len(rows) != len(set(rows)):
            problems.append("a partition appears more than once")
    if problems:
        raise IntegrityError(f"{where} failed its post-processing checks, not publishing: " + "; ".join(problems))
    return checks


def publish(ctx: RunContext, ledger: Any, *, gx_checks: bool = False, progress: Progress | None = None) -> RunOutcome:
    """Check the noisy output, write the manifest, commit the run, then publish it atomically as the
    interval's next version (see the ordering note below)."""
    _pick_attempt(ctx, ledger)
    record = ledger.run(ctx.run_id)
    if record is None:
        raise LedgerError(f"run {ctx.run_id} is not in the ledger: reserve and compute it first")
    if record.state == "committed":
        _make_visible(ctx, record)
        check_served_files(ctx, record)
        return _outcome(ctx, ledger, "already_published", record=record, message="nothing charged")
    if record.state != "started":
        raise LedgerError(f"run {ctx.run_id} is {record.state}; only a started (computed) run can be published")
    staged = ctx.store.verify_staged(ctx.interval.slug, ctx.run_id)
    if staged.test_mode:
        ledger.mark_spent_unpublished(ctx.run_id, reason="test-mode output is never published", actor=ctx.actor)
        raise StorageError(f"run {ctx.run_id} used test-mode (seeded) noise; it is never published. It is now "
                           "spent_unpublished; run with keyed or os randomness to publish")
    _stage(progress, "check output")
    ctx.output_checks = check_noisy_output(ctx.spec, staged.data_location)
    if gx_checks or os.environ.get("DPOPS_GX_PROJECT"):
        with local_copy(ctx, staged) as data_file:  # GX reads local files; an object-store output is copied privately
            if gx_checks:
                from dpops.validate import check_release_output

                check_release_output(str(data_file), partition_columns=ctx.spec.partitions.columns,
                                     public_partitions=ctx.spec.public_partitions(),
                                     allow_null=ctx.spec.postprocess.suppress_below is not None)
                ctx.output_checks = [*ctx.output_checks, "great expectations output suite"]
            if os.environ.get("DPOPS_GX_PROJECT"):  # the deployment's GX project: checkpoint + Data Docs
                from dpops.gx_project import run_output_checkpoint

                gx_result = run_output_checkpoint(os.environ["DPOPS_GX_PROJECT"], ctx.spec, data_file,
                                                  run_id=ctx.run_id)
                ctx.output_checks = [*ctx.output_checks,
                                     *(f"great expectations checkpoint {gx_result.checkpoint}: suite {s}"
                                       for s in gx_result.suites)]
    # The manifest is written BEFORE anything becomes visible (semantics.md section 5): it
    # fingerprints the staged files, and the published copies are verified byte-identical.
    _stage(progress, "publish")
    target = ctx.store.next_version_location(ctx.interval.slug, ctx.run_id)
    manifest_path = write_manifest_before_publish(ctx, ledger, location_uri(target), staged.location,
                                                  ctx.output_checks)
    # Order: ledger commit, then the files become visible. The charge was already final at start;
    # the commit records the decision to publish. A crash in between leaves a committed run whose
    # output is not visible yet, which every retry (and every served re-run) completes through
    # ``_make_visible``; `dpops ledger recover` never touches committed runs. The opposite order
    # would let recovery mark a run whose output is live as spent_unpublished.
    details = {"version": version_number(target),
               "files": {n: staged.hashes[n] for n in PUBLISHED_FILES if n in staged.hashes}}
    if manifest_path:
        from dpops.manifest.io import file_sha256

        details["manifest"] = {"file": as_location(manifest_path).name, "sha256": file_sha256(manifest_path)}
    record = ledger.commit(ctx.run_id, output_uri=location_uri(target), actor=ctx.actor, details=details)
    pub = _make_visible(ctx, record)
    if pub.location.realpath() != target.realpath():  # pragma: no cover - publish refuses races first
        raise StorageError(f"run {ctx.run_id} was published to {pub.location}, not {target} as its ledger "
                           "entry and manifest say; investigate before publishing anything else for this interval")
    return _outcome(ctx, ledger, "published", record=record, output_uri=pub.uri,
                    message=f"version v{pub.version}")


def as_location(p: str | os.PathLike[str] | Location) -> Location:
    """A path or URI the pipeline or a caller gave as a ``Location`` (relative paths: the working directory)."""
    if isinstance(p, Location):
        return p
    text = os.fspath(p)
    return Location.parse(text) if is_uri(text) else Location.local(text)


def location_uri(loc: Location) -> str:
    """The URI recorded in the ledger and the manifest: ``file://`` of the resolved local path, or the object URI."""
    return loc.local_path.resolve().as_uri() if loc.is_local else loc.uri


@contextmanager
def local_copy(ctx: RunContext, staged: StagedRun) -> Iterator[Path]:
    """The staged data file as a local path: itself (local backend) or a private temporary copy (0700 directory
    under the private state directory, removed afterwards) of an object-store one."""
    if staged.location.is_local:
        yield staged.data_file
        return
    import tempfile

    base = Path(getattr(ctx.store, "state_dir", None) or tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dpops-check-", dir=base) as d:
        os.chmod(d, 0o700)
        target = Path(d) / "data.parquet"
        files.copy(staged.data_location, Location.local(target))
        yield target


def _make_visible(ctx: RunContext, record: Any) -> Any:
    """Make a committed run's output the interval's current version (idempotent; repairs a crash)."""
    slug = ctx.interval.slug
    current = ctx.store.current(slug)
    if current is not None and current.run_id == record.run_id:
        return current
    staged = ctx.store.find_staged(slug, record.run_id)
    if staged is None:
        raise StorageError(
            f"run {record.run_id} of {ctx.spec.name} {ctx.interval} is committed in the ledger but its staged "
            f"output is missing under {ctx.store.staged_interval_location(slug)}: restore the staging area from "
            "backup; nothing was charged again"
        )
    return ctx.store.publish(staged, slug, restates=record.restates,
                             extra={"spec_hash": ctx.spec.spec_hash, "randomness": ctx.randomness})


def published_file_check(store: Store, slug: str, record: Any, manifest_dir: Path | Location,
                         key: Any = None) -> Any:
    """Compare a committed run's published files with the ledger's commit entry and (with the noise
    key) the manifest's keyed fingerprints. Returns a ``dpops.manifest.files.FileCheck``."""
    from dpops.manifest.files import FileCheck, check_ledger_files, check_manifest_files, merge

    version = next((v for v in store.versions(slug) if v.run_id == record.run_id), None)
    if version is None:
        return FileCheck(not_checked=[f"no published version of run {record.run_id} under "
                                      f"{store.published_interval_location(slug)}"])
    checks = [check_ledger_files(record, version.location)]
    from dpops.manifest.io import manifest_exists, read_manifest

    name = f"{record.run_id}.published.json"
    mpath = manifest_exists(manifest_dir, name)
    if key is not None and mpath is not None:
        checks.append(check_manifest_files(read_manifest(mpath), key=key, directory=version.location))
    elif key is None:
        checks.append(FileCheck(not_checked=["no noise key given: the manifest's keyed fingerprints were not checked"]))
    else:
        checks.append(FileCheck(not_checked=[f"no manifest {as_location(manifest_dir) / name}"]))
    return merge(*checks)


def check_served_files(ctx: RunContext, record: Any) -> None:
    """Refuse to serve a published interval whose files changed after publication.

    Privacy reason: a re-run reports the interval as published (a DP release); if its files were
    edited (e.g. the noise replaced by exact values) serving them would put dpops' name on a
    non-private release. Nothing is charged either way."""
    key = ctx.fingerprint_key if ctx.randomness != "test" else None
    check = published_file_check(ctx.store, ctx.interval.slug, record, manifests_dir(ctx), key)
    if check.problems:
        raise IntegrityError(
            f"{ctx.spec.name} {ctx.interval}: refusing to serve run {record.run_id}: " + "; ".join(check.problems)
            + ". Restore the published files from a backup (or the staged copy) and investigate who changed them; "
            "nothing was charged")


# --------------------------------------------------------------------------- manifests


def manifests_dir(ctx: RunContext) -> Path | Location:
    """``$DPOPS_MANIFESTS_DIR`` or ``<output root>/manifests/<release>`` (the DAG uses the same rule)."""
    return spec_manifests_dir(ctx.spec)


def spec_manifests_dir(spec: ReleaseSpec) -> Path | Location:
    """A local ``Path``, or a ``Location`` under an object-store output root (or a URI in the env var)."""
    env = os.environ.get("DPOPS_MANIFESTS_DIR")
    if env:
        return Location.parse(env) if is_uri(env) else Path(env)
    root = spec.output_root
    if root.is_local:
        return root.local_path / "manifests" / spec.name
    return root.join("manifests", spec.name)


def output_fingerprints(ctx: RunContext, directory: Path | Location) -> dict[str, str]:
    """Keyed fingerprints of the published files (a plain hash would let a manifest reader confirm guesses)."""
    out: dict[str, str] = {}
    loc = as_location(directory)
    if ctx.fingerprint_key is None or not files.exists(loc):
        return out
    for name in PUBLISHED_FILES:
        f = loc / name
        if files.is_file(f):
            data = files.read_bytes(f)
            assert data is not None
            out[name] = "hmac-sha256:" + ctx.fingerprint_key.hmac(data).hex()
    return out


def write_manifest_before_publish(ctx: RunContext, ledger: Any, output_uri: str, staged_dir: Path | Location,
                                  checks: Sequence[str] = ()) -> str | None:
    """Write the published run's manifest from its staged files; a retry finds the existing one."""
    if not ctx.write_manifest:
        return None
    folder = manifests_dir(ctx)
    from dpops.manifest.io import manifest_exists

    existing = manifest_exists(folder, f"{ctx.run_id}.published.json")
    if existing is not None:
        return existing
    from dpops.manifest.run_hook import write_run_manifest

    validation = {"checks": [{"name": c, "passed": True} for c in checks], "proceeded": True} if checks else None
    return write_run_manifest(
        ctx, ledger, {"state": "published", "output_uri": output_uri}, manifests_dir=folder,
        validation=validation, output_fingerprints=output_fingerprints(ctx, staged_dir),
    )


def ensure_manifest(ctx: RunContext, ledger: Any, outcome: RunOutcome, checks: Sequence[str] = ()) -> str | None:
    """Write the run's manifest once (a retry finds the existing one). Only for published runs."""
    if outcome.state not in ("published", "already_published") or outcome.run_id != ctx.run_id:
        return None
    folder = manifests_dir(ctx)
    from dpops.manifest.io import manifest_exists

    existing = manifest_exists(folder, f"{ctx.run_id}.published.json")
    if existing is not None:
        return existing
    from dpops.manifest.run_hook import write_run_manifest

    published = ctx.store.current(ctx.interval.slug)
    directory = next((v.location for v in ctx.store.versions(ctx.interval.slug) if v.run_id == ctx.run_id),
                     published.location if published else None)
    validation = {"checks": [{"name": c, "passed": True} for c in checks], "proceeded": True} if checks else None
    return write_run_manifest(
        ctx, ledger, {"state": "published", "output_uri": outcome.output_uri}, manifests_dir=folder,
        validation=validation, output_fingerprints=output_fingerprints(ctx, directory) if directory else {},
    )


# --------------------------------------------------------------------------- the whole run


def _release_before_start(ctx: RunContext, ledger: Any, exc: BaseException) -> None:
    """A failure before any noise was drawn refunds the reservation (semantics.md section 4)."""
    try:
        rec = ledger.run(ctx.run_id)
        if rec is not None and rec.state == "reserved":
            reason = public_message(exc)  # the ledger and the log keep no input data (dpops.errors)
            ledger.release(ctx.run_id, reason=f"failed before any mechanism ran: {reason}"[:500], actor=ctx.actor)
            log.info("release=%s interval=%s outcome=released run=%s reason=%s", ctx.spec.name, ctx.interval,
                     ctx.run_id, reason)
    except Exception:  # noqa: BLE001 - keep the original error; `dpops ledger recover` releases it later
        log.exception("could not release the reservation of run %s", ctx.run_id)


def _run_steps(ctx: RunContext, ledger: Any, **kwargs: Any) -> RunOutcome:
    token = _QUIET.set(True)
    try:
        out = _run_steps_quiet(ctx, ledger, **kwargs)
    except BaseException as exc:
        _QUIET.reset(token)
        failed = _log_failure(ctx, ledger, exc)
        try:
            exc.dpops_outcome = failed  # type: ignore[attr-defined] - the CLI's --json error object shows it
        except AttributeError:  # pragma: no cover
            pass
        raise
    _QUIET.reset(token)
    log.info(out.line())
    return out


def _run_steps_quiet(ctx: RunContext, ledger: Any, *, publish_output: bool, runner: str, runner_options: Sequence[str],
               run_release: Callable[[Any], Any] | None, gx_checks: bool, restates: str | None,
               reserved: RunOutcome | None = None, write_manifest: bool = True,
               progress: Progress | None = None) -> RunOutcome:
    ctx.write_manifest = write_manifest
    if reserved is None:
        check_runner(runner, runner_options, run_release)  # before reserve: a bad runner costs nothing
        _stage(progress, "reserve")
        reserved = reserve(ctx, ledger, restates=restates)
    if reserved.state == "already_published":
        if write_manifest:
            ensure_manifest(ctx, ledger, reserved)
        return reserved
    try:
        staged = compute_staged(ctx, ledger, runner=runner, runner_options=runner_options, run_release=run_release,
                                progress=progress)
    except BaseException as exc:
        _release_before_start(ctx, ledger, exc)
        raise
    if not publish_output:
        rec = ledger.run(ctx.run_id)
        return _outcome(ctx, ledger, "staged", record=rec, charged=reserved.epsilon_charged,
                        output_uri=staged.directory.resolve().as_uri(),
                        message="computed and staged; publish with --publish (no new charge)")
    out = publish(ctx, ledger, gx_checks=gx_checks, progress=progress)
    out.epsilon_charged = reserved.epsilon_charged
    if write_manifest:
        ensure_manifest(ctx, ledger, out, ctx.output_checks)
    return out


def execute_release(spec_path: str | os.PathLike[str], interval_start: Any, interval_end: Any = None, *,
                    ledger: Any, randomness: str = "keyed", key_path: str | None = None,
                    test_seed: int | None = None, key: Any = None, runner: str = "FnApiRunner",
                    runner_options: Sequence[str] = (), publish_output: bool = True,
                    run_release: Callable[[Any], Any] | None = None, planner: Callable[[ReleaseSpec], Any] | None = None,
                    gx_checks: bool = False, actor: str | None = None, progress: Progress | None = None) -> RunOutcome:
    """``dpops release run``: prepare, reserve, compute, publish. Safe to call again after any failure.

    ``progress`` is called with each stage name of ``STAGES`` as the run reaches it."""
    ctx = prepare(spec_path, interval_start, interval_end, randomness=randomness, key_path=key_path,
                  test_seed=test_seed, key=key, planner=planner, actor=actor, progress=progress)
    return _run_steps(ctx, ledger, publish_output=publish_output, runner=runner, runner_options=runner_options,
                      run_release=run_release, gx_checks=gx_checks, restates=None, progress=progress)


def restate(ctx: RunContext, ledger: Any) -> RunOutcome:
    """The restatement's reserve step: explicitly re-release a published interval whose input (or spec)
    changed. A new run key, a fresh charge, linked (``restates``) to the run it corrects; ``compute`` and
    ``publish`` then publish it as the interval's next version."""
    _pick_attempt(ctx, ledger)
    published = ledger.published(ctx.spec.name, ctx.interval.start_iso, ctx.interval.end_iso)
    if published is None:
        raise LedgerError(f"{ctx.spec.name} {ctx.interval} has not been published: nothing to restate; "
                          "use dpops release run")
    if published.run_id == ctx.run_id:
        _make_visible(ctx, published)  # completes a restatement killed between its commit and the file publish
        check_served_files(ctx, published)
        return _outcome(ctx, ledger, "already_published", record=published,
                        message="input, spec and key unchanged: the published result stands, nothing charged")
    return reserve(ctx, ledger, restates=published.run_id)


def execute_restatement(spec_path: str | os.PathLike[str], interval_start: Any, interval_end: Any = None, *,
                        ledger: Any, randomness: str = "keyed", key_path: str | None = None, key: Any = None,
                        runner: str = "FnApiRunner", runner_options: Sequence[str] = (),
                        run_release: Callable[[Any], Any] | None = None,
                        planner: Callable[[ReleaseSpec], Any] | None = None,
                        gx_checks: bool = False, actor: str | None = None,
                        progress: Progress | None = None) -> RunOutcome:
    """``dpops release restate``: prepare, restate (reserve linked to the published run), compute, publish."""
    ctx = prepare(spec_path, interval_start, interval_end, randomness=randomness, key_path=key_path, key=key,
                  planner=planner, actor=actor, progress=progress)
    token = _QUIET.set(True)
    _stage(progress, "reserve")
    try:
        first = restate(ctx, ledger)
    finally:
        _QUIET.reset(token)
    if first.state == "already_published":
        log.info(first.line())
        return first
    return _run_steps(ctx, ledger, publish_output=True, runner=runner, runner_options=runner_options,
                      run_release=run_release, gx_checks=gx_checks, restates=first.restates, reserved=first,
                      progress=progress)


def abandon(ctx: RunContext, ledger: Any, *, reason: str) -> RunOutcome:
    """Explicitly give up an unpublished run: a reservation is refunded (no noise was drawn), a started
    run is marked spent_unpublished (its noise may exist, so the charge stays). Published runs are final."""
    _pick_attempt(ctx, ledger)
    rec = ledger.run(ctx.run_id)
    if rec is None:
        raise LedgerError(f"run {ctx.run_id} of {ctx.spec.name} {ctx.interval} is not in the ledger: nothing to abandon")
    if rec.state == "reserved":
        rec = ledger.release(ctx.run_id, reason=f"abandoned by operator: {reason}", actor=ctx.actor)
    elif rec.state == "started":
        rec = ledger.mark_spent_unpublished(ctx.run_id, reason=f"abandoned by operator: {reason}", actor=ctx.actor)
    elif rec.state == "committed":
        raise LedgerError(f"run {ctx.run_id} is published; a publication is never withdrawn (restate it instead)")
    return _outcome(ctx, ledger, rec.state, record=rec, message=f"abandoned: {reason}")


def status(spec_path: str | os.PathLike[str], interval_start: Any, interval_end: Any = None, *,
           ledger: Any, key: Any = None) -> dict[str, Any]:
    """What the ledger and the storage say about a release's interval. Reads no private data.

    ``published_files``: the published run's files compared with the ledger's commit entry and, given
    the noise ``key``, with the manifest's keyed fingerprints (``ok`` False names each changed file)."""
    spec = load_spec(spec_path)
    iv = parse_interval(interval_start, interval_end)
    store = open_store(spec.output_root, spec.name)
    runs = ledger.runs(release=spec.name, interval_start=iv.start_iso, interval_end=iv.end_iso)
    published = ledger.published(spec.name, iv.start_iso, iv.end_iso)
    try:
        remaining = float(ledger.status(spec.budget.scope).remaining)
    except DpopsError:
        remaining = None
    return {
        "release": spec.name, "interval": str(iv), "scope": spec.budget.scope, "scope_remaining": remaining,
        "published_run": published.run_id if published else None,
        "output_uri": published.output_uri if published else None,
        "versions": [{"version": v.version, "run_id": v.run_id, "restates": v.restates, "published_at": v.published_at}
                     for v in store.versions(iv.slug)],
        "runs": [{"run_id": r.run_id, "state": r.state, "epsilon": r.epsilon, "restates": r.restates,
                  "key_id": r.key.key_id, "created_at": r.created_at, "updated_at": r.updated_at} for r in runs],
        "published_files": published_file_check(
            store, iv.slug, published, spec_manifests_dir(spec), key).to_dict() if published is not None else None,
    }


__all__ = ["RunContext", "RunOutcome", "prepare", "reserve", "compute", "compute_staged", "publish", "restate",
           "execute_release", "execute_restatement", "abandon", "status", "check_noisy_output", "open_run_ledger", "step_summary"]
