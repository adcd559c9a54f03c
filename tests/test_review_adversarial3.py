"""Adversarial privacy review (review3) of what landed in 5b0945e..db7180c: one test per finding.

Each test fails on the code before its fix (checked when it was written) and names the finding in its docstring.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from fuzz_support import examples
from hypothesis import example, given, settings
from hypothesis import strategies as st

import dpops.release_plan
from dpops.noise.selection import histogram_quantile_utility

REAL_PLAN = dpops.release_plan.plan_release  # cli_support.make_env plants a stand-in; tune and simulate use the real one

# --------------------------------------------------------------------------- finding 1: quantile utility overflow

# A quantile with a large decimal denominator (q = 0.123456789: d = 10^9) and a partition of 1.2e10 bounded rows:
# d * rank passes 2^63 and int64 wraps.
BIG_D_Q = 0.123456789


def exact_utility(hist: list[int], q: float) -> tuple[list[int], int]:
    """-|d rank - a n| in Python integers (never wraps): the utility the mechanism's sensitivity is argued for."""
    f = Fraction(repr(float(q))).limit_denominator(10**9)
    ranks, acc = [], 0
    for c in hist:
        acc += int(c)
        ranks.append(acc)
    return [-abs(f.denominator * r - f.numerator * acc) for r in ranks], int(f.denominator)


@settings(max_examples=examples(200))
@given(hist=st.lists(st.integers(0, 2**40), min_size=1, max_size=12),
       q=st.sampled_from([0.5, 0.9, 0.001, 0.123456789, 0.3333333, 0.987654321]))
@example(hist=[0, 0, 6_000_000_000, 0, 0, 6_000_000_000, 0, 0], q=BIG_D_Q)
@example(hist=[0, 0, 6_000_000_000, 0, 0, 90_000_000_000], q=BIG_D_Q)
def test_quantile_utilities_are_exact_integers_whatever_the_partition_size(hist, q):
    """Finding 1 (severity 2, correctness; pipelines.aggregate via dpops.noise.selection.histogram_quantile_utility):
    the utility -|d rank - a n| was computed in int64, so (d - a) n wrapped past 2^63 (q = 0.123456789 over
    1.2e10 bounded rows in one partition: the far cells looked near, a wrong quantile published) or turned to
    float64 once a n left int64 (inexact: the mechanism left its exact integer path). The wrap is folded by the
    absolute value, so one unit still moved a utility by at most d * Delta (checked, not a DP violation); the
    published pick was simply not the mechanism on the spec's utility. The utilities must equal the exact
    integers for any histogram the data can produce."""
    util, d = histogram_quantile_utility(np.asarray(hist, dtype=np.int64), q)
    want, want_d = exact_utility(hist, q)
    assert d == want_d
    got = [int(x) for x in np.asarray(util).tolist()]
    assert all(isinstance(x, (int, np.integer)) for x in np.asarray(util).tolist())
    assert got == want


# --------------------------------------------------------------------------- finding 2: analysis outputs where data is published


def _tune_env(tmp_path, monkeypatch):
    from cli_support import make_env

    for v in ("DPOPS_DATA_ROOTS", "DPOPS_OUTPUT_ROOTS", "DPOPS_PUBLIC_ROOTS"):
        monkeypatch.delenv(v, raising=False)
    return make_env(tmp_path, monkeypatch, cap=5.0)


def _private_tune(env, capsys, out):
    from dpops.cli.main import main

    code = main(["--ledger", env.url, "tune", str(env.spec), "--sample", str(env.root / "data" / "2024-01-01.parquet"),
                 "--i-understand-this-reads-private-data", "--reason", "review", "--key-file", str(env.key),
                 "--l0", "1", "--linf", "1,2", "--out", str(out)])
    return code, capsys.readouterr().err


def _private_accesses(env) -> int:
    from dpops.ledger import open_ledger

    with open_ledger(env.url) as led:
        return sum(1 for e in led.history("shop") if e.kind == "private_access")


def test_tune_on_private_data_refuses_an_out_under_the_specs_output_root(tmp_path, monkeypatch, capsys):
    """Finding 2 (severity 2, dpops/cli/tune.py): ``dpops tune --i-understand-this-reads-private-data`` wrote its
    results.json and tune.html (rows dropped, partitions kept, sample rows: exact, not DP, functions of the
    private rows) to any ``--out``, also under the spec's ``output.root`` where staged and published outputs are
    read by the release's consumers. It must be refused before the private read is recorded or done."""
    env = _tune_env(tmp_path, monkeypatch)
    monkeypatch.setattr(dpops.release_plan, "plan_release", REAL_PLAN)
    out = env.root / "out" / "tune"  # the spec's output.root is "out" beside the spec
    code, err = _private_tune(env, capsys, out)
    assert code == 3 and "output.root" in err, err
    assert not out.exists()
    assert _private_accesses(env) == 0  # refused before the ledger records a read that did not happen


