"""Backfill gaps: which intervals of a date range have no publication, and why.

Airflow skips a logical date that already has a DAG run even if that run covered another
interval, and a refused or failed run leaves nothing behind in the output; so holes in a release's
history appear silently. This module lists, per interval of the spec's own grid (its unit period,
else its cron schedule), what the ledger, the storage and the manifests say:

``published``          the interval's current version is visible in storage, names the newest run the
                       ledger committed for it, and every version there is one the ledger committed
``forged``             storage holds a version or a pointer the ledger did not commit for this interval (a
                       version on a refused or never-run day, a pointer moved back, a run of another
                       ledger): never "published" (issue 25 item 10); the ledger's own record (a refusal,
                       a run) is named in the detail
``never_run``          nothing in the ledger, no refusal manifest, no input-wait record
``input_missing``      a run waited for the interval's input and timed out (``record_input_wait``: the
                       orchestrator's sensor leaves a small record in the private state directory)
``refused``            a refusal manifest (the ledger keeps nothing for a refusal: nothing was charged)
``failed``             the run was refunded (released) after a failure before any noise was drawn
``spent_unpublished``  charged but not visible: started (noise may exist) or marked spent_unpublished,
                       or committed in the ledger while the storage shows no current version
``abandoned``          given up by an operator (``dpops release abandon``); refunded or charged
``in_progress``        reserved, not started: running now, or stuck (``dpops ledger recover``)

Reads only public facts (ledger states, storage pointers, manifest outcomes); never the input.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dpops.errors import InvalidParameter

REASONS = ("published", "forged", "never_run", "input_missing", "refused", "failed", "spent_unpublished", "abandoned",
           "in_progress")
WAITS_DIR = "input-waits"
ABANDON_PREFIX = "abandoned by operator"


@dataclass
class IntervalStatus:
    interval_start: str
    interval_end: str
    status: str  # one of REASONS
    detail: str = ""
    run_id: str | None = None
    runs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def is_gap(self) -> bool:
        return self.status != "published"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gap": self.is_gap}


def _iso(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def spec_intervals(spec: Any, start: datetime, end: datetime, *, limit: int = 10_000) -> list[tuple[datetime, datetime]]:
    """The releasable intervals of ``spec`` that start in [start, end), in order.

    The grid is the one ``dpops release run`` accepts (``dpops.spec.aligned_bounds``): the unit period,
    else the cron schedule. A spec with neither has no grid, so there is nothing to enumerate."""
    from dpops.spec import aligned_bounds

    if not start < end:
        raise InvalidParameter(f"--from {_iso(start)} must be before --to {_iso(end)}")
    first = aligned_bounds(spec, start)
    if first is None:
        raise InvalidParameter(f"{spec.source}: the spec has neither privacy_unit.period nor a cron schedule, so it "
                               "has no interval grid to plan or check; give intervals explicitly")
    out: list[tuple[datetime, datetime]] = []
    s, e = first
    if s < start:
        nxt = aligned_bounds(spec, e)
        assert nxt is not None
        s, e = nxt
    while s < end:
        out.append((s, e))
        if len(out) > limit:
            raise InvalidParameter(f"--from/--to spans more than {limit} intervals of {spec.name}; narrow the range")
        nxt = aligned_bounds(spec, e)
        assert nxt is not None
        s, e = nxt
    return out


def manifests_dir_for(spec: Any, manifests_dir: str | os.PathLike[str] | None = None) -> Any:
    """Where this release's manifests are: ``dpops.release.spec_manifests_dir``'s rule (a local ``Path`` or an
    object-store ``Location``), unless ``manifests_dir`` is given."""
    if manifests_dir:
        from dpops.storage.location import Location, is_uri

        text = os.fspath(manifests_dir)
        return Location.parse(text) if is_uri(text) and not Location.parse(text).is_local else Path(text)
    from dpops.release import spec_manifests_dir

    return spec_manifests_dir(spec)


def _refusal_files(folder: Any) -> list[tuple[str, bytes | None]]:
    """(name, content) of every ``*.refused.json`` in a local directory or under an object-store prefix."""
    if isinstance(folder, Path):
        if not folder.is_dir():
            return []
        return [(str(p), p.read_bytes()) for p in sorted(folder.glob("*.refused.json"))]
    from dpops.storage import files

    try:
        return [(str(loc), files.read_bytes(loc)) for loc in files.glob(folder.join("*.refused.json"))]
    except OSError:
        return []


def _refusals(folder: Any, release: str) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Refusal manifests by (normalised start, end): a refusal writes nothing to the ledger."""
    from dpops.ledger.model import normalize_utc

    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for path, data in _refusal_files(folder):
        try:
            m = json.loads((data or b"").decode("utf-8"))
            k = m["run_key"]
            if k["release"] != release:
                continue
            key = (normalize_utc(k["interval_start"]), normalize_utc(k["interval_end"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # an unreadable manifest is `dpops manifest verify`'s business, not a gap reason
        out.setdefault(key, []).append({"file": str(path), "created_at": m.get("created_at", ""),
                                        "reason": (m.get("outcome") or {}).get("reason") or ""})
    return out


def _wait_file(release: str, slug: str, state_dir: Path | None = None) -> Path:
    from dpops.storage import private_state_dir

    return (state_dir or private_state_dir()) / WAITS_DIR / release / f"{slug}.json"


def record_input_wait(spec: Any, interval_start: str, interval_end: str, *, waited_seconds: float,
                      missing_files: int, state_dir: Path | None = None) -> Path:
    """Record that a run waited ``waited_seconds`` for the interval's input and gave up, so ``dpops gaps`` says
    "input missing (waited N s)" instead of "never run".

    Written to the private state directory (``$DPOPS_STATE_DIR``, mode 0700, where the private run logs are),
    not next to the manifests: it is an operational fact, not a release record. It holds only public facts
    (release, interval, the wait, how many files were missing, when), never a path, a file name or data."""
    from dpops.inputs import parse_interval

    iv = parse_interval(interval_start, interval_end)
    path = _wait_file(spec.name, iv.slug, state_dir)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    doc = {"release": spec.name, "interval_start": iv.start_iso, "interval_end": iv.end_iso,
           "waited_seconds": round(float(waited_seconds)), "missing_files": int(missing_files),
           "at": _iso(datetime.now(UTC))}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, sort_keys=True))
    os.replace(tmp, path)
    return path


def _input_wait(release: str, slug: str, state_dir: Path | None = None) -> dict[str, Any] | None:
    try:
        doc = json.loads(_wait_file(release, slug, state_dir).read_text())
        return doc if isinstance(doc, dict) and doc.get("release") == release else None
    except (OSError, ValueError):
        return None


def _reasons(ledger: Any, run_ids: set[str]) -> dict[str, str]:
    """The reason recorded when each run was released or marked spent_unpublished."""
    out: dict[str, str] = {}
    if not run_ids:
        return out
    for e in ledger.history():
        if e.run_id in run_ids and e.kind in ("released", "spent_unpublished") and isinstance(e.data, dict):
            out[e.run_id] = str(e.data.get("reason") or "")
    return out


def interval_statuses(spec: Any, ledger: Any, start: datetime, end: datetime, *,
                      manifests_dir: str | os.PathLike[str] | None = None) -> list[IntervalStatus]:
    """Every interval of ``spec`` starting in [start, end) with its publication status and reason."""
    from dpops.errors import DpopsError
    from dpops.inputs import Interval
    from dpops.ledger.model import normalize_utc
    from dpops.manifest.files import check_interval_pointer
    from dpops.storage import ReleaseStore

    store = ReleaseStore(spec.output_root, spec.name)
    refusals = _refusals(manifests_dir_for(spec, manifests_dir), spec.name)
    by_interval: dict[tuple[str, str], list[Any]] = {}
    for r in ledger.runs(release=spec.name):
        key = (normalize_utc(r.key.interval_start), normalize_utc(r.key.interval_end))
        by_interval.setdefault(key, []).append(r)
    reasons = _reasons(ledger, {r.run_id for rs in by_interval.values() for r in rs
                                if r.state in ("released", "spent_unpublished")})
    out = []
    for s, e in spec_intervals(spec, start, end):
        key = (normalize_utc(s.isoformat()), normalize_utc(e.isoformat()))
        recs = sorted(by_interval.get(key, []), key=lambda r: (r.updated_at, r.run_id))
        slug = Interval(s, e).slug
        try:
            current = store.current(slug)
            on_storage = current is not None or bool(store.versions(slug))
        except DpopsError:  # a pointer to no version, an unreadable marker: the pointer check names it
            current, on_storage = None, True
        # Storage is checked against the ledger whenever it holds anything for the interval, committed or
        # not (the one owner of the rule: check_interval_pointer); a mismatch is never "published".
        pointer = (check_interval_pointer(store, slug, ledger, spec.name, key[0], key[1]).problems
                   if on_storage else [])
        st = IntervalStatus(_iso(s), _iso(e), "never_run",
                            runs=[{"run_id": r.run_id, "state": r.state, "epsilon": r.epsilon,
                                   "reason": reasons.get(r.run_id)} for r in recs])
        committed = [r for r in recs if r.state == "committed"]
        refused = refusals.get(key, [])
        if pointer:
            st.status, st.run_id = "forged", current.run_id if current is not None else None
            record = (f"the ledger committed run {committed[-1].run_id}" if committed else
                      f"refused: {refused[-1]['reason'] or 'refused'}" if refused else
                      f"the ledger's last run is {recs[-1].run_id} ({recs[-1].state})" if recs else
                      "the ledger has no run for it")
            st.detail = (f"published storage does not match the ledger ({record}): " + "; ".join(pointer)
                         + ". Remove what the ledger did not commit and investigate who wrote it")
        elif committed:
            newest = committed[-1]
            st.run_id = newest.run_id
            if current is not None and current.run_id in {r.run_id for r in committed}:
                st.status, st.detail = "published", f"version v{current.version}"
            else:
                st.status = "spent_unpublished"
                st.detail = ("committed in the ledger but no published version is visible in storage under "
                             f"{store.published_interval_dir(Interval(s, e).slug)}: a retry of the run makes it "
                             "visible at no new charge")
        elif recs and not (refused and max(x["created_at"] for x in refused) > recs[-1].updated_at):
            last = recs[-1]
            st.run_id = last.run_id
            why = reasons.get(last.run_id, "")
            if why.startswith(ABANDON_PREFIX):
                st.status = "abandoned"
                st.detail = f"{last.state}: {why}"
            elif last.state == "released":
                st.status, st.detail = "failed", f"refunded, no noise drawn: {why}" if why else "refunded"
            elif last.state == "spent_unpublished":
                st.status, st.detail = "spent_unpublished", why or "charged, never published"
            elif last.state == "started":
                st.status = "spent_unpublished"
                st.detail = ("started, not published: noise may exist, the charge stays; re-run it (keyed: free) "
                             "or abandon it")
            else:
                st.status = "in_progress"
                st.detail = "reserved, not started: running now, or stuck (dpops ledger recover refunds it)"
        elif refused:
            st.status = "refused"
            st.detail = refused[-1]["reason"] or "refused"
        elif (wait := _input_wait(spec.name, Interval(s, e).slug, getattr(store, "state_dir", None))) is not None:
            waited = (f"waited {wait.get('waited_seconds', '?')} s, gave up at {wait.get('at', '?')}")
            if _input_arrived(spec, s, e):
                # The wait record is history: the files are there now (issue 28 item 7), the day only needs a run.
                st.status = "never_run"
                st.detail = (f"the input arrived after a run gave up waiting for it ({waited}): nothing was read or "
                             f"charged; fill it: {FILL_ADVICE}")
            else:
                st.status = "input_missing"
                st.detail = (f"input missing ({waited}; {wait.get('missing_files', '?')} file(s) missing): nothing "
                             f"was read or charged. Deliver the input, then fill it: {FILL_ADVICE}")
        out.append(st)
    return out


# How an operator fills a day: a cleared sensor must take its downstream tasks along (else they stay
# upstream_failed and the DAG run failed), and a REST-triggered run has no logical date to clear by.
FILL_ADVICE = ("clear wait_for_input of that DAG run WITH its downstream tasks (airflow tasks clear DAG_ID -t "
               "wait_for_input -s D -e D --downstream --yes, D the run's logical date; a REST-triggered run has "
               "none: use Clear with Downstream on the run in the UI), or trigger the day again (REST with "
               "logical_date null and conf.interval), or dpops release run")


def _input_arrived(spec: Any, start: datetime, end: datetime) -> bool:
    """Whether the interval's input files are all there now (existence only, no data read)."""
    from dpops.errors import DpopsError
    from dpops.inputs import missing_input_files

    try:
        return not missing_input_files(spec, start, end)
    except (DpopsError, OSError):
        return False  # cannot tell (an unreachable bucket): keep the record's word


def parse_day(text: str, what: str) -> datetime:
    """``--from``/``--to``: an ISO-8601 date or timestamp, UTC when no offset is given."""
    from dpops.ledger.model import parse_utc

    return parse_utc(text, what)


__all__ = ["REASONS", "IntervalStatus", "interval_statuses", "manifests_dir_for", "parse_day", "record_input_wait",
           "spec_intervals"]
