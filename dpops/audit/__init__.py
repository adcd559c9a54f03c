"""Empirical privacy auditing: statistically sound lower bounds on the ε a release really spends.

See docs/audit.md for the method. Entry points: ``audit_plan`` (a release spec's metrics and
partition selection), ``audit_mechanisms`` (the built-in suite), ``audit_key_reuse`` (fresh
noise on a changed input), ``audit_float_sums`` (one unit moves an exact sum by no more than the
charge, whatever the other rows) and ``audit_metric_via_pipeline`` (end to end through Beam).
"""

from dpops.audit.float_sums import audit_float_sums
from dpops.audit.key_reuse import audit_key_reuse
from dpops.audit.pipeline_path import audit_metric_via_pipeline
from dpops.audit.runner import AuditResult, audit_plan, audit_scenarios, sample_statistic
from dpops.audit.stats import Bound, cp_lower, cp_upper, epsilon_from_counts, held_out_bound
from dpops.audit.suite import PROFILES, audit_mechanisms, mechanism_spec

__all__ = [
    "AuditResult",
    "audit_plan",
    "audit_mechanisms",
    "audit_key_reuse",
    "audit_float_sums",
    "audit_metric_via_pipeline",
    "audit_scenarios",
    "sample_statistic",
    "mechanism_spec",
    "PROFILES",
    "Bound",
    "cp_lower",
    "cp_upper",
    "epsilon_from_counts",
    "held_out_bound",
]