def test_tune_on_private_data_refuses_an_out_under_an_operator_output_or_public_root(tmp_path, monkeypatch, capsys):
    """Finding 2, for tune: the same for the operator's other published places: every ``$DPOPS_OUTPUT_ROOTS`` entry (other
    releases' staged and published outputs) and every ``$DPOPS_PUBLIC_ROOTS`` entry (files read as public data,
    published verbatim as partition labels from a publishable one)."""
    env = _tune_env(tmp_path, monkeypatch)
    monkeypatch.setattr(dpops.release_plan, "plan_release", REAL_PLAN)
    published, public = tmp_path / "published", tmp_path / "public"
    published.mkdir()
    public.mkdir()
    monkeypatch.setenv("DPOPS_DATA_ROOTS", str(tmp_path / "data"))  # apart from the public root
    monkeypatch.setenv("DPOPS_OUTPUT_ROOTS", str(published))
    monkeypatch.setenv("DPOPS_PUBLIC_ROOTS", str(public))
    for out, needle in ((published / "other_release" / "tune", "DPOPS_OUTPUT_ROOTS"),
                        (public / "tune", "DPOPS_PUBLIC_ROOTS")):
        code, err = _private_tune(env, capsys, out)
        assert code == 3 and needle in err, err
        assert not out.exists()
    assert _private_accesses(env) == 0


def test_simulate_refuses_an_out_under_an_operator_output_or_public_root(tmp_path, monkeypatch, capsys):
    """Finding 2, for simulate: its outputs are marked not publishable (test-mode draws), yet only its own spec's
    ``output.root`` was refused; an operator output root or a public root took them."""
    import pandas as pd

    from dpops.cli.main import main

    env = _tune_env(tmp_path, monkeypatch)
    monkeypatch.setattr(dpops.release_plan, "plan_release", REAL_PLAN)
    published, public = tmp_path / "published", tmp_path / "public"
    published.mkdir()
    public.mkdir()
    monkeypatch.setenv("DPOPS_DATA_ROOTS", str(tmp_path / "data"))  # apart from the public root
    monkeypatch.setenv("DPOPS_OUTPUT_ROOTS", str(published))
    monkeypatch.setenv("DPOPS_PUBLIC_ROOTS", str(public))

    sample = public / "sample.parquet"  # a public (synthetic) sample, not the spec's input
    pd.DataFrame({"user_id": [f"s{i}" for i in range(40)], "region": ["north", "south"] * 20,
                  "amount": [float(i % 10) for i in range(40)]}).to_parquet(sample)
    for out, needle in ((published / "sim", "DPOPS_OUTPUT_ROOTS"), (public / "sim", "DPOPS_PUBLIC_ROOTS")):
        code = main(["simulate", str(env.spec), "--sample", str(sample), "--draws", "5", "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 3 and needle in err, err
        assert not out.exists()


# --------------------------------------------------------------------------- finding 3: a staging that cannot exist, found after the charge


def test_a_local_staging_that_cannot_be_created_is_refused_before_anything_is_reserved(tmp_path, monkeypatch):
    """Finding 3 (severity 3, dpops/release/estimation.py ``PipelineCounts._pass``): ``dpops estimate --staging DIR``
    was checked for where it lies (``check_scratch_location``) before the reservation, but created only in the
    first Beam pass, after ``ledger.start``: a DIR below a regular file (or unwritable) failed the run with its
    charge kept and nothing computed. It must be refused with the ledger untouched."""
    from dpops.analysis.estimate import EstimateConfig
    from dpops.errors import DpopsError
    from dpops.ledger import open_ledger
    from dpops.release.estimation import EstimationEngine
    from dpops.release.execute import estimate

    import pandas as pd
    import yaml

    from dpops.ledger import ScopeDefinition
    from dpops.noise.randomness import NoiseKey

    for v in ("DPOPS_LEDGER_URL", "DPOPS_MANIFESTS_DIR", "DPOPS_NOISE_KEY_FILE", "DPOPS_OUTPUT_ROOTS",
              "DPOPS_PUBLIC_ROOTS"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "staging_probe", "schedule": "0 0 * * *",
        "input": {"path": "data/{start:%Y-%m-%d}.parquet", "format": "parquet",
                  "columns": {"user_id": "string", "region": "string", "amount": "float"}},
        "privacy_unit": {"column": "user_id", "description": "a user", "adjacency": "add_remove"},
        "budget": {"scope": "shop", "epsilon": 0.5, "delta": 0},
        "contribution": {"max_partitions_per_unit": 1, "max_rows_per_unit_per_partition": 2},
        "partitions": {"columns": ["region"], "public": ["north", "south"]},
        "metrics": [{"type": "count"}, {"type": "sum", "column": "amount", "bounds": [0, 10]}]}))
    (tmp_path / "data").mkdir()
    pd.DataFrame({"user_id": ["a", "b", "c"], "region": ["north", "south", "north"],
                  "amount": [1.0, 2.0, 3.0]}).to_parquet(tmp_path / "data" / "2024-01-01.parquet")
    key = tmp_path / "keys" / "noise.key"
    key.parent.mkdir()
    NoiseKey.generate(key)
    monkeypatch.setenv("DPOPS_DATA_ROOTS", str(tmp_path / "data"))  # the staging lies apart from every root
    (tmp_path / "blocker").write_text("a regular file")
    with open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}") as led:
        led.create_scope(ScopeDefinition(name="shop", unit="a user", unit_column="user_id", epsilon=3.0, delta=1e-6,
                                         rho=None, accountant="basic/1", adjacency="add_remove"), actor="test")
        eng = EstimationEngine(staging=str(tmp_path / "blocker" / "scratch"))
        with pytest.raises(DpopsError, match="--staging"):
            estimate(spec, "2024-01-01", "2024-01-02", config=EstimateConfig(epsilon=1.0), ledger=led,
                     key_path=str(key), engine=eng)
        assert led.runs() == []


