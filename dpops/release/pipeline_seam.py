"""The seam between the release steps (``dpops.release.computation``) and the Beam pipeline (pipelines/).

Dataclasses only: ``dpops`` never imports Beam. The compute step builds a
``ComputeRequest`` and calls ``pipelines.release_pipeline:run_release`` by its
dotted name, which returns a ``ComputeResult``. The request carries a key
REFERENCE, never the key: each worker resolves it and checks its key id.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from dpops.analysis.estimate import PassCounts
    from dpops.analysis.tune_stats import StatNeeds
    from dpops.analysis.tuning import TuneStatistics
    from dpops.noise.randomness import RandomSource
    from dpops.spec import ReleaseSpec
    from pipelines.io import ReadConfig

RUN_RELEASE = "pipelines.release_pipeline:run_release"
# The estimation's counting passes (``dpops.release.estimation.PipelineCounts``): ``count_estimation(request)``
COUNT_ESTIMATION = "pipelines.estimation:count_estimation"
# dpops simulate's one pass over a PUBLIC sample (``dpops.release.simulation``): ``sample_truth(request)``
SAMPLE_TRUTH = "pipelines.release_pipeline:sample_truth"
# a flagged private dpops tune's read (``dpops.release.tuning.tune_private``): ``tune_statistics(request)``
TUNE_STATISTICS = "pipelines.tuning:tune_statistics"
RANDOMNESS_MODES = ("keyed", "os", "test")


@dataclass(frozen=True)
class ComputeRequest:
    spec_path: str  # the pipeline re-loads the spec with dpops.spec.load_spec
    interval_start: str  # ISO-8601 UTC
    interval_end: str
    input_paths: tuple[str, ...]  # local paths or URIs (read through Beam's FileSystems on the workers)
    # {"release", "spec_hash", "interval_start", "interval_end", "input_fingerprint"}: the keyed noise label
    noise_label: dict[str, str]
    randomness: str  # "keyed" | "os" | "test"
    # keyed mode: a REFERENCE to the noise key (``dpops.keyref``: a key file path mounted on every worker,
    # file:PATH, gcp-secret://...), never the key itself; each worker resolves it
    key_ref: str | None = None
    # keyed mode: the public id of the key the run was prepared (and charged) with; every worker
    # refuses to draw noise with a key file holding another key
    key_id: str | None = None
    test_seed: int | None = None  # test mode only
    # run-specific empty location, a local path or a URI (file://, s3://, gs://...): data.parquet +
    # summary.json are written there; scratch under <staging>/_parts/ is removed at the end
    staging_dir: str = ""
    runner: str = "FnApiRunner"
    runner_options: tuple[str, ...] = ()
    # Optional guard: sha256 of the plan the ledger reserved (ReleasePlan.plan_hash). When given, the
    # pipeline refuses to draw noise if the plan it derives from the spec differs (spec edited in between).
    expected_plan_hash: str | None = None
    # bounds: estimate: the charged estimation's run id and its bounds per column; the pipeline applies
    # them to the spec it re-loads (``ReleaseSpec.with_estimated_bounds``, see ``spec_of``)
    estimated_from: str | None = None
    estimated_bounds: tuple[tuple[str, float, float], ...] = ()

    def spec_of(self) -> ReleaseSpec:
        """The spec this request computes: the file re-loaded, with the estimated bounds substituted when
        the spec says ``bounds: estimate`` (the same substitution ``prepare`` made, so the spec hash in the
        noise label and the plan hash match)."""
        from dpops.spec import load_spec

        spec = load_spec(self.spec_path)
        if self.estimated_from is not None:
            spec = spec.with_estimated_bounds(self.estimated_from, {c: (lo, hi) for c, lo, hi in self.estimated_bounds})
        return spec

    @property
    def key_path(self) -> str | None:
        """The former name of ``key_ref`` (read-only; a key file path is a key reference)."""
        return self.key_ref


@dataclass
class ComputeResult:
    output_file: str
    summary_file: str
    partitions_released: int
    # rows read, dropped by reason, clamped...: INTERNAL run log only, never published
    internal: dict[str, Any] = field(default_factory=dict)
    # {input path as in the request: (size, tag hex)} of every file the reader read whole as one byte stream
    # (CSV): what the pipeline actually consumed (``dpops.inputs.read_digest_tag`` of its size and sha256 under
    # ``read_digest_salt``), for ``check_input_unchanged``. In memory only: never written.
    read_digests: dict[str, tuple[int, str]] = field(default_factory=dict, repr=False, compare=False)
    read_digest_salt: bytes = field(default=b"", repr=False, compare=False)


@dataclass(frozen=True)
class EstimationCountsRequest:
    """One counting pass of an estimation (``pipelines.estimation``): read the interval's input on workers with
    the estimation's own streams and return only public-grid counts (``GridCounts``/``ValueCounts``, or
    error/1's ``BoundHistograms``).

    ``stage``: ``"pairs"`` (the L0 counts, and the Linf counts at every candidate L0 of ``grid_l0``),
    ``"values"`` (each column of ``columns`` over the rows bounding keeps at (``l0``, ``linf``)) or ``"error"``
    (error/1's exact ``histograms`` over the public partitions ``public_hashes``, in plan order, and the Linf
    grid up to ``max_linf``). The request carries the key's REFERENCE and id, never the key; the counts and the
    workers' scratch files live under ``staging_dir``, a private location the caller made (a 0700 directory,
    or a private prefix workers on other machines can reach) and removes."""

    stage: str
    read: ReadConfig  # built by dpops.release.estimation.read_config (the driver path's own)
    # the read's units (pipelines.io.work_items); listed by count_estimation from input_paths when those are given
    work_items: tuple[tuple[int, str, int | None, int], ...]
    label: tuple[tuple[str, str], ...]  # the estimation's randomness label (dpops.release.estimation.random_source)
    randomness: str  # "keyed" | "test"
    key_ref: str | None
    key_id: str | None
    test_seed: int | None
    staging_dir: str
    grid_l0: tuple[int, ...] = ()
    grid_linf: tuple[int, ...] = ()
    l0: int = 1
    linf: int = 1
    columns: tuple[str, ...] = ()
    input_paths: tuple[str, ...] = ()  # the interval's input files (local paths or URIs), in the prepared order
    input_format: str = "parquet"
    public_hashes: tuple[int, ...] = ()  # error: the public partitions' hashes in plan order (public)
    histograms: tuple[str, ...] = ()  # error: dpops.analysis.estimate.error_histogram_names
    max_linf: int = 256  # error: the Linf grid's top (EstimateConfig.max_linf)
    runner: str = "FnApiRunner"
    runner_options: tuple[str, ...] = ()
    n_buckets: int = 64  # unit-hash buckets: one scratch file per (work item, bucket); the counts do not depend on it


CONFLICTING_READS = "conflicting"  # a read digest's tag when two reads of one file disagreed: it matches no tag


@dataclass
class CountedPass:
    """What one counting pass returns (``pipelines.estimation.count_estimation``): its public-grid ``counts``, and
    ``read_digests``, {input path as in the request: (size, tag hex)} of every file its workers read whole as
    one byte stream (CSV), the salted tag under ``estimation_digest_salt`` (``dpops.inputs.read_digest_tag``),
    or ``CONFLICTING_READS`` when two reads of the file disagreed. The estimation's check after its read
    (``dpops.release.computation.check_input_unchanged``) compares every pass's with the fingerprint pass's
    digests, as the release does with its reader's."""

    counts: PassCounts
    read_digests: dict[str, tuple[int, str]] = field(default_factory=dict, repr=False, compare=False)


