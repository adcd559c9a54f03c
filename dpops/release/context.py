"""What every release step shares: the run's context, its outcome line, the ledger it runs against.

``RunContext`` is built by ``prepare`` (``dpops.release.preparation``) without touching the ledger and is
rebuilt, cheaply and identically, by every Airflow task, so no step trusts state handed over by an
earlier one. Its run key (release, spec hash, interval, keyed input fingerprint, key id and attempt)
is the ledger's identity of the run: keyed noise is a function of (key, run key), which is why a
retry of the same run key reveals nothing new and is not charged again.

``RunOutcome`` is the one line a run logs. It never carries input data, only ledger figures.
Logs go to the ``dpops.release`` logger: the one ``dpops release=...`` line per run that log
filters and alerts select on.
"""

from __future__ import annotations

import getpass
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import date, datetime
from typing import TYPE_CHECKING, Protocol, TypeAlias, TypedDict

from dpops.errors import BudgetExceeded, LedgerError, public_message
from dpops.inputs import HmacKey, InputStats, Interval
from dpops.ledger.budget import format_budget
from dpops.spec import ReleaseSpec
from dpops.storage import StagedRun, Store

if TYPE_CHECKING:  # the ledger is imported lazily at run time (DAG parsing must not load it)
    from dpops.events import PrivacyEvent
    from dpops.ledger import Ledger, RunKey, RunRecord
    from dpops.release_plan import ReleasePlan

log = logging.getLogger("dpops.release")
QUIET_RUNS: ContextVar[bool] = ContextVar("dpops_runs_quiet", default=False)

RANDOMNESS = ("keyed", "os", "test")
# Stages reported to a ``progress`` callback, in order. Reading, bounding and noise are one Beam job
# (pipelines.release_pipeline), so they are one stage here: reporting them apart would need a hook
# inside the pipeline, and a stage line that claims noise is drawn before it is would mislead.
STAGES = ("fingerprint", "reserve", "read, bound and noise", "write", "check output", "publish")
Progress = Callable[[str], None]
# What ``parse_interval`` takes for each end ("START/END" as the start alone, an ``Interval``, ISO text, a date).
IntervalBound: TypeAlias = "Interval | str | date | datetime | None"
MAX_OS_ATTEMPTS = 100


class NoiseKeyLike(HmacKey, Protocol):
    """The noise key as the steps use it: ``key_id``, ``hmac`` (keyed fingerprints) and ``seal_mac``
    (the staging seal). ``dpops.noise.randomness.NoiseKey``, or a stand-in in tests and embeddings."""

    def seal_mac(self, data: bytes) -> str:
        """The staging seal: a keyed MAC of the staged files' payload."""


def report_stage(progress: Progress | None, name: str) -> None:
    """Tell the ``progress`` callback (when there is one) that the run entered stage ``name``."""
    if progress is not None:
        progress(name)


