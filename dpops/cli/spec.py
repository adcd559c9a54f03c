"""``dpops spec check FILE [--json]``: validate a release spec and show what it would spend.

Exit 3 on an invalid spec (the error names the file and the field).
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import click

from dpops.cli.common import HelpGroup, key_file_option, say


def _plan_summary(spec: Any) -> tuple[dict[str, Any] | None, str | None, Any]:
    try:
        from dpops.release_plan import plan_release

        plan = plan_release(spec)
    except ImportError as exc:  # the plan module or one of its mechanism modules is missing
        return None, f"the release plan is unavailable ({exc}): no mechanism details", None
    return plan.describe(), None, plan


ESTIMATED_AT_RUN_TIME = "estimated at run time"


def _metric_summary(spec: Any, m: Any) -> dict[str, Any]:
    """One metric of the summary. ``bounds: estimate``: the bounds are not known before the run (``bounds``
    null, ``bounds_estimated`` says so, with the estimation's share and the fallback the plan predicts at)."""
    out: dict[str, Any] = {"key": m.key, "type": m.type, "column": getattr(m, "column", None),
                           "bounds": list(getattr(m, "bounds", ()) or ()) or None}
    if getattr(m, "estimates_bounds", False):
        out["bounds"] = None
        out["bounds_estimated"] = {"note": ESTIMATED_AT_RUN_TIME, "fallback_bounds": list(m.fallback_bounds),
                                   "estimation_epsilon": spec.estimation_epsilon(),
                                   "share_key": f"{m.key}.bounds"}
    return out


def summary(spec: Any) -> dict[str, Any]:
    """What ``spec check`` prints. ``epsilon_split`` includes each ``<key>.bounds`` share (the weights of the
    split over all weights: the interval's total is ``budget.epsilon``)."""
    weights = dict(spec.split_weights())
    for k in spec.estimated_metric_keys:
        weights[f"{k}.bounds"] = float((spec.budget.split or {})[f"{k}.bounds"])
    total = sum(weights.values())
    b = spec.budget
    # only when named: the summary of a spec without budget.accountant stays what it was
    calibrated = {"accountant": b.accountant} if b.accountant is not None else {}
    return {
        **calibrated,
        "file": spec.source,
        "release": spec.name,
        "spec_hash": spec.spec_hash,
        "privacy_unit": spec.privacy_unit.model_dump(mode="json"),
        "contribution": spec.contribution.model_dump(mode="json"),
        "scope": b.scope,
        "epsilon": b.epsilon,
        "delta": b.delta,
        "noise": b.noise,
        "partitions": {
            "columns": spec.partitions.columns,
            "strategy": "public" if spec.partitions.is_public else spec.partitions.private.strategy,
            "public_count": len(spec.public_partitions() or []) if spec.partitions.is_public else None,
        },
        # The basic-composition view of the split; the plan below is authoritative.
        "epsilon_split": {k: b.epsilon * w / total for k, w in weights.items()},
        "metrics": [_metric_summary(spec, m) for m in spec.metrics],
        "output_root": str(spec.output_root),
    }


@click.group("spec", cls=HelpGroup)
def cli() -> None:
    """Release specs: validate them and see what they would spend."""


def _check_scope(spec: Any, check: Any, problems: list[str]) -> str | None:
    """Check ``budget.scope`` against the ledger when one is configured ($DPOPS_LEDGER_URL); a warning
    (returned) when none is set or it cannot be read: spec check must work offline."""
    from dpops.cli.common import ledger_url
    from dpops.errors import LedgerError, SpecError
    from dpops.ledger import open_ledger

    try:
        url = ledger_url(required=False)
        if url is None:
            return "budget.scope not checked: no ledger configured ($DPOPS_LEDGER_URL)"
        with open_ledger(url) as led:
            names = [s.name for s in led.scopes()]
    except LedgerError as exc:
        return f"budget.scope not checked: the ledger cannot be read ({exc})"
    try:
        check(spec, names)
    except SpecError as exc:
        problems.append(str(exc))
    return None


@cli.command("check")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="print the summary as JSON")
@key_file_option("the spec's files must not be it or beside it")
@click.option("--require-targets", is_flag=True,
              help="exit 3 if the declared budget does not meet one of the spec's accuracy targets (for CI)")
