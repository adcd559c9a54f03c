"""Adversarial privacy review (review4) of what landed in 434a666..2cbb43c: tests of the findings that have no
better home (the others sit beside the code's own tests: test_basic2_accountant, test_small_gaps,
test_spec_property, test_ledger_roles_property, test_analysis_tune).

Each test fails on the code before its fix (checked when it was written) and names the finding in its docstring.
"""

from __future__ import annotations

import pytest

from dpops.dataroots import check_scratch_location
from dpops.errors import SpecError
from dpops.storage.location import Location


def test_a_scratch_under_another_releases_output_root_is_refused(tmp_path, monkeypatch):
    """``check_scratch_location`` (``estimate --staging``, ``tune --staging``) refused the spec's own output.root but
    not the other entries of ``$DPOPS_OUTPUT_ROOTS``, where every release's staged and published outputs are read:
    the passes' scratch (the interval's rows and exact counts) could be written where another release's consumers
    read. ``check_analysis_out`` already refused those roots for tune's and simulate's outputs."""
    for v in ("DPOPS_PUBLIC_ROOTS", "DPOPS_NOISE_KEY_FILE"):
        monkeypatch.delenv(v, raising=False)
    shared = tmp_path / "srv-out"
    (shared / "other_release").mkdir(parents=True)
    (tmp_path / "data").mkdir()
    monkeypatch.setenv("DPOPS_DATA_ROOTS", str(tmp_path / "data"))
    monkeypatch.setenv("DPOPS_OUTPUT_ROOTS", str(shared))
    mine = Location.local(str(tmp_path / "mine-out"))
    with pytest.raises(SpecError, match="DPOPS_OUTPUT_ROOTS"):
        check_scratch_location(str(shared / "other_release" / "scratch"), "--staging", source="spec.yaml",
                               spec_dir=str(tmp_path), output_root=mine)
    ok = check_scratch_location(str(tmp_path / "scratch"), "--staging", source="spec.yaml", spec_dir=str(tmp_path),
                                output_root=mine)
    assert ok.local_path is not None
