"""Synthetic event data for benchmarks, tests and the demo (never real data).

``generate_for_spec`` writes input shaped by a release spec (its path template, format, columns,
public partitions and bounds), so the shipped examples run as they are (``dpops spec synth``).

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
from typing import Any

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


def generate_for_spec(
    spec_path: str | os.PathLike[str],
    start: str,
    end: str,
    *,
    n_rows: int = 2000,
    n_users: int = 300,
    n_partitions: int = 8,
    seed: int = 0,
    user_exponent: float = 1.0,
) -> list[str]:
    """Write synthetic input for every interval of a release spec starting in [start, end).

    The files follow the spec itself, so a shipped example runs as it is: its ``input.path``
    template (relative to the spec's directory), its ``format`` (parquet or csv) and its declared
    ``columns``. Values: the unit column holds power-law user ids; partition columns hold the
    spec's public partitions when it lists them (else ``<column><i>`` names, power-law); a bounded
    metric's column is lognormal clipped to its bounds; a top_k column draws from its domain; the
    time column falls inside the file's interval. Returns the written paths. Never real data.
    """
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    from dpops.gaps import spec_intervals
    from dpops.ledger.model import parse_utc
    from dpops.spec import load_spec

    for name, v in (("n_rows", n_rows), ("n_users", n_users), ("n_partitions", n_partitions)):
        if not isinstance(v, int) or v < 1:
            raise InvalidParameter(f"generate_for_spec: {name} must be an integer >= 1, got {v!r}")
    spec = load_spec(spec_path)
    cols = spec.input.columns
    unit = spec.privacy_unit.column
    part_cols = list(spec.partitions.columns)
    public = spec.public_partitions()
    bounds: dict[str, tuple[float, float]] = {}
    domains: dict[str, list[Any]] = {}
    for m in spec.metrics:
        col = getattr(m, "column", None)
        if col and getattr(m, "bounds", None):
            lo, hi = m.bounds
            bounds[col] = (min(bounds.get(col, (lo, hi))[0], lo), max(bounds.get(col, (lo, hi))[1], hi))
        if col and getattr(m, "domain", None):
            domains[col] = list(m.domain)
    rng = np.random.default_rng(seed)
    user_p = _power_law(n_users, user_exponent)
    written = []
    for s, e in spec_intervals(spec, parse_utc(start, "start"), parse_utc(end, "end")):
        n = n_rows
        data: dict[str, Any] = {}
        users = rng.choice(n_users, size=n, p=user_p)
        data[unit] = [f"u{i}" for i in users] if cols[unit] == "string" else users.astype(np.int64)
        if public is not None:
            idx = rng.choice(len(public), size=n, p=_power_law(len(public), 0.8))
            for j, c in enumerate(part_cols):
                data[c] = [public[i][j] for i in idx]
        else:
            for c in part_cols:
                idx = rng.choice(n_partitions, size=n, p=_power_law(n_partitions, 0.8))
                data[c] = [f"{c}{i}" for i in idx] if cols[c] == "string" else idx.astype(np.int64)
        for c, t in cols.items():
            if c in data:
                continue
            if c == spec.input.time_column or t == "timestamp":
                span_us = int((e - s).total_seconds() * 1_000_000)
                base_us = int(s.timestamp() * 1_000_000)
                data[c] = pa.array(base_us + rng.integers(0, span_us, size=n), pa.timestamp("us", tz="UTC"))
            elif c in domains:
                dom = domains[c]
                data[c] = [dom[i] for i in rng.choice(len(dom), size=n, p=_power_law(len(dom), 0.7))]
            elif t in ("float", "int"):
                lo, hi = bounds.get(c, (0.0, 100.0))
                v = np.clip(lo + rng.lognormal(0.0, 1.0, size=n) * max(hi - lo, 1e-9) / 8.0, lo, hi)
                data[c] = v if t == "float" else np.round(v).astype(np.int64)
            elif t == "bool":
                data[c] = rng.random(n) < 0.5
            else:
                data[c] = [f"{c}{i}" for i in rng.integers(0, 10, size=n)]
        types = {"string": pa.string(), "int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(),
                 "timestamp": pa.timestamp("us", tz="UTC")}
        table = pa.table({c: pa.array(data[c], types[t]) if not isinstance(data[c], pa.Array) else data[c]
                          for c, t in cols.items()})
        out = Path(spec.resolve_path(spec.input.path.format(start=s, end=e)))
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        if spec.input.format == "parquet":
            pq.write_table(table, tmp)
        else:
            pacsv.write_csv(table, tmp)
        os.replace(tmp, out)
        written.append(str(out))
    return written