def default_actor() -> str:
    """Who the ledger records for a command-line run: ``dpops:<OS user>``."""
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        user = "unknown"
    return f"dpops:{user}"


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
    plan: ReleasePlan
    store: Store
    key_path: str | None = None
    test_seed: int | None = None
    attempt: int = 1  # chosen by ``pick_attempt``: os mode always; keyed mode after a refund or a fresh attempt
    # The spent_unpublished run a fresh attempt replaces (``pick_attempt``); part of the noise label.
    replaces_spent: str | None = None
    # The published run a restatement corrects, set by ``dpops.release.execute.restate`` before it reserves:
    # a refusal manifest written for the restatement states the same link the ledger records when the same
    # run key is reserved later (after a cap raise), so the refusal verifies then too (issue 28 item 1).
    restates: str | None = field(default=None, compare=False)
    # A fresh attempt's operator reason, set by ``reserve`` with ``replaces_spent``: a refusal manifest of the
    # fresh attempt states the same link (run and reason) the ledger records when it is reserved later.
    fresh_reason: str | None = field(default=None, compare=False)
    actor: str = field(default_factory=default_actor)
    # The key behind the keyed fingerprints (input and published files). Never shown or serialized.
    fingerprint_key: HmacKey | None = field(default=None, repr=False, compare=False)
    # What the ledger last confirmed to this process about the run (its state, its own ε) and what this
    # invocation charged: a failure line can say "started and charged" when the ledger no longer answers.
    known_state: str | None = field(default=None, repr=False, compare=False)
    known_epsilon: float | None = field(default=None, repr=False, compare=False)
    charged_here: float = field(default=0.0, repr=False, compare=False)
    output_checks: list[str] = field(default_factory=list, repr=False, compare=False)
    write_manifest: bool = field(default=True, repr=False, compare=False)
    # bounds: estimate: the estimated bounds per column substituted into ``spec`` (the pipeline, which
    # re-loads the spec file, substitutes the same ones: ``ComputeRequest.estimated_bounds``)
    estimated_bounds: dict[str, tuple[float, float]] | None = None
    estimation_charged: float = field(default=0.0, repr=False, compare=False)  # by this invocation (prepare)
    # Files of the noise keys of earlier rotations (``dpops.keyref.KeyRing``; ``prepare`` takes
    # ``$DPOPS_PREVIOUS_NOISE_KEY_FILES``, ``release run --previous-key-file`` sets them): a re-run of an
    # interval published under one of them compares the input under it (``served_across_rotation``).
    previous_key_paths: tuple[str, ...] = field(default=(), repr=False, compare=False)
    # The inputs' stat snapshot taken by this process's ``prepare`` right before its fingerprint pass
    # (``dpops.inputs.input_stat_snapshot``; None for object-store inputs): the check before ``start`` compares it
    # instead of hashing the input a second time.
    input_stats: InputStats | None = field(default=None, repr=False, compare=False)
    # Each input file's (size, sha256) from that same fingerprint pass, {path: (size, hex)}: the check after the
    # pipeline compares them with the bytes the reader consumed (``ComputeResult.read_digests``) instead of
    # hashing the input again. Unkeyed hashes of private files: in memory only, never written or shown.
    input_digests: dict[str, tuple[int, str]] = field(default_factory=dict, repr=False, compare=False)

    def note_ledger(self, record: RunRecord | None, charged: float = 0.0) -> None:
        """Remember what the ledger just confirmed about this run (``record``) and any charge it made now."""
        if record is not None and getattr(record, "run_id", None) == self.run_id:
            self.known_state = record.state
            self.known_epsilon = getattr(record, "epsilon", None)
        if charged:
            self.charged_here = float(charged)

    @property
    def run_key_id(self) -> str:
        """The key id part of the run key: the noise key's id, or the os-mode attempt."""
        if self.randomness == "os":
            return f"os/attempt-{self.attempt}"
        # keyed/test: attempt 1 is the plain key id, so run ids stay stable; a later attempt exists only
        # after a refund (released: no noise was ever drawn), and its noise label is unchanged.
        return self.key_id if self.attempt == 1 else f"{self.key_id}/retry-{self.attempt}"

    @property
    def run_key(self) -> RunKey:
        """The ledger's identity of this run."""
        from dpops.ledger import RunKey

        return RunKey(
            release=self.spec.name, spec_hash=self.spec.spec_hash, interval_start=self.interval.start_iso,
            interval_end=self.interval.end_iso, input_fingerprint=self.input_fingerprint, key_id=self.run_key_id,
        )

    @property
    def run_id(self) -> str:
        """The run key's id."""
        return self.run_key.run_id

    @property
    def noise_label(self) -> dict[str, str]:
        """What keyed noise is a function of (with the key): never the key, never input data."""
        return {
            "release": self.spec.name, "spec_hash": self.spec.spec_hash, "interval_start": self.interval.start_iso,
            "interval_end": self.interval.end_iso, "input_fingerprint": self.input_fingerprint,
            **({"attempt": str(self.attempt)} if self.randomness == "os" else {}),
            # A fresh attempt after a spent one draws noise independent of the spent attempt's.
            **({"replaces_spent": str(self.replaces_spent)} if getattr(self, "replaces_spent", None) else {}),
        }

    @property
    def events(self) -> list[PrivacyEvent]:
        """The plan's privacy events: what ``reserve`` charges."""
        return list(self.plan.events)


