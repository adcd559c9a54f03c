"""The release-spec reference (``docs/spec.md``), generated from the spec models in ``dpops.spec``.

Every key a spec may hold is a field of a pydantic model there; this module walks those models and
writes one table per section with each field's path, type, default and constraints, plus what the
field changes (``FIELD_DOCS``). ``tests/test_spec_reference.py`` regenerates the page and compares it
with ``docs/spec.md``, and checks that every field of every model has an entry here and no entry names
a field that is gone. So a new spec key cannot ship undocumented, and the page cannot drift from the
models: ``dpops spec reference --out docs/spec.md`` rewrites it.

Why a table of its own and not pydantic ``description=``: the descriptions say what a field *changes*
(which mechanism, which output, what is charged), which reads better next to one another than spread
over validators; the test keeps the two in step either way.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from dpops import spec as S

# (section title, path prefix, model, intro). A discriminated union (metrics, targets, tuning data) gets one
# section per member, its discriminator value in the title.
SECTIONS: tuple[tuple[str, str, type[BaseModel], str], ...] = (
    ("Top level", "", S.ReleaseSpec,
     "A release spec is one YAML file (at most 1 MiB, no aliases, no duplicate keys). Unknown keys are errors "
     "everywhere, so a misspelt key never falls back to a default."),
    ("input", "input.", S.InputSpec, "The private input of one run."),
    ("privacy_unit", "privacy_unit.", S.PrivacyUnitSpec,
     "Whom the release protects. Together with `input.time_column` this is the unit definition a budget "
     "scope records: a release with another definition is refused before anything is reserved."),
    ("budget", "budget.", S.BudgetSpec, "What one run (one interval) is charged, and to which scope."),
    ("contribution", "contribution.", S.ContributionSpec,
     "How much one unit may contribute; rows beyond the bounds are dropped (sampled uniformly with the run's "
     "randomness) before any aggregation. Sensitivities are derived from these (`dpops/noise/sensitivity.py`)."),
    ("partitions", "partitions.", S.PartitionsSpec,
     "Which partitions are released. Give exactly one of `public`, `public_file` and `private`."),
    ("partitions.private", "partitions.private.", S.PrivatePartitionsSpec,
     "DP partition selection: a partition is released only if its noisy unit count passes the strategy "
     "(needs `budget.delta` > 0); it is charged its share of the budget (`budget.split.partition_selection`)."),
    ("metrics[].contribution", "metrics[].contribution.", S.MetricContributionSpec,
     "A metric's own contribution bounds (any metric type), overriding the release's `contribution` for that "
     "metric only: give either or both fields; one left out is the release's. The metric's vectors are computed "
     "on rows bounded by its own bounds and charged with the sensitivity they give; the others keep the "
     "release's. `max_partitions_per_unit` may not exceed the release's (partition selection and the first bound "
     "use the release's L0). Refused with `bounds: estimate`, `estimated_from`, record-level units, `dpops "
     "estimate`, `dpops tune` and the planted-bug audit (they model one bound set). Absent: the release's "
     "bounds, and the spec hashes and plans as before."),
    ("metrics[]: count", "metrics[].", S.CountMetric, "Rows per partition (after bounding), discrete noise."),
    ("metrics[]: unit_count", "metrics[].", S.UnitCountMetric, "Distinct units per partition, discrete noise."),
    ("metrics[]: sum", "metrics[].", S.SumMetric, "Sum of a numeric column, values clamped to `bounds`."),
    ("metrics[]: mean", "metrics[].", S.MeanMetric,
     "Mean of a numeric column: a noisy centred sum over a noisy count (two mechanisms)."),
    ("metrics[]: variance", "metrics[].", S.VarianceMetric,
     "Variance of a numeric column, from noisy count, sum and sum of squares."),
    ("metrics[]: quantiles", "metrics[].", S.QuantilesMetric,
     "Quantiles by the exponential mechanism (permute-and-flip) over a public grid of 257 points in `bounds`."),
    ("metrics[]: top_k", "metrics[].", S.TopKMetric,
     "The k most frequent categories of a column, chosen among a public domain by permute-and-flip peeling."),
    ("postprocess", "postprocess.", S.PostprocessSpec,
     "Post-processing of the noisy values (free: it reads no private data, semantics section 3)."),
    ("output", "output.", S.OutputSpec, "Where the run's staged and published files and manifests go."),
    ("accuracy", "accuracy.", S.AccuracySpec,
     "Accuracy targets (`dpops plan`, `plan --solve`, `spec check --require-targets`, docs/accuracy.md). Claims "
     "about public parameters only: checking them reads no data and charges nothing; left out of the spec hash."),
    ("accuracy.targets[]: error", "accuracy.targets[].", S.ErrorTarget,
     "The error of the released value, absolute or relative, is within the bound with the given probability."),
    ("accuracy.targets[]: keep", "accuracy.targets[].", S.KeepTarget,
     "Private partition selection keeps a partition of `at_units` units with at least this probability."),
    ("accuracy.targets[]: rank_error", "accuracy.targets[].", S.RankTarget,
     "A quantile's expected rank error, as a fraction of the partition's rows."),
    ("accuracy.targets[]: top_pick", "accuracy.targets[].", S.TopPickTarget,
     "top_k ranks the true top item first with at least this probability when it leads by `at_gap`."),
    ("tuning", "tuning.", S.TuningSpec,
     "Where the bounds came from when `dpops tune` chose them; written by `dpops spec apply-patch`, carried into "
     "every manifest and the report. Provenance, not a parameter: left out of the spec hash."),
    ("tuning.data: public", "tuning.data.", S.PublicTuningData, "Tuned on a sample under `$DPOPS_PUBLIC_ROOTS`."),
    ("tuning.data: private", "tuning.data.", S.PrivateTuningData,
     "Tuned by looking at private data on purpose, recorded by a `private_access` ledger entry."),
)

_METRIC_COMMON = {
    "name": "The metric's key and output column prefix (`[a-z][a-z0-9_]{0,63}`). Default: the type for count "
            "and unit_count, `<type>_<column>` otherwise (`sum_amount`). `budget.split` and targets name metrics "
            "by key.",
    "type": "The metric type (the discriminator of `metrics[]`).",
    "contribution": "The metric's own contribution bounds (`metrics[].contribution`); absent: the release's "
                    "`contribution`.",
}
_BOUNDED = {
    "column": "The numeric input column (declared `int` or `float`; not the unit column).",
    "bounds": "`[lower, upper]`: every value is clamped into them before aggregation, so they fix the "
              "sensitivity. Public: never chosen by looking at the data (within +-2^53). Or `estimate`: the "
              "bounds are learned under DP at run time by a charged estimation with its own share "
              "`budget.split.<key>.bounds`.",
    "fallback_bounds": "Only with `bounds: estimate`: public `[lower, upper]` at which `plan` predicts accuracy "
                       "before the estimation runs, and the estimator's anchor (a lower bound >= 0 is kept).",
}
_TARGET_AT_UNITS = ("The partition size (in units) the claim is about; errors only shrink with more rows, so "
                    "the prediction is for the smallest partition of that size.")
_TARGET_ROWS_PER_UNIT = ("Rows each of those units has in the partition (default 1, the worst case). The prediction "
                         "uses `at_units * min(rows_per_unit, max_rows_per_unit_per_partition)` rows: bounding "
                         "keeps at most Linf of a unit's rows. Changes the mean's and variance's denominator, a "
                         "count's default true value and a quantile's rank scale; never a mechanism.")

# What each field changes, by (section title, field name). The test checks this covers every field.
FIELD_DOCS: dict[tuple[str, str], str] = {
    ("Top level", "name"): "The release's name (`[a-z0-9_-]{1,64}`): part of the run key, the output paths and "
                           "the DAG id (`dpops_<name>`).",
    ("Top level", "description"): "Free text shown in reports.",
    ("Top level", "schedule"): "A 5-field cron expression or `@daily`-style preset: one run per schedule "
                               "interval. With `privacy_unit.period`, every interval must be exactly one period.",
    ("Top level", "catchup"): "Whether the scheduler creates runs for past intervals (Airflow `catchup`). Null: "
                              "the deployment's `DPOPS_CATCHUP` (false by default: every run spends budget). "
                              "Orchestration only; left out of the spec hash.",
    ("Top level", "input"): "The `input` section.",
    ("Top level", "privacy_unit"): "The `privacy_unit` section.",
    ("Top level", "budget"): "The `budget` section.",
    ("Top level", "contribution"): "The `contribution` section.",
    ("Top level", "partitions"): "The `partitions` section.",
    ("Top level", "metrics"): "The metrics, at least one; each is a mechanism charged its share of the budget.",
    ("Top level", "postprocess"): "The `postprocess` section.",
    ("Top level", "output"): "The `output` section.",
    ("Top level", "accuracy"): "The `accuracy` section (optional).",
    ("Top level", "tuning"): "The `tuning` section (written by `dpops spec apply-patch`).",
    ("Top level", "estimated_from"): "The run id of the committed, charged `dpops estimate` run these bounds "
                                     "came from. Part of the spec hash; the release is refused unless that run is "
                                     "a committed estimation of this release on the same scope.",
    ("input", "path"): "The input file(s), relative to the spec's directory or absolute, under a data root "
                       "(`$DPOPS_DATA_ROOTS`). May use `{start}` and `{end}` with strftime formats "
                       "(`{start:%Y-%m-%d}`), nothing else.",
    ("input", "format"): "`parquet` or `csv` (the CSV dialect is in README.md: a line is a row, a malformed "
                         "line is skipped, only an empty cell is null).",
    ("input", "columns"): "Every column the release reads, with its type (`string`, `int`, `float`, `bool`, "
                          "`timestamp`). A cell that does not convert drops its row (counted in the private run "
                          "log only).",
    ("input", "time_column"): "The event-time column (declared `timestamp`): each run keeps only rows whose "
                              "time is in its interval, so runs over different periods read disjoint rows "
                              "(required for a period-bucketed scope). Naive times are UTC.",
    ("privacy_unit", "column"): "The column naming the protected unit (`user_id`).",
    ("privacy_unit", "description"): "What one unit is, in words (`a user's purchases on one day`): shown to "
                                      "reviewers in the manifest and the report.",
    ("privacy_unit", "adjacency"): "`add_remove` (a unit's data present or absent) or `replace` (swapped for "
                                   "another's): replace doubles most sensitivities.",
    ("privacy_unit", "record_level"): "True: every row is its own unit (then both contribution bounds must be 1).",
    ("privacy_unit", "period"): "`day`, `week` or `month`: the unit is period-scoped (a user-day), so releases "
                                "over disjoint periods compose in parallel on a bucketed scope.",
    ("privacy_unit", "population"): "The number of units, if known: `budget.delta` must then be below 1/population.",
    ("budget", "scope"): "The budget scope in the ledger (`[A-Za-z0-9_.:-]{1,128}`), created by an operator; "
                         "all releases on a scope compose against its cap.",
    ("budget", "epsilon"): "A finite number > 0: the epsilon of one run, split over the metrics (and partition "
                           "selection, and any estimation) by `split`.",
    ("budget", "delta"): "In [0, 1): the delta of one run (needed by Gaussian noise and private partitions; a warning "
                         "above 1e-5).",
    ("budget", "noise"): "`laplace` (discrete Laplace, pure DP) or `gaussian` (discrete Gaussian, needs delta).",
    ("budget", "accountant"): "The scope's accountant, pinned `name/version` (`pld/1`, `rdp/1`, `zcdp/1`, "
                              "`basic/1`, `basic/2`): Gaussian noise is calibrated so the run's events composed by "
                              "it cost exactly the declared (epsilon, delta); the run is refused on a scope checked by "
                              "another accountant. Null: the zCDP split of the Gaussian metrics' budget.",
    ("budget", "split"): "Relative weights by metric key (and `partition_selection`, and `<key>.bounds` for an "
                         "estimation); unlisted keys weigh 1.",
    ("contribution", "max_partitions_per_unit"): "L0: the partitions one unit may contribute to per run.",
    ("contribution", "max_rows_per_unit_per_partition"): "Linf: the rows one unit may contribute per partition.",
    ("partitions", "columns"): "The partition (group-by) columns, at least one; not the unit column.",
    ("partitions", "public"): "An inline list of public partitions (a list of values per entry with several "
                              "columns): all of them are released, with zeros where there is no data.",
    ("partitions", "public_file"): "A CSV of public partitions under `$DPOPS_PUBLIC_ROOTS` (never under a data "
                                   "root); its rows enter the run's keyed input fingerprint.",
    ("partitions", "private"): "DP partition selection (the `partitions.private` section).",
    ("partitions.private", "strategy"): "`truncated_geometric` (the optimal keep probability), "
                                        "`laplace_threshold` or `gaussian_threshold` (noisy unit count against a "
                                        "threshold set by delta).",
    ("metrics[]: quantiles", "quantiles"): "The quantiles, each strictly between 0 and 1, no duplicates; output "
                                           "columns `<key>_q50`, `<key>_q90`, ...",
    ("metrics[]: top_k", "column"): "The categorical input column.",
    ("metrics[]: top_k", "k"): "How many categories to rank (at most the domain's size); output columns "
                               "`<key>_rank1`, ...",
    ("metrics[]: top_k", "domain"): "The public list of categories (scalars, no duplicates); values outside it "
                                    "are not counted.",
    ("postprocess", "non_negative"): "Clamp counts (and sums whose lower bound is >= 0) and their intervals at 0.",
    ("postprocess", "integer_counts"): "Publish counts as integers (false: as floats).",
    ("postprocess", "clamp_means_to_bounds"): "Clamp means and their intervals into the metric's bounds.",
    ("postprocess", "suppress_below"): "Blank (null) every metric value of a partition whose first noisy count "
                                       "is below this; null: suppress nothing.",
    ("output", "root"): "Relative to the spec's directory (default `out`), or an absolute path or URI (`s3://`) "
                        "under `$DPOPS_OUTPUT_ROOTS`: staged/, published/ and manifests/ go there.",
    ("accuracy", "confidence"): "The default probability of every error target.",
    ("accuracy", "targets"): "The targets, at least one.",
    ("accuracy.targets[]: error", "kind"): "`error`.",
    ("accuracy.targets[]: error", "metric"): "The metric key (count, unit_count, sum, mean or variance).",
    ("accuracy.targets[]: error", "max_error"): "The absolute error bound (give this or `max_relative_error`).",
    ("accuracy.targets[]: error", "max_relative_error"): "The error bound as a fraction of the true value "
                                                          "(`at_value`; for count by default the partition's rows, "
                                                          "for unit_count `at_units`).",
    ("accuracy.targets[]: error", "at_units"): _TARGET_AT_UNITS,
    ("accuracy.targets[]: error", "rows_per_unit"): _TARGET_ROWS_PER_UNIT,
    ("accuracy.targets[]: error", "at_value"): "The true value a relative error is measured against (needed for "
                                                "sum, mean and variance).",
    ("accuracy.targets[]: error", "confidence"): "This target's probability (default `accuracy.confidence`).",
    ("accuracy.targets[]: keep", "kind"): "`keep`.",
    ("accuracy.targets[]: keep", "at_units"): "The partition size in units.",
    ("metrics[].contribution", "max_partitions_per_unit"): "The metric's L0: at most this many partitions per "
                                                              "unit for this metric (<= the release's). Absent: the "
                                                              "release's.",
    ("metrics[].contribution", "max_rows_per_unit_per_partition"): "The metric's Linf: at most this many rows per "
                                                                      "unit and partition for this metric. Absent: "
                                                                      "the release's.",
    ("accuracy.targets[]: keep", "min_probability"): "The least keep probability.",
    ("accuracy.targets[]: rank_error", "kind"): "`rank_error`.",
    ("accuracy.targets[]: rank_error", "metric"): "The quantiles metric's key.",
    ("accuracy.targets[]: rank_error", "max_rank_error"): "The largest expected rank error, a fraction of n.",
    ("accuracy.targets[]: rank_error", "at_units"): _TARGET_AT_UNITS,
    ("accuracy.targets[]: rank_error", "rows_per_unit"): _TARGET_ROWS_PER_UNIT,
    ("accuracy.targets[]: top_pick", "kind"): "`top_pick`.",
    ("accuracy.targets[]: top_pick", "metric"): "The top_k metric's key.",
    ("accuracy.targets[]: top_pick", "at_gap"): "The lead (in rows) of the true top item over the second.",
    ("accuracy.targets[]: top_pick", "min_probability"): "The least probability of ranking it first.",
    ("tuning", "candidate"): "The chosen candidate, as tune named it.",
    ("tuning", "loss"): "The loss tune minimised.",
    ("tuning", "candidates"): "How many candidates tune compared.",
    ("tuning", "not_evaluated"): "Candidates tune could not score.",
    ("tuning", "data"): "What the choice looked at: `source: public` or `source: private`.",
    ("tuning.data: public", "source"): "`public`.",
    ("tuning.data: public", "sample"): "The public sample's path.",
    ("tuning.data: public", "checked_at"): "When the sample was checked to be public (UTC, ISO-8601).",
    ("tuning.data: private", "source"): "`private`.",
    ("tuning.data: private", "scope"): "The scope the private read was recorded on (must be `budget.scope`).",
    ("tuning.data: private", "fingerprint"): "The keyed fingerprint (`hmac-sha256:...`) of the data read.",
    ("tuning.data: private", "ledger_entry"): "The ledger's `private_access` entry that recorded the read.",
    ("tuning.data: private", "read_at"): "When the data was read (UTC).",
    ("tuning.data: private", "statement"): "What every release says about it; derived from `read_at` (leave it "
                                           "out or copy it).",
}
for _title, _prefix, _model, _ in SECTIONS:
    if _title.startswith("metrics[]"):
        for _f in _model.model_fields:
            if _f in _METRIC_COMMON:
                FIELD_DOCS.setdefault((_title, _f), _METRIC_COMMON[_f])
            elif _f in _BOUNDED and "bounds" in _model.model_fields:  # the bounded metrics share these
                FIELD_DOCS.setdefault((_title, _f), _BOUNDED[_f])


# Where the YAML form differs from the model's in-memory type (``bounds: estimate`` is read into the fallback).
_YAML_TYPES = {"bounds": "[number, number] or `estimate`"}


@dataclass(frozen=True)
class FieldRow:
    """One row of the reference: a field's YAML path, type, default, constraints and what it changes."""

    section: str
    path: str
    name: str
    type: str
    required: bool
    default: str
    constraints: str
    doc: str | None


