"""docs/spec.md is generated from the spec models and documents every field (issue 26 section 4).

Three ways it could go stale, each a test: a model field with no description, a description of a field
that is gone, and a page that differs from what the models generate today."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from pydantic import BaseModel

from dpops import spec as S
from dpops import spec_reference as ref
from dpops.cli.main import cli

PAGE = Path(__file__).resolve().parents[1] / "docs" / "spec.md"


def test_every_field_is_described_and_every_description_names_a_field() -> None:
    assert ref.missing_docs() == []
    assert all(r.doc for r in ref.rows())


def _models(tp: object, seen: set[type]) -> None:
    """Every BaseModel reachable from a type annotation (through unions, lists, maps, Annotated)."""
    from typing import get_args

    if isinstance(tp, type) and issubclass(tp, BaseModel):
        if tp in seen:
            return
        seen.add(tp)
        for f in tp.model_fields.values():
            _models(f.annotation, seen)
        return
    for a in get_args(tp):
        _models(a, seen)


def test_every_model_reachable_from_the_spec_has_a_section() -> None:
    """A new nested section (a model reachable from ReleaseSpec) must be listed in SECTIONS."""
    reachable: set[type] = set()
    _models(S.ReleaseSpec, reachable)
    assert reachable == {m for _, _, m, _ in ref.SECTIONS}


def test_the_page_is_what_the_models_generate() -> None:
    assert PAGE.read_text(encoding="utf-8") == ref.render() + "\n", (
        "docs/spec.md is stale: run `dpops spec reference --out docs/spec.md`")


def test_a_new_undocumented_field_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: drop one description and it names the field."""
    docs = dict(ref.FIELD_DOCS)
    docs.pop(("postprocess", "suppress_below"))
    monkeypatch.setattr(ref, "FIELD_DOCS", docs)
    assert ref.missing_docs() == ["postprocess: suppress_below has no description"]


def test_reference_command_writes_the_page(tmp_path: Path) -> None:
    out = tmp_path / "spec.md"
    res = CliRunner().invoke(cli, ["spec", "reference", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert out.read_text(encoding="utf-8") == PAGE.read_text(encoding="utf-8")
    printed = CliRunner().invoke(cli, ["spec", "reference"])
    assert printed.exit_code == 0 and printed.output == PAGE.read_text(encoding="utf-8")
    # the page names postprocess, which no other document described (the example)
    assert "`postprocess.suppress_below`" in printed.output
