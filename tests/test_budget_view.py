"""dpops.budget_view without Airflow: the manifest download's id check, and the page model against the ledger."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from fuzz_support import examples

from dpops.budget_view import budget_page, manifest_file, render_page
from dpops.errors import DpopsError
from dpops.ledger.budget import format_budget
from dpops.manifest import write_manifest
from manifest_support import ACTOR, make_ledger, run_key, synthetic_events, synthetic_manifest


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("bv")
    mdir = root / "manifests"
    mdir.mkdir()
    (root / "secret.txt").write_text("dpops-noise-key v1\n")
    good = "0123456789abcdef" * 2
    (mdir / f"{good}.published.json").write_text("{}\n")
    os.symlink(root / "secret.txt", mdir / ("e" * 32 + ".published.json"))
    (mdir / ("d" * 32 + ".txt")).write_text("not a manifest\n")
    return root, mdir, good


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.text(max_size=80), st.sampled_from(["../secret.txt", "..", "e" * 32, "d" * 32, "*", "?" * 32,
                                                          "[0-9a-f]" * 4, "0123456789abcdef" * 2 + "/.."])))
def test_manifest_file_serves_only_manifests_inside_the_directory(tree, run_id):
    """An adversary picks the id: either it is refused, or the file is a real manifest inside the directory."""
    root, mdir, good = tree
    try:
        p = manifest_file(mdir, run_id)
    except DpopsError:
        return
    assert run_id == good
    assert p.resolve().parent == mdir.resolve() and not p.is_symlink() and p.name.endswith(".json")


def test_manifest_file_refuses_a_symlink_named_like_a_manifest(tree):
    _, mdir, _ = tree
    with pytest.raises(DpopsError):
        manifest_file(mdir, "e" * 32)


def test_page_figures_are_ledger_status_formatted(tmp_path: Path):
    ledger = make_ledger(tmp_path, accountant="rdp/1", epsilon=1.0, delta=1e-7)
    mdir = tmp_path / "manifests"
    for i in range(36):
        key = run_key("daily_a", i)
        try:
            rec = ledger.reserve(key, "purchases", synthetic_events(sigma=25.0), actor=ACTOR)
        except DpopsError as exc:
            write_manifest(synthetic_manifest("refused", key=key, reason=str(exc)), mdir)
            continue
        ledger.start(rec.run_id, actor=ACTOR)
        if i % 7 != 3:  # some runs stay started (in flight)
            ledger.commit(rec.run_id, output_uri=f"file:///out/{i}", actor=ACTOR)
    page = budget_page(ledger, mdir, [])
    st_ = ledger.status("purchases")
    (row,) = page.scopes
    assert (row.committed, row.started, row.total, row.remaining) == (st_.committed, st_.started, st_.total,
                                                                    st_.remaining)
    spend = page.spend["purchases"]
    assert format_budget(spend[-1].total, st_.cap) == format_budget(st_.total, st_.cap)
    assert [p.total for p in spend] == sorted(p.total for p in spend), "a scope total never decreases"
    text = render_page(page)
    assert f'data-field="total">{format_budget(st_.total, st_.cap)}<' in text
    assert "<script" not in text and not re.search(r"(src|href)=\"https?:", text), "no external resource"
    assert any(o.status == "refused" for o in page.open_intervals)
    ledger.close()


def test_budget_view_imports_no_airflow():
    """The page model is dpops's: importing it must not pull Airflow into dpops (layers stay clean)."""
    import subprocess
    import sys

    code = ("import sys, dpops.budget_view; bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('airflow', 'apache_beam', 'fastapi')); assert not bad, bad")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert p.returncode == 0, p.stderr[-2000:]


def test_page_and_download_show_only_what_the_reader_may_read(tmp_path: Path):
    """Issue 25 item 11: a reader allowed one release DAG sees that release's manifests and refusals only,
    downloads no other release's manifest, and sees no figure of a scope that also composes a DAG it may not
    read (the total would tell how much the other release spent); a scope none of whose DAGs it may read is
    not even named. A reader allowed every DAG of the scope sees its figures."""
    from dpops.ledger import ScopeDefinition

    ledger = make_ledger(tmp_path, accountant="rdp/1", epsilon=1.0, delta=1e-7)
    ledger.create_scope(ScopeDefinition(name="hidden_scope", unit="a user's visits on one day", unit_column="user_id",
                                        epsilon=1.0, delta=1e-7, rho=None, accountant="rdp/1",
                                        population=1_000_000, adjacency="add_remove"), actor=ACTOR)
    mdir = tmp_path / "manifests"
    ids: dict[str, list[str]] = {"daily_a": [], "daily_b": []}
    for i in range(4):
        for release in ids:
            key = run_key(release, i)
            rec = ledger.reserve(key, "purchases", synthetic_events(sigma=25.0), actor=ACTOR)
            ledger.start(rec.run_id, actor=ACTOR)
            ledger.commit(rec.run_id, output_uri=f"file:///out/{release}/{i}", actor=ACTOR)
            write_manifest(synthetic_manifest("published", key=key), mdir)
            ids[release].append(rec.run_id)
    refused_b = run_key("daily_b", 9)
    write_manifest(synthetic_manifest("refused", key=refused_b, reason="budget refused"), mdir)
    rec = ledger.reserve(run_key("daily_c", 0), "hidden_scope", synthetic_events(sigma=25.0), actor=ACTOR)

    only_a = lambda dag_ids: dag_ids & {"dpops_daily_a"}  # noqa: E731 - a reader granted DAG:dpops_daily_a
    page = budget_page(ledger, mdir, [], readable=only_a)
    assert {r.release for r in page.manifests} == {"daily_a"} and len(page.manifests) == 4
    assert page.scopes == [] and page.spend == {}
    assert not any(o.release != "daily_a" for o in page.open_intervals)
    text = render_page(page)
    assert "daily_b" not in text and "hidden_scope" not in text and "daily_c" not in text
    assert all(i[:12] not in text for i in ids["daily_b"]) and refused_b.run_id[:12] not in text
    assert "scope purchases: its figures are not shown" in text and "1 more scope(s) not shown" in text
    assert manifest_file(mdir, ids["daily_a"][0], readable=only_a).name.startswith(ids["daily_a"][0])
    for other in (ids["daily_b"][0], refused_b.run_id):
        with pytest.raises(DpopsError, match="no manifest for run"):
            manifest_file(mdir, other, readable=only_a)

    both = lambda dag_ids: dag_ids & {"dpops_daily_a", "dpops_daily_b"}  # noqa: E731
    page = budget_page(ledger, mdir, [], readable=both)
    assert [s.scope for s in page.scopes] == ["purchases"] and len(page.manifests) == 9
    assert any(o.status == "refused" and o.release == "daily_b" for o in page.open_intervals)
    assert "hidden_scope" not in render_page(page)
    # no reader restriction (the CLI's and the tests' callers): everything, as before
    assert [s.scope for s in budget_page(ledger, mdir, []).scopes] == ["hidden_scope", "purchases"]
    assert rec.run_id
    ledger.close()


