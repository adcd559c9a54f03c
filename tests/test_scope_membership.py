"""Issue 19, property "the unit definition is everything that decides membership".

Every field of the spec models that could change which rows a release reads, or which unit or
bucket a row belongs to, is classified here, in one table:

- **pinned by the scope**: the scope records it and a release that differs is refused before any
  reservation. Each such mutation is checked for real below, through ``dpops release run``, on a
  day-bucketed scope: exit 3, "nothing was reserved", the ledger unchanged.
- **cannot change the scope's claim**, with the reason written in the table (``docs/decisions.md``,
  "What decides membership", holds the longer argument). Each such mutation is also checked to be
  admitted by the scope check, so the table cannot claim a refusal that does not happen.

``test_every_spec_field_is_classified`` iterates the pydantic models' fields: a field added to any of
them without an entry here fails the suite, so the next field is decided on purpose, not by default.
The one reason that rests on the reader's behaviour (a unit column's declared type only ever merges
stored values, never splits one) is checked by a Hypothesis property against the real reader.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from fuzz_support import examples

from dpops import spec as spec_models
from dpops.cli.main import main
from dpops.ledger import ScopeDefinition, TimeRule, open_ledger
from dpops.noise.randomness import NoiseKey
from dpops.release import unit_definition_mismatches
from dpops.spec import load_spec

Doc = dict[str, Any]
DAY = "2024-01-01/2024-01-02"


@dataclass(frozen=True)
class Mutation:
    """A change to the base spec document, and a phrase the refusal must contain (pinned mutations)."""

    what: str
    apply: Callable[[Doc], None]
    needle: str = ""


@dataclass(frozen=True)
class Claim:
    """How one spec field relates to the scope's claim: the mutations the scope refuses (``pinned``), and
    for every other way the field can change, why the scope's claim still holds (``reason``) with
    mutations that are admitted (``admitted``)."""

    pinned: tuple[Mutation, ...] = ()
    reason: str = ""
    admitted: tuple[Mutation, ...] = ()


def _set(path: str, value: Any) -> Callable[[Doc], None]:
    def apply(doc: Doc) -> None:
        *parents, last = path.split(".")
        node = doc
        for p in parents:
            node = node[p]
        node[last] = value
    return apply


def _time_column(col: str) -> Callable[[Doc], None]:
    def apply(doc: Doc) -> None:
        doc["input"]["columns"] = {k: v for k, v in doc["input"]["columns"].items() if v != "timestamp"}
        doc["input"]["columns"][col] = "timestamp"
        doc["input"]["time_column"] = col
    return apply


def _no_time_column(doc: Doc) -> None:
    del doc["input"]["columns"]["ts"]
    doc["input"]["time_column"] = None


def _record_level(doc: Doc) -> None:
    doc["privacy_unit"]["record_level"] = True
    doc["contribution"] = {"max_partitions_per_unit": 1, "max_rows_per_unit_per_partition": 1}


def _csv(doc: Doc) -> None:
    doc["input"]["format"] = "csv"
    doc["input"]["path"] = "data/all.csv"


def _private_partitions(doc: Doc) -> None:
    doc["partitions"] = {"columns": ["region"], "private": {"strategy": "truncated_geometric"}}
    doc["budget"]["delta"] = 1e-7


def _category_partitions(doc: Doc) -> None:
    doc["input"]["columns"]["category"] = "string"
    doc["partitions"] = {"columns": ["category"], "public": ["a", "b"]}


NOT_READ = "does not decide which rows are read, nor any row's unit or period"

# --------------------------------------------------------------------------- the table
CLAIMS: dict[str, Claim] = {
    # ---- ReleaseSpec (top level); its sections are classified field by field below
    "name": Claim(reason=f"the release's name {NOT_READ}; every release on the scope composes whatever its name",
                  admitted=(Mutation("another name", _set("name", "renamed")),)),
    "description": Claim(reason=f"free text; it {NOT_READ}",
                         admitted=(Mutation("another description", _set("description", "other words")),)),
    "schedule": Claim(
        reason="decides which intervals the DAG runs, not which bucket a row is in: the interval of every run must "
               "be exactly one period of the spec (interval_problems, refused before reservation), its buckets are "
               "derived from the interval by the ledger (bucket_labels), and each row is then placed by the pinned "
               "time rule",
        admitted=(Mutation("a daily cron", _set("schedule", "0 0 * * *")),)),
    "input": Claim(reason="a section: classified field by field (input.*)"),
    "privacy_unit": Claim(reason="a section: classified field by field (privacy_unit.*)"),
    "budget": Claim(reason="a section: classified field by field (budget.*)"),
    "contribution": Claim(reason="a section: classified field by field (contribution.*)"),
    "partitions": Claim(reason="a section: classified field by field (partitions.*)"),
    "metrics": Claim(reason="a list of metrics: classified field by field (metrics[].*)"),
    "postprocess": Claim(reason="a section: classified field by field (postprocess.*)"),
    "output": Claim(reason="a section: classified field by field (output.*)"),
    "accuracy": Claim(reason=f"declared accuracy targets: predictions over public parameters, outside spec_hash; "
                             f"they change no mechanism and {NOT_READ}"),
    "tuning": Claim(reason=f"provenance of the bounds (which dpops tune run chose them, and the ledger entry of a "
                           f"private read), outside spec_hash; it changes no mechanism and {NOT_READ}",
                    admitted=(Mutation("a public tuning block", _set("tuning", {
                        "candidate": "L0=1 Linf=5", "loss": "mean_relative_rmse", "candidates": 4,
                        "data": {"source": "public", "sample": "/public/s.parquet",
                                 "checked_at": "2024-01-01T00:00:00+00:00"}})),
                              Mutation("a private tuning block on the scope", _set("tuning", {
                                  "candidate": "L0=1 Linf=5", "loss": "targets", "candidates": 4,
                                  "data": {"source": "private", "scope": "orders", "fingerprint": "hmac-sha256:" + "0" * 64,
                                           "ledger_entry": 7, "read_at": "2024-01-01T00:00:00.5+00:00"}})))),
    "catchup": Claim(reason=f"whether the scheduler runs the intervals missed since the start date; it decides when "
                            f"runs happen, not what one computes (outside spec_hash), and {NOT_READ}",
                     admitted=(Mutation("catch up", _set("catchup", True)), Mutation("no catchup", _set("catchup", False)))),
    "estimated_from": Claim(reason=f"names the committed estimation run whose private bounds the spec's bounds are "
                                   f"(refused before reservation unless that run is a committed estimation on the same "
                                   f"scope); the bounds themselves are classified under contribution.* and metrics[].*, "
                                   f"and the name {NOT_READ}"),
    # ---- InputSpec
    "input.path": Claim(
        reason="which files are read: the scope's population question, not a bucket question. Per definition the "
               "time filter keeps only rows whose pinned time column lies in the run's period, so a row counts in "
               "one bucket whatever files hold it, and two releases reading different files in the same bucket "
               "are composed sequentially in that bucket (no double spend). That another source's column of the "
               "same name means the same instant is the scope owner's declaration (docs/decisions.md)",
        admitted=(Mutation("another file", _set("input.path", "data/other.parquet")),)),
    "input.format": Claim(
        reason="how the stored bytes are decoded; the pinned time rule (dpops.time-filter/1) maps a stored instant to "
               "the same UTC period in both formats (naive = UTC in Parquet and in CSV text), and a unit column's "
               "type can only merge stored ids, never split one (see input.columns)",
        admitted=(Mutation("CSV", _csv),)),
    "input.columns": Claim(
        pinned=(Mutation("the time column declared string", _set("input.columns.ts", "string"),
                         "must be declared with type timestamp"),),
        reason="the time column's type is pinned (TimeRule.type; timestamp is the only type a time column can have). "
               "Any other column's declared type maps each stored cell to a value by a per-cell function (checked "
               "by test_a_unit_id_is_a_function_of_its_stored_cell): a unit id can merge stored ids (\"007\" and "
               "\"7\" as int), which only ever removes contributions, and never splits one stored id into two units; "
               "a cell that does not convert drops its row, which also only removes contributions",
        admitted=(Mutation("the unit column declared int", _set("input.columns.user_id", "int")),)),
    "input.time_column": Claim(
        pinned=(Mutation("another time column", _time_column("shipped_at"), "differs from the time rule"),
                Mutation("no time column", _no_time_column, "declare the event-time column"))),
    # ---- PrivacyUnitSpec
    "privacy_unit.column": Claim(
        pinned=(Mutation("another unit column", _set("privacy_unit.column", "account_id"),
                         "privacy_unit.column 'account_id' differs from scope 'orders'"),)),
    "privacy_unit.description": Claim(reason=f"the unit in words (the scope's own words are what the manifest shows); "
                                             f"it {NOT_READ}",
                                      admitted=(Mutation("other words", _set("privacy_unit.description", "x")),)),
    "privacy_unit.adjacency": Claim(
        pinned=(Mutation("replace", _set("privacy_unit.adjacency", "replace"), "privacy_unit.adjacency 'replace'"),)),
    "privacy_unit.record_level": Claim(
        pinned=(Mutation("record level", _record_level, "privacy_unit.record_level is true"),)),
    "privacy_unit.period": Claim(
        pinned=(Mutation("no period", _set("privacy_unit.period", None), "set privacy_unit.period: day"),)),
    "privacy_unit.population": Claim(
        reason="the declared number of units, used only to refuse delta >= 1/n; it reads no row",
        admitted=(Mutation("a population", _set("privacy_unit.population", 1000)),)),
    # ---- BudgetSpec
    "budget.scope": Claim(reason="which scope is charged: the claim checked is that scope's, with its own definition "
                                 "(a release on another scope is checked against that one)"),
    "budget.epsilon": Claim(reason="the charge itself, composed by the scope's accountant against the cap",
                            admitted=(Mutation("more epsilon", _set("budget.epsilon", 0.7)),)),
    "budget.delta": Claim(reason="the charge itself, composed by the scope's accountant against the cap",
                          admitted=(Mutation("a delta", _set("budget.delta", 1e-9)),)),
    "budget.noise": Claim(reason="which mechanism; its events are what the accountant composes",
                          admitted=(Mutation("gaussian", lambda d: (_set("budget.noise", "gaussian")(d),
                                                                    _set("budget.delta", 1e-9)(d))),)),
    "budget.accountant": Claim(reason="which accountant calibrates the Gaussian noise (issue 26 item 1): it changes "
                                      "sigma, i.e. the events, which the scope's accountant composes; a spec naming "
                                      "another accountant than the scope's is refused before reservation "
                                      "(check_scope); it decides no row, unit or period"),
    "budget.split": Claim(reason="how the release's own epsilon is shared between its metrics; the events compose",
                          admitted=(Mutation("a split", _set("budget.split", {"count": 2})),)),
    # ---- ContributionSpec
    "contribution.max_partitions_per_unit": Claim(
        reason="L0: enforced per release on the unit the scope pins, and the release's sensitivity (so its charged "
               "epsilon) is derived from it; it changes the charge, not which unit a row belongs to",
        admitted=(Mutation("L0 2", _set("contribution.max_partitions_per_unit", 2)),)),
    "contribution.max_rows_per_unit_per_partition": Claim(
        reason="Linf: enforced per release and part of its sensitivity, like L0",
        admitted=(Mutation("Linf 3", _set("contribution.max_rows_per_unit_per_partition", 3)),)),
    # ---- PartitionsSpec / PrivatePartitionsSpec
    "partitions.columns": Claim(
        reason="which partition a row is in, for L0: bounding keeps at most L0 partitions per (pinned) unit over this "
               "release's own partition columns, and the sensitivity is derived from that L0; other partition "
               "columns give another release with its own charge, composed in the same bucket",
        admitted=(Mutation("another partition column", _category_partitions),)),
    "partitions.public": Claim(reason="a public list only removes rows outside it (before bounding); it never adds a "
                                      "row or moves one to another unit or period",
                               admitted=(Mutation("another list", _set("partitions.public", ["north"])),)),
    "partitions.public_file": Claim(reason="the same public list, read from a file"),
    "partitions.private": Claim(reason="DP partition selection is itself charged (partition_selection events)",
                                admitted=(Mutation("private selection", _private_partitions),)),
    "partitions.private.strategy": Claim(reason="which selection mechanism; its events are charged"),
    # ---- metrics (every metric model's fields)
    "metrics[].type": Claim(reason="which statistic; its mechanism's events are charged"),
    "metrics[].name": Claim(reason=f"the output column's name; it {NOT_READ}"),
    "metrics[].column": Claim(reason="which value column is read: a null or non-finite value drops its row, which "
                                     "only removes contributions; it decides no unit or period"),
    "metrics[].bounds": Claim(reason="clamping bounds: part of the sensitivity, so of the charge; bounds: estimate "
                                     "makes the run first charge a DP estimation of them on the spec's own scope "
                                     "(its share budget.split['<key>.bounds']), then release with its result"),
    "metrics[].contribution": Claim(reason="a metric's own L0/Linf (at most the release's L0): enforced on the unit "
                                           "the scope pins, by the same keyed priorities, and part of that metric's "
                                           "sensitivity, so of the charge; like contribution.*, it changes the "
                                           "charge, not which unit or period a row belongs to"),
    "metrics[].fallback_bounds": Claim(reason="public bounds of bounds: estimate that the plan predicts accuracy at "
                                              "and the estimator anchors on (a data-independent preference, no "
                                              "sensitivity change); the release itself uses the charged estimate, "
                                              f"and the value {NOT_READ}"),
    "metrics[].quantiles": Claim(reason="which quantiles: part of the mechanism, charged"),
    "metrics[].k": Claim(reason="top-k size: part of the mechanism, charged"),
    "metrics[].domain": Claim(reason="a public category domain: values outside it are not counted; it never adds a "
                                     "row or moves one to another unit or period"),
    # ---- PostprocessSpec: post-processing of noisy values
    "postprocess.non_negative": Claim(reason="post-processing of noisy values (free, semantics.md section 3)"),
    "postprocess.integer_counts": Claim(reason="post-processing of noisy values"),
    "postprocess.clamp_means_to_bounds": Claim(reason="post-processing of noisy values"),
    "postprocess.suppress_below": Claim(reason="post-processing of noisy values (suppression by a noisy value)"),
    # ---- OutputSpec
    "output.root": Claim(reason=f"where outputs are written; it {NOT_READ}"),
}

SECTIONS = {
    "input": spec_models.InputSpec, "privacy_unit": spec_models.PrivacyUnitSpec, "budget": spec_models.BudgetSpec,
    "contribution": spec_models.ContributionSpec, "partitions": spec_models.PartitionsSpec,
    "partitions.private": spec_models.PrivatePartitionsSpec, "postprocess": spec_models.PostprocessSpec,
    "output": spec_models.OutputSpec,
}
METRIC_MODELS = (spec_models.CountMetric, spec_models.UnitCountMetric, spec_models.SumMetric, spec_models.MeanMetric,
                 spec_models.VarianceMetric, spec_models.QuantilesMetric, spec_models.TopKMetric)


def _all_fields() -> set[str]:
    out = set(spec_models.ReleaseSpec.model_fields)
    for prefix, model in SECTIONS.items():
        out |= {f"{prefix}.{name}" for name in model.model_fields}
    for model in METRIC_MODELS:
        out |= {f"metrics[].{name}" for name in model.model_fields}
    return out


def test_every_spec_field_is_classified():
    """A new spec field fails here until it is put in CLAIMS: pinned (and tested) or with its reason."""
    fields = _all_fields()
    missing = sorted(fields - set(CLAIMS))
    assert not missing, f"spec fields not classified in CLAIMS (pinned by the scope, or why not): {missing}"
    stale = sorted(set(CLAIMS) - fields)
    assert not stale, f"CLAIMS names fields the spec models no longer have: {stale}"
    # the section models are exactly the ones the spec uses (a new section model must be added to SECTIONS)
    nested = {name for name, f in spec_models.ReleaseSpec.model_fields.items()
              if isinstance(f.annotation, type) and issubclass(f.annotation, spec_models.BaseModel)}
    assert nested <= set(SECTIONS), sorted(nested - set(SECTIONS))
    for name, claim in CLAIMS.items():
        # every field is pinned, or says why it cannot change the claim (a partly pinned field says both)
        assert claim.pinned or claim.reason, name


# --------------------------------------------------------------------------- the real checks

def _base_doc() -> Doc:
    return {
        "name": "by_purchase",
        "input": {"path": "data/all.parquet", "format": "parquet",
                  "columns": {"user_id": "string", "account_id": "string", "region": "string", "ts": "timestamp"},
                  "time_column": "ts"},
        "privacy_unit": {"column": "user_id", "description": "a user's orders on one day", "adjacency": "add_remove",
                         "period": "day"},
        "budget": {"scope": "orders", "epsilon": 0.5, "delta": 0},
        "contribution": {"max_partitions_per_unit": 1, "max_rows_per_unit_per_partition": 5},
        "partitions": {"columns": ["region"], "public": ["north", "south"]},
        "metrics": [{"type": "count"}],
    }


SCOPE = ScopeDefinition(name="orders", unit="a user's orders on one day", unit_column="user_id", epsilon=1.0,
                        delta=1e-6, rho=None, accountant="basic/1", bucket="day", unit_period="day",
                        adjacency="add_remove", time_rule=TimeRule("ts"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("membership")
    start = datetime(2024, 1, 1, tzinfo=UTC)
    ts = [start + timedelta(minutes=37 * i) for i in range(60)]
    (root / "data").mkdir()
    table = pa.table({
        "user_id": [f"u{i % 9}" for i in range(60)], "account_id": [f"a{i % 7}" for i in range(60)],
        "region": ["north" if i % 2 else "south" for i in range(60)], "category": ["a"] * 60,
        "ts": pa.array(ts, pa.timestamp("us", tz="UTC")),
        "shipped_at": pa.array([t + timedelta(hours=20) for t in ts], pa.timestamp("us", tz="UTC")),
    })
    pq.write_table(table, root / "data" / "all.parquet")
    NoiseKey.generate(root / "noise.key")
    return root


def _write_spec(root: Path, doc: Doc, name: str) -> Path:
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


PINNED = [(field, m) for field, c in CLAIMS.items() for m in c.pinned]
ADMITTED = [(field, m) for field, c in CLAIMS.items() for m in c.admitted]


def test_the_base_spec_is_admitted(data_dir):
    spec = load_spec(_write_spec(data_dir, _base_doc(), "base"))
    assert unit_definition_mismatches(spec, SCOPE) == []


@pytest.mark.parametrize("field, mutation", PINNED, ids=[f"{f}:{m.what}" for f, m in PINNED])
def test_a_pinned_field_changed_is_refused_before_reservation(data_dir, tmp_path, capsys, monkeypatch, field,
                                                              mutation):
    """Through the real CLI: exit 3 (SpecError), the refusal names the field, and the ledger is unchanged."""
    for var in ("DPOPS_LEDGER_URL", "DPOPS_MANIFESTS_DIR", "DPOPS_NOISE_KEY_FILE", "DPOPS_DATA_ROOTS"):
        monkeypatch.delenv(var, raising=False)
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    with open_ledger(url) as led:
        led.create_scope(SCOPE, actor="test")
    doc = copy.deepcopy(_base_doc())
    mutation.apply(doc)
    spec = _write_spec(data_dir, doc, f"m{PINNED.index((field, mutation))}")
    code = main(["release", "run", str(spec), "--interval", DAY, "--key-file", str(data_dir / "noise.key"),
                 "--ledger", url, "--no-gx-checks", "--no-progress", "--json"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert mutation.needle in err, err
    with open_ledger(url) as led:
        assert [e.kind for e in led.history()] == ["scope_created"]  # nothing reserved, nothing written
        assert led.runs() == []


@pytest.mark.parametrize("field, mutation", ADMITTED, ids=[f"{f}:{m.what}" for f, m in ADMITTED])
def test_a_field_that_cannot_change_the_claim_is_admitted(data_dir, field, mutation):
    """The table's reason carries these: the scope check admits the mutation (it is not silently pinned)."""
    doc = copy.deepcopy(_base_doc())
    mutation.apply(doc)
    spec = load_spec(_write_spec(data_dir, doc, f"a{ADMITTED.index((field, mutation))}"))
    assert unit_definition_mismatches(spec, SCOPE) == []


