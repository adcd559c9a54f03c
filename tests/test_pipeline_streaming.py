"""Issue 10: streaming, mergeable contribution bounding; shards through the filesystem layer; the
composite transforms one by one (TestPipeline / assert_that); worker-side key resolution."""

from __future__ import annotations

import dataclasses
import io
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from typing import ClassVar

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.io.filesystem import FileMetadata, FileSystem
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to
from test_pipeline_helpers import request, run, write_spec

from dpops.errors import InvalidParameter, StorageError
from dpops.noise.randomness import test_random
from pipelines import release_pipeline, transforms
from pipelines.bounding import (
    AggregationSpec,
    aggregate_bucket,
    bound_rows,
    pair_priority,
    pair_salt,
)
from pipelines.elements import NoisyShard, PartitionNames, RowBlock, ShardPartial

ROOT = Path(__file__).resolve().parents[1]
COUNT_SUM = [{"type": "count"}, {"type": "unit_count"}, {"type": "sum", "column": "amount", "bounds": [0, 100]},
             {"type": "mean", "column": "amount", "bounds": [0, 100]}]


def _random_rows(seed: int, n: int, n_units: int = 40, n_parts: int = 12) -> dict[str, np.ndarray]:
    gen = np.random.default_rng(seed)
    rng = test_random(seed, ("rows",))
    u = (gen.integers(0, n_units, n).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) | np.uint64(1)
    p = gen.integers(0, n_parts, n).astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9) + np.uint64(3)
    rows = {"u": u, "p": p, "prio": rng.uint64(n), "rid": np.arange(n, dtype=np.int64),
            "v:amount": gen.uniform(-10, 120, n)}
    rows["pp"] = pair_priority(u, p, pair_salt(rng))
    return rows


def _take(rows, idx):
    return {k: v[idx] for k, v in rows.items()}


def _kept_ids(rows) -> list[int]:
    return sorted(rows["rid"].tolist())


# --------------------------------------------------------------------------- mergeability


@pytest.mark.parametrize("seed", range(12))
def test_bound_is_mergeable_under_random_splits(seed):
    """bound(bound(A) + bound(B) + ...) == bound(A + B + ...) for random splits, with nested merges."""
    gen = np.random.default_rng(100 + seed)
    rows = _random_rows(seed, int(gen.integers(50, 1500)))
    l0, linf = int(gen.integers(1, 5)), int(gen.integers(1, 4))
    want = _kept_ids(bound_rows(rows, l0, linf)[0])
    for _ in range(5):
        n = len(rows["u"])
        part_of = gen.integers(0, int(gen.integers(1, 9)), n)
        parts = [bound_rows(_take(rows, np.flatnonzero(part_of == k)), l0, linf)[0] for k in np.unique(part_of)]
        while len(parts) > 1:  # merge random pairs, re-bounding each merge (a tree of combiner merges)
            i, j = sorted(gen.choice(len(parts), 2, replace=False))
            merged = {k: np.concatenate([parts[i][k], parts[j][k]]) for k in rows}
            parts[i] = bound_rows(merged, l0, linf)[0]
            parts.pop(j)
        assert _kept_ids(bound_rows(parts[0], l0, linf)[0]) == want


def test_old_rule_would_not_be_mergeable_but_the_pair_priority_is():
    """The winner of a unit's L0 choice must not change when rows of the same pair arrive later: the
    pair priority depends on (salt, unit, partition) only, never on which rows are present."""
    rows = _random_rows(7, 400, n_units=3, n_parts=10)
    first, second = _take(rows, np.arange(200)), _take(rows, np.arange(200, 400))
    a, _ = bound_rows(first, 2, 1)
    both, _ = bound_rows({k: np.concatenate([a[k], second[k]]) for k in rows}, 2, 1)
    assert _kept_ids(both) == _kept_ids(bound_rows(rows, 2, 1)[0])
    same = rows["pp"][(rows["u"] == rows["u"][0]) & (rows["p"] == rows["p"][0])]
    assert len(set(same.tolist())) == 1


