"""The one call the run orchestration makes: write the manifest of a run before publishing it.

``write_run_manifest`` reads what it needs from the run context (spec, run key,
plan, randomness mode), the ledger (the run's state, entries, restatement link,
the scope's accountant and position) and the outcome, then builds, optionally
signs, validates and writes the manifest. A retry of the same step finds the
manifest it already wrote and returns its path (same claim) instead of failing;
a *different* claim for the same run and outcome is refused (manifests are
immutable).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from dpops.errors import InvalidParameter, StorageError
from dpops.manifest.build import build_manifest
from dpops.manifest.io import manifest_exists, manifest_filename, read_manifest, write_manifest
from dpops.manifest.scope import scope_position
from dpops.storage.location import Location

if TYPE_CHECKING:
    from dpops.ledger.model import RunKey
    from dpops.ledger.store import Ledger
    from dpops.release_plan import ReleasePlan
    from dpops.spec import ReleaseSpec


class RunContextLike(Protocol):
    """What a manifest reads from a run: ``dpops.release.RunContext``, or a stand-in holding just these.

    Optional attributes read when present: ``randomness`` ("keyed" | "os" | "test", default keyed),
    ``restates`` (the run id a restatement replaces) and, for a fresh attempt, ``replaces_spent`` and
    ``fresh_reason``.
    """

    @property
    def spec(self) -> ReleaseSpec:
        """The validated release spec (its budget scope and canonical document go into the manifest)."""

    @property
    def run_key(self) -> RunKey:
        """The run's ledger key; its ``run_id`` finds the run's record."""

    @property
    def plan(self) -> ReleasePlan:
        """The plan the run reserved: its description and events are the manifest's claim."""

# RunOutcome / ledger states -> manifest outcome
_OUTCOME = {
    "published": "published", "committed": "published", "served": "published", "restated": "published",
    "already_published": "published", "staged": "started",
    "refused": "refused", "budget_refused": "refused", "budget_exceeded": "refused",
    "spent_unpublished": "spent_unpublished",
    "failed": "failed", "released": "failed", "error": "failed",
    "reserved": "reserved", "started": "started",
}
# Path of an Ed25519 private key (PEM, see ``dpops.manifest.sign.generate_signing_key``). When set, every
# manifest the run orchestration writes is signed, so a reviewer holding the public key can tell a manifest
# dpops wrote from one written by anyone with access to the manifests directory. The key signs public
# claims only: it is not the noise key, and compromising it reveals nothing about the data.
SIGNING_KEY_ENV = "DPOPS_MANIFEST_SIGNING_KEY"
# Parts of a manifest that legitimately differ between two writes of the same claim.
_VOLATILE = ("created_at", "timings", "code", "signature")


def check_signing_key() -> str | None:
    """Load the configured signing key now (before any budget is reserved), so a missing or bad key
    fails the run at prepare time instead of after its noise was drawn. Returns its public key id."""
    path = os.environ.get(SIGNING_KEY_ENV) or None
    if path is None:
        return None
    from dpops.manifest.sign import load_private_key, public_key_id

    return public_key_id(load_private_key(path).public_key())


def _get(obj: object, *names: str, default: Any = None) -> Any:
    for n in names:
        if isinstance(obj, Mapping) and n in obj:
            return obj[n]
        if hasattr(obj, n):
            return getattr(obj, n)
    return default


def _outcome_state(outcome: object) -> str:
    raw = outcome if isinstance(outcome, str) else _get(outcome, "state", "outcome", "status")
    state = _OUTCOME.get(str(raw).lower()) if raw is not None else None
    if state is None:
        raise InvalidParameter(f"run outcome {raw!r} has no manifest outcome; known: {sorted(_OUTCOME)}")
    return state


TEST_REFUSAL_FINGERPRINT = "withheld:test-mode-refusal"


