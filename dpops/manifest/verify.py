"""Recompute a manifest's privacy claim from the manifest alone (and, optionally, the ledger).

Steps, each a named check; any mismatch names the manifest field:

1. schema: the document is a valid ``dpops.manifest/1``;
2. spec: the embedded spec re-validates, its hash equals ``spec_hash`` and ``run_key.spec_hash``,
   and the summary sections (privacy unit, adjacency, contribution and value bounds,
   partition strategy) are exactly what the spec says;
3. plan: ``plan_release`` re-run on the embedded spec gives every mechanism, parameter and
   sensitivity recorded in ``release_plan`` and exactly the recorded ``events``;
4. sensitivity: every sensitivity in the plan is recomputed with ``dpops.noise.sensitivity`` from
   the manifest's own bounds and adjacency;
5. accounting: the run's ε, recomputed with the *recorded* accountant version, equals the claim;
6. randomness: a test-mode run never claims to be published;
7. ledger (when given): the ledger's hash chain verifies, the run's key, events, restatement
   link, entry ids and hashes match, and the scope position replays from the entries;
8. signature (when a public key is given);
9. tuning provenance (when the manifest has ``provenance.tuning``): the statement follows from its data and
   a private read names the scope charged; with a ledger, the ``private_access`` entry it names exists on
   that scope with the same fingerprint and time, before the run's first entry.
"""

from __future__ import annotations

import copy
import math
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dpops.errors import DpopsError, IntegrityError
from dpops.events import event_from_dict, event_to_dict
from dpops.manifest.build import run_epsilon, spec_document_hash, spec_sections
from dpops.manifest.schema import schema_problems

if TYPE_CHECKING:  # types only: the checks import the ledger lazily, where they need it
    from dpops.keyref import KeyRing
    from dpops.ledger.model import RunRecord, VerifyReport
    from dpops.ledger.store import Ledger
    from dpops.manifest.files import FileCheck
    from dpops.noise.randomness import NoiseKey
    from dpops.storage.location import Location

REL_TOL = 1e-9  # recomputation is deterministic; this only absorbs float summation order


@dataclass
class Check:
    """One named verification step: ``ok`` with its problems, or ``skipped`` with the reason it could not run."""

    name: str
    ok: bool
    problems: list[str] = field(default_factory=list)
    skipped: str | None = None
    note: str | None = None  # ran, but part of it could not (e.g. one file unreachable)

    def to_dict(self) -> dict[str, Any]:
        """JSON form, as the CLI prints it."""
        return {"name": self.name, "ok": self.ok, "skipped": self.skipped, "problems": self.problems,
                "note": self.note}


@dataclass
class VerificationResult:
    """Every check run on one manifest; ``ok`` only when all of them are."""

    source: str
    run_id: str | None
    checks: list[Check]

    @property
    def ok(self) -> bool:
        """No check found a problem (a skipped check is ok: what could not be checked is reported, not failed)."""
        return all(c.ok for c in self.checks)

    @property
    def problems(self) -> list[str]:
        """Every problem of every check, in check order."""
        return [p for c in self.checks for p in c.problems]

    def to_dict(self) -> dict[str, Any]:
        """JSON form, as the CLI prints it."""
        return {"source": self.source, "run_id": self.run_id, "ok": self.ok,
                "checks": [c.to_dict() for c in self.checks], "problems": self.problems}

    def raise_for_problems(self) -> VerificationResult:
        """Raise IntegrityError listing every problem when any check failed; else return self."""
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
        for i, (a, b) in enumerate(zip(recorded, recomputed, strict=True)):
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


def placeholder_partitions(columns: list[str], types: Mapping[str, str], count: int) -> list[Any]:
    """``count`` distinct inline partitions of the declared column types, standing in for a public file
    whose rows the manifest does not carry (``public_file_count``): the plan, its sensitivities and the
    accounting depend on how many public partitions there are, never on their labels."""
    varying = next((j for j, c in enumerate(columns) if types.get(c) != "bool"), None)
    const = {"string": "", "int": 0, "float": 0.0, "bool": False}
    out: list[Any] = []
    for i in range(count):
        row: list[Any] = []
        for j, c in enumerate(columns):
            t = types.get(c, "string")
            if varying is None:  # all bool: the i-th combination (a file of n distinct rows has n <= 2**k)
                row.append(bool((i >> j) & 1))
            elif j == varying:
                row.append({"string": f"#{i}", "int": i, "float": float(i)}[t])
            else:
                row.append(const[t])
        out.append(row[0] if len(row) == 1 else row)
    return out


