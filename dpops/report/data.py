"""What the reviewer's report shows, gathered from the ledger and the manifests (public facts only)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpops.accounting import get_accountant, known_accountants
from dpops.errors import IntegrityError, StorageError

CHARGED = ("committed", "spent_unpublished", "started", "reserved")
COMPARED = ("basic", "zcdp", "rdp", "pld")


@dataclass
class RunRow:
    run_id: str
    release: str
    interval_start: str
    interval_end: str
    state: str  # ledger state, or "refused" for a refusal known only from its manifest
    epsilon: float | None
    restates: str | None
    created_at: str
    updated_at: str
    buckets: list[str]
    events: list[Any]
    manifest: str | None = None  # path of the newest manifest of this run
    reason: str | None = None
    key_id: str | None = None
    test_mode: bool = False


@dataclass
class ReportData:
    scope: Any  # ScopeDefinition
    status: Any  # ScopeStatus
    runs: list[RunRow]
    manifests: dict[str, dict[str, Any]]  # path -> manifest
    comparison: dict[str, float | None]
    adjacencies: list[str]
    contribution: list[dict[str, Any]]
    noise: list[dict[str, Any]]
    warnings: list[str] = field(default_factory=list)
    start: str | None = None
    end: str | None = None


def _load_manifests(directory: str | os.PathLike[str] | None, scope: str) -> dict[str, dict[str, Any]]:
    from dpops.manifest.io import read_manifest

    out: dict[str, dict[str, Any]] = {}
    if directory is None:
        return out
    d = Path(directory)
    if not d.is_dir():
        raise StorageError(f"manifest directory {d} does not exist")
    for p in sorted(d.rglob("*.json")):
        try:
            m = read_manifest(p)
        except IntegrityError as exc:
            raise IntegrityError(f"report: {exc}") from None
        if m["spec"]["budget"]["scope"] == scope:
            out[str(p)] = m
    return out


def ci95_halfwidth(vector: dict[str, Any]) -> tuple[float, str]:
    """Half-width of a 95% interval from the vector's public noise parameters (exact per family)."""
    fam_integer = vector["mechanism"].split("_", 1)
    family = fam_integer[1] if len(fam_integer) == 2 else vector["mechanism"]
    try:  # prefer the mechanisms module's own exact computation
        from dpops.mechanisms import NoiseParams

        params = NoiseParams(family=family, integer_valued=fam_integer[0] == "integer",
                             resolution=float(vector["resolution"]), scale=float(vector["scale"]),
                             l1_sensitivity=vector.get("l1_sensitivity_charged"),
                             l2_sensitivity=vector.get("l2_sensitivity_charged"), std=float(vector["std"]))
        return float(params.ci95_halfwidth()), "exact"
    except Exception:  # noqa: BLE001 - any mismatch of constructor: fall back to the closed forms
        pass
    if family == "laplace":  # P(|X| > t) = exp(-t/b) = 0.05
        return float(vector["scale"]) * math.log(20.0), "laplace closed form"
    return 1.959963984540054 * float(vector["std"]), "normal quantile"


