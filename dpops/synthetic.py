"""Synthetic event data for benchmarks, tests and the demo (never real data).

``generate_events`` writes one Parquet file per day using the spec's path
template (``{start:%Y-%m-%d}`` ...). Activity is power-law: user i has weight
proportional to (i+1)^-user_exponent, so a few users have many rows (the case
contribution bounding exists for); partitions are power-law too; values are
lognormal clipped to [0, 100]; categories come from a small fixed domain.
Columns: user_id (string), region (string), amount (float), category (string).
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np

from dpops.errors import InvalidParameter

DEFAULT_CATEGORIES = ("books", "games", "music", "food", "toys")
COLUMNS = {"user_id": "string", "region": "string", "amount": "float", "category": "string"}
_CHUNK = 1_000_000  # rows generated and written at a time: bounds memory at 10M rows


def _power_law(n: int, exponent: float) -> np.ndarray:
    w = (np.arange(1, n + 1, dtype=np.float64)) ** (-exponent)
    return w / w.sum()


def generate_events(
    path: str | os.PathLike[str],
    n_rows: int,
    n_users: int,
    n_partitions: int,
    days: int = 1,
    seed: int = 0,
    *,
    start: str = "2024-01-01",
    categories: tuple[str, ...] = DEFAULT_CATEGORIES,
    user_exponent: float = 1.0,
    partition_exponent: float = 0.8,
    value_mean: float = 2.0,
    value_sigma: float = 1.0,
    row_group_size: int = 262_144,
) -> list[str]:
    """Write ``n_rows`` rows per day and return the written paths.

    ``path`` is a template formatted with ``start``/``end`` (the day's bounds, UTC datetimes);
    a path without placeholders is allowed only for ``days=1``.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name, v in (("n_rows", n_rows), ("n_users", n_users), ("n_partitions", n_partitions), ("days", days)):
        if not isinstance(v, int) or v < 1:
            raise InvalidParameter(f"generate_events: {name} must be an integer >= 1, got {v!r}")
    template = str(path)
    if days > 1 and "{" not in template:
        raise InvalidParameter("generate_events: several days need a path template with {start}")
    day0 = datetime.fromisoformat(start).replace(tzinfo=timezone.utc)
    rng = np.random.default_rng(seed)
    user_p = _power_law(n_users, user_exponent)
    part_p = _power_law(n_partitions, partition_exponent)
    # Dictionary-encoded string columns: small files and fast reads, strings on the way out.
    width_u, width_p = len(str(n_users - 1)), len(str(n_partitions - 1))
    users = pa.array([f"u{i:0{width_u}d}" for i in range(n_users)], pa.string())
    parts = pa.array([f"p{i:0{width_p}d}" for i in range(n_partitions)], pa.string())
    cats = pa.array(list(categories), pa.string())
    cat_p = _power_law(len(categories), 0.7)
    schema = pa.schema([
        ("user_id", pa.dictionary(pa.int32(), pa.string())),
        ("region", pa.dictionary(pa.int32(), pa.string())),
        ("amount", pa.float64()),
        ("category", pa.dictionary(pa.int32(), pa.string())),
        ("ts", pa.timestamp("us", tz="UTC")),  # event time inside the file's day (input.time_column)
    ])
    # A separate stream for the event times, so the other columns stay what they were for a seed.
    ts_rng = np.random.default_rng([seed, 0x7473])
    written = []
    for d in range(days):
        s, e = day0 + timedelta(days=d), day0 + timedelta(days=d + 1)
        out = Path(template.format(start=s, end=e))
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        # store_schema=False: readers see plain string columns (the declared type), not Arrow dictionaries.
        with pq.ParquetWriter(tmp, schema, store_schema=False) as writer:
            left = n_rows
            while left > 0:
                n = min(_CHUNK, left)
                left -= n
                u = rng.choice(n_users, size=n, p=user_p).astype(np.int32)
                p = rng.choice(n_partitions, size=n, p=part_p).astype(np.int32)
                v = np.clip(rng.lognormal(value_mean, value_sigma, size=n), 0.0, 100.0)
                c = rng.choice(len(categories), size=n, p=cat_p).astype(np.int32)
                day_us = int((s - datetime(1970, 1, 1, tzinfo=timezone.utc)).total_seconds()) * 1_000_000
                t = day_us + ts_rng.integers(0, 86_400 * 1_000_000, size=n)
                batch = pa.record_batch([
                    pa.DictionaryArray.from_arrays(pa.array(u), users),
                    pa.DictionaryArray.from_arrays(pa.array(p), parts),
                    pa.array(v),
                    pa.DictionaryArray.from_arrays(pa.array(c), cats),
                    pa.array(t, pa.timestamp("us", tz="UTC")),
                ], schema=schema)
                writer.write_batch(batch, row_group_size=row_group_size)
        os.replace(tmp, out)
        written.append(str(out))
    return written
