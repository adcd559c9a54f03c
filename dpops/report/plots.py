"""Matplotlib figures as base64 PNG (Agg backend: no display, no network)."""

from __future__ import annotations

import base64
import io
import math
from typing import Any

from dpops.accounting import get_accountant
from dpops.ledger.model import CHARGED_STATES as CHARGED  # the one owner of the charged states


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def charge_order(run: Any) -> tuple[int, str, str]:
    """The ledger's order of charges: the run's first entry id (two runs committed in the same second keep
    their order; a timestamp would tie them), then its time and id for rows known only from manifests."""
    return (int(getattr(run, "entry_id", 0) or 0), str(run.created_at), str(run.run_id))


def cumulative_series(runs: list[Any], accountant: str, delta: float, key=lambda r: "all") -> dict[str, list[tuple[int, float]]]:
    """Per group (``key(run)``), the composed epsilon after each charged run, in charge order."""
    acct = get_accountant(accountant)
    states: dict[str, Any] = {}
    out: dict[str, list[tuple[int, float]]] = {}
    for i, r in enumerate(runs):
        if r.state not in CHARGED:
            continue
        g = key(r)
        states[g] = acct.add_events(states.get(g, acct.empty_state()), r.events)
        eps = acct.state_epsilon(states[g], delta)
        out.setdefault(g, []).append((i, eps if math.isfinite(eps) else float("nan")))
    return out


def cumulative_plot(data: Any) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = data.scope
    # Cumulative budget is a function of the order of charges, not of the intervals' dates.
    runs = sorted((r for r in data.runs if getattr(r, "kind", "run") == "run"), key=charge_order)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    if s.bucket is None:
        total = cumulative_series(runs, s.accountant, s.delta)
        per_release = cumulative_series(runs, s.accountant, s.delta, key=lambda r: r.release)
        if total:
            xs, ys = zip(*total["all"])
            ax.step(xs, ys, where="post", label="scope total", linewidth=2)
        if len(per_release) > 1:
            for name, pts in sorted(per_release.items()):
                xs, ys = zip(*pts)
                ax.step(xs, ys, where="post", label=f"release {name}", linestyle="--")
        # whole runs on the x axis (never 2.5), labelled with their interval's date when few enough to read
        ax.set_xlabel("run number, in the ledger's order (entry id)")
        idx = [i for i, r in enumerate(runs) if r.state in CHARGED]
        if 0 < len(idx) <= 16:
            ax.set_xticks(idx, [f"{i + 1}: {runs[i].interval_start[:10]}" for i in idx], rotation=45, ha="right",
                          fontsize=7)
        else:
            from matplotlib.ticker import MaxNLocator

            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        per_bucket = cumulative_series(runs, s.accountant, s.delta,
                                       key=lambda r: r.buckets[0] if r.buckets else "?")
        labels = sorted(per_bucket)
        ax.bar(range(len(labels)), [per_bucket[b][-1][1] for b in labels], label=f"per {s.bucket} bucket")
        ax.set_xticks(range(len(labels)), labels, rotation=60, fontsize=7)
        ax.set_xlabel(f"{s.bucket} bucket")
    if s.cap_unit == "epsilon":
        ax.axhline(s.cap, color="red", linestyle=":", label=f"cap eps={s.cap:g}")
    ax.set_ylabel(f"composed epsilon at delta={s.delta:g}")
    ax.set_title(f"scope {s.name}: cumulative epsilon ({s.accountant})")
    ax.legend(fontsize=8)
    return _png(fig)


def per_interval_bars(data: Any) -> list[tuple[str, float, str]]:
    """The per-interval chart's bars in date order: (interval start, ε the run charged, state). A refused or
    refunded run charged nothing and gets a zero-height bar (drawn as a marker on the axis), so the bars add
    up to what the timeline's column adds up to (``RunRow.charged_epsilon``, issue 28 item 4)."""
    return [(r.interval_start, float(r.charged_epsilon), r.state) for r in data.runs
            if getattr(r, "kind", "run") == "run" and r.charged_epsilon is not None]


def per_interval_plot(data: Any) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.0))
    colors = {"committed": "tab:blue", "spent_unpublished": "tab:orange", "reserved": "tab:gray",
              "started": "tab:gray", "released": "tab:green", "refused": "tab:red"}
    bars = per_interval_bars(data)
    for i, (_, eps, state) in enumerate(bars):
        if state in CHARGED:
            ax.bar(i, eps, color=colors.get(state, "black"))
        else:  # nothing charged: a marker on the axis, never a bar a reviewer would add up
            ax.plot(i, 0, marker="x", color=colors.get(state, "black"))
    ax.set_xticks(range(len(bars)), [b[0][:10] for b in bars], rotation=70, fontsize=6)
    ax.set_xlabel("interval start (date order)")
    ax.set_ylabel("epsilon the run charged")
    ax.set_title("per interval (blue committed, orange spent-unpublished; x: refunded green, refused red, "
                 "nothing charged)", fontsize=9)
    return _png(fig)