def check_cmd(file: str, as_json: bool, key_file: str | None, require_targets: bool) -> None:
    """Validate FILE; print the metrics, the epsilon/delta split, each mechanism's sensitivity and the
    predicted accuracy (noise, std, exact 95% interval; each accuracy target met or not).

    The spec's input files must resolve under the data roots ($DPOPS_DATA_ROOTS, default the spec's
    directory), its public file under the public roots ($DPOPS_PUBLIC_ROOTS, never under a data root), and
    both away from the noise key (see dpops.dataroots)."""
    from dpops.errors import SpecError
    from dpops.spec import check_spec_paths, check_spec_scope, load_spec

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = load_spec(file)  # every structural problem at once; the checks below need a parsed spec
    problems: list[str] = []
    scope_note = _check_scope(spec, check_spec_scope, problems)
    try:
        check_spec_paths(spec, key_file)
    except SpecError as exc:
        problems.append(str(exc))
    if problems:  # the files and the scope together: one run of spec check lists all that is wrong
        raise SpecError("\n".join(problems))
    doc = summary(spec)
    plan, note, plan_obj = _plan_summary(spec)
    doc["plan"] = plan
    doc["warnings"] = [str(w.message) for w in caught] + ([note] if note else []) + ([scope_note] if scope_note else [])
    doc["accuracy"] = _accuracy(spec, plan_obj)
    unmet = [t for t in (doc["accuracy"] or {}).get("targets", []) if not t["met"]]
    err = None
    if require_targets and unmet:
        err = SpecError(f"{spec.source}: the declared budget does not meet {len(unmet)} accuracy target(s): "
                        + "; ".join(f"{t['description']} (predicted {t['predicted']:.4g})" for t in unmet)
                        + "; run dpops plan --solve for a split that does")
    if as_json:
        from dpops.cli.common import attach, echo_ok

        if err is not None:
            raise attach(err, doc)
        echo_ok(doc)
        return
    u = spec.privacy_unit
    say(f"{doc['file']}: valid release spec {spec.name!r} (spec hash {spec.spec_hash[:16]})")
    say(f"  unit: {u.column} ({u.description}), adjacency {u.adjacency}"
               f"{', record level' if u.record_level else ''}{', per ' + u.period if u.period else ''}")
    c = spec.contribution
    say(f"  contribution: at most {c.max_partitions_per_unit} partition(s) per unit, "
               f"{c.max_rows_per_unit_per_partition} row(s) per unit and partition")
    for m in spec.metrics:
        if m.contribution is not None:
            l0, linf = spec.metric_contribution(m.key)
            say(f"    {m.key}: its own bounds, at most {l0} partition(s) per unit, {linf} row(s) per unit and partition")
    p = doc["partitions"]
    say(f"  partitions by {', '.join(p['columns'])}: {p['strategy']}"
               + (f" ({p['public_count']} listed)" if p["public_count"] is not None else ""))
    say(f"  budget: scope {doc['scope']}, epsilon {doc['epsilon']}, delta {doc['delta']}, {doc['noise']} noise"
               + (f"; Gaussian noise calibrated so that {doc['accountant']} composes the run to epsilon "
                  f"{doc['epsilon']} (the scope must use {doc['accountant']})" if doc.get("accountant") else ""))
    for m in doc["metrics"]:
        extra = f" of {m['column']}" if m["column"] else ""
        extra += f" in [{m['bounds'][0]}, {m['bounds'][1]}]" if m["bounds"] else ""
        say(f"  - {m['key']}: {m['type']}{extra}, epsilon share {doc['epsilon_split'][m['key']]:.4g}")
        est = m.get("bounds_estimated")
        if est is not None:
            lo, hi = est["fallback_bounds"]
            say(f"      bounds {ESTIMATED_AT_RUN_TIME} (DP estimation, epsilon share "
                       f"{doc['epsilon_split'][est['share_key']]:.4g} of the estimation's "
                       f"{est['estimation_epsilon']:.4g}); the plan below is at the fallback bounds [{lo}, {hi}]")
    if "partition_selection" in doc["epsilon_split"]:
        say(f"  - partition selection: epsilon share {doc['epsilon_split']['partition_selection']:.4g}")
    if plan is not None:
        say("  plan (from dpops.release_plan; --json for every parameter):")
        for m in plan.get("metrics", []):
            say(f"  - {m.get('key')}: epsilon {m.get('epsilon_share', 0):.4g}, delta {m.get('delta_share', 0):.3g}")
            for v in m.get("vectors", []) or []:
                sens = v.get("sensitivity") or {}
                say(f"      {v.get('name')}: {v.get('mechanism')} std {v.get('std', float('nan')):.4g}, "
                           f"sensitivity L1 {sens.get('l1')} L2 {sens.get('l2', 0):.4g}"
                           + (f", charged L1 {v['l1_sensitivity_charged']:.6g}" if v.get("l1_sensitivity_charged") else "")
                           + (f", charged L2 {v['l2_sensitivity_charged']:.6g}" if v.get("l2_sensitivity_charged") else ""))
        ps = (plan.get("partitions") or {}).get("selection") if isinstance(plan.get("partitions"), dict) else None
        if ps:
            say(f"  - partition selection: {json.dumps(ps, sort_keys=True, default=str)}")
        say(f"  privacy events reserved per run: {len(plan.get('events', []))}")
    acc = doc["accuracy"]
    if acc is not None:
        say(f"  predicted accuracy ({acc['confidence']:.0%}, partitions of {acc['at_units']} units; "
                   "dpops plan for the full view):")
        for p in acc["predictions"]:
            say(f"  - {p['metric']} {p['quantity']}: {_prediction_text(p)}")
        for t in acc["targets"]:
            say(f"  target {'met' if t['met'] else 'NOT MET'}: {t['description']}: predicted "
                       f"{t['predicted']:.4g}" + ("" if t["met"] else f" (off by {t['shortfall']:.1%})"))
    for w in doc["warnings"]:
        say(f"  warning: {w}")
    if err is not None:
        raise err


