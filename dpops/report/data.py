"""What the reviewer's report shows, gathered from the ledger and the manifests (public facts only)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpops.accounting import get_accountant, known_accountants
from dpops.errors import DpopsError, IntegrityError, StorageError
from dpops.ledger.backend import redact
from dpops.ledger.model import CHARGED_STATES as CHARGED  # the one owner of the charged states

COMPARED = ("basic", "zcdp", "rdp", "pld")


@dataclass
class RunRow:
    run_id: str
    release: str
    interval_start: str
    interval_end: str
    state: str  # ledger state, or "refused" for a refusal known only from its manifest
    epsilon: float | None
    restates: str | None
    created_at: str
    updated_at: str
    buckets: list[str]
    events: list[Any]
    manifest: str | None = None  # path of the newest manifest of this run
    reason: str | None = None
    key_id: str | None = None
    test_mode: bool = False
    verification: str = "no manifest"  # verified | verified (partly) | FAILED | no manifest
    flags: list[str] = field(default_factory=list)  # off-schedule / misaligned / overlapping interval
    kind: str = "run"  # run | gap
    replaces_spent: str | None = None  # a fresh attempt: the spent_unpublished run it replaces (charged again)
    fresh_reason: str | None = None  # the operator's reason for that fresh attempt (ledger; the manifest says it too)
    entry_id: int = 0  # the run's first ledger entry (its reservation): the ledger's order of charges

    @property
    def charged_epsilon(self) -> float | None:
        """What this run charged the scope on its own: its ε for a state whose events count against the cap
        (``CHARGED_STATES``), 0 for a refused or refunded run (``epsilon`` then is what it asked). Privacy
        reason: a reviewer adds this column up to check the cap; counting a refusal's request would show a
        cap broken that the ledger kept (issue 28 item 4)."""
        if self.state in CHARGED:
            return self.epsilon
        return 0.0


@dataclass
class ManifestCheck:
    """The outcome of verifying one manifest file for the report (a forged one must not look trusted)."""

    path: str
    run_id: str | None
    ok: bool
    status: str  # verified | verified (partly) | FAILED
    problems: list[str] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)
    files: str = "not checked"  # ok | CHANGED | not checked
    signature: str = "none"  # valid | unverified | none | FAILED


@dataclass
class ReportData:
    scope: Any  # ScopeDefinition
    status: Any  # ScopeStatus
    runs: list[RunRow]
    manifests: dict[str, dict[str, Any]]  # path -> manifest
    comparison: dict[str, float | None]
    adjacencies: list[str]
    contribution: list[dict[str, Any]]
    noise: list[dict[str, Any]]
    warnings: list[str] = field(default_factory=list)
    start: str | None = None
    end: str | None = None
    checks: dict[str, ManifestCheck] = field(default_factory=dict)  # path -> verification
    provenance: dict[str, Any] = field(default_factory=dict)
    releases: list[dict[str, Any]] = field(default_factory=list)  # per run with a verified manifest
    # Per spec given (--spec): every interval of its grid in the window with no publication, and why.
    backfill_gaps: list[dict[str, Any]] = field(default_factory=list)
    gap_specs: list[str] = field(default_factory=list)
    # Private bound estimations (``dpops estimate``) charged to the scope, from their verified manifests.
    estimations: list[dict[str, Any]] = field(default_factory=list)

    @property
    def trusted(self) -> dict[str, dict[str, Any]]:
        """Manifests that verified: only their numbers are shown as facts."""
        return {p: m for p, m in self.manifests.items() if p in self.checks and self.checks[p].ok}


def _load_manifests(directory: str | os.PathLike[str] | None, scope: str
                    ) -> tuple[dict[str, dict[str, Any]], dict[str, ManifestCheck], dict[str, str]]:
    """Readable manifests of ``scope``, a FAILED check for each file that is not a valid manifest (shown in the
    report, never silently dropped: a reviewer must see that something is wrong), and each readable file's
    sha256 of the bytes parsed (one read: the digest checked against the ledger is of the document shown)."""
    from dpops.manifest.io import read_manifest_and_digest

    out: dict[str, dict[str, Any]] = {}
    bad: dict[str, ManifestCheck] = {}
    digests: dict[str, str] = {}
    if directory is None:
        return out, bad, digests
    for p in _manifest_files(directory):
        try:
            m, digest = read_manifest_and_digest(p)
        except (IntegrityError, StorageError) as exc:
            bad[str(p)] = ManifestCheck(str(p), None, False, "FAILED", [str(exc).splitlines()[0][:300]])
            continue
        if m["spec"]["budget"]["scope"] == scope:
            out[str(p)] = m
            digests[str(p)] = digest
    return out, bad, digests


def _manifest_files(directory: str | os.PathLike[str]) -> list[str]:
    """Every ``*.json`` below a local directory or an object-store prefix (``s3://bucket/manifests``), sorted.

    A URI is never turned into a ``Path``: that collapsed ``s3://`` into ``s3:/`` (issue 19 item 11)."""
    from dpops.storage import files
    from dpops.storage.location import Location, is_uri

    text = os.fspath(directory)
    if is_uri(text) and not Location.parse(text).is_local:
        loc = Location.parse(text)
        try:
            names = files.list_files(loc)
        except OSError as exc:
            raise StorageError(f"cannot list the manifest directory {loc.uri}: {type(exc).__name__}") from None
        if not names:
            raise StorageError(f"manifest directory {loc.uri} does not exist or holds no manifest")
        return [str(loc / n) for n in names if n.endswith(".json")]
    d = Location.parse(text).local_path if is_uri(text) else Path(text)
    if not d.is_dir():
        raise StorageError(f"manifest directory {d} does not exist")
    return [str(p) for p in sorted(d.rglob("*.json"))]


def _folder_of(path: str) -> str | Any:
    """The directory of a manifest (where the manifests of the runs it depends on are looked up)."""
    from dpops.storage.location import Location, is_uri

    if is_uri(path):
        loc = Location.parse(path)
        return str(loc.local_path.parent) if loc.is_local else loc.parent
    return os.path.dirname(os.path.abspath(path))


def _verify_all(manifests: dict[str, dict[str, Any]], digests: dict[str, str], ledger: Any, key: Any,
                public_key: str | None) -> dict[str, ManifestCheck]:
    from dpops.manifest.verify import verify_manifest

    out = {}
    try:
        chain = ledger.verify() if manifests else None  # once for all manifests, not once each
    except Exception:  # noqa: BLE001 - each manifest's ledger check then reports it
        chain = None
    for path, m in manifests.items():
        r = verify_manifest(m, ledger=ledger, key=key, public_key=public_key, source=path,
                            file_name=os.path.basename(path), file_digest=digests[path], chain_report=chain,
                            manifests_dir=_folder_of(path))
        by = {c.name: c for c in r.checks}
        not_checked = [f"{c.name}: {c.skipped}" for c in r.checks if c.skipped]
        not_checked += [f"{c.name}: {c.note}" for c in r.checks if c.note]
        files = by.get("published files")
        files_state = ("n/a" if files is None and m["outcome"]["state"] != "published" else
                       "not checked" if files is None or files.skipped else ("ok" if files.ok else "CHANGED"))
        sig = by.get("signature")
        sig_state = ("none" if sig is None else "unverified" if sig.skipped else "valid" if sig.ok else "FAILED")
        status = "FAILED" if not r.ok else ("verified (partly)" if not_checked else "verified")
        out[path] = ManifestCheck(path, m.get("run_id"), r.ok, status, r.problems, not_checked, files_state, sig_state)
    return out


def _checkpoint_state(ledger: Any, verify: dict[str, Any]) -> str:
    """One line on the chain's external anchor: the signed checkpoints the deployment keeps.

    Read from ``DPOPS_LEDGER_CHECKPOINTS_DIR`` with ``DPOPS_LEDGER_CHECKPOINT_PUBLIC_KEY``. A chain that no
    longer extends a checkpoint fails the ledger verification shown beside it (and ``dpops report`` exits 7),
    because only this anchor catches a ledger rebuilt by someone with database write access.
    """
    from dpops.ledger import checkpoint as cp

    directory, public_key = os.environ.get(cp.DIR_ENV), cp.default_public_key(None)
    if not directory or not public_key:
        return "none configured (set DPOPS_LEDGER_CHECKPOINTS_DIR and DPOPS_LEDGER_CHECKPOINT_PUBLIC_KEY)"
    try:
        checkpoints = cp.load_checkpoints(directory, public_key)
        hashes = [str(e.hash) for e in sorted(ledger.history(), key=lambda e: int(e.id))]
        problems = cp.check_anchors(hashes, checkpoints)
    except DpopsError as exc:
        problems = [str(exc)]
        checkpoints = []
    if problems:
        verify["ok"] = False
        verify["problems"] = (list(verify.get("problems") or []) + problems)[:5]
        return f"FAILED: {problems[0]}"
    latest = cp.summary(checkpoints)
    return (f"{latest['checkpoints']} signed checkpoint(s), latest at entry {latest['latest_entries']} "
            f"(head {latest['latest_head']}, key {latest['public_key_id']}): the chain extends them")


def _provenance(ledger: Any, checks: dict[str, ManifestCheck]) -> dict[str, Any]:
    from dpops import __version__
    from dpops.ledger.model import utc_now

    try:
        rep = ledger.verify()
        verify = {"ok": bool(rep.ok), "entries": int(rep.entries), "head_hash": rep.head_hash,
                  "first_bad_entry": rep.first_bad_entry, "problems": list(rep.problems)[:5]}
    except Exception as exc:  # noqa: BLE001 - the report must say the ledger could not be verified
        verify = {"ok": False, "entries": None, "head_hash": None, "first_bad_entry": None,
                  "problems": [f"ledger verify could not run: {type(exc).__name__}"]}
    values = list(checks.values())
    return {
        "generated_at": utc_now(),
        "dpops_version": __version__,
        "ledger_url": redact(str(ledger.url), public=True) if getattr(ledger, "url", None) else "unknown",
        "ledger_verify": verify,
        "checkpoint": _checkpoint_state(ledger, verify),
        "manifests": {"total": len(values), "verified": sum(c.status == "verified" for c in values),
                      "partly": sum(c.status == "verified (partly)" for c in values),
                      "failed": sum(not c.ok for c in values)},
        "files": {"ok": sum(c.files == "ok" for c in values), "changed": sum(c.files == "CHANGED" for c in values),
                  "not_checked": sum(c.files == "not checked" for c in values)},
        "signatures": {s: sum(c.signature == s for c in values) for s in ("valid", "unverified", "FAILED", "none")},
    }


def _data_docs(gx_project: str | None) -> str | None:
    """The deployment GX project's Data Docs index (checkpoint results on the noisy outputs), if built."""
    if not gx_project:
        return None
    from dpops.gx_project import data_docs_index

    index = data_docs_index(gx_project)
    return str(index) if index.is_file() else None


def _schedule_flags(rows: list[RunRow]) -> list[RunRow]:
    """Flag intervals off the release's usual length or grid, and add a row for each gap.

    The schedule is read off the intervals themselves (the most common length, anchored at the
    earliest start): a reviewer sees at a glance an interval that does not fit the cadence, which
    is where double counting or a missed period hides."""
    from collections import Counter

    from dpops.ledger.model import parse_utc

    gaps: list[RunRow] = []
    by_release: dict[str, list[RunRow]] = {}
    for r in rows:
        by_release.setdefault(r.release, []).append(r)
    for release, rs in by_release.items():
        spans = sorted({(parse_utc(r.interval_start, "interval_start"), parse_utc(r.interval_end, "interval_end"))
                        for r in rs})
        if not spans:
            continue
        length = Counter(e - s for s, e in spans).most_common(1)[0][0]
        anchor = spans[0][0]
        for r in rs:
            s, e = parse_utc(r.interval_start, "interval_start"), parse_utc(r.interval_end, "interval_end")
            if e - s != length:
                r.flags.append(f"off-schedule: lasts {e - s}, the release's intervals last {length}")
            elif length.total_seconds() > 0 and (s - anchor).total_seconds() % length.total_seconds():
                r.flags.append(f"misaligned: does not start on the release's {length} grid from {anchor.isoformat()}")
        for (s0, e0), (s1, e1) in zip(spans, spans[1:]):
            if s1 > e0:
                gaps.append(RunRow(run_id="", release=release, interval_start=e0.isoformat().replace("+00:00", "Z"),
                                   interval_end=s1.isoformat().replace("+00:00", "Z"), state="gap", epsilon=None,
                                   restates=None, created_at="", updated_at="", buckets=[], events=[], kind="gap",
                                   verification="", flags=["gap: no run covers this period"]))
            elif s1 < e0:
                for r in rs:
                    if parse_utc(r.interval_start, "interval_start") == s1 and \
                            parse_utc(r.interval_end, "interval_end") == e1:
                        r.flags.append("overlaps the previous interval")
    return gaps


def _totals_after(ledger: Any, scope: Any) -> dict[str, float]:
    """The scope's total right after each charged run, in the ledger's order (``Ledger.totals_after``, its one
    owner: the Privacy budget page shows the same figures).

    A manifest's scope snapshot is read when that run commits: two runs committed at the same moment both
    saw the other's charge and showed the same total. The ledger's order decides instead. Unbucketed
    scopes only (a bucketed scope's total is per bucket; the manifest's figure stays)."""
    if scope.bucket is not None:
        return {}
    return {r.run_id: total for r, total in ledger.totals_after(scope.name) if math.isfinite(total)}


def _release_details(rows: list[RunRow], manifests: dict[str, dict[str, Any]], checks: dict[str, ManifestCheck],
                     after: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """Per run with a manifest: what a reviewer signs off, taken only from manifests that verified."""
    after = after or {}
    out = []
    for r in rows:
        if r.kind != "run" or not r.manifest:
            continue
        m = manifests.get(r.manifest)
        c = checks.get(r.manifest)
        if m is None or c is None or not c.ok:
            out.append({"run_id": r.run_id, "release": r.release, "interval": [r.interval_start, r.interval_end],
                        "trusted": False, "status": c.status if c else "unreadable"})
            continue
        mechanisms = []
        for metric in m["release_plan"].get("metrics", []):
            for v in metric.get("vectors") or []:
                mechanisms.append({"metric": metric["key"], "vector": v["name"], "mechanism": v["mechanism"],
                                   "scale": v.get("scale"), "std": v.get("std"),
                                   "l1": v.get("l1_sensitivity_charged"), "l2": v.get("l2_sensitivity_charged")})
        scope = m["privacy"]["scope"]
        totals = [b["total"] for b in (scope or {}).get("buckets", []) if b["total"] is not None]
        out.append({
            "run_id": r.run_id, "release": r.release, "interval": [r.interval_start, r.interval_end], "trusted": True,
            "status": c.status, "outcome": m["outcome"]["state"], "unit": m["privacy_unit"],
            "contribution": m["contribution_bounds"], "value_bounds": m["value_bounds"], "mechanisms": mechanisms,
            "run_epsilon": m["privacy"]["run"]["epsilon"], "delta": m["privacy"]["run"]["delta"],
            "charged": bool(m["privacy"]["run"]["charged"]),  # a refusal's ε is what it asked, not a charge
            "scope_total_after": after.get(r.run_id, max(totals) if totals else None),
            "scope_unit": (scope or {}).get("cap", {}).get("unit"), "accountant": m["accountant"]["ref"],
            # issue 20: the spec's accuracy targets against the plan's prediction (verified with the manifest)
            "accuracy_targets": list((m.get("accuracy") or {}).get("targets") or []),
            # issue 20 section 3: where the bounds came from, when dpops tune chose them (verified with the manifest,
            # and against the ledger's private_access entry)
            "tuning": (m.get("provenance") or {}).get("tuning"),
        })
    return out


def ci95_halfwidth(vector: dict[str, Any]) -> tuple[float, str]:
    """Half-width of a 95% interval from the vector's public noise parameters (exact per family)."""
    fam_integer = vector["mechanism"].split("_", 1)
    family = fam_integer[1] if len(fam_integer) == 2 else vector["mechanism"]
    try:  # prefer the mechanisms module's own exact computation
        from dpops.noise.mechanisms import NoiseParams

        params = NoiseParams(family=family, integer_valued=fam_integer[0] == "integer",
                             resolution=float(vector["resolution"]), scale=float(vector["scale"]),
                             l1_sensitivity=vector.get("l1_sensitivity_charged"),
                             l2_sensitivity=vector.get("l2_sensitivity_charged"), std=float(vector["std"]))
        return float(params.ci95_halfwidth()), "exact"
    except Exception:  # noqa: BLE001 - any mismatch of constructor: fall back to the closed forms
        pass
    if family == "laplace":  # P(|X| > t) = exp(-t/b) = 0.05
        return float(vector["scale"]) * math.log(20.0), "laplace closed form"
    return 1.959963984540054 * float(vector["std"]), "normal quantile"


def gather(ledger: Any, scope_name: str, manifests_dir: str | os.PathLike[str] | None = None,
           start: str | None = None, end: str | None = None, *, key: Any = None,
           public_key: str | None = None, gx_project: str | None = None) -> ReportData:
    """Everything the report shows. Every manifest is verified against the ledger (and, given the
    noise ``key``, its published files; given ``public_key``, its signature) before its numbers
    are used: a forged manifest shows as FAILED and contributes nothing."""
    from dpops.ledger.model import parse_utc

    scope = ledger.scope(scope_name)
    status = ledger.status(scope_name)
    manifests, unreadable, digests = _load_manifests(manifests_dir, scope_name)
    checks = {**unreadable, **_verify_all(manifests, digests, ledger, key, public_key)}
    # A manifest that failed verification cannot stand for a run: its claims (including the run it
    # names) are not used; only its verified peers are. It still appears, marked, in the report.
    # A refusal manifest is a record of its moment: the same run key may be published later (after a cap
    # raise), so refusals are listed on their own and never stand for the run's later outcome.
    by_run: dict[str, tuple[str, dict[str, Any]]] = {}
    refusals: dict[str, tuple[str, dict[str, Any]]] = {}
    for path, m in sorted(manifests.items(), key=lambda kv: (checks[kv[0]].ok, kv[1]["created_at"])):
        target = refusals if m["outcome"]["state"] == "refused" else by_run
        target[m["run_id"]] = (path, m)  # a verified manifest wins over a failed one for the same run

    lo = parse_utc(start, "--from") if start else None
    hi = parse_utc(end, "--to") if end else None

    def in_window(s: str, e: str) -> bool:
        return (lo is None or parse_utc(s, "interval_start") >= lo) and (hi is None or parse_utc(e, "interval_end") <= hi)

    reasons = {}
    for e in ledger.history(scope_name):
        if e.run_id and e.kind in ("released", "spent_unpublished") and isinstance(e.data, dict):
            reasons[e.run_id] = e.data.get("reason")
    rows: list[RunRow] = []
    seen = set()
    for rec in ledger.runs(scope=scope_name):
        if not in_window(rec.key.interval_start, rec.key.interval_end):
            continue
        path, m = by_run.get(rec.run_id, (None, None))
        rows.append(RunRow(
            run_id=rec.run_id, release=rec.key.release, interval_start=rec.key.interval_start,
            interval_end=rec.key.interval_end, state=rec.state,
            epsilon=rec.epsilon if rec.epsilon is not None and math.isfinite(rec.epsilon) else None,
            restates=rec.restates, created_at=rec.created_at, updated_at=rec.updated_at, buckets=list(rec.buckets),
            events=list(rec.events), manifest=path, reason=reasons.get(rec.run_id), key_id=rec.key.key_id,
            replaces_spent=((rec.details or {}).get("replaces_spent") or {}).get("run_id"),
            fresh_reason=((rec.details or {}).get("replaces_spent") or {}).get("reason") or None,
            test_mode=bool(m and m["randomness"]["test_mode"]),
            verification=checks[path].status if path else "no manifest",
            entry_id=min(rec.entry_ids) if rec.entry_ids else 0))
        seen.add(rec.run_id)
    # Refusals never reach the ledger (nothing is written): their manifests are the record, also of a run
    # key reserved and published later (both rows are shown).
    for run_id, (path, m) in refusals.items():
        k = m["run_key"]
        if not in_window(k["interval_start"], k["interval_end"]):
            continue
        rows.append(RunRow(
            run_id=run_id, release=k["release"], interval_start=k["interval_start"], interval_end=k["interval_end"],
            state="refused", epsilon=m["privacy"]["run"]["epsilon"], restates=(m["restates"] or {}).get("run_id"),
            created_at=m["created_at"], updated_at=m["created_at"], buckets=[], events=[], manifest=path,
            reason=m["outcome"]["reason"], key_id=k["key_id"], test_mode=m["randomness"]["test_mode"],
            verification=checks[path].status))
    charged = [e for r in rows if r.state in CHARGED for e in r.events]
    gaps = _schedule_flags(rows)
    rows = rows + gaps
    # The timeline is in date order (interval start), refusals and gaps in place; ties by charge time.
    rows.sort(key=lambda r: (parse_utc(r.interval_start, "interval_start"), r.kind != "gap", r.created_at, r.run_id))

    comparison: dict[str, float | None] = {}
    for name in COMPARED:
        refs = [r for r in known_accountants() if r.split("/")[0] == name]
        if not refs:
            continue
        try:
            eps = get_accountant(name).epsilon(charged, scope.delta) if charged else 0.0
        except (ValueError, ZeroDivisionError, OverflowError):
            eps = math.inf
        comparison[get_accountant(name).ref] = eps if math.isfinite(eps) else None

    trusted = {p: m for p, m in manifests.items() if checks[p].ok}
    adjacencies = sorted({m["privacy_unit"]["adjacency"] for m in trusted.values()})
    contribution = []
    seen_c = set()
    noise = []
    seen_plans = set()
    estimations = []
    for m in trusted.values():
        if m.get("estimation") is not None:
            # An estimation's spec describes the release it estimated for, not mechanisms it ran: listed apart.
            est = m["estimation"]
            estimations.append({"run_id": m["run_id"], "release": m["spec"]["name"],
                                "interval": [m["run_key"]["interval_start"], m["run_key"]["interval_end"]],
                                "epsilon": float(est["config"]["epsilon"]), "quantile": float(est["config"]["quantile"]),
                                "result": est["result"]})
            continue
        c = (m["run_key"]["release"], m["contribution_bounds"]["max_partitions_per_unit"],
             m["contribution_bounds"]["max_rows_per_unit_per_partition"], m["privacy_unit"]["adjacency"])
        if c not in seen_c:
            seen_c.add(c)
            contribution.append({"release": c[0], "max_partitions_per_unit": c[1],
                                 "max_rows_per_unit_per_partition": c[2], "adjacency": c[3],
                                 "per_metric": m["contribution_bounds"].get("per_metric") or {},
                                 "value_bounds": m["value_bounds"], "unit": m["privacy_unit"]["description"]})
        if m["spec_hash"] in seen_plans:
            continue
        seen_plans.add(m["spec_hash"])
        for metric in m["release_plan"].get("metrics", []):
            for v in metric.get("vectors") or []:
                half, how = ci95_halfwidth(v)
                noise.append({"release": m["run_key"]["release"], "spec_hash": m["spec_hash"][:12],
                              "metric": metric["key"], "vector": v["name"], "mechanism": v["mechanism"],
                              "std": float(v["std"]), "ci95_width": 2.0 * half, "ci_method": how})
    data = ReportData(scope=scope, status=status, runs=rows, manifests=manifests, comparison=comparison,
                      adjacencies=adjacencies, contribution=contribution, noise=noise, start=start, end=end,
                      checks=checks, provenance={**_provenance(ledger, checks), "data_docs": _data_docs(gx_project)},
                      releases=_release_details(rows, manifests, checks, _totals_after(ledger, scope)))
    data.estimations = estimations
    data.warnings = _warnings(data)
    return data


def _warnings(d: ReportData) -> list[str]:
    out = []
    s = d.scope
    if s.population:
        if s.delta >= 1.0 / s.population:
            out.append(f"delta={s.delta:g} is not below 1/n = {1.0 / s.population:.3g} for the declared population: "
                       "the guarantee is meaningless")
        elif s.delta > 0.1 / s.population:
            out.append(f"delta={s.delta:g} is within a factor 10 of 1/n = {1.0 / s.population:.3g}")
    failed = [c for c in d.checks.values() if not c.ok]
    if failed:
        out.append(f"{len(failed)} manifest(s) FAILED verification and are not trusted: "
                   + ", ".join(os.path.basename(c.path) for c in failed[:5]))
    if not d.provenance.get("ledger_verify", {}).get("ok", True):
        out.append("the ledger's hash chain does NOT verify: every figure below is suspect")
    for m in d.trusted.values():
        n = m["privacy_unit"]["population"]
        if n and m["privacy"]["requested"]["delta"] > 0.1 / n:
            out.append(f"release {m['run_key']['release']}: delta={m['privacy']['requested']['delta']:g} is near 1/n "
                       f"(n={n})")
            break
    if s.cap_unit == "epsilon" and s.cap > 10:
        out.append(f"the scope's cap epsilon={s.cap:g} is above 10: a very weak guarantee")
    big = [r for r in d.runs if r.epsilon is not None and r.epsilon > 10]
    if big:
        out.append(f"{len(big)} run(s) charged epsilon above 10 each (e.g. {big[0].run_id[:12]})")
    if d.status.total is not None and d.status.unit == "epsilon" and d.status.total > 10:
        out.append(f"the scope's composed epsilon is {d.status.total:.3g}, above 10")
    tests = [r for r in d.runs if r.test_mode]
    if tests:
        out.append(f"{len(tests)} test-mode run(s) (seeded noise, never publishable): "
                   + ", ".join(r.run_id[:12] for r in tests[:5]))
    flagged = [r for r in d.runs if r.kind == "run" and r.flags]
    if flagged:
        out.append(f"{len(flagged)} interval(s) off the release's schedule (see the timeline)")
    from dpops.keyref import noise_key_id

    last_key: dict[str, str] = {}
    from dpops.report.plots import charge_order

    for r in sorted((r for r in d.runs if r.kind == "run"), key=charge_order):
        # the key's id, not the recorded attempt: "<id>/retry-2" is the same key drawing a fresh attempt
        kid = noise_key_id(r.key_id) if r.key_id else None
        if kid and r.release in last_key and last_key[r.release] != kid:
            out.append(f"release {r.release}: the noise key changed from {last_key[r.release]} to {kid} "
                       f"at run {r.run_id[:12]} ({r.interval_start})")
        if kid:
            last_key[r.release] = kid
    return out


def backfill_gaps(ledger: Any, specs: Any, start: str | None, end: str | None,
                  manifests_dir: str | os.PathLike[str] | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """``dpops.gaps`` for each spec over the report window (default: the release's first to last run).

    Returns (gap rows, warnings). A spec that does not load, or has no interval grid, is a warning in
    the report rather than a failure: the rest of the report still stands."""
    from datetime import timedelta

    from dpops.gaps import interval_statuses
    from dpops.ledger.model import parse_utc
    from dpops.spec import load_spec

    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for path in specs:
        try:
            spec = load_spec(path)
            recs = ledger.runs(release=spec.name)
            lo = parse_utc(start, "--from") if start else (
                min(parse_utc(r.key.interval_start, "interval_start") for r in recs) if recs else None)
            hi = parse_utc(end, "--to") if end else (
                max(parse_utc(r.key.interval_end, "interval_end") for r in recs) - timedelta(microseconds=1)
                if recs else None)
            if lo is None or hi is None:
                notes.append(f"{path}: no runs of {spec.name} in the ledger and no --from/--to: no gaps to list")
                continue
            for st in interval_statuses(spec, ledger, lo, hi,
                                        manifests_dir=manifests_dir if manifests_dir else None):
                if st.is_gap:
                    rows.append({"release": spec.name, **st.to_dict()})
        except DpopsError as exc:
            notes.append(f"{path}: gaps not listed: {exc}")
    return rows, notes

