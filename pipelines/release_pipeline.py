"""The Beam release pipeline: read -> bucket by unit -> bound + pre-aggregate -> shard by
partition -> select partitions + noise -> data.parquet + summary.json.

Shape (one Beam element is a batch, never a row):

  Create(work items: file x row group)
    | ReadCheckHash    Arrow batches; malformed rows dropped (counted, internal);
    |                  rows outside the public partition list dropped; emits
    |                  (bucket = hash(unit) mod B, numpy batch) + partition names per shard
    | GroupByKey(bucket)
    | BoundAggregate   exact L0 / Linf bounding with the run's randomness (per-bucket
    |                  stream), clamping, per-partition partial sums; emits per shard
    | Flatten(partials, names, one empty seed per shard) | GroupByKey(shard)
    | SelectNoiseWrite partition selection / public alignment, noise from the plan,
                       post-processing; writes <staging>/_parts/shard-N.parquet

The driver then merges the shard files into data.parquet and writes summary.json.
DoFns hold only picklable configuration; the noise key is read from ``key_path``
inside each worker (never on a command line, never logged), at most once per worker
process, and refused unless its id is the run's ``key_id`` (``randomness.key_for_run``).
Staging must be a filesystem every worker can write (local for FnApiRunner / PortableRunner
LOOPBACK).
"""

from __future__ import annotations

import argparse
import errno
import functools
import json
import os
import pickle
import shutil
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np

from dpops.compute import ComputeRequest, ComputeResult
from dpops.errors import DEBUG_ENV, DpopsError, InputDataError, InternalError, InvalidParameter, StorageError
from dpops.release_plan import plan_release
from dpops.spec import load_spec
from pipelines.aggregate import select_and_noise
from pipelines.bounding import AggregationSpec, aggregate_bucket, merge_partials, metric_layout
from pipelines.io import (
    ReadConfig,
    hash_partition_tuples,
    iter_record_batches,
    prepare_batch,
    shard_of,
    split_by_bucket,
    work_items,
)

N_BUCKETS = 64  # fixed (not per runner): the bounding randomness is drawn per bucket
N_SHARDS = 16  # fixed: the noise is drawn per shard


@dataclass(frozen=True)
class RandomnessConfig:
    """How a worker builds the run's randomness source. Holds the key's PATH and public id, never the key."""

    mode: str
    label: tuple[tuple[str, str], ...]
    key_path: str | None = None
    test_seed: int | None = None
    key_id: str | None = None

    def source(self):
        from dpops import randomness

        label = dict(self.label)
        if self.mode == "keyed":
            # Loaded once per worker process and checked against the run's key id: a worker that
            # sees another key must not draw noise the ledger and manifest do not describe.
            return randomness.keyed_random(randomness.key_for_run(self.key_path, self.key_id), label)
        if self.mode == "os":
            return randomness.os_random()
        if self.mode == "test":
            return randomness.test_random(int(self.test_seed), tuple(f"{k}={v}" for k, v in self.label))
        raise InvalidParameter(f"randomness must be keyed, os or test, got {self.mode!r}")


@dataclass(frozen=True)
class PipelineContext:
    read: ReadConfig
    agg: AggregationSpec
    plan: Any  # dpops.release_plan.ReleasePlan
    randomness: RandomnessConfig
    parts_dir: str
    public_names: dict[int, tuple[Any, ...]] | None


# --------------------------------------------------------------------------- DoFns


_DISK_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EDQUOT)


def _is_disk_error(exc: BaseException) -> bool:
    """An OSError about the disk (full, read-only, quota), as the OS or pyarrow's writer reports it."""
    if not isinstance(exc, OSError):
        return False
    return exc.errno in _DISK_ERRNOS or any(os.strerror(code) in str(exc) for code in _DISK_ERRNOS)


def _withhold_data_in_errors(process):
    """Wrap a DoFn's ``process`` so no foreign exception (pyarrow, numpy, a bug) leaves it with its text.

    Beam logs a failing DoFn's exception at ERROR itself (``apache_beam.runners.common``) and re-raises it
    wrapped with the original text, before dpops can see it; such text may quote a cell or a whole input
    line. dpops's own errors are written without data and pass unchanged; anything else becomes an
    ``InternalError`` naming only its class and code location, ``from None`` so no chained text follows.
    ``DPOPS_DEBUG=1`` keeps the original (a trusted terminal only).
    """

    @functools.wraps(process)
    def wrapper(self, *args, **kwargs):
        try:
            yield from process(self, *args, **kwargs)
        except DpopsError:
            raise
        except Exception as exc:  # noqa: BLE001
            if os.environ.get(DEBUG_ENV) or _is_disk_error(exc):
                raise  # a full or read-only disk: its text is the OS's, and dpops.runs makes it a StorageError
            last = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
            where = f" at {Path(last.filename).name}:{last.lineno}" if last else ""
            raise InternalError(f"internal error in {type(self).__name__}: {type(exc).__name__}{where} (a bug, "
                                f"please report it; the error text is withheld because it may quote input data, "
                                f"{DEBUG_ENV}=1 shows it on a trusted terminal)") from None

    return wrapper


