"""Recompute every sensitivity in a manifest's release plan from the manifest's own bounds.

The inputs are the manifest's top-level ``privacy_unit.adjacency``,
``contribution_bounds`` and ``value_bounds`` (not the plan's copies), so a
manifest whose summary was edited (say L0 lowered to make the claim look
stronger) fails here even if the plan section was left alone. A metric bounded with its own contribution
bounds (``contribution_bounds.per_metric``, from ``metrics[].contribution``) is recomputed from those: its
vectors were computed on rows bounded by them, so its sensitivity follows from them alone; the plan's copy
(``release_plan.metrics[].contribution``) must agree, and a metric listed there but not in ``per_metric`` (or
the reverse) is a mismatch. The mapping from
a noised vector's name to its query is the documented layout of
``dpops.release_plan`` (mean = normalised sum + count; variance adds the
normalised sum of centred squares over [0, ((hi-lo)/2)^2]).
"""

from __future__ import annotations

import math
from typing import Any

from dpops.events import event_from_dict, event_to_dict
from dpops.noise import sensitivity as S

_TOL = 1e-9


def _bounds(m: dict[str, Any], key: Any = None) -> Any:
    """The contribution bounds of metric ``key`` (its ``per_metric`` entry, else the release's); of the release
    when ``key`` is None."""
    c = m["contribution_bounds"]
    if key is not None:
        c = (c.get("per_metric") or {}).get(key, c)
    return S.ContributionBounds(
        adjacency=m["privacy_unit"]["adjacency"],
        max_partitions=int(c["max_partitions_per_unit"]),
        max_rows_per_partition=int(c["max_rows_per_unit_per_partition"]),
    )


def _query_sensitivity(name: str, b: Any, lohi: list[float] | None) -> Any:
    if name == "count":
        return S.count(b)
    if name == "unit_count":
        return S.unit_count(b)
    if lohi is None:
        raise KeyError(f"value bounds for a {name!r} vector")
    lo, hi = lohi
    if name == "sum":
        return S.sum_(b, lo, hi)
    if name == "normalized_sum":
        return S.normalized_sum(b, lo, hi)
    if name == "normalized_sum_squares":
        half = (hi - lo) / 2.0
        return S.normalized_sum(b, 0.0, half * half)
    raise KeyError(f"unknown noised vector {name!r}")