def test_combiner_holds_bounded_rows_and_is_exact_under_any_bundling():
    rows = _random_rows(3, 5000, n_units=60, n_parts=15)
    l0, linf = 3, 2
    want = _kept_ids(bound_rows(rows, l0, linf)[0])
    gen = np.random.default_rng(9)
    for compact_min in (1, 50, 10**9):
        fn = transforms.BoundRowsFn(l0, linf, compact_min)
        accs = []
        for chunk in np.array_split(gen.permutation(5000), int(gen.integers(2, 30))):
            acc = fn.create_accumulator()
            for piece in np.array_split(chunk, 3):
                acc = fn.add_input(acc, RowBlock.of(_take(rows, piece)))
                # amortised compaction: the buffer never exceeds twice its last bounded size (or the minimum)
                assert acc.n <= max(compact_min, 2 * acc.floor)
            accs.append(fn.compact(acc) if gen.random() < 0.5 else acc)
        gen.shuffle(accs)
        acc = pickle.loads(pickle.dumps(fn.merge_accumulators(accs)))  # accumulators cross the shuffle pickled
        out, dropped = fn.extract_output(acc)
        assert _kept_ids(out) == want
        # every dropped row counted once, whatever the compactions (pre-bounded inputs drop nothing here)
        assert sum(dropped.values()) == 5000 - len(want)
        # the bound itself: no unit in more than l0 partitions, no pair with more than linf rows
        pairs: dict[tuple[int, int], int] = {}
        for u, p in zip(out["u"].tolist(), out["p"].tolist()):
            pairs[(u, p)] = pairs.get((u, p), 0) + 1
        assert max(pairs.values()) <= linf
        per_unit: dict[int, int] = {}
        for u, _ in pairs:
            per_unit[u] = per_unit.get(u, 0) + 1
        assert max(per_unit.values()) <= l0


# --------------------------------------------------------------------------- the transforms, one by one


def test_bound_contributions_transform():
    rows = _random_rows(5, 3000)
    want = _kept_ids(bound_rows(rows, 2, 2)[0])
    blocks = [(int(k), RowBlock.of(_take(rows, idx)))
              for k, idx in enumerate(np.array_split(np.arange(3000), 10))]
    # every block keyed by unit so that a unit's rows meet in one key
    keyed = []
    for _k, b in blocks:
        for key, chunk in transforms.split_by_key(b.rows(), 4):
            keyed.append((key, RowBlock.of(chunk)))
    with TestPipeline() as p:
        out = (p | beam.Create(keyed) | transforms.BoundContributions(2, 2, compact_min=10)
               | beam.FlatMap(lambda kv: kv[1][0]["rid"].tolist()))
        assert_that(out, equal_to(want))


def test_aggregate_per_partition_transform():
    rows = _random_rows(6, 2000)
    bounded, _ = bound_rows(rows, 3, 2)
    spec = AggregationSpec(l0=3, linf=2, sums=(("sum:a", "amount", 0.0, 100.0, "sum"),))
    parts, acc, _ = aggregate_bucket(bounded, spec)
    want = sorted(zip(map(str, parts.tolist()), acc["count"].tolist(), acc["sum:a"].tolist()))
    keyed = [(k, (r, {"rows_dropped_l0": 0})) for k, r in transforms.split_by_key(bounded, 5)]

    def explode(kv):
        sp = ShardPartial(*kv[1])
        pp, aa = sp.unpack()
        return [(str(h), kv[0], int(c), int(s)) for h, c, s in zip(pp.tolist(), aa["count"], aa["sum:a"])]

    with TestPipeline() as p:
        out = p | beam.Create(keyed) | transforms.AggregatePerPartition(spec, 4)
        flat = out["partials"] | beam.FlatMap(explode)
        # every partition lands in its shard; summing the partials gives the one-pass aggregate
        summed = (flat | beam.Map(lambda t: (t[0], (t[2], t[3]))) | beam.CombinePerKey(
            lambda vs: tuple(map(sum, zip(*vs)))) | beam.MapTuple(lambda h, cs: (h, cs[0], cs[1])))
        assert_that(summed, equal_to(want), label="sums")
        shards_ok = flat | beam.Map(lambda t: int(transforms.shard_of(np.array([int(t[0])], np.uint64), 4)[0]) == t[1])
        assert_that(shards_ok | beam.Distinct(), equal_to([True]), label="shards")


