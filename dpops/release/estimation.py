"""The estimation release kind: a private bound estimation run as prepare, reserve, start, compute, commit.

docs/semantics.md section 1: "a bound learned from data must itself be a charged DP release". This module
is that release's ledger and data path; its mechanisms are pure and live in ``dpops.analysis.estimate``
(they see only the rows handed to them, and this module hands them the interval's rows after the charge).
The steps are a release's, with the same ledger semantics:

1. **prepare** (``dpops.release.preparation.prepare(..., for_estimation=True)``): the spec as written, the
   interval, the input and its keyed fingerprint, the noise key. Nothing is written.
2. **reserve** (``reserve_estimation``): the release's own checks (``check_scope``: the scope exists and
   protects this unit definition; ``check_key_continuity``), then either serve the committed estimation of
   this run key (``served_estimation``: nothing charged), or reserve the estimation's events (one pure-DP
   event per mechanism, a function of spec and configuration only, ``dpops.analysis.estimate.events``).
3. **start** (``start_estimation``): everything that can fail without drawing anything (the randomness
   source, the manifests directory, the result path) runs before ``ledger.start`` and is refunded; from
   ``start`` on the charge stays.
4. **compute** (``compute_estimation``): the release's own reader (type checks, null/NaN drops, hashing, public
   partitions, the time filter) and the pure mechanisms (``dpops.analysis.estimate.estimate_counts``; error/1:
   ``estimate_by_error``), by default with the counts computed by Beam on the workers (``engine="beam"``:
   ``PipelineCounts``, ``pipelines.estimation``), only public-grid counts coming back, so the driver's memory
   does not grow with the input; or with the rows read into this process (``engine="driver"``: ``read_rows``,
   ``estimate_rows``), the reference the tests hold the workers to. Both give the same bounds. An interval
   without rows is data, never an error: this runs after ``start``.
5. **commit** (``commit_estimation``): the manifest (``manifest verify`` recomputes it), the result file, then
   ``ledger.commit`` with the manifest's sha256; a test-mode run ends ``spent_unpublished`` instead
   (``end_test_mode``).

``run_estimation`` runs steps 2-5 over a prepared context: ``dpops.release.execute.estimate`` (``dpops
estimate``, the notebook's ``dpops.release.estimate_bounds``) prepares and calls it, and so does ``prepare``
itself for a spec with ``bounds: estimate``.

Randomness, retries and the ledger
----------------------------------

Noise comes from the run's randomness source exactly as a release's: ``keyed`` (the default) is the
CSPRNG stream of the noise key and the estimation's run key (``keyed_random``), so a retry of the same
run key over the same input draws the same values, reveals nothing new and is not charged again;
``test`` is seeded and never feeds a published release: the run ends spent_unpublished, writes no manifest
and no result under output.root (its fingerprint is keyed with the public test key), and
``dpops.manifest.dependencies.check_dependency`` refuses it to a keyed or os release (``end_test_mode``).
``os`` randomness cannot be reproduced, so a retry could not be free: it is refused for estimation. The run
key is the release's (spec hash, interval, keyed input fingerprint, key id) under the release name
``<name>__estimate`` and a spec hash field that also covers the estimation's configuration
(``dpops.analysis.estimate.estimation_hash``): the same request is the same run, a different epsilon or
quantile a new one. A committed estimation is served from its manifest: no charge, the same result.

What is public: the estimates themselves (DP outputs) and the configuration. The manifest records
them, the mechanisms and their sensitivities; nothing else about the data.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dpops.analysis import estimate as estimator
from dpops.analysis.estimate import (
    QUANTILE_METHOD,
    RELEASE_SUFFIX,
    Estimate,
    EstimateConfig,
    GridCounts,
    Mechanism,
    PassCounts,
    ValueCounts,
    estimation_hash,
)
from dpops.errors import BudgetExceeded, IntegrityError, InvalidParameter, LedgerError, SpecError, public_message
from dpops.release.context import RunContext
from dpops.release.pipeline_seam import CountedPass, estimation_digest_salt
from dpops.spec import refuse_metric_contributions
from dpops.storage.location import Location

if TYPE_CHECKING:
    from dpops.analysis.bound_choice import BoundHistograms
    from dpops.events import PrivacyEvent
    from dpops.ledger import Ledger, RunKey, RunRecord
    from dpops.noise.randomness import RandomSource
    from dpops.release.pipeline_seam import EstimationCountsRequest
    from dpops.release_plan import ReleasePlan
    from dpops.spec import ReleaseSpec
    from pipelines.io import ReadConfig


# --------------------------------------------------------------------------- the run and its key


@dataclass
class EstimationRun:
    """One estimation run: its prepared context and run key (what ``write_run_manifest`` reads from a run)."""

    ctx: RunContext
    key: RunKey

    @property
    def spec(self) -> ReleaseSpec:
        """The spec as written (the estimation's own prepare)."""
        return self.ctx.spec

    @property
    def run_key(self) -> RunKey:
        """The estimation's run key (``run_key_of``)."""
        return self.key

    @property
    def plan(self) -> ReleasePlan:
        """The release's plan at the spec's declared (or fallback) bounds."""
        return self.ctx.plan

    @property
    def randomness(self) -> str:
        """keyed | test (os is refused before prepare)."""
        return self.ctx.randomness


def run_key_of(ctx: RunContext, config: EstimateConfig) -> RunKey:
    """The estimation's run key (module docstring): the release's, under ``<name>__estimate`` and the
    estimation hash."""
    from dpops.ledger import RunKey

    name = ctx.spec.name
    if name.endswith(RELEASE_SUFFIX) or len(name) + len(RELEASE_SUFFIX) > 64:
        raise SpecError(f"{ctx.spec.source}: release name {name!r}: an estimation runs as {name + RELEASE_SUFFIX!r} "
                        f"in the ledger, which must be at most 64 characters and not end twice in {RELEASE_SUFFIX!r}; "
                        "shorten the name; nothing was reserved")
    return RunKey(release=name + RELEASE_SUFFIX, spec_hash=estimation_hash(ctx.spec.spec_hash, config),
                  interval_start=ctx.interval.start_iso, interval_end=ctx.interval.end_iso,
                  input_fingerprint=ctx.input_fingerprint, key_id=ctx.key_id)


def random_label(key: RunKey) -> dict[str, str]:
    """The estimation's randomness label: its run key's fields (not the key id), marked ``kind: estimation`` so
    no stream of a release's run key can equal it."""
    return {"kind": "estimation", **{k: str(v) for k, v in key.to_dict().items() if k != "key_id"}}


def random_source(ctx: RunContext, key: RunKey) -> RandomSource:
    """The run's source: keyed by the noise key and the run key's label, or seeded in test mode."""
    from dpops.noise.randomness import NoiseKey, keyed_random, test_random

    label = random_label(key)
    if ctx.randomness == "test":
        assert ctx.test_seed is not None  # prepare refuses test mode without a seed
        return test_random(int(ctx.test_seed), label)
    nk = ctx.fingerprint_key  # keyed mode: prepare loads the noise key and keys fingerprints with it
    if not isinstance(nk, NoiseKey):
        raise InvalidParameter("estimate: keyed randomness needs the noise key (--key-file)")
    return keyed_random(nk, label)


def manifests_folder(spec: ReleaseSpec) -> Path | Location:
    """The manifests directory of the spec's estimations: the release's own (``spec_manifests_dir``), a local
    directory or an object-store prefix (a release whose outputs the isolated workers write to S3 keeps its
    estimation's manifests beside its own)."""
    from dpops.release.manifests import spec_manifests_dir

    return spec_manifests_dir(spec)


def result_path(spec: ReleaseSpec, run_id: str) -> Path | Location:
    """Where the committed result is written: ``<output.root>/estimates/<release>/<run id>.json`` (not in the
    manifests directory, whose every ``*.json`` is a manifest to the report); a local path, or a location under
    an object-store output root."""
    root = spec.output_root
    if not root.is_local:
        return root / "estimates" / spec.name / f"{run_id}.json"
    return Path(root.local_path) / "estimates" / spec.name / f"{run_id}.json"


# --------------------------------------------------------------------------- step 2: reserve (or serve)


@dataclass
class Reserved:
    """What ``reserve_estimation`` leaves for the next steps: the run, its ledger record and this call's charge."""

    run: EstimationRun
    record: RunRecord
    charged: float
    test_mode: bool


def reserve_estimation(ctx: RunContext, config: EstimateConfig, ledger: Ledger, *,
                       then_charges: Sequence[PrivacyEvent] = (), serve_only: bool = False,
                       for_release: bool = False) -> Reserved | Estimate:
    """Serve the committed estimation of this request (an ``Estimate``), or reserve a new one (``Reserved``).

    A spec with per-metric contribution bounds is refused first (``dpops.spec.refuse_metric_contributions``):
    the estimation chooses one bound set for the release, so its result would not be the bounds those metrics
    use; nothing is reserved.

    The same request again (same spec, interval, input, key and configuration) is the same run key: a
    committed one is served from its manifest, a started one is recomputed with the same keyed noise;
    neither is charged again. Over the cap the ledger refuses (``BudgetExceeded``) and nothing changes.

    ``then_charges``: the events of the release that runs right after (``bounds: estimate``): a new
    estimation is reserved only if the estimation and that release fit the scope together
    (``ledger.plan``), so an interval whose declared total is over the cap is refused with the ledger
    unchanged instead of charging the estimation and refusing the release. ``serve_only``: return the
    committed estimation or raise LedgerError; never reserve (callers that must not charge). ``for_release``:
    the estimation of a plain release run (not a restatement): a new one is refused, before anything is
    reserved, when the release's interval is already published (``refuse_new_estimation_of_published``)."""
    from dpops.release.key_continuity import check_key_continuity
    from dpops.release.reservation import check_scope, refuse_new_estimation_of_published

    refuse_metric_contributions(ctx.spec, "dpops estimate",
                                "remove metrics[].contribution to estimate the release's bounds, then add them back")

    spec = ctx.spec
    evs = estimator.events(spec, config)  # refuses a request with nothing to estimate before anything is written
    key = run_key_of(ctx, config)
    check_scope(ctx, ledger)  # the release's own checks: the scope exists and protects this unit definition
    check_key_continuity(ctx, ledger)
    rec = ledger.run(key.run_id)
    if rec is not None and rec.state == "committed":
        return served_estimation(spec, config, rec)
    # a test-mode run is never committed: once charged (spent_unpublished) its seeded result is recomputed, free
    test_mode = ctx.randomness == "test"
    test_again = test_mode and rec is not None and rec.state == "spent_unpublished"
    if serve_only and not test_again:
        raise LedgerError(f"{spec.name} {ctx.interval}: its bounds: estimate estimation has not been committed "
                          f"(run {key.run_id} is {rec.state if rec is not None else 'not in the ledger'}); run the "
                          "release (dpops release run, or the DAG's reserve task) first; nothing was charged")
    if rec is not None and rec.state in ("released", "spent_unpublished") and not test_again:
        raise LedgerError(f"estimation run {key.run_id} is {rec.state}; change the request (e.g. --epsilon) for a "
                          "new run")
    charged = 0.0
    if rec is None and for_release:
        refuse_new_estimation_of_published(ctx, ledger.published(spec.name, ctx.interval.start_iso,
                                                                 ctx.interval.end_iso))
    if rec is None and then_charges:
        fit = ledger.plan(spec.budget.scope, [(ctx.interval.start_iso, ctx.interval.end_iso,
                                               list(evs) + list(then_charges))])
        if not fit.fits_all:
            left = ledger.status(spec.budget.scope).remaining
            raise BudgetExceeded(
                f"{spec.name} {ctx.interval}: the estimation (bounds: estimate, epsilon {config.epsilon:g}) and the "
                f"release together cost {fit.items[0].cost:g} {fit.unit}, more than scope {spec.budget.scope!r} has "
                f"left ({left:g} of cap {fit.cap:g}); nothing was reserved")
    if rec is None:
        # Another estimation of this interval (another configuration, spec or input) is committed already: the
        # ledger keeps one current publication per (release, interval), so the new one restates it (linked,
        # charged afresh); the earlier one stays committed and usable by the releases that name it.
        published = ledger.published(key.release, ctx.interval.start_iso, ctx.interval.end_iso)
        rec = ledger.reserve(key, spec.budget.scope, evs, actor=ctx.actor,
                             restates=published.run_id if published is not None else None,
                             details={"randomness": ctx.randomness, "spec": spec.source, "kind": "estimation"})
        charged = float(rec.epsilon or 0.0)
    return Reserved(EstimationRun(ctx, key), rec, charged, test_mode)


def served_estimation(spec: ReleaseSpec, config: EstimateConfig, rec: RunRecord) -> Estimate:
    """A committed estimation: its result read back from its manifest (nothing recomputed or charged).

    The manifest read is the file the ledger's commit entry names, and its sha256 must be the one that
    entry recorded (issue 25 item 7c): the served bounds become a release's sensitivity, so a manifest
    edited after the commit (e.g. [0, 32] made [0, 1e6]) would set a release's bounds that no DP
    mechanism chose. A mismatch is an IntegrityError (exit 7) before anything is reserved."""
    import hashlib

    from dpops.manifest.io import manifest_exists, parse_manifest, read_manifest_bytes
    from dpops.manifest.verify import committed_manifest_problems

    folder = manifests_folder(spec)
    recorded = ((rec.details or {}).get("commit") or {}).get("manifest")
    name = recorded.get("file") if isinstance(recorded, dict) else None
    # a bare file name only (no separator, no ".."): the entry names a file IN the folder, never elsewhere
    path = manifest_exists(folder, name) if isinstance(name, str) and name and Path(name).name == name \
        and name not in (".", "..") else None
    raw = read_manifest_bytes(path) if path is not None else b""  # one read: the bytes checked are those served
    problems = (committed_manifest_problems(rec, str(name), hashlib.sha256(raw).hexdigest(), required=True)
                if path is not None else
                [f"the manifest file the ledger's commit entry names ({name!r}) is not in {folder}"])
    if problems or path is None:
        raise IntegrityError(f"{spec.name}: refusing to serve committed estimation {rec.run_id}: " + "; ".join(problems)
                             + ". Restore the manifest from a backup and investigate who changed it; nothing was "
                             "reserved or charged")
    m = parse_manifest(raw, source=path)
    est = m.get("estimation") or {}
    res = est.get("result") or {}
    return Estimate(spec, config, res.get("max_partitions_per_unit"), res.get("max_rows_per_unit_per_partition"),
                    {c: (float(b[0]), float(b[1])) for c, b in (res.get("bounds") or {}).items()},
                    [Mechanism(**x) for x in est.get("mechanisms", [])], run_id=rec.run_id,
                    state="already_committed", manifest=path)


# --------------------------------------------------------------------------- step 3: start


def start_estimation(ledger: Ledger, reserved: Reserved) -> RandomSource:
    """``ledger.start`` after every check that draws nothing (refunded if one fails); the run's randomness.

    A run found started (interrupted earlier) or a test-mode run again is not started twice: it gets the
    same source, so it recomputes the same result, uncharged."""
    ctx, key = reserved.run.ctx, reserved.run.key
    if reserved.record.state == "reserved":
        try:  # everything that can fail without drawing anything happens before start, and is refunded
            from dpops.release.computation import check_input_unchanged

            rng = random_source(ctx, key)
            manifests_folder(ctx.spec)
            result_path(ctx.spec, key.run_id)
            # the release's rule: the input is still the one the run key names (its stat snapshot, else its hash)
            check_input_unchanged(ctx, "before the estimation started; nothing was drawn, the reservation is "
                                       "refunded", snapshot_suffices=True)
        except BaseException as exc:
            ledger.release(key.run_id, reason=f"failed before any mechanism ran: {public_message(exc)}"[:500],
                           actor=ctx.actor)
            raise
        ledger.start(key.run_id, actor=ctx.actor)  # from here on the charge stays
        return rng
    rng = random_source(ctx, key)
    manifests_folder(ctx.spec)
    return rng


# --------------------------------------------------------------------------- step 4: compute


ENGINES = ("beam", "driver")  # how compute_estimation counts: Beam passes on workers (the default), or rows here
DEFAULT_ENGINE = "beam"


@dataclass(frozen=True)
class EstimationEngine:
    """Where an estimation's private read runs (``compute_estimation``).

    ``name``: ``beam`` (the default: Beam passes over the input, ``pipelines.estimation``; only public-grid
    counts reach this process, and a worker holds about one unit bucket's rows, so memory does not grow with
    the input) or ``driver`` (every row of the interval read into this process: the reference the tests
    compare the workers with, bounded by this machine's memory). ``runner``/``runner_options``: the Beam
    runner, as ``dpops release run --runner``. ``staging``: a private location the workers and this process
    both reach (a local directory or an object-store prefix) for the workers' scratch files and the counts;
    None: a fresh 0700 temporary directory on this machine, which only in-process workers see. Public
    configuration: it changes where the counts are computed, never what they are (the same bounds).
    ``buckets``: how many unit-hash buckets the rows are split into between the read and the count: a worker
    holds about 1/``buckets`` of the rows, and each work item writes up to ``buckets`` scratch files (fewer
    suit small inputs on an object store, where each file is a request)."""

    name: str = DEFAULT_ENGINE
    runner: str = "FnApiRunner"
    runner_options: tuple[str, ...] = ()
    staging: str | None = None
    buckets: int = 64

    @classmethod
    def of(cls, engine: str | EstimationEngine) -> EstimationEngine:
        """An engine from its name (``ENGINES``) or itself; an unknown name is refused."""
        e = cls(name=engine) if isinstance(engine, str) else engine
        if e.name not in ENGINES:
            raise InvalidParameter(f"estimation engine must be one of {ENGINES}, got {e.name!r}; nothing was reserved")
        if isinstance(e.buckets, bool) or not isinstance(e.buckets, int) or not 1 <= e.buckets <= 1 << 16:
            raise InvalidParameter(f"estimation buckets must be an integer in [1, 65536], got {e.buckets!r}; nothing "
                                   "was reserved")
        return e


def compute_estimation(run: EstimationRun, config: EstimateConfig, rng: RandomSource, *,
                       engine: str | EstimationEngine = DEFAULT_ENGINE,
                       reads: list[dict[str, tuple[int, str]]] | None = None) -> Estimate:
    """The interval's counts through the pure mechanisms (``dpops.analysis.estimate.estimate_counts``; error/1:
    ``estimate_by_error`` over the exact histograms).

    ``engine`` (``EstimationEngine``) ``beam``: counted by Beam passes on the workers (``PipelineCounts``), only
    the public-grid counts (error/1: the exact histograms on the public bins) coming back; ``driver``: the rows
    read into this process (``read_rows``) and counted here. Both read with the same streams and count with the
    same functions, so they give the same bounds, bit for bit. Runs after ``ledger.start``: nothing here may
    depend on the data to fail (an empty interval is data).

    ``reads``: when given, one entry is appended per read of the input (the driver's one read, or each Beam
    pass): {input path: (size, salted tag)} of every CSV file that read consumed whole
    (``dpops.inputs.read_digest_tag`` under ``estimation_digest_salt(rng)``), for the check after the read
    (``run_estimation``). In memory only."""
    eng = EstimationEngine.of(engine)
    if eng.name == "driver":
        digests: dict[str, tuple[int, str]] = {}
        rows = read_rows(run.ctx, rng.child("estimate", "read"), digests=digests,
                         digest_salt=estimation_digest_salt(rng))
        if reads is not None:
            reads.append(digests)
        est = estimator.estimate_rows(run.ctx.spec, rows, config, rng)  # looked up at call time (tests plant faults)
    else:
        counts = PipelineCounts(run, config, eng)
        try:
            if config.method == QUANTILE_METHOD:
                est = estimator.estimate_counts(run.ctx.spec, counts, config, rng)
            else:
                est = estimator.estimate_by_error(run.ctx.spec, counts.error_histograms(), config, rng)
        finally:
            if reads is not None:
                reads.extend(counts.reads)
    est.run_id = run.key.run_id
    return est


def read_config(ctx: RunContext) -> ReadConfig:
    """The release's reader configuration for the estimation's prepared context: the spec's declared types and
    columns, its public partitions, its time filter (the interval as integer ns). One builder for both engines."""
    from pipelines.bounding import metric_layout
    from pipelines.io import ReadConfig, hash_partition_tuples

    spec, plan = ctx.spec, ctx.plan
    types = {k: str(v) for k, v in spec.input.columns.items()}
    pub = None
    if plan.public_partitions is not None:
        pub = np.sort(hash_partition_tuples([tuple(x) for x in plan.public_partitions],
                                            tuple(plan.partition_columns), types))
    window = None
    if spec.input.time_column is not None:
        epoch = datetime(1970, 1, 1, tzinfo=UTC)

        def ns(t: datetime) -> int:
            d = t - epoch
            return (d.days * 86_400 + d.seconds) * 1_000_000_000 + d.microseconds * 1_000

        window = (ns(ctx.interval.start), ns(ctx.interval.end))
    return ReadConfig(format=spec.input.format, types=types,
                      unit_column=None if spec.privacy_unit.record_level else spec.privacy_unit.column,
                      partition_columns=tuple(plan.partition_columns), value_columns=metric_layout(plan)[0],
                      category_columns={}, public_hashes=pub, time_column=spec.input.time_column,
                      time_window_ns=window)


def read_rows(ctx: RunContext, rng: RandomSource, *, digests: dict[str, tuple[int, str]] | None = None,
              digest_salt: bytes = b"") -> dict[str, np.ndarray]:
    """The interval's rows, checked and hashed by the release's own ``prepare_batch`` (one pair salt). An
    interval without data rows gives empty columns, never an error (it runs after the charge).

    ``digests``: filled with {input path: (size, tag)} of each CSV file read to its end, the tag
    ``dpops.inputs.read_digest_tag`` under ``digest_salt`` (the Beam passes' form, so one check serves both)."""
    from dpops.inputs import read_digest_tag
    from pipelines.bounding import pair_salt
    from pipelines.io import ReadDigest, iter_record_batches, prepare_batch, work_items

    spec = ctx.spec
    cfg = read_config(ctx)
    salt = pair_salt(rng)
    parts: list[dict[str, np.ndarray]] = []
    paths = list(ctx.input_paths)
    for item in work_items(paths, spec.input.format):
        digest = ReadDigest()
        for j, (batch, offset) in enumerate(iter_record_batches(item, cfg, None, digest)):
            rows, _, _ = prepare_batch(batch, item[0], offset, cfg, rng.child("read", item[0], item[2] or 0, j),
                                       pair_salt=salt)
            parts.append(rows)
        if digests is not None and digest.complete:
            digests[paths[item[0]]] = (digest.size, read_digest_tag(digest_salt, digest.size, digest.hexdigest()))
    if not parts:
        # n = 0 is data (issue 25 item 3): this runs after ledger.start, so refusing an interval without rows
        # would be a data-dependent abort that leaves it charged and never published. An empty batch of the
        # declared types goes through the same prepare_batch, so the mechanisms get the same (empty) columns
        # and still output DP bounds (every count is zero; the public tail preference picks the candidate).
        import pyarrow as pa

        from pipelines.io import ARROW_TYPES

        empty = pa.RecordBatch.from_pydict({c: pa.array([], type=ARROW_TYPES[cfg.types[c]]) for c in cfg.needed})
        rows, _, _ = prepare_batch(empty, 0, 0, cfg, rng.child("read", "empty"), pair_salt=salt)
        parts.append(rows)
    return {k: np.concatenate([x[k] for x in parts]) for k in parts[0]}


class PipelineCounts:
    """``dpops.analysis.estimate.EstimationCounts`` answered by Beam passes over the input (``pipelines.estimation``).

    One ``pairs`` pass gives the L0 counts and the Linf counts at every candidate L0 (so Linf costs no second
    read), one ``values`` pass the value counts at the chosen bounds. The request names the key's reference,
    never the key; the workers rebuild the estimation's read stream from it (``random_source``'s label). The
    counts come back through a private directory (``tempfile.mkdtemp``: 0700), removed after each pass."""

    def __init__(self, run: EstimationRun, config: EstimateConfig, engine: EstimationEngine | None = None):
        self.run, self.config, self.engine = run, config, engine or EstimationEngine()
        self.read = read_config(run.ctx)
        self._pairs: PassCounts | None = None
        # each pass's {input path: (size, salted tag)} of the bytes it read (``CountedPass.read_digests``)
        self.reads: list[dict[str, tuple[int, str]]] = []

    def _pass(self, request: Callable[[str], EstimationCountsRequest]) -> PassCounts:
        counted = self._counted(request)
        self.reads.append(counted.read_digests)
        return counted.counts

    def _counted(self, request: Callable[[str], EstimationCountsRequest]) -> CountedPass:
        import shutil
        import tempfile
        import uuid

        from dpops.release.pipeline_seam import load_count_estimation

        if self.engine.staging is None:
            staging = tempfile.mkdtemp(prefix="dpops-estimate-")  # 0700: the counts and scratch are exact, not DP
            try:
                return load_count_estimation()(request(staging))
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        from pipelines import fs

        # a fresh location per pass under the operator's private staging (workers on other machines reach it)
        staging = fs.join(self.engine.staging, f"dpops-estimate-{uuid.uuid4().hex}")
        if fs.is_local(staging):
            os.makedirs(staging, mode=0o700)
        try:
            return load_count_estimation()(request(staging))
        finally:
            fs.delete_everything_under(staging)  # a failed pass may leave scratch files of some buckets

    def _request(self, staging: str, stage: str, *, grid_l0: tuple[int, ...] = (), grid_linf: tuple[int, ...] = (),
                 l0: int = 1, linf: int = 1, columns: tuple[str, ...] = (), public_hashes: tuple[int, ...] = (),
                 histograms: tuple[str, ...] = ()) -> EstimationCountsRequest:
        from dpops.release.pipeline_seam import EstimationCountsRequest

        ctx, key = self.run.ctx, self.run.key
        return EstimationCountsRequest(
            stage=stage, read=self.read, work_items=(), input_paths=tuple(str(x) for x in ctx.input_paths),
            input_format=ctx.spec.input.format, label=tuple(random_label(key).items()),
            randomness=ctx.randomness, key_ref=ctx.key_path, key_id=ctx.key_id, test_seed=ctx.test_seed,
            staging_dir=staging, grid_l0=grid_l0, grid_linf=grid_linf, l0=l0, linf=linf, columns=columns,
            public_hashes=public_hashes, histograms=histograms, max_linf=int(self.config.max_linf),
            runner=self.engine.runner, runner_options=self.engine.runner_options, n_buckets=self.engine.buckets)

    def error_histograms(self) -> BoundHistograms:
        """One ``error`` pass: error/1's exact histograms (``estimate.error_exact_histograms``), summed per bucket."""
        spec = self.run.ctx.spec
        names = tuple(m.name.split(":", 1)[1] for m in estimator.mechanisms(spec, self.config))
        cols = tuple(n.split(":", 1)[1] for n in names if n.startswith("values:"))
        pub = tuple(int(x) for x in estimator.public_partition_hashes(spec))
        h = self._pass(lambda staging: self._request(staging, "error", columns=cols, public_hashes=pub,
                                                     histograms=names)).histograms
        assert h is not None
        return h

    def _pairs_pass(self) -> PassCounts:
        from dpops.analysis.estimate import contribution_grid

        if self._pairs is None:
            g0 = tuple(int(x) for x in contribution_grid(self.config.max_l0))
            g1 = tuple(int(x) for x in contribution_grid(self.config.max_linf))
            self._pairs = self._pass(lambda staging: self._request(staging, "pairs", grid_l0=g0, grid_linf=g1))
        return self._pairs

    def l0_counts(self, grid: np.ndarray) -> GridCounts:
        """The ``pairs`` pass's L0 counts (``grid`` is ``contribution_grid(config.max_l0)``)."""
        counts = self._pairs_pass()
        assert counts.l0 is not None and len(grid) == len(counts.l0.at_or_below)
        return counts.l0

    def linf_counts(self, l0: int, grid: np.ndarray) -> GridCounts:
        """The ``pairs`` pass's Linf counts at ``l0`` (a candidate of the L0 grid: the L0 mechanism's output)."""
        c = self._pairs_pass().linf[int(l0)]
        assert len(grid) == len(c.at_or_below)
        return c

    def value_counts(self, l0: int, linf: int, columns: Sequence[str], grid: np.ndarray) -> dict[str, ValueCounts]:
        """One ``values`` pass at (``l0``, ``linf``) over ``columns`` (``grid`` is ``value_grid()``)."""
        cols = tuple(columns)
        return self._pass(lambda staging: self._request(staging, "values", l0=int(l0), linf=int(linf),
                                                        columns=cols)).values


# --------------------------------------------------------------------------- step 5: commit


def commit_estimation(ledger: Ledger, reserved: Reserved, est: Estimate) -> Estimate:
    """Manifest, result file, then ``ledger.commit`` naming the manifest's sha256 (test mode: ``end_test_mode``).

    The manifest is written before the commit, as a release's is before its publish: a crash between the
    two leaves a started run whose retry recomputes the same keyed result and commits it, uncharged."""
    from dpops.ledger.budget import format_budget
    from dpops.manifest.io import file_sha256
    from dpops.manifest.run_hook import write_run_manifest

    run = reserved.run
    ctx, key, spec = run.ctx, run.key, run.ctx.spec
    if reserved.test_mode:
        return end_test_mode(ctx, ledger, key, est, reserved.charged)
    folder = manifests_folder(spec)
    out = result_path(spec, key.run_id)
    result_uri = out.resolve().as_uri() if isinstance(out, Path) else out.uri
    path = write_run_manifest(run, ledger, {"state": "published", "output_uri": result_uri},
                              manifests_dir=folder, estimation=estimator.manifest_section(est))
    _write_result(out, est)
    # the commit entry records the manifest's sha256 (as a release's does): an edit after the commit shows
    ledger.commit(key.run_id, output_uri=result_uri, actor=ctx.actor,
                  details={"kind": "estimation", "manifest": {"file": Path(path).name, "sha256": file_sha256(path)}})
    est.state = "committed"
    est.epsilon_charged = reserved.charged
    est.manifest = path
    est.details = {"scope": spec.budget.scope, "charged": format_budget(reserved.charged)}
    return est


def end_test_mode(ctx: RunContext, ledger: Ledger, key: RunKey, est: Estimate, charged: float) -> Estimate:
    """A test-mode (seeded) estimation: charged, never published (issue 25 item 4).

    Privacy reasons, as for a test-mode release (``dpops.release.publication``): seeded noise is not secret,
    so its output is never a DP release; the run is marked spent_unpublished (the charge stays, nothing is
    committed), and ``check_dependency`` refuses it to any keyed or os release before reservation. No
    manifest and no result file is written under output.root: the run key's input fingerprint is keyed with
    the PUBLIC test key, so a reviewer holding it could recompute it for "alice in" and "alice out" and
    confirm membership. The caller gets the result (the operator's own output directory)."""
    from dpops.ledger.budget import format_budget

    rec = ledger.run(key.run_id)
    if rec is not None and rec.state == "started":
        ledger.mark_spent_unpublished(key.run_id, actor=ctx.actor,
                                      reason="test-mode (seeded) estimation: never published, never feeds a release "
                                             "with keyed or os randomness")
    est.state = "test_only"
    est.epsilon_charged = charged
    est.manifest = None
    est.details = {"scope": ctx.spec.budget.scope, "charged": format_budget(charged), "randomness": "test"}
    return est


def _write_result(path: Path | Location, est: Estimate) -> None:
    data = (json.dumps({"run_id": est.run_id, "result": est.result(), "patch": est.patch()}, indent=2,
                       sort_keys=True) + "\n").encode("utf-8")
    if isinstance(path, Location):  # an object store: one PUT is atomic
        from dpops.storage import files

        files.write_bytes(path, data)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- the whole run


# how refusals name an estimation's staging: ``dpops estimate --staging``, or a release's ``bounds: estimate`` pass
# given ``--estimation-staging`` / ``$DPOPS_ESTIMATION_STAGING`` (the engine does not record which one set it)
STAGING_FIELD = "the estimation staging (--staging, --estimation-staging or $DPOPS_ESTIMATION_STAGING)"


def release_estimation_engine(runner: str, runner_options: Sequence[str],
                              staging: str | None) -> EstimationEngine:
    """Where a release's ``bounds: estimate`` pass runs: with ``staging`` (``--estimation-staging``,
    ``$DPOPS_ESTIMATION_STAGING``: a private location both this process and the workers reach) on the release's
    own runner, so an isolated-worker release reads its private input only on its workers, its estimation
    included; without one, Beam in this process (a driver-local scratch directory would be invisible to other
    machines' workers). Either way the same bounds, bit for bit (``EstimationEngine``); the staging is checked
    by ``check_engine`` before anything is reserved."""
    if staging is None:
        return EstimationEngine()
    return EstimationEngine(DEFAULT_ENGINE, runner, tuple(runner_options), staging)


def check_engine(ctx: RunContext, engine: str | EstimationEngine, config: EstimateConfig) -> EstimationEngine:
    """Refuse, before anything is reserved, an engine that could only fail after ``ledger.start``: an unknown
    name; ``beam`` without Beam installed (the pipeline is imported here); ``beam`` in keyed mode without a key
    reference for the workers (a key object handed to ``prepare`` cannot be shipped, by design); a ``staging``
    location that overlaps a data, public or output root or the key's directory (``check_scratch_location``:
    the scratch holds private rows and exact counts while a pass runs), or a local one that cannot be created or
    written (``prepare_local_staging``); without ``staging``, a ``$TMPDIR`` inside one of those places
    (``check_temp_scratch``)."""
    eng = EstimationEngine.of(engine)
    if eng.name != "beam":
        return eng
    from dpops.dataroots import check_scratch_location, check_temp_scratch

    if eng.staging is not None:
        loc = check_scratch_location(eng.staging, STAGING_FIELD, source=ctx.spec.source, spec_dir=ctx.spec.base_dir,
                                     output_root=ctx.spec.output_root, key_path=ctx.key_path)
        if loc.is_local:
            prepare_local_staging(str(loc.local_path))
    else:  # each pass's fresh scratch goes under $TMPDIR (``PipelineCounts``)
        check_temp_scratch("estimate", source=ctx.spec.source, spec_dir=ctx.spec.base_dir,
                           output_root=ctx.spec.output_root, key_path=ctx.key_path)
    if ctx.randomness == "keyed" and not ctx.key_path:
        raise InvalidParameter("estimate --engine beam: the workers resolve the noise key from its reference, and "
                               "this run has none (pass --key-file); nothing was reserved")
    from dpops.release.pipeline_seam import load_count_estimation

    try:
        load_count_estimation()
    except ImportError as exc:
        raise InvalidParameter(f"estimate --engine beam needs Apache Beam (pip install 'dpops[beam]'): {exc.name} "
                               "is not installed (--engine driver reads the rows into this process instead); "
                               "nothing was reserved") from None
    return eng


def prepare_local_staging(path: str, field: str = STAGING_FIELD) -> None:
    """A local ``--staging`` directory made (0700, as the passes' own directories are) and checked writable before
    anything is reserved: each pass creates its scratch below it after ``ledger.start``, so a staging below a
    regular file, or one this process cannot write, would otherwise fail the run with its charge kept and
    nothing computed. Refusal names the option and the path (no data is involved yet)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise InvalidParameter(f"{field} {path}: cannot create the directory ({exc.strerror or exc}); "
                               "give a directory this process can create and write; nothing was reserved") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise InvalidParameter(f"{field} {path}: this process cannot write the directory; fix its "
                               "permissions or give another; nothing was reserved")


def run_estimation(ctx: RunContext, config: EstimateConfig, ledger: Ledger, *,
                   then_charges: Sequence[PrivacyEvent] = (), serve_only: bool = False,
                   for_release: bool = False, engine: str | EstimationEngine = DEFAULT_ENGINE) -> Estimate:
    """Steps 2-5 over a prepared context (``prepare(..., for_estimation=True)``): serve, or reserve, start,
    compute, commit. A failure before ``start`` refunds the reservation; after it the run stays started
    (charged) and a retry recomputes the same result for free. Keywords as ``reserve_estimation``; ``engine``
    as ``compute_estimation`` (every engine gives the same bounds, so a retry may use any)."""
    eng = check_engine(ctx, engine, config)  # before anything is reserved
    reserved = reserve_estimation(ctx, config, ledger, then_charges=then_charges, serve_only=serve_only,
                                  for_release=for_release)
    if isinstance(reserved, Estimate):
        return reserved
    from dpops.release.computation import check_input_unchanged

    rng = start_estimation(ledger, reserved)
    reads: list[dict[str, tuple[int, str]]] = []
    est = compute_estimation(reserved.run, config, rng, engine=eng, reads=reads)  # a failure leaves it started
    # Committed only if what was read is what the run key (and the manifest) name: the estimation had no check of
    # its input at all, so a file replaced between prepare and the read was estimated on, and committed under the
    # fingerprint of other bytes. Every read's digests (each Beam pass, or the driver's one read) are compared
    # with the fingerprint pass's, as the release compares its reader's: a pass that saw other bytes while the
    # path and its stat stayed the same is refused too. After start: the run stays started (charged); a retry on
    # the final input is a new run key.
    check_input_unchanged(ctx, "while the estimation read it; the run stays charged and nothing is committed",
                          read_digests=reads, read_digest_salt=estimation_digest_salt(rng))
    return commit_estimation(ledger, reserved, est)


def refuse_os_randomness(randomness: str) -> None:
    """os randomness is refused before prepare: its noise cannot be reproduced, so a retry would be charged."""
    if randomness == "os":
        raise InvalidParameter("estimate: os randomness cannot be reproduced, so a retry would be charged again; "
                               "use keyed randomness (the default), whose retries are free")


__all__ = ["DEFAULT_ENGINE", "ENGINES", "EstimationEngine", "EstimationRun", "Reserved", "commit_estimation",
           "compute_estimation", "end_test_mode", "manifests_folder", "prepare_local_staging",
           "random_source", "read_rows", "refuse_os_randomness", "release_estimation_engine", "reserve_estimation",
           "result_path",
           "run_estimation", "run_key_of", "served_estimation", "start_estimation"]
