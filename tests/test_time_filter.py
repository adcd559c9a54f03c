"""Issue 11 item 2: period buckets compose in parallel only when the data path proves disjointness.

- a bucketed scope refuses a spec without ``input.time_column`` (the three-day ``all.parquet`` case);
- the pipeline keeps only rows whose event time is in the run's [start, end);
- an interval that is not exactly one period / one schedule interval is refused before reservation.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import yaml

from dpops import release
from dpops.inputs import parse_interval
from dpops.errors import SpecError
from dpops.ledger import ScopeDefinition, TimeRule, open_ledger
from dpops.spec import interval_problems, load_spec, parse_spec
from dpops.storage import ReleaseStore
from pipelines.io import outside_window
from tests.test_runs import FakeKey

DAYS = [("2024-01-01T00:00:00Z", "2024-01-02T00:00:00Z"), ("2024-01-02T00:00:00Z", "2024-01-03T00:00:00Z"),
        ("2024-01-03T00:00:00Z", "2024-01-04T00:00:00Z")]
ROWS_PER_DAY = (5, 7, 11)


def _three_day_file(tmp_path, fmt="parquet"):
    """data/all.<fmt>: ROWS_PER_DAY[d] rows on day d, distinct users, one region."""
    users, ts, amounts = [], [], []
    for d, n in enumerate(ROWS_PER_DAY):
        for i in range(n):
            users.append(f"u{d}_{i}")
            ts.append(datetime(2024, 1, 1 + d, 3 + i % 20, tzinfo=timezone.utc))
            amounts.append(1.0)
    table = pa.table({"user_id": users, "region": ["north"] * len(users), "amount": amounts,
                      "ts": pa.array(ts, pa.timestamp("ms", tz="UTC"))})
    p = tmp_path / "data" / f"all.{fmt}"
    p.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        pq.write_table(table, p)
    else:
        table = table.set_column(3, "ts", pa.array([t.strftime("%Y-%m-%dT%H:%M:%SZ") for t in ts]))
        pcsv.write_csv(table, p)
    return p


def _spec(tmp_path, *, time_column=True, fmt="parquet", path=None, schedule="0 0 * * *"):
    cols = {"user_id": "string", "region": "string", "amount": "float"}
    inp = {"path": path or f"data/all.{fmt}", "format": fmt, "columns": cols}
    if time_column:
        cols["ts"] = "timestamp"
        inp["time_column"] = "ts"
    doc = {
        "name": "daily", "schedule": schedule, "input": inp,
        "privacy_unit": {"column": "user_id", "description": "a user's purchases on one day",
                         "adjacency": "add_remove", "period": "day"},
        "budget": {"scope": "shop", "epsilon": 1.0, "delta": 0},
        "contribution": {"max_partitions_per_unit": 1, "max_rows_per_unit_per_partition": 1},
        "partitions": {"columns": ["region"], "public": ["north"]},
        "metrics": [{"type": "count"}],
    }
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


@pytest.fixture
def ledger(tmp_path):
    led = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    led.create_scope(ScopeDefinition(name="shop", unit="a user's purchases on one day", unit_column="user_id",
                                     epsilon=1.0, delta=1e-6, rho=None, accountant="basic/1", adjacency="add_remove",
                                     bucket="day", unit_period="day", time_rule=TimeRule("ts")), actor="test")
    yield led
    led.close()


def test_bucketed_scope_refuses_a_spec_without_time_column(tmp_path, ledger):
    """The issue's reproduction: one all.parquet released for three days, each charged to its own bucket."""
    _three_day_file(tmp_path)
    spec = _spec(tmp_path, time_column=False)
    for start, end in DAYS:
        with pytest.raises(SpecError, match="declare the event-time column"):
            release.execute_release(spec, start, end, ledger=ledger, randomness="test", test_seed=1)
    assert ledger.runs() == []


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_each_day_reads_only_its_own_rows(tmp_path, ledger, fmt):
    _three_day_file(tmp_path, fmt)
    spec = _spec(tmp_path, fmt=fmt)
    total = sum(ROWS_PER_DAY)
    for d, (start, end) in enumerate(DAYS):
        out = release.execute_release(spec, start, end, ledger=ledger, randomness="test", test_seed=3,
                                   publish_output=False)
        assert out.state == "staged"
        slug = parse_interval(start, end).slug
        internal = ReleaseStore(tmp_path / "out", "daily").read_internal_log(slug, out.run_id)
        assert internal["rows_read"] == total
        assert internal["dropped_outside_interval"] == total - ROWS_PER_DAY[d]
        assert internal["rows_kept"] == ROWS_PER_DAY[d]
    # three disjoint days: each bucket holds exactly one run's epsilon
    assert [b.total for b in ledger.status("shop").buckets] == pytest.approx([1.0, 1.0, 1.0])


