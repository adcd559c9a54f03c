"""What ``dpops tune`` writes: the recommendation as a spec patch (YAML) and an HTML page with plots.

The page is self-contained: matplotlib (Agg backend) PNGs embedded as ``data:`` URIs, no script and
no CDN, so it opens offline and loads nothing from anywhere. Every value in it is escaped. Plots:
error against L0 and against the value bound (the recommended candidate's other settings held), and
the expected number of partitions kept per candidate.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from dpops.analysis.tuning import TuneResult

PATCH_SCHEMA = "dpops.tune-patch/1"
# The solver's patch (``Solution.patch_document``): named here, beside the reader that accepts every patch kind,
# so that the solver imports this module (``dump_patch``) and this module never imports the solver.
SOLVE_PATCH_SCHEMA = "dpops.solve-patch/1"


def patch_document(result: TuneResult, provenance: Mapping[str, Any]) -> dict[str, Any]:
    """``{"patch": <spec patch>, "tuning": <what tune found>}``; apply it with ``apply_patch_document``
    (``dpops spec apply-patch``): lists replace, mappings merge, and ``patch.tuning`` -- the spec's
    ``tuning`` block, where the bounds came from -- replaces any earlier one whole. The top-level
    ``tuning`` adds what only the operator should see (loss value, sample rows): never copied into a spec."""
    from dpops.analysis.tuning import spec_patch

    best = result.candidates[result.best]
    patch = spec_patch(result.spec, result.recommended)
    patch["tuning"] = {"candidate": result.recommended.label, "loss": result.loss, "candidates": len(result.grid),
                       "not_evaluated": list(result.not_evaluated), "data": dict(provenance)}
    return {
        "schema": PATCH_SCHEMA,
        "spec": result.spec.name,
        "patch": patch,
        "tuning": {"candidate": result.recommended.label, "loss": result.loss, "loss_value": _finite(best["loss"]),
                   "candidates": len(result.grid), "sample_rows": result.sample_rows,
                   "not_evaluated": list(result.not_evaluated), "data": dict(provenance)},
    }


class _NoAliasDumper(yaml.SafeDumper):
    """A safe dumper that writes a value seen twice twice, never as an ``&id001`` anchor and ``*id001`` alias: a
    patch is read and edited by people, who should see every value where it applies."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_patch(doc: Mapping[str, Any]) -> str:
    """A patch document (tune's, estimate's, solve's) as YAML: keys in order, no anchors."""
    return yaml.dump(dict(doc), Dumper=_NoAliasDumper, sort_keys=False, allow_unicode=True)


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def patch_yaml(result: TuneResult, provenance: Mapping[str, Any]) -> str:
    """``patch_document`` as YAML, headed by comments that say it is not DP and, for private data, when."""
    doc = patch_document(result, provenance)
    head = "# dpops tune recommendation (not differentially private: computed from the sample's exact rows)\n"
    if provenance.get("source") == "private":
        head += f"# {provenance.get('statement')} (ledger entry {provenance.get('ledger_entry')})\n"
    return head + dump_patch(doc)


def _source(block: Any) -> str | None:
    data = block.get("data") if isinstance(block, Mapping) else None
    return str(data.get("source")) if isinstance(data, Mapping) and data.get("source") is not None else None


def provenance_downgrade(current: Any, new: Any) -> str | None:
    """Why a tune patch whose ``tuning`` block is ``new`` may not replace the spec's ``current`` one (None: it may).

    Issue 25 item 7b. A spec whose parameters were chosen by looking at private data (``tuning.data.source:
    private``, its ledger entry) keeps that record: a later tune on a public sample cannot replace it with
    "chosen on a public sample". Privacy reason: that tune starts from the privately chosen values (its
    default grid is built around the spec's values, and a one-candidate grid can be exactly them), so its
    recommendation is not a function of public data alone, and a reviewer would be told it is. A private
    tune may replace a public record (the more conservative statement), or a private one (a new read, with
    its own ledger entry; the earlier entry stays in the ledger)."""
    if _source(current) == "private" and _source(new) != "private":
        data = current.get("data") if isinstance(current, Mapping) else {}
        entry = data.get("ledger_entry") if isinstance(data, Mapping) else None
        return (f"the spec's parameters were chosen by looking at private data (tuning.data.source: private, "
                f"ledger entry {entry}); a tune whose data is {_source(new) or 'not stated'} cannot replace that "
                "record, since its candidates start from the privately chosen values. Keep the spec as it is, or "
                "tune again with the private flag (a new private_access entry)")
    return None