def parse_embedded_spec(spec_document: Mapping[str, Any]) -> Any:
    """Re-validate the embedded spec. A ``public_file`` spec carries the file's parsed content
    (``public_file_content``) when the operator marked it publishable; it is re-parsed as the equivalent
    inline list. Otherwise it carries only ``public_file_count`` and is re-parsed with that many
    placeholder partitions (``placeholder_partitions``): what a reviewer cannot check then is which labels
    were published (that the list equals the public file's rows), only how many; the rows are bound to the
    run through its keyed input fingerprint, checkable only by the key holder."""
    from dpops.spec import parse_spec

    doc = copy.deepcopy(dict(spec_document))
    parts = doc.get("partitions", {})
    if "public_file_content" in parts:
        content = parts.pop("public_file_content")
        parts["public_file"] = None
        parts["public"] = [row[0] if len(row) == 1 else row for row in content]
    elif "public_file_count" in parts:
        count = int(parts.pop("public_file_count"))
        parts["public_file"] = None
        parts["public"] = placeholder_partitions(list(parts.get("columns", [])),
                                                 dict(doc.get("input", {}).get("columns", {})), count)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # delta warnings were shown when the run was planned
        return parse_spec(doc, source="manifest.spec")


def _check_spec(m: dict[str, Any]) -> list[str]:
    out = []
    h = spec_document_hash(m["spec"])
    if h != m["spec_hash"]:
        out.append(f"spec_hash: manifest says {m['spec_hash']}, the embedded spec hashes to {h} (the spec was edited)")
    want_hash, want_release = m["spec_hash"], m["spec"].get("name")
    if m.get("estimation") is not None:
        # An estimation's run key names <release>.estimate and hashes the spec with the estimation's
        # configuration (dpops.release.estimation.run_key_of): an edited configuration shows here.
        from dpops.analysis.estimate import RELEASE_SUFFIX, estimation_hash

        want_hash = estimation_hash(m["spec_hash"], m["estimation"]["config"])
        want_release = f"{want_release}{RELEASE_SUFFIX}"
    if m["run_key"]["spec_hash"] != want_hash:
        out.append(f"run_key.spec_hash: {m['run_key']['spec_hash']} differs from "
                   + ("the estimation hash of spec_hash and estimation.config " if m.get("estimation") is not None
                      else "spec_hash ") + want_hash)
    if m["run_key"]["release"] != want_release:
        out.append(f"run_key.release: {m['run_key']['release']!r} is not {want_release!r}")
    parse_embedded_spec(m["spec"])
    for section, value in spec_sections(m["spec"]).items():
        out.extend(diff(m[section], value, section))
    budget = m["spec"]["budget"]
    out.extend(diff(m["privacy"]["requested"], {"epsilon": float(budget["epsilon"]),
                                                "delta": float(budget.get("delta", 0.0))}, "privacy.requested"))
    return out


def _check_unit_definition(m: dict[str, Any]) -> list[str]:
    """The embedded spec has the unit definition the manifest says its scope records (issue 19 item 1).

    From the manifest alone: a release is admitted only when its unit column, adjacency, record level
    and (where the scope records one) time rule are the scope's, so a manifest whose spec differs was
    either edited or admitted by a dpops that did not check; both make its claim unsupported. The
    ledger check then compares the recorded definition with the ledger's.
    """
    from dpops.inputs import time_rule_of

    scope = m["privacy"]["scope"]
    if scope is None or "definition" not in scope:
        return []
    d = scope["definition"]
    spec = parse_embedded_spec(m["spec"])
    unit = spec.privacy_unit
    out = []
    for field_name, mine in (("unit_column", unit.column), ("adjacency", unit.adjacency),
                             ("record_level", bool(unit.record_level))):
        if d.get(field_name) != mine:
            out.append(f"privacy.scope.definition.{field_name}: the scope records {d.get(field_name)!r}, the "
                       f"embedded spec declares {mine!r}: the release was not checked against its scope's unit")
    recorded_time = d.get("time")
    if recorded_time is not None:
        rule = time_rule_of(spec)
        mine_time = rule.to_dict() if rule is not None else None
        if mine_time != recorded_time:
            out.append(f"privacy.scope.definition.time: the scope records the time rule {recorded_time}, the embedded "
                       f"spec's is {mine_time} (input.time_column): the same rows would fall in other buckets")
    elif d.get("bucket") is not None and "time" in d:
        out.append("privacy.scope.definition.time: a bucketed scope records no time rule, so no release on it "
                   "can have been checked against one")
    return out


# --------------------------------------------------------------------------- plan and sensitivity


