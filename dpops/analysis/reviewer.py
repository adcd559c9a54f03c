"""Plain-language lines for a compliance reviewer: what the guarantee means for THIS unit and adjacency.

Seed 004's reporting section asks a privacy report to state epsilon, delta, adjacency, contribution
limits, accountant and the whole release plan, and to explain what they mean to its audience rather
than hand over a single number: two epsilons are comparable only under the same unit and adjacency
(a small epsilon per row may protect a person less than a larger epsilon for their whole bounded
contribution). ``lines`` says exactly that for one spec, from the spec and its plan alone.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dpops.analysis.accuracy import Prediction
    from dpops.release_plan import ReleasePlan
    from dpops.spec import ReleaseSpec


def lines(spec: ReleaseSpec, plan: ReleasePlan, predictions: list[Prediction] | None = None,
          accountant: str | None = None) -> list[str]:
    """Sentences a reviewer can read, in order: unit, guarantee, contribution, composition, accuracy."""
    u = spec.privacy_unit
    c = spec.contribution
    eps, delta = plan.epsilon, plan.delta
    who = "each row (record-level protection)" if u.record_level else f"{u.description} (column {u.column})"
    out = [f"Protected unit: {who}."]
    if u.adjacency == "add_remove":
        change = "adding or removing all of that unit's data"
    else:
        change = "replacing all of that unit's data with anyone else's"
    bound = f"at most a factor e^{eps:g} = {math.exp(eps):.3g}"
    tail = f", except with probability at most delta = {delta:g}" if delta > 0 else ""
    out.append(f"Guarantee per interval: {change} changes the probability of any published output of one run by "
               f"{bound}{tail}. This holds whatever else an observer knows.")
    if u.record_level:
        out.append("Record-level only: a person with k rows is protected as k units, i.e. up to k times this epsilon.")
    else:
        out.append(f"It covers the unit's whole contribution after bounding: at most {c.max_partitions_per_unit} "
                   f"partition(s) and {c.max_rows_per_unit_per_partition} row(s) per partition; rows beyond these "
                   "bounds are dropped before noise, so a unit with more data is protected by the same epsilon.")
        own = [(m.key, *spec.metric_contribution(m.key)) for m in spec.metrics if m.contribution is not None]
        if own:  # per-metric bounds: each such metric's vectors see the unit's rows bounded by its own bounds
            out.append("Some metrics bound the unit's contribution with their own bounds, charged with the "
                       "sensitivity those give: " + "; ".join(f"{k}: at most {a} partition(s) and {b} row(s) per "
                                                             "partition" for k, a, b in own) + ".")
    if u.period:
        out.append(f"The unit is period-scoped ({u.description}; period: one {u.period}): the same person on "
                   f"another {u.period} is another unit, so the guarantee for a person over many periods composes "
                   "across them.")
    out.append(f"Every run charges scope {spec.budget.scope!r}; the ledger composes all runs on it"
               + (f" with the {accountant} accountant" if accountant else "")
               + " and refuses a run that would pass the scope's cap: the cap, not the per-run epsilon, is the "
               "guarantee over the whole schedule.")
    out.append("An epsilon is comparable with another only under the same unit and adjacency: epsilon for a row is "
               "not epsilon for a person, and an add_remove epsilon is worth 2x under replace adjacency.")
    for p in predictions or []:
        if p.abs_error is not None and p.type in ("count", "unit_count", "sum"):
            out.append(f"Accuracy: each published {p.metric} is within +-{p.abs_error:.4g} of its true value with "
                       f"{p.confidence:.0%} probability (noise std {p.std:.4g}).")
        elif p.type == "partition_selection" and p.units_50 is not None:
            out.append(f"A partition is published only if enough units are in it: about half the time at "
                       f"{p.units_50} units, 95% of the time at {p.units_95} units; smaller ones are usually hidden.")
    return out


__all__ = ["lines"]