def test_run_tab_describes_the_dag_run_it_sits_on(tmp_path: Path):
    """Issue 28 item 2: a refused DAG run's tab shows its refusal, not the interval's later restatement as its
    own "committed"; a DAG run that has not reserved says the run shown may be another DAG run's."""
    from dpops.budget_view import DagRunOutcome, run_view

    ledger = make_ledger(tmp_path, accountant="rdp/1", epsilon=1.0, delta=1e-7)
    mdir = tmp_path / "manifests"
    first = run_key("daily_a", 0)
    rec = ledger.reserve(first, "purchases", synthetic_events(sigma=25.0), actor=ACTOR)
    ledger.start(rec.run_id, actor=ACTOR)
    ledger.commit(rec.run_id, output_uri="file:///out/a/0", actor=ACTOR)
    write_manifest(synthetic_manifest("published", key=first), mdir)
    refused = run_key("daily_a", 0, variant="late")  # a restatement the cap refused (a backfill's DAG run)
    write_manifest(synthetic_manifest("refused", key=refused, reason="budget refused"), mdir)
    later = run_key("daily_a", 0, variant="later")  # a later restatement, by another DAG run, published
    r2 = ledger.reserve(later, "purchases", synthetic_events(sigma=25.0), actor=ACTOR, restates=rec.run_id)
    ledger.start(r2.run_id, actor=ACTOR)
    ledger.commit(r2.run_id, output_uri="file:///out/a/0/v2", actor=ACTOR)
    s, e = first.interval_start, first.interval_end

    view = run_view(ledger, mdir, "dpops_daily_a", s, e, outcome=DagRunOutcome(refused.run_id, "refused"))
    assert (view.run_id, view.state) == (refused.run_id, "refused")
    assert view.manifest == f"{refused.run_id}.refused.json"
    mine = run_view(ledger, mdir, "dpops_daily_a", s, e, outcome=DagRunOutcome(rec.run_id, "reserved"))
    assert (mine.run_id, mine.state) == (rec.run_id, "committed")  # the first publication, not the later one
    unknown = run_view(ledger, mdir, "dpops_daily_a", s, e)
    assert unknown.run_id == r2.run_id and "another DAG run" in unknown.note
    nothing = run_view(ledger, mdir, "dpops_daily_a", None, None, note="this DAG run releases no interval: x")
    assert nothing.run_id is None and nothing.note.endswith("x")
    ledger.close()


def test_run_interval_is_resolved_as_the_dag_does(tmp_path: Path):
    """Issue 28 items 2 and 5: the one rule (``dpops.run_interval``) the DAG, the tab and the alerts share."""
    from datetime import UTC, datetime

    from dpops.run_interval import resolve_run_interval
    from manifest_support import EXAMPLE_SPEC

    day = ("2024-01-03T00:00:00+00:00", "2024-01-04T00:00:00+00:00")
    rest = dict(data_interval_start=None, data_interval_end=None, logical_date=None)
    assert resolve_run_interval(EXAMPLE_SPEC, **rest, named="2024-01-03") == day
    assert resolve_run_interval(None, **rest, named="2024-01-03/2024-01-04") == day
    sched = dict(data_interval_start=datetime(2024, 1, 3, tzinfo=UTC), data_interval_end=datetime(2024, 1, 4, tzinfo=UTC))
    assert resolve_run_interval(EXAMPLE_SPEC, **sched, logical_date=sched["data_interval_start"]) == day
    assert resolve_run_interval(EXAMPLE_SPEC, data_interval_start=day[0], data_interval_end=day[1]) == day
    for bad in (dict(**rest), dict(**rest, named="soon"), dict(**sched, named="2024-01-05"),
                dict(**sched, logical_date=datetime(2024, 1, 1, tzinfo=UTC))):
        with pytest.raises(DpopsError, match="nothing was read, reserved or charged"):
            resolve_run_interval(EXAMPLE_SPEC, **bad)
