"""Audit a release against the unit its budget SCOPE protects (issue 11 item 1).

The mechanism audits (``runner.audit_plan``) bound ε for the unit the *spec* declares. A release
charged to a scope protecting another unit is only as private as it is for the scope's unit. The
case the auditor can show is a record-level release (each row its own unit) in a scope whose
unit is a user: the target neighbour is one *user* with ``rows_per_unit`` rows, which the
record-level pipeline treats as that many units, so the audited ε grows with the rows while the
ledger would be charged ε once. ``dpops.release.reservation`` refuses such a release before any reservation;
this audit shows why (and ``refused`` says whether dpops would refuse it).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from dpops.audit.harness import Harness, Rows, block
from dpops.audit.runner import AuditResult, audit_scenarios
from dpops.audit.scenarios import UNIT_STRIDE, ScenarioBuilder
from dpops.errors import SpecError

if TYPE_CHECKING:
    from dpops.ledger.model import ScopeDefinition
    from dpops.spec import ReleaseSpec


@dataclasses.dataclass(frozen=True)
class ScopeAudit:
    """Result of auditing a release against a scope's unit: refused by dpops, or audited against that unit."""

    refused: bool  # dpops.release.reservation would refuse this release on this scope (before any reservation)
    reasons: list[str]
    results: list[AuditResult]  # audits against the scope's unit (a user with many rows)

    @property
    def passed(self) -> bool:
        """Every audit against the scope's unit held."""
        return all(r.passed for r in self.results)


class _UserTarget(ScenarioBuilder):
    """Record-level plan, user-level neighbour: the target user has ``rows`` rows in one partition."""

    def __init__(self, h: Harness, rows: int):
        super().__init__(h)
        self.rows = rows

    def _target(self, world: int, groups: int, over: bool, value: float, cat: int) -> Rows:
        if self.replace:
            offset, k = (self.l0, 1) if world == 1 else (0, 0)
        else:
            if world == 0:
                return Rows.empty()
            offset, k = 0, 0
        J = self.n_parts(over)
        g = np.repeat(np.arange(groups), self.rows)
        units = (g * UNIT_STRIDE + k) * 2 + world  # ignored by a record-level run: every row is a unit
        return block(units, g * J + offset, value, cat)


def audit_against_scope(spec: ReleaseSpec, scope: ScopeDefinition, *, metric: str | None = None,
                        rows_per_unit: int = 40, trials: int = 2000, confidence: float = 0.99,
                        seed: int = 0) -> ScopeAudit:
    """Would dpops refuse ``spec`` on ``scope``, and what ε does it really spend for the scope's unit?"""
    from dpops.release import unit_definition_mismatches
    from dpops.release_plan import plan_release

    reasons = unit_definition_mismatches(spec, scope)
    if not (spec.privacy_unit.record_level and not getattr(scope, "record_level", False)):
        return ScopeAudit(refused=bool(reasons), reasons=reasons, results=[])
    plan = plan_release(spec)
    keys = [m.key for m in plan.metrics if m.type in ("count", "sum", "unit_count")]
    if metric is not None:
        keys = [k for k in keys if k == metric]
    if not keys:
        raise SpecError(f"{spec.source}: the scope audit needs a count, unit_count or sum metric")
    results = []
    for key in keys:
        m = next(x for x in plan.metrics if x.key == key)
        sub = dataclasses.replace(plan, metrics=(m,), partition_selection=None, partition_selection_event=None,
                                  public_partitions=plan.public_partitions or (("audit",),))
        h = Harness(spec, sub)
        sb = _UserTarget(h, rows_per_unit)
        scen = [sc for sc in sb.metric(key) if sc.name == "at_bounds"]
        results.append(audit_scenarios(h, scen, target=f"{key} (one {scope.unit_column} with {rows_per_unit} rows)",
                                       mechanism=m.type, claimed_epsilon=float(m.epsilon), delta=float(m.delta),
                                       trials=trials, confidence=confidence, seed=seed))
    return ScopeAudit(refused=bool(reasons), reasons=reasons, results=results)


__all__ = ["ScopeAudit", "audit_against_scope"]
