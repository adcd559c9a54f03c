"""Issue 21 "Proof": the scripted year of a deployment, shortened to 12 daily intervals (every event kept).

Runs ``benchmarks/year_in_the_life.py`` (documented CLI commands in forked children, SQLite ledger, the
embedded Beam runner) and asserts its end state: the report shows no FAILED and no warning, the
ledger verifies, ``dpops gaps`` lists exactly the days left open on purpose, and each scope is charged
exactly what its runs should cost (a served repeat is free; a restatement and a fresh attempt after a
spent run are charged again, on their own day's bucket only).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import year_in_the_life as yl  # noqa: E402

DAYS = 12


@pytest.fixture(scope="module")
def year(tmp_path_factory):
    return yl.run(DAYS, tmp_path_factory.mktemp("year"))


def test_gaps_list_exactly_the_days_left_open(year):
    items = [g for g in year["gaps"]["items"] if g["gap"]]
    assert sorted(g["interval_start"][:10] for g in items) == year["open_days"]
    assert all(g["status"] == "never_run" for g in items), items
    assert year["gaps"]["counts"]["published"] == DAYS - len(year["open_days"])
    assert year["users_gaps"]["gaps"] == 0, year["users_gaps"]


def test_every_event_brought_to_published(year):
    assert year["published"] == DAYS - len(year["open_days"])
    assert year["refunded_then_published"] == 1 and year["spent_then_published"] == 1
    assert year["restated"] == 1
    assert year["refused_then_published"] == yl.USER_DAYS - int(yl.USER_CAP / yl.USER_EPS)
    assert len(set(year["key_ids"])) == 2


def test_charges_are_exactly_what_the_runs_cost(year):
    users = year["status"]["users"]
    assert users["total"] == pytest.approx(yl.USER_DAYS * yl.USER_EPS)
    buckets = {b["bucket"]: b["sum_of_runs"] for b in year["status"]["daily"]["buckets"]}
    # every published day once; the restated day and the spent-then-fresh day twice; open days nothing
    assert len(buckets) == year["published"]
    assert sum(buckets.values()) == pytest.approx((year["published"] + 2) * yl.DAILY_EPS)
    assert sorted(v for v in buckets.values() if v > 1.5 * yl.DAILY_EPS) == pytest.approx([2 * yl.DAILY_EPS] * 2)


def test_ledger_verifies(year):
    assert year["verify"].startswith("ledger OK") or "ledger OK" in year["verify"], year["verify"]


def test_user_scope_report_is_clean(year):
    assert not [f for f in yl.findings(year) if f.startswith("report users")]


def test_report_and_status_are_clean_after_the_key_rotation(year):
    """Versions bound under the pre-rotation key are 'not checked' with the new key, never FAILED; a
    refunded day's new attempt (key id '<id>/retry-N') is no key change; the declared rotation is the
    report's only warning."""
    assert yl.findings(year) == []
