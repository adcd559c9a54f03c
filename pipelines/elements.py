"""The elements that flow between the release pipeline's composite transforms (``pipelines.transforms``).

One element is a batch of rows (numpy columns), never a row: per-element overhead is what makes
naive DP pipelines slow. Row blocks travel as ONE pickle of their numpy columns (``RowBlock.__reduce__``,
only when a runner encodes them): Beam's default coder would pickle each array on its own, which
dominated the shuffle cost.

Shapes (``K`` = a unit-hash bucket, ``S`` = a noise shard):

  WorkItem                     what one reader task reads: a file (CSV) or a Parquet row group
  (K, RowBlock)                checked, hashed, pre-bounded rows of the units in bucket K
  (S, PartitionNames)          labels of partitions seen in private-partition mode
  (S, ShardPartial)            exact per-partition integer partials of one bucket, for shard S
  NoisyShard                   the released partitions of shard S (an Arrow table)
  ShardFile                    where shard S was written, and how many partitions it holds
  dict[str, int]               internal counters (rows read, dropped by reason, ...): never published
"""

from __future__ import annotations

import pickle
from typing import Any, NamedTuple

import numpy as np

Rows = dict[str, np.ndarray]  # "u", "p", "prio", "pp", "v:<col>", "c:<col>": equal-length numpy columns


class WorkItem(NamedTuple):
    """(file index, path or URI, Parquet row group or None for a CSV file, row offset of the row group)."""

    file_index: int
    path: str
    row_group: int | None
    row_offset: int


class RowBlock:
    """Rows of some units (all of one bucket after ``ReadPrivateBatches``), pickled once as a whole.

    The block holds the numpy columns themselves and becomes bytes only when a runner encodes it
    (``__reduce__``: one pickle of the whole dict). Within a fused stage (the read and the combiner's lifted
    partial bound, on the in-process runner) nothing is encoded, so the block is never pickled there; that
    saved a pickle and an unpickle of every pre-bounded row (~1 s per 10M rows). Speed only: the rows are
    the same objects either way."""

    __slots__ = ("_rows",)

    def __init__(self, rows: Rows):
        self._rows = rows

    @classmethod
    def of(cls, rows: Rows) -> RowBlock:
        return cls(rows)

    def rows(self) -> Rows:
        return self._rows

    def __reduce__(self):
        return (_row_block_from_payload, (pickle.dumps(self._rows, protocol=pickle.HIGHEST_PROTOCOL),))


def _row_block_from_payload(payload: bytes) -> RowBlock:
    return RowBlock(pickle.loads(payload))


class PartitionNames(NamedTuple):
    """Labels of partitions seen in one batch: their hashes and one value list per partition column."""

    hashes: np.ndarray
    values: list[list[Any]]


class ShardPartial(NamedTuple):
    """Exact per-partition accumulators of one bucket's bounded rows, restricted to one noise shard."""

    bucket: int
    payload: bytes  # pickle of (sorted partition hashes, {accumulator: array aligned with them})

    @classmethod
    def of(cls, bucket: int, parts: np.ndarray, acc: dict[str, np.ndarray]) -> ShardPartial:
        return cls(bucket, pickle.dumps((parts, acc), protocol=pickle.HIGHEST_PROTOCOL))

    def unpack(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        return pickle.loads(self.payload)


class NoisyShard(NamedTuple):
    """The released rows of one noise shard (partition columns first, then metric columns)."""

    shard: int
    table: Any  # pyarrow.Table (Any: pyarrow is imported lazily)


class ShardFile(NamedTuple):
    shard: int
    path: str
    partitions: int