def _ne(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return not math.isclose(float(a), float(b), rel_tol=_TOL, abs_tol=1e-12)
    return a != b


def _check_coordinate_event(vw: str, ev: dict, v: dict, s, r: float, integer: bool) -> list[str]:
    """A vector charged as ``count`` compositions of its scalar noise: the count is the vector's max_coords, the
    inner event is its noise (sigma = the vector's scale, its grid, one coordinate) at the per-coordinate lattice
    sensitivity the bounds give (``dpops.release_plan.coordinate_lattice``)."""
    from dpops.release_plan import coordinate_lattice

    out: list[str] = []
    inner = ev["event"]
    want = {"kind": "discrete_gaussian", "sigma": v["scale"], "resolution": r, "max_coords": 1,
            "l2_sensitivity": coordinate_lattice(s.linf, integer, r) * r}
    for k, val in want.items():
        if _ne(inner.get(k), val):
            out.append(f"{vw}.event.event.{k}: {inner.get(k)!r}, the vector's noise and bounds give {val!r}")
    if _ne(ev.get("count"), int(s.max_coords)):
        out.append(f"{vw}.event.count: {ev.get('count')!r}, the bounds give max_coords {int(s.max_coords)}")
    return out


def recompute_sensitivities(m: dict[str, Any]) -> list[str]:
    """Recompute every vector's sensitivity from the manifest's own contribution bounds; one problem per mismatch.

    A manifest whose noise was calibrated to a sensitivity below what its bounds give would under-protect:
    this check needs nothing but the manifest.
    """
    out: list[str] = []
    release_b = _bounds(m)
    plan = m["release_plan"]
    per_metric = m["contribution_bounds"].get("per_metric") or {}
    for i, metric in enumerate(plan.get("metrics", [])):
        where = f"release_plan.metrics[{i}]"
        key = metric.get("key")
        b = _bounds(m, key)
        count_s = S.count(b)
        own = per_metric.get(key)
        if metric.get("contribution") != own:
            out.append(f"{where}.contribution: {metric.get('contribution')!r}, but contribution_bounds.per_metric"
                       f".{key} is {own!r} (absent: the release's bounds)")
        lohi = m["value_bounds"].get(key)
        if metric.get("bounds") is not None and lohi is not None and _ne(list(metric["bounds"]), list(lohi)):
            out.append(f"{where}.bounds: {metric['bounds']} but value_bounds.{key} says {lohi}")
        for j, v in enumerate(metric.get("vectors") or []):
            vw = f"{where}.vectors[{j}]"
            s = _query_sensitivity(v["name"], b, lohi)
            want = {"l1": s.l1, "l2": s.l2, "linf": s.linf, "max_coords": s.max_coords}
            for k, val in want.items():
                if _ne(v["sensitivity"].get(k), val):
                    out.append(f"{vw}.sensitivity.{k}: manifest says {v['sensitivity'].get(k)!r}, the bounds "
                               f"({m['privacy_unit']['adjacency']}, L0={b.max_partitions}, "
                               f"Linf={b.max_rows_per_partition}"
                               f"{', values ' + str(lohi) if lohi else ''}) give {val!r}")
            # The charged sensitivity includes the rounding charge: r*ceil(raw/r + m) (L1) or r*ceil(raw/r +
            # sqrt(m)) (L2), never less than raw + r*m; recomputed with the mechanisms' own formula (an
            # estimated bound such as 2**(j/4) makes raw/r a non-integer, where raw + r*m would be short).
            from dpops.noise.mechanisms import RESOLUTION_BITS, charged_sensitivity

            r, mc = float(v["resolution"]), int(s.max_coords)
            integer = v["mechanism"].startswith("integer_")
            for norm, raw, extra in (("l1", s.l1, r * mc), ("l2", s.l2, r * math.sqrt(mc))):
                charged = v.get(f"{norm}_sensitivity_charged")
                if charged is None:
                    continue
                # a pld/1-calibrated plan may put one coordinate on a coarser grid; the plan records its bits
                # (and the plan check recomputes the whole plan from the spec, so they cannot be chosen freely)
                bits = int(v.get("resolution_bits", RESOLUTION_BITS))
                expect = raw if integer else charged_sensitivity(raw, False, mc, norm, bits)
                if _ne(charged, expect):
                    out.append(f"{vw}.{norm}_sensitivity_charged: manifest says {charged!r}, expected {expect!r} "
                               f"(raw {raw!r}{'' if integer else f' + rounding {extra!r}, up to the grid {r!r}'})")
            ev = event_to_dict(event_from_dict(v["event"]))
            if ev["kind"] == "self_composed":
                # a pld/1-calibrated vector charged per coordinate (dpops.release_plan.coordinate_event)
                out.extend(_check_coordinate_event(vw, ev, v, s, r, integer))
                continue
            scale_field = "scale" if "scale" in ev else "sigma"
            if _ne(ev.get(scale_field), v["scale"]):
                out.append(f"{vw}.event.{scale_field}: {ev.get(scale_field)!r} differs from the vector's "
                           f"scale {v['scale']!r}")
            sens_field = "l1_sensitivity" if "l1_sensitivity" in ev else "l2_sensitivity"
            charged = v.get(f"{sens_field[:2]}_sensitivity_charged")
            if charged is not None and _ne(ev.get(sens_field), charged):
                out.append(f"{vw}.event.{sens_field}: {ev.get(sens_field)!r} differs from the charged {charged!r}")
        if metric.get("type") == "quantiles":
            if _ne(metric.get("utility_sensitivity"), float(S.quantile_utility(b))):
                out.append(f"{where}.utility_sensitivity: manifest says {metric.get('utility_sensitivity')!r}, "
                           f"the bounds give {float(S.quantile_utility(b))!r}")
            runs = int(count_s.max_coords) * len(metric.get("quantiles", []))
            if metric.get("runs_per_unit") != runs:
                out.append(f"{where}.runs_per_unit: manifest says {metric.get('runs_per_unit')!r}, "
                           f"a unit reaches {runs}")
        elif metric.get("type") == "top_k":
            if _ne(metric.get("utility_sensitivity"), float(count_s.linf)):
                out.append(f"{where}.utility_sensitivity: manifest says {metric.get('utility_sensitivity')!r}, "
                           f"the bounds give {float(count_s.linf)!r}")
            if metric.get("runs_per_unit") != int(count_s.max_coords):
                out.append(f"{where}.runs_per_unit: manifest says {metric.get('runs_per_unit')!r}, "
                           f"a unit reaches {int(count_s.max_coords)} partitions")
    sel = (plan.get("partitions") or {}).get("selection")
    if sel is not None and sel.get("max_partitions_per_unit") != release_b.max_partitions:
        out.append("release_plan.partitions.selection.max_partitions_per_unit: "
                   f"{sel.get('max_partitions_per_unit')!r}, "
                   f"but contribution_bounds.max_partitions_per_unit is {release_b.max_partitions}")
    for key, own in per_metric.items():  # the spec refuses a metric L0 above the release's (dpops.spec)
        if int(own["max_partitions_per_unit"]) > release_b.max_partitions:
            out.append(f"contribution_bounds.per_metric.{key}.max_partitions_per_unit: {own['max_partitions_per_unit']}"
                       f" exceeds the release's {release_b.max_partitions}: partition selection would not cover it")
    return out