class ReadCheckHash(beam.DoFn):
    def __init__(self, ctx: PipelineContext):
        self.ctx = ctx
        self._source = None

    def setup(self):
        self._source = self.ctx.randomness.source()

    @_withhold_data_in_errors
    def process(self, item):
        cfg = self.ctx.read
        stats: dict[str, int] = {}
        for seq, (batch, offset) in enumerate(iter_record_batches(item, cfg, stats)):
            # bounding priorities: a stream per (file, row group, batch), independent of runner order
            rng = self._source.child("bounding", item[0], -1 if item[2] is None else item[2], seq)
            rows, (uniq, values), st = prepare_batch(batch, item[0], offset, cfg, rng)
            _add(stats, st)
            for bucket, chunk in split_by_bucket(rows, cfg.n_buckets):
                yield bucket, _pack(chunk)
            if len(uniq) and self.ctx.public_names is None:
                shards = shard_of(uniq, cfg.n_shards)
                for s in np.unique(shards):
                    sel = np.flatnonzero(shards == s)
                    yield beam.pvalue.TaggedOutput(
                        "names", (int(s), ("names", uniq[sel], [[col[i] for i in sel] for col in values])))
        yield beam.pvalue.TaggedOutput("stats", stats)


class BoundAggregate(beam.DoFn):
    def __init__(self, ctx: PipelineContext):
        self.ctx = ctx

    @_withhold_data_in_errors
    def process(self, element):
        bucket, chunks = element
        chunks = [_unpack(c) for c in chunks]
        rows = {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}
        parts, acc, stats = aggregate_bucket(rows, self.ctx.agg)
        shards = shard_of(parts, self.ctx.read.n_shards)
        for s in np.unique(shards):
            sel = np.flatnonzero(shards == s)
            yield int(s), ("agg", int(bucket), _pack((parts[sel], {k: v[sel] for k, v in acc.items()})))
        yield beam.pvalue.TaggedOutput("stats", stats)


class SelectNoiseWrite(beam.DoFn):
    def __init__(self, ctx: PipelineContext):
        self.ctx = ctx
        self._source = None

    def setup(self):
        self._source = self.ctx.randomness.source()

    @_withhold_data_in_errors
    def process(self, element):
        import pyarrow as pa
        import pyarrow.parquet as pq

        shard, items = element
        partials, names = [], {}
        for it in items:
            if it[0] == "agg":
                partials.append((it[1], *_unpack(it[2])))
            elif it[0] == "names":
                for j, h in enumerate(it[1]):
                    names[int(h)] = tuple(col[j] for col in it[2])
        partials.sort(key=lambda t: t[0])  # bucket order (all sums are exact integers: order-free anyway)
        parts, acc = merge_partials([(p, a) for _, p, a in partials])
        if not acc:
            acc = _empty_acc(self.ctx.agg)
        pub = None
        if self.ctx.public_names is not None:
            all_pub = np.array(sorted(self.ctx.public_names), dtype=np.uint64)
            pub = all_pub[shard_of(all_pub, self.ctx.read.n_shards) == shard]
        cols = select_and_noise(shard, parts, acc, names, self.ctx.plan, pub, self.ctx.public_names, self._source)
        n = len(next(iter(cols.values()))) if cols else 0
        if n:
            table = pa.table({k: (v if isinstance(v, (list, pa.Array)) else pa.array(v)) for k, v in cols.items()})
            final = os.path.join(self.ctx.parts_dir, f"shard-{shard:05d}.parquet")
            tmp = final + f".tmp-{os.getpid()}"
            pq.write_table(table, tmp)
            os.replace(tmp, final)
        yield n


