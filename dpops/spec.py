"""Release specs: the YAML file that declares one differentially private release.

The pydantic models below mirror the YAML keys exactly, with ``extra="forbid"``
everywhere so that a misspelt key is an error instead of a silently ignored
setting (a typo in ``max_rows_per_unit_per_partition`` must never fall back to a
default bound).

``load_spec(path)`` reads the file safely (size limit, no YAML aliases, no
duplicate keys) and raises ``SpecError`` naming the file and the field path,
e.g. ``daily.yaml: metrics[2].bounds: lower bound 5.0 is greater than upper bound 1.0``.

Decisions worth knowing (see also the docstrings):

- A metric's key is its ``name`` or, by default, ``<type>`` for metrics without a
  column (count, unit_count) and ``<type>_<column>`` otherwise (``sum_amount``).
  ``budget.split`` keys must be metric keys or ``partition_selection``; metrics
  not listed get weight 1 ("default equal").
- Relative paths (``input.path``, ``partitions.public_file``, ``output.root``)
  are relative to the directory of the spec file, so a DAG and a shell give the
  same result whatever their working directory.
- ``spec_hash`` = sha256 of the canonical JSON of the validated model (defaults
  filled in). When partitions come from ``public_file``, the file's parsed
  content is part of the hashed document only when the operator marked it publishable
  (``dpops.dataroots``); otherwise its row count is, and the rows are part of the run's keyed
  input fingerprint: changing the list changes the run key either way.
"""

from __future__ import annotations

import csv
import hashlib
import io
import math
import os
import re
import string
import warnings
from datetime import datetime, timezone
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from dpops.errors import InvalidParameter, SpecError
from dpops.events import canonical_json
from dpops.param_checks import check_bounds, check_delta, check_delta_for_population, check_epsilon

if TYPE_CHECKING:
    from dpops.storage.location import Location

MAX_SPEC_BYTES = 1024 * 1024  # a release spec is a few KiB; anything bigger is a mistake or an attack
MAX_PUBLIC_FILE_BYTES = 64 * 1024 * 1024
MAX_ABS_BOUND = float(2**53)  # metric value bounds; see _Bounded._bounds
MIN_ABS_BOUND = 2.0**-53  # the smallest non-zero scale of a metric's bounds; see _Bounded._bounds

NAME_RE = re.compile(r"^[a-z0-9_-]{1,64}$")
SCOPE_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
KEY_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
COLUMN_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")

ColumnType = Literal["string", "int", "float", "bool", "timestamp"]
NUMERIC_TYPES = ("int", "float")
PARTITION_SELECTION_KEY = "partition_selection"


def _no_bool(v: Any) -> Any:
    # pydantic's lax mode turns `true` into 1.0; a boolean where a number belongs is a typo.
    if isinstance(v, bool):
        raise ValueError(f"expected a number, got boolean {v!r}")
    return v