def test_write_shards_and_run_stats_transforms(tmp_path):
    parts_dir = str(tmp_path / "_parts")
    shards = [NoisyShard(s, pa.table({"x": list(range(s))})) for s in range(3)]
    p = TestPipeline()
    files = p | "shards" >> beam.Create(shards) | transforms.WriteShards(parts_dir, 3)
    assert_that(files | beam.Map(lambda f: (f.shard, Path(f.path).name, f.partitions)),
                equal_to([(s, transforms.shard_name(s, 3), s) for s in range(3)]), label="files")
    stats = (p | "a" >> beam.Create([{"r": 1}, {"r": 2, "d": 1, "z": 0}]), p | "b" >> beam.Create([{"r": 4}]))
    stats | transforms.RunStats()
    result = p.run()
    result.wait_until_finish()
    tables = release_pipeline.read_shards(parts_dir, 3)  # all 3 present, empty shard 0 included
    assert tables[0] is None and [t.num_rows for t in tables[1:]] == [1, 2]  # empty shard: a zero-byte file
    # the counters come back through the runner's metrics (zero ones too), and no file holds them
    assert transforms.collect_stats(result) == {"d": 1, "r": 7, "z": 0}
    assert sorted(x.name for x in Path(parts_dir).iterdir()) == [transforms.shard_name(s, 3) for s in range(3)]
    assert not list(Path(parts_dir).glob("*.tmp-*"))  # temp names renamed away


def test_select_partitions_and_noise_emits_every_shard(tmp_path):
    spec = write_spec(tmp_path, [{"type": "count"}], {"columns": ["region"], "public": ["a", "b"]})
    req = request(spec, [tmp_path / "none.parquet"], tmp_path / "st")
    from dpops.release_plan import plan_release
    from dpops.spec import load_spec

    sp = load_spec(str(spec))
    ctx = release_pipeline.build_context(sp, plan_release(sp), req, str(tmp_path / "_parts"))
    with TestPipeline() as p:
        partials = p | "p" >> beam.Create([], reshuffle=False) | "tp" >> beam.Map(lambda x: x)
        names = p | "n" >> beam.Create([(0, PartitionNames(np.zeros(0, np.uint64), [[]]))])
        out = {"partials": partials, "names": names} | transforms.SelectPartitionsAndNoise(ctx)
        assert_that(out | beam.Map(lambda s: s.shard), equal_to(list(range(release_pipeline.N_SHARDS))))


# --------------------------------------------------------------------------- end to end invariance


def _input(tmp_path: Path, n: int = 6000, seed: int = 1) -> Path:
    gen = np.random.default_rng(seed)
    # heavy users (zipf) over several regions and many light ones: both bounds bite
    users = [f"u{x}" for x in np.where(gen.random(n) < 0.5, gen.zipf(1.6, n) % 50, gen.integers(50, 3000, n))]
    regions = [f"r{x}" for x in gen.integers(1, 9, n)]
    path = tmp_path / "in" / "2024-01-01.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"user_id": users, "region": regions, "amount": gen.uniform(0, 150, n),
                             "category": ["c"] * n}), path, row_group_size=700)  # 9 work items
    return path


