"""The JSON shapes of the accuracy view: one owner for what ``plan``, ``spec check``, manifests and the report show.

``accuracy_document`` is the whole view of one spec (predictions, targets, plain-language lines);
``manifest_section`` is the part a run manifest records -- the declared targets and what the plan
predicts for them -- and ``recompute_manifest_section`` is what ``manifest verify`` compares it with.
All of it is post-processing of public parameters: no data, no charge.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dpops.analysis.accuracy import DEFAULT_CONFIDENCE, DEFAULT_GAP, DEFAULT_UNITS, predict
from dpops.analysis.reviewer import lines
from dpops.analysis.targets import CURRENT_PREDICTION, PREDICTION_VERSIONS, evaluate

if TYPE_CHECKING:
    from dpops.release_plan import ReleasePlan
    from dpops.spec import ReleaseSpec

SCHEMA_PREFIX = "dpops.accuracy/"
MANIFEST_SCHEMA = f"{SCHEMA_PREFIX}{CURRENT_PREDICTION}"  # the version of the predictions (targets.PREDICTION_VERSIONS)


def accuracy_document(spec: ReleaseSpec, plan: ReleasePlan, *, confidence: float = DEFAULT_CONFIDENCE,
                      at_units: int = DEFAULT_UNITS, at_values: Mapping[str, float] | None = None,
                      gap: int = DEFAULT_GAP, accountant: str | None = None) -> dict[str, Any]:
    """Predictions, target results and reviewer lines of one spec's plan."""
    preds = predict(plan, confidence=confidence, at_units=at_units, at_values=dict(at_values or {}), gap=gap)
    return {
        "confidence": confidence, "at_units": at_units, "at_values": dict(at_values or {}), "gap": gap,
        "predictions": [p.to_dict() for p in preds],
        "targets": [t.to_dict() for t in evaluate(plan, spec.accuracy)],
        "explain": lines(spec, plan, preds, accountant),
    }


def manifest_section(spec: ReleaseSpec, plan: ReleasePlan) -> dict[str, Any] | None:
    """What a manifest records about accuracy: the declared targets and the plan's prediction for each.

    None when the spec declares no targets (the field is optional, so older manifests still verify).
    """
    if spec.accuracy is None:
        return None
    return {"schema": MANIFEST_SCHEMA, "declared": spec.accuracy.model_dump(mode="json"),
            "targets": [t.to_dict() for t in evaluate(plan, spec.accuracy)]}


def recompute_manifest_section(spec: ReleaseSpec, recorded: Mapping[str, Any]) -> dict[str, Any]:
    """The section recomputed from the manifest's embedded spec and its recorded ``declared`` targets.

    ``spec``: the embedded spec as the verifier re-reads it (``dpops.manifest.verify.parse_embedded_spec``, the
    manifest's own rule for a spec it carries); taking it parsed keeps this module free of the manifest."""
    from dpops.release_plan import plan_release
    from dpops.spec import AccuracySpec

    declared = AccuracySpec.model_validate(dict(recorded["declared"]))
    plan = plan_release(spec)
    schema = str(recorded.get("schema", ""))
    version = int(schema[len(SCHEMA_PREFIX):]) if schema[len(SCHEMA_PREFIX):].isdigit() else -1
    if not schema.startswith(SCHEMA_PREFIX) or version not in PREDICTION_VERSIONS:
        version = CURRENT_PREDICTION  # the schema check names the unknown value; recompute as today
    return {"schema": f"{SCHEMA_PREFIX}{version}", "declared": declared.model_dump(mode="json"),
            "targets": [t.to_dict() for t in evaluate(plan, declared, version)]}


__all__ = ["accuracy_document", "manifest_section", "recompute_manifest_section", "MANIFEST_SCHEMA"]