def write_run_manifest(
    ctx: RunContextLike,
    ledger: Ledger | None,
    outcome: object,
    *,
    manifests_dir: str | os.PathLike[str] | Location,
    validation: Any = None,
    timings: Mapping[str, Any] | None = None,
    output_fingerprints: Mapping[str, str] | None = None,
    signing_key: str | os.PathLike[str] | None = None,
    estimation: Mapping[str, Any] | None = None,
) -> str:
    """Build and write the manifest of one run; return its path.

    ``ctx``: the run context (``.spec`` ReleaseSpec, ``.run_key`` RunKey, ``.plan`` ReleasePlan,
    ``.randomness`` "keyed" | "os" | "test", optional ``.restates``). ``outcome``: a RunOutcome
    (``.state``, optional ``.reason``/``.error``, ``.output_uri``) or a state string.
    ``validation``: which checks ran and passed ({"checks": [{"name", "passed"}], "proceeded"} or a
    report object with the same attributes) -- never statistics. ``output_fingerprints``: file name ->
    ``"hmac-sha256:<hex>"`` keyed fingerprints of the published files. ``signing_key``: Ed25519 private
    key (PEM) to sign with; default ``$DPOPS_MANIFEST_SIGNING_KEY`` (unset: unsigned). ``estimation``: the
    run is a private bound estimation (``dpops.release.estimation``), recorded in its own sub-object. A spec
    with ``estimated_from`` gets a ``dependencies`` sub-object naming that estimation run.
    """
    spec = _get(ctx, "spec")
    key = _get(ctx, "run_key", "key")
    plan = _get(ctx, "plan")
    if spec is None or key is None or plan is None:
        raise InvalidParameter("write_run_manifest: the run context needs .spec, .run_key and .plan")
    key_dict = key.to_dict() if hasattr(key, "to_dict") else dict(key)
    run_id = key.run_id if hasattr(key, "run_id") else _get(ctx, "run_id")
    state = _outcome_state(outcome)
    mode = _get(ctx, "randomness", "randomness_mode", default="keyed")
    mode = _get(mode, "mode", default=mode) if not isinstance(mode, str) else mode

    if mode == "test" and state == "refused" and key_dict.get("input_fingerprint") != TEST_REFUSAL_FINGERPRINT:
        # Test mode fingerprints the input under a PUBLIC key (TestFingerprintKey), so the fingerprint -
        # and the run id, a hash of the run key - would let a manifest reader confirm a guess of the
        # input. A refused run has no ledger entry to match, so both are left out (issue 11 item 6).
        key_dict = {**key_dict, "input_fingerprint": TEST_REFUSAL_FINGERPRINT}
        run_id = None  # build_manifest derives it from the redacted key
    scope_name = spec.budget.scope
    rec = ledger.run(run_id) if ledger is not None and run_id is not None else None
    scope_def = ledger.scope(scope_name) if ledger is not None else None
    accountant = scope_def.accountant if scope_def is not None else "basic/1"
    position = scope_position(ledger, scope_name, rec.buckets if rec else None) if ledger is not None else None
    restates = (rec.restates if rec else None) or _get(ctx, "restates")
    output_uri = _get(outcome, "output_uri", "output", "location") if not isinstance(outcome, str) else None
    if output_uri is None and rec is not None:
        output_uri = rec.output_uri
    reason = None if isinstance(outcome, str) else _get(outcome, "reason", "error", "message")

    manifest = build_manifest(
        run_key=key_dict,
        run_id=run_id,
        spec_document=spec.canonical_document(),
        release_plan=plan.describe(),
        events=list(plan.events) if rec is None else list(rec.events),
        accountant=accountant,
        outcome=state,
        randomness_mode=str(mode),
        ledger_state=rec.state if rec else None,
        reason=None if reason is None else str(reason),
        scope=position,
        entry_ids=rec.entry_ids if rec else (),
        entry_hashes=rec.entry_hashes if rec else (),
        restates=restates,
        replaces_spent=(rec.details or {}).get("replaces_spent") if rec is not None else _fresh_link(ctx),
        validation=validation,
        timings=timings,
        output={"uri": str(output_uri), "fingerprints": dict(output_fingerprints or {})} if output_uri else None,
        accuracy=_accuracy_section(spec, plan),
        estimation=estimation,
        dependencies=_dependencies(spec),
        provenance=_provenance_section(spec),
    )
    if signing_key is None:
        signing_key = os.environ.get(SIGNING_KEY_ENV) or None
    if signing_key is not None:
        from dpops.manifest.sign import sign_manifest

        manifest = sign_manifest(manifest, signing_key)

    existing = manifest_exists(manifests_dir, manifest_filename(manifest))  # local path or object-store URI
    if existing is not None:
        old = read_manifest(existing)
        if _claim(old) == _claim(manifest):
            return existing  # a retry of the same step: the manifest already states this claim
        raise StorageError(
            f"{existing} already states a different claim for run {run_id} ({state}); manifests are immutable: "
            "write a correction whose 'corrects' names the old file"
        )
    return write_manifest(manifest, manifests_dir)


def _fresh_link(ctx: object) -> dict[str, str] | None:
    """A run not in the ledger (a refusal) that is a fresh attempt: the link the ledger records when the same
    run key is reserved later (``dpops.release.reservation.reserve``), so its refusal manifest stays true then."""
    spent = _get(ctx, "replaces_spent")
    if not isinstance(spent, str) or not spent:
        return None
    return {"run_id": spent, "reason": str(_get(ctx, "fresh_reason") or "")}


def _accuracy_section(spec: Any, plan: Any) -> dict[str, Any] | None:
    """The declared accuracy targets and their predictions (issue 20), when the spec declares any."""
    if getattr(spec, "accuracy", None) is None:
        return None
    from dpops.analysis.document import manifest_section

    return manifest_section(spec, plan)


def _dependencies(spec: Any) -> dict[str, Any] | None:
    """The estimation run the spec's bounds came from (issue 20 section 4), when it names one."""
    run_id = getattr(spec, "estimated_from", None)
    return {"estimations": [{"run_id": str(run_id)}]} if run_id else None


def _provenance_section(spec: Any) -> dict[str, Any] | None:
    """Where the spec's parameters came from (issue 20 section 3), when its ``tuning`` block says."""
    if getattr(spec, "tuning", None) is None:
        return None
    from dpops.manifest.build import tuning_provenance

    return {"tuning": tuning_provenance(spec.tuning)}


def _claim(m: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in m.items() if k not in _VOLATILE}
    # The scope position moves when other runs land between two attempts; the run's own claim does not.
    out["privacy"] = {k: v for k, v in m["privacy"].items() if k != "scope"}
    out["ledger"] = None
    out["outcome"] = {k: v for k, v in m["outcome"].items() if k != "ledger_state"}  # started -> committed
    return json.loads(json.dumps(out))  # compare as the file stores it
