"""What ``dpops simulate`` shows: a plot of predicted against observed figures and a self-contained HTML page.

Pure rendering of the simulation's JSON document (``dpops.release.simulation.Simulation.to_dict``): a matplotlib
(Agg) PNG, and a page with that PNG as a ``data:`` URI, no script and no CDN, every value escaped. Both carry the
not-publishable marker (``dpops.analysis.simulation.MARKER``): the figures are exact functions of a public
sample, never a release.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Mapping, Sequence
from typing import Any

from dpops.analysis.simulation import MARKER


def _rows(doc: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    rows: Sequence[Mapping[str, Any]] = doc.get("rows", [])
    return list(rows)


def plot_png(doc: Mapping[str, Any]) -> bytes:
    """Three panels, one point per (metric, size bucket): std, coverage and keep rate, predicted (x) against
    observed (y), with the diagonal where they agree."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows(doc)
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    panels = (("predicted_std", "observed_std", "std (root mean square error)", True),
              ("predicted_coverage", "observed_coverage", f"coverage of the {doc.get('confidence', 0.95):g} interval",
               False),
              ("predicted_keep", "observed_keep", "keep rate of private partitions", False),
              ("predicted_rank_error", "observed_rank_error", "quantiles: excess rank error (rows)", True))
    for ax, (px, ox, title, log) in zip(axes, panels, strict=True):
        pts = [(r[px], r[ox], f"{r['metric']} {r['bucket']}") for r in rows
               if r.get(px) is not None and r.get(ox) is not None]
        if pts:
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            ax.scatter(xs, ys, s=24)
            lo, hi = min(xs + ys), max(xs + ys)
            if log and lo > 0:
                ax.set_xscale("log")
                ax.set_yscale("log")
            pad = (hi - lo) * 0.05 or abs(hi) * 0.05 or 0.01
            ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], color="grey", lw=1, ls="--")
            for x, y, label in pts[:40]:
                ax.annotate(label, (x, y), fontsize=6, alpha=0.7)
        else:
            ax.text(0.5, 0.5, "nothing to show", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("predicted")
        ax.set_ylabel("observed")
    verdict = "predictions hold" if doc.get("holds") else "predictions do NOT hold"
    fig.suptitle(f"dpops simulate {doc.get('release', '')}: {doc.get('draws')} draws, seed {doc.get('seed')}: "
                 f"{verdict}\n{MARKER}", fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _cell(v: object) -> str:
    if isinstance(v, float):
        return html.escape(f"{v:.4g}")
    return html.escape("" if v is None else str(v))


def _table(rows: Sequence[Mapping[str, Any]], cols: Sequence[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{_cell(r.get(c))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def html_page(doc: Mapping[str, Any], png: bytes) -> str:
    """The page: the marker, the verdict, the table, the checks that failed, the bounding's effect, the plot."""
    src = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
    name = html.escape(str(doc.get("release", "")))
    cols = ["metric", "bucket", "partitions", "observations", "predicted_std", "observed_std", "predicted_coverage",
            "observed_coverage", "predicted_keep", "observed_keep", "predicted_rank_error", "observed_rank_error",
            "bounding_bias", "bounding_relative_bias", "suppressed", "method"]
    checks = [c for c in doc.get("checks", []) if not c.get("passed")]
    check_cols = ["metric", "bucket", "what", "sides", "observed", "predicted", "low", "high"]
    bounding = [{"figure": k, "value": v} for k, v in dict(doc.get("bounding", {})).items()]
    verdict = ("every prediction held within its band" if doc.get("holds")
               else f"{len(checks)} check(s) outside their band")
    return (
        "<!doctype html><html><head><meta charset=\"utf-8\">"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
        "padding:2px 6px;font-size:12px}.warn{color:#a00;font-weight:bold}</style>"
        f"<title>dpops simulate: {name}</title></head><body>"
        f"<h1>Simulating {name}</h1><p class=\"warn\">{html.escape(MARKER)}</p>"
        f"<p>{_cell(doc.get('draws'))} draws, seed {_cell(doc.get('seed'))}, sample {_cell(doc.get('sample'))}, "
        f"{_cell(doc.get('partitions'))} partitions; family-wise false-failure rate {_cell(doc.get('alpha'))}: "
        f"<b>{html.escape(verdict)}</b></p>"
        f"<h2>Predicted against observed</h2>{_table(_rows(doc), cols)}"
        + (f"<h2>Checks outside their band</h2>{_table(checks, check_cols)}" if checks else "")
        + f"<h2>The bounding's effect on the sample</h2>{_table(bounding, ['figure', 'value'])}"
        + (f"<p>not scored: {html.escape(', '.join(doc.get('not_scored', [])))}</p>" if doc.get("not_scored") else "")
        + f"<h2>Plot</h2><img alt=\"predicted against observed\" src=\"{src}\"></body></html>")


__all__ = ["html_page", "plot_png"]
