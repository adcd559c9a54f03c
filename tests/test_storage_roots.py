"""Output and data roots as an operator allow-list (DPOPS_OUTPUT_ROOTS, DPOPS_DATA_ROOTS) and ``Location``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from dpops.dataroots import check_data_path, split_roots
from dpops.errors import SpecError
from dpops.spec import load_spec
from dpops.storage.location import Location, LocationError

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "daily_purchases.yaml"


def spec_with_root(tmp_path: Path, root: str) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["output"] = {"root": root}
    p = tmp_path / "daily.yaml"
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


def test_location_parse_and_join():
    loc = Location.parse("s3://Bucket//out/x/")
    assert (loc.scheme, loc.path, loc.uri) == ("s3", "Bucket/out/x", "s3://Bucket/out/x")
    assert str(loc / "published" / "v1") == "s3://Bucket/out/x/published/v1"
    assert Location.parse("file:///tmp/a/b") == Location.local("/tmp/a/b")
    assert Location.parse("rel/x", base=Location.local("/base")) == Location.local("/base/rel/x")
    for bad in ("s3://b/a/../c", "s3://b/./c", "s3://b/x?endpoint_override=evil", "s3://", "file://host/x"):
        with pytest.raises(LocationError):
            Location.parse(bad)
    with pytest.raises(LocationError):
        loc.join("../up")
    with pytest.raises(TypeError):
        os.fspath(loc)


def test_is_under_uses_segment_boundaries():
    root = Location.parse("s3://b/out")
    assert Location.parse("s3://b/out/x").is_under(root)
    assert Location.parse("s3://b/out").is_under(root)
    assert not Location.parse("s3://b/outside/x").is_under(root)
    assert not Location.parse("gs://b/out/x").is_under(root)
    assert not Location.local("/srv/outside").is_under(Location.local("/srv/out"))


def test_split_roots_commas_and_pathsep():
    assert split_roots("/a:/b") == ["/a", "/b"]
    assert split_roots("s3://b/data, /x:/y ,gs://c/d") == ["s3://b/data", "/x", "/y", "gs://c/d"]


@pytest.mark.parametrize("root", ["/srv/dpops-out/rel", "s3://bucket/dp/rel"])
def test_absolute_or_uri_root_refused_without_allow_list(tmp_path, monkeypatch, root):
    monkeypatch.delenv("DPOPS_OUTPUT_ROOTS", raising=False)
    with pytest.raises(SpecError) as info:
        load_spec(spec_with_root(tmp_path, root))
    msg = str(info.value)
    assert "daily.yaml" in msg and "output.root" in msg and root in msg and "DPOPS_OUTPUT_ROOTS" in msg


@pytest.mark.parametrize("allowed,root,ok", [
    ("s3://bucket/dp", "s3://bucket/dp/rel", True),
    ("s3://bucket/dp", "s3://bucket/dp", True),
    ("s3://bucket/dp", "s3://bucket/dpx/rel", False),      # not on a segment boundary
    ("s3://bucket/dp", "s3://other/dp/rel", False),
    ("s3://bucket/dp", "gs://bucket/dp/rel", False),
    ("/srv/a,s3://bucket/dp", "s3://bucket/dp/x", True),  # commas separate mixed entries
])
def test_uri_allow_list(tmp_path, monkeypatch, allowed, root, ok):
    monkeypatch.setenv("DPOPS_OUTPUT_ROOTS", allowed)
    path = spec_with_root(tmp_path, root)
    if ok:
        assert load_spec(path).output_root == Location.parse(root)
    else:
        with pytest.raises(SpecError, match="DPOPS_OUTPUT_ROOTS"):
            load_spec(path)


def test_local_allow_list_follows_symlinks(tmp_path, monkeypatch):
    allowed = tmp_path / "allowed"
    outside = tmp_path / "outside"
    allowed.mkdir(), outside.mkdir()
    (allowed / "link").symlink_to(outside)
    monkeypatch.setenv("DPOPS_OUTPUT_ROOTS", str(allowed))
    assert load_spec(spec_with_root(tmp_path, str(allowed / "rel"))).output_root == Location.local(allowed / "rel")
    with pytest.raises(SpecError, match="DPOPS_OUTPUT_ROOTS"):
        load_spec(spec_with_root(tmp_path, str(allowed / "link" / "rel")))  # resolves outside
    with pytest.raises(SpecError, match="must not contain"):
        load_spec(spec_with_root(tmp_path, str(allowed) + "/../outside"))


def test_allow_list_entries_are_checked(tmp_path, monkeypatch):
    for bad in (f"{tmp_path}/a/../b", "s3://bucket/a/../b", "relative/dir"):
        monkeypatch.setenv("DPOPS_OUTPUT_ROOTS", bad)
        with pytest.raises(SpecError, match="DPOPS_OUTPUT_ROOTS"):
            load_spec(spec_with_root(tmp_path, "s3://bucket/b/x"))


def test_relative_root_needs_no_allow_list(tmp_path, monkeypatch):
    monkeypatch.delenv("DPOPS_OUTPUT_ROOTS", raising=False)
    assert load_spec(spec_with_root(tmp_path, "out/x")).output_root == Location.local(tmp_path / "out/x")


def test_data_roots_accept_uri_prefixes(tmp_path, monkeypatch):
    monkeypatch.setenv("DPOPS_DATA_ROOTS", f"s3://bucket/data,{tmp_path}")
    assert check_data_path(Location.parse("s3://bucket/data/2024/a.csv"), "input.path", source="s.yaml",
                           spec_dir=None) == "s3://bucket/data/2024/a.csv"
    assert check_data_path(tmp_path / "x.csv", "input.path", source="s.yaml", spec_dir=None) == str(
        (tmp_path / "x.csv").resolve())
    for bad in ("s3://bucket/database/a.csv", "s3://other/data/a.csv"):
        with pytest.raises(SpecError, match="outside the allowed data roots"):
            check_data_path(Location.parse(bad), "input.path", source="s.yaml", spec_dir=None)
    monkeypatch.setenv("DPOPS_DATA_ROOTS", os.pathsep.join([str(tmp_path / "a"), str(tmp_path / "b")]))
    check_data_path(tmp_path / "b" / "f.csv", "input.path", source="s.yaml", spec_dir=None)


def test_file_uri_root_is_the_local_backend(tmp_path, monkeypatch):
    from dpops.storage import ReleaseStore, open_store

    monkeypatch.setenv("DPOPS_OUTPUT_ROOTS", (tmp_path / "allowed").as_uri())
    spec = load_spec(spec_with_root(tmp_path, (tmp_path / "allowed" / "rel").as_uri()))
    assert spec.output_root == Location.local(tmp_path / "allowed" / "rel")
    assert isinstance(open_store(spec.output_root, spec.name), ReleaseStore)
    monkeypatch.setenv("DPOPS_OUTPUT_ROOTS", str(tmp_path / "elsewhere"))
    with pytest.raises(SpecError, match="DPOPS_OUTPUT_ROOTS"):
        load_spec(spec_with_root(tmp_path, (tmp_path / "allowed" / "rel").as_uri()))