def test_release_bits_do_not_depend_on_keys_bundles_order_or_workers(tmp_path, monkeypatch):
    spec = write_spec(tmp_path, COUNT_SUM, {"columns": ["region"], "private": {"strategy": "truncated_geometric"}},
                      l0=3, linf=2, epsilon=4.0, delta=1e-5)
    inp = _input(tmp_path)
    ref, _, res = run(request(spec, [inp], tmp_path / "ref"))
    internal = res.internal
    assert len(ref) > 5 and internal["rows_dropped_bounding"] > 0  # the bound did drop rows
    # every row that entered the bound was kept or dropped (by reason) exactly once
    assert internal["rows_dropped_l0"] + internal["rows_dropped_linf"] == internal["rows_dropped_bounding"]
    items_fn = release_pipeline.work_items
    variants = [
        ("one key", {"N_BUCKETS": 1}, {}, False, ()),
        ("7 keys, compaction at every input", {"N_BUCKETS": 7}, {"COMPACT_MIN_ROWS": 1}, False, ()),
        ("1024 keys, reversed arrival", {"N_BUCKETS": 1024}, {}, True, ()),
        ("2 threads, small bundles", {"N_BUCKETS": 13}, {"COMPACT_MIN_ROWS": 100}, True,
         ("--direct_num_workers=2", "--direct_running_mode=multi_threading")),
    ]
    for name, rp, tp, reverse, opts in variants:
        with monkeypatch.context() as m:
            for k, v in rp.items():
                m.setattr(release_pipeline, k, v)
            for k, v in tp.items():
                m.setattr(transforms, k, v)
            if reverse:
                m.setattr(release_pipeline, "work_items", lambda paths, fmt: list(reversed(items_fn(paths, fmt))))
            df, _, r2 = run(request(spec, [inp], tmp_path / name.replace(" ", "_").replace(",", ""),
                                    runner_options=opts))
        assert r2.internal["buckets"] == rp["N_BUCKETS"]
        assert df.equals(ref), name
        assert r2.internal["rows_kept"] == res.internal["rows_kept"], name


# --------------------------------------------------------------------------- shards: completeness


def test_a_missing_shard_is_an_error_never_an_empty_release(tmp_path, monkeypatch):
    spec = write_spec(tmp_path, COUNT_SUM, {"columns": ["region"], "public": ["r1", "r2", "r3"]})
    inp = _input(tmp_path, 500)
    real = transforms._WriteShard.process.__wrapped__

    def skip_shard_3(self, shard):
        if NoisyShard(*shard).shard == 3:
            return
        yield from real(self, shard)

    monkeypatch.setattr(transforms._WriteShard, "process", skip_shard_3)
    with pytest.raises(StorageError, match=r"shard 3 of 16 is missing"):
        run(request(spec, [inp], tmp_path / "stage"))
    assert not (tmp_path / "stage" / "data.parquet").exists()