# A run in these states holds a charge (a reserved one until it is refunded).
CHARGED_RUN_STATES = ("reserved", "started", "spent_unpublished", "committed")


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
    ledger_state: str | None = None  # a failed run: its state in the ledger (read, or last confirmed to this process)
    ledger_unreadable: bool = False  # a failed run: the ledger did not answer when the outcome was written
    # bounds: estimate: what THIS invocation charged for the interval's estimation (its own ledger run,
    # <name>__estimate), so no line says "charged ε=0" after an estimation was charged (issue 25 item 7d)
    estimation_charged: float = 0.0

    def budget_words(self) -> str:
        """``charged ε=0.94 this run; scope total ε=3.93 of cap 4 (rdp/1 accountant)``.

        Figures go through ``format_budget`` (the cap's precision for totals and remaining: no float crumbs).
        A failed run says what is known (issue 21 item 9): when the ledger had reserved or started it, the run is
        charged whatever this invocation's ``epsilon_charged`` says, and a total the ledger did not answer for is
        "could not be read", not "unknown" next to a false "charged ε=0".
        """
        u = "ρ" if self.budget_unit == "rho" else "ε"
        f = format_budget
        if self.state == "refused":
            this = (f"charged {u}=0 this run" + (f" (it would have cost {u}={f(self.run_epsilon)})"
                                                 if self.run_epsilon is not None else ""))
        elif self.state == "failed" and self.ledger_state in CHARGED_RUN_STATES:
            own = "" if self.run_epsilon is None else f" {u}={f(self.run_epsilon)}"
            this = f"the run is {self.ledger_state} in the ledger and charged{own}"
            if self.ledger_state == "reserved":
                this += " (refunded if no noise was drawn: retry, or `dpops ledger recover`)"
            elif self.ledger_state == "started":
                this += " (noise may have been drawn: the charge stays)"
            if self.epsilon_charged:
                this += f", {u}={f(self.epsilon_charged)} of it by this invocation"
        else:
            this = f"charged {u}={f(self.epsilon_charged)} this run"
            if self.run_epsilon is not None and not math.isclose(self.run_epsilon, self.epsilon_charged,
                                                                 rel_tol=1e-9, abs_tol=1e-12):
                this += f" (the run's own {u}={f(self.run_epsilon)}, charged once when it was first reserved)"
        if self.estimation_charged:
            this += (f"; its bounds: estimate estimation (run {self.release}__estimate) charged "
                     f"{u}={f(self.estimation_charged)} more by this invocation")
        if self.scope_total is None:
            scope = (f"scope {self.scope} total could not be read (the ledger did not answer)"
                     if self.ledger_unreadable else f"scope {self.scope} total unknown")
        else:
            scope = f"scope {self.scope} total {u}={f(self.scope_total, self.scope_cap)}"
            if self.scope_cap is not None:
                scope += f" of cap {f(self.scope_cap)}"
            if self.accountant:
                scope += f" ({self.accountant} accountant, all runs composed)"
        return f"{this}; {scope}"

    def line(self) -> str:
        """The one log line of this outcome."""
        rem = "?" if self.scope_remaining is None else format_budget(self.scope_remaining, self.scope_cap)
        text = (f"release={self.release} interval={self.interval} outcome={self.state} "
                f"epsilon_charged={format_budget(self.epsilon_charged)} scope={self.scope} remaining={rem}: "
                f"{self.budget_words()}")
        if self.restates:
            text += f" restates={self.restates}"
        if self.output_uri:
            text += f" output={self.output_uri}"
        if self.message:
            text += f" - {self.message}"
        return text

    def as_dict(self) -> dict[str, object]:
        """JSON-safe fields (non-finite figures as None) plus the ``budget`` words."""
        d: dict[str, object] = dict(self.__dict__)
        d["budget"] = self.budget_words()
        for k in ("epsilon_charged", "run_epsilon", "scope_remaining", "scope_total", "scope_cap"):
            v = d[k]
            if isinstance(v, float) and not math.isfinite(v):
                d[k] = None
        return d


class ScopePosition(TypedDict, total=False):
    """A scope's figures as ``RunOutcome`` fields (empty when the ledger could not say)."""

    scope_total: float
    scope_remaining: float
    scope_cap: float
    accountant: str
    budget_unit: str


def scope_position(ledger: Ledger, scope: str, buckets: Sequence[str] | None = None) -> ScopePosition:
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


def make_outcome(ctx: RunContext, ledger: Ledger, state: str, *, record: RunRecord | None = None, charged: float = 0.0,
             message: str = "", output_uri: str | None = None) -> RunOutcome:
    """The run's one outcome line: note the ledger record on ``ctx``, read the scope's position after it
    and log the line (at DEBUG while ``QUIET_RUNS`` is set, i.e. inside ``execute_release``). Every step
    ends a run through this function."""
    ctx.note_ledger(record, charged)
    pos = scope_position(ledger, ctx.spec.budget.scope, getattr(record, "buckets", None))  # incl. scope_remaining
    out = RunOutcome(
        release=ctx.spec.name, interval=str(ctx.interval), state=state,
        run_id=getattr(record, "run_id", None) or ctx.run_id,
        output_uri=output_uri or getattr(record, "output_uri", None),
        epsilon_charged=charged, run_epsilon=getattr(record, "epsilon", None), scope=ctx.spec.budget.scope,
        restates=getattr(record, "restates", None), message=message, estimation_charged=ctx.estimation_charged,
        **pos,
    )
    # Inside execute_release the steps' lines are DEBUG: the whole run logs ONE line at the end.
    log.log(logging.DEBUG if QUIET_RUNS.get() else logging.INFO, out.line())
    return out


