"""Empirical privacy auditing: statistically sound lower bounds on the ε a release really spends.

See docs/audit.md for the method. Entry points: ``audit_plan`` (a release spec's metrics and
partition selection), ``audit_mechanisms`` (the built-in suite) and ``audit_key_reuse``.
"""

from dpops.audit.runner import AuditResult, audit_plan, audit_scenarios, sample_statistic
from dpops.audit.stats import Bound, cp_lower, cp_upper, epsilon_from_counts, held_out_bound

__all__ = [
    "AuditResult",
    "audit_plan",
    "audit_scenarios",
    "sample_statistic",
    "Bound",
    "cp_lower",
    "cp_upper",
    "epsilon_from_counts",
    "held_out_bound",
]
