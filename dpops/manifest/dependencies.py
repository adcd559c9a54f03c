"""What a release depends on: the bound estimation its spec names (``estimated_from``), and the rule it must meet.

One rule, two callers: ``dpops release run``/``restate`` and the DAG's reserve step apply it before anything
is reserved (``dpops.release.reservation.check_scope``), and ``manifest verify --ledger`` applies it to the
manifest's ``dependencies`` section. It lives with the manifest because the manifest is where a reviewer sees
the dependency; both callers import it from here, so the release and the verifier can never disagree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dpops.analysis.estimate import RELEASE_SUFFIX, is_test_key_id

if TYPE_CHECKING:
    from dpops.ledger import Ledger
    from dpops.spec import ReleaseSpec


def check_dependency(spec: ReleaseSpec, ledger: Ledger, randomness: str = "keyed") -> list[str]:
    """Why ``spec.estimated_from`` is not a usable estimation in ``ledger`` for a release with ``randomness``
    (empty: it is). The one rule ``release run``/``restate``/the DAG's reserve (``check_scope``, before
    reservation) and ``manifest verify`` (``dependencies``) apply.

    A release whose bounds came from an estimation must name a committed estimation of the same release
    on the same scope: a bound learned from the data without a charged estimation is a leak
    (semantics.md section 1), and an estimation charged to another scope was charged to other people. A
    test-mode (seeded) estimation is not a DP release (its noise is public): it feeds only a test-mode
    release, itself never published (issue 25 item 4)."""
    run_id = getattr(spec, "estimated_from", None)
    if run_id is None:
        return []
    rec = ledger.run(run_id)
    if rec is None:
        return [f"estimated_from: run {run_id} is not in this ledger: run dpops estimate with this ledger first"]
    out = []
    test_run = is_test_key_id(rec.key.key_id)
    if test_run and randomness != "test":
        out.append(f"estimated_from: estimation {run_id} used test-mode (seeded) randomness, so it is not a DP "
                   f"release and never feeds a release with {randomness} randomness: estimate again with keyed "
                   "randomness (dpops estimate without --randomness test)")
        return out
    if rec.key.release != spec.name + RELEASE_SUFFIX:
        out.append(f"estimated_from: run {run_id} is a run of {rec.key.release!r}, not an estimation of "
                   f"{spec.name!r}")
    if rec.scope != spec.budget.scope:
        out.append(f"estimated_from: estimation {run_id} was charged to scope {rec.scope!r}, the release uses "
                   f"{spec.budget.scope!r}")
    if rec.state != "committed" and not (test_run and rec.state == "spent_unpublished"):
        out.append(f"estimated_from: estimation {run_id} is {rec.state}, not committed")
    return out


__all__ = ["check_dependency"]