def _pack(obj: Any) -> bytes:
    """One pickle per element (numpy arrays inside): Beam's coder would pickle each array on its own,
    which dominated the shuffle cost; bytes go through its fast path."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _unpack(data: bytes) -> Any:
    return pickle.loads(data)  # noqa: S301 - our own bytes, produced by _pack inside this pipeline


def _empty_acc(agg: AggregationSpec) -> dict[str, np.ndarray]:
    acc = {"count": np.zeros(0, np.int64), "unit_count": np.zeros(0, np.int64)}
    for name, *_ in agg.sums:
        acc[name] = np.zeros(0, np.int64)  # exact fixed-point sums (pipelines.bounding)
    for name, _c, _lo, _hi, bins in agg.hists:
        acc[name] = np.zeros((0, bins + 1), np.int64)
    for name, _c, k in agg.cats:
        acc[name] = np.zeros((0, k), np.int64)
    return acc


def _add(total: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    for k, v in more.items():
        total[k] = total.get(k, 0) + int(v)
    return total


class SumStats(beam.CombineFn):
    def create_accumulator(self):
        return {}

    def add_input(self, acc, x):
        return _add(acc, x)

    def merge_accumulators(self, accs):
        out: dict[str, int] = {}
        for a in accs:
            _add(out, a)
        return out

    def extract_output(self, acc):
        return acc


class WriteStats(beam.DoFn):
    def __init__(self, path: str):
        self.path = path

    def process(self, stats):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(stats, fh, sort_keys=True)
        os.replace(tmp, self.path)
        yield self.path


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


def build_context(spec, plan, request: ComputeRequest, parts_dir: str) -> PipelineContext:
    types = dict(spec.input.columns)
    unit_col = None if spec.privacy_unit.record_level else spec.privacy_unit.column
    value_cols, cats, sums, hists, catspecs = metric_layout(plan)
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
        category_columns=cats, public_hashes=public_hashes, n_buckets=N_BUCKETS, n_shards=N_SHARDS,
        time_column=spec.input.time_column, time_window_ns=_window_ns(request))
    agg = AggregationSpec(
        l0=plan.max_partitions_per_unit, linf=plan.max_rows_per_unit_per_partition,
        sums=sums, hists=hists, cats=catspecs)
    label = tuple(sorted((str(k), str(v)) for k, v in request.noise_label.items()))
    rnd = RandomnessConfig(request.randomness, label, request.key_path, request.test_seed, _key_id(request))
    return PipelineContext(read, agg, plan, rnd, parts_dir, public_names)


def build_pipeline(p: beam.Pipeline, ctx: PipelineContext, items: list) -> None:
    read = (
        p
        | "WorkItems" >> beam.Create(items, reshuffle=False)
        | "ReadCheckHash" >> beam.ParDo(ReadCheckHash(ctx)).with_outputs("names", "stats", main="rows")
    )
    bounded = (
        read.rows
        | "GroupByBucket" >> beam.GroupByKey()
        | "BoundAggregate" >> beam.ParDo(BoundAggregate(ctx)).with_outputs("stats", main="partials")
    )
    seeds = p | "ShardSeeds" >> beam.Create([(s, ("seed",)) for s in range(ctx.read.n_shards)], reshuffle=False)
    (
        (bounded.partials, read.names, seeds)
        | "FlattenShardInputs" >> beam.Flatten()
        | "GroupByShard" >> beam.GroupByKey()
        | "SelectNoiseWrite" >> beam.ParDo(SelectNoiseWrite(ctx))
    )
    (
        (read.stats, bounded.stats)
        | "FlattenStats" >> beam.Flatten()
        | "SumStats" >> beam.CombineGlobally(SumStats())
        | "WriteStats" >> beam.ParDo(WriteStats(os.path.join(ctx.parts_dir, "_internal_stats.json")))
    )


def _make_pipeline(request: ComputeRequest) -> beam.Pipeline:
    from apache_beam.options.pipeline_options import PipelineOptions

    opts = list(request.runner_options)
    if request.runner == "FnApiRunner":
        from apache_beam.runners.portability.fn_api_runner import FnApiRunner

        return beam.Pipeline(runner=FnApiRunner(), options=PipelineOptions(opts))
    return beam.Pipeline(options=PipelineOptions([f"--runner={request.runner}", *opts]))


def _check_request(request: ComputeRequest, spec) -> None:
    if request.randomness not in ("keyed", "os", "test"):
        raise InvalidParameter(f"ComputeRequest.randomness must be keyed, os or test, got {request.randomness!r}")
    if request.randomness == "keyed" and not request.key_path:
        raise InvalidParameter("ComputeRequest.key_path is required in keyed mode (the FILE holding the noise key)")
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


def run_release(request: ComputeRequest) -> ComputeResult:
    """Build and run the Beam pipeline for one interval; write data.parquet + summary.json to staging."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    t0 = time.time()
    spec = load_spec(request.spec_path)
    _check_request(request, spec)
    plan = plan_release(spec)
    if request.expected_plan_hash is not None and request.expected_plan_hash != plan.plan_hash:
        raise InvalidParameter(
            "the release plan differs from the one the ledger reserved (expected_plan_hash mismatch); "
            "prepare and reserve the run again"
        )
    staging = Path(request.staging_dir)
    try:
        staging.mkdir(parents=True, exist_ok=True)
        if any(p.name in ("data.parquet", "summary.json") for p in staging.iterdir()):
            raise StorageError(f"{staging}: staging directory already holds an output; use a fresh run directory")
        parts_dir = staging / "_parts"
        if parts_dir.exists():
            shutil.rmtree(parts_dir)
        parts_dir.mkdir()
    except OSError as exc:
        raise StorageError(f"{staging}: cannot prepare the staging directory: {exc}") from None

    ctx = build_context(spec, plan, request, str(parts_dir))
    if request.randomness == "keyed":
        ctx.randomness.source()  # fail fast in the driver on a bad key file (message names the path, not the key)
    items = work_items(list(request.input_paths), spec.input.format)
    p = _make_pipeline(request)
    build_pipeline(p, ctx, items)
    result = p.run()
    result.wait_until_finish()
    t_pipe = time.time() - t0

    shard_files = sorted(parts_dir.glob("shard-*.parquet"))
    tables = [pq.read_table(f) for f in shard_files]
    if tables:
        table = pa.concat_tables(tables, promote_options="default")
    else:
        table = _empty_table(plan, spec)
    table = table.sort_by([(c, "ascending") for c in plan.partition_columns])
    internal_path = parts_dir / "_internal_stats.json"
    internal = json.loads(internal_path.read_text()) if internal_path.exists() else {}

    out_file = staging / "data.parquet"
    _atomic_write_table(table, out_file)
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
    summary_file = staging / "summary.json"
    _atomic_write_text(summary_file, json.dumps(summary, indent=2, sort_keys=True, default=str))
    shutil.rmtree(parts_dir, ignore_errors=True)
    internal.update({"pipeline_seconds": round(t_pipe, 3), "work_items": len(items),
                     "buckets": N_BUCKETS, "shards": N_SHARDS})
    return ComputeResult(str(out_file), str(summary_file), table.num_rows, internal)