def test_a_truncated_shard_is_an_error(tmp_path):
    parts = tmp_path / "_parts"
    parts.mkdir()
    for s in range(2):
        buf = io.BytesIO()
        pq.write_table(pa.table({"x": [1, 2]}), buf)
        data = buf.getvalue()
        (parts / transforms.shard_name(s, 2)).write_bytes(data if s == 0 else data[: len(data) // 2])
    with pytest.raises(StorageError, match=r"shard 1 of 2 is incomplete"):
        release_pipeline.read_shards(str(parts), 2)


# --------------------------------------------------------------------------- a non-local filesystem


class MemTestFileSystem(FileSystem):
    """A process-local object store under ``memtest://`` (no rename-free shortcut: it renames)."""

    STORE: ClassVar[dict[str, bytes]] = {}
    LOCK: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def scheme(cls):
        return "memtest"

    def join(self, basepath, *paths):
        return "/".join([basepath.rstrip("/"), *paths])

    def split(self, path):
        head, _, tail = path.rpartition("/")
        return head, tail

    def mkdirs(self, path):
        pass

    def has_dirs(self):
        return False

    def _list(self, dir_or_prefix):
        with self.LOCK:
            items = [(k, len(v)) for k, v in self.STORE.items() if k.startswith(dir_or_prefix)]
        for k, size in items:
            yield FileMetadata(k, size)

    def create(self, path, mime_type="application/octet-stream", compression_type=None):
        store, lock = self.STORE, self.LOCK

        class _W(io.BytesIO):
            def close(self):
                if not self.closed:
                    with lock:
                        store[path] = self.getvalue()
                super().close()

        return _W()

    def open(self, path, mime_type="application/octet-stream", compression_type=None):
        with self.LOCK:
            if path not in self.STORE:
                raise FileNotFoundError(path)
            return io.BytesIO(self.STORE[path])

    def copy(self, src, dst):
        with self.LOCK:
            for s, d in zip(src, dst):
                self.STORE[d] = self.STORE[s]

    def rename(self, src, dst):
        with self.LOCK:
            for s, d in zip(src, dst):
                self.STORE[d] = self.STORE.pop(s)

    def exists(self, path):
        return path in self.STORE

    def size(self, path):
        return len(self.STORE[path])

    def last_updated(self, path):
        return 0.0

    def checksum(self, path):
        return str(len(self.STORE[path]))

    def metadata(self, path):
        return FileMetadata(path, len(self.STORE[path]))

    def delete(self, paths):
        with self.LOCK:
            for p in paths:
                self.STORE.pop(p, None)


def test_staging_and_input_on_a_non_local_filesystem(tmp_path):
    spec = write_spec(tmp_path, COUNT_SUM, {"columns": ["region"], "private": {"strategy": "truncated_geometric"}},
                      l0=3, linf=2, epsilon=4.0, delta=1e-5)
    inp = _input(tmp_path, 3000)
    local, _, _ = run(request(spec, [inp], tmp_path / "local"))
    MemTestFileSystem.STORE.clear()
    MemTestFileSystem.STORE["memtest://bucket/in/2024-01-01.parquet"] = inp.read_bytes()
    req = request(spec, ["memtest://bucket/in/2024-01-01.parquet"], "memtest://bucket/runs/r1")
    res = release_pipeline.run_release(req)
    assert res.output_file == "memtest://bucket/runs/r1/data.parquet"
    keys = sorted(MemTestFileSystem.STORE)
    assert keys == ["memtest://bucket/in/2024-01-01.parquet", "memtest://bucket/runs/r1/data.parquet",
                    "memtest://bucket/runs/r1/summary.json"]  # _parts removed, nothing else survives
    remote = pq.read_table(pa.BufferReader(MemTestFileSystem.STORE[res.output_file])).to_pandas()
    assert remote.equals(local)  # same bits as the local release
    with pytest.raises(StorageError, match="already holds an output"):
        release_pipeline.run_release(req)


def test_s3_endpoint_is_forwarded_from_the_standard_variable():
    from pipelines.fs import s3_options

    assert s3_options(["--a=1"], {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}) == ["--a=1", "--s3_endpoint_url=http://127.0.0.1:9"]
    assert s3_options(["--s3_endpoint_url=http://x"], {"AWS_ENDPOINT_URL": "http://y"}) == ["--s3_endpoint_url=http://x"]
    assert s3_options([], {}) == []


# --------------------------------------------------------------------------- worker-side key resolution


def _key_file(dir_: Path, name: str = "noise.key") -> Path:
    from dpops.noise.randomness import NoiseKey

    dir_.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = dir_ / name
    NoiseKey.generate(path)
    return path


def test_a_worker_resolves_the_key_reference_itself_and_checks_its_id(tmp_path):
    spec = write_spec(tmp_path, [{"type": "count"}], {"columns": ["region"], "public": ["r1"]})
    key = _key_file(tmp_path / "keys")
    req = request(spec, [_input(tmp_path, 100)], tmp_path / "st", randomness="keyed", key_path=f"file:{key}")
    from dpops.release_plan import plan_release
    from dpops.spec import load_spec

    sp = load_spec(str(spec))
    ctx = release_pipeline.build_context(sp, plan_release(sp), req, str(tmp_path / "_parts"))
    blob = pickle.dumps(ctx)
    secret = key.read_bytes().split()[-1]  # the key material line of the v1 file
    assert secret not in blob and bytes.fromhex(secret.decode()) not in blob  # the job graph holds no key
    (tmp_path / "ctx.pkl").write_bytes(blob)
    code = ("import pickle, sys; ctx = pickle.load(open(sys.argv[1], 'rb')); src = ctx.randomness.source(); "
            "print(src.describe().get('key_id'), ctx.randomness.pair_salt(src))")
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "PATH": "/usr/bin:/bin"}
    ok = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ctx.pkl")], capture_output=True, text=True, check=False,
                        env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]
    here = ctx.randomness.source()
    assert ok.stdout.split()[0] == ctx.randomness.key_id
    assert ok.stdout.strip().endswith(str(ctx.randomness.pair_salt(here)))  # same salt on every worker
    # a worker that sees another key at the reference refuses to draw anything
    key.unlink()
    from dpops.noise.randomness import NoiseKey

    NoiseKey.generate(key)
    bad = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ctx.pkl")], capture_output=True, text=True, check=False,
                         env=env, timeout=120)
    assert bad.returncode != 0 and "the run was prepared with key id" in bad.stderr
    assert key.read_bytes().split()[-1].decode() not in bad.stderr