def _type_name(tp: Any) -> str:
    """A YAML reader's name for an annotation (``number``, ``one of a, b``, ``list of ...``)."""
    if tp is S.Number:
        return "number"
    if tp is S.Integer:
        return "integer"
    origin = get_origin(tp)
    if origin is Annotated:
        return _type_name(get_args(tp)[0])
    if origin is Literal:
        vals = get_args(tp)
        return f"`{vals[0]}`" if len(vals) == 1 else "one of " + ", ".join(f"`{v}`" for v in vals)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) > 1 and all(isinstance(a, type) and issubclass(a, BaseModel) for a in args):
            return "section (one of the sections below, by its discriminator)"
        inner = " or ".join(_type_name(a) for a in args)
        return inner + (" or null" if len(args) < len(get_args(tp)) else "")
    if origin is list:
        return f"list of {_type_name(get_args(tp)[0])}"
    if origin is tuple:
        return "[" + ", ".join(_type_name(a) for a in get_args(tp)) + "]"
    if origin is dict:
        k, v = get_args(tp)
        return f"map {_type_name(k)} -> {_type_name(v)}"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "section"
    return {str: "string", bool: "boolean", int: "integer", float: "number", typing.Any: "any"}.get(tp, str(tp))


def _constraints(info: FieldInfo) -> str:
    words = []
    for m in info.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if isinstance(m, getattr(annotated_types, attr.capitalize())):
                words.append(f"{sym} {getattr(m, attr)}")
        if isinstance(m, annotated_types.MinLen):
            words.append(f"at least {m.min_length} item(s)" if m.min_length != 1 else "not empty")
        if hasattr(m, "pattern") and getattr(m, "pattern", None):
            words.append(f"matches `{m.pattern}`")
    return "; ".join(w for w in words if w)