# --------------------------------------------------------------------------- finding 4: the sample is checked, then opened again by name


def _swap_env(tmp_path, monkeypatch):
    """spec/ (the data root) with a 5,000-unit private input; public/ with a 2-row public sample; the sample check
    planted to replace the sample by a symlink to the private input right after it passes."""
    import os

    import pandas as pd
    from test_simulate import SPEC, sample

    import dpops.analysis.sample_access as access_mod
    from dpops.analysis.loading import load

    for v in ("DPOPS_DATA_ROOTS", "DPOPS_LEDGER_URL", "DPOPS_NOISE_KEY_FILE", "DPOPS_OUTPUT_ROOTS"):
        monkeypatch.delenv(v, raising=False)
    spec_dir, pub = tmp_path / "spec", tmp_path / "public"
    (spec_dir / "data").mkdir(parents=True)
    pub.mkdir()
    (spec_dir / "spec.yaml").write_text(SPEC.replace("LINF", "3"), encoding="utf-8")
    private = spec_dir / "data" / "2024-01-01.csv"
    sample(seed=7, sizes=(5000,)).to_csv(private, index=False)  # one region, 5,000 units: told apart by its size
    public_sample = pub / "sample.csv"
    pd.DataFrame({"user_id": ["p1", "p2"], "region": ["r0", "r0"], "amount": [1.0, 2.0]}).to_csv(public_sample,
                                                                                                 index=False)
    monkeypatch.setenv("DPOPS_PUBLIC_ROOTS", str(pub))
    checked = access_mod.check_public_sample

    def check_then_swap(*a, **k):
        out = checked(*a, **k)
        public_sample.unlink()
        os.symlink(private, public_sample)  # after the check, before the read
        return out

    monkeypatch.setattr(access_mod, "check_public_sample", check_then_swap)
    return load(spec_dir / "spec.yaml"), public_sample


def test_a_sample_swapped_for_the_private_input_after_its_check_is_not_read_by_simulate(tmp_path, monkeypatch):
    """Finding 4 (severity 2, pipelines/release_pipeline.py ``sample_truth``; dpops/analysis/tuning.py ``tune``): the
    time-of-check/time-of-use gap that issue 25 item 11 closed for ``partitions.public_file``. The sample's path
    was checked and then opened again by name, so a writer of a public root could swap the checked file for a
    symlink into the data root in between: the old code aggregated the private input's 5,000 units exactly.
    The pass must refuse (the held file is checked again)."""
    from dpops.errors import SpecError
    from dpops.release.pipeline_seam import SampleTruthRequest, load_sample_truth

    spec, public_sample = _swap_env(tmp_path, monkeypatch)
    with pytest.raises(SpecError, match="data root"):
        load_sample_truth()(SampleTruthRequest(spec, str(public_sample), "csv", 1))


def test_a_sample_swapped_for_the_private_input_after_its_check_is_not_read_by_tune(tmp_path, monkeypatch):
    """Finding 4, for ``dpops tune`` on a public sample: the same swap must be refused, not tuned on."""
    from dpops.analysis.tuning import tune
    from dpops.errors import SpecError

    spec, public_sample = _swap_env(tmp_path, monkeypatch)
    with pytest.raises(SpecError, match="data root"):
        tune(spec, str(public_sample), seed=1)