def gather(ledger: Any, scope_name: str, manifests_dir: str | os.PathLike[str] | None = None,
           start: str | None = None, end: str | None = None) -> ReportData:
    from dpops.ledger.model import parse_utc

    scope = ledger.scope(scope_name)
    status = ledger.status(scope_name)
    manifests = _load_manifests(manifests_dir, scope_name)
    by_run: dict[str, tuple[str, dict[str, Any]]] = {}
    for path, m in sorted(manifests.items(), key=lambda kv: kv[1]["created_at"]):
        by_run[m["run_id"]] = (path, m)

    lo = parse_utc(start, "--from") if start else None
    hi = parse_utc(end, "--to") if end else None

    def in_window(s: str, e: str) -> bool:
        return (lo is None or parse_utc(s, "interval_start") >= lo) and (hi is None or parse_utc(e, "interval_end") <= hi)

    reasons = {}
    for e in ledger.history(scope_name):
        if e.run_id and e.kind in ("released", "spent_unpublished") and isinstance(e.data, dict):
            reasons[e.run_id] = e.data.get("reason")
    rows: list[RunRow] = []
    seen = set()
    for rec in ledger.runs(scope=scope_name):
        if not in_window(rec.key.interval_start, rec.key.interval_end):
            continue
        path, m = by_run.get(rec.run_id, (None, None))
        rows.append(RunRow(
            run_id=rec.run_id, release=rec.key.release, interval_start=rec.key.interval_start,
            interval_end=rec.key.interval_end, state=rec.state,
            epsilon=rec.epsilon if rec.epsilon is not None and math.isfinite(rec.epsilon) else None,
            restates=rec.restates, created_at=rec.created_at, updated_at=rec.updated_at, buckets=list(rec.buckets),
            events=list(rec.events), manifest=path, reason=reasons.get(rec.run_id), key_id=rec.key.key_id,
            test_mode=bool(m and m["randomness"]["test_mode"])))
        seen.add(rec.run_id)
    # Refusals never reach the ledger (nothing is written): their manifests are the record.
    for run_id, (path, m) in by_run.items():
        if run_id in seen or m["outcome"]["state"] != "refused":
            continue
        k = m["run_key"]
        if not in_window(k["interval_start"], k["interval_end"]):
            continue
        rows.append(RunRow(
            run_id=run_id, release=k["release"], interval_start=k["interval_start"], interval_end=k["interval_end"],
            state="refused", epsilon=m["privacy"]["run"]["epsilon"], restates=(m["restates"] or {}).get("run_id"),
            created_at=m["created_at"], updated_at=m["created_at"], buckets=[], events=[], manifest=path,
            reason=m["outcome"]["reason"], key_id=k["key_id"], test_mode=m["randomness"]["test_mode"]))
    rows.sort(key=lambda r: (r.created_at, r.run_id))

    charged = [e for r in rows if r.state in CHARGED for e in r.events]
    comparison: dict[str, float | None] = {}
    for name in COMPARED:
        refs = [r for r in known_accountants() if r.split("/")[0] == name]
        if not refs:
            continue
        try:
            eps = get_accountant(name).epsilon(charged, scope.delta) if charged else 0.0
        except (ValueError, ZeroDivisionError, OverflowError):
            eps = math.inf
        comparison[get_accountant(name).ref] = eps if math.isfinite(eps) else None

    adjacencies = sorted({m["privacy_unit"]["adjacency"] for m in manifests.values()})
    contribution = []
    seen_c = set()
    noise = []
    seen_plans = set()
    for m in manifests.values():
        c = (m["run_key"]["release"], m["contribution_bounds"]["max_partitions_per_unit"],
             m["contribution_bounds"]["max_rows_per_unit_per_partition"], m["privacy_unit"]["adjacency"])
        if c not in seen_c:
            seen_c.add(c)
            contribution.append({"release": c[0], "max_partitions_per_unit": c[1],
                                 "max_rows_per_unit_per_partition": c[2], "adjacency": c[3],
                                 "value_bounds": m["value_bounds"], "unit": m["privacy_unit"]["description"]})
        if m["spec_hash"] in seen_plans:
            continue
        seen_plans.add(m["spec_hash"])
        for metric in m["release_plan"].get("metrics", []):
            for v in metric.get("vectors") or []:
                half, how = ci95_halfwidth(v)
                noise.append({"release": m["run_key"]["release"], "spec_hash": m["spec_hash"][:12],
                              "metric": metric["key"], "vector": v["name"], "mechanism": v["mechanism"],
                              "std": float(v["std"]), "ci95_width": 2.0 * half, "ci_method": how})
    data = ReportData(scope=scope, status=status, runs=rows, manifests=manifests, comparison=comparison,
                      adjacencies=adjacencies, contribution=contribution, noise=noise, start=start, end=end)
    data.warnings = _warnings(data)
    return data


def _warnings(d: ReportData) -> list[str]:
    out = []
    s = d.scope
    if s.population:
        if s.delta >= 1.0 / s.population:
            out.append(f"delta={s.delta:g} is not below 1/n = {1.0 / s.population:.3g} for the declared population: "
                       "the guarantee is meaningless")
        elif s.delta > 0.1 / s.population:
            out.append(f"delta={s.delta:g} is within a factor 10 of 1/n = {1.0 / s.population:.3g}")
    for m in d.manifests.values():
        n = m["privacy_unit"]["population"]
        if n and m["privacy"]["requested"]["delta"] > 0.1 / n:
            out.append(f"release {m['run_key']['release']}: delta={m['privacy']['requested']['delta']:g} is near 1/n "
                       f"(n={n})")
            break
    if s.cap_unit == "epsilon" and s.cap > 10:
        out.append(f"the scope's cap epsilon={s.cap:g} is above 10: a very weak guarantee")
    big = [r for r in d.runs if r.epsilon is not None and r.epsilon > 10]
    if big:
        out.append(f"{len(big)} run(s) charged epsilon above 10 each (e.g. {big[0].run_id[:12]})")
    if d.status.total is not None and d.status.unit == "epsilon" and d.status.total > 10:
        out.append(f"the scope's composed epsilon is {d.status.total:.3g}, above 10")
    tests = [r for r in d.runs if r.test_mode]
    if tests:
        out.append(f"{len(tests)} test-mode run(s) (seeded noise, never publishable): "
                   + ", ".join(r.run_id[:12] for r in tests[:5]))
    last_key: dict[str, str] = {}
    for r in d.runs:
        if r.key_id and r.release in last_key and last_key[r.release] != r.key_id:
            out.append(f"release {r.release}: the noise key changed from {last_key[r.release]} to {r.key_id} "
                       f"at run {r.run_id[:12]} ({r.interval_start})")
        if r.key_id:
            last_key[r.release] = r.key_id
    return out