def test_key_references_and_providers(tmp_path):
    from dpops import keyref
    from dpops.noise.randomness import NoiseKey

    key = _key_file(tmp_path / "k")
    want = NoiseKey.from_file(key).key_id
    assert keyref.resolve_key(str(key)).key_id == want
    assert keyref.resolve_key(f"file:{key}").key_id == want
    assert keyref.resolve_key(f"file://{key}").key_id == want
    with pytest.raises(InvalidParameter, match="unknown scheme 'vault'"):
        keyref.resolve_key("vault://x")
    with pytest.raises(InvalidParameter, match="gcp-secret://projects/P/secrets/S/versions/V"):
        keyref.resolve_key("gcp-secret://nonsense")

    calls = []

    class Fake:
        def load(self, ref):
            calls.append(ref)
            return NoiseKey(bytes(range(32)))

    keyref.register_provider("fakesecret", Fake)
    try:
        k = keyref.resolve_key_for_run("fakesecret://a", NoiseKey(bytes(range(32))).key_id)
        keyref.resolve_key_for_run("fakesecret://a", k.key_id)  # cached per process
        assert calls == ["fakesecret://a"]
        with pytest.raises(InvalidParameter, match="holds key id"):
            keyref.resolve_key_for_run("fakesecret://b", "0" * 16)
    finally:
        keyref._FACTORIES.pop("fakesecret")
        keyref._PROVIDERS.pop("fakesecret", None)


def test_fast_group_order_equals_lexsort_also_with_ties():
    from pipelines.bounding import _order_by_group_then

    gen = np.random.default_rng(4)
    for trial in range(40):
        n = int(gen.integers(1, 3000))
        group = gen.integers(0, int(gen.integers(1, 2000)), n)
        # keys that differ only in their low bits (ties of the truncated word) in half the trials
        key = gen.integers(0, 2**63, n).astype(np.uint64)
        if trial % 2:
            key = (key & np.uint64(0xFF)) | np.uint64(1 << 60)
        tie = gen.integers(0, 3, n).astype(np.uint64)
        for t in (None, tie):
            want = np.lexsort((key, group) if t is None else (t, key, group))
            got = _order_by_group_then(group, key, t)
            assert np.array_equal(group[got], group[want]) and np.array_equal(key[got], key[want])
            if t is not None:
                assert np.array_equal(t[got], t[want])


