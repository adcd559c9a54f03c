"""A refused run: the reason an operator reads, and the refusal manifest that records it.

A budget refusal charges nothing and the ledger keeps no entry for it (a refusal is not a state
change), so the only durable trace is the refusal manifest ``<run_id>.refused.json`` next to the
release's other manifests. ``dpops gaps`` reads it to say *refused* rather than *never run*, and a
reviewer sees what was asked and what was left. Both entry points write it through this module:
``dpops release run`` (``execute``) and the Airflow DAG (``dpops.orchestration``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from dpops.errors import BudgetExceeded, public_message
from dpops.ledger.budget import format_budget
from dpops.release.context import RunContext
from dpops.release.manifests import manifests_dir

if TYPE_CHECKING:
    from dpops.ledger import Ledger

log = logging.getLogger("dpops.release")


def budget_refusal_reason(ctx: RunContext, ledger: Ledger, exc: BudgetExceeded) -> str:
    """What was left, what was asked and what to do; only ledger figures (never input data)."""
    scope = getattr(exc, "scope", None) or ctx.spec.budget.scope
    cap = getattr(exc, "cap", None)
    left_value = getattr(exc, "left", None)  # the refused bucket's, from the same read as the refusal itself
    if left_value is None:
        try:
            left_value = float(ledger.status(scope).remaining)
            cap = float(ledger.status(scope).cap) if cap is None else cap
        except Exception:  # noqa: BLE001 - the refusal must not fail on a status read
            left_value = None
    # One precision (the cap's) for every number, so they agree: "0 left (cap 4.5), asked 0.5, would remain -0.5".
    left = "?" if left_value is None else format_budget(left_value, cap)
    unit = getattr(exc, "unit", None) or "epsilon"
    asked = getattr(exc, "requested", None)
    remain = getattr(exc, "would_remain", None)
    return (f"budget refused for {ctx.spec.name} {ctx.interval}: scope {scope!r} has {unit} {left} left "
            f"(cap {'?' if cap is None else format_budget(cap)}), this run asked {unit} "
            f"{'?' if asked is None else format_budget(asked)}"
            + ("" if remain is None else f", which would leave {format_budget(remain, cap)}")
            + f"; nothing was charged and the interval stays unpublished. {_what_to_do(ledger, scope, cap)} "
            f"Ledger: {public_message(exc)}")


def _what_to_do(ledger: Ledger, scope: str, cap: float | None) -> str:
    """What frees budget on ``scope``: only a reservation may still be refunded (no noise drawn yet); every
    other charge is final (semantics: after noise is drawn the charge stays). So "wait" is said only when
    reservations are in flight (issue 28 item 15: "wait for budget" where waiting frees nothing)."""
    raise_cap = f"raise the cap (dpops ledger cap {scope} ... --reason ...)"
    try:
        reserved = float(ledger.status(scope).reserved)
    except Exception:  # noqa: BLE001 - the refusal must not fail on a status read
        return f"To release it, {raise_cap}, then run the interval again."
    if reserved > 0:
        return (f"Runs in flight hold {format_budget(reserved, cap)} in reservations; if one fails before drawing "
                f"noise its reservation is refunded. To release it, wait for those runs or {raise_cap}, then run "
                "the interval again.")
    return (f"Waiting frees nothing: every charge on the scope is final. To release it, {raise_cap}, then run the "
            "interval again; or leave it unpublished on purpose (dpops gaps lists it).")


def record_refusal(ctx: RunContext, ledger: Ledger, reason: str) -> None:
    """Write the run's refusal manifest once (nothing spent); best effort, never masks the refusal."""
    try:
        from dpops.manifest.io import manifest_exists
        from dpops.manifest.run_hook import write_run_manifest

        folder = manifests_dir(ctx)
        if manifest_exists(folder, f"{ctx.run_id}.refused.json") is None:  # local dir or object-store prefix
            write_run_manifest(ctx, ledger, {"state": "refused", "reason": reason}, manifests_dir=folder)
    except Exception:
        log.exception("could not write the refusal manifest of run %s", ctx.run_id)


__all__ = ["budget_refusal_reason", "record_refusal"]
