"""Post-processing checks on the NOISY output, before it is published.

Everything here reads only the noisy, post-processed output, never the input: by the
post-processing property of differential privacy such a check costs no budget and may block a
publish freely. A failure names columns and counts, never a partition value that is not public
(a partition outside the public list is a raw value from the input).
"""

from __future__ import annotations

import os

from dpops.errors import IntegrityError
from dpops.spec import ReleaseSpec
from dpops.storage import Location, as_location


def check_noisy_output(spec: ReleaseSpec, data_file: str | os.PathLike[str] | Location) -> list[str]:
    """Post-processing checks on the NOISY output (free to block a publish): returns the checks that ran.

    Partition columns and every metric's value/std/CI columns present; no NaN anywhere (nulls only where
    ``suppress_below`` blanks a value); public partitions all present, once, and nothing else.
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    where = f"noisy output {data_file}"
    try:
        loc = as_location(data_file)
        fs, inner = loc.filesystem()
        table = pq.read_table(inner, filesystem=fs)
    except Exception as exc:  # noqa: BLE001
        raise IntegrityError(f"{where}: cannot read it as Parquet ({type(exc).__name__}); not publishing") from None
    names = set(table.column_names)
    problems: list[str] = []
    checks = ["partition columns present", "metric, std and 95% CI columns present", "no NaN values"]
    for c in spec.partitions.columns:
        if c not in names:
            problems.append(f"partition column {c!r} missing")
    for m in spec.metrics:
        if m.type == "quantiles":
            want = [f"{m.key}_{s}" for s in m.column_suffixes()]
        elif m.type == "top_k":
            want = []
            if not any(n == m.key or n.startswith(m.key + "_") for n in names):
                problems.append(f"no column for top_k metric {m.key!r}")
        else:
            want = [m.key, f"{m.key}_std", f"{m.key}_ci95_low", f"{m.key}_ci95_high"]
        problems += [f"column {w!r} missing" for w in want if w not in names]
    for name in table.column_names:
        col = table.column(name)
        if pa.types.is_floating(col.type):
            if pc.any(pc.is_nan(col)).as_py():
                problems.append(f"column {name!r} has NaN values")
        if col.null_count and (spec.postprocess.suppress_below is None or name in spec.partitions.columns):
            problems.append(f"column {name!r} has {col.null_count} null values")
    public = spec.public_partitions()
    if public is not None and not any(p.startswith("partition column") for p in problems):
        checks.append("exactly the public partitions")
        rows = list(zip(*(table.column(c).to_pylist() for c in spec.partitions.columns), strict=False))
        want_set = set(public)
        missing = want_set - set(rows)
        extra = set(rows) - want_set
        if missing:
            problems.append(f"{len(missing)} public partition(s) missing, e.g. {sorted(map(str, missing))[:3]}")
        if extra:
            # No examples: a partition outside the public list is a raw value from the input, not public.
            problems.append(f"{len(extra)} partition(s) not in the public list")
        if len(rows) != len(set(rows)):
            problems.append("a partition appears more than once")
    if problems:
        raise IntegrityError(f"{where} failed its post-processing checks, not publishing: " + "; ".join(problems))
    return checks
