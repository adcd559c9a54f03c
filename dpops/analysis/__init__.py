"""dpops.analysis: plan before spending -- predicted accuracy, targets solved into epsilon, the horizon.

Everything here is computed from a release spec and its plan (``dpops.release_plan.plan_release``)
alone: no data is read and nothing is charged. The CLI (``dpops plan``, ``dpops spec check``), the
manifest and the report call these same functions; a notebook calls them directly::

    from dpops import analysis
    spec = analysis.load("examples/daily_purchases.yaml")      # or a dict
    analysis.plan(spec, at_units=500)                          # pandas DataFrame, one row per quantity
    sol = analysis.solve(spec)                                 # least-epsilon split meeting spec.accuracy
    sol.spec_patch()                                           # the rounded split to declare (plan --solve --out)
    analysis.horizon_of(spec, cap=10.0).rows                   # intervals that fit, per accountant

By role:

- loading: ``load``; intervals named as on the command line (one START or START/END): ``interval_of``
- prediction: ``plan`` (DataFrame), ``predictions`` (rows), ``keep_curve``
- targets: ``check_targets``, ``solve``, ``Solution``
- budget over time: ``horizon_of``, ``Horizon``
- words for a reviewer: ``explain``

- tuning on a sample (not private): ``tune``, ``Candidate``, ``TuneResult``
- private bound estimation's mechanisms: ``EstimateConfig``, ``Estimate``; the L0 mechanism alone over given
  per-unit counts, ``estimate_l0``. The charged run over an interval's private data is a release, so it
  lives in ``dpops.release``: ``dpops.release.estimate_bounds`` (the notebook form of ``dpops estimate``)
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from dpops.analysis.accuracy import (
    DEFAULT_CONFIDENCE,
    DEFAULT_GAP,
    DEFAULT_UNITS,
    Prediction,
    keep_curve,
    predict,
)
from dpops.analysis.estimate import Estimate, EstimateConfig, estimate_l0
from dpops.analysis.horizon import ACCOUNTANTS, Horizon, HorizonRow
from dpops.analysis.loading import load
from dpops.analysis.solver import FitCheck, Solution
from dpops.analysis.solver import solve as solve_spec
from dpops.analysis.targets import TargetResult, evaluate
from dpops.analysis.tuning import Candidate, TuneResult, tune
from dpops.errors import InvalidParameter

if TYPE_CHECKING:
    import pandas as pd

    from dpops.events import PrivacyEvent
    from dpops.spec import ReleaseSpec

class ScopeView(Protocol):
    """What ``solve`` reads of a ledger scope: its name and the accountant that composes its charges."""

    @property
    def name(self) -> str:
        """The scope's name."""

    @property
    def accountant(self) -> str:
        """The accountant ref, e.g. ``pld/1``."""


class FitItemView(Protocol):
    """One item of a ledger plan: does the run fit what the scope has left."""

    @property
    def fits(self) -> bool:
        """True when the run fits every bucket it touches."""


class PlanView(Protocol):
    """What ``solve`` reads of ``Ledger.plan``: one item per planned run."""

    @property
    def items(self) -> Sequence[FitItemView]:
        """The planned runs, in order."""


class LedgerView(Protocol):
    """The read-only part of ``dpops.ledger.Ledger`` that ``solve(ledger=...)`` uses. analysis/ never opens or
    writes a ledger itself (it reads nothing and charges nothing); the caller passes an open one in."""

    def scope(self, name: str) -> ScopeView:
        """The scope's definition."""

    def plan(self, scope: str, runs: Sequence[tuple[str, str, list[PrivacyEvent]]]) -> PlanView:
        """Would these runs fit the scope now (composed with what it holds, nothing written)."""


__all__ = [
    "load", "interval_of", "plan", "predictions", "keep_curve", "check_targets", "solve", "Solution", "horizon_of",
    "Horizon", "HorizonRow", "explain", "Prediction", "TargetResult", "ACCOUNTANTS", "FitCheck", "LedgerView",
    "DEFAULT_CONFIDENCE", "DEFAULT_UNITS", "DEFAULT_GAP", "tune", "Candidate", "TuneResult",
    "estimate_l0", "EstimateConfig", "Estimate",
]


def predictions(spec: ReleaseSpec | str | os.PathLike[str] | Mapping[str, Any], *,
                confidence: float = DEFAULT_CONFIDENCE, at_units: int = DEFAULT_UNITS,
                at_values: Mapping[str, float] | None = None, gap: int = DEFAULT_GAP) -> list[Prediction]:
    """Predicted accuracy rows of the spec's plan (see ``dpops.analysis.accuracy``)."""
    from dpops.release_plan import plan_release

    s = load(spec)
    return predict(plan_release(s), confidence=confidence, at_units=at_units,
                   at_values=dict(at_values or {}), gap=gap)


def plan(spec: ReleaseSpec | str | os.PathLike[str] | Mapping[str, Any], *,
         confidence: float = DEFAULT_CONFIDENCE, at_units: int = DEFAULT_UNITS,
         at_values: Mapping[str, float] | None = None, gap: int = DEFAULT_GAP) -> pd.DataFrame:
    """Predicted accuracy as a pandas DataFrame, one row per released quantity (columns: ``Prediction``'s fields).

    Needs pandas (``pip install dpops[analysis]``).
    """
    try:
        import pandas as pd
    except ImportError:  # pragma: no cover - depends on the installation
        raise InvalidParameter("dpops.analysis.plan returns a pandas DataFrame: install pandas "
                               "(pip install 'dpops[analysis]') or use dpops.analysis.predictions") from None
    rows = predictions(spec, confidence=confidence, at_units=at_units, at_values=at_values, gap=gap)
    return pd.DataFrame([r.to_dict() for r in rows])