def _check_plan(m: dict[str, Any]) -> list[str]:
    from dpops.release_plan import plan_release

    spec = parse_embedded_spec(m["spec"])
    plan = plan_release(spec)
    described = _jsonable(plan.describe())
    parts = m["spec"].get("partitions", {})
    if "public_file_content" in parts or "public_file_count" in parts:
        # Re-parsed as an inline list, the spec hashes differently; the embedded document's own hash is the
        # plan's (checked against spec_hash by the spec check).
        described["spec_hash"] = spec_document_hash(m["spec"])
    out = diff(m["release_plan"], described, "release_plan")
    recomputed_events = [event_to_dict(e) for e in plan.events]
    if m.get("estimation") is not None:  # an estimation charges its own mechanisms, not the release plan's
        from dpops.analysis.estimate import recompute_section

        recomputed_events = recompute_section(m, spec)[1]
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
        out.append(f"accountant.ref: {a['ref']!r} is not accountant.name/accountant.version "
                   f"({a['name']}/{a['version']})")
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


def _check_accuracy(m: dict[str, Any]) -> list[str]:
    """The recorded targets' predictions recompute from the embedded spec's plan (issue 20)."""
    from dpops.analysis.document import recompute_manifest_section

    spec = parse_embedded_spec(m["spec"])
    return diff(m["accuracy"], _jsonable(recompute_manifest_section(spec, m["accuracy"])), "accuracy")


def _check_estimation(m: dict[str, Any]) -> list[str]:
    """A bound estimation's mechanisms (shares, utility sensitivities from the manifest's own bounds and
    unit definition), its spec patch and its events recompute from the embedded spec, the configuration and
    the recorded result alone (``dpops.analysis.estimate.recompute_section``); the shares compose to at
    most the requested epsilon."""
    from dpops.analysis.estimate import recompute_section

    section, _ = recompute_section(m, parse_embedded_spec(m["spec"]))
    out = diff(m["estimation"], _jsonable(section), "estimation")
    total = sum(float(x["epsilon"]) for x in m["estimation"]["mechanisms"])
    if total > float(m["estimation"]["config"]["epsilon"]) * (1 + REL_TOL):
        out.append(f"estimation.mechanisms: the shares sum to {total}, above the requested "
                   f"estimation.config.epsilon {m['estimation']['config']['epsilon']}")
    return out


def _check_dependencies(m: dict[str, Any], ledger: Ledger | None, manifests_dir: Any,
                        chain_report: VerifyReport | None) -> list[str]:
    """A release whose bounds came from an estimation (spec ``estimated_from``) names it in ``dependencies``,
    and the estimation's own manifest verifies (its claim recomputed as any manifest's), estimates the
    release's spec, and its result is what the release's spec declares (the patch applied). Privacy reason:
    the release's bounds are only public because the estimation was charged; a reviewer must see that
    charge, and that the bounds used are the charged ones."""
    from dpops.manifest.io import find_manifest, read_manifest

    wanted = m["spec"].get("estimated_from")
    recorded = [d["run_id"] for d in (m.get("dependencies") or {}).get("estimations", [])]
    if recorded != ([wanted] if wanted else []):
        return [f"dependencies.estimations: manifest names {recorded}, the embedded spec's estimated_from is "
                f"{wanted!r}"]
    if not wanted:
        return []
    out: list[str] = []
    if ledger is not None:  # the rule release run applies before reservation (issue 25 item 4): one owner
        from dpops.manifest.dependencies import check_dependency

        out.extend(check_dependency(parse_embedded_spec(m["spec"]), ledger, str(m["randomness"]["mode"])))
    if manifests_dir is None:
        return [*out, f"dependencies: the manifest of estimation {wanted} cannot be looked up (no manifests "
                      "directory given): verify with --manifests DIR"]
    try:
        dep = read_manifest(find_manifest(wanted, manifests_dir))
    except DpopsError as exc:
        return [*out, f"dependencies.estimations[0]: estimation {wanted}: {exc}"]
    if dep.get("estimation") is None:
        return [*out, f"dependencies.estimations[0]: run {wanted}'s manifest is not an estimation's"]
    if dep["randomness"].get("test_mode") and not m["randomness"].get("test_mode"):
        out.append(f"dependencies.estimations[0]: estimation {wanted} used test-mode (seeded) randomness, so it "
                   "never feeds a release with keyed or os randomness")
    res = verify_manifest(dep, ledger=ledger, source=f"estimation {wanted}", check_files=False,
                          chain_report=chain_report, manifests_dir=manifests_dir)
    out.extend(f"dependencies.estimations[0] (estimation {wanted}): {p}" for p in res.problems)
    if dep["spec"].get("name") != m["spec"].get("name"):
        out.append(f"dependencies.estimations[0]: estimation {wanted} estimated release {dep['spec'].get('name')!r}, "
                   f"not {m['spec'].get('name')!r}")
    if (dep["privacy"]["scope"] or {}).get("name") != (m["privacy"]["scope"] or {}).get("name"):
        out.append(f"dependencies.estimations[0]: estimation {wanted} was charged to scope "
                   f"{(dep['privacy']['scope'] or {}).get('name')!r}, this release to "
                   f"{(m['privacy']['scope'] or {}).get('name')!r}")
    result = dep["estimation"]["result"]
    mine = m["contribution_bounds"]
    for k in ("max_partitions_per_unit", "max_rows_per_unit_per_partition"):
        if result.get(k) is not None and int(result[k]) != int(mine[k]):
            out.append(f"contribution_bounds.{k}: {mine[k]}, but estimation {wanted} estimated {result[k]}")
    for metric in m["spec"]["metrics"]:
        col, b = metric.get("column"), metric.get("bounds")
        est = (result.get("bounds") or {}).get(col) if col else None
        if est is not None and b is not None and [float(x) for x in b] != [float(x) for x in est]:
            out.append(f"spec.metrics: {col} bounds {list(b)}, but estimation {wanted} estimated {list(est)}")
    return out


