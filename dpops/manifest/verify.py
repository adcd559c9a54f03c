"""Recompute a manifest's privacy claim from the manifest alone (and, optionally, the ledger).

Steps, each a named check; any mismatch names the manifest field:

1. schema: the document is a valid ``dpops.manifest/1``;
2. spec: the embedded spec re-validates, its hash equals ``spec_hash`` and ``run_key.spec_hash``,
   and the summary sections (privacy unit, adjacency, contribution and value bounds,
   partition strategy) are exactly what the spec says;
3. plan: ``plan_release`` re-run on the embedded spec gives every mechanism, parameter and
   sensitivity recorded in ``release_plan`` and exactly the recorded ``events``;
4. sensitivity: every sensitivity in the plan is recomputed with ``dpops.sensitivity`` from
   the manifest's own bounds and adjacency;
5. accounting: the run's ε, recomputed with the *recorded* accountant version, equals the claim;
6. randomness: a test-mode run never claims to be published;
7. ledger (when given): the ledger's hash chain verifies, the run's key, events, restatement
   link, entry ids and hashes match, and the scope position replays from the entries;
8. signature (when a public key is given).
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from dpops.errors import DpopsError, IntegrityError
from dpops.events import event_from_dict, event_to_dict
from dpops.manifest.build import run_epsilon, spec_document_hash, spec_sections
from dpops.manifest.schema import schema_problems

REL_TOL = 1e-9  # recomputation is deterministic; this only absorbs float summation order


@dataclass
class Check:
    name: str
    ok: bool
    problems: list[str] = field(default_factory=list)
    skipped: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "skipped": self.skipped, "problems": self.problems}


@dataclass
class VerificationResult:
    source: str
    run_id: str | None
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def problems(self) -> list[str]:
        return [p for c in self.checks for p in c.problems]

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "run_id": self.run_id, "ok": self.ok,
                "checks": [c.to_dict() for c in self.checks], "problems": self.problems}

    def raise_for_problems(self) -> "VerificationResult":
        if not self.ok:
            raise IntegrityError(f"{self.source}: manifest verification failed:\n  " + "\n  ".join(self.problems))
        return self


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if math.isinf(a) or math.isinf(b):
            return a == b
        return math.isclose(float(a), float(b), rel_tol=REL_TOL, abs_tol=1e-12)
    return a == b


def diff(recorded: Any, recomputed: Any, path: str) -> list[str]:
    """Every place where ``recorded`` (the manifest) and ``recomputed`` differ, as ``path: ...``."""
    if isinstance(recorded, Mapping) and isinstance(recomputed, Mapping):
        out = []
        for k in sorted(set(recorded) | set(recomputed), key=str):
            p = f"{path}.{k}" if path else str(k)
            if k not in recorded:
                out.append(f"{p}: missing from the manifest (recomputed {_short(recomputed[k])})")
            elif k not in recomputed:
                out.append(f"{p}: the manifest has {_short(recorded[k])}, the recomputation has no such field")
            else:
                out.extend(diff(recorded[k], recomputed[k], p))
        return out
    if isinstance(recorded, list) and isinstance(recomputed, list):
        if len(recorded) != len(recomputed):
            return [f"{path}: the manifest lists {len(recorded)} items, the recomputation {len(recomputed)}"]
        out = []
        for i, (a, b) in enumerate(zip(recorded, recomputed)):
            out.extend(diff(a, b, f"{path}[{i}]"))
        return out
    if not _close(recorded, recomputed):
        return [f"{path}: manifest says {_short(recorded)}, recomputed {_short(recomputed)}"]
    return []


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 120 else s[:117] + "..."


def _run(name: str, fn: Callable[[], list[str]], checks: list[Check]) -> None:
    try:
        problems = fn()
    except DpopsError as exc:
        problems = [f"{name}: {exc}"]
    except (KeyError, TypeError, ValueError) as exc:
        problems = [f"{name}: cannot recompute ({type(exc).__name__}: {exc})"]
    checks.append(Check(name, not problems, problems))


# --------------------------------------------------------------------------- spec


def parse_embedded_spec(spec_document: Mapping[str, Any]) -> Any:
    """Re-validate the embedded spec. A ``public_file`` spec carries the file's parsed content
    (``public_file_content``); it is re-parsed as the equivalent inline list."""
    from dpops.spec import parse_spec

    doc = copy.deepcopy(dict(spec_document))
    parts = doc.get("partitions", {})
    if "public_file_content" in parts:
        content = parts.pop("public_file_content")
        parts["public_file"] = None
        parts["public"] = [row[0] if len(row) == 1 else row for row in content]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # delta warnings were shown when the run was planned
        return parse_spec(doc, source="manifest.spec")


def _check_spec(m: dict[str, Any]) -> list[str]:
    out = []
    h = spec_document_hash(m["spec"])
    if h != m["spec_hash"]:
        out.append(f"spec_hash: manifest says {m['spec_hash']}, the embedded spec hashes to {h} (the spec was edited)")
    if m["run_key"]["spec_hash"] != m["spec_hash"]:
        out.append(f"run_key.spec_hash: {m['run_key']['spec_hash']} differs from spec_hash {m['spec_hash']}")
    if m["run_key"]["release"] != m["spec"].get("name"):
        out.append(f"run_key.release: {m['run_key']['release']!r} is not the spec's name {m['spec'].get('name')!r}")
    parse_embedded_spec(m["spec"])
    for section, value in spec_sections(m["spec"]).items():
        out.extend(diff(m[section], value, section))
    budget = m["spec"]["budget"]
    out.extend(diff(m["privacy"]["requested"], {"epsilon": float(budget["epsilon"]),
                                                "delta": float(budget.get("delta", 0.0))}, "privacy.requested"))
    return out


# --------------------------------------------------------------------------- plan and sensitivity


def _check_plan(m: dict[str, Any]) -> list[str]:
    from dpops.release_plan import plan_release

    spec = parse_embedded_spec(m["spec"])
    plan = plan_release(spec)
    out = diff(m["release_plan"], _jsonable(plan.describe()), "release_plan")
    recomputed_events = [event_to_dict(e) for e in plan.events]
    recorded = [event_to_dict(event_from_dict(e)) for e in m["events"]]
    out.extend(diff(recorded, recomputed_events, "events"))
    return out


def _jsonable(obj: Any) -> Any:
    import json

    return json.loads(json.dumps(obj, allow_nan=False))


def _check_sensitivity(m: dict[str, Any]) -> list[str]:
    from dpops.manifest.sensitivity_check import recompute_sensitivities

    return recompute_sensitivities(m)


# --------------------------------------------------------------------------- accounting, randomness


def _check_accounting(m: dict[str, Any]) -> list[str]:
    from dpops.accounting import get_accountant, known_accountants

    a = m["accountant"]
    out = []
    if a["ref"] != f"{a['name']}/{a['version']}":
        out.append(f"accountant.ref: {a['ref']!r} is not accountant.name/accountant.version ({a['name']}/{a['version']})")
    ref = f"{a['name']}/{a['version']}"
    if ref not in known_accountants():
        out.append(f"accountant.version: {ref} is not a registered accountant version (known: {known_accountants()}); "
                   "the claim cannot be recomputed")
        return out
    scope = m["privacy"]["scope"]
    if scope is not None and scope["accountant"] != ref:
        out.append(f"accountant.version: the run was accounted with {ref}, its scope uses {scope['accountant']}")
    delta = m["privacy"]["run"]["delta"]
    if scope is not None and not _close(delta, scope["cap"]["delta"]):
        out.append(f"privacy.run.delta: {delta} is not the scope's delta {scope['cap']['delta']}")
    eps = run_epsilon(ref, m["events"], delta)
    if not _close(m["privacy"]["run"]["epsilon"], eps):
        out.append(f"privacy.run.epsilon: manifest says {m['privacy']['run']['epsilon']}, "
                   f"{ref} composes the recorded events to {eps} at delta={delta}")
    get_accountant(ref)
    return out


def _check_randomness(m: dict[str, Any]) -> list[str]:
    r = m["randomness"]
    out = []
    if r["test_mode"] != (r["mode"] == "test"):
        out.append(f"randomness.test_mode: {r['test_mode']} contradicts randomness.mode {r['mode']!r}")
    if r["test_mode"] and m["outcome"]["state"] == "published":
        out.append("outcome.state: a test-mode run (seeded noise) can never be published")
    if r["key_id"] != m["run_key"]["key_id"]:
        out.append(f"randomness.key_id: {r['key_id']!r} differs from run_key.key_id {m['run_key']['key_id']!r}")
    return out


# --------------------------------------------------------------------------- ledger


def _check_ledger(m: dict[str, Any], ledger: Any) -> list[str]:
    from dpops.manifest.scope import replay_position

    out = []
    report = ledger.verify()
    if not report.ok:
        out.append(f"ledger: the ledger's hash chain does not verify (first bad entry {report.first_bad_entry}): "
                   + "; ".join(report.problems[:3]))
    rec = ledger.run(m["run_id"])
    refused = m["outcome"]["state"] == "refused"
    if rec is None:
        if not refused or m["ledger"]["entry_ids"]:
            out.append(f"run_id: run {m['run_id']} is not in the ledger")
    else:
        out.extend(diff(m["run_key"], rec.key.to_dict(), "run_key"))
        out.extend(diff(m["events"], [event_to_dict(e) for e in rec.events], "events"))
        want_restates = (m["restates"] or {}).get("run_id")
        if want_restates != rec.restates:
            out.append(f"restates.run_id: manifest says {want_restates!r}, the ledger says {rec.restates!r}")
        if m["privacy"]["scope"] is not None and rec.scope != m["privacy"]["scope"]["name"]:
            out.append(f"privacy.scope.name: {m['privacy']['scope']['name']!r}, the ledger charged scope {rec.scope!r}")
        ids, hashes = m["ledger"]["entry_ids"], m["ledger"]["entry_hashes"]
        if len(ids) != len(hashes):
            out.append(f"ledger.entry_hashes: {len(hashes)} hashes for {len(ids)} entry ids")
        ledger_hash = dict(zip(rec.entry_ids, rec.entry_hashes))
        for i, (eid, h) in enumerate(zip(ids, hashes)):
            if eid not in ledger_hash:
                out.append(f"ledger.entry_ids[{i}]: entry {eid} is not one of the run's ledger entries {rec.entry_ids}")
            elif ledger_hash[eid] != h:
                out.append(f"ledger.entry_hashes[{i}]: manifest says {h}, ledger entry {eid} has {ledger_hash[eid]}")
        if m["outcome"]["state"] == "published" and rec.state not in ("committed", "started"):
            out.append(f"outcome.state: manifest says published, the ledger has the run {rec.state}")
    if m["privacy"]["scope"] is not None:
        replayed, problems = replay_position(ledger, m["privacy"]["scope"])
        out.extend(problems)
        out.extend(diff(m["privacy"]["scope"]["buckets"], replayed["buckets"], "privacy.scope.buckets"))
    return out


# --------------------------------------------------------------------------- entry point


def verify_manifest(manifest: dict[str, Any], *, ledger: Any = None, public_key: str | None = None,
                    source: str = "manifest") -> VerificationResult:
    """Run every check; never raises for a mismatch (see ``VerificationResult.raise_for_problems``)."""
    checks: list[Check] = []
    problems = schema_problems(manifest)
    checks.append(Check("schema", not problems, problems))
    run_id = manifest.get("run_id") if isinstance(manifest, dict) else None
    if problems:
        return VerificationResult(source, run_id, checks)
    m = manifest
    _run("spec", lambda: _check_spec(m), checks)
    _run("plan", lambda: _check_plan(m), checks)
    _run("sensitivity", lambda: _check_sensitivity(m), checks)
    _run("accounting", lambda: _check_accounting(m), checks)
    _run("randomness", lambda: _check_randomness(m), checks)
    if ledger is not None:
        _run("ledger", lambda: _check_ledger(m, ledger), checks)
    else:
        checks.append(Check("ledger", True, skipped="no ledger given: the scope total was not recomputed"))
    if public_key is not None:
        from dpops.manifest.sign import verify_signature

        _run("signature", lambda: (verify_signature(m, public_key), [])[1], checks)
    elif "signature" in m:
        checks.append(Check("signature", True, skipped="signed, but no public key given"))
    return VerificationResult(source, run_id, checks)
