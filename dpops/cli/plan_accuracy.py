"""``dpops plan SPEC``: the accuracy view (predictions, targets, ``--solve``, horizon, reviewer lines).

Thin: every number comes from ``dpops.analysis`` (the same functions a notebook calls). This module
only gathers what the ledger knows about the spec's scope -- its cap, accountant, bucket and what is
already charged -- and prints. No data is read and nothing is written but the ``--out`` patch; if the ledger is
not reachable the view says so and uses ``--scope-cap``/``--scope-delta`` instead.

Two caps, two options (issue 26 section 4: ``--cap`` was the horizon's scope cap and, with ``--solve``, the run's
cap, in the same output): ``--scope-cap`` stands for the scope's cap when the ledger cannot say it (the horizon
counts intervals against it; the solve fits one interval in it, nothing assumed spent); ``--run-cap`` caps one
interval's cost in the solve, with or without a ledger. With ``--solve`` the horizon prices the solved split (the
patch's rounded shares), since that is the budget the operator is about to declare.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dpops.cli.common import attach, echo_ok, echo_wrapped, ledger_url, print_table, say
from dpops.errors import DpopsError, InvalidParameter
from dpops.ledger.model import CHARGED_STATES as CHARGED  # the one owner of the charged states

if TYPE_CHECKING:
    from dpops.analysis.solver import Solution
    from dpops.events import PrivacyEvent
    from dpops.ledger.model import ScopeDefinition
    from dpops.ledger.store import Ledger
    from dpops.release_plan import ReleasePlan
    from dpops.spec import ReleaseSpec


@dataclass(frozen=True)
class AccuracyOptions:
    """The accuracy view's command-line options."""

    at_units: int | None = None
    values: tuple[str, ...] = ()
    confidence: float | None = None
    gap: int | None = None
    intervals: int = 365
    scope_cap: float | None = None  # the scope's cap when the ledger is not reachable (horizon and solve)
    run_cap: float | None = None  # with solve: the most one interval may cost
    out: str | None = None  # with solve: where the patch is written
    scope_delta: float | None = None
    solve: bool = False
    require_targets: bool = False
    accountants: tuple[str, ...] = ("basic/1", "zcdp/1", "rdp/1", "pld/1")


def parse_values(values: Sequence[str]) -> dict[str, float]:
    """``KEY=V`` pairs (``--value``) as a dict; a malformed pair is a usage error naming it."""
    out: dict[str, float] = {}
    for item in values:
        key, sep, raw = item.partition("=")
        try:
            v = float(raw)
        except ValueError:
            v = math.nan
        if not sep or not key or not math.isfinite(v):
            raise InvalidParameter(f"--value {item!r}: expected KEY=NUMBER, e.g. --value sum_amount=50000")
        out[key] = v
    return out


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def _scope_info(led: Ledger, spec: ReleaseSpec) -> tuple[ScopeDefinition, list[PrivacyEvent], float]:
    sdef = led.scope(spec.budget.scope)
    spent = [e for r in led.runs(scope=sdef.name, states=CHARGED) for e in r.events]
    remaining = float(led.status(sdef.name).remaining)
    return sdef, spent, remaining


def run(spec_path: str, opts: AccuracyOptions, as_json: bool) -> None:
    """Compute and print the accuracy view of ``spec_path``."""
    from dpops import analysis
    from dpops.release_plan import plan_release
    from dpops.spec import load_spec

    spec = load_spec(spec_path)
    plan = plan_release(spec)
    at_values = parse_values(opts.values)
    unknown = sorted(set(at_values) - set(spec.metric_keys))
    if unknown:
        raise InvalidParameter(f"--value names {unknown}, which are not metric keys of {spec.source}: "
                               f"{spec.metric_keys}")
    confidence = opts.confidence if opts.confidence is not None else (
        float(spec.accuracy.confidence) if spec.accuracy is not None else analysis.DEFAULT_CONFIDENCE)
    at_units = opts.at_units if opts.at_units is not None else analysis.DEFAULT_UNITS
    gap = opts.gap if opts.gap is not None else analysis.DEFAULT_GAP

    url = ledger_url(required=False)
    led = None
    note = ""
    sdef = None
    spent: list[PrivacyEvent] = []
    remaining: float | None = None
    if url is None:
        note = "no ledger given (--ledger or $DPOPS_LEDGER_URL): the scope's cap and spending are unknown"
    else:
        from dpops.ledger import open_ledger

        try:
            led = open_ledger(url)
            sdef, spent, remaining = _scope_info(led, spec)
            note = f"read from the ledger, {len(spent)} charged event(s) so far"
            if opts.scope_cap is not None:  # said, not silently dropped: the ledger's cap is the one that binds
                note += f"; --scope-cap {opts.scope_cap:g} not used: the scope's cap in the ledger is {sdef.cap:g}"
        except DpopsError as exc:
            note = f"the ledger or scope is not reachable ({exc}): the scope's cap and spending are unknown"
            if led is not None:
                led.close()
                led = None
    try:
        doc = _compute(spec, plan, opts, confidence, at_units, at_values, gap, led, sdef, spent, remaining, note)
    finally:
        if led is not None:
            led.close()
    failing = _failing(doc, opts)
    err = None
    if opts.require_targets and failing:
        err = InvalidParameter(f"{spec.source}: {len(failing)} accuracy target(s) not met: " + "; ".join(failing))
    if as_json:
        if err is not None:
            raise attach(err, doc)
        echo_ok(doc)
    else:
        _print(doc)
    if err is not None:
        raise err