def _check_tuning(m: dict[str, Any]) -> list[str]:
    """``provenance.tuning`` says what its own fields imply (issue 20 section 3): the statement is the one its
    data source and date give, and a private read was recorded on the scope this release charges.

    Privacy reason: the statement is what a reviewer reads; a milder sentence, or a read recorded on another
    scope, would hide that the bounds came from looking at this scope's private data."""
    from dpops.spec import TuningSpec

    t = m["provenance"]["tuning"]
    spec_block = TuningSpec.model_validate({k: t[k] for k in ("candidate", "loss", "candidates", "not_evaluated",
                                                               "data")})
    out = []
    if t["statement"] != spec_block.statement:
        out.append(f"provenance.tuning.statement: manifest says {t['statement']!r}, its data gives "
                   f"{spec_block.statement!r}")
    d = t["data"]
    if d["source"] == "private":
        if d["statement"] != spec_block.statement:
            out.append(f"provenance.tuning.data.statement: manifest says {d['statement']!r}, its read_at gives "
                       f"{spec_block.statement!r}")
        charged = m["spec"]["budget"]["scope"]
        if d["scope"] != charged:
            out.append(f"provenance.tuning.data.scope: the private read was recorded on scope {d['scope']!r}, this "
                       f"release charges scope {charged!r}")
    return out


def _check_tuning_ledger(m: dict[str, Any], ledger: Ledger) -> list[str]:
    """A private read named by ``provenance.tuning`` is a ``private_access`` entry of the ledger on that scope,
    with the recorded fingerprint and time, written before this run's first entry.

    Privacy reason: the entry is the durable record of a non-DP look at the data; a manifest pointing at no
    entry, at another one, or at one written after the release, would claim an accountability that does not
    exist (or hide the real read)."""
    d = m["provenance"]["tuning"]["data"]
    if d["source"] != "private":
        return []
    where = f"provenance.tuning.data.ledger_entry: entry {d['ledger_entry']}"
    scope = d["scope"]
    try:
        history = ledger.history(scope)
    except DpopsError as exc:  # an unknown scope: named by the ledger's own refusal
        return [f"{where}: {exc}"]
    entry = next((e for e in history if int(e.id) == int(d["ledger_entry"])), None)
    if entry is None:
        return [f"{where} is not an entry of scope {scope!r} in the ledger"]
    out = []
    if entry.kind != "private_access":
        out.append(f"{where} is a {entry.kind!r} entry, not a private_access one")
    if (entry.data or {}).get("fingerprint") != d["fingerprint"]:
        out.append(f"provenance.tuning.data.fingerprint: manifest says {d['fingerprint']!r}, ledger entry "
                   f"{entry.id} recorded {(entry.data or {}).get('fingerprint')!r}")
    if entry.ts != d["read_at"]:
        out.append(f"provenance.tuning.data.read_at: manifest says {d['read_at']}, ledger entry {entry.id} was "
                   f"written at {entry.ts}")
    first = min((int(i) for i in m["ledger"]["entry_ids"]), default=None)
    if first is not None and int(entry.id) > first:
        out.append(f"{where} was written after this run's first ledger entry #{first}: the read cannot have chosen "
                   "this release's bounds")
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
    # The key id's form is fixed by the mode (dpops.release.RunContext.run_key_id), and the key id is part
    # of the run key and so of the run id: an edited mode cannot keep a key id of another mode's form.
    # Privacy reason: "os" tells a reviewer the noise cannot be recomputed by anyone, "keyed" that a
    # key holder can; claiming the wrong one misstates who can reproduce the noise.
    kid = str(r["key_id"])
    form = "os" if _OS_KEY_ID.match(kid) else "test" if _TEST_KEY_ID.match(kid) else \
        "invalid" if kid.startswith(("os/", "test/")) else "keyed"
    if form != r["mode"]:
        out.append(f"randomness.mode: manifest says {r['mode']!r}, but the run's key id {kid!r} has the form of "
                   f"{form!r} randomness")
    return out