def interval_of(spec: ReleaseSpec | str | os.PathLike[str] | Mapping[str, Any],
                interval: str | datetime | None = None) -> tuple[str, str]:
    """(start, end) as ISO-8601 UTC text of an interval named as the CLI names one (``--interval``): ``START/END``,
    or one ``START`` (``"2024-01-03"``) for the spec's period or schedule interval starting there
    (``dpops.release.preparation.requested_interval``, the one convention); a ``datetime`` is a START. None: the
    interval containing now (what ``dpops plan --solve`` checks against the ledger)."""
    from dpops.spec import aligned_bounds

    s = load(spec)
    if interval is None:
        from datetime import UTC, timedelta

        now = datetime.now(UTC)
        b = aligned_bounds(s, now)
        lo, hi = b if b is not None else (now, now + timedelta(days=1))
        return lo.strftime("%Y-%m-%dT%H:%M:%SZ"), hi.strftime("%Y-%m-%dT%H:%M:%SZ")
    from dpops.run_interval import requested_interval

    text = interval.isoformat() if isinstance(interval, datetime) else str(interval)
    iv = requested_interval(s, text)
    return iv.start.strftime("%Y-%m-%dT%H:%M:%SZ"), iv.end.strftime("%Y-%m-%dT%H:%M:%SZ")


def solve(spec: ReleaseSpec | str | os.PathLike[str] | Mapping[str, Any], *, accountant: str | None = None,
          available: float | None = None, fits: FitCheck | None = None, ledger: LedgerView | None = None,
          interval: str | datetime | None = None) -> Solution:
    """The least-cost split meeting every accuracy target (``dpops.analysis.solver.solve``); ``spec`` is a path,
    a dict or a ``ReleaseSpec``, as for ``plan`` and ``tune`` (issue 26 section 4).

    ``available``: the most one interval may cost (epsilon under the accountant), a cap on the run.
    ``ledger`` (an open ``dpops.ledger.Ledger``: ``LedgerView``): also fit what remains of the spec's scope, as
    ``dpops plan --solve`` does: the run over ``interval`` (``interval_of``: ``START/END`` or one ``START`` like
    ``"2024-01-03"``; default the interval containing now) must fit the ledger's own ``plan`` (buckets, open
    reservations), priced by the scope's accountant. ``accountant`` defaults to the scope's with a ledger,
    else basic/1."""
    s = load(spec)
    if ledger is None:
        if interval is not None:
            raise InvalidParameter("analysis.solve: interval= names the run checked against the ledger's remaining "
                                   "budget; give ledger= too (a Ledger or a URL), or leave interval out")
        return solve_spec(s, accountant=accountant or "basic/1", available=available, fits=fits)
    if isinstance(ledger, (str, os.PathLike)):
        # analysis/ opens no ledger (it reads nothing, charges nothing: tests/test_import_graph.py); the caller
        # opens it and passes it in, read only here
        raise InvalidParameter("analysis.solve: ledger= takes an open ledger (dpops.ledger.open_ledger(URL)), "
                               "not a URL; use it in a with block so it is closed")
    start, end = interval_of(s, interval)
    scope = ledger.scope(s.budget.scope)
    if accountant is not None and accountant != scope.accountant:
        raise InvalidParameter(f"analysis.solve: scope {scope.name!r} composes with {scope.accountant}, not "
                               f"{accountant}: leave accountant= out (the ledger's is used)")

    def within(events: Sequence[PrivacyEvent]) -> bool:
        if fits is not None and not fits(events):
            return False
        return bool(ledger.plan(scope.name, [(start, end, list(events))]).items[0].fits)

    return solve_spec(s, accountant=scope.accountant, available=available, fits=within)


def check_targets(spec: ReleaseSpec | str | os.PathLike[str] | Mapping[str, Any]) -> list[TargetResult]:
    """Each of the spec's accuracy targets against its declared budget (empty without ``accuracy:``)."""
    from dpops.release_plan import plan_release

    s = load(spec)
    return evaluate(plan_release(s), s.accuracy)


def horizon_of(spec: ReleaseSpec | str | os.PathLike[str] | Mapping[str, Any], *, cap: float | None,
               cap_unit: str = "epsilon", delta: float | None = None, spent: Sequence[PrivacyEvent] = (),
               spent_source: str = "given", intervals: int = 365, start: str | datetime | None = None,
               accountants: Sequence[str] = ACCOUNTANTS, bucket: str | None = None) -> Horizon:
    """The horizon view of the spec's schedule on a scope with ``cap`` (see ``dpops.analysis.horizon``).

    ``start``: the first interval, named as the CLI names one (``"2024-01-03"``, ``START/END`` or a datetime;
    ``interval_of``); default now.
    (The function lives in the submodule of the same name, which is why it is not re-exported here:
    importing the submodule would rebind ``dpops.analysis.horizon`` to the module.)
    """
    from dpops.analysis.horizon import horizon
    from dpops.release_plan import plan_release

    s = load(spec)
    if isinstance(start, str):
        start = datetime.fromisoformat(interval_of(s, start)[0].replace("Z", "+00:00"))
    return horizon(s, plan_release(s), cap=cap, cap_unit=cap_unit, delta=delta, spent=spent,
                   spent_source=spent_source, intervals=intervals, start=start, accountants=accountants,
                   bucket=bucket)


def explain(spec: ReleaseSpec | str | os.PathLike[str] | Mapping[str, Any], *,
            accountant: str | None = None) -> list[str]:
    """Plain-language lines for a reviewer (``dpops.analysis.reviewer.lines``)."""
    from dpops.analysis.reviewer import lines
    from dpops.release_plan import plan_release

    s = load(spec)
    p = plan_release(s)
    return lines(s, p, predict(p), accountant)