@pytest.mark.parametrize("interval, needle", [
    (("2024-01-02T12:00:00Z", "2024-01-04T12:00:00Z"), "2024-01-02T00:00:00Z/2024-01-03T00:00:00Z"),
    (("2024-01-18T12:00:00Z", "2024-01-20T12:00:00Z"), "2024-01-18T00:00:00Z/2024-01-19T00:00:00Z"),
    (("2024-01-02T00:00:00Z", "2024-01-04T00:00:00Z"), "2024-01-02T00:00:00Z/2024-01-03T00:00:00Z"),
    (("2024-01-02T00:00:00Z", "2024-01-02T12:00:00Z"), "2024-01-02T00:00:00Z/2024-01-03T00:00:00Z"),
])
def test_misaligned_interval_is_refused_before_reservation(tmp_path, ledger, interval, needle):
    _three_day_file(tmp_path)
    spec = _spec(tmp_path, path="data/{start:%Y-%m-%d}.parquet")
    with pytest.raises(SpecError) as err:
        release.execute_release(spec, *interval, ledger=ledger, randomness="test", test_seed=1)
    text = str(err.value)
    assert "is not exactly one UTC day" in text and "nothing was reserved" in text
    assert f"dpops release run {spec} --interval {needle}" in text
    assert ledger.runs() == []


def test_schedule_alignment_without_period(tmp_path):
    doc = yaml.safe_load(_spec(tmp_path, schedule="0 6 * * *").read_text())
    del doc["privacy_unit"]["period"]
    spec = parse_spec(doc, base_dir=tmp_path)
    t = lambda s: datetime.fromisoformat(s.replace("Z", "+00:00"))  # noqa: E731
    assert interval_problems(spec, t("2024-01-02T06:00:00Z"), t("2024-01-03T06:00:00Z")) == []
    probs = interval_problems(spec, t("2024-01-02T00:00:00Z"), t("2024-01-03T00:00:00Z"), spec_path="s.yaml")
    assert "not an interval of schedule '0 6 * * *'" in probs[0]
    assert probs[-1].endswith("dpops release run s.yaml --interval 2024-01-01T06:00:00Z/2024-01-02T06:00:00Z")


def test_spec_check_of_time_column_and_schedule(tmp_path):
    doc = yaml.safe_load(_spec(tmp_path).read_text())
    load_spec(_spec(tmp_path))  # valid
    bad = {**doc, "input": {**doc["input"], "columns": {**doc["input"]["columns"], "ts": "string"}}}
    with pytest.raises(SpecError, match="input.time_column: column 'ts' must be declared with type timestamp"):
        parse_spec(bad)
    bad = {**doc, "input": {**doc["input"], "time_column": "when"}}
    with pytest.raises(SpecError, match="input.time_column: column 'when' is not in input.columns"):
        parse_spec(bad)
    bad = {**doc, "schedule": "0 0 * * 1"}  # weekly runs for a day-scoped unit could never release
    with pytest.raises(SpecError, match="schedule: schedule '0 0 \\* \\* 1' runs over"):
        parse_spec(bad)


