"""Building a run manifest from public inputs only.

Everything here is derived from the release spec, the release plan, the privacy
events, the ledger's bookkeeping and the code's own version. Nothing reads the
private input: row counts, drop counts and data-quality statistics stay in the
internal run log (semantics.md section 5). The schema closes every object so a
statistic cannot be added by accident; ``validation`` keeps only check names and
pass/fail.
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
import subprocess
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpops import __version__
from dpops.accounting import get_accountant
from dpops.errors import InvalidParameter
from dpops.events import PrivacyEvent, canonical_json, event_from_dict, event_to_dict
from dpops.manifest.schema import SCHEMA_VERSION

if TYPE_CHECKING:
    from dpops.spec import TuningSpec

EventLike = PrivacyEvent | Mapping[str, Any]  # an event, or its stable JSON form (as the ledger returns it)

# Libraries whose numerics a claim depends on; read from package metadata so Beam is never imported here.
TRACKED_LIBRARIES = ("numpy", "scipy", "apache-beam", "dp-accounting", "pyarrow", "cryptography", "jsonschema")
OUTCOMES = ("published", "refused", "failed", "spent_unpublished", "reserved", "started")
CHARGED_LEDGER_STATES = ("reserved", "started", "committed", "spent_unpublished")


def sensitivity_not_charged(value: object, mechanism: object, norm: str) -> str | None:
    """Why a vector's charged ``norm`` ("L1" or "L2") sensitivity has no finite figure, or None when it has one.

    A Laplace (or geometric) vector is calibrated to its L1 sensitivity only and a Gaussian to its L2 only; the
    other norm is recorded as unbounded, and printing ``inf`` there reads as "unbounded sensitivity", i.e. no
    privacy. The one wording of the report and ``dpops manifest show`` (issue 28 item 14)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return None
    mech = str(mechanism or "").lower()
    if norm == "L2" and ("laplace" in mech or "geometric" in mech):
        return "n/a (pure ε-DP: Laplace noise is calibrated to the L1 sensitivity)"
    if norm == "L1" and "gauss" in mech:
        return "n/a (Gaussian noise is calibrated to the L2 sensitivity)"
    return "n/a (not recorded in the manifest)"


def utc_timestamp(dt: datetime | None = None) -> str:
    """``dt`` (default now) as a second-precision ISO-8601 UTC timestamp ending in ``Z``, the manifests' form."""
    dt = dt or datetime.now(UTC)
    return dt.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _git_commit() -> str | None:
    env = os.environ.get("DPOPS_GIT_COMMIT")  # set by deployments that ship without a .git directory
    if env:
        return env.strip().lower()
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        if out.returncode != 0:
            return None
        commit = out.stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", str(here.parent)], cwd=here,
                               capture_output=True, timeout=10).returncode
        return commit + ("-dirty" if dirty == 1 else "")
    except (OSError, subprocess.SubprocessError):
        return None


