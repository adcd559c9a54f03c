"""Property-based fuzzing (hypothesis) of the spec parser and the contribution bounder.

Spec parser: random YAML documents, random mutations of a valid spec (values replaced by hostile
ones, keys deleted or added) and random byte edits of its text. ``load_spec``/``parse_spec`` must
either return a spec (whose hash and release plan then work) or raise ``SpecError``: never any
other exception. A spec that parses but cannot be planned may raise only a ``DpopsError``.

Contribution bounder: random rows (few units/partitions so collisions are common; NaN, inf, None,
huge values): every unit keeps exactly min(L0, its partitions) partitions and every kept
(unit, partition) exactly min(Linf, its rows) rows; aggregates never hold NaN/inf and stay within
the clamped bounds.

Hypothesis runs with the fixed-seed "ci" profile (tests/fuzz_support.py) and a fixed example budget, so a
failure reproduces exactly; `make fuzz` runs the same properties with random seeds.
"""

from __future__ import annotations

import copy
import math
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from fuzz_support import examples

from dpops.errors import DpopsError, SpecError
from dpops.spec import load_spec, parse_spec

CORPUS = Path(__file__).resolve().parent / "corpus"
BASE_TEXT = (CORPUS / "base_spec.yaml").read_text(encoding="utf-8")
BASE = yaml.safe_load(BASE_TEXT)

FUZZ = settings(max_examples=examples(150), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

scalars = (st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=30)
           | st.sampled_from(["", "..", "../../etc", "/abs", "{start.__class__}", "count", "gaussian", "north",
                              "add_remove", "1e-300", "-0", "\x00", "🙂", "data/{start:%Y}.csv"]))
documents = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                         | st.dictionaries(st.text(max_size=12) | st.sampled_from(list(BASE)), inner, max_size=6),
                         max_leaves=25)


def _check_parse(doc) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "delta above 1e-5" is a warning by design
            spec = parse_spec(doc, source="fuzz.yaml", base_dir=tempfile.gettempdir())
    except SpecError:
        return
    assert len(spec.spec_hash) == 64
    spec.public_partitions()
    from dpops.release_plan import plan_release

    try:
        plan_release(spec)
    except DpopsError:
        pass  # a clear, classified refusal (exit 3/4/...) is fine; anything else is a crash


@FUZZ
@given(documents)
def test_random_documents_only_raise_spec_error(doc):
    _check_parse(doc)


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


ALL_PATHS = [p for p in _paths(BASE) if p]
# plausible values keep a good share of mutants valid, so the plan is exercised too
plausible = st.sampled_from([0.5, 1, 2, 3.0, 10, 1e-6, 1e-9, "laplace", "gaussian", "replace", "add_remove", [0, 10],
                             [-5, 5], ["north"], ["north", "south", "east"], "week", "day", 1000000, "shop", "x"])
hostile_values = plausible | plausible | scalars | st.sampled_from([0, -1, 0.0, float("nan"), float("inf"), -float("inf"), 1e308, 2 ** 63,
                                            [], {}, [100, 0], [0, float("nan")], ["north", "north"], True])


@st.composite
def mutated_specs(draw):
    doc = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 2))):
        path = draw(st.sampled_from(ALL_PATHS))
        parent = doc
        try:
            for k in path[:-1]:
                parent = parent[k]
            op = draw(st.sampled_from(["replace", "replace", "replace", "delete", "add"]))
            if op == "replace":
                parent[path[-1]] = draw(hostile_values)
            elif op == "delete":
                del parent[path[-1]]
            elif isinstance(parent, dict):
                parent[draw(st.text(min_size=1, max_size=10))] = draw(hostile_values)
            elif isinstance(parent, list):
                parent.append(draw(hostile_values))
        except (KeyError, IndexError, TypeError):
            pass  # an earlier mutation removed or replaced this path
    return doc