def log_failure(ctx: RunContext, ledger: Ledger, exc: BaseException) -> RunOutcome:
    """The one line of a run that ended in an error (the error itself still propagates)."""
    state = "refused" if isinstance(exc, BudgetExceeded) else "failed"
    rec = None
    unreadable = False
    try:
        rec = ledger.run(ctx.run_id)
    except Exception:  # noqa: BLE001
        unreadable = True
    pos = scope_position(ledger, ctx.spec.budget.scope, getattr(rec, "buckets", None))  # incl. scope_remaining
    unreadable = unreadable or not pos
    # What is known: the ledger's answer now, else what it last confirmed to this process (issue 21 item 9).
    ledger_state = rec.state if rec is not None else (ctx.known_state if state == "failed" else None)
    run_eps = getattr(rec, "epsilon", None) if rec is not None else ctx.known_epsilon
    requested = getattr(exc, "requested", None)
    if run_eps is None and isinstance(requested, float):
        run_eps = requested  # a refusal: what this run would have cost
    known = (f" (ledger state {rec.state})" if rec else
             f" (the ledger did not answer; it last confirmed the run {ctx.known_state})" if ledger_state else "")
    out = RunOutcome(release=ctx.spec.name, interval=str(ctx.interval), state=state, run_id=ctx.run_id,
                     run_epsilon=run_eps, scope=ctx.spec.budget.scope,
                     epsilon_charged=ctx.charged_here if state == "failed" else 0.0,
                     ledger_state=ledger_state, ledger_unreadable=unreadable,
                     message=public_message(exc) + known, estimation_charged=ctx.estimation_charged, **pos)
    log.warning(out.line())
    return out


@contextmanager
def open_run_ledger(url: str | None = None) -> Iterator[Ledger]:
    """The ledger for one step (``None``: ``DPOPS_LEDGER_URL`` or the default SQLite file), closed afterwards."""
    from dpops.ledger import open_ledger

    ledger = open_ledger(url)
    try:
        yield ledger
    finally:
        close = getattr(ledger, "close", None)
        if callable(close):
            close()


def step_summary(result: RunOutcome | StagedRun) -> dict[str, object]:
    """JSON-safe dict of a step's result (an Airflow XCom): never the key, never internal counters."""
    if isinstance(result, RunOutcome):
        return result.as_dict()
    if isinstance(result, StagedRun):
        return {"state": "staged", "run_id": result.run_id, "output_uri": result.directory.resolve().as_uri(),
                "test_mode": result.test_mode}
    raise TypeError(f"not a step result: {type(result).__name__}")


def pick_attempt(ctx: RunContext, ledger: Ledger, *, fresh: bool = False) -> None:
    """Choose the attempt number, i.e. the run key, this invocation works on: THE one owner of that
    choice. Every step (``reserve``, ``compute``, ``publish``, and each orchestrator task through
    ``dpops.orchestration.Step.current``) calls it, so all of them work on the same run id.

    os mode: attempts whose noise may exist (spent_unpublished) or which were refunded
    (released) are closed: the next free attempt number gets a new run id and a fresh charge.
    keyed/test mode: a refunded attempt is skipped (a transient failure before any noise was
    drawn must not block the interval forever). A spent_unpublished keyed attempt stays the
    interval's current attempt (its noise may exist, it is never silently replaced) until an
    operator asks for a fresh attempt (``fresh``: ``dpops release run --fresh-attempt --reason``);
    once the attempt after it exists in the ledger, that one is current.

    A fresh attempt after a spent one gets ``ctx.replaces_spent`` = the spent run id. That id is
    part of its noise label, so its noise is FRESH (independent of the spent attempt's, which may
    have leaked from wherever it was drawn), and it is charged again: the spent charge stays,
    because that noise may exist. A refunded attempt's successor keeps the label (no noise was drawn).
    """
    closed = ("released", "spent_unpublished") if ctx.randomness == "os" else ("released",)
    ctx.replaces_spent = None
    for attempt in range(1, MAX_OS_ATTEMPTS + 1):
        ctx.attempt = attempt
        rec = ledger.run(ctx.run_id)
        if rec is not None and rec.state in closed:
            continue
        if rec is None or rec.state != "spent_unpublished":
            return
        spent = ctx.run_id  # a keyed attempt whose noise may exist
        ctx.attempt = attempt + 1
        successor = ledger.run(ctx.run_id) is not None
        ctx.attempt = attempt
        if not (fresh or successor):
            return  # stays current: publishing the interval needs an explicit fresh attempt
        ctx.replaces_spent = spent
    raise LedgerError(f"{ctx.spec.name} {ctx.interval}: {MAX_OS_ATTEMPTS} os-mode attempts failed; investigate first")
