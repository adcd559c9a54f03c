"""Great Expectations checks around a release: the input's schema, and the noisy output.

Two kinds of checks, with different privacy status (semantics.md section 6):

- ``check_input_schema`` looks only at *metadata* (Parquet schema, CSV header), never at
  values, so its verdict does not depend on private data and may stop a run before any
  budget is reserved. Value problems (a bad number, a NaN) are the pipeline's job: clamp
  or drop the row, never abort the interval. That is also why a CSV's column *types* are
  not checked here: inferring them would read values.
- ``check_release_output`` runs on the *noisy, post-processed* output. It is
  post-processing, so it may block a publish freely.

Reports carry which checks ran and whether they passed, never statistics about the
input: those belong to the internal run log, not the manifest (semantics.md section 5).

GX costs seconds to import, so it is imported lazily inside the functions.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dpops.errors import InputDataError, IntegrityError, SpecError
from dpops.inputs import columns_of_any_type

# Declared spec type -> the pandas dtype names GX accepts for it. Strings are turned into
# pandas' StringDtype first (an empty object column would pass any type check vacuously).
# An integer column is accepted where a float is declared: widening is lossless.
_INTS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
_TYPE_NAMES: dict[str, tuple[str, ...]] = {
    "string": ("StringDtype",),
    # floats too (pandas writes an int column with a missing value as float64): dpops.inputs.stored_type_ok
    "int": (*_INTS, "float16", "float32", "float64"),
    "float": ("float16", "float32", "float64", *_INTS),
    "bool": ("bool",),
    # input.time_column: a Parquet timestamp of any unit, naive (= UTC) or zone-aware
    "timestamp": tuple(f"datetime64[{u}]" for u in ("s", "ms", "us", "ns")),
}

# Separator joining several partition columns into one key; a control character that
# no sane partition label contains.
_KEY_SEP = "\x1f"


@dataclass
class CheckReport:
    """Which checks ran and their verdict. ``failures`` are human sentences."""

    name: str
    success: bool
    checks: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        """The report as JSON-ready values (names and verdicts only)."""
        return {"name": self.name, "success": self.success, "checks": list(self.checks),
                "failures": list(self.failures)}


_lock = threading.Lock()
_context: Any = None


def _gx():
    """The GX module, an ephemeral context shared by this process, and the expectations module."""
    global _context
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    from dpops.third_party_logs import quiet_third_party_loggers

    quiet_third_party_loggers()  # before the import: GX logs INFO while it is imported (_docs_decorators)
    import great_expectations as gx
    import great_expectations.expectations as gxe

    quiet_third_party_loggers()  # and after: GX sets some of its loggers' levels when imported
    with _lock:
        if _context is None:
            from great_expectations.data_context.types.base import ProgressBarsConfig

            ctx = gx.get_context(mode="ephemeral")
            ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
            _context = ctx
    return gx, gxe, _context


def _run_suite(name: str, expectations: list[Any], df: Any) -> list[Any]:
    """Validate ``df`` against ``expectations``; return GX's per-expectation results."""
    gx, _, ctx = _gx()
    tag = f"{name}-{uuid.uuid4().hex[:12]}"
    with _lock:  # the context's stores are not thread-safe
        batch = ctx.data_sources.add_pandas(tag).add_dataframe_asset(tag).add_batch_definition_whole_dataframe(tag)
        suite = ctx.suites.add(gx.ExpectationSuite(name=tag, expectations=expectations))
        vd = ctx.validation_definitions.add(gx.ValidationDefinition(name=tag, data=batch, suite=suite))
    try:
        result = vd.run(batch_parameters={"dataframe": df})
        return list(result.results)
    finally:
        with _lock:  # keep the shared context from growing with every run
            for delete in (ctx.validation_definitions.delete, ctx.suites.delete, ctx.data_sources.delete):
                try:
                    delete(tag)
                except Exception:  # noqa: BLE001 - cleanup is best effort
                    pass


def _describe(res: Any) -> str:
    cfg = res.expectation_config
    kw = {k: v for k, v in cfg.kwargs.items() if k in ("column", "column_A", "column_B")}
    return cfg.type + (f"({', '.join(f'{k}={v}' for k, v in sorted(kw.items()))})" if kw else "")


# ---------------------------------------------------------------------------- input