def _default(info: FieldInfo) -> tuple[bool, str]:
    if info.default is PydanticUndefined and info.default_factory is None:
        return True, ""
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
    else:
        value = info.default
    if isinstance(value, BaseModel):
        return False, "(section defaults)"
    if value is None:
        return False, "null"
    if isinstance(value, bool):
        return False, str(value).lower()
    return False, f"`{value!r}`" if isinstance(value, (str, list, dict)) else f"`{value}`"


def rows() -> Iterator[FieldRow]:
    """Every field of every spec model, in section order."""
    for title, prefix, model, _ in SECTIONS:
        for name, info in model.model_fields.items():
            required, default = _default(info)
            yield FieldRow(title, prefix + name, name, _YAML_TYPES.get(name) or _type_name(info.annotation),
                           required, default,
                           _constraints(info), FIELD_DOCS.get((title, name)))


def missing_docs() -> list[str]:
    """Fields with no entry in ``FIELD_DOCS``, and entries that name no field (the test's two checks)."""
    fields = {(r.section, r.name) for r in rows()}
    return ([f"{s}: {n} has no description" for s, n in sorted(fields - set(FIELD_DOCS))]
            + [f"{s}: {n} is described but is no field" for s, n in sorted(set(FIELD_DOCS) - fields)])


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    """The whole of ``docs/spec.md``."""
    out = ["# Release spec reference", "",
           "Generated from the spec models (`dpops/spec.py`) by `dpops spec reference --out docs/spec.md`; "
           "`tests/test_spec_reference.py` fails when this page and the models differ. Cross-field rules (a "
           "metric's column must be declared, gaussian noise needs delta, ...) are checked when a spec is loaded "
           "and named there with the field path; `dpops spec check FILE` runs them all.", ""]
    by_section: dict[str, list[FieldRow]] = {}
    for r in rows():
        by_section.setdefault(r.section, []).append(r)
    for title, _prefix, _model, intro in SECTIONS:
        out += [f"## {title}", "", intro, "", "| key | type | default | constraints | what it changes |",
                "| --- | --- | --- | --- | --- |"]
        for r in by_section.get(title, []):
            default = "required" if r.required else r.default
            out.append(f"| `{r.path}` | {_cell(r.type)} | {_cell(default)} | {_cell(r.constraints) or '-'} | "
                       f"{_cell(r.doc or '')} |")
        out.append("")
    return "\n".join(out)


__all__ = ["FIELD_DOCS", "FieldRow", "SECTIONS", "missing_docs", "render", "rows"]