def apply_patch_document(spec_doc: Mapping[str, Any], patch_doc: Any, *, source: str = "patch") -> dict[str, Any]:
    """``spec_doc`` (a spec as written, e.g. its YAML) with a ``patch_document`` (or the ``dpops estimate``
    patch document, ``dpops.analysis.estimate.patch_document``) applied.

    Refuses (``SpecError``, naming ``source``) a document that is not a tune patch or was made for another
    release, and a public tune patch over a spec tuned on private data (``provenance_downgrade``). ``tuning``
    is replaced whole, not merged: a block from a private read must not keep the sample of an earlier public
    one. The result is not validated here
    (``dpops.spec.parse_spec`` does that)."""
    from dpops.analysis.estimate import PATCH_SCHEMA as ESTIMATE_PATCH_SCHEMA
    from dpops.analysis.tuning import apply_patch
    from dpops.errors import SpecError

    schema = patch_doc.get("schema") if isinstance(patch_doc, Mapping) else None
    if schema not in (PATCH_SCHEMA, ESTIMATE_PATCH_SCHEMA, SOLVE_PATCH_SCHEMA):
        raise SpecError(f"{source}: not a dpops tune patch (schema {PATCH_SCHEMA!r}), estimate patch (schema "
                        f"{ESTIMATE_PATCH_SCHEMA!r}) or solve patch (schema {SOLVE_PATCH_SCHEMA!r}); use the patch "
                        "file that dpops tune, dpops estimate or dpops plan --solve --out wrote")
    assert isinstance(patch_doc, Mapping)
    if patch_doc.get("spec") != spec_doc.get("name"):
        raise SpecError(f"{source}: the patch was made for release {patch_doc.get('spec')!r}, this spec is "
                        f"{spec_doc.get('name')!r}")
    patch = patch_doc.get("patch")
    if not isinstance(patch, Mapping):
        raise SpecError(f"{source}: 'patch' must be a mapping of spec sections")
    if schema == SOLVE_PATCH_SCHEMA:
        # A data-free budget split: only budget.epsilon and budget.split may change (no bounds, no provenance).
        budget = patch.get("budget")
        if set(patch) != {"budget"} or not isinstance(budget, Mapping) or not set(budget) <= {"epsilon", "split"}:
            raise SpecError(f"{source}: a solve patch changes budget.epsilon and budget.split only; this one "
                            f"names {sorted(patch)}: write it again with dpops plan --solve --out")
        return apply_patch(dict(spec_doc), patch)
    if schema == ESTIMATE_PATCH_SCHEMA:
        # A private estimation's bounds and ``estimated_from``; a ``tuning`` block for the parameters the
        # estimation did not set stays (it is provenance, and the estimation names itself).
        return apply_patch(dict(spec_doc), patch)
    problem = provenance_downgrade(spec_doc.get("tuning"), patch.get("tuning"))
    if problem:
        raise SpecError(f"{source}: {problem}; the spec was not changed")
    rest = {k: v for k, v in patch.items() if k != "tuning"}
    out = apply_patch({k: v for k, v in spec_doc.items() if k != "tuning"}, rest)
    if "tuning" in patch:
        out["tuning"] = patch["tuning"]
    return out


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _plots(result: TuneResult) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")  # no display, no GUI toolkit
    import matplotlib.pyplot as plt

    best = result.recommended
    out: list[tuple[str, str]] = []
    cs = result.candidates
    # error against L0 (Linf, bounds, split as recommended)
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    pts = sorted((c["l0"], c["mean_relative_rmse"]) for c, g in zip(cs, result.grid, strict=True)
                 if g.linf == best.linf and g.bounds == best.bounds and g.split == best.split)
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
    ax.set_xlabel("L0 (max partitions per unit)")
    ax.set_ylabel("mean relative RMSE")
    ax.set_title(f"error vs L0 (Linf={best.linf})")
    out.append(("Error against L0", _png(fig)))
    plt.close(fig)
    # error against the value bound, per bounded column
    spec_bounds = result.spec.declared_value_bounds()
    cols = sorted({c for g in result.grid for c, _, _ in g.bounds})
    for col in cols:
        fig, ax = plt.subplots(figsize=(5.5, 3.2))
        pts2 = []
        for c, g in zip(cs, result.grid, strict=True):
            if g.l0 == best.l0 and g.linf == best.linf and g.split == best.split:
                hi = dict((k, h) for k, _, h in g.bounds).get(col, spec_bounds[col][1])
                pts2.append((hi, c["mean_relative_rmse"]))
        pts2.sort()
        ax.plot([p[0] for p in pts2], [p[1] for p in pts2], marker="o")
        ax.set_xlabel(f"upper bound of {col}")
        ax.set_ylabel("mean relative RMSE")
        ax.set_title(f"error vs value bound ({col})")
        out.append((f"Error against the bound of {col}", _png(fig)))
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    ax.bar(range(len(cs)), [c["expected_partitions_kept"] for c in cs],
           color=["C1" if i == result.best else "C0" for i in range(len(cs))])
    ax.set_xlabel("candidate (#; recommended in orange)")
    ax.set_ylabel("expected partitions kept")
    ax.set_title(f"partitions kept (of {cs[0]['partitions'] if cs else 0} in the sample)")
    out.append(("Partitions kept", _png(fig)))
    plt.close(fig)
    return out


