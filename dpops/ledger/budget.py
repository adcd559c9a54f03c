"""How the ledger turns an accountant's running state into the number compared with a scope's cap.

Per bucket the ledger composes three states at each reservation: ``settled``
(committed + spent-unpublished runs), ``committed`` and ``spent``, then the open runs
(reserved or started) and the request on top. They are composed from the ``runs``
rows every time, not kept as running states in a cache (issue 25 item 8: the
application role could reset such a cache; ``cap.bucket_states``). The price:
a check costs the composition of the bucket's history (measured in the issue's
report at 10 and 10,000 entries).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from dpops.accounting import Accountant, State, get_accountant
from dpops.errors import SpecError
from dpops.events import PrivacyEvent
from dpops.ledger.model import ScopeDefinition

# Float summation noise only: 10 x 0.1 is 0.9999999999999999 but 3 x 0.1 is 0.30000000000000004.
# A composition above the cap by less than this relative margin (1e-12, far below any meaningful
# privacy difference) is admitted so that exact-fit budgets behave as written.
CAP_RELATIVE_TOLERANCE = 1e-12


def dump_state(state: State) -> str:
    """Serialise an accountant's running state for its database column (sorted keys, so equal states are equal text)."""
    # Infinity is legal in a running state (e.g. an RDP order that overflowed): keep it round-trippable.
    return json.dumps(state, sort_keys=True, separators=(",", ":"))


def load_state(text: str) -> State:
    """Parse a running state stored by ``dump_state``."""
    return json.loads(text)


def accountant_for(scope: ScopeDefinition) -> Accountant:
    """The accountant pinned by ``scope`` (its ``name/version``, never the latest of the name)."""
    return get_accountant(scope.accountant)


def state_rho(acct: Accountant, state: State) -> float:
    """rho of a running state, for a zCDP cap; SpecError when the composition has no rho form.

    An accountant may provide ``state_rho`` itself; ``zcdp/1`` keeps rho in two fields and has a rho only while
    no approximate-DP event (e.g. partition selection) is in the history.
    """
    fn = getattr(acct, "state_rho", None)
    if callable(fn):
        return float(fn(state))
    # zcdp/1 keeps rho in "rho_noise" + "rho_pure" beside an approx-DP part that has no rho form.
    if acct.name == "zcdp" and {"rho_noise", "rho_pure"} <= set(state):
        if not state.get("approx_eps") and not state.get("approx_delta"):
            return float(state["rho_noise"]) + float(state["rho_pure"])
    raise SpecError(
        f"accountant {acct.ref} cannot express this composition as a zCDP rho; a rho cap needs a zcdp accountant "
        "and mechanisms with a zCDP form (cap this scope with epsilon instead)"
    )


def measure(acct: Accountant, scope: ScopeDefinition, state: State) -> float:
    """The capped quantity of a state: epsilon at the scope's delta, or rho for a zCDP cap."""
    if scope.rho is not None:
        return state_rho(acct, state)
    return float(acct.state_epsilon(state, scope.delta))


def measure_events(acct: Accountant, scope: ScopeDefinition, events: Sequence[PrivacyEvent]) -> float:
    """``measure`` of the composition of ``events`` alone (0 for none): one group of runs, for statuses, replays."""
    if not events:
        return 0.0
    return measure(acct, scope, acct.add_events(acct.empty_state(), list(events)))


def epsilon_of(acct: Accountant, scope: ScopeDefinition, events: Sequence[PrivacyEvent]) -> float:
    """Epsilon of ``events`` alone at the scope's delta (inf when delta=0 and a mechanism needs delta)."""
    if not events:
        return 0.0
    try:
        return float(acct.epsilon(list(events), scope.delta))
    except (ValueError, ZeroDivisionError, OverflowError):
        return math.inf


def within_cap(value: float, cap: float) -> bool:
    """Is ``value`` within ``cap``, allowing float noise of CAP_RELATIVE_TOLERANCE relative? NaN never is."""
    return not math.isnan(value) and value <= cap * (1.0 + CAP_RELATIVE_TOLERANCE)