@pytest.mark.parametrize("unit", ["s", "ms", "us", "ns"])
def test_outside_window_is_exact_at_the_bounds(unit):
    lo = 1_704_067_200 * 10**9  # 2024-01-01T00:00:00Z in ns
    hi = lo + 86_400 * 10**9
    f = {"s": 10**9, "ms": 10**6, "us": 10**3, "ns": 1}[unit]
    vals = [lo // f - 1, lo // f, hi // f - 1, hi // f, None]
    for tz in (None, "UTC", "Europe/Paris"):  # naive = UTC; aware values are stored as UTC instants
        mask = outside_window(pa.array(vals, pa.timestamp(unit, tz=tz)), (lo, hi))
        assert mask.tolist() == [True, False, False, True, True]
    text = pa.array(["2023-12-31T23:59:59Z", "2024-01-01T00:00:00Z", "2024-01-01T01:00:00+01:00",
                     "2024-01-01 23:59:59", "2024-01-02T00:00:00Z", "not a time", None, ""])
    # "01:00+01:00" is midnight UTC: inside
    assert outside_window(text, (lo, hi)).tolist() == [True, False, False, False, True, True, True, True]
    assert outside_window(pa.array([], pa.timestamp(unit)), (lo, hi)).dtype == np.bool_


def test_check_input_wants_a_timestamp_time_column(tmp_path):
    from dpops.errors import InputDataError
    from dpops.inputs import check_input

    spec = load_spec(_spec(tmp_path))
    p = _three_day_file(tmp_path)
    check_input(spec, [str(p)])
    t = pq.read_table(p)
    pq.write_table(t.set_column(3, "ts", pa.array([str(v) for v in t["ts"].to_pylist()])), p)
    with pytest.raises(InputDataError, match="column 'ts' has type string but input.columns declares timestamp"):
        check_input(spec, [str(p)])


def test_example_spec_with_synthetic_data_on_a_day_bucketed_scope(tmp_path):
    """examples/daily_purchases.yaml (time_column ts) over dpops.testing.synthetic data, charged per day bucket."""
    import shutil
    from pathlib import Path

    from dpops.testing.synthetic import generate_events

    example = Path(__file__).resolve().parent.parent / "examples" / "daily_purchases.yaml"
    spec = tmp_path / "daily_purchases.yaml"
    shutil.copy(example, spec)
    generate_events(str(tmp_path / "data/purchases/{start:%Y-%m-%d}.parquet"), n_rows=3000, n_users=300,
                    n_partitions=4, days=2, categories=("books", "games", "music", "food", "toys"))
    for f in (tmp_path / "data/purchases").glob("*.parquet"):  # the example's regions
        t = pq.read_table(f)
        regions = pa.array([["north", "south", "east", "west"][int(r[1:])] for r in t["region"].to_pylist()])
        pq.write_table(t.set_column(t.schema.get_field_index("region"), "region", regions), f)
    with open_ledger(f"sqlite:///{tmp_path / 'l.sqlite'}") as led:
        led.create_scope(ScopeDefinition(name="purchases", unit="a user's purchases on one day", unit_column="user_id",
                                         epsilon=1.0, delta=1e-7, rho=None, accountant="rdp/1", bucket="day",
                                         unit_period="day", adjacency="add_remove", population=1_000_000,
                                         time_rule=TimeRule("ts")), actor="t")
        for start, end in DAYS[:2]:
            out = release.execute_release(spec, start, end, ledger=led, randomness="test", test_seed=1,
                                       publish_output=False)
            assert out.state == "staged"
        assert len(led.status("purchases").buckets) == 2


@pytest.mark.parametrize("tz", [None, "UTC", "Europe/Paris"])
def test_gx_input_schema_check_knows_timestamp(tmp_path, tz):
    from dpops.errors import InputDataError
    from dpops.release.gx_checks import check_input_schema

    p = tmp_path / "x.parquet"
    pq.write_table(pa.table({"ts": pa.array([1], pa.timestamp("ms", tz=tz)), "x": [1.0]}), p)
    assert check_input_schema([str(p)], {"ts": "timestamp", "x": "float"}).success
    pq.write_table(pa.table({"ts": ["2024-01-01"], "x": [1.0]}), p)
    with pytest.raises(InputDataError, match="column 'ts' is declared 'timestamp'"):
        check_input_schema([str(p)], {"ts": "timestamp", "x": "float"})


def test_one_start_names_one_period_of_the_spec(tmp_path, ledger, capsys):
    """``--interval 2024-01-02`` is the spec's period starting there; an instant inside a period, or a spec
    with neither period nor schedule, is refused naming the interval to give instead."""
    from dpops.cli.main import main
    from dpops.errors import InvalidParameter
    from dpops.noise.randomness import NoiseKey
    from dpops.spec import one_period_interval

    _three_day_file(tmp_path)
    spec_path = _spec(tmp_path)
    spec = load_spec(spec_path)
    t = lambda s: datetime.fromisoformat(s.replace("Z", "+00:00"))  # noqa: E731
    assert one_period_interval(spec, t("2024-01-02T00:00:00Z")) == (t("2024-01-02T00:00:00Z"),
                                                                      t("2024-01-03T00:00:00Z"))
    with pytest.raises(InvalidParameter, match="--interval 2024-01-02T00:00:00Z/2024-01-03T00:00:00Z"):
        one_period_interval(spec, t("2024-01-02T12:00:00Z"))
    doc = yaml.safe_load(spec_path.read_text())
    del doc["privacy_unit"]["period"], doc["schedule"]
    with pytest.raises(InvalidParameter, match="give START/END"):
        one_period_interval(parse_spec(doc, base_dir=tmp_path), t("2024-01-02T00:00:00Z"))

    (tmp_path / "secret").mkdir(mode=0o700)
    key = tmp_path / "secret" / "noise.key"
    NoiseKey.generate(key)
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    code = main(["release", "run", str(spec_path), "--interval", "2024-01-02", "--ledger", url,
                 "--key-file", str(key), "--no-gx-checks", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    (run,) = ledger.runs()
    assert (run.key.interval_start[:19], run.key.interval_end[:19]) == ("2024-01-02T00:00:00", "2024-01-03T00:00:00")
    assert main(["release", "run", str(spec_path), "--interval", "2024-01-02T05:00", "--ledger", url]) == 3
    assert "is not the start of a period" in capsys.readouterr().err