@FUZZ
@given(mutated_specs())
def test_mutated_specs_only_raise_spec_error(doc):
    _check_parse(doc)


def _get(doc, path):
    for k in path:
        doc = doc[k]
    return doc


@st.composite
def nearly_valid_specs(draw):
    """One leaf replaced by a value of the same kind (a number by a number, ...): many stay valid, so the
    release plan behind them is fuzzed too (the plan may refuse only with a DpopsError)."""
    doc = copy.deepcopy(BASE)
    leaves = [p for p in ALL_PATHS if not isinstance(_get(BASE, p), (dict, list))]
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(leaves))
        old = _get(BASE, path)
        if isinstance(old, bool):
            new = draw(st.booleans())
        elif isinstance(old, (int, float)):
            new = draw(st.sampled_from([0, 1, 2, 7, 0.1, 0.5, 1e-12, 1e-3, 99.5, 1e6, 1e15, -1, -0.5])
                       | st.floats(-1e9, 1e9, allow_nan=False))
        else:
            new = draw(st.sampled_from(["count", "sum", "mean", "variance", "unit_count", "laplace", "gaussian",
                                        "replace", "add_remove", "amount", "region", "user_id", "float", "int",
                                        "string", "bool", "shop", "out/x", "data/{start:%Y-%m-%d}.csv"]))
        parent = _get(doc, path[:-1])
        parent[path[-1]] = new
    return doc


@FUZZ
@given(nearly_valid_specs())
def test_nearly_valid_specs_parse_or_raise_spec_error_and_plan_cleanly(doc):
    _check_parse(doc)


@st.composite
def mutated_texts(draw):
    data = bytearray(BASE_TEXT.encode("utf-8"))
    for _ in range(draw(st.integers(1, 6))):
        pos = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["flip", "insert", "delete"]))
        chunk = draw(st.binary(min_size=1, max_size=4) | st.sampled_from(
            [b"&a ", b"*a", b"!!python/name:os.system ", b": ", b"\n  ", b"- ", b"{", b"]", b"\t", b"\xff", b"%YAML 1.1\n"]))
        if op == "flip" and pos < len(data):
            data[pos] ^= chunk[0] or 1
        elif op == "insert":
            data[pos:pos] = chunk
        else:
            del data[pos:pos + len(chunk)]
    return bytes(data)


@FUZZ
@given(mutated_texts())
def test_mutated_spec_text_only_raises_spec_error(text):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "spec.yaml"
        p.write_bytes(text)
        try:
            spec = load_spec(p)
        except SpecError:
            return
        assert len(spec.spec_hash) == 64


def test_the_parser_check_can_fail(monkeypatch):
    """Negative control: an exception other than SpecError escaping the parser fails the check."""
    import dpops.spec

    def broken(doc, source="", base_dir=None):
        raise KeyError("budget")

    monkeypatch.setattr(sys.modules[__name__], "parse_spec", broken)
    with pytest.raises(KeyError):
        _check_parse(dict(BASE))
    assert dpops.spec.parse_spec is not broken


# --------------------------------------------------------------------------- contribution bounder