def _table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return html.escape(f"{v:.4g}")
        return html.escape("" if v is None else str(v))

    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{cell(r.get(c))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def html_page(result: TuneResult, provenance: Mapping[str, Any]) -> str:
    """The page as one string (no external resource)."""
    warn = ("Computed from the sample's exact rows: NOT differentially private. "
            + (str(provenance.get("statement", "")) + "." if provenance.get("source") == "private"
               else "The sample was read from the operator's public roots."))
    plots = "".join(f"<h2>{html.escape(t)}</h2><img alt=\"{html.escape(t)}\" src=\"{src}\">"
                    for t, src in _plots(result))
    ccols = ["candidate", "loss", "mean_relative_rmse", "max_relative_rmse", "target_ratio", "rows_dropped_l0",
             "rows_dropped_linf", "units_dropped_l0", "units_dropped_linf", "expected_partitions_kept"]
    best_rows = [r for r in result.rows if r["candidate"] == result.recommended.label]
    rcols = ["metric", "quantity", "bucket", "partitions", "noise_std", "noise_value_error", "rank_error_fraction",
             "bias_bounding", "bias_clipping", "rmse", "relative_rmse", "top_pick_probability",
             "top_changed_by_bounding", "expected_partitions_kept"]
    ne = ", ".join(result.not_evaluated) or "none"
    return (
        "<!doctype html><html><head><meta charset=\"utf-8\">"
        "<meta http-equiv=\"Content-Security-Policy\" "
        "content=\"default-src 'none'; img-src data:; style-src 'unsafe-inline'\">"
        f"<title>dpops tune: {html.escape(result.spec.name)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;font-size:90%}"
        "td,th{border:1px solid #ccc;padding:2px 6px}.warn{background:#fee;padding:.5em}</style></head><body>"
        f"<h1>Tuning {html.escape(result.spec.name)}</h1><p class=\"warn\">{html.escape(warn)}</p>"
        f"<p>Recommended: <b>{html.escape(result.recommended.label)}</b> (loss {html.escape(result.loss)}); "
        f"{len(result.grid)} candidates, {result.sample_rows} rows, {result.boundings} bounding passes. "
        f"Not evaluated: {html.escape(ne)}.</p>{plots}"
        f"<h2>Candidates</h2>{_table(result.candidates, ccols)}"
        f"<h2>Recommended candidate by metric and partition size (true units)</h2>{_table(best_rows, rcols)}"
        "</body></html>")


__all__ = ["PATCH_SCHEMA", "patch_document", "patch_yaml", "dump_patch", "apply_patch_document", "provenance_downgrade",
           "html_page"]