def _check_identity(m: dict[str, Any]) -> list[str]:
    """Self-consistency a forger must keep: the run id is the hash of the run key (so an edited input
    fingerprint or key id shows), the charge flag follows the outcome, the accountant's description is
    the registered one."""
    from dpops.accounting import get_accountant, known_accountants
    from dpops.ledger.model import RunKey
    from dpops.manifest.build import CHARGED_LEDGER_STATES

    out = []
    rid = RunKey(**{k: m["run_key"][k] for k in ("release", "spec_hash", "interval_start", "interval_end",
                                                 "input_fingerprint", "key_id")}).run_id
    if rid != m["run_id"]:
        out.append(f"run_id: manifest says {m['run_id']}, the run key hashes to {rid} (the run key was edited)")
    o = m["outcome"]
    charged = o["ledger_state"] in CHARGED_LEDGER_STATES if o["ledger_state"] else \
        o["state"] in ("published", "spent_unpublished")
    if m["privacy"]["run"]["charged"] != charged:
        out.append(f"privacy.run.charged: manifest says {m['privacy']['run']['charged']}, but outcome "
                   f"{o['state']!r} (ledger state {o['ledger_state']!r}) means {charged}")
    ref = m["accountant"]["ref"]
    if ref in known_accountants():
        # The library versions are provenance (an upgrade must not fail old manifests); the rest is the method.
        strip = lambda d: {k: v for k, v in dict(d).items() if k != "libraries"}  # noqa: E731
        out.extend(diff(strip(m["accountant"]["details"]), strip(_jsonable(get_accountant(ref).describe())),
                        "accountant.details"))
    return out


_OS_KEY_ID = re.compile(r"^os/attempt-[0-9]+$")
_TEST_KEY_ID = re.compile(r"^test/seed-[0-9]+$")


def _check_scope_arithmetic(m: dict[str, Any]) -> list[str]:
    """Each bucket's ``remaining`` is ``cap.value - total``: an edited cap (or remaining) without the ledger."""
    scope = m["privacy"]["scope"]
    out: list[str] = []
    if scope is None:
        return out
    cap = scope["cap"]["value"]
    for i, b in enumerate(scope["buckets"]):
        if b["total"] is None or b["remaining"] is None:
            continue
        if not _close(b["remaining"], cap - b["total"]):
            out.append(f"privacy.scope.buckets[{i}].remaining: {b['remaining']} is not privacy.scope.cap.value "
                       f"{cap} minus the total {b['total']} (the cap or the remaining budget was edited)")
    return out


# --------------------------------------------------------------------------- ledger


def _check_ledger(m: dict[str, Any], ledger: Ledger, chain_report: VerifyReport | None = None) -> list[str]:
    from dpops.manifest.scope import replay_position

    out = []
    report = chain_report if chain_report is not None else ledger.verify()
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
        out.extend(_check_replaces_spent(m, rec, ledger))
        want_restates = (m["restates"] or {}).get("run_id")
        if want_restates != rec.restates:
            out.append(f"restates.run_id: manifest says {want_restates!r}, the ledger says {rec.restates!r}")
        if m["privacy"]["scope"] is not None and rec.scope != m["privacy"]["scope"]["name"]:
            out.append(f"privacy.scope.name: {m['privacy']['scope']['name']!r}, the ledger charged scope {rec.scope!r}")
        ids, hashes = m["ledger"]["entry_ids"], m["ledger"]["entry_hashes"]
        if len(ids) != len(hashes):
            out.append(f"ledger.entry_hashes: {len(hashes)} hashes for {len(ids)} entry ids")
        # strict=False: a length mismatch is reported above (or by the chain check), not raised
        ledger_hash = dict(zip(rec.entry_ids, rec.entry_hashes, strict=False))
        for i, (eid, h) in enumerate(zip(ids, hashes, strict=False)):
            if eid not in ledger_hash:
                out.append(f"ledger.entry_ids[{i}]: entry {eid} is not one of the run's ledger entries {rec.entry_ids}")
            elif ledger_hash[eid] != h:
                out.append(f"ledger.entry_hashes[{i}]: manifest says {h}, ledger entry {eid} has {ledger_hash[eid]}")
        if m["outcome"]["state"] == "published" and rec.state not in ("committed", "started"):
            out.append(f"outcome.state: manifest says published, the ledger has the run {rec.state}")
        out.extend(_check_output_location(m, rec))
        out.extend(_check_outcome_against_ledger(m, rec, ledger))
        ledger_mode = (rec.details or {}).get("randomness")
        if isinstance(ledger_mode, str) and ledger_mode != m["randomness"]["mode"]:
            out.append(f"randomness.mode: manifest says {m['randomness']['mode']!r}, the ledger reserved the run with "
                       f"{ledger_mode!r} randomness")
    if m["privacy"]["scope"] is not None:
        out.extend(_check_cap(m["privacy"]["scope"], ledger))
    if m["privacy"]["scope"] is not None:
        replayed, problems = replay_position(ledger, m["privacy"]["scope"])
        out.extend(problems)
        out.extend(diff(m["privacy"]["scope"]["buckets"], replayed["buckets"], "privacy.scope.buckets"))
    return out