def _key_id(request: ComputeRequest) -> str | None:
    """The run's key id: given by the request (``dpops.runs``, which loaded the key), else the key is
    loaded here once (a hand-written request JSON) and every worker is held to it."""
    if request.randomness != "keyed":
        return None
    if request.key_id:
        return request.key_id
    from dpops.randomness import load_key

    return load_key(request.key_path).key_id


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


def bounded_truth(request: ComputeRequest) -> tuple[list[tuple[Any, ...]], dict[str, np.ndarray]]:
    """Reference path without Beam and WITHOUT noise: the exact bounded per-partition aggregates the
    pipeline noises for this request (same randomness, hence the same kept rows).

    For benchmarks and tests only: its output is not differentially private and must never be
    published. Returns (partition keys, accumulators aligned with them); sum accumulators are exact
    integer counts of their grid step ``pipelines.bounding.sum_unit(kind, lo, hi)``.
    """
    spec = load_spec(request.spec_path)
    plan = plan_release(spec)
    ctx = build_context(spec, plan, request, "")
    source = ctx.randomness.source()
    buckets: dict[int, list[dict]] = {}
    names: dict[int, tuple[Any, ...]] = dict(ctx.public_names or {})
    for item in work_items(list(request.input_paths), spec.input.format):
        for seq, (batch, offset) in enumerate(iter_record_batches(item, ctx.read)):
            rng = source.child("bounding", item[0], -1 if item[2] is None else item[2], seq)
            rows, (uniq, values), _ = prepare_batch(batch, item[0], offset, ctx.read, rng)
            for j, h in enumerate(uniq):
                names.setdefault(int(h), tuple(col[j] for col in values))
            for bucket, chunk in split_by_bucket(rows, ctx.read.n_buckets):
                buckets.setdefault(bucket, []).append(chunk)
    partials = []
    for bucket in sorted(buckets):
        chunks = buckets[bucket]
        rows = {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}
        parts, acc, _ = aggregate_bucket(rows, ctx.agg)
        partials.append((parts, acc))
    parts, acc = merge_partials(partials)
    return [names[int(h)] for h in parts], acc


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """``python -m pipelines.release_pipeline --request REQUEST.json``: the request holds the key's path only."""
    ap = argparse.ArgumentParser(prog="python -m pipelines.release_pipeline")
    ap.add_argument("--request", required=True, help="JSON file with the ComputeRequest fields")
    args = ap.parse_args(argv)
    try:
        data = json.loads(Path(args.request).read_text())
        data["input_paths"] = tuple(data.get("input_paths", ()))
        data["runner_options"] = tuple(data.get("runner_options", ()))
        res = run_release(ComputeRequest(**data))
    except Exception as exc:  # one clear line; exit code from the dpops error class
        from dpops.errors import DpopsError

        from dpops.errors import public_message

        print(f"release_pipeline: error: {public_message(exc)}", file=sys.stderr)
        return exc.exit_code if isinstance(exc, DpopsError) else 1
    print(json.dumps({k: v for k, v in asdict(res).items() if k != "internal"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