# --- how budget figures are shown (issue 21 item 8) ------------------------------------------------------------
# The ledger keeps the exact floats (and ``CAP_RELATIVE_TOLERANCE``'s slack; the release plan shares a budget with
# a 1e-9 safety margin, dpops.release_plan.SAFETY), so a scope at its cap can hold 4.499999995497694 committed and
# 4.50231e-09 remaining. Those digits mean nothing: privacy parameters are decided to a few significant digits.
# Every figure a person reads (CLI tables and lines, refusals, outcome lines, the report) goes through
# ``format_budget``; JSON carries the same figures and the exact numbers beside them (``budget_json`` below).
DISPLAY_DIGITS = 6


def format_budget(value: float | None, scale: float | None = None) -> str:
    """A budget figure (epsilon or rho) at ``DISPLAY_DIGITS`` significant digits.

    ``scale``: the figure it is read against, the scope's cap. A value smaller than the cap's last shown digit
    (``|value| < cap * 10**-DISPLAY_DIGITS``, e.g. 4.50231e-09 remaining of a cap of 4.5) is a float crumb and
    shows as 0, so the numbers of one message agree with each other (0 left, asked 0.5, would remain -0.5).
    Otherwise a figure keeps its own 6 significant digits (4.499999995497694 -> 4.5, 0.4999999995 -> 0.5), the
    same in every place it appears. None and infinity are "inf" (an epsilon with no finite bound).
    """
    if value is None:
        return "inf"
    v = float(value)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if scale is not None and math.isfinite(float(scale)) and abs(v) < abs(float(scale)) * 10.0 ** -DISPLAY_DIGITS:
        return "0"
    text = f"{v:.{DISPLAY_DIGITS}g}"
    return "0" if text in ("-0", "0") else text


# --- the same figures for machines (issue 28 item 13) ----------------------------------------------------------
# ``--json`` used to keep the accountant's slack (committed 16.999999982991294, remaining 1.0005e-08 at a cap of 17)
# where the tables, the report and the Privacy budget page show 17 and 0. A script reading ``remaining`` then
# decided "budget left" where every person was told there is none. The rule, owned here beside ``format_budget``:
# every budget figure of a JSON document is the number a person reads (``format_budget``'s digits, so a crumb below
# the cap's resolution is exactly 0), and the exact float the ledger composed is kept, unrounded, under the
# document's ``exact`` mapping for whoever recomputes. The resolution, 10**-DISPLAY_DIGITS of the cap, is the
# accountant-calibrated plan's own tolerance (``dpops.release_plan.CALIBRATION_REL_TOL``, 1e-6: a run may charge
# that much less than it declares, never more) and far above the cap check's float allowance
# (``CAP_RELATIVE_TOLERANCE``): a remainder smaller than it is calibration slack, not budget anyone planned.
# Nothing here changes what the ledger records or admits (``within_cap`` decides on the exact floats).
EXACT_FIELD = "exact"


def budget_figure(value: float | None, scale: float | None = None) -> float | None:
    """``format_budget(value, scale)`` as a JSON number: the figure a person reads; None where it reads "inf"."""
    text = format_budget(value, scale)
    if text in ("inf", "-inf", "nan"):
        return None
    return float(text)


def budget_json(doc: dict[str, object], scales: dict[str, float | None]) -> dict[str, object]:
    """``doc`` with each field named in ``scales`` that holds a number replaced by ``budget_figure(value, scale)``
    (the scale it is read against: the scope's cap, or None for a figure read alone, such as a run's own epsilon),
    and the exact numbers under ``doc["exact"]`` (merged with an ``exact`` already there). A field that is absent
    or not a number is left as it is."""
    out = dict(doc)
    prior = out.get(EXACT_FIELD)
    exact: dict[str, float | None] = dict(prior) if isinstance(prior, dict) else {}
    for name, scale in scales.items():
        v = out.get(name)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            exact[name] = float(v) if math.isfinite(float(v)) else None
            out[name] = budget_figure(float(v), scale)
    if exact:
        out[EXACT_FIELD] = exact
    return out