Number = Annotated[float, BeforeValidator(_no_bool)]
Integer = Annotated[int, BeforeValidator(_no_bool)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------------------- sections


class InputSpec(_Strict):
    path: str
    format: Literal["parquet", "csv"]
    columns: dict[str, ColumnType]
    # The event-time column (declared with type ``timestamp``): the pipeline keeps only rows whose
    # time lies in the run's interval [start, end). This is what makes releases over different
    # periods read disjoint rows, whatever files the path template resolves to (issue 11 item 2).
    time_column: str | None = None

    @field_validator("path")
    @classmethod
    def _template(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("input path is empty")
        # Only {start} / {end} (with an optional strftime spec): attribute or index
        # access in a format string ({start.__class__}) has no business in a path.
        for _, field_name, fmt, conv in string.Formatter().parse(v):
            if field_name is None:
                continue
            if field_name not in ("start", "end") or conv:
                raise ValueError(
                    f"input path template may only use {{start}} and {{end}} (strftime formats allowed), "
                    f"got {{{field_name}}}"
                )
        sample = datetime(2000, 1, 2, tzinfo=timezone.utc)
        try:
            v.format(start=sample, end=sample)
        except (ValueError, KeyError, IndexError) as exc:
            raise ValueError(f"input path template {v!r} cannot be formatted: {exc}") from None
        return v

    @field_validator("columns")
    @classmethod
    def _columns(cls, v: dict[str, str]) -> dict[str, str]:
        if not v:
            raise ValueError("declare at least one input column")
        for name in v:
            if not COLUMN_RE.match(name):
                raise ValueError(f"column name {name!r} must match {COLUMN_RE.pattern}")
        return v


class PrivacyUnitSpec(_Strict):
    column: str
    description: str = Field(min_length=1)
    adjacency: Literal["add_remove", "replace"]
    record_level: bool = False
    period: Literal["day", "week", "month"] | None = None
    population: Integer | None = Field(default=None, ge=1)


class BudgetSpec(_Strict):
    scope: str
    epsilon: Number
    delta: Number = 0.0
    noise: Literal["laplace", "gaussian"] = "laplace"
    split: dict[str, Number] | None = None
    # The scope's accountant, pinned ``name/version`` (issue 26): Gaussian noise is then calibrated so the
    # release's events, composed by it, cost the declared (epsilon, delta); absent, the zCDP split (basic/1
    # certifies it). Only a pinned version: the calibration must mean the same thing for every later verify.
    accountant: str | None = None

    @field_validator("scope")
    @classmethod
    def _scope(cls, v: str) -> str:
        if not SCOPE_RE.match(v):
            raise ValueError(f"scope name {v!r} must match {SCOPE_RE.pattern}")
        return v

    @field_validator("epsilon")
    @classmethod
    def _eps(cls, v: float) -> float:
        return check_epsilon(v, "epsilon")

    @field_validator("delta")
    @classmethod
    def _delta(cls, v: float) -> float:
        return check_delta(v, "delta")

    @field_validator("accountant")
    @classmethod
    def _accountant(cls, v: str | None) -> str | None:
        if v is None:
            return v
        from dpops.accounting import known_accountants  # the registry is lazy: no accountant is imported here

        if v not in known_accountants():
            raise ValueError(f"budget.accountant {v!r} must be a pinned accountant name/version, one of "
                             f"{known_accountants()} (the scope's: dpops ledger scope list)")
        return v

    @field_validator("split")
    @classmethod
    def _split(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("split is empty: omit it for equal weights")
        for k, w in v.items():
            if not math.isfinite(w) or w <= 0:
                raise ValueError(f"weight of {k!r} must be a finite number > 0, got {w!r}")
        return v


class ContributionSpec(_Strict):
    max_partitions_per_unit: Integer = Field(ge=1)
    max_rows_per_unit_per_partition: Integer = Field(ge=1)


class MetricContributionSpec(_Strict):
    """A metric's own contribution bounds (``metrics[].contribution``, issue 26 item 3): either or both of the
    release's two fields; a field left out is the release's (``contribution``).

    Privacy reason: the metric's vectors are computed on the rows bounded by its own (L0, Linf), so their
    sensitivity, and hence their noise and charge, follow from these bounds alone (``dpops.release_plan``);
    composition over the metrics' events is unchanged (each event carries its own sensitivity). The metric's
    L0 may not exceed the release's: the release's (L0, largest Linf) is the pipeline's first bound and partition
    selection runs under the release's L0, so every metric's partitions must be a subset of the release's
    (``_metric_contribution_problems``). The dumped form has only the fields given: a spec without any override
    dumps, hashes and plans exactly as before."""

    max_partitions_per_unit: Integer | None = Field(default=None, ge=1)
    max_rows_per_unit_per_partition: Integer | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _some(self) -> "MetricContributionSpec":
        if self.max_partitions_per_unit is None and self.max_rows_per_unit_per_partition is None:
            raise ValueError("give max_partitions_per_unit and/or max_rows_per_unit_per_partition, or remove "
                             "contribution: (the metric then uses the release's contribution bounds)")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        d: dict[str, Any] = handler(self)
        return {k: v for k, v in d.items() if v is not None}


class PrivatePartitionsSpec(_Strict):
    strategy: Literal["truncated_geometric", "laplace_threshold", "gaussian_threshold"]


class PartitionsSpec(_Strict):
    columns: list[str] = Field(min_length=1)
    public: list[Any] | None = None
    public_file: str | None = None
    private: PrivatePartitionsSpec | None = None

    @model_validator(mode="after")
    def _one_source(self) -> "PartitionsSpec":
        given = [k for k in ("public", "public_file", "private") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of partitions.public (inline list), partitions.public_file or "
                f"partitions.private (DP partition selection); got {given or 'none'}"
            )
        if len(set(self.columns)) != len(self.columns):
            raise ValueError(f"partitions.columns has duplicates: {self.columns}")
        if self.public is not None and not self.public:
            raise ValueError("partitions.public is empty: list at least one partition")
        return self

    @property
    def is_public(self) -> bool:
        return self.private is None


class _MetricBase(_Strict):
    name: str | None = None
    # The metric's own contribution bounds (MetricContributionSpec); None: the release's.
    contribution: MetricContributionSpec | None = None

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        d: dict[str, Any] = handler(self)
        return _drop_absent_contribution(d)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and not KEY_RE.match(v):
            raise ValueError(f"metric name {v!r} must match {KEY_RE.pattern} (it becomes an output column)")
        return v

    @property
    def key(self) -> str:
        if self.name:
            return self.name
        column = getattr(self, "column", None)
        return f"{self.type}_{column}" if column else self.type  # type: ignore[attr-defined]


def _drop_absent_contribution(d: dict[str, Any]) -> dict[str, Any]:
    """A metric's dump without ``contribution`` when it has none: absent, not null, so a spec written before
    per-metric bounds keeps its hash, its run keys and its manifests' form."""
    if d.get("contribution") is None:
        d.pop("contribution", None)
    return d


ESTIMATE_BOUNDS = "estimate"  # ``bounds: estimate``: the value bounds are estimated under DP at run time
BOUNDS_SHARE_SUFFIX = ".bounds"  # ``budget.split["<metric key>.bounds"]``: that estimation's share


class _Bounded(_MetricBase):
    """A metric with value bounds: declared (``bounds: [lo, hi]``) or estimated (``bounds: estimate``).

    ``bounds: estimate`` (issue 20 section 4) needs ``fallback_bounds: [lo, hi]``: PUBLIC bounds that the
    plan (``spec check``, ``plan``) predicts accuracy at before any estimation, and that the estimator
    anchors its public preference on (``dpops.analysis.estimate.quantile_choice``; a fallback lower bound
    >= 0 is kept, not estimated). In memory ``bounds`` holds the fallback until ``with_estimated_bounds``
    substitutes the estimate; the option is ``fallback_bounds is not None`` and the dumped form (hashed,
    embedded in manifests) says ``bounds: estimate`` again, so a dump parses back to the same spec."""

    column: str
    bounds: tuple[Number, Number]
    fallback_bounds: tuple[Number, Number] | None = None

    @model_validator(mode="before")
    @classmethod
    def _estimate_option(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        b, fb = data.get("bounds"), data.get("fallback_bounds")
        if isinstance(b, str):
            if b != ESTIMATE_BOUNDS:
                raise ValueError(f"bounds must be [lower, upper] or {ESTIMATE_BOUNDS!r}, got {b!r}")
            if fb is None:
                raise ValueError("bounds: estimate needs fallback_bounds: [lower, upper], the public bounds the plan "
                                 "predicts accuracy at before the estimation runs (and the estimator's anchor)")
            return {**data, "bounds": fb}
        if fb is not None:
            raise ValueError("fallback_bounds is only for bounds: estimate; with declared bounds remove it")
        return data

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        d: dict[str, Any] = handler(self)
        if self.fallback_bounds is not None:
            d["bounds"] = ESTIMATE_BOUNDS
        else:  # absent, not null: a spec with declared bounds keeps its hash and its manifests their form
            d.pop("fallback_bounds", None)
        return _drop_absent_contribution(d)

    @property
    def estimates_bounds(self) -> bool:
        """``bounds: estimate``: the value bounds are learned under DP at run time (charged)."""
        return self.fallback_bounds is not None

    @field_validator("bounds", "fallback_bounds")
    @classmethod
    def _bounds(cls, v: tuple[float, float] | None) -> tuple[float, float] | None:
        if v is None:
            return v
        lo, hi = check_bounds(v[0], v[1], "bounds")
        # Sensitivities, noise scales and rho are computed in doubles from the bounds: beyond 2**53 a
        # plan overflows or loses the unit step, and would fail after the budget is spent (issue 11 item 5).
        if max(abs(lo), abs(hi)) > MAX_ABS_BOUND:
            raise ValueError(f"bounds must lie within +-2**53 ({MAX_ABS_BOUND:.0f}); rescale the column (e.g. to "
                             "thousands) and its bounds")
        # The same at the other end (issue 25): bounds of magnitude ~1e-300 give a resolution grid and a
        # sigma whose square underflows to 0, and the plan crashed. A column on that scale is refused here,
        # before any reservation, like one beyond 2**53.
        if 0 < max(abs(lo), abs(hi)) < MIN_ABS_BOUND:
            raise ValueError(f"bounds [{lo!r}, {hi!r}] are below 2**-53 ({MIN_ABS_BOUND:.3g}) in magnitude; rescale "
                             "the column (e.g. to millionths) and its bounds")
        return lo, hi


class CountMetric(_MetricBase):
    type: Literal["count"]


class UnitCountMetric(_MetricBase):
    type: Literal["unit_count"]


class SumMetric(_Bounded):
    type: Literal["sum"]


class MeanMetric(_Bounded):
    type: Literal["mean"]


class VarianceMetric(_Bounded):
    type: Literal["variance"]


class QuantilesMetric(_Bounded):
    type: Literal["quantiles"]
    quantiles: list[Number] = Field(min_length=1)

    @field_validator("quantiles")
    @classmethod
    def _qs(cls, v: list[float]) -> list[float]:
        for q in v:
            if not (0 < q < 1):
                raise ValueError(f"each quantile must be strictly between 0 and 1, got {q!r}")
        if len(set(v)) != len(v):
            raise ValueError(f"quantiles has duplicates: {v}")
        return v

    def column_suffixes(self) -> list[str]:
        """``q50`` for 0.5, ``q90`` for 0.9, ``q999`` for 0.999: the output column is ``<key>_<suffix>``."""
        return ["q" + f"{float(q):.12f}".rstrip("0")[2:].ljust(2, "0") for q in self.quantiles]


class TopKMetric(_MetricBase):
    type: Literal["top_k"]
    column: str
    k: Integer = Field(ge=1)
    domain: list[Any] = Field(min_length=1)

    @model_validator(mode="after")
    def _domain(self) -> "TopKMetric":
        seen: set[Any] = set()
        for v in self.domain:
            if isinstance(v, (list, dict)) or v is None:
                raise ValueError(f"domain values must be scalars, got {v!r}")
            marker = (type(v).__name__, v)
            if marker in seen:
                raise ValueError(f"domain has a duplicate value {v!r}")
            seen.add(marker)
        if self.k > len(self.domain):
            raise ValueError(f"k={self.k} is larger than the domain ({len(self.domain)} values)")
        return self


Metric = Annotated[
    Union[CountMetric, UnitCountMetric, SumMetric, MeanMetric, VarianceMetric, QuantilesMetric, TopKMetric],
    Field(discriminator="type"),
]
METRIC_TYPES = ("count", "unit_count", "sum", "mean", "variance", "quantiles", "top_k")
NUMERIC_METRICS = ("sum", "mean", "variance", "quantiles")


class PostprocessSpec(_Strict):
    non_negative: bool = True
    integer_counts: bool = True
    clamp_means_to_bounds: bool = True
    suppress_below: Number | None = None

    @field_validator("suppress_below")
    @classmethod
    def _suppress(cls, v: float | None) -> float | None:
        if v is not None and (not math.isfinite(v) or v < 0):
            raise ValueError(f"suppress_below must be a finite number >= 0 or null, got {v!r}")
        return v


class OutputSpec(_Strict):
    """``root``: where staged and published outputs go.

    A relative path (below the spec's directory, the default ``out``), an absolute path, or a URI
    (``file://``, ``s3://``, ``gs://``, anything ``pyarrow.fs`` understands). An absolute path or a URI
    is accepted only under an entry of the operator's ``DPOPS_OUTPUT_ROOTS`` (``dpops.dataroots.
    check_output_root``, run by ``parse_spec``): a spec author must not be able to make a process that
    holds the noise key write next to another release's files or into a bucket the operator did not
    choose. The shape is checked here; the allow-list needs the environment and the spec's file name.
    """

    root: str = "out"

    @field_validator("root")
    @classmethod
    def _root(cls, v: str) -> str:
        from dpops.storage.location import Location, LocationError, is_uri

        if not v.strip():
            raise ValueError("output root is empty")
        if is_uri(v):
            try:
                Location.parse(v)
            except LocationError as exc:
                raise ValueError(f"output root: {exc}") from None
            return v
        if v.startswith("~") or re.match(r"^[A-Za-z]:", v) or "\\" in v:
            raise ValueError(f"output root {v!r} must be a relative path below the spec's directory, an absolute "
                             "path or a URI (s3://bucket/prefix)")
        if ".." in Path(v).parts:
            raise ValueError(f"output root {v!r} must not contain '..'")
        return v


# --------------------------------------------------------------------------- accuracy targets
#
# ``accuracy:`` declares what the release must achieve, so that ``dpops plan --solve`` can choose the
# epsilon split and ``spec check --require-targets`` can fail CI when the declared budget falls short.
# Targets are claims about public parameters only (the noise the plan draws), never about data: checking
# or solving them costs no privacy. They are left out of ``spec_hash`` (``canonical_document``): a target
# changes no mechanism, so editing one must not turn the next run into a new release version.


class ErrorTarget(_Strict):
    """|released - true| <= max_error (or max_relative_error * true) with probability >= confidence.

    ``at_units``: the partition size the claim is about, in units. ``rows_per_unit``: how many rows each of
    them has in the partition (default 1: the smallest partition of that size, where errors are largest;
    bounding keeps at most ``max_rows_per_unit_per_partition`` of them, so the prediction uses
    ``at_units * min(rows_per_unit, Linf)`` rows). ``at_value``: the true value a relative error is measured
    against; for count it defaults to that number of rows, for unit_count to ``at_units``.
    """

    kind: Literal["error"]
    metric: str
    max_error: Number | None = Field(default=None, gt=0)
    max_relative_error: Number | None = Field(default=None, gt=0)
    at_units: Integer = Field(default=1000, ge=1)
    rows_per_unit: Number = Field(default=1, ge=1)
    at_value: Number | None = None
    confidence: Number | None = Field(default=None, gt=0, lt=1)

    @model_validator(mode="after")
    def _one_bound(self) -> "ErrorTarget":
        if (self.max_error is None) == (self.max_relative_error is None):
            raise ValueError("give exactly one of max_error (absolute) and max_relative_error")
        if self.at_value is not None and (not math.isfinite(self.at_value) or self.at_value == 0):
            raise ValueError(f"at_value must be a finite non-zero number, got {self.at_value!r}")
        return self


class KeepTarget(_Strict):
    """Private partition selection keeps a partition of ``at_units`` units with probability >= min_probability."""

    kind: Literal["keep"]
    at_units: Integer = Field(ge=1)
    min_probability: Number = Field(gt=0, lt=1)


class RankTarget(_Strict):
    """A quantile's expected rank error is at most ``max_rank_error`` (a fraction of the partition's rows: ``at_units``
    units with ``rows_per_unit`` rows each, at most Linf of them kept)."""

    kind: Literal["rank_error"]
    metric: str
    max_rank_error: Number = Field(gt=0, lt=1)
    at_units: Integer = Field(default=1000, ge=1)
    rows_per_unit: Number = Field(default=1, ge=1)


class TopPickTarget(_Strict):
    """top_k returns the true top item first with probability >= min_probability when it leads by ``at_gap``."""

    kind: Literal["top_pick"]
    metric: str
    at_gap: Integer = Field(ge=0)
    min_probability: Number = Field(gt=0, lt=1)


AccuracyTarget = Annotated[Union[ErrorTarget, KeepTarget, RankTarget, TopPickTarget], Field(discriminator="kind")]
TARGET_KINDS = ("error", "keep", "rank_error", "top_pick")


class AccuracySpec(_Strict):
    """``accuracy: {confidence: 0.95, targets: [...]}`` (see docs/accuracy.md)."""

    confidence: Number = Field(default=0.95, gt=0, lt=1)
    targets: list[AccuracyTarget] = Field(min_length=1)


# --------------------------------------------------------------------------- tuning provenance
#
# ``tuning:`` says where the spec's bounds came from when ``dpops tune`` chose them (written by ``dpops spec
# apply-patch`` from the tune patch; see docs/accuracy.md). Tuning is not differentially private, so a choice
# made by looking at private data must be public (issue 20 section 3): every release of the spec carries the
# block into its manifest (``provenance.tuning``) and the report, and ``manifest verify --ledger`` checks the
# ledger's ``private_access`` entry it names. The block is provenance, not a parameter: it changes no mechanism
# and is left out of ``spec_hash`` like ``accuracy``. Statistics of the sample (its row count, the loss value)
# are not accepted here: they are exact functions of the data and a manifest never carries input statistics.


def private_tuning_statement(read_at: str) -> str:
    """The sentence every later release says when its bounds came from a look at private data."""
    return f"bounds chosen by looking at the private data on {read_at[:10]}"


def _utc_iso(v: str) -> str:
    try:
        t = datetime.fromisoformat(v.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{v!r} is not an ISO-8601 timestamp") from None
    if t.tzinfo is None or t.utcoffset() != timezone.utc.utcoffset(None):
        raise ValueError(f"{v!r} must be in UTC (end in Z or +00:00)")
    return v


UtcTimestamp = Annotated[str, AfterValidator(_utc_iso)]


class PublicTuningData(_Strict):
    """Tuned on a sample under the operator's public roots (``$DPOPS_PUBLIC_ROOTS``)."""

    source: Literal["public"]
    sample: str
    checked_at: UtcTimestamp


class PrivateTuningData(_Strict):
    """Tuned by looking at private data on purpose: the ledger's ``private_access`` entry that recorded it."""

    source: Literal["private"]
    scope: str
    fingerprint: str = Field(pattern=r"^hmac-sha256:[0-9a-f]{64}$")
    ledger_entry: Integer = Field(ge=1)
    read_at: UtcTimestamp
    statement: str | None = None

    @model_validator(mode="after")
    def _statement(self) -> "PrivateTuningData":
        want = private_tuning_statement(self.read_at)
        if self.statement is not None and self.statement != want:
            raise ValueError(f"statement must be {want!r} (it is derived from read_at; leave it out or copy it)")
        return self


TuningData = Annotated[Union[PublicTuningData, PrivateTuningData], Field(discriminator="source")]


class TuningSpec(_Strict):
    """``tuning: {candidate, loss, candidates, not_evaluated, data: {source: public|private, ...}}``."""

    candidate: str
    loss: str
    candidates: Integer = Field(ge=1)
    not_evaluated: list[str] = Field(default_factory=list)
    data: TuningData

    @property
    def statement(self) -> str:
        """What the manifest and the report say about where the bounds came from."""
        d = self.data
        if isinstance(d, PrivateTuningData):
            return private_tuning_statement(d.read_at)
        return f"bounds chosen by dpops tune on a public sample on {d.checked_at[:10]}"


# --------------------------------------------------------------------------- the spec


class ReleaseSpec(_Strict):
    name: str
    description: str = ""
    schedule: str | None = None
    # Orchestration, not privacy: whether the scheduler creates a run for every past schedule interval since the
    # deployment's start date (Airflow ``catchup``). None (the default): the deployment's ``DPOPS_CATCHUP``
    # (itself false by default: every run spends budget, so old intervals are released on purpose after
    # ``dpops plan``). ``true`` suits a release whose start date is the first day it must publish. Left out of
    # ``spec_hash`` (``canonical_document``): it changes no mechanism and no output.
    catchup: bool | None = None
    input: InputSpec
    privacy_unit: PrivacyUnitSpec
    budget: BudgetSpec
    contribution: ContributionSpec
    partitions: PartitionsSpec
    metrics: list[Metric] = Field(min_length=1)
    postprocess: PostprocessSpec = PostprocessSpec()
    output: OutputSpec = OutputSpec()
    accuracy: AccuracySpec | None = None
    tuning: TuningSpec | None = None
    # The private bound estimation (``dpops estimate``) this spec's bounds came from: its run id. Part of
    # the spec hash; the release is refused unless that run is a committed estimation of this release on
    # the same scope, and its manifest names it (``dependencies``) so verify recomputes both claims.
    estimated_from: str | None = None

    # Set by load_spec: where relative paths start, and the parsed public_file.
    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)
    _source: str = PrivateAttr(default="<spec>")
    _public_from_file: list[tuple[Any, ...]] | None = PrivateAttr(default=None)
    _public_publishable: bool = PrivateAttr(default=False)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(f"release name {v!r} must match {NAME_RE.pattern} (it is used in paths)")
        return v

    @field_validator("estimated_from")
    @classmethod
    def _estimated_from(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[0-9a-f]{32}", v):
            raise ValueError(f"estimated_from {v!r} must be the run id (32 hex digits) that dpops estimate printed")
        return v

    @field_validator("schedule")
    @classmethod
    def _schedule(cls, v: str | None) -> str | None:
        if v is None or v.startswith("@"):
            return v
        if len(v.split()) != 5:
            raise ValueError(f"schedule {v!r} must be a 5-field cron expression (or @daily, @hourly, ...)")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "ReleaseSpec":
        # Cross-section checks. The message starts with the field path because a
        # model-level error has no location of its own in pydantic.
        problems = _consistency_problems(self)
        if problems:
            raise ValueError("\n".join(f"{path}: {msg}" for path, msg in problems))
        return self

    # ---- derived views -------------------------------------------------------
    @property
    def metric_keys(self) -> list[str]:
        return [m.key for m in self.metrics]

    def metric(self, key: str) -> Any:
        for m in self.metrics:
            if m.key == key:
                return m
        raise KeyError(key)

    def metric_contribution(self, key: str) -> tuple[int, int]:
        """The (L0, Linf) metric ``key`` is bounded with: its ``contribution`` override merged onto the release's
        ``contribution``. The one owner of that merge (plan, pipeline, manifest and predictions read it here)."""
        c = self.contribution
        l0, linf = int(c.max_partitions_per_unit), int(c.max_rows_per_unit_per_partition)
        own = self.metric(key).contribution
        if own is None:
            return l0, linf
        return (l0 if own.max_partitions_per_unit is None else int(own.max_partitions_per_unit),
                linf if own.max_rows_per_unit_per_partition is None else int(own.max_rows_per_unit_per_partition))

    @property
    def has_metric_contributions(self) -> bool:
        """Some metric declares its own ``contribution`` bounds."""
        return any(m.contribution is not None for m in self.metrics)

    def split_weights(self) -> dict[str, float]:
        """Relative weight per metric key (and ``partition_selection`` when private); missing keys weigh 1."""
        given = self.budget.split or {}
        keys = self.metric_keys + ([] if self.partitions.is_public else [PARTITION_SELECTION_KEY])
        return {k: float(given.get(k, 1.0)) for k in keys}

    @property
    def estimated_metric_keys(self) -> list[str]:
        """Keys of the metrics declaring ``bounds: estimate`` (issue 20 section 4)."""
        return [m.key for m in self.metrics if isinstance(m, _Bounded) and m.estimates_bounds]

    @property
    def estimated_columns(self) -> list[str]:
        """The value columns whose bounds are estimated at run time (each once, in metric order)."""
        return list(dict.fromkeys(m.column for m in self.metrics if isinstance(m, _Bounded) and m.estimates_bounds))

    def estimation_epsilon(self) -> float:
        """The estimation's epsilon: ``budget.epsilon`` times the ``<key>.bounds`` weights over all weights.

        The interval's total charge is the declared ``budget.epsilon``: the release itself gets the rest
        (``release_part``). 0.0 for a spec without ``bounds: estimate``."""
        keys = self.estimated_metric_keys
        if not keys:
            return 0.0
        split = self.budget.split or {}
        shares = sum(float(split.get(k + BOUNDS_SHARE_SUFFIX, 0.0)) for k in keys)  # 0 on a release_part()
        total = sum(self.split_weights().values()) + shares
        return float(self.budget.epsilon) * shares / total

    def release_part(self) -> "ReleaseSpec":
        """The release without its estimation: ``budget.epsilon`` minus ``estimation_epsilon()`` and the
        ``.bounds`` shares removed from the split (the metrics keep their relative weights). The spec
        itself when nothing is estimated. Bounds stay the fallback until ``with_estimated_bounds``."""
        if not self.estimated_metric_keys or self.estimation_epsilon() == 0.0:  # idempotent
            return self
        split = {k: v for k, v in (self.budget.split or {}).items() if not k.endswith(BOUNDS_SHARE_SUFFIX)}
        budget = BudgetSpec.model_validate({**self.budget.model_dump(),
                                            "epsilon": float(self.budget.epsilon) - self.estimation_epsilon(),
                                            "split": split or None})
        new = self.model_copy(update={"budget": budget})
        new.__dict__.pop("spec_hash", None)  # cached from the whole budget
        return new

    def declared_value_bounds(self) -> dict[str, tuple[float, float]]:
        """Each value column of a bounded metric with its declared bounds (the first metric's per column).

        The one owner for tuning, estimation and their patches: a column whose bounds are ``estimate``
        has no declared bounds yet and is left out."""
        out: dict[str, tuple[float, float]] = {}
        for m in self.metrics:
            b = getattr(m, "bounds", None)
            col = getattr(m, "column", None)
            if b is not None and col is not None and str(col) not in out:
                out[str(col)] = (float(b[0]), float(b[1]))
        return out

    def with_estimated_bounds(self, run_id: str, bounds: dict[str, tuple[float, float]]) -> "ReleaseSpec":
        """The spec a release of ``bounds: estimate`` runs with: ``release_part()`` with each estimated
        column's bounds set to the estimation's result and ``estimated_from: run_id``: the same spec a
        ``dpops estimate`` patch gives, so the manifest, ``dependencies`` and verification are unchanged."""
        missing = [c for c in self.estimated_columns if c not in bounds]
        if missing:
            raise SpecError(f"{self.source}: estimation {run_id} has no bounds for column(s) {missing}")
        part = self.release_part()
        doc = part.model_dump(mode="json", exclude_none=True)
        for m in doc["metrics"]:
            if m.get("bounds") == ESTIMATE_BOUNDS:
                m["bounds"] = [float(x) for x in bounds[m["column"]]]
                m.pop("fallback_bounds", None)
        doc["estimated_from"] = run_id
        try:
            new = ReleaseSpec.model_validate(doc)
        except ValidationError as exc:
            raise SpecError(f"{self.source}: with the estimated bounds: " + "; ".join(_format_validation_error(exc))) \
                from None
        new._base_dir, new._source = self._base_dir, self._source
        new._public_from_file, new._public_publishable = self._public_from_file, self._public_publishable
        return new

    def with_budget(self, epsilon: float, split: dict[str, float] | None) -> "ReleaseSpec":
        """This spec with another ``budget.epsilon`` and ``budget.split`` (e.g. a split ``dpops plan --solve``
        found); everything else, including where relative paths start, is kept. The keys of ``split`` must
        be this spec's split keys, or the ``<key>.bounds`` share of a ``bounds: estimate`` metric."""
        if split is not None:
            allowed = set(self.split_weights()) | {k + BOUNDS_SHARE_SUFFIX for k in self.estimated_metric_keys}
            bad = sorted(set(split) - allowed)
            if bad:
                raise SpecError(f"{self.source}: budget.split keys {bad} are not metric keys; known: {sorted(allowed)}")
            # the bounds: estimate shares are kept (a solved split weighs the metrics, not the estimation)
            split = {**split, **{k: v for k, v in (self.budget.split or {}).items() if k.endswith(BOUNDS_SHARE_SUFFIX)
                                 and k not in split}}
        try:
            budget = BudgetSpec.model_validate({**self.budget.model_dump(), "epsilon": epsilon, "split": split})
        except ValidationError as exc:
            raise SpecError(f"{self.source}: budget: " + "; ".join(_format_validation_error(exc))) from None
        new = self.model_copy(update={"budget": budget})
        new.__dict__.pop("spec_hash", None)  # cached from the old budget
        return new

    def public_partitions(self) -> list[tuple[Any, ...]] | None:
        """The public partition keys as tuples (one value per partition column), or None when private."""
        if self.partitions.public is not None:
            return [_as_tuple(p) for p in self.partitions.public]
        if self.partitions.public_file is not None:
            if self._public_from_file is None:
                rows, publishable = _read_public_file(self, self.resolve_path(self.partitions.public_file))
                self._public_from_file, self._public_publishable = rows, publishable
            return list(self._public_from_file)
        return None

    @property
    def base_dir(self) -> Path:
        return self._base_dir

    @property
    def source(self) -> str:
        return self._source

    def resolve_path(self, p: str) -> "Location":
        """A spec path as a ``Location``: a URI as given, an absolute path, or relative to the spec's directory."""
        from dpops.storage.location import Location

        return Location.parse(p, base=Location.local(self._base_dir))

    @property
    def output_root(self) -> "Location":
        """``output.root`` as a ``Location`` (local path or object-store URI); see ``OutputSpec``."""
        return self.resolve_path(self.output.root)

    @property
    def public_file_publishable(self) -> bool:
        """The operator marked the public file's root publishable (``$DPOPS_PUBLIC_ROOTS_PUBLISHABLE``):
        its rows may appear in the spec document and the manifest. False without a public file."""
        if self.partitions.public_file is None:
            return False
        self.public_partitions()
        return self._public_publishable

    def canonical_document(self) -> dict[str, Any]:
        """The validated spec as hashed (``spec_hash``) and embedded in the manifest.

        A ``public_file`` adds ``public_file_content`` (its rows) only when the operator marked its root
        publishable; otherwise only ``public_file_count`` (how many partitions), and the rows enter the
        run's keyed input fingerprint instead (``dpops.inputs.input_fingerprint``): the manifest goes to
        reviewers outside the trusted boundary, and neither the rows nor a plain hash over them (the spec
        hash is one) may reach them unless the operator decided the list is publishable. The ``accuracy``
        targets and the ``tuning`` provenance are left out: neither changes a mechanism, so editing one is not a
        new release version (the manifest carries the provenance in ``provenance.tuning``); so is ``catchup``
        (when the scheduler runs, not what a run computes). ``estimated_from`` is kept when set: the release's
        bounds are those of that charged estimation."""
        doc = self.model_dump(mode="json", exclude={"accuracy", "tuning", "catchup"})
        if doc.get("estimated_from") is None:  # absent, not null: specs without it keep their hash
            doc.pop("estimated_from", None)
        if doc["budget"].get("accountant") is None:  # likewise: specs written before budget.accountant keep theirs
            doc["budget"].pop("accountant", None)
        if self.partitions.public_file is not None:
            rows = [list(p) for p in (self.public_partitions() or [])]
            if self._public_publishable:
                doc["partitions"]["public_file_content"] = rows
            else:
                doc["partitions"]["public_file_count"] = len(rows)
        return doc

    @cached_property
    def spec_hash(self) -> str:
        return hashlib.sha256(canonical_json(self.canonical_document()).encode()).hexdigest()


def _as_tuple(p: Any) -> tuple[Any, ...]:
    return tuple(p) if isinstance(p, (list, tuple)) else (p,)


def _value_matches(value: Any, ctype: str) -> bool:
    if ctype == "string":
        return isinstance(value, str)
    if ctype == "bool":
        return isinstance(value, bool)
    if ctype == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _time_column_problems(spec: ReleaseSpec) -> list[tuple[str, str]]:
    """``input.time_column`` must be a declared ``timestamp`` column, and only it may have that type.

    A timestamp as a partition, metric or unit column has no use in dpops and would need its own
    hashing and output types; it is refused rather than half supported.
    """
    out: list[tuple[str, str]] = []
    cols = spec.input.columns
    tc = spec.input.time_column
    if tc is not None:
        if tc not in cols:
            out.append(("input.time_column", f"column {tc!r} is not in input.columns; declare it as {tc}: timestamp"))
        elif cols[tc] != "timestamp":
            out.append(("input.time_column", f"column {tc!r} must be declared with type timestamp, not {cols[tc]}"))
    for name, ctype in cols.items():
        if ctype == "timestamp" and name != tc:
            out.append((f"input.columns.{name}", "type timestamp is only for the event-time column: set "
                        f"input.time_column: {name}, or declare it as string"))
    if tc is not None and (tc == spec.privacy_unit.column or tc in spec.partitions.columns
                           or any(getattr(m, "column", None) == tc for m in spec.metrics)):
        out.append(("input.time_column", f"column {tc!r} is the event time; it cannot also be the unit, a partition "
                    "or a metric column"))
    return out


def _consistency_problems(spec: ReleaseSpec) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    cols = spec.input.columns
    declared = f"declared input columns: {sorted(cols)}"

    unit = spec.privacy_unit
    out.extend(_time_column_problems(spec))
    out.extend(_schedule_period_problems(spec))
    if unit.column not in cols:
        out.append(("privacy_unit.column", f"column {unit.column!r} is not in input.columns ({declared})"))
    c = spec.contribution
    if unit.record_level and (c.max_partitions_per_unit != 1 or c.max_rows_per_unit_per_partition != 1):
        out.append((
            "privacy_unit.record_level",
            "record_level: true means each row is its own unit, so contribution.max_partitions_per_unit and "
            "max_rows_per_unit_per_partition must both be 1",
        ))

    b = spec.budget
    try:
        check_delta_for_population(b.delta, unit.population, "delta")
    except InvalidParameter as exc:
        out.append(("budget.delta", str(exc)))
    if b.noise == "gaussian" and b.delta == 0:
        out.append(("budget.delta", "gaussian noise needs delta > 0 (or use noise: laplace)"))
    if not spec.partitions.is_public and b.delta == 0:
        out.append(("budget.delta", "private partition selection needs delta > 0 (or list public partitions)"))

    for i, pcol in enumerate(spec.partitions.columns):
        if pcol not in cols:
            out.append((f"partitions.columns[{i}]", f"column {pcol!r} is not in input.columns ({declared})"))
        elif pcol == unit.column:
            out.append((f"partitions.columns[{i}]", "the privacy unit column cannot be a partition column"))

    ncols = len(spec.partitions.columns)
    if spec.partitions.public is not None:
        seen: set[tuple[Any, ...]] = set()
        for i, p in enumerate(spec.partitions.public):
            tup = _as_tuple(p)
            where = f"partitions.public[{i}]"
            if ncols > 1 and not isinstance(p, (list, tuple)):
                out.append((where, f"with {ncols} partition columns each entry must be a list of {ncols} values"))
                continue
            if len(tup) != ncols:
                out.append((where, f"has {len(tup)} values for {ncols} partition column(s)"))
                continue
            bad = False
            for v, pcol in zip(tup, spec.partitions.columns):
                ctype = cols.get(pcol)
                if ctype and not _value_matches(v, ctype):
                    out.append((where, f"value {v!r} is not of column {pcol!r}'s type {ctype} (quote strings in YAML)"))
                    bad = True
            if bad:
                continue
            marker = tuple((type(v).__name__, v) for v in tup)
            if marker in seen:
                out.append((where, f"duplicate public partition {p!r}: each partition may be listed once"))
            seen.add(marker)
    if spec.partitions.public_file is not None and ".." in Path(spec.partitions.public_file).parts:
        out.append(("partitions.public_file", "must not contain '..'"))

    keys: dict[str, int] = {}
    reserved = set(spec.partitions.columns)
    for i, m in enumerate(spec.metrics):
        where = f"metrics[{i}]"
        column = getattr(m, "column", None)
        if column is not None:
            if column not in cols:
                out.append((f"{where}.column", f"column {column!r} is not in input.columns ({declared})"))
            elif m.type in NUMERIC_METRICS and cols[column] not in NUMERIC_TYPES:
                out.append((f"{where}.column", f"{m.type} needs a numeric column (int or float); {column!r} is {cols[column]}"))
            elif column == unit.column:
                out.append((f"{where}.column", "a metric over the privacy unit column itself would publish unit ids"))
        if isinstance(m, TopKMetric) and column in cols:
            for j, v in enumerate(m.domain):
                if not _value_matches(v, cols[column]):
                    out.append((f"{where}.domain[{j}]", f"value {v!r} is not of column {column!r}'s type {cols[column]}"))
        key = m.key
        if not KEY_RE.match(key):
            out.append((where, f"metric key {key!r} is not a valid column name; give it a name: matching {KEY_RE.pattern}"))
        if key in keys:
            out.append((where, f"metric key {key!r} is already used by metrics[{keys[key]}]; give one a different name:"))
        elif key in reserved or key == PARTITION_SELECTION_KEY:
            out.append((where, f"metric key {key!r} collides with a partition column or a reserved word; set name:"))
        keys.setdefault(key, i)

    out.extend(_accuracy_problems(spec, keys))
    if spec.tuning is not None and isinstance(spec.tuning.data, PrivateTuningData) and \
            spec.tuning.data.scope != b.scope:
        out.append(("tuning.data.scope", f"the private read was recorded on scope {spec.tuning.data.scope!r}, but this "
                                         f"spec charges scope {b.scope!r}: tune the spec of this scope again"))
    out.extend(_estimate_option_problems(spec))
    out.extend(_metric_contribution_problems(spec))
    if b.split is not None:
        allowed = list(keys) + ([] if spec.partitions.is_public else [PARTITION_SELECTION_KEY])
        estimating = {m.key + BOUNDS_SHARE_SUFFIX for m in spec.metrics if isinstance(m, _Bounded) and m.estimates_bounds}
        for k in b.split:
            if k == PARTITION_SELECTION_KEY and spec.partitions.is_public:
                out.append((f"budget.split.{k}", "partitions are public: there is no partition selection to weigh"))
            elif k.endswith(BOUNDS_SHARE_SUFFIX) and k not in estimating:
                base = k[: -len(BOUNDS_SHARE_SUFFIX)]
                why = (f"metric {base!r} declares its bounds" if base in keys
                       else f"{base!r} is not a metric key (known keys: {list(keys)})")
                out.append((f"budget.split.{k}", f"a {BOUNDS_SHARE_SUFFIX!r} share is only for a metric with bounds: "
                                                 f"estimate, and {why}; remove the share or set that metric's "
                                                 "bounds: estimate"))
            elif k not in allowed and k not in estimating:
                out.append((f"budget.split.{k}", f"{k!r} is not a metric key; known keys: {allowed}"))
    return out


def _estimate_option_problems(spec: ReleaseSpec) -> list[tuple[str, str]]:
    """``bounds: estimate`` needs its own share in ``budget.split`` (``<metric key>.bounds``), keyed
    randomness-free spec fields that do not contradict it, and one source of bounds per column.

    Privacy reason: the estimation is a charged DP release of its own; its epsilon must be declared
    (public) in the spec, never taken implicitly from the release's. A column whose bounds are both
    declared and estimated would make the manifest's claim ambiguous (which bounds were used)."""
    out: list[tuple[str, str]] = []
    split = spec.budget.split or {}
    by_column: dict[str, set[bool]] = {}
    for i, m in enumerate(spec.metrics):
        if not isinstance(m, _Bounded):
            continue
        by_column.setdefault(m.column, set()).add(m.estimates_bounds)
        if m.estimates_bounds and (m.key + BOUNDS_SHARE_SUFFIX) not in split:
            out.append((f"metrics[{i}].bounds", f"bounds: estimate needs its own budget share: add budget.split."
                                                f"{m.key}{BOUNDS_SHARE_SUFFIX}: W (a weight, as the metrics' weights; "
                                                "the estimation gets epsilon * W / sum of all weights)"))
    for col, kinds in by_column.items():
        if len(kinds) > 1:
            out.append(("metrics", f"column {col!r} has metrics with declared bounds and with bounds: estimate; "
                                   "give every metric of one column the same kind of bounds"))
    if spec.estimated_from is not None and any(True in k for k in by_column.values()):
        out.append(("estimated_from", "a spec with bounds: estimate runs its own estimation at run time; remove "
                                      "estimated_from (it names an estimation whose bounds are already declared)"))
    return out


def refuse_metric_contributions(spec: ReleaseSpec, what: str, instead: str) -> None:
    """Raise SpecError when a spec with per-metric contribution bounds reaches a procedure (``what``) that
    models one bound set for the whole release (the private bound estimation, ``dpops tune``, the planted-bug
    audit): its answer would be about bounds some metrics do not use. Names the first such metric's field and
    ``instead`` (what to do)."""
    for i, m in enumerate(spec.metrics):
        if m.contribution is not None:
            raise SpecError(f"{spec.source}: metrics[{i}].contribution: {what} does not support per-metric "
                            f"contribution bounds (it models one bound set for the release); {instead}")


def _metric_contribution_problems(spec: ReleaseSpec) -> list[tuple[str, str]]:
    """``metrics[].contribution`` (per-metric bounds): what dpops makes correct, and an honest refusal otherwise.

    Privacy reasons: (1) a metric's L0 may not exceed the release's. The pipeline bounds every unit once at the
    release's L0 (and the largest Linf), then narrows that set for each metric by the SAME keyed priorities
    (``pipelines.bounding``), so a metric's partitions are a subset of the release's, and partition selection,
    which runs on the unit counts under the release's L0, never sees a partition that only a wider metric kept.
    (2) Record-level units contribute one row by definition: an override has nothing to bound. (3) The private
    bound estimation (``bounds: estimate``, ``dpops estimate``, ``estimated_from``) chooses one bound set for
    the whole release; it is not extended to per-metric bounds, so the combination is refused rather than
    estimated for bounds the metric does not use."""
    out: list[tuple[str, str]] = []
    c = spec.contribution
    estimating = any(isinstance(m, _Bounded) and m.estimates_bounds for m in spec.metrics)
    for i, m in enumerate(spec.metrics):
        own = m.contribution
        if own is None:
            continue
        where = f"metrics[{i}].contribution"
        if spec.privacy_unit.record_level:
            out.append((where, "record_level: true means each row is its own unit (one row, one partition): remove "
                               "the metric's contribution bounds"))
            continue
        if own.max_partitions_per_unit is not None and own.max_partitions_per_unit > c.max_partitions_per_unit:
            out.append((f"{where}.max_partitions_per_unit",
                        f"{own.max_partitions_per_unit} exceeds the release's contribution.max_partitions_per_unit "
                        f"({c.max_partitions_per_unit}): a metric may only narrow the release's L0 (partition "
                        "selection and the first bound use it); raise contribution.max_partitions_per_unit and give "
                        "the other metrics their own lower L0"))
        if estimating:
            out.append((where, "per-metric contribution bounds cannot be combined with bounds: estimate (the "
                               "estimation chooses one bound set for the release); declare the value bounds, or "
                               "remove the metric's contribution"))
        if spec.estimated_from is not None:
            out.append((where, "per-metric contribution bounds cannot be combined with estimated_from (the "
                               "estimation's bounds are the release's): remove one of them"))
    return out


_TARGET_METRIC_TYPES = {"error": ("count", "unit_count", "sum", "mean", "variance"), "rank_error": ("quantiles",),
                        "top_pick": ("top_k",)}


def _accuracy_problems(spec: ReleaseSpec, keys: dict[str, int]) -> list[tuple[str, str]]:
    """Each target names a metric of a type it applies to; keep targets need private partitions."""
    if spec.accuracy is None:
        return []
    out: list[tuple[str, str]] = []
    types = {m.key: m.type for m in spec.metrics}
    for i, t in enumerate(spec.accuracy.targets):
        where = f"accuracy.targets[{i}]"
        if isinstance(t, KeepTarget):
            if spec.partitions.is_public:
                out.append((where, "a keep target needs private partition selection (partitions.private); "
                            "public partitions are always released"))
            continue
        if t.metric not in keys:
            out.append((f"{where}.metric", f"{t.metric!r} is not a metric key; known keys: {list(keys)}"))
            continue
        allowed = _TARGET_METRIC_TYPES[t.kind]
        if types[t.metric] not in allowed:
            out.append((f"{where}.kind", f"a {t.kind} target applies to {', '.join(allowed)} metrics; "
                        f"{t.metric!r} is {types[t.metric]}"))
        elif (isinstance(t, ErrorTarget) and t.max_relative_error is not None and t.at_value is None
              and types[t.metric] in ("sum", "mean", "variance")):
            out.append((f"{where}.at_value", f"a relative error of a {types[t.metric]} needs the true value it is "
                        "relative to: set at_value"))
    return out


# --------------------------------------------------------------------------- intervals, periods, schedules
#
# Period buckets compose in parallel only if releases over different periods read disjoint rows
# (semantics.md section 4). dpops proves that by the data path, never by a file name:
#   1. a spec whose unit is period-scoped releases exactly one period per run (``interval_problems``);
#   2. a bucketed scope refuses a spec without ``input.time_column`` (``dpops.release``);
#   3. the pipeline keeps only rows whose event time lies in [start, end) (``pipelines.io``), a
#      per-row filter on public bounds, so the filter itself reveals nothing.
# Then one run per period reads only that period's rows, whatever file the template resolves to.

PERIOD_WORDS = {"day": "UTC day", "week": "ISO week (Monday 00:00 UTC to the next Monday)",
                "month": "UTC calendar month"}


def period_bounds(period: str, t: datetime) -> tuple[datetime, datetime]:
    """The period (``day``, ISO ``week``, ``month``, UTC) containing instant ``t``: [start, end)."""
    from datetime import timedelta

    t = t.astimezone(timezone.utc)
    day = datetime(t.year, t.month, t.day, tzinfo=timezone.utc)
    if period == "day":
        return day, day + timedelta(days=1)
    if period == "week":
        start = day - timedelta(days=day.weekday())
        return start, start + timedelta(days=7)
    if period == "month":
        start = day.replace(day=1)
        end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
        return start, end
    raise ValueError(f"unknown period {period!r}")


def _iso_z(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def schedule_bounds(schedule: str | None, t: datetime) -> tuple[datetime, datetime] | None:
    """The schedule interval [fire, next fire) containing ``t`` (UTC), or None for no cron schedule."""
    if not schedule:
        return None
    from datetime import timedelta

    from croniter import croniter
    from croniter.croniter import CroniterError

    t = t.astimezone(timezone.utc)
    try:
        start = croniter(schedule, t + timedelta(microseconds=1)).get_prev(datetime)
        end = croniter(schedule, start).get_next(datetime)
    except (CroniterError, ValueError, KeyError):
        return None  # @once, @continuous...: no recurring intervals to align with
    return start.astimezone(timezone.utc), end.astimezone(timezone.utc)


def aligned_bounds(spec: "ReleaseSpec", t: datetime) -> tuple[datetime, datetime] | None:
    """The one releasable interval of ``spec`` containing ``t``: its unit period, else its schedule
    interval; None when the spec has neither (then only an explicit START/END names an interval)."""
    if spec.privacy_unit.period is not None:
        return period_bounds(spec.privacy_unit.period, t)
    return schedule_bounds(spec.schedule, t)


def one_period_interval(spec: "ReleaseSpec", start: datetime) -> tuple[datetime, datetime]:
    """``--interval 2024-01-03``: the period (or schedule interval) of ``spec`` that starts at ``start``.

    The instant must be the interval's start, not any instant inside it: a Wednesday given for a weekly
    release is refused with the week that contains it, rather than silently releasing another range.
    """
    from dpops.errors import InvalidParameter

    bounds = aligned_bounds(spec, start)
    if bounds is None:
        raise InvalidParameter(f"{spec.source}: --interval {_iso_z(start)} names one period, but the spec has "
                               "neither privacy_unit.period nor a cron schedule; give START/END")
    if bounds[0] != start.astimezone(timezone.utc):
        raise InvalidParameter(f"{spec.source}: --interval {_iso_z(start)} is not the start of a period of this "
                               f"spec; the one containing it is --interval {_iso_z(bounds[0])}/{_iso_z(bounds[1])}")
    return bounds


def interval_problems(spec: "ReleaseSpec", start: datetime, end: datetime, spec_path: str | None = None) -> list[str]:
    """Why [start, end) is not a releasable interval of ``spec`` (empty: it is).

    - A period-scoped unit (``privacy_unit.period``) is released exactly one period per run: a
      run over two days charged to two day buckets would read both days' rows in one mechanism,
      and a run over half a day would let two runs read the same day twice.
    - With a ``schedule``, the interval is one schedule interval [fire time, next fire time), so
      that manual, backfilled and Airflow runs of the same data are the same run key.
    The message names the aligned interval containing ``start`` and the exact command to release it.
    """
    out: list[str] = []
    where = spec_path or spec.source
    fix: tuple[datetime, datetime] | None = None
    period = spec.privacy_unit.period
    if period is not None:
        ps, pe = period_bounds(period, start)
        if (start, end) != (ps, pe):
            out.append(f"interval {_iso_z(start)}/{_iso_z(end)} is not exactly one {PERIOD_WORDS[period]}, "
                       f"but privacy_unit.period is {period}: each run releases one whole {period}")
            fix = (ps, pe)
    sched = schedule_bounds(spec.schedule, start)
    if sched is not None and (start, end) != sched:
        out.append(f"interval {_iso_z(start)}/{_iso_z(end)} is not an interval of schedule {spec.schedule!r} "
                   f"(it starts at a fire time and ends at the next one)")
        fix = fix or sched
    if out and fix is not None:
        out.append(f"to release the {period or 'interval'} containing {_iso_z(start)} run: dpops release run "
                   f"{where} --interval {_iso_z(fix[0])}/{_iso_z(fix[1])}")
    return out


def _schedule_period_problems(spec: "ReleaseSpec") -> list[tuple[str, str]]:
    """A schedule whose intervals are not the unit's periods could never release anything."""
    period = spec.privacy_unit.period
    if period is None or not spec.schedule:
        return []
    probe = datetime(2024, 1, 10, 12, tzinfo=timezone.utc)
    sched = schedule_bounds(spec.schedule, probe)
    if sched is None:
        return []
    if sched != period_bounds(period, sched[0]):
        return [("schedule", f"schedule {spec.schedule!r} runs over {_iso_z(sched[0])}/{_iso_z(sched[1])}, which is "
                 f"not one {PERIOD_WORDS[period]} (privacy_unit.period: {period}); use a schedule whose intervals "
                 f"are whole periods (e.g. '0 0 * * *' for day, '0 0 * * 1' for week, '0 0 1 * *' for month)")]
    return []


# --------------------------------------------------------------------------- loading


class _SpecLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases (billion-laughs) and duplicate keys (silent overrides)."""

    def compose_node(self, parent, index):  # type: ignore[override]
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.constructor.ConstructorError(
                None, None, "YAML aliases (*name) are not allowed in release specs: write values out", event.start_mark
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):  # type: ignore[override]
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _loc_to_path(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    prev: Any = None
    for i, item in enumerate(loc):
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(prev, int) and item in METRIC_TYPES and i >= 2 and loc[i - 2] == "metrics":
            pass  # the discriminated union's tag: noise in a path
        elif isinstance(prev, int) and item in TARGET_KINDS and i >= 2 and loc[i - 2] == "targets":
            pass  # the same for accuracy targets
        elif prev == "data" and item in ("public", "private") and i >= 2 and loc[i - 2] == "tuning":
            pass  # and for the tuning provenance's data source
        elif str(item).startswith(("function-", "tagged-union")):
            pass  # pydantic's validator wrappers, not keys of the YAML
        else:
            parts.append(("." if parts else "") + str(item))
        prev = item
    return "".join(parts)


def _spec_keys(model: type[BaseModel] | None = None, seen: set[type[BaseModel]] | None = None) -> set[str]:
    """Every key a release spec may hold, at any depth (the "did you mean" candidates)."""
    import typing

    model = model or ReleaseSpec
    seen = seen if seen is not None else set()
    seen.add(model)
    keys: set[str] = set()

    def walk(t: Any) -> None:
        if isinstance(t, type) and issubclass(t, BaseModel) and t not in seen:
            keys.update(_spec_keys(t, seen))
        for arg in typing.get_args(t):
            walk(arg)

    for name, field in model.model_fields.items():
        keys.add(field.alias or name)
        walk(field.annotation)
    return keys


def did_you_mean(word: Any, candidates: Any) -> str:
    """``; did you mean 'max_partitions_per_unit'?`` for a misspelt word, else empty. Only a hint: a typo in a
    key or a budget scope must be fixed by the author, never guessed, so the spec is still refused."""
    import difflib

    close = difflib.get_close_matches(str(word), sorted(map(str, candidates)), n=1, cutoff=0.75)
    return f"; did you mean {close[0]!r}?" if close else ""


def _format_validation_error(exc: ValidationError) -> list[str]:
    lines = []
    for err in exc.errors():
        msg = err.get("msg", "")
        msg = re.sub(r"^(Value error|Assertion failed), ", "", msg)
        loc = tuple(err.get("loc", ()))
        path = _loc_to_path(loc)
        last = path.rsplit(".", 1)[-1]
        if last and msg.startswith(f"{last}: "):  # the path names the field already: no "bounds: bounds: ..."
            msg = msg[len(last) + 2:]
        if err.get("type") == "extra_forbidden":
            msg = ("unknown key" + (did_you_mean(loc[-1], _spec_keys()) if loc else "")
                   + " (see examples/daily_purchases.yaml for every key)")
        elif err.get("type") == "missing":
            msg = "required key is missing"
        elif err.get("type") == "union_tag_invalid":
            msg = f"unknown metric type {err.get('input', {}).get('type')!r}; known: {list(METRIC_TYPES)}" \
                if isinstance(err.get("input"), dict) else msg
        lines.extend(f"{path}: {m}" if path else m for m in msg.split("\n"))
    return lines


def parse_spec(data: Any, source: str = "<spec>", base_dir: str | Path | None = None) -> ReleaseSpec:
    """Validate an already-parsed document; errors become one ``SpecError`` listing every problem."""
    if not isinstance(data, dict):
        raise SpecError(f"{source}: a release spec must be a YAML mapping, got {type(data).__name__}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # validation warnings (delta above 1e-5) are re-emitted below once
            spec = ReleaseSpec.model_validate(data)
    except ValidationError as exc:
        lines = _format_validation_error(exc)
        raise SpecError("\n".join(f"{source}: {line}" for line in lines)) from None
    spec._base_dir = Path(base_dir) if base_dir is not None else Path.cwd()
    spec._source = source
    from dpops.dataroots import check_output_root
    from dpops.storage.location import LocationError

    try:
        root = spec.output_root
    except LocationError as exc:
        raise SpecError(f"{source}: output.root ({spec.output.root}): {exc}") from None
    # the operator's allow-list, at load (DAG parse, spec check, prepare before reserve)
    check_output_root(spec.output.root, root, source=source)
    if spec.budget.delta > 1e-5:
        warnings.warn(f"{source}: budget.delta={spec.budget.delta!r} is above 1e-5; a delta this large is rarely justified",
                      stacklevel=2)
    if spec.partitions.public_file is not None:
        spec.public_partitions()  # read and check it now, not in the middle of a run
    return spec


def load_spec(path: str | os.PathLike[str]) -> ReleaseSpec:
    """Read, parse and validate a release spec file. Any problem is a ``SpecError`` naming the file and field."""
    p = Path(path)
    return parse_spec(read_spec_document(p), source=p.name, base_dir=p.resolve().parent)


def read_spec_document(path: str | os.PathLike[str]) -> Any:
    """The spec file's YAML document, not yet validated (size-limited, UTF-8, duplicate keys refused)."""
    p = Path(path)
    label = p.name
    try:
        size = p.stat().st_size
    except OSError as exc:
        raise SpecError(f"{p}: cannot read the release spec: {exc.strerror or exc}") from None
    if size > MAX_SPEC_BYTES:
        raise SpecError(f"{label}: file is {size} bytes; a release spec is limited to {MAX_SPEC_BYTES} bytes")
    try:
        with open(p, "rb") as fh:
            raw = fh.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise SpecError(f"{p}: cannot read the release spec: {exc.strerror or exc}") from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(f"{label}: file exceeds {MAX_SPEC_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"{label}: not UTF-8 text (first bad byte at offset {exc.start})") from None
    try:
        data = yaml.load(text, Loader=_SpecLoader)  # noqa: S506 - _SpecLoader is a SafeLoader
    except yaml.YAMLError as exc:
        raise SpecError(f"{label}: invalid YAML{_yaml_where(exc)}") from None
    return data


def check_spec_paths(spec: ReleaseSpec, key_path: str | os.PathLike[str] | None = None) -> None:
    """``dpops spec check``: the spec's files under their roots and away from the key, for today's interval.

    ``input.path`` (under the data roots) is a template, so this checks it formatted with today's date;
    ``release run`` checks the actual files of its interval again (after glob expansion) before anything
    is reserved. ``partitions.public_file`` must be under the public roots (``dpops.dataroots``)."""
    from datetime import timedelta

    from dpops.dataroots import check_data_path, check_public_path

    today = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    formatted = spec.input.path.format(start=today, end=today + timedelta(days=1))
    problems: list[str] = []  # both files checked, both problems reported at once
    try:
        check_data_path(spec.resolve_path(formatted), "input.path", source=spec.source, spec_dir=spec.base_dir,
                        key_path=key_path)
    except SpecError as exc:
        problems.append(str(exc))
    if spec.partitions.public_file is not None:
        try:
            check_public_path(spec.resolve_path(spec.partitions.public_file), "partitions.public_file",
                              source=spec.source, spec_dir=spec.base_dir, key_path=key_path)
        except SpecError as exc:
            problems.append(str(exc))
    if problems:
        raise SpecError("\n".join(problems))


def check_spec_scope(spec: ReleaseSpec, scope_names: Any) -> None:
    """``dpops spec check`` with a reachable ledger: ``budget.scope`` must name one of its scopes.

    A misspelt scope is otherwise found only at the first ``release run`` (refused before any charge,
    but a scheduled DAG then fails every day until someone reads the log)."""
    names = sorted(map(str, scope_names))
    if spec.budget.scope not in names:
        raise SpecError(f"{spec.source}: budget.scope: no scope {spec.budget.scope!r} in the ledger"
                        f"{did_you_mean(spec.budget.scope, names)} (scopes: {', '.join(names) or 'none'}; "
                        "`dpops ledger scope show` lists them, `dpops ledger scope create` makes one)")


def _yaml_where(exc: Exception) -> str:
    """The parser's complaint, line and column, without the snippet of the file PyYAML adds: a spec path may
    be a symlink to a secret, and the error must not print the file's lines."""
    mark = getattr(exc, "problem_mark", None)
    problem = str(getattr(exc, "problem", "") or "")
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f": {problem or 'cannot parse'}{where}"


def _read_public_file(spec: ReleaseSpec, path: "Location") -> tuple[list[tuple[Any, ...]], bool]:
    """CSV with a header naming the partition columns; values converted to the declared column types.
    Returns the rows and whether the operator marked the file publishable."""
    where = f"{spec.source}: partitions.public_file ({path})"
    # The path must resolve under an operator's public root, outside every data root and away from the noise
    # key (dpops.dataroots, issue 19 item 6), and no error below repeats the file's content: a spec author
    # could otherwise point it at a secret or another release's private input and read it back.
    # The bytes come from the very file that passed the check (read_public_file: one open, the descriptor's
    # own path checked), so a symlink flipped between check and read cannot swap in a private file.
    from dpops.dataroots import read_public_file

    try:
        raw, checked = read_public_file(path, "partitions.public_file", source=spec.source, spec_dir=spec.base_dir,
                                        limit=MAX_PUBLIC_FILE_BYTES)
        publishable = checked.publishable
        if raw is None:
            raise SpecError(f"{where}: larger than {MAX_PUBLIC_FILE_BYTES} bytes")
        rows = list(csv.reader(io.StringIO(raw.decode("utf-8"), newline="")))
    except OSError as exc:
        raise SpecError(f"{where}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise SpecError(f"{where}: not UTF-8 text") from None
    if not rows:
        raise SpecError(f"{where}: empty file; the first line must name the partition columns")
    header = [h.strip() for h in rows[0]]
    want = spec.partitions.columns
    if header != want:
        raise SpecError(f"{where}: the header line (line 1) must be exactly the partition columns {want}, "
                        "comma-separated; fix the file's first line")
    types = [spec.input.columns[c] for c in want]
    out: list[tuple[Any, ...]] = []
    seen: set[tuple[Any, ...]] = set()
    for lineno, row in enumerate(rows[1:], start=2):
        if not row:
            continue
        if len(row) != len(want):
            raise SpecError(f"{where}: line {lineno} has {len(row)} values, expected {len(want)}")
        try:
            tup = tuple(_convert(v, t) for v, t in zip(row, types))
        except ValueError:
            bad = next(c for c, v, t in zip(want, row, types) if not _converts(v, t))
            raise SpecError(f"{where}: line {lineno}: the value of column {bad!r} is not a valid "
                            f"{spec.input.columns[bad]} (input.columns); fix that line") from None
        if tup in seen:
            raise SpecError(f"{where}: line {lineno}: duplicate partition (same values as an earlier line); "
                            "remove the line")
        seen.add(tup)
        out.append(tup)
    if not out:
        raise SpecError(f"{where}: lists no partitions")
    return out, publishable


def _converts(v: str, ctype: str) -> bool:
    try:
        _convert(v, ctype)
    except ValueError:
        return False
    return True


def _convert(v: str, ctype: str) -> Any:
    if ctype == "string":
        return v
    if ctype == "int":
        return int(v)
    if ctype == "float":
        f = float(v)
        if not math.isfinite(f):
            raise ValueError("value is not finite")
        return f
    if v.strip().lower() in ("true", "1"):
        return True
    if v.strip().lower() in ("false", "0"):
        return False
    raise ValueError("value is not a boolean")


__all__ = [
    "ReleaseSpec", "InputSpec", "PrivacyUnitSpec", "BudgetSpec", "ContributionSpec", "PartitionsSpec",
    "PrivatePartitionsSpec", "CountMetric", "UnitCountMetric", "SumMetric", "MeanMetric", "VarianceMetric",
    "QuantilesMetric", "TopKMetric", "PostprocessSpec", "OutputSpec", "AccuracySpec", "ErrorTarget", "KeepTarget",
    "RankTarget", "TopPickTarget", "TARGET_KINDS", "METRIC_TYPES", "PARTITION_SELECTION_KEY",
    "load_spec", "parse_spec", "interval_problems", "period_bounds", "schedule_bounds", "check_spec_paths",
]