def _check_replaces_spent(m: dict[str, Any], rec: RunRecord, ledger: Ledger) -> list[str]:
    """A fresh attempt's link: the ledger reserved the run with the same link, and the run it names is a
    spent_unpublished run of the same release and interval. Privacy reason: the link is what tells a
    reviewer that the interval was charged twice (the spent charge stays) and why; a forged or dropped
    link would hide a second charge or claim one that never happened."""
    claimed = m.get("replaces_spent")
    recorded = (rec.details or {}).get("replaces_spent")
    out: list[str] = []
    if (claimed or {}).get("run_id") != (recorded or {}).get("run_id") or \
            (claimed or {}).get("reason", "") != (recorded or {}).get("reason", ""):
        out.append(f"replaces_spent: manifest says {_short(claimed)}, the ledger reserved run {rec.run_id} with "
                   f"{_short(recorded)}")
        return out
    if not claimed:
        return out
    spent = ledger.run(claimed["run_id"])
    if spent is None:
        return [f"replaces_spent.run_id: run {claimed['run_id']} is not in the ledger"]
    if spent.state != "spent_unpublished":
        out.append(f"replaces_spent.run_id: run {spent.run_id} is {spent.state}, not spent_unpublished")
    for k in ("release", "interval_start", "interval_end"):
        if getattr(spent.key, k) != m["run_key"][k]:
            out.append(f"replaces_spent.run_id: run {spent.run_id} has {k} {getattr(spent.key, k)!r}, this run "
                       f"{m['run_key'][k]!r}")
    return out


def _check_outcome_against_ledger(m: dict[str, Any], rec: RunRecord, ledger: Ledger) -> list[str]:
    """The outcome and the ledger state the manifest records are ones the ledger's entries show for the run."""
    out = []
    state, recorded = m["outcome"]["state"], m["outcome"]["ledger_state"]
    if state == "refused":
        problem = _refusal_before_run(m, rec)
        if problem:
            out.append(problem)
    elif state == "spent_unpublished" and rec.state != "spent_unpublished":
        out.append(f"outcome.state: manifest says spent_unpublished, the ledger has the run {rec.state}")
    if recorded is not None:
        kinds = {e.kind for e in ledger.history(rec.scope) if e.run_id == rec.run_id}
        if recorded not in kinds:
            out.append(f"outcome.ledger_state: manifest says {recorded!r}, the ledger's entries for the run are "
                       f"{sorted(kinds)}")
    return out


def _refusal_before_run(m: dict[str, Any], rec: RunRecord) -> str | None:
    """A refusal manifest is a true record of its moment: the same run key may be reserved (and published)
    later, after a cap raise. It contradicts the ledger only if the run already had ledger entries when the
    refusal was written: the refusal names the ledger position it saw (``privacy.scope.history.
    through_entry_id``), and every entry of the run must come after it (else, without a position, the
    refusal must predate the run's first entry). Privacy reason: a refusal claims nothing was charged at
    that moment; a run charged before it would make that claim false."""
    scope = m["privacy"]["scope"]
    through = (scope or {}).get("history", {}).get("through_entry_id") if scope else None
    first = min((int(i) for i in rec.entry_ids), default=None)
    if m["ledger"]["entry_ids"]:
        return (f"outcome.state: manifest says refused (nothing charged) but names the ledger entries "
                f"{m['ledger']['entry_ids']} of run {rec.run_id} ({rec.state})")
    if through is not None and first is not None:
        if first > int(through):
            return None
        return (f"outcome.state: manifest says refused (nothing charged) at ledger entry #{through}, but run "
                f"{rec.run_id} already had ledger entry #{first} ({rec.state})")
    if first is not None and str(m["created_at"]) <= str(rec.created_at):
        return None
    return (f"outcome.state: manifest says refused (nothing charged) at {m['created_at']}, the ledger has run "
            f"{rec.run_id} {rec.state} since {rec.created_at}")


def _check_output_location(m: dict[str, Any], rec: RunRecord) -> list[str]:
    """The published location is the one the ledger committed (a manifest pointing at another
    version would make a reviewer check, and a reader trust, files this run never produced)."""
    out: list[str] = []
    uri = (m.get("output") or {}).get("uri")
    if m["outcome"]["state"] != "published" or rec.state != "committed" or rec.output_uri is None:
        return out  # started: the commit (and so the committed location) comes after the manifest
    if uri != rec.output_uri:
        out.append(f"output.uri: manifest says {uri!r}, the ledger committed the run's output at {rec.output_uri!r}")
    return out


