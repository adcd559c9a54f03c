"""The built-in mechanism suite behind ``dpops audit mechanisms``: one small release per mechanism.

Each entry is a real release spec (validated by ``dpops.spec.parse_spec``) with a single metric,
so the audit exercises the same planning (``plan_release``), row checks, bounding, noise and
selection code as a production run. The claimed ε of each is 1: large enough that a factor-2
bug (true ε = 2) is far outside the Clopper–Pearson noise at CI trial counts (see docs/audit.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dpops.errors import InvalidParameter

INPUT_COLUMNS = {"user": "string", "region": "string", "amount": "float", "category": "string"}
BOUNDS = [0.0, 10.0]

MECHANISMS: dict[str, dict[str, Any]] = {
    "count": {"metric": {"type": "count"}},
    "sum": {"metric": {"type": "sum", "column": "amount", "bounds": BOUNDS}},
    "mean": {"metric": {"type": "mean", "column": "amount", "bounds": BOUNDS}},
    "unit_count": {"metric": {"type": "unit_count"}},
    "top_k": {"metric": {"type": "top_k", "column": "category", "k": 1, "domain": ["a", "b"]}},
    "partition_selection": {"metric": {"type": "count"}, "private": "truncated_geometric", "epsilon": 2.0,
                            "delta": 1e-5, "audit": "partition_selection"},
    "quantiles": {"metric": {"type": "quantiles", "column": "amount", "bounds": BOUNDS, "quantiles": [0.5]}},
}


@dataclass(frozen=True)
class Profile:
    """Trial counts and confidence of one audit-suite run (``ci`` or ``thorough``)."""

    name: str
    trials: int  # per neighbour and scenario, for the fast mechanisms
    slow_trials: dict[str, int]  # mechanisms whose code path runs per partition in Python
    confidence: float


PROFILES = {
    # ci: the whole suite in well under 2 minutes on 2 shared cores
    "ci": Profile("ci", 10000, {"top_k": 4000, "mean": 4000, "quantiles": 1000}, 0.99),
    "thorough": Profile("thorough", 100000, {"top_k": 40000, "mean": 40000, "quantiles": 10000}, 0.999),
}


def mechanism_spec(name: str, *, adjacency: str = "add_remove", noise: str = "laplace", epsilon: float | None = None,
                   delta: float | None = None, l0: int = 1, linf: int = 2, strategy: str | None = None):
    """The suite's release spec for mechanism ``name`` (parameters overridable for planted-bug tests)."""
    from dpops.spec import parse_spec

    if name not in MECHANISMS:
        raise InvalidParameter(f"unknown mechanism {name!r}; choose from {sorted(MECHANISMS)}")
    entry = MECHANISMS[name]
    private = strategy or entry.get("private")
    eps = epsilon if epsilon is not None else entry.get("epsilon", 1.0)
    dlt = delta if delta is not None else entry.get("delta", 1e-6 if noise == "gaussian" else 0.0)
    doc = {
        "name": f"audit_{name}",
        "description": f"dpops audit suite: {name}",
        "input": {"path": "unused.parquet", "format": "parquet", "columns": INPUT_COLUMNS},
        "privacy_unit": {"column": "user", "description": "a synthetic user", "adjacency": adjacency},
        "budget": {"scope": "audit", "epsilon": eps, "delta": dlt, "noise": noise},
        "contribution": {"max_partitions_per_unit": l0, "max_rows_per_unit_per_partition": linf},
        "partitions": {"columns": ["region"],
                       **({"private": {"strategy": private}} if private else {"public": ["p0"]})},
        "metrics": [entry["metric"]],
    }
    return parse_spec(doc, source=f"<audit suite: {name}>")


def audit_target(name: str) -> str:
    """The plan key the suite audits for mechanism ``name``."""
    from dpops.release_plan import plan_release

    entry = MECHANISMS[name]
    if entry.get("audit"):
        return entry["audit"]
    return plan_release(mechanism_spec(name)).metrics[0].key


def audit_mechanisms(profile: str = "ci", names: list[str] | None = None, seed: int = 0, **spec_overrides):
    """Audit each mechanism of the suite; returns one ``AuditResult`` per mechanism."""
    from dpops.audit.runner import audit_plan

    if profile not in PROFILES:
        raise InvalidParameter(f"unknown audit profile {profile!r}; choose from {sorted(PROFILES)}")
    prof = PROFILES[profile]
    out = []
    for name in names or list(MECHANISMS):
        spec = mechanism_spec(name, **spec_overrides)
        trials = prof.slow_trials.get(name, prof.trials)
        out.extend(audit_plan(spec, metrics=[audit_target(name)], trials=trials, confidence=prof.confidence,
                              seed=seed))
    return out


__all__ = ["MECHANISMS", "PROFILES", "Profile", "mechanism_spec", "audit_target", "audit_mechanisms"]