def estimation_digest_salt(source: RandomSource) -> bytes:
    """The salt of an estimation's read-digest tags: 32 bytes of its own stream (``source`` is the estimation's
    ``dpops.release.estimation.random_source``, which the driver holds and every worker rebuilds from the key
    reference or the test seed). Never from the data; os randomness is refused for an estimation."""
    return bytes(source.child("estimate", "digest_salt").uint64(4).tobytes())


@dataclass(frozen=True)
class TuneStatisticsRequest:
    """A flagged private ``dpops tune``'s read (``pipelines.tuning``): the sample read on workers with the driver
    path's reader and streams, ranked by the release's bounding, reduced to the statistics the scoring reads
    (``needs``, public: a function of spec and grid); only those reach the driver.

    ``seed``: the ``--seed`` test stream (None: fresh OS randomness on each worker, with ``salt``, the pair
    salt the driver drew, shipped so every worker orders a unit's pairs alike). The statistics and the
    workers' scratch files live under ``staging_dir``, a private location the caller made and removes."""

    read: ReadConfig  # dpops.analysis.tuning.read_config, with the sample's format
    sample_path: str  # the checked sample (SampleAccess.location): a local path or a URI
    needs: StatNeeds
    seed: int | None
    salt: tuple[int, int]
    staging_dir: str
    work_items: tuple[tuple[int, str, int | None, int], ...] = ()  # listed by tune_statistics when empty
    runner: str = "FnApiRunner"
    runner_options: tuple[str, ...] = ()
    n_buckets: int = 64  # unit-hash and partition-hash buckets; the statistics do not depend on it