def _schema_frame(path: str, fmt: str) -> Any:
    """An EMPTY pandas frame with the file's columns and types: metadata only, no values."""
    import pandas as pd
    import pyarrow as pa

    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            meta = pq.read_metadata(path)
            schema = meta.schema.to_arrow_schema()
        except Exception as exc:  # noqa: BLE001 - any reader error means the file is unusable
            raise InputDataError(f"input file {path}: not a readable Parquet file ({type(exc).__name__}); "
                                 "fix or replace it") from None
        # Dictionary-encoded columns are checked as their value type.
        fields = [pa.field(f.name, f.type.value_type if pa.types.is_dictionary(f.type) else f.type) for f in schema]
        # Timestamps are checked by unit only: a zone-aware dtype has no name GX can match, and a
        # zone is irrelevant to input.time_column (the instant is UTC either way).
        fields = [pa.field(f.name, pa.timestamp(f.type.unit)) if pa.types.is_timestamp(f.type) else f for f in fields]
        df = pa.schema(fields).empty_table().to_pandas()
        for f in fields:
            # binary too: the reader reads a bytes column as UTF-8 text cell by cell (dpops.inputs.stored_type_ok:
            # one unit's bytes value makes a writer store the whole column as binary; review 5)
            if (pa.types.is_string(f.type) or pa.types.is_large_string(f.type) or pa.types.is_binary(f.type)
                    or pa.types.is_large_binary(f.type)):
                df[f.name] = df[f.name].astype("string")
        # Columns whose stored type says nothing about their values (all-null, or a file without rows) get no
        # type expectation: GX accepts exactly what check_input accepts (dpops.inputs.columns_of_any_type).
        df.attrs["any_type_columns"] = sorted(columns_of_any_type(schema, meta.num_rows))
        return df
    if fmt == "csv":
        # the header as the reader reads it (one owner, ``pipelines.io.csv_header_names``; review 5)
        from pipelines.io import csv_header_names

        try:
            with open(path, "rb") as fh:
                header = csv_header_names(fh, f"input file {path}")
        except OSError as exc:
            what = exc.strerror or type(exc).__name__
            raise InputDataError(f"input file {path}: cannot read the CSV header ({what}); fix or replace it") from None
        return pd.DataFrame(columns=header)
    raise SpecError(f"input.format: unsupported format {fmt!r}; use parquet or csv")


def check_input_schema(paths: Sequence[str], columns: Mapping[str, str], fmt: str = "parquet") -> CheckReport:
    """Every file exists and has every declared column with a compatible type (Parquet only).

    Extra columns are ignored. Raises ``InputDataError`` naming the file and the column; on
    success returns the report of the checks that ran. Never reads a value.
    """
    if not paths:
        raise InputDataError("no input files resolved for this interval; check input.path in the spec")
    for col, typ in columns.items():
        if typ not in _TYPE_NAMES:
            raise SpecError(f"input.columns.{col}: unknown type {typ!r}; use one of {sorted(_TYPE_NAMES)}")
    _, gxe, _ = _gx()
    report = CheckReport(name="input_schema", success=True)
    for path in paths:
        if not os.path.isfile(path):
            raise InputDataError(f"input file {path} does not exist; provide it (late data?) and retry")
        if not os.access(path, os.R_OK):
            raise InputDataError(f"input file {path} is not readable by this process; fix its permissions")
        df = _schema_frame(path, fmt)
        expectations: list[Any] = [gxe.ExpectColumnToExist(column=c) for c in columns]
        if fmt == "parquet":
            expectations += [
                gxe.ExpectColumnValuesToBeInTypeList(column=c, type_list=list(_TYPE_NAMES[t]))
                for c, t in columns.items()
                if c in df.columns and c not in df.attrs.get("any_type_columns", ())
            ]
        failures = []
        for res in _run_suite("input", expectations, df):
            check = _describe(res)
            if check not in report.checks:
                report.checks.append(check)
            if not res.success:
                col = res.expectation_config.kwargs.get("column")
                if res.expectation_config.type == "expect_column_to_exist":
                    failures.append(f"input file {path}: declared column {col!r} is missing")
                else:
                    seen = (res.result or {}).get("observed_value")
                    failures.append(
                        f"input file {path}: column {col!r} is declared {columns[col]!r} but the file stores {seen!r}"
                    )
        if failures:
            report.success = False
            report.failures += failures
            raise InputDataError("; ".join(failures) + "; fix the file or input.columns in the spec")
    return report