def _compute(spec: ReleaseSpec, plan: ReleasePlan, opts: AccuracyOptions, confidence: float, at_units: int,
             at_values: dict[str, float], gap: int, led: Ledger | None, sdef: ScopeDefinition | None,
             spent: list[PrivacyEvent], remaining: float | None, note: str) -> dict[str, Any]:
    from dpops import analysis
    from dpops.analysis.document import accuracy_document
    from dpops.analysis.horizon import horizon
    from dpops.ledger.budget import budget_json
    from dpops.release_plan import plan_release

    acct = sdef.accountant if sdef is not None else None
    doc: dict[str, Any] = {
        "release": spec.name, "spec_hash": spec.spec_hash, "scope": spec.budget.scope,
        # the scope's remaining budget as ``ledger status`` shows it, the exact float under ``exact`` (budget_json)
        "ledger": budget_json({"reachable": sdef is not None, "note": note, "accountant": acct,
                               "remaining": remaining, "cap_unit": sdef.cap_unit if sdef is not None else None},
                              {"remaining": sdef.cap if sdef is not None else None}),
        "accuracy": accuracy_document(spec, plan, confidence=confidence, at_units=at_units, at_values=at_values,
                                      gap=gap, accountant=acct),
        "solution": None,
        # bounds: estimate: not known before the run; the accuracy above is predicted at the fallback bounds
        "estimated_bounds": [{"metric": m.key, "column": m.column, "note": "estimated at run time",
                              "fallback_bounds": list(m.fallback_bounds),
                              "estimation_epsilon": spec.estimation_epsilon()}
                             for m in spec.metrics if getattr(m, "estimates_bounds", False)],
    }
    priced, priced_plan, priced_what = spec, plan, "the declared budget"
    if opts.solve:
        if led is not None and sdef is not None:
            # the run over the interval containing now must fit what the ledger says remains, and --run-cap
            sol = analysis.solve(spec, ledger=led, available=opts.run_cap)
        else:  # nothing known spent: one interval may cost the scope's cap, and --run-cap
            caps = [c for c in (opts.scope_cap, opts.run_cap) if c is not None]
            sol = analysis.solve(spec, available=min(caps) if caps else None)
        doc["solution"] = sol.to_dict()
        # The horizon prices what --solve proposes (the patch's rounded split), not the budget it replaces.
        priced = sol.patched_spec()
        priced_plan = plan_release(priced)
        priced_what = f"the solved split (epsilon {float(priced.budget.epsilon):.4g} per interval)"
        if opts.out is not None:
            doc["solution"]["patch_file"] = write_patch(sol, opts.out)
    if sdef is not None:
        cap: float | None = sdef.cap
        cap_unit, delta, bucket, source = sdef.cap_unit, sdef.delta, sdef.bucket, "ledger"
    else:
        cap, cap_unit, bucket = opts.scope_cap, "epsilon", None
        delta = opts.scope_delta if opts.scope_delta is not None else min(0.5, spec.budget.delta * opts.intervals)
        source = "not reachable: nothing assumed spent"
    h = horizon(priced, priced_plan, cap=cap, cap_unit=cap_unit, delta=delta, spent=spent, spent_source=source,
                intervals=opts.intervals, accountants=opts.accountants, scope_accountant=acct, bucket=bucket)
    doc["horizon"] = {**h.to_dict(), "priced": priced_what}
    return doc


def write_patch(sol: Solution, path: str) -> str:
    """Write ``sol``'s patch (``Solution.patch_yaml``) to ``path``, a new file: ``--out spec.yaml`` by mistake must
    not replace the spec it patches. Returns the path written."""
    from pathlib import Path

    out = Path(path)
    if out.exists():
        raise InvalidParameter(f"--out {path}: already exists; the patch is written to a new file, never over one "
                               "(remove it or name another file)")
    try:
        with out.open("x", encoding="utf-8") as fh:
            fh.write(sol.patch_yaml())
    except OSError as exc:
        raise InvalidParameter(f"--out {path}: cannot write the patch ({exc.strerror}): name a writable file") from None
    return str(out)


