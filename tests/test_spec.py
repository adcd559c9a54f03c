"""Release spec parsing and validation: every bad spec names its file and field."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import yaml

from dpops.errors import SpecError
from dpops.storage.location import Location
from dpops.spec import load_spec, parse_spec

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "daily_purchases.yaml"


def base_doc() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def write(tmp_path: Path, doc: dict, name: str = "daily.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


def test_example_is_valid():
    spec = load_spec(EXAMPLE)
    assert spec.name == "daily_purchases"
    assert spec.metric_keys[:3] == ["count", "unit_count", "sum_amount"]
    assert spec.public_partitions() == [("north",), ("south",), ("east",), ("west",)]
    assert spec.output_root == Location.local(EXAMPLE.parent / "out")
    assert len(spec.spec_hash) == 64


def _set(doc: dict, path: str, value):
    cur = doc
    parts = path.split(".")
    for part in parts[:-1]:
        cur = cur[int(part)] if part.isdigit() else cur[part]
    last = parts[-1]
    if value is _DELETE:
        del cur[last]
    elif last.isdigit():
        cur[int(last)] = value
    else:
        cur[last] = value


class _Delete:
    """Marks a key to remove; a stable repr keeps test ids identical in every pytest-xdist worker."""

    def __repr__(self) -> str:
        return "DELETE"


_DELETE = _Delete()

# (mutation path, new value, substring the error must contain: the field path and the reason)
BAD = [
    ("budget.epsilon", 0, "budget.epsilon: epsilon must be a finite number > 0"),
    ("budget.epsilon", -1.0, "budget.epsilon"),
    ("budget.epsilon", float("nan"), "budget.epsilon"),
    ("budget.epsilon", float("inf"), "budget.epsilon"),
    ("budget.epsilon", True, "budget.epsilon: expected a number"),
    ("budget.delta", 1.0, "budget.delta: delta must be in [0, 1)"),
    ("budget.delta", 2e-6, "budget.delta: delta=2e-06 is not below 1/n"),  # population 1e6
    ("budget.noise", "cauchy", "budget.noise"),
    ("budget.split", {"sum": 1}, "budget.split.sum: 'sum' is not a metric key"),
    ("budget.split", {"count": 0}, "budget.split: weight of 'count' must be a finite number > 0"),
    ("budget.split", {"partition_selection": 1}, "budget.split.partition_selection: partitions are public"),
    ("metrics.2.bounds", [5, 1], "metrics[2].bounds: lower bound 5.0 is greater than upper bound 1.0"),
    ("metrics.2.bounds", [0, float("nan")], "metrics[2].bounds: upper bound must be a finite number"),
    ("metrics.2.bounds", [0, float("inf")], "metrics[2].bounds"),
    ("metrics.2.column", "amt", "metrics[2].column: column 'amt' is not in input.columns"),
    ("metrics.2.column", "region", "metrics[2].column: sum needs a numeric column"),
    ("metrics.0", {"type": "median"}, "metrics[0]: unknown metric type 'median'"),
    ("metrics.1", {"type": "count"}, "metrics[1]: metric key 'count' is already used by metrics[0]"),
    ("metrics.6.domain", [], "metrics[6].domain"),
    ("metrics.6.domain", ["books", "books", "toys"], "metrics[6]: domain has a duplicate value 'books'"),
    ("metrics.6.k", 9, "metrics[6]: k=9 is larger than the domain"),
    ("metrics.5.quantiles", [0.5, 1.0], "metrics[5].quantiles: each quantile must be strictly between 0 and 1"),
    ("metrics.0.name", "Bad Name", "metrics[0].name: metric name 'Bad Name' must match"),
    ("metrics", [], "metrics: List should have at least 1 item"),
    ("partitions.public", ["north", "south", "north"], "partitions.public[2]: duplicate public partition 'north'"),
    ("partitions.public", ["north", 3], "partitions.public[1]: value 3 is not of column 'region'"),
    ("partitions.public", _DELETE, "partitions: give exactly one of partitions.public"),
    ("partitions.columns", ["country"], "partitions.columns[0]: column 'country' is not in input.columns"),
    ("partitions.private", {"strategy": "truncated_geometric"}, "partitions: give exactly one of"),
    ("output.root", "../escape", "output.root: output root '../escape' must not contain '..'"),
    ("output.root", "out/../../etc", "output.root"),
    ("output.root", "/etc/dpops", "output.root (/etc/dpops) is an absolute path or URI outside the operator's allowed output roots ($DPOPS_OUTPUT_ROOTS"),
    ("name", "../evil", "name: release name '../evil' must match"),
    ("name", "Daily Purchases", "name: release name"),
    ("contribution.max_partitions_per_unit", 0, "contribution.max_partitions_per_unit: Input should be greater than or equal to 1"),
    ("contribution.max_rows_per_unit_per_partition", 1.5, "contribution.max_rows_per_unit_per_partition"),
    ("privacy_unit.column", "uid", "privacy_unit.column: column 'uid' is not in input.columns"),
    ("privacy_unit.record_level", True, "privacy_unit.record_level: record_level: true means each row"),
    ("privacy_unit.adjacency", "swap", "privacy_unit.adjacency"),
    ("privacy_unit.population", 0, "privacy_unit.population"),
    ("input.columns.amount", "decimal", "input.columns.amount"),
    ("input.path", "data/{start.__class__}.parquet", "input.path: input path template may only use {start} and {end}"),
    ("input.format", "json", "input.format"),
    ("budget.epsilon_", 1.0, "budget.epsilon_: unknown key"),
    ("metrics.2.bound", [0, 1], "metrics[2].bound: unknown key"),
    ("extra_top_level", 1, "extra_top_level: unknown key"),
    ("schedule", "daily", "schedule: schedule 'daily' must be a 5-field cron"),
    ("postprocess.suppress_below", -1, "postprocess.suppress_below"),
    ("budget", _DELETE, "budget: required key is missing"),
]


@pytest.mark.parametrize("path,value,expected", BAD, ids=[f"{p}={v!r}"[:60] for p, v, _ in BAD])
def test_bad_spec_names_file_and_field(tmp_path, path, value, expected):
    doc = base_doc()
    _set(doc, path, value)
    p = write(tmp_path, doc)
    with pytest.raises(SpecError) as info:
        load_spec(p)
    msg = str(info.value)
    assert msg.startswith("daily.yaml: "), msg
    assert expected in msg, msg
    assert info.value.exit_code == 3


def test_gaussian_and_private_partitions_need_delta(tmp_path):
    doc = base_doc()
    doc["budget"]["delta"] = 0
    doc["budget"]["noise"] = "gaussian"
    with pytest.raises(SpecError, match=r"budget.delta: gaussian noise needs delta > 0"):
        load_spec(write(tmp_path, doc))
    doc = base_doc()
    doc["budget"]["delta"] = 0
    del doc["partitions"]["public"]
    doc["partitions"]["private"] = {"strategy": "laplace_threshold"}
    with pytest.raises(SpecError, match=r"budget.delta: private partition selection needs delta > 0"):
        load_spec(write(tmp_path, doc))
    # delta = 0 with laplace and public partitions is fine
    doc = base_doc()
    doc["budget"]["delta"] = 0
    assert load_spec(write(tmp_path, doc)).budget.delta == 0.0


def test_private_partitions_split_weights(tmp_path):
    doc = base_doc()
    del doc["partitions"]["public"]
    doc["partitions"]["private"] = {"strategy": "truncated_geometric"}
    doc["budget"]["split"] = {"count": 2, "partition_selection": 3}
    w = load_spec(write(tmp_path, doc)).split_weights()
    assert w["count"] == 2 and w["partition_selection"] == 3 and w["sum_amount"] == 1


def test_several_partition_columns(tmp_path):
    doc = base_doc()
    doc["partitions"] = {"columns": ["region", "category"], "public": [["north", "books"], ["south", "toys"]]}
    doc["metrics"] = [{"type": "count"}]
    doc["budget"]["split"] = None
    assert load_spec(write(tmp_path, doc)).public_partitions() == [("north", "books"), ("south", "toys")]
    doc["partitions"]["public"] = [["north", "books"], ["north", "books"]]
    with pytest.raises(SpecError, match=r"partitions.public\[1\]: duplicate"):
        load_spec(write(tmp_path, doc))
    doc["partitions"]["public"] = [["north"]]
    with pytest.raises(SpecError, match=r"partitions.public\[0\]: has 1 values for 2"):
        load_spec(write(tmp_path, doc))


def test_public_file(tmp_path, monkeypatch):
    public = tmp_path / "public"  # the operator's public root (dpops.dataroots), apart from the spec's directory
    public.mkdir()
    specs = tmp_path / "specs"
    specs.mkdir()
    monkeypatch.delenv("DPOPS_DATA_ROOTS", raising=False)
    monkeypatch.setenv("DPOPS_PUBLIC_ROOTS", str(public))
    monkeypatch.setenv("DPOPS_PUBLIC_ROOTS_PUBLISHABLE", str(public))
    doc = base_doc()
    del doc["partitions"]["public"]
    regions = public / "regions.csv"
    doc["partitions"]["public_file"] = str(regions)
    regions.write_text("region\nnorth\nsouth\n")
    spec = load_spec(write(specs, doc))
    assert spec.public_partitions() == [("north",), ("south",)]
    h1 = spec.spec_hash
    regions.write_text("region\nnorth\nsouth\neast\n")
    assert load_spec(write(specs, doc)).spec_hash != h1  # a publishable list is part of the spec
    regions.write_text("region\nnorth\nnorth\n")
    with pytest.raises(SpecError, match=r"public_file .*line 3: duplicate partition"):
        load_spec(write(specs, doc))
    regions.unlink()
    with pytest.raises(SpecError, match=r"partitions.public_file .*cannot read"):
        load_spec(write(specs, doc))


def test_yaml_bomb_fails_fast(tmp_path):
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    prev = "a"
    for name in "bcdefghi":
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
        prev = name
    p = tmp_path / "bomb.yaml"
    p.write_text("\n".join(lines) + "\n")
    t0 = time.perf_counter()
    with pytest.raises(SpecError, match=r"bomb.yaml: invalid YAML: .*aliases"):
        load_spec(p)
    assert time.perf_counter() - t0 < 1.0


def test_duplicate_yaml_key_is_refused(tmp_path):
    text = EXAMPLE.read_text().replace("  epsilon: 1.0\n", "  epsilon: 1.0\n  epsilon: 9.0\n")
    p = tmp_path / "dup.yaml"
    p.write_text(text)
    with pytest.raises(SpecError, match=r"dup.yaml: invalid YAML: .*duplicate key 'epsilon'"):
        load_spec(p)


def test_oversized_and_missing_and_non_mapping(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (1024 * 1024 + 10) + "\n")
    with pytest.raises(SpecError, match=r"big.yaml: file is \d+ bytes"):
        load_spec(big)
    with pytest.raises(SpecError, match=r"nope.yaml: cannot read"):
        load_spec(tmp_path / "nope.yaml")
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(SpecError, match=r"list.yaml: a release spec must be a YAML mapping"):
        load_spec(lst)


def test_several_problems_reported_together(tmp_path):
    doc = base_doc()
    doc["budget"]["epsilon"] = 0
    doc["metrics"][2]["bounds"] = [5, 1]
    msg = str(pytest.raises(SpecError, load_spec, write(tmp_path, doc)).value)
    assert "budget.epsilon" in msg and "metrics[2].bounds" in msg


def test_spec_hash_ignores_layout_and_key_order(tmp_path):
    doc = base_doc()
    h = load_spec(write(tmp_path, doc, "a.yaml")).spec_hash
    # reversed key order at every level, flow vs block style, comments/whitespace
    def rev(x):
        if isinstance(x, dict):
            return {k: rev(x[k]) for k in reversed(list(x))}
        if isinstance(x, list):
            return [rev(v) for v in x]
        return x
    p = tmp_path / "b.yaml"
    p.write_text("# a comment\n\n" + yaml.safe_dump(rev(doc), default_flow_style=True, width=40))
    assert load_spec(p).spec_hash == h
    # 0 and 0.0 are the same bound
    doc2 = copy.deepcopy(doc)
    doc2["metrics"][2]["bounds"] = [0.0, 100.0]
    assert load_spec(write(tmp_path, doc2, "c.yaml")).spec_hash == h
    # defaults filled in: stating a default explicitly changes nothing
    doc3 = copy.deepcopy(doc)
    doc3["metrics"][0]["name"] = None
    assert load_spec(write(tmp_path, doc3, "d.yaml")).spec_hash == h


@pytest.mark.parametrize("path,value", [
    ("budget.epsilon", 1.0000001),
    ("budget.delta", 1e-8),
    ("metrics.2.bounds", [0, 101]),
    ("contribution.max_partitions_per_unit", 4),
    ("partitions.public", ["north", "south", "east"]),
    ("privacy_unit.adjacency", "replace"),
    ("postprocess.non_negative", False),
    ("description", "other words"),
    ("metrics.5.quantiles", [0.5, 0.95]),
])
def test_spec_hash_changes_with_any_value(tmp_path, path, value):
    h = load_spec(write(tmp_path, base_doc(), "a.yaml")).spec_hash
    doc = base_doc()
    _set(doc, path, value)
    assert load_spec(write(tmp_path, doc, "b.yaml")).spec_hash != h


def test_parse_spec_from_dict():
    spec = parse_spec(base_doc(), source="inline")
    assert spec.metric("sum_amount").bounds == (0.0, 100.0)
    with pytest.raises(SpecError, match=r"^inline: "):
        parse_spec({"name": "x"}, source="inline")


@pytest.mark.parametrize("path", sorted(EXAMPLE.parent.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_is_valid(path):
    spec = load_spec(path)
    assert sum(spec.split_weights().values()) > 0