# --------------------------------------------------------------------------- output


def _partition_keys(df: Any, partition_columns: Sequence[str]) -> Any:
    if len(partition_columns) == 1:
        return df[partition_columns[0]].astype(str)
    return df[list(partition_columns)].astype(str).agg(_KEY_SEP.join, axis=1)


def _public_keys(public: Iterable[Any], n_columns: int) -> list[str]:
    keys = []
    for p in public:
        parts = [p] if n_columns == 1 and not isinstance(p, (list, tuple)) else list(p)
        if len(parts) != n_columns:
            raise SpecError(f"partitions.public: entry {p!r} does not have {n_columns} values")
        keys.append(_KEY_SEP.join(str(x) for x in parts))
    return keys


def output_expectations(df: Any, partition_columns: Sequence[str], public_partitions: Sequence[Any] | None,
                        allow_null: bool, where: str) -> tuple[Any, list[Any]]:
    """dpops' output suite on a noisy release table: (the table with its partition key column, expectations).

    One owner for the suite: ``check_release_output`` runs it in memory, ``dpops.gx_project`` through a
    file-backed checkpoint. Only noisy values are checked here (post-processing, semantics.md section 6).
    """
    _, gxe, _ = _gx()
    df = df.copy()
    df["__partition_key"] = _partition_keys(df, partition_columns)
    value_cols = [c for c in df.columns if c not in partition_columns and c != "__partition_key"]
    exp: list[Any] = [gxe.ExpectColumnValuesToBeUnique(column="__partition_key")]
    if public_partitions is not None:
        keys = _public_keys(public_partitions, len(partition_columns))
        exp += [
            gxe.ExpectColumnDistinctValuesToEqualSet(column="__partition_key", value_set=keys),
            gxe.ExpectTableRowCountToEqual(value=len(keys)),
        ]
    if not allow_null:
        exp += [gxe.ExpectColumnValuesToNotBeNull(column=c) for c in [*partition_columns, *value_cols]]
    for low in [c for c in value_cols if c.endswith("_ci95_low")]:
        high = low[: -len("_low")] + "_high"
        if high not in df.columns:
            raise IntegrityError(f"{where}: column {low!r} has no matching {high!r}")
        exp.append(
            gxe.ExpectColumnPairValuesAToBeGreaterThanB(
                column_A=high, column_B=low, or_equal=True, ignore_row_if="either_value_is_missing"
            )
        )
    exp += [gxe.ExpectColumnValuesToBeBetween(column=c, min_value=0) for c in value_cols if c.endswith("_std")]
    return df, exp


def check_release_output(
    output: Any,
    *,
    partition_columns: Sequence[str],
    public_partitions: Sequence[Any] | None = None,
    allow_null: bool = False,
) -> CheckReport:
    """Post-processing checks on a NOISY output table (a DataFrame or a Parquet path).

    - every public partition is present exactly once (private selection: keys are unique);
    - no null/NaN value (unless ``allow_null``: a spec with ``suppress_below`` blanks values);
    - every ``<key>_ci95_low <= <key>_ci95_high`` and every ``<key>_std >= 0``.

    Raises ``IntegrityError`` listing what failed, so the interval is not published.
    """
    import pandas as pd

    if isinstance(output, (str, os.PathLike)):
        try:
            df = pd.read_parquet(output)
        except Exception as exc:  # noqa: BLE001
            raise IntegrityError(f"release output {output}: cannot read it as Parquet ({type(exc).__name__})") from None
        where = str(output)
    else:
        df, where = output, "release output"
    missing = [c for c in partition_columns if c not in df.columns]
    if missing:
        raise IntegrityError(f"{where}: partition column(s) {missing} are missing")
    df, exp = output_expectations(df, partition_columns, public_partitions, allow_null, where)
    report = CheckReport(name="release_output", success=True)
    for res in _run_suite("output", exp, df):
        report.checks.append(_describe(res))
        if not res.success:
            # Counts only, never the offending values: GX's partial_unexpected_list holds cells of the output.
            n_bad = (res.result or {}).get("unexpected_count")
            report.failures.append(f"{_describe(res)} failed" + (f" ({n_bad} rows)" if n_bad is not None else ""))
    if report.failures:
        report.success = False
        raise IntegrityError(f"{where}: the noisy output failed its checks, not publishing: "
                             + "; ".join(report.failures))
    return report