class _Prio:
    """Stands in for the run's randomness source: seeded uniform uint64 priorities."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def uint64(self, n: int) -> np.ndarray:
        return self.rng.integers(0, 2 ** 64, n, dtype=np.uint64)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 5)), max_size=120), st.integers(1, 4), st.integers(1, 4),
       st.integers(0, 2 ** 32))
def test_bounder_keeps_exactly_min_l0_and_min_linf(pairs, l0, linf, seed):
    from pipelines.bounding import bound_contributions

    u = np.array([a for a, _ in pairs], dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    p = np.array([b for _, b in pairs], dtype=np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
    prio = _Prio(seed).uint64(len(pairs))
    kept, kept_parts, stats = bound_contributions(u, p, prio, l0, linf)
    assert len(set(kept.tolist())) == len(kept) and all(0 <= i < len(pairs) for i in kept)
    rows: dict[tuple[int, int], int] = {}
    for a, b in pairs:
        rows[(a, b)] = rows.get((a, b), 0) + 1
    got: dict[tuple[int, int], int] = {}
    for i in kept:
        got[pairs[i]] = got.get(pairs[i], 0) + 1
    for pair, n in got.items():
        assert n == min(linf, rows[pair]), f"pair {pair}: kept {n} of {rows[pair]} rows, Linf={linf}"
    for unit in {a for a, _ in pairs}:
        have = {b for a, b in rows if a == unit}
        kept_p = {b for a, b in got if a == unit}
        assert len(kept_p) == min(l0, len(have)), f"unit {unit}: kept {len(kept_p)} of {len(have)} partitions"
    assert sorted(kept_parts.tolist()) == sorted(int(p[[i for i in kept if pairs[i] == pr][0]]) for pr in got)


values = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(
    [float("nan"), float("inf"), -float("inf"), 1e308, -1e308, 5e-324, 0.0, -0.0, 1e12]))


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d", None, "é", ""]),
                          st.sampled_from(["north", "south", "east", None, "🙂"]), values), max_size=150),
       st.integers(1, 3), st.integers(1, 3), st.sampled_from([(0.0, 100.0), (-5.0, 5.0), (-1e6, 0.0), (3.0, 3.0)]),
       st.integers(0, 2 ** 32))
def test_aggregates_never_hold_nan_and_respect_bounds(rows, l0, linf, bounds, seed):
    from pipelines.bounding import AggregationSpec, aggregate_bucket
    from pipelines.io import ReadConfig, prepare_batch

    lo, hi = bounds
    batch = pa.RecordBatch.from_pydict({
        "user_id": pa.array([r[0] for r in rows], pa.string()),
        "region": pa.array([r[1] for r in rows], pa.string()),
        "amount": pa.array([r[2] for r in rows], pa.float64()),
    })
    cfg = ReadConfig(format="parquet", types={"user_id": "string", "region": "string", "amount": "float"},
                     unit_column="user_id", partition_columns=("region",), value_columns=("amount",))
    prepared, _names, stats = prepare_batch(batch, 0, 0, cfg, _Prio(seed))
    good = [r for r in rows if r[0] is not None and r[1] is not None and r[2] is not None and math.isfinite(r[2])]
    assert len(prepared["u"]) == len(good) and stats["rows_read"] == len(rows)
    spec = AggregationSpec(l0=l0, linf=linf, sums=(("s", "amount", lo, hi, "sum"), ("ns", "amount", lo, hi, "nsum"),
                                                    ("nq", "amount", lo, hi, "nsq")),
                           hists=(("h", "amount", lo, hi, 8),))
    parts, acc, _ = aggregate_bucket(prepared, spec)
    for name, arr in acc.items():
        assert np.isfinite(np.asarray(arr, dtype=float)).all(), f"non-finite value in aggregate {name}"
    count = acc["count"]
    units = {r[0] for r in good}
    assert count.sum() <= len(units) * l0 * linf
    assert (acc["unit_count"] <= len(units)).all() and (acc["unit_count"] <= count).all()
    bound, half = max(abs(lo), abs(hi)), (hi - lo) / 2
    tol = 1e-9 * max(1.0, bound) * max(1, count.max(initial=0))
    from pipelines.bounding import sum_unit  # sums are exact integer multiples of their grid step

    val = {k: acc[k] * sum_unit(kind, lo, hi) for k, kind in (("s", "sum"), ("ns", "nsum"), ("nq", "nsq"))}
    assert (np.abs(val["s"]) <= count * bound + tol).all()
    assert (np.abs(val["ns"]) <= count * half + tol).all()
    assert (np.abs(val["nq"]) <= count * half * half / 2 + tol * max(1.0, bound)).all()
    assert (acc["h"].sum(axis=1) == count).all()