def code_version() -> dict[str, Any]:
    """dpops version, git commit when available, Python and the numeric libraries' versions."""
    libs: dict[str, str | None] = {}
    for name in TRACKED_LIBRARIES:
        try:
            libs[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            libs[name] = None
    return {"dpops": __version__, "git_commit": _git_commit(), "python": platform.python_version(), "libraries": libs}


# --------------------------------------------------------------------------- spec-derived sections


def spec_document_hash(spec_document: Mapping[str, Any]) -> str:
    """Same construction as ``ReleaseSpec.spec_hash``: sha256 of the canonical JSON of the validated document."""
    return hashlib.sha256(canonical_json(spec_document).encode()).hexdigest()


def spec_sections(spec_document: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest's summary sections, read off the validated spec document (so ``verify`` can recompute them)."""
    unit = spec_document["privacy_unit"]
    contribution = spec_document["contribution"]
    parts = spec_document["partitions"]
    if parts.get("private"):
        strategy = f"private:{parts['private']['strategy']}"
        public_count = None
    elif parts.get("public_file") is not None:
        strategy = "public_file"
        # Rows only when the operator marked the file publishable; else just their count (dpops.dataroots).
        public_count = len(parts.get("public_file_content") or []) or parts.get("public_file_count") or None
    else:
        strategy = "public"
        public_count = len(parts.get("public") or []) or None
    value_bounds = {}
    release_bounds = {"max_partitions_per_unit": int(contribution["max_partitions_per_unit"]),
                      "max_rows_per_unit_per_partition": int(contribution["max_rows_per_unit_per_partition"])}
    # Per-metric contribution bounds (``metrics[].contribution``): each such metric's EFFECTIVE (L0, Linf), its
    # override merged onto the release's, the same merge as ``ReleaseSpec.metric_contribution``. Only metrics
    # bounded otherwise than the release appear, and the key only when one does: manifests of specs without
    # overrides keep exactly their form. ``verify`` recomputes each such metric's sensitivities from these.
    per_metric: dict[str, dict[str, int]] = {}
    for m in spec_document["metrics"]:
        own = m.get("contribution")
        if own:
            eff = {**release_bounds, **{k: int(v) for k, v in own.items() if v is not None}}
            if eff != release_bounds:
                per_metric[m.get("name") or (f"{m['type']}_{m['column']}" if m.get("column") else m["type"])] = eff
    for m in spec_document["metrics"]:
        if m.get("bounds") is not None:
            key = m.get("name") or f"{m['type']}_{m['column']}"
            # bounds: estimate (an estimation's own manifest): the fallback, the bounds its recorded plan is at
            b = m["fallback_bounds"] if m["bounds"] == "estimate" else m["bounds"]
            value_bounds[key] = [float(b[0]), float(b[1])]
    return {
        "privacy_unit": {
            "column": unit["column"],
            "description": unit["description"],
            "adjacency": unit["adjacency"],
            "record_level": bool(unit.get("record_level", False)),
            "period": unit.get("period"),
            "population": unit.get("population"),
        },
        "contribution_bounds": {**release_bounds, **({"per_metric": per_metric} if per_metric else {})},
        "value_bounds": value_bounds,
        "partitions": {"strategy": strategy, "columns": list(parts["columns"]), "public_count": public_count},
    }


def _event_dicts(events: Sequence[EventLike]) -> list[dict[str, Any]]:
    # Round-trip through the events contract so a malformed event fails here, not in a reviewer's hands.
    return [event_to_dict(event_from_dict(e) if isinstance(e, Mapping) else e) for e in events]


def run_epsilon(accountant_ref: str, events: Sequence[EventLike], delta: float) -> float | None:
    """ε of this run alone at ``delta`` with the pinned accountant (None = infinite, e.g. Gaussian at δ=0)."""
    if not events:
        return 0.0
    acct = get_accountant(accountant_ref)
    try:
        eps = float(acct.epsilon([event_from_dict(e) for e in _event_dicts(events)], delta))
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return eps if math.isfinite(eps) else None


def _validation_summary(validation: Any) -> dict[str, Any] | None:
    """Only check names and pass/fail survive: statistics about the input never enter a manifest."""
    if validation is None:
        return None
    if isinstance(validation, Mapping):
        checks_in = validation.get("checks", [])
        proceeded = validation.get("proceeded")
    else:  # a report object such as dpops.release.gx_checks.CheckReport
        checks_in = getattr(validation, "checks", None) or getattr(validation, "results", None) or []
        proceeded = getattr(validation, "proceeded", None)
        if proceeded is None:
            proceeded = getattr(validation, "ok", None)
    checks = []
    for c in checks_in:
        name = c.get("name") if isinstance(c, Mapping) else getattr(c, "name", None)
        passed = c.get("passed") if isinstance(c, Mapping) else getattr(c, "passed", getattr(c, "success", None))
        if not isinstance(name, str) or not isinstance(passed, bool):
            raise InvalidParameter(f"validation check {c!r}: needs a string 'name' and a boolean 'passed'")
        checks.append({"name": name, "passed": passed})
    if proceeded is None:
        proceeded = all(c["passed"] for c in checks)
    return {"checks": checks, "proceeded": bool(proceeded)}


def _timings(timings: Mapping[str, Any] | None) -> dict[str, Any]:
    """Timestamps plus whole-second step durations: finer timing would say more about the input's size."""
    t = dict(timings or {})
    steps = {}
    for k, v in (t.get("steps_seconds") or t.get("steps") or {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0:
            steps[str(k)] = int(round(v))
    return {"started_at": t.get("started_at"), "finished_at": t.get("finished_at") or utc_timestamp(),
            "steps_seconds": steps}


# --------------------------------------------------------------------------- the document


def build_manifest(
    *,
    run_key: Mapping[str, Any],
    spec_document: Mapping[str, Any],
    release_plan: Mapping[str, Any],
    events: Sequence[EventLike],
    accountant: str,
    outcome: str,
    randomness_mode: str,
    run_id: str | None = None,
    ledger_state: str | None = None,
    reason: str | None = None,
    scope: Mapping[str, Any] | None = None,
    entry_ids: Sequence[int] = (),
    entry_hashes: Sequence[str] = (),
    restates: str | None = None,
    replaces_spent: Mapping[str, Any] | None = None,
    corrects: Mapping[str, Any] | None = None,
    validation: Any = None,
    timings: Mapping[str, Any] | None = None,
    output: Mapping[str, Any] | None = None,
    created_at: str | None = None,
    code: Mapping[str, Any] | None = None,
    accuracy: Mapping[str, Any] | None = None,
    estimation: Mapping[str, Any] | None = None,
    dependencies: Mapping[str, Any] | None = None,
    provenance: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Assemble one manifest (a plain dict; ``write_manifest`` validates it against the schema).

    ``run_key``: release, spec_hash, interval_start, interval_end, input_fingerprint, key_id.
    ``spec_document``: ``ReleaseSpec.canonical_document()``. ``release_plan``: ``ReleasePlan.describe()``.
    ``accountant``: the scope's pinned ``name/version``. ``scope``: ``scope_position(...)`` or None
    (e.g. a run refused before the scope could be read). ``output``: {"uri", "fingerprints"} with
    HMAC fingerprints only. ``accuracy``: ``dpops.analysis.document.manifest_section`` (the declared
    targets and the plan's prediction for each: public parameters only), recorded only when the spec
    declares targets, so manifests without it keep verifying. ``provenance``: ``{"tuning":
    tuning_provenance(spec.tuning)}`` when the spec says its parameters came from ``dpops tune``.
    ``estimation``: the run is a private bound estimation (``dpops.analysis.estimate.manifest_section``:
    configuration, mechanisms, result, patch). ``dependencies``: the runs this release's parameters came
    from (``{"estimations": [{"run_id"}]}``, from the spec's ``estimated_from``). Each only when present,
    so older manifests keep verifying.
    """
    if outcome not in OUTCOMES:
        raise InvalidParameter(f"manifest outcome must be one of {OUTCOMES}, got {outcome!r}")
    if randomness_mode not in ("keyed", "os", "test"):
        raise InvalidParameter(f"randomness mode must be keyed, os or test, got {randomness_mode!r}")
    key = {k: run_key[k]
           for k in ("release", "spec_hash", "interval_start", "interval_end", "input_fingerprint", "key_id")}
    if run_id is None:
        from dpops.ledger.model import RunKey  # value type only; no database is touched

        run_id = RunKey(**key).run_id
    acct = get_accountant(accountant)  # refuses unknown accountants and pins the version
    ev = _event_dicts(events)
    budget = spec_document["budget"]
    delta = float(scope["cap"]["delta"]) if scope else float(budget.get("delta", 0.0))
    charged = ledger_state in CHARGED_LEDGER_STATES if ledger_state else outcome in ("published", "spent_unpublished")
    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "run_id": run_id,
        "run_key": key,
        "created_at": created_at or utc_timestamp(),
        "outcome": {"state": outcome, "ledger_state": ledger_state, "reason": reason},
        "restates": {"run_id": restates} if restates else None,
        "replaces_spent": ({"run_id": str(replaces_spent["run_id"]), "reason": str(replaces_spent.get("reason") or "")}
                           if replaces_spent else None),
        "corrects": dict(corrects) if corrects else None,
        "spec": dict(spec_document),
        "spec_hash": spec_document_hash(spec_document),
        "code": dict(code) if code is not None else code_version(),
        **spec_sections(spec_document),
        "release_plan": dict(release_plan),
        "events": ev,
        "accountant": {"name": acct.name, "version": acct.version, "ref": acct.ref, "details": acct.describe()},
        "privacy": {
            "run": {"epsilon": run_epsilon(acct.ref, ev, delta), "delta": delta, "charged": charged},
            "requested": {"epsilon": float(budget["epsilon"]), "delta": float(budget.get("delta", 0.0))},
            "scope": dict(scope) if scope else None,
        },
        "ledger": {"entry_ids": [int(i) for i in entry_ids], "entry_hashes": [str(h) for h in entry_hashes]},
        "randomness": {"mode": randomness_mode, "key_id": key["key_id"], "test_mode": randomness_mode == "test"},
        "validation": _validation_summary(validation),
        "timings": _timings(timings),
        "output": dict(output) if output else None,
    }
    if accuracy is not None:
        doc["accuracy"] = dict(accuracy)
    if estimation is not None:
        doc["estimation"] = dict(estimation)
    if dependencies is not None:
        doc["dependencies"] = dict(dependencies)
    if provenance is not None:
        doc["provenance"] = dict(provenance)
    return doc


TUNING_PROVENANCE_SCHEMA = "dpops.tuning-provenance/1"


def tuning_provenance(tuning: TuningSpec) -> dict[str, Any]:
    """The manifest's ``provenance.tuning`` from the spec's ``tuning`` block (``dpops.spec.TuningSpec``).

    Privacy reason: tuning is not DP, so a release whose bounds came from looking at private data must say
    so to every reviewer (issue 20 section 3). Only what the spec block holds goes in -- where the choice came
    from and the ledger entry that recorded a private read -- never a statistic of the sample."""
    data = tuning.data.model_dump(mode="json")
    if data["source"] == "private":
        data["statement"] = tuning.statement
    return {"schema": TUNING_PROVENANCE_SCHEMA, "statement": tuning.statement, "candidate": tuning.candidate,
            "loss": tuning.loss, "candidates": int(tuning.candidates), "not_evaluated": list(tuning.not_evaluated),
            "data": data}