def _accuracy(spec: Any, plan: Any) -> dict[str, Any] | None:
    """The predicted accuracy of the spec's plan (``dpops.analysis.document``; no data, no charge);
    None when there is no real ``ReleasePlan`` to predict from (the plan module is unavailable)."""
    from dpops.analysis.document import accuracy_document
    from dpops.release_plan import ReleasePlan

    if not isinstance(plan, ReleasePlan):
        return None
    conf = float(spec.accuracy.confidence) if spec.accuracy is not None else 0.95
    doc = accuracy_document(spec, plan, confidence=conf)
    doc.pop("explain")  # the reviewer's lines belong to dpops plan and the report
    return doc


def _prediction_text(p: dict[str, Any]) -> str:
    if p["type"] == "quantiles":
        return (f"expected rank error {p['expected_rank_error']:.4g} rows for dense data (at most "
                f"{p['rank_error_bound']:.4g} for any data), {p['distribution']}")
    if p["type"] == "top_k":
        return f"P(true top first | lead {p['gap']}) = {p['probability']:.3g}, {p['distribution']}"
    if p["type"] == "partition_selection":
        return (f"{p['distribution']}: P(keep | {p['at_units']} units) = {p['probability']:.3g}, 50% at "
                f"{p['units_50']} units, 95% at {p['units_95']}")
    rel = f" ({p['rel_error']:.3g} of {p['at_value']:.4g})" if p["rel_error"] is not None else ""
    return f"{p['distribution']}, std {p['std']:.4g}, +-{p['abs_error']:.4g}{rel} ({p['method']})"


@cli.command("apply-patch")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.argument("patch_path", metavar="PATCH", type=click.Path(exists=True, dir_okay=False))
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default=None,
              help="where to write the patched spec (default FILE's stem + .tuned.yaml, .estimated.yaml for an "
                   "estimate patch or .solved.yaml for a plan --solve patch, beside FILE; never overwritten)")