def _failing(doc: dict[str, Any], opts: AccuracyOptions) -> list[str]:
    results = (doc["solution"] or {}).get("targets") if opts.solve else doc["accuracy"]["targets"]
    return [f"{t['description']}: predicted {_fmt(t['predicted'])}" for t in results or [] if not t["met"]]


def _print(doc: dict[str, Any]) -> None:
    acc = doc["accuracy"]
    echo_wrapped(f"accuracy of {doc['release']} from its spec alone (no data read, nothing charged); "
               f"{acc['confidence']:.0%} intervals, partitions of {acc['at_units']} units")
    for e in doc.get("estimated_bounds") or []:
        lo, hi = e["fallback_bounds"]
        echo_wrapped(f"{e['metric']}: bounds estimated at run time (DP estimation charged epsilon "
                     f"{e['estimation_epsilon']:.4g} of each interval's budget); predicted at the fallback bounds "
                     f"[{lo:g}, {hi:g}]", indent=2)
    rows = []
    for p in acc["predictions"]:
        if p["type"] == "quantiles":
            err = (f"E rank err {_fmt(p['expected_rank_error'])} rows ({_fmt(p['rank_error_fraction'], 3)} of n; "
                   f"bound {_fmt(p['rank_error_bound'])})")
        elif p["type"] == "top_k":
            err = f"P(true top first | lead {p['gap']}) = {_fmt(p['probability'], 3)}"
        elif p["type"] == "partition_selection":
            err = (f"P(keep | {p['at_units']} units) = {_fmt(p['probability'], 3)}; 50% at {p['units_50']}, "
                   f"95% at {p['units_95']} units")
        else:
            err = f"+-{_fmt(p['abs_error'])}" + (f" ({_fmt(p['rel_error'], 3)} of {_fmt(p['at_value'])})"
                                                 if p["rel_error"] is not None else "")
        rows.append([p["metric"], p["quantity"], p["distribution"], _fmt(p["epsilon"]), _fmt(p["std"]), err])
    print_table("predicted accuracy", ["metric", "quantity", "noise", "epsilon", "std", "error"], rows,
                keep=("metric",))
    if acc["targets"]:
        print_table("accuracy targets at the declared budget", ["target", "predicted", "met"],
                    [[t["description"], _fmt(t["predicted"]), "yes" if t["met"] else
                      f"NO (off by {t['shortfall']:.1%})"] for t in acc["targets"]])
    sol = doc["solution"]
    if sol is not None:
        budget = sol["spec_patch"]["budget"]  # the rounded split the patch writes (solver.rounded_split)
        split = ", ".join(f"{k}: {v:g}" for k, v in budget["split"].items())
        state = "meets every target" if sol["feasible"] else "does NOT meet every target"
        echo_wrapped(f"solved split ({state}): epsilon {budget['epsilon']:g} per interval (basic view), "
                     f"{sol['cost']:.4g} under {sol['accountant']}; split {{{split}}}")
        if sol["limited_by"]:
            echo_wrapped("the least-cost split does not fit the budget: this is the split that fits with the smallest "
                         f"largest shortfall ({sol['max_shortfall']:.1%}), every target missing by at most that",
                         indent=2)
        for t in sol["targets"]:
            if not t["met"]:
                echo_wrapped(f"fails: {t['description']}: predicted {_fmt(t['predicted'])} "
                             f"(off by {t['shortfall']:.1%})", indent=2)
    if sol is not None and sol.get("patch_file"):
        echo_wrapped(f"wrote {sol['patch_file']}: apply with dpops spec apply-patch SPEC {sol['patch_file']}", indent=2)
    h = doc["horizon"]
    echo_wrapped(f"horizon of {h['priced']} on scope {h['scope']} ({doc['ledger']['note']})")
    unit = "ε" if h["cap_unit"] == "epsilon" else "ρ"
    print_table(f"horizon ({h['schedule'] or 'no schedule'}; cap {unit}={_fmt(h['cap'])}, delta {h['delta']:.3g})",
                ["accountant", f"{unit} per interval", f"{unit} after {h['intervals']}", "intervals that fit",
                 "cap reached on"],
                [[r["accountant"], _fmt(r["per_interval"]), _fmt(r["total_after"]),
                  ("more than " if r["more_than"] else "") + _fmt(r["intervals_fit"]), r["cap_reached_on"] or "-"]
                 for r in h["rows"]], keep=("accountant",))
    for r in h["rows"]:
        if r["note"] and r["per_interval"] is None:  # a row the table cannot show: why it is empty
            echo_wrapped(f"{r['accountant']}: {r['note']}", indent=2)
    say("for a reviewer:")
    for line in acc["explain"]:
        echo_wrapped(line, indent=2)


__all__ = ["AccuracyOptions", "run", "parse_values"]
