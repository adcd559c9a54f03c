"""Issue 19 item 5 (a): team GX suites are validated strictly, before GX sees them (dpops.gx_suites).

Properties with a fixed example budget (derandomized by the ci profile): every expectation type outside the
allow-list is refused; a ``row_condition``/``condition_parser`` key anywhere in a suite is refused, naming where;
an unknown keyword argument of an allowed type is refused. And each allowed type, with the keyword
arguments its model names, really builds in GX (the allow-list is not vacuous and its names match GX).
"""

from __future__ import annotations

import copy
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from fuzz_support import examples

from dpops.errors import SpecError
from dpops.gx_suites import ALLOWED_EXPECTATIONS, load_team_suites, validate_suite

PROPS = settings(max_examples=examples(60), deadline=None,
                 suppress_health_check=[HealthCheck.too_slow])

# A minimal valid keyword set per allowed type (used to build suites around the adversarial part).
MINIMAL: dict[str, dict[str, object]] = {
    "expect_column_to_exist": {"column": "count"},
    "expect_table_columns_to_match_set": {"column_set": ["region", "count"], "exact_match": False},
    "expect_table_row_count_to_be_between": {"min_value": 1, "max_value": 10},
    "expect_table_row_count_to_equal": {"value": 2},
    "expect_column_values_to_not_be_null": {"column": "count", "mostly": 1},
    "expect_column_values_to_be_between": {"column": "count", "min_value": 0, "strict_min": False},
    "expect_column_values_to_be_in_set": {"column": "region", "value_set": ["north", "south"]},
    "expect_column_values_to_be_unique": {"column": "region"},
    "expect_column_values_to_be_in_type_list": {"column": "count", "type_list": ["float64"]},
    "expect_column_distinct_values_to_equal_set": {"column": "region", "value_set": ["north", "south"]},
    "expect_column_distinct_values_to_be_in_set": {"column": "region", "value_set": ["north", "south"]},
    "expect_column_pair_values_a_to_be_greater_than_b": {"column_A": "count_ci95_high", "column_B": "count_ci95_low",
                                                          "or_equal": True, "ignore_row_if": "either_value_is_missing"},
    "expect_column_min_to_be_between": {"column": "count", "min_value": -100},
    "expect_column_max_to_be_between": {"column": "count", "max_value": 1e9},
    "expect_column_sum_to_be_between": {"column": "count", "min_value": 0, "max_value": 1e9},
    "expect_column_mean_to_be_between": {"column": "count", "min_value": 0},
}


def _suite(*expectations: dict[str, object], name: str = "output.all.team") -> dict[str, object]:
    return {"name": name, "meta": {"great_expectations_version": "1.24.1"},
            "expectations": [{"meta": {}, "severity": "critical", **e} for e in expectations]}


def test_minimal_table_covers_the_allow_list():
    assert set(MINIMAL) == set(ALLOWED_EXPECTATIONS)


@pytest.mark.parametrize("etype", sorted(ALLOWED_EXPECTATIONS))
def test_each_allowed_type_validates_and_builds_in_gx(etype):
    from great_expectations.expectations.expectation_configuration import ExpectationConfiguration

    suite = validate_suite(_suite({"type": etype, "kwargs": MINIMAL[etype]}), "f.json")
    exp = suite.expectations[0]
    built = ExpectationConfiguration(type=exp.type, kwargs=dict(exp.kwargs)).to_domain_obj()
    cls = type(built)
    gx_fields = set(getattr(cls, "model_fields", None) or cls.__fields__)
    ours = set(ALLOWED_EXPECTATIONS[etype].model_fields)
    assert ours <= gx_fields, ours - gx_fields  # every keyword we allow is GX's own, spelled the same


def _registered_types() -> list[str]:
    import great_expectations.expectations  # noqa: F401 - registers the core expectations
    from great_expectations.expectations.registry import list_registered_expectation_implementations

    return sorted(list_registered_expectation_implementations())


def test_every_registered_gx_type_outside_the_allow_list_is_refused():
    refused = [t for t in _registered_types() if t not in ALLOWED_EXPECTATIONS]
    assert len(refused) > 30 and "expect_column_values_to_match_regex" in refused
    assert "unexpected_rows_expectation" in refused
    for etype in refused:
        doc = _suite({"type": "expect_column_to_exist", "kwargs": {"column": "c"}}, {"type": etype, "kwargs": {}})
        with pytest.raises(SpecError, match=rf"^f\.json: expectations\[1\]\.type: expectation type {etype} is not"):
            validate_suite(doc, "f.json")


