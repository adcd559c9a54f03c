"""One release over one data interval, as idempotent steps with the ledger between them.

The package by role (each module's docstring gives the privacy/ledger reason for its boundary):

- ``context``        ``RunContext`` (the run key and everything a step needs), ``RunOutcome`` (the one
                     outcome line), ``open_run_ledger``, ``step_summary``, the attempt choice.
- ``preparation``    step 1, ``prepare``: spec, interval, input and keyed fingerprint, plan, key. No ledger write.
- ``reservation``    step 2, ``reserve``: serve a published interval, refuse a changed input or a different
                     unit definition, else reserve the plan's events.
- ``computation``    step 3, ``compute``: ``ledger.start`` then the Beam pipeline, via ``pipeline_seam``
                     (``ComputeRequest`` / ``ComputeResult``; ``dpops`` never imports Beam).
- ``output_checks``  post-processing checks on the noisy output; ``gx_checks`` the Great Expectations ones.
- ``manifests``      where manifests live; the published run's manifest, written before publishing.
- ``publication``    step 4, ``publish``: checks, manifest, ledger commit, atomic versioned publish.
- ``served``         serving a published interval: make it visible, refuse changed files.
- ``refusals``       a budget refusal's reason and its refusal manifest (the ledger keeps no entry for it).
- ``estimation``     the estimation release kind (a private bound estimation, ``dpops estimate``): the same
                     steps over the ledger (reserve or serve, start, compute, commit) around the pure
                     mechanisms of ``dpops.analysis.estimate``.
- ``execute``        the whole run (``execute_release``), ``restate``, ``abandon``, ``status``; ``estimate``
                     (``dpops estimate``) and its notebook form ``estimate_bounds``.

Modules are nouns and the step functions verbs, so ``dpops.release.prepare`` is always the function and
``dpops.release.preparation`` its module. ``from dpops.release import execute_release, RunContext`` for
callers; tests patch a name in the module that looks it up at call time (e.g.
``dpops.release.computation._load_run_release``, ``dpops.release.manifests.write_manifest_before_publish``).
"""

from __future__ import annotations

from dpops.release.computation import check_runner, compute, compute_staged
from dpops.release.context import (
    STAGES,
    RunContext,
    RunOutcome,
    ScopePosition,
    open_run_ledger,
    pick_attempt,
    scope_position,
    step_summary,
)
from dpops.release.execute import (
    abandon,
    estimate,
    estimate_bounds,
    execute_release,
    execute_restatement,
    restate,
    status,
)
from dpops.release.manifests import ensure_manifest, manifests_dir, spec_manifests_dir
from dpops.release.output_checks import check_noisy_output
from dpops.release.preparation import prepare, requested_interval
from dpops.release.publication import publish
from dpops.release.reservation import reserve, unit_definition_mismatches
from dpops.release.simulation import Simulation, simulate, write_outputs

__all__ = [
    "Simulation", "simulate", "write_outputs",
    "STAGES", "RunContext", "RunOutcome", "ScopePosition", "abandon", "check_noisy_output", "check_runner", "compute",
    "compute_staged", "ensure_manifest", "estimate", "estimate_bounds", "execute_release", "execute_restatement",
    "manifests_dir",
    "open_run_ledger", "pick_attempt", "prepare", "publish", "requested_interval", "reserve",
    "restate", "scope_position", "spec_manifests_dir",
    "status", "step_summary", "unit_definition_mismatches",
]