@dataclass(frozen=True)
class SampleTruthRequest:
    """``dpops simulate``'s one pipeline pass over a public sample: read, check and bound it with the release's
    own code in test mode, and return the exact per-partition aggregates (``SampleTruth``).

    Exact aggregates are not differentially private, so the pipeline side (``pipelines.release_pipeline.
    sample_truth``) checks again what ``dpops.release.simulation`` checked: the sample must be public data
    (``dpops.analysis.sample_access.check_public_sample``: under ``$DPOPS_PUBLIC_ROOTS``, not under a data root,
    not the spec's input in disguise) and the randomness is the test seed, never a key. The spec travels as the
    parsed object: this pass runs in the calling process, never on remote workers."""

    spec: ReleaseSpec
    sample_path: str
    sample_format: str  # "csv" | "parquet"
    test_seed: int


@dataclass(frozen=True)
class SampleTruth:
    """The exact aggregates of a public sample, per partition present in it (same order in every array).

    ``bounded``: the accumulators the release noises (``pipelines.bounding.aggregate_bucket`` after contribution
    bounding and clamping: sums in fixed-point units of ``sum_unit``). ``unbounded``: the same partitions before
    bounding and clamping: ``count`` (rows), ``unit_count`` (distinct units), ``sum:<col>`` and ``sq:<col>`` (raw
    sums of values and of squares). ``names``: each partition's column values; ``stats``: the read's counters
    (rows read, dropped by reason, kept by the bounding, values clamped). Simulation only, never published."""

    names: list[tuple[object, ...]]
    bounded: dict[str, np.ndarray]  # accumulator name -> array aligned with ``names``
    unbounded: dict[str, np.ndarray]
    stats: dict[str, int]


def load_sample_truth() -> Callable[[SampleTruthRequest], SampleTruth]:
    """``pipelines.release_pipeline:sample_truth``, imported lazily (dpops never imports Beam itself)."""
    mod_name, func = SAMPLE_TRUTH.split(":")
    fn: Callable[[SampleTruthRequest], SampleTruth] = getattr(import_pipeline_module(mod_name), func)
    return fn


def load_count_estimation() -> Callable[[EstimationCountsRequest], CountedPass]:
    """``pipelines.estimation:count_estimation``, imported lazily (dpops never imports Beam itself)."""
    mod_name, func = COUNT_ESTIMATION.split(":")
    fn: Callable[[EstimationCountsRequest], CountedPass] = getattr(import_pipeline_module(mod_name), func)
    return fn


def load_tune_statistics() -> Callable[[TuneStatisticsRequest], TuneStatistics]:
    """``pipelines.tuning:tune_statistics``, imported lazily (dpops never imports Beam itself)."""
    mod_name, func = TUNE_STATISTICS.split(":")
    fn: Callable[[TuneStatisticsRequest], TuneStatistics] = getattr(import_pipeline_module(mod_name), func)
    return fn


def load_run_release() -> Callable[[ComputeRequest], ComputeResult]:
    """Import the pipeline lazily (Beam is heavy and optional for the core package)."""
    mod_name, func = RUN_RELEASE.split(":")
    run_release: Callable[[ComputeRequest], ComputeResult] = getattr(import_pipeline_module(mod_name), func)
    return run_release


def import_pipeline_module(name: str) -> ModuleType:
    """Import a ``pipelines`` module (which imports Beam) with the noisy third-party loggers quieted first.

    Beam logs "apitools not found, and bigquery client libraries are not available" on the root logger
    (and BigQuery INFO lines) while it is imported, which every ``release run`` printed; the filters go on
    before the import so exactly those records are dropped, never a dpops warning."""
    import importlib

    from dpops.third_party_logs import quiet_third_party_loggers

    quiet_third_party_loggers()
    return importlib.import_module(name)