# --------------------------------------------------------------------------- the reader's part of the argument

class _Prio:
    """The priority source prepare_batch draws from; priorities do not affect which unit a row is."""

    def uint64(self, n: int) -> np.ndarray:
        return np.arange(n, dtype=np.uint64)


def _units(cells: list[bytes | None], ctype: str) -> list[int]:
    from pipelines.io import ReadConfig, prepare_batch

    cfg = ReadConfig(format="csv", types={"user_id": ctype, "region": "string"}, unit_column="user_id",
                     partition_columns=("region",), value_columns=())
    batch = pa.record_batch({"user_id": pa.array(cells, pa.binary()),
                             "region": pa.array([b"north"] * len(cells), pa.binary())})
    rows, _, _ = prepare_batch(batch, 0, 0, cfg, _Prio())
    return [int(u) for u in rows["u"]]


CELL = st.one_of(st.none(), st.text(alphabet=" +-0123456789.eEinfatrulsNA_x", max_size=8).map(str.encode),
                 st.binary(max_size=4))


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cells=st.lists(CELL, min_size=1, max_size=12), ctype=st.sampled_from(["string", "int", "float", "bool"]))
def test_a_unit_id_is_a_function_of_its_stored_cell(cells, ctype):
    """Whatever a unit column is declared, a row's unit is a function of its own stored cell, never of the other
    cells in the batch: equal stored ids are always one unit (a type can merge ids, never split one), and a
    cell that does not convert drops its row. That is why the unit column's type is not pinned."""
    alone = {}
    for c in set(cells):
        u = _units([c], ctype)
        alone[c] = u[0] if u else None
    together = _units(cells, ctype)
    assert together == [alone[c] for c in cells if alone[c] is not None]
    if ctype == "string":  # the identity reading: distinct stored ids stay distinct units (up to 2^-64 collisions)
        kept = {c: u for c, u in alone.items() if u is not None}
        assert len(set(kept.values())) == len(kept)


def test_the_classification_is_documented():
    """docs/decisions.md carries the table's reasoning (the path-template question in particular)."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "decisions.md").read_text()
    assert "What decides membership" in text and "input.path" in text and "time rule" in text


def test_scope_show_json_matches_the_manifest_definition():
    """One dict for both: what `scope show --json` calls unit_definition is what manifests record."""
    assert json.loads(json.dumps(SCOPE.unit_definition))["time"] == TimeRule("ts").to_dict()
