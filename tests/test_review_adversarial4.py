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


def test_a_private_sample_replaced_after_its_read_was_recorded_is_not_tuned_on(tmp_path, monkeypatch, capsys):
    """``dpops tune --i-understand-this-reads-private-data``: the ledger entry records the sample's keyed
    fingerprint, then Beam workers read the sample BY NAME. A file renamed over it in between was tuned on, and the
    patch's provenance (and the ledger entry) named the fingerprint of other bytes. Now the statistics are
    discarded (exit 4, nothing written) when the sample no longer shows the snapshot taken before its fingerprint;
    the access stays recorded. Fails on the old code (exit 0, results written)."""
    import os

    import dpops.release.pipeline_seam as seam
    from test_tune_beam import BASE, frame, spec_file, write

    from dpops.cli.main import main
    from dpops.ledger import ScopeDefinition, open_ledger
    from dpops.noise.randomness import NoiseKey

    root = tmp_path / "data"
    (root / "data").mkdir(parents=True)
    spec = spec_file(root, BASE)
    path = write(frame(800, 4), root / "data" / "x.parquet")
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    with open_ledger(url) as led:
        led.create_scope(ScopeDefinition(name="shop", unit="a user", unit_column="user_id", epsilon=5.0, delta=1e-6,
                                         rho=None, accountant="basic/1", adjacency="add_remove"), actor="test")
    key = tmp_path / "keys" / "noise.key"
    key.parent.mkdir()
    NoiseKey.generate(key)
    for v in ("DPOPS_DATA_ROOTS", "DPOPS_PUBLIC_ROOTS", "DPOPS_NOISE_KEY_FILE", "DPOPS_LEDGER_URL",
              "DPOPS_OUTPUT_ROOTS"):
        monkeypatch.delenv(v, raising=False)
    real = seam.load_tune_statistics

    def swapping_loader():
        fn = real()

        def run(request):
            other = write(frame(900, 5), root / "data" / "other.parquet")
            os.replace(other, path)  # another file at the recorded sample's name, before the workers read it
            return fn(request)
        return run

    monkeypatch.setattr(seam, "load_tune_statistics", swapping_loader)
    out = tmp_path / "o"
    code = main(["--ledger", url, "tune", str(spec), "--sample", str(path), "--out", str(out),
                 "--i-understand-this-reads-private-data", "--reason", "bounds", "--key-file", str(key),
                 "--l0", "1", "--linf", "1", "--seed", "1"])
    err = capsys.readouterr().err
    assert code != 0 and "changed after its read was recorded" in err, err
    assert not (out / "results.json").exists()
    with open_ledger(url) as led:
        assert [e.kind for e in led.history("shop")].count("private_access") == 1


def _estimation_env(tmp_path, monkeypatch):
    import pandas as pd
    import yaml

    from dpops.ledger import ScopeDefinition, open_ledger
    from dpops.noise.randomness import NoiseKey

    for v in ("DPOPS_LEDGER_URL", "DPOPS_MANIFESTS_DIR", "DPOPS_NOISE_KEY_FILE", "DPOPS_OUTPUT_ROOTS",
              "DPOPS_PUBLIC_ROOTS"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "estimate_probe", "schedule": "0 0 * * *",
        "input": {"path": "data/{start:%Y-%m-%d}.parquet", "format": "parquet",
                  "columns": {"user_id": "string", "region": "string", "amount": "float"}},
        "privacy_unit": {"column": "user_id", "description": "a user", "adjacency": "add_remove"},
        "budget": {"scope": "shop", "epsilon": 0.5, "delta": 0},
        "contribution": {"max_partitions_per_unit": 1, "max_rows_per_unit_per_partition": 2},
        "partitions": {"columns": ["region"], "public": ["north", "south"]},
        "metrics": [{"type": "count"}, {"type": "sum", "column": "amount", "bounds": [0, 10]}]}))
    (tmp_path / "data").mkdir()

    def write(path, amounts):
        pd.DataFrame({"user_id": ["a", "b", "c"], "region": ["north", "south", "north"],
                      "amount": list(amounts)}).to_parquet(path)
        return path

    data = write(tmp_path / "data" / "2024-01-01.parquet", [1.0, 2.0, 3.0])
    key = tmp_path / "keys" / "noise.key"
    key.parent.mkdir()
    NoiseKey.generate(key)
    monkeypatch.setenv("DPOPS_DATA_ROOTS", str(tmp_path / "data"))
    led = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    led.create_scope(ScopeDefinition(name="shop", unit="a user", unit_column="user_id", epsilon=3.0, delta=1e-6,
                                     rho=None, accountant="basic/1", adjacency="add_remove"), actor="test")
    return spec, data, key, led, write


@pytest.mark.parametrize("when", ["before start", "during the read"])
def test_an_estimation_never_commits_bounds_of_an_input_other_than_its_run_keys(tmp_path, monkeypatch, when):
    """``dpops estimate`` (and ``bounds: estimate``) had no check of its input at all: prepare fingerprinted the
    interval's file (the run key and the manifest name that fingerprint), and the read after ``ledger.start`` took
    whatever file was there then. A file renamed over the input in between was estimated on and committed under
    the fingerprint of other bytes. Now the release's rule applies: before ``start`` the reservation is refunded,
    after the read nothing is committed (the run stays charged). Fails on the old code (committed)."""
    import os

    import dpops.release.estimation as estimation
    from dpops.analysis.estimate import EstimateConfig
    from dpops.errors import InputDataError
    from dpops.release.execute import estimate

    spec, data, key, led, write = _estimation_env(tmp_path, monkeypatch)

    def swap():
        os.replace(write(tmp_path / "data" / "other.parquet", [9.0, 9.0, 9.0]), data)

    hook = "start_estimation" if when == "before start" else "compute_estimation"
    real = getattr(estimation, hook)

    def swapping(*a, **k):
        if when == "before start":
            swap()
            return real(*a, **k)
        out = real(*a, **k)
        swap()  # after the read: stands for a file replaced while the workers read it
        return out

    monkeypatch.setattr(estimation, hook, swapping)
    try:
        with pytest.raises(InputDataError, match="input files changed since the run was prepared"):
            estimate(spec, "2024-01-01", "2024-01-02", config=EstimateConfig(epsilon=1.0), ledger=led,
                     key_path=str(key), engine="driver")
        (rec,) = led.runs()
        assert rec.state == ("released" if when == "before start" else "started")
    finally:
        led.close()
