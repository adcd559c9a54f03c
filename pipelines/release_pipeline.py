"""The Beam release pipeline: read -> bound contributions -> aggregate per partition -> select
partitions + noise -> shard files, then data.parquet + summary.json in the staging location.

Built from the composite transforms of ``pipelines.transforms`` (element shapes there and in
``pipelines.elements``):

  ReadPrivateBatches        work items (file x row group) -> checked, hashed, pre-bounded row blocks
                            keyed by unit-hash bucket (+ partition names, internal counters)
  BoundContributions        CombinePerKey with combiner lifting: mergeable L0 / Linf bound
  AggregatePerPartition     clamping, exact integer per-partition partials keyed by noise shard
  SelectPartitionsAndNoise  partition selection / public alignment, noise, post-processing per shard
  WriteShards               <staging>/_parts/shard-NNNNN-of-MMMMM.parquet, every shard, atomically
  RunStats                  internal counters as Beam metrics, read by the driver (never a file)

The driver then reads the shard files back through the same filesystem layer (``pipelines.fs``:
Beam's ``FileSystems``, so the staging location may be a local path or any URI Beam's filesystems
handle), refuses a missing or unreadable shard (``StorageError``, never an empty release), merges
them into data.parquet, writes summary.json and removes ``_parts``. The exact internal counters come
back to the driver through the runner's metrics (``collect_stats``), never through storage the workers
write: on an object store that would leave exact counts where bucket readers may list them.

DoFns hold only picklable configuration. The noise key travels as a key *reference*
(``dpops.keyref``): each worker resolves it itself in ``DoFn.setup`` (never on a command line,
never in the pipeline options or the job graph, never logged) and refuses it unless its id is the
run's ``key_id``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import apache_beam as beam
import numpy as np

from dpops.release.pipeline_seam import ComputeRequest, ComputeResult, SampleTruth, SampleTruthRequest
from dpops.errors import DpopsError, InputDataError, InvalidParameter, StorageError
from dpops import release_plan  # looked up at call time: ``release_plan.plan_release`` (see ``_plan``)
from pipelines import fs
from pipelines.aggregate import select_and_noise  # noqa: F401 - re-exported (tests, auditor)
from pipelines.bounding import (
    AggregationSpec,
    aggregate_bucket,
    merge_partials,
    aggregation_spec,
    metric_layout,
)
from pipelines.elements import WorkItem
from pipelines.io import (
    ReadConfig,
    hash_partition_tuples,
    iter_record_batches,
    prepare_batch,
    work_items,
)
from pipelines.transforms import (
    EMPTY_SHARD,
    AggregatePerPartition,
    BoundContributions,
    ReadPrivateBatches,
    RunStats,
    SelectPartitionsAndNoise,
    WriteShards,
    SelectNoise,
    collect_stats,
    split_read_digests,
    concat_rows,
    empty_acc,
    shard_name,
    split_by_key,
)

if TYPE_CHECKING:
    from dpops.release_plan import ReleasePlan
    from dpops.spec import ReleaseSpec

# Unit-hash keys of the bounding combiner (the parallelism of the bound; the result does not depend on
# it). 256, not more: every read batch emits one element per key, and at ~50 us of pickling and Beam
# overhead per element 1024 keys cost ~1 s more per 10M rows on this machine.
N_BUCKETS = 256
N_SHARDS = 16  # fixed: the noise is drawn per shard
_empty_acc = empty_acc  # the former name (tests import it)
SelectNoiseWrite = SelectNoise  # the former DoFn name (the fault-injection tests hook its ``process``)


def _plan(spec: ReleaseSpec) -> ReleasePlan:
    """The release plan of ``spec``, from ``dpops.release_plan.plan_release`` looked up when called, not bound when
    this module was first imported: a caller that swaps the planner for a while (the test suite's stand-ins do)
    then never leaves its planner behind in every later pipeline of the process."""
    return release_plan.plan_release(spec)


@dataclass(frozen=True)
class RandomnessConfig:
    """How a worker builds the run's randomness source. Holds the key's REFERENCE and public id, never the key."""

    mode: str
    label: tuple[tuple[str, str], ...]
    key_ref: str | None = None
    test_seed: int | None = None
    key_id: str | None = None
    # os mode only: the pair-priority salt drawn once by the driver (each process's OS randomness differs,
    # and every worker must order a unit's pairs alike). Keyed and test mode re-derive it on each worker.
    os_pair_salt: tuple[int, int] | None = None
    # os mode only, likewise: the salt of the reader's read-digest tags (``digest_salt``), drawn once by the driver
    os_digest_salt: bytes | None = None

    def source(self):
        from dpops.noise import randomness

        label = dict(self.label)
        if self.mode == "keyed":
            # Resolved once per worker process and checked against the run's key id: a worker that
            # sees another key must not draw noise the ledger and manifest do not describe.
            from dpops.keyref import resolve_key_for_run

            return randomness.keyed_random(resolve_key_for_run(self.key_ref, self.key_id), label)
        if self.mode == "os":
            return randomness.os_random()
        if self.mode == "test":
            return randomness.test_random(int(self.test_seed), tuple(f"{k}={v}" for k, v in self.label))
        raise InvalidParameter(f"randomness must be keyed, os or test, got {self.mode!r}")

    def digest_salt(self, source) -> bytes:
        """The run's read-digest salt (``dpops.inputs.read_digest_tag``): 32 bytes of the run's own stream in keyed
        and test mode (every worker and the driver derive the same), the driver's draw in os mode."""
        if self.mode == "os":
            if self.os_digest_salt is None:
                raise InvalidParameter("os-mode randomness needs the driver's digest salt (build_context draws it)")
            return self.os_digest_salt
        return bytes(source.child("read", "digest_salt").uint64(4).tobytes())

    def pair_salt(self, source) -> tuple[int, int]:
        """The run's L0 pair-priority salt (``pipelines.bounding.pair_salt``)."""
        from pipelines.bounding import pair_salt

        if self.mode == "os":
            if self.os_pair_salt is None:
                raise InvalidParameter("os-mode randomness needs the driver's pair salt (build_context draws it)")
            return self.os_pair_salt
        return pair_salt(source)


@dataclass(frozen=True)
class PipelineContext:
    read: ReadConfig
    agg: AggregationSpec
    plan: Any  # dpops.release_plan.ReleasePlan
    randomness: RandomnessConfig
    parts_dir: str
    public_names: dict[int, tuple[Any, ...]] | None


# --------------------------------------------------------------------------- building


def _window_ns(request: ComputeRequest) -> tuple[int, int]:
    """The run's interval [start, end) as integer ns since the epoch (exact: no float on the way)."""
    from dpops.inputs import parse_interval

    iv = parse_interval(request.interval_start, request.interval_end)
    epoch = datetime(1970, 1, 1, tzinfo=timezone.utc)

    def ns(t: datetime) -> int:
        d = t - epoch
        return (d.days * 86_400 + d.seconds) * 1_000_000_000 + d.microseconds * 1_000

    return ns(iv.start), ns(iv.end)


def build_context(spec, plan, request: ComputeRequest, parts_dir: str, n_buckets: int | None = None, *,
                  time_filter: bool = True) -> PipelineContext:
    """The workers' configuration of one run. ``time_filter=False`` (``sample_truth`` only): no event-time
    filter, as a sample is not an interval's input."""
    types = dict(spec.input.columns)
    unit_col = None if spec.privacy_unit.record_level else spec.privacy_unit.column
    value_cols, cats, _, _, _ = metric_layout(plan)
    public_names = public_hashes = None
    if plan.public_partitions is not None:
        tuples = [tuple(p) for p in plan.public_partitions]
        hashes = hash_partition_tuples(tuples, plan.partition_columns, types)
        public_names = {int(h): t for h, t in zip(hashes, tuples)}
        if len(public_names) != len(tuples):
            raise InvalidParameter("two public partitions hash to the same 64-bit value; rename one")
        public_hashes = np.array(sorted(public_names), dtype=np.uint64)
    read = ReadConfig(
        format=spec.input.format, types=types, unit_column=unit_col,
        partition_columns=tuple(plan.partition_columns), value_columns=value_cols,
        category_columns=cats, public_hashes=public_hashes, n_buckets=n_buckets or N_BUCKETS, n_shards=N_SHARDS,
        time_column=spec.input.time_column if time_filter else None,
        time_window_ns=_window_ns(request) if time_filter else None)
    agg = aggregation_spec(plan)  # the release's bounds, and per-metric bound sets when the spec has them
    label = tuple(sorted((str(k), str(v)) for k, v in request.noise_label.items()))
    os_salt = os_digest = None
    if request.randomness == "os":
        from dpops.noise.randomness import os_random
        from pipelines.bounding import pair_salt

        os_salt = pair_salt(os_random())
        os_digest = bytes(os_random().uint64(4).tobytes())
    rnd = RandomnessConfig(request.randomness, label, request.key_ref, request.test_seed, _key_id(request), os_salt,
                           os_digest)
    return PipelineContext(read, agg, plan, rnd, parts_dir, public_names)


def build_pipeline(p: beam.Pipeline, ctx: PipelineContext, items: list) -> None:
    """The end-to-end release job from the composite transforms (``pipelines.transforms``)."""
    read = p | "ReadPrivateBatches" >> ReadPrivateBatches(ctx, [WorkItem(*it) for it in items])
    bounded = read["rows"] | "BoundContributions" >> BoundContributions(ctx.agg.l0, ctx.agg.linf)
    agg = bounded | "AggregatePerPartition" >> AggregatePerPartition(ctx.agg, ctx.read.n_shards)
    noisy = {"partials": agg["partials"], "names": read["names"]} | "SelectPartitionsAndNoise" >> \
        SelectPartitionsAndNoise(ctx)
    noisy | "WriteShards" >> WriteShards(ctx.parts_dir, ctx.read.n_shards)
    (read["stats"], agg["stats"]) | "RunStats" >> RunStats()


def _make_pipeline(request: ComputeRequest) -> beam.Pipeline:
    from apache_beam.options.pipeline_options import PipelineOptions

    # AWS_ENDPOINT_URL -> --s3_endpoint_url for the workers (an endpoint, not a secret: pipelines.fs)
    opts = fs.s3_options(list(request.runner_options))
    if request.runner == "FnApiRunner":
        from apache_beam.runners.portability.fn_api_runner import FnApiRunner

        return beam.Pipeline(runner=FnApiRunner(), options=PipelineOptions(opts))
    return beam.Pipeline(options=PipelineOptions([f"--runner={request.runner}", *opts]))


def _check_request(request: ComputeRequest, spec) -> None:
    if request.randomness not in ("keyed", "os", "test"):
        raise InvalidParameter(f"ComputeRequest.randomness must be keyed, os or test, got {request.randomness!r}")
    if request.randomness == "keyed" and not request.key_ref:
        raise InvalidParameter("ComputeRequest.key_ref is required in keyed mode (a key file path, file:PATH or "
                               "gcp-secret://...: where each worker finds the noise key, never the key itself)")
    if request.randomness == "test" and request.test_seed is None:
        raise InvalidParameter("ComputeRequest.test_seed is required in test mode")
    if request.randomness != "test" and request.test_seed is not None:
        raise InvalidParameter("ComputeRequest.test_seed is only allowed in test mode")
    if not request.staging_dir:
        raise StorageError("ComputeRequest.staging_dir is empty: give a run-specific empty directory")
    if not request.input_paths:
        raise InputDataError("ComputeRequest.input_paths is empty: there is no input to read")
    want = request.noise_label.get("spec_hash")
    if want is not None and want != spec.spec_hash:
        raise InvalidParameter(
            f"{request.spec_path}: the spec changed since the run was prepared (spec_hash {spec.spec_hash[:12]} "
            f"!= {str(want)[:12]} in the noise label); prepare the run again"
        )


def _prepare_staging(staging: str) -> str:
    """Check the staging location holds no output yet, clear leftovers of an earlier attempt's
    ``_parts`` and return the parts location. Local paths keep today's behaviour (directories made)."""
    parts_dir = fs.join(staging, "_parts")
    try:
        fs.make_dirs(staging)
        for name in ("data.parquet", "summary.json"):
            if fs.exists(fs.join(staging, name)):
                raise StorageError(f"{staging}: staging directory already holds an output; use a fresh run directory")
        fs.delete_tree(parts_dir)
        fs.make_dirs(parts_dir)
    except DpopsError:
        raise
    except Exception as exc:  # noqa: BLE001 - OSError, BeamIOError, an object store client error
        raise fs.storage_error(staging, "cannot prepare the staging location", exc) from None
    return parts_dir


def read_shards(parts_dir: str, n_shards: int):
    """The shard tables the workers wrote, in shard order (None for an empty shard): every one of the
    ``n_shards`` must be there and readable, else ``StorageError`` (a worker that wrote elsewhere or died must never turn into an
    empty or partial release)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    for s in range(n_shards):
        path = fs.join(parts_dir, shard_name(s, n_shards))
        try:
            data = fs.read_bytes(path)
        except Exception as exc:  # noqa: BLE001 - missing on every filesystem: FileNotFoundError / BeamIOError
            raise StorageError(f"{path}: shard {s} of {n_shards} is missing ({type(exc).__name__}): the pipeline's "
                               "workers did not write it where the driver reads; check that the staging location "
                               "is shared storage every worker can write (an object store URI or a shared "
                               "filesystem) and retry") from None
        if not data or data == EMPTY_SHARD:  # empty on purpose: the shard released no partition (WriteShards)
            tables.append(None)
            continue
        try:
            tables.append(pq.read_table(pa.BufferReader(data)))
        except (OSError, pa.ArrowException) as exc:
            raise StorageError(f"{path}: shard {s} of {n_shards} is incomplete or damaged ({type(exc).__name__}); "
                               "retry the run") from None
    return tables


def run_release(request: ComputeRequest) -> ComputeResult:
    """Build and run the Beam pipeline for one interval; write data.parquet + summary.json to staging
    (a local path or a URI)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    t0 = time.time()
    spec = request.spec_of()  # the file, with the estimated bounds of a bounds: estimate spec
    _check_request(request, spec)
    plan = _plan(spec)
    if request.expected_plan_hash is not None and request.expected_plan_hash != plan.plan_hash:
        raise InvalidParameter(
            "the release plan differs from the one the ledger reserved (expected_plan_hash mismatch); "
            "prepare and reserve the run again"
        )
    staging = fs.normalize(request.staging_dir)
    p = _make_pipeline(request)  # first: it points Beam's FileSystems at the run's options (s3 endpoint, ...)
    parts_dir = _prepare_staging(staging)

    ctx = build_context(spec, plan, request, parts_dir)
    # Keyed mode fails fast here, in the driver, on a bad key reference (the message names it, not the key). The
    # same source gives the salt of the reader's digest tags, which the driver's check compares (digest_salt).
    digest_salt = ctx.randomness.digest_salt(ctx.randomness.source())
    items = work_items([fs.normalize(x) for x in request.input_paths], spec.input.format)
    build_pipeline(p, ctx, items)
    result = p.run()
    state = result.wait_until_finish()
    if state is not None and str(state).upper().rsplit(".", 1)[-1] not in ("DONE", "SUCCEEDED"):
        raise StorageError(f"the release pipeline ended in state {state}; nothing was staged, retry the run")
    t_pipe = time.time() - t0

    tables = [t for t in read_shards(parts_dir, N_SHARDS) if t is not None and t.num_rows]
    table = pa.concat_tables(tables, promote_options="default") if tables else _empty_table(plan, spec)
    table = table.sort_by([(c, "ascending") for c in plan.partition_columns])
    try:
        reported = collect_stats(result)
    except Exception as exc:  # noqa: BLE001 - a runner without metrics (NotImplementedError), a job API error
        raise StorageError(f"the runner returned no pipeline metrics ({type(exc).__name__}): the run's internal "
                           "counters travel as Beam metrics; use a runner that reports them (FnApiRunner, a "
                           "portable runner, Flink, Dataflow) and retry") from None
    if reported is None:
        raise StorageError("the pipeline reported no internal counters (the RunStats step did not complete); "
                           "retry the run")
    # The reader's digests of the bytes it read leave the counters here, before any of them is written
    # (pipelines.transforms.read_digest_counters); the driver compares them with the run key's fingerprint.
    counters, read_digests = split_read_digests(reported)
    internal: dict[str, Any] = dict(counters)
    if "rows_to_bounding" in internal and "rows_kept" in internal:
        internal["rows_dropped_bounding"] = internal["rows_to_bounding"] - internal["rows_kept"]

    out_file = fs.join(staging, "data.parquet")
    summary = {
        "release": plan.release,
        "interval": {"start": request.interval_start, "end": request.interval_end},
        "spec_hash": plan.spec_hash,
        "plan_hash": plan.plan_hash,
        "randomness": request.randomness,
        "key_id": ctx.randomness.key_id,
        "test_mode": request.randomness == "test",
        "partitions_released": table.num_rows,
        "columns": table.column_names,
        "runner": request.runner,
        "plan": plan.describe(),
        "notes": {
            "malformed_rows": "rows with a null unit or partition, a null/NaN/inf value in ANY metric "
                              "column, or a cell that does not convert to its declared type, and CSV lines "
                              "with the wrong number of fields, are dropped for all metrics before "
                              "contribution bounding",
            "mean_variance_intervals": "delta-method approximations from the noise stds",
            "quantiles": "exponential mechanism over a public grid; no std / interval",
        },
    }
    summary_file = fs.join(staging, "summary.json")
    summary_text = json.dumps(summary, indent=2, sort_keys=True, default=str)
    if fs.is_local(staging):
        _atomic_write_table(table, Path(out_file))
        _atomic_write_text(Path(summary_file), summary_text)
    else:
        try:
            buf = pa.BufferOutputStream()
            pq.write_table(table, buf)
            fs.write_bytes(out_file, buf.getvalue().to_pybytes())
            fs.write_bytes(summary_file, summary_text.encode())
        except Exception as exc:  # noqa: BLE001
            raise fs.storage_error(staging, "cannot write the output", exc) from None
    try:
        fs.delete_tree(parts_dir)
    except Exception:  # noqa: BLE001, S110 - leftovers of _parts are scratch; the next attempt clears them
        pass
    internal.update({"pipeline_seconds": round(t_pipe, 3), "work_items": len(items),
                     "buckets": ctx.read.n_buckets, "shards": N_SHARDS})
    return ComputeResult(out_file, summary_file, table.num_rows, internal,
                         read_digests={request.input_paths[i]: d for i, d in read_digests.items()
                                       if 0 <= i < len(request.input_paths)},
                         read_digest_salt=digest_salt)


def _key_id(request: ComputeRequest) -> str | None:
    """The run's key id: given by the request (``dpops.release.preparation``, which loaded the key), else the key is
    loaded here once (a hand-written request JSON) and every worker is held to it."""
    if request.randomness != "keyed":
        return None
    if request.key_id:
        return request.key_id
    from dpops.keyref import resolve_key

    return resolve_key(request.key_ref).key_id


def _empty_table(plan, spec):
    import pyarrow as pa

    from pipelines.io import ARROW_TYPES

    cols = {c: pa.array([], ARROW_TYPES[spec.input.columns[c]]) for c in plan.partition_columns}
    for m in plan.metrics:
        if m.vectors:
            for suffix in ("", "_std", "_ci95_low", "_ci95_high"):
                cols[m.key + suffix] = pa.array([], pa.float64())
        elif m.type == "quantiles":
            for s in m.quantile_suffixes:
                cols[f"{m.key}_{s}"] = pa.array([], pa.float64())
        else:
            for r in range(m.k):
                cols[f"{m.key}_rank{r + 1}"] = pa.array([], ARROW_TYPES[spec.input.columns[m.column]])
    return pa.table(cols)


def _atomic_write_table(table, path: Path) -> None:
    import pyarrow.parquet as pq

    tmp = path.with_name(path.name + ".tmp")
    try:
        pq.write_table(table, tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise StorageError(f"{path}: cannot write the output: {exc}") from None


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise StorageError(f"{path}: cannot write: {exc}") from None


def bounded_truth(request: ComputeRequest, n_buckets: int | None = None) -> tuple[list[tuple[Any, ...]], dict[str, np.ndarray]]:
    """Reference path without Beam and WITHOUT noise: the exact bounded per-partition aggregates the
    pipeline noises for this request (same randomness, hence the same kept rows: the bound is
    mergeable, so bounding each bucket's rows at once gives what the streaming combiner gives).

    For benchmarks and tests only: its output is not differentially private and must never be
    published. Returns (partition keys, accumulators aligned with them); sum accumulators are exact
    integer counts of their grid step ``pipelines.bounding.sum_unit(kind, lo, hi)``.
    """
    spec = request.spec_of()  # the file, with the estimated bounds of a bounds: estimate spec
    plan = _plan(spec)
    ctx = build_context(spec, plan, request, "", n_buckets=n_buckets)
    names, buckets, _ = _read_buckets(ctx, [fs.normalize(x) for x in request.input_paths], spec.input.format)
    partials = []
    for bucket in sorted(buckets):
        parts, acc, _ = aggregate_bucket(concat_rows(buckets.pop(bucket)), ctx.agg)
        partials.append((parts, acc))
    parts, acc = merge_partials(partials)
    return [names[int(h)] for h in parts], acc


def _read_buckets(ctx: PipelineContext, paths: list[str], fmt: str
                  ) -> tuple[dict[int, tuple[Any, ...]], dict[int, list[dict]], dict[str, int]]:
    """The read of ``ReadPrivateBatches`` in one process: every work item's batches through ``prepare_batch`` with
    the run's bounding streams and pair salt, grouped by unit-hash bucket (partition names, read counters)."""
    source = ctx.randomness.source()
    salt = ctx.randomness.pair_salt(source)
    buckets: dict[int, list[dict]] = {}
    names: dict[int, tuple[Any, ...]] = dict(ctx.public_names or {})
    stats: dict[str, int] = {}
    for item in work_items(paths, fmt):
        for seq, (batch, offset) in enumerate(iter_record_batches(item, ctx.read)):
            rng = source.child("bounding", item[0], -1 if item[2] is None else item[2], seq)
            rows, (uniq, values), st = prepare_batch(batch, item[0], offset, ctx.read, rng, pair_salt=salt)
            for k, v in st.items():
                stats[k] = stats.get(k, 0) + int(v)
            for j, h in enumerate(uniq):
                names.setdefault(int(h), tuple(col[j] for col in values))
            for bucket, chunk in split_by_key(rows, ctx.read.n_buckets):
                buckets.setdefault(bucket, []).append(chunk)
    return names, buckets, stats


def _unbounded(rows: dict[str, np.ndarray], value_cols: tuple[str, ...]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Per partition of one bucket's checked rows, before bounding and clamping: rows, distinct units, raw sums."""
    parts, pidx = np.unique(rows["p"], return_inverse=True)
    n = len(parts)
    pairs = np.unique(np.stack([rows["u"], rows["p"]], axis=1), axis=0)
    out = {"count": np.bincount(pidx, minlength=n).astype(np.int64),
           "unit_count": np.bincount(np.searchsorted(parts, pairs[:, 1]), minlength=n).astype(np.int64)}
    for c in value_cols:
        v = rows[f"v:{c}"]
        out[f"sum:{c}"] = np.bincount(pidx, weights=v, minlength=n)
        out[f"sq:{c}"] = np.bincount(pidx, weights=v * v, minlength=n)
    return parts, out


def sample_truth(request: SampleTruthRequest) -> SampleTruth:
    """``dpops simulate``'s one pass (``dpops.release.pipeline_seam.SampleTruthRequest``): the sample read, checked
    and bounded by the release's own steps in test mode, and its exact per-partition aggregates, bounded (what
    the release noises) and unbounded (what bounding changed).

    Privacy: exact aggregates are not differentially private, so this function refuses what is not public data
    itself (``check_public_sample``: under ``$DPOPS_PUBLIC_ROOTS``, not under a data root, not the spec's input
    in disguise), whoever calls it, and reads the very file that passed (``pinned_sample``: opened once, so no
    symlink swapped in after the check is followed), and runs only on the test seed. It has no private flag: a
    private sample has no path here. No event-time filter: a sample is not an interval's input (the whole sample is read).
    """
    import dataclasses

    from dpops.analysis.sample_access import check_public_sample, pinned_sample
    from dpops.errors import InvalidParameter as _Invalid

    spec = request.spec
    if isinstance(request.test_seed, bool) or not isinstance(request.test_seed, int):
        raise _Invalid(f"sample_truth runs on a test seed only (an integer), got {request.test_seed!r}")
    access = check_public_sample(spec, request.sample_path)
    plan = _plan(spec)
    compute = ComputeRequest(spec_path=spec.source, interval_start="", interval_end="",
                             input_paths=(access.location,), noise_label={"release": spec.name, "purpose": "simulate"},
                             randomness="test", test_seed=request.test_seed, staging_dir="-")
    ctx = build_context(spec, plan, compute, "", time_filter=False)
    ctx = dataclasses.replace(ctx, read=dataclasses.replace(ctx.read, format=request.sample_format))
    with pinned_sample(spec, access) as held:  # the file that passed the checks, opened once (no swap after them)
        names, buckets, stats = _read_buckets(ctx, [held], request.sample_format)
    value_cols = ctx.read.value_columns
    partials = []
    for bucket in sorted(buckets):
        rows = concat_rows(buckets.pop(bucket))
        raw_parts, raw = _unbounded(rows, value_cols)
        parts, acc, st = aggregate_bucket(rows, ctx.agg)
        for k, v in st.items():
            stats[k] = stats.get(k, 0) + int(v)
        # the bounded accumulators aligned on the bucket's partitions before bounding (a partition whose
        # every pair the L0 step dropped keeps zeros): one partition list for both truths
        idx = np.searchsorted(raw_parts, parts)
        merged = {f"raw:{k}": v for k, v in raw.items()}
        for k, v in acc.items():
            z = np.zeros((len(raw_parts),) + v.shape[1:], dtype=v.dtype)
            z[idx] = v
            merged[k] = z
        partials.append((raw_parts, merged))
    if not partials:
        raise InputDataError(f"--sample ({request.sample_path}): no row of the sample survives the release's input "
                             "checks (types, nulls, public partitions); nothing to simulate")
    parts, acc = _merge_float_partials(partials)
    bounded = {k: v for k, v in acc.items() if not k.startswith("raw:")}
    unbounded = {k[4:]: v for k, v in acc.items() if k.startswith("raw:")}
    return SampleTruth([names[int(h)] for h in parts], bounded, unbounded, stats)


def _merge_float_partials(partials: list[tuple[np.ndarray, dict]]) -> tuple[np.ndarray, dict]:
    """``merge_partials`` for the integer accumulators; the raw float sums are added per partition alike."""
    ints = [(p, {k: v for k, v in a.items() if v.dtype.kind != "f"}) for p, a in partials]
    parts, out = merge_partials(ints)
    all_parts = np.concatenate([p for p, _ in partials])
    inv = np.searchsorted(parts, all_parts)
    offset = 0
    for p, a in partials:
        idx = inv[offset: offset + len(p)]
        offset += len(p)
        for k, v in a.items():
            if v.dtype.kind == "f":
                out.setdefault(k, np.zeros(len(parts)))
                out[k][idx] += v
    return parts, out


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """``python -m pipelines.release_pipeline --request REQUEST.json``: the request holds a key reference only."""
    ap = argparse.ArgumentParser(prog="python -m pipelines.release_pipeline")
    ap.add_argument("--request", required=True, help="JSON file with the ComputeRequest fields")
    args = ap.parse_args(argv)
    try:
        data = json.loads(Path(args.request).read_text())
        data["input_paths"] = tuple(data.get("input_paths", ()))
        data["runner_options"] = tuple(data.get("runner_options", ()))
        if "key_path" in data:  # the former field name: a key file path is a key reference
            data.setdefault("key_ref", data.pop("key_path"))
        res = run_release(ComputeRequest(**data))
    except Exception as exc:  # one clear line; exit code from the dpops error class
        from dpops.errors import DpopsError, public_message

        print(f"release_pipeline: error: {public_message(exc)}", file=sys.stderr)
        return exc.exit_code if isinstance(exc, DpopsError) else 1
    print(json.dumps({k: v for k, v in asdict(res).items() if k != "internal"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