def scope_definition_at(ledger: Ledger, name: str, through_entry_id: int | None) -> dict[str, Any] | None:
    """The scope's definition as it stood after entry ``through_entry_id`` (creation, then each entry that sets
    a definition: a cap change, a pinned time rule)."""
    from dpops.ledger.model import definition_set_by

    definition = None
    for e in ledger.history(name):
        if through_entry_id is not None and int(e.id) > int(through_entry_id):
            break
        d = definition_set_by(e.kind, e.data)
        if d is not None and (definition is not None or e.kind == "scope_created"):
            definition = d
    return definition


def _check_cap(scope: dict[str, Any], ledger: Ledger) -> list[str]:
    """The recorded cap is the one in force when the manifest was written (a later, legitimate cap
    change does not make an old manifest wrong; an edited cap overstates the budget the unit had)."""
    from dpops.ledger.model import ScopeDefinition

    d = scope_definition_at(ledger, scope["name"], scope["history"]["through_entry_id"])
    if d is None:
        return [f"privacy.scope.name: the ledger has no creation entry for scope {scope['name']!r}"]
    sdef = ScopeDefinition.from_dict(d)
    out = []
    want = {"unit": sdef.cap_unit, "value": float(sdef.cap), "delta": float(sdef.delta)}
    for k, v in want.items():
        if not _close(scope["cap"][k], v):
            out.append(f"privacy.scope.cap.{k}: manifest says {_short(scope['cap'][k])}, the ledger's cap at entry "
                       f"#{scope['history']['through_entry_id']} was {_short(v)}")
    return out


def committed_manifest_problems(rec: RunRecord | None, file_name: str, file_digest: str, *,
                                required: bool = False) -> list[str]:
    """Compare a manifest file with the name and sha256 the ledger's commit entry of ``rec`` recorded.

    ``required``: a commit entry that records no manifest, or another file, is a problem too (a caller that
    acts on the manifest's content, e.g. serving a committed estimation, must have the recorded one); without
    it such a manifest is not comparable and passes (a correction, a run committed before the field)."""
    recorded = ((rec.details or {}).get("commit") or {}).get("manifest") if rec is not None else None
    if not isinstance(recorded, dict) or recorded.get("file") != file_name:
        return ([f"manifest file {file_name}: the ledger's commit entry records "
                 f"{recorded.get('file') if isinstance(recorded, dict) else 'no manifest'!r}"] if required else [])
    if recorded.get("sha256") != file_digest:
        return [f"manifest file {file_name}: its sha256 differs from the one the ledger recorded when the run was "
                "committed (the file was edited after publication)"]
    return []


def _check_file_digest(m: dict[str, Any], ledger: Ledger, file_name: str, file_digest: str) -> list[str]:
    """The ledger's commit entry records the manifest file's sha256: any byte changed since is caught."""
    return committed_manifest_problems(ledger.run(m["run_id"]), file_name, file_digest)


def _file_check(name: str, result: Any, *, no_key: bool = False) -> Check:
    """One file check: failed with problems, skipped when nothing could be compared (with the reason; "no
    noise key" when that is why), ok, with a note naming any part that could not run."""
    if result.problems:
        return Check(name, False, result.problems)
    if not result.ran:
        why = "; ".join(result.not_checked)
        return Check(name, True, skipped=(f"no noise key (--key-file or $DPOPS_NOISE_KEY_FILE): {why}" if no_key
                                          else f"NOT CHECKED: {why}"))
    note = ("partly: " + "; ".join(result.not_checked)) if result.not_checked else None
    return Check(name, True, note=note)


def _pointer_check(version_dir: Location | None, ledger: Ledger, rec: RunRecord,
                   key: NoiseKey | KeyRing | None) -> FileCheck:
    """The interval's versions and ``current`` pointer against the ledger (``check_published_pointer``).

    The interval is the parent of the published version (``<root>/published/<release>/<interval>/<v>``)."""
    from dpops.manifest.files import FileCheck, check_published_pointer
    from dpops.storage import open_store

    if version_dir is None:
        return FileCheck(not_checked=["published pointer: the manifest names no output location"])
    interval = version_dir.parent
    if interval.parent.name != rec.key.release or interval.parent.parent.name != "published":
        return FileCheck()  # not a dpops store's layout: no versions or pointer there to compare
    store = open_store(interval.parent.parent.parent, rec.key.release)
    return check_published_pointer(store, interval.name, ledger, rec, key=key)


