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