@PROPS
@given(st.text(min_size=1, max_size=80))
def test_any_other_type_name_is_refused(etype):
    if etype in ALLOWED_EXPECTATIONS:
        return
    doc = _suite({"type": etype, "kwargs": {"column": "c"}})
    with pytest.raises(SpecError, match=r"expectations\[0\]\.type: expectation type .* is not in dpops' allow-list"):
        validate_suite(doc, "f.json")


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=10)


def _plant(doc: object, path: list[int], key: str, value: object) -> object:
    """Put ``key: value`` into the dict reached by following ``path`` choices through ``doc``."""
    node = doc
    for choice in path:
        children = list(node.values()) if isinstance(node, dict) else node if isinstance(node, list) else []
        containers = [c for c in children if isinstance(c, (dict, list))]
        if not containers:
            break
        node = containers[choice % len(containers)]
    if isinstance(node, list):
        node.append({key: value})
    else:
        node[key] = value
    return doc


@PROPS
@given(etype=st.sampled_from(sorted(ALLOWED_EXPECTATIONS)), extra=JSON, path=st.lists(st.integers(0, 7), max_size=6),
       key=st.sampled_from(["row_condition", "condition_parser"]), value=JSON)
def test_a_row_condition_anywhere_is_refused(etype, extra, path, key, value):
    doc = copy.deepcopy(_suite({"type": etype, "kwargs": MINIMAL[etype]}))
    doc["meta"] = {"x": extra} if not isinstance(extra, dict) else extra  # arbitrary nesting to hide it in
    doc = json.loads(json.dumps(_plant(doc, path, key, value)))
    with pytest.raises(SpecError, match=rf"f\.json: .*{key}: row conditions are refused"):
        validate_suite(doc, "f.json")


@PROPS
@given(etype=st.sampled_from(sorted(ALLOWED_EXPECTATIONS)),
       name=st.text(st.characters(min_codepoint=48, max_codepoint=122), min_size=1, max_size=20), value=JSON)
def test_an_unknown_keyword_of_an_allowed_type_is_refused(etype, name, value):
    if name in ALLOWED_EXPECTATIONS[etype].model_fields or name in ("row_condition", "condition_parser"):
        return
    doc = _suite({"type": etype, "kwargs": {**MINIMAL[etype], name: value}})
    with pytest.raises(SpecError, match=r"expectations\[0\]\.kwargs\..*unknown field"):
        validate_suite(json.loads(json.dumps(doc)), "f.json")


@pytest.mark.parametrize("kwargs, field", [
    ({"column": "count", "min_value": {"$PARAMETER": "upstream"}}, "min_value"),  # GX's suite parameters
    ({"column": "count", "min_value": True}, "min_value"),
    ({"column": "count", "result_format": "COMPLETE"}, "result_format"),
    ({"column": "count", "catch_exceptions": False}, "catch_exceptions"),
    ({"column": "count\x1b[2J"}, "column"),
    ({"column": "count", "mostly": 2}, "mostly"),
])
def test_field_errors_name_file_index_and_field(kwargs, field):
    doc = _suite({"type": "expect_column_to_exist", "kwargs": {"column": "c"}},
                 {"type": "expect_column_values_to_be_between", "kwargs": kwargs})
    with pytest.raises(SpecError, match=rf"^f\.json: expectations\[1\]\.kwargs\.{field}"):
        validate_suite(doc, "f.json")


def test_meta_notes_and_name_are_checked():
    with pytest.raises(SpecError, match=r"expectations\[0\]\.meta"):
        validate_suite(_suite({"type": "expect_column_to_exist", "kwargs": {"column": "c"}, "meta": {"a": "b"}}), "f")
    with pytest.raises(SpecError, match=r"f: evaluation_parameters: unknown field"):
        validate_suite({**_suite(), "evaluation_parameters": {}}, "f")
    with pytest.raises(SpecError, match=r"name: the suite in this file must be named 'output.all.x'"):
        validate_suite(_suite(name="output.all.y"), "f", "output.all.x")


def test_load_team_suites_reads_only_this_release_and_all(tmp_path):
    root = tmp_path / "p"
    for rel, name in (("output/r1/a.json", "output.r1.a"), ("output/all/b/c.json", "output.all.b.c"),
                      ("output/r2/z.json", "output.r2.z"), ("other/q.json", "other.q")):
        path = root / "gx" / "expectations" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_suite({"type": "expect_column_to_exist", "kwargs": {"column": "c"}}, name=name)))
    assert [s.name for s in load_team_suites(root, "r1")] == ["output.all.b.c", "output.r1.a"]
    link = root / "gx" / "expectations" / "output" / "r1" / "l.json"
    os.symlink(root / "gx" / "expectations" / "other" / "q.json", link)
    with pytest.raises(SpecError, match=rf"GX suite file {link} is a symlink"):
        load_team_suites(root, "r1")