def _check_published_files(m: dict[str, Any], ledger: Ledger | None, key: NoiseKey | KeyRing | None) -> list[Check]:
    """The published bytes are still the ones fingerprinted at publication (see dpops.manifest.files): the
    manifest's keyed fingerprints (needs the noise key) and, with a ledger, the commit entry's digests, as two
    checks, so a check that could not run for want of the key is listed as skipped, never as ok."""
    from dpops.manifest.files import check_ledger_files, check_manifest_files, merge, uri_directory

    ledger_part = None
    try:
        keyed = check_manifest_files(m, key=key)
        if ledger is not None and m["outcome"]["state"] == "published":
            rec = ledger.run(m["run_id"])
            if rec is not None and rec.state == "committed":
                version_dir = uri_directory((m.get("output") or {}).get("uri"))
                ledger_part = merge(check_ledger_files(rec, version_dir), _pointer_check(version_dir, ledger, rec, key))
    except DpopsError as exc:
        return [Check("published files", False, [f"published files: {exc}"])]
    from dpops.keyref import key_for_record

    no_key = key_for_record(key, str(m["run_key"]["key_id"])) is None
    out = [_file_check("published files", keyed, no_key=no_key)]
    if ledger_part is not None:
        out.append(_file_check("published files (ledger digests)", ledger_part))
    return out


# --------------------------------------------------------------------------- entry point


def verify_manifest(manifest: dict[str, Any], *, ledger: Ledger | None = None, public_key: str | None = None,
                    source: str = "manifest", file_name: str | None = None, file_digest: str | None = None,
                    require_signature: bool = False, key: NoiseKey | KeyRing | None = None,
                    check_files: bool = True,
                    chain_report: VerifyReport | None = None, manifests_dir: Any = None) -> VerificationResult:
    """Run every check; never raises for a mismatch (see ``VerificationResult.raise_for_problems``).

    ``file_name``/``file_digest``: the manifest file's base name and sha256, compared (with a ledger)
    to what the run's commit entry recorded. ``require_signature``: a missing or unverifiable
    signature is a failure, not a note. ``key``: the noise key (``NoiseKey``), or a ``KeyRing`` holding the
    keys of earlier rotations (each check then uses the key its record names), to check the published
    files' keyed fingerprints and bindings; ``check_files``: compare the published files at ``output.uri`` with the
    manifest (and the ledger's commit entry) -- a check that cannot run says why. ``chain_report``: a
    ``ledger.verify()`` result to reuse when verifying many manifests against one ledger. ``manifests_dir``:
    where to find the manifests of the runs this one depends on (an estimation named by ``estimated_from``);
    they are verified too."""
    checks: list[Check] = []
    problems = schema_problems(manifest)
    checks.append(Check("schema", not problems, problems))
    run_id = manifest.get("run_id") if isinstance(manifest, dict) else None
    if problems:
        return VerificationResult(source, run_id, checks)
    m = manifest
    _run("spec", lambda: _check_spec(m), checks)
    _run("unit definition", lambda: _check_unit_definition(m), checks)
    _run("plan", lambda: _check_plan(m), checks)
    _run("sensitivity", lambda: _check_sensitivity(m), checks)
    _run("accounting", lambda: _check_accounting(m), checks)
    _run("randomness", lambda: _check_randomness(m), checks)
    _run("scope arithmetic", lambda: _check_scope_arithmetic(m), checks)
    _run("identity", lambda: _check_identity(m), checks)
    if m.get("accuracy") is not None:
        _run("accuracy", lambda: _check_accuracy(m), checks)
    tuned = (m.get("provenance") or {}).get("tuning") is not None
    if tuned:
        _run("tuning provenance", lambda: _check_tuning(m), checks)
    if m.get("estimation") is not None:
        _run("estimation", lambda: _check_estimation(m), checks)
    if m["spec"].get("estimated_from") or m.get("dependencies") is not None:
        _run("dependencies", lambda: _check_dependencies(m, ledger, manifests_dir, chain_report), checks)
    if ledger is not None:
        _run("ledger", lambda: _check_ledger(m, ledger, chain_report)
             + (_check_file_digest(m, ledger, file_name, file_digest) if file_name and file_digest else []), checks)
        if tuned:
            _run("tuning provenance (ledger)", lambda: _check_tuning_ledger(m, ledger), checks)
    else:
        checks.append(Check("ledger", True, skipped="no ledger given: the scope total, cap and output location "
                                                    "were not compared with the ledger"))
    # nothing was published otherwise; an estimation publishes no files (its result is in the manifest)
    if check_files and m["outcome"]["state"] == "published" and m.get("estimation") is None:
        checks.extend(_check_published_files(m, ledger, key))
    if public_key is not None:
        from dpops.manifest.sign import verify_signature

        _run("signature", lambda: (verify_signature(m, public_key), [])[1], checks)
    elif require_signature:
        checks.append(Check("signature", False, ["signature: a valid signature is required, but no public key was "
                                                 "given to check it (--public-key)"]))
    elif "signature" in m:
        # Anyone can attach bytes that look like a signature: without the public key nothing was checked.
        checks.append(Check("signature", True, skipped="unverified signature: the manifest carries a signature, but "
                                                       "no public key was given to check it"))
    return VerificationResult(source, run_id, checks)