def test_the_read_stage_draws_every_batch_s_priorities_from_the_reference_stream(tmp_path):
    """The read DoFn (checking, hashing and pre-bounding in its Prefetch stage) emits exactly the rows the
    reference path (``bounded_truth``'s loop: ``prepare_batch`` with the stream ("bounding", file, row group,
    batch), then ``bound_rows``) keeps, with the same priorities: the runs-against-runs tests above cannot see
    a stream label shifted in the pipeline alone."""
    from pipelines.bounding import bound_rows, pair_salt
    from pipelines.elements import WorkItem
    from pipelines.io import iter_record_batches, prepare_batch, work_items
    from dpops.release_plan import plan_release

    spec = write_spec(tmp_path, COUNT_SUM, {"columns": ["region"], "private": {"strategy": "truncated_geometric"}},
                      l0=3, linf=2, epsilon=4.0, delta=1e-5)
    inp = _input(tmp_path)
    req = request(spec, [inp], tmp_path / "s")
    sp = req.spec_of()
    ctx = release_pipeline.build_context(sp, plan_release(sp), req, "")
    ctx = release_pipeline.PipelineContext(dataclasses.replace(ctx.read, batch_rows=300), ctx.agg, ctx.plan,
                                           ctx.randomness, ctx.parts_dir, ctx.public_names)
    items = work_items([str(inp)], "parquet")
    fn = transforms._ReadBatches(ctx)
    fn.setup()
    got = [blk.rows() for it in items for el in fn.process(WorkItem(*it))
           if not isinstance(el, beam.pvalue.TaggedOutput) for blk in [el[1]]]
    source = ctx.randomness.source()
    salt = pair_salt(source)
    want = []
    for it in items:
        for seq, (batch, offset) in enumerate(iter_record_batches(it, ctx.read)):
            rng = source.child("bounding", it[0], -1 if it[2] is None else it[2], seq)
            rows, _, _ = prepare_batch(batch, it[0], offset, ctx.read, rng, pair_salt=salt)
            want.append(bound_rows(rows, ctx.agg.l0, ctx.agg.linf)[0])

    def flat(chunks):
        cols = {k: np.concatenate([c[k] for c in chunks]) for k in ("u", "p", "prio", "pp")}
        order = np.lexsort((cols["prio"], cols["u"]))
        return {k: v[order] for k, v in cols.items()}

    g, w = flat(got), flat(want)
    assert len(w["u"]) > 1000 and sum(len(c["u"]) for c in want) < 6000  # several batches, and the bound dropped rows
    for k in w:
        assert np.array_equal(g[k], w[k]), k


def test_the_read_stage_s_three_threads_give_the_serial_names_and_stopping_early_leaves_none(tmp_path):
    """The read DoFn's stages (``dpops-prepare`` checks and hashes, ``dpops-pre-bound`` bounds and splits by key,
    the reader's own ``dpops-csv-prefetch``) emit the partition names a serial loop gives, in its order; and a
    consumer that stops after the first element leaves none of the three threads alive."""
    import threading

    from pipelines.bounding import pair_salt
    from pipelines.elements import WorkItem
    from pipelines.io import iter_record_batches, prepare_batch, work_items
    from dpops.release_plan import plan_release

    spec = write_spec(tmp_path, COUNT_SUM, {"columns": ["region"], "private": {"strategy": "truncated_geometric"}},
                      l0=3, linf=2, epsilon=4.0, delta=1e-5)
    inp = _input(tmp_path)
    req = request(spec, [inp], tmp_path / "s")
    sp = req.spec_of()
    ctx = release_pipeline.build_context(sp, plan_release(sp), req, "")
    ctx = release_pipeline.PipelineContext(dataclasses.replace(ctx.read, batch_rows=300), ctx.agg, ctx.plan,
                                           ctx.randomness, ctx.parts_dir, ctx.public_names)
    items = work_items([str(inp)], "parquet")
    fn = transforms._ReadBatches(ctx)
    fn.setup()
    names = [el.value for it in items for el in fn.process(WorkItem(*it))
             if isinstance(el, beam.pvalue.TaggedOutput) and el.tag == "names"]
    source = ctx.randomness.source()
    salt = pair_salt(source)
    want = []
    for it in items:
        for seq, (batch, offset) in enumerate(iter_record_batches(it, ctx.read)):
            rng = source.child("bounding", it[0], -1 if it[2] is None else it[2], seq)
            _, (uniq, values), _ = prepare_batch(batch, it[0], offset, ctx.read, rng, pair_salt=salt)
            shards = transforms.shard_of(uniq, ctx.read.n_shards)
            for s in np.unique(shards):
                sel = np.flatnonzero(shards == s)
                want.append((int(s), uniq[sel].tolist(), [[col[i] for i in sel] for col in values]))
    assert len(want) > 3
    assert [(s, pn.hashes.tolist(), pn.values) for s, pn in names] == want

    stages = ("dpops-prepare", "dpops-pre-bound", "dpops-csv-prefetch")
    gen = fn.process(WorkItem(*items[0]))
    next(gen)
    assert {t.name for t in threading.enumerate() if t.is_alive()} >= {"dpops-prepare", "dpops-pre-bound"}
    gen.close()
    assert not [t for t in threading.enumerate() if t.name in stages and t.is_alive()]