@click.option("--json", "as_json", is_flag=True, help="print the written file as JSON")
def apply_patch_cmd(file: str, patch_path: str, out_path: str | None, as_json: bool) -> None:
    """Apply the patch.yaml of `dpops tune` (the recommended bounds, and the spec's `tuning` block saying where
    they came from), of `dpops estimate` (the estimated bounds and `estimated_from`) or of `dpops plan --solve
    --out` (budget.epsilon and budget.split) to FILE. Writes a new, validated spec."""
    from pathlib import Path

    import yaml

    from dpops.analysis.tune_output import apply_patch_document
    from dpops.errors import SpecError
    from dpops.spec import parse_spec, read_spec_document

    src = Path(file)
    try:
        patch_doc = yaml.safe_load(Path(patch_path).read_text(encoding="utf-8"))
    except yaml.YAMLError:
        raise SpecError(f"{patch_path}: not valid YAML; use the patch.yaml that dpops tune or dpops estimate "
                        "wrote") from None
    from dpops.analysis.estimate import PATCH_SCHEMA as ESTIMATE_PATCH_SCHEMA
    from dpops.analysis.solver import PATCH_SCHEMA as SOLVE_PATCH_SCHEMA

    schema = patch_doc.get("schema") if isinstance(patch_doc, dict) else None
    suffix = {ESTIMATE_PATCH_SCHEMA: ".estimated.yaml", SOLVE_PATCH_SCHEMA: ".solved.yaml"}.get(schema, ".tuned.yaml")
    out = Path(out_path) if out_path else src.with_name(src.stem + suffix)
    if out.resolve().parent != src.resolve().parent:
        raise SpecError(f"--out {out}: write the patched spec beside {src} (its relative paths start there)")
    if out.exists():
        raise SpecError(f"--out {out}: already exists; a patched spec is written to a new file, never over one")
    doc = read_spec_document(src)
    if not isinstance(doc, dict):
        raise SpecError(f"{src}: a release spec is a YAML mapping")
    patched = apply_patch_document(doc, patch_doc, source=patch_path)
    spec = parse_spec(patched, source=out.name, base_dir=out.resolve().parent)  # refuses an invalid result
    from dpops.analysis.tune_output import dump_patch

    out.write_text(dump_patch(patched), encoding="utf-8")  # no YAML anchors: every value where it applies
    statement = spec.tuning.statement if spec.tuning is not None else None
    if as_json:
        from dpops.cli.common import echo_ok

        echo_ok({"spec": file, "patch": patch_path, "written": str(out), "spec_hash": spec.spec_hash,
                 "tuning": statement})
        return
    say(f"wrote {out} (spec hash {spec.spec_hash})")
    if statement:
        say(f"its releases will say: {statement}")


@cli.command("reference")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default=None,
              help="write the page here (docs/spec.md in the repository) instead of printing it")
def reference_cmd(out_path: str | None) -> None:
    """Print the spec reference page (every key, type, default, constraint and what it changes), generated
    from the spec models: the repository's docs/spec.md is this output."""
    from dpops.spec_reference import render

    text = render() + "\n"
    if out_path is None:
        click.echo(text, nl=False)
        return
    with open(out_path, "w", encoding="utf-8") as fh:
        fh.write(text)
    say(f"wrote {out_path}")


@cli.command("synth")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--from", "start", required=True, help="first interval start (ISO-8601, UTC)")
@click.option("--to", "end", required=True, help="end, exclusive: intervals starting before it")
@click.option("--rows", type=int, default=2000, show_default=True, help="rows per interval file")
@click.option("--users", type=int, default=300, show_default=True, help="distinct units")
@click.option("--partitions", type=int, default=8, show_default=True,
              help="values per partition column when the spec does not list public partitions")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print the written files as JSON")
def synth_cmd(file: str, start: str, end: str, rows: int, users: int, partitions: int, seed: int,
              as_json: bool) -> None:
    """Write SYNTHETIC input (never real data) for FILE's intervals in [--from, --to), where the spec's
    input.path says, with its declared columns, public partitions and metric bounds (dpops.testing.synthetic)."""
    from dpops.testing.synthetic import generate_for_spec

    paths = generate_for_spec(file, start, end, n_rows=rows, n_users=users, n_partitions=partitions, seed=seed)
    if as_json:
        from dpops.cli.common import echo_ok

        echo_ok({"spec": file, "files": paths})
    else:
        for p in paths:
            say(f"wrote synthetic input {p}")
