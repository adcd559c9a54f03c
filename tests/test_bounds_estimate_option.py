"""``bounds: estimate`` (issue 20 section 4): a metric whose value bounds are estimated under DP at run time.

Through the real CLI (``release run``, ``ledger status``, ``manifest verify``, ``spec check``) with the
cli_support stand-in for the Beam job (the FakePipeline); the plan, the estimation (``dpops estimate``'s
own function: the release's reader and bounding, the exponential mechanism), the ledger and the manifests
are the real ones.
"""

from __future__ import annotations

import json
import math

import pytest
import yaml
from cli_support import make_env

from dpops.ledger import open_ledger
from dpops.release_plan import plan_release

TOTAL = 0.6  # declared budget.epsilon of one interval
SPLIT = {"count": 1.0, "sum_amount": 1.0, "sum_amount.bounds": 1.0}  # the estimation gets TOTAL / 3


def _option_env(tmp_path, monkeypatch, cap=1.5):
    e = make_env(tmp_path, monkeypatch, cap=cap, planner_fn=plan_release)  # the real plan, the stand-in Beam job
    doc = yaml.safe_load(e.spec.read_text())
    doc["budget"] = {**doc["budget"], "epsilon": TOTAL, "split": dict(SPLIT)}
    doc["metrics"] = [{"type": "count"},
                      {"type": "sum", "column": "amount", "bounds": "estimate", "fallback_bounds": [0, 10]}]
    e.spec.write_text(yaml.safe_dump(doc))
    return e


def _status(e):
    with open_ledger(e.url) as led:
        return float(led.status("shop").total), [(r.key.release, r.state, r.epsilon) for r in led.runs(scope="shop")]


def _write(e, **changes):
    doc = yaml.safe_load(e.spec.read_text())
    doc.update(changes)
    e.spec.write_text(yaml.safe_dump(doc))


def test_spec_check_refuses_an_option_without_its_share_and_a_share_without_the_option(tmp_path, monkeypatch, capsys):
    e = _option_env(tmp_path, monkeypatch)
    code, out, err = e.run(capsys, "spec", "check", str(e.spec))
    assert code == 0, err
    doc = yaml.safe_load(e.spec.read_text())
    no_share = {**doc, "budget": {**doc["budget"], "split": {"count": 1, "sum_amount": 1}}}
    e.spec.write_text(yaml.safe_dump(no_share))
    code, out, err = e.run(capsys, "spec", "check", str(e.spec))
    assert code != 0 and "metrics[1].bounds" in err and "budget.split.sum_amount.bounds" in err
    declared = {**doc, "metrics": [{"type": "count"}, {"type": "sum", "column": "amount", "bounds": [0, 10]}]}
    e.spec.write_text(yaml.safe_dump(declared))
    code, out, err = e.run(capsys, "spec", "check", str(e.spec))
    assert code != 0 and "budget.split.sum_amount.bounds" in err and "only for a metric with bounds: estimate" in err
    no_fallback = {**doc, "metrics": [{"type": "count"}, {"type": "sum", "column": "amount", "bounds": "estimate"}]}
    e.spec.write_text(yaml.safe_dump(no_fallback))
    code, out, err = e.run(capsys, "spec", "check", str(e.spec))
    assert code != 0 and "fallback_bounds" in err
    typo = {**doc, "metrics": [{"type": "count"},
                               {"type": "sum", "column": "amount", "bounds": "estimated", "fallback_bounds": [0, 1]}]}
    e.spec.write_text(yaml.safe_dump(typo))
    code, out, err = e.run(capsys, "spec", "check", str(e.spec))
    assert code != 0 and "'estimated'" in err


def test_plan_says_estimated_at_run_time_and_plans_the_release_share(tmp_path, monkeypatch, capsys):
    e = _option_env(tmp_path, monkeypatch)
    code, out, err = e.json(capsys, "spec", "check", str(e.spec), "--json")
    assert code == 0, err
    m = out["metrics"][1]
    assert m["bounds"] is None and m["bounds_estimated"]["note"] == "estimated at run time"
    assert m["bounds_estimated"]["fallback_bounds"] == [0.0, 10.0]
    assert math.isclose(m["bounds_estimated"]["estimation_epsilon"], TOTAL / 3)
    assert math.isclose(sum(out["epsilon_split"].values()), TOTAL)  # the shares add up to the declared total
    code, text, err = e.run(capsys, "spec", "check", str(e.spec))
    assert code == 0 and "estimated at run time" in text and "fallback bounds [0.0, 10.0]" in text
    code, text, err = e.run(capsys, "plan", str(e.spec))
    assert code == 0, err
    assert "estimated at run time" in text
    from dpops.spec import load_spec

    spec = load_spec(e.spec)
    assert math.isclose(spec.release_part().budget.epsilon, TOTAL * 2 / 3)
    # the plan is the release's own share at the fallback bounds (what is reserved after the estimation)
    assert plan_release(spec).events == plan_release(spec.release_part()).events


def test_release_run_charges_the_declared_total_once_and_both_manifests_verify(tmp_path, monkeypatch, capsys):
    e = _option_env(tmp_path, monkeypatch)
    code, out, err = e.json(capsys, "release", "run", str(e.spec), *e.base(), "--ledger", e.url, "--publish",
                            "--no-gx-checks", "--json")
    assert code == 0, err
    total, runs = _status(e)
    assert math.isclose(total, TOTAL, rel_tol=1e-6), runs  # estimation share + release share = declared total
    by_release = {r: (st, eps) for r, st, eps in runs}
    assert set(by_release) == {"purchases_test", "purchases_test__estimate"}
    assert by_release["purchases_test__estimate"][0] == "committed"
    assert math.isclose(by_release["purchases_test__estimate"][1], TOTAL / 3, rel_tol=1e-6)
    assert math.isclose(by_release["purchases_test"][1], TOTAL * 2 / 3, rel_tol=1e-6)
    mdir = tmp_path / "out" / "manifests" / "purchases_test"
    manifests = [json.loads(p.read_text()) for p in mdir.glob("*.json")]
    est = [m for m in manifests if m.get("estimation") is not None]
    rel = [m for m in manifests if m.get("estimation") is None]
    assert len(est) == 1 and len(rel) == 1, [p.name for p in mdir.glob("*.json")]
    est, rel = est[0], rel[0]
    assert rel["dependencies"] == {"estimations": [{"run_id": est["run_id"]}]}
    assert rel["spec"]["estimated_from"] == est["run_id"]
    bounds = est["estimation"]["result"]["bounds"]["amount"]
    assert rel["spec"]["metrics"][1]["bounds"] == bounds and "fallback_bounds" not in rel["spec"]["metrics"][1]
    assert est["estimation"]["config"]["contribution"] is False  # contribution bounds stay declared
    assert math.isclose(rel["spec"]["budget"]["epsilon"], TOTAL * 2 / 3, rel_tol=1e-9)
    for m in (rel, est):
        path = next(p for p in mdir.glob("*.json") if json.loads(p.read_text())["run_id"] == m["run_id"])
        code, out, err = e.run(capsys, "manifest", "verify", str(path), "--manifests", str(mdir), "--ledger", e.url)
        assert code == 0, out + err
    # the reviewer report verifies both manifests and says where the bounds came from
    code, out, err = e.run(capsys, "report", "--scope", "shop", "--manifests", str(mdir), "--ledger", e.url,
                           "--key-file", str(e.key), "--out", str(tmp_path / "report.html"))
    assert code == 0, out + err
    import re

    text = re.sub(r"\s+", " ", re.sub("<[^>]+>", " ", (tmp_path / "report.html").read_text()))
    assert "0 FAILED of 2" in text and f"dpops estimate, run {est['run_id']}" in text
    # the same run again: the estimation and the release are served, nothing is charged
    code, again, err = e.json(capsys, "release", "run", str(e.spec), *e.base(), "--ledger", e.url, "--publish",
                              "--no-gx-checks", "--json")
    assert code == 0, err
    assert again["state"] == "already_published" and _status(e) == (total, runs)


def test_over_the_cap_is_refused_before_the_estimation_with_the_ledger_unchanged(tmp_path, monkeypatch, capsys):
    # the estimation alone (0.2) fits a 0.5 cap, the interval's total (0.6) does not: nothing may be charged
    e = _option_env(tmp_path, monkeypatch, cap=0.5)
    before = _status(e)
    code, out, err = e.run(capsys, "release", "run", str(e.spec), *e.base(), "--ledger", e.url, "--publish",
                           "--no-gx-checks")
    assert code == 5, out + err
    assert "nothing was reserved" in err
    assert _status(e) == before == (0.0, [])


def test_a_retry_after_the_estimation_committed_reuses_it(tmp_path, monkeypatch, capsys):
    """The release fails after the estimation committed (the Beam job dies): the retry is served the
    committed estimation (no second estimation run, no second charge) and the release's charge stays one."""
    e = _option_env(tmp_path, monkeypatch)
    e.pipe.fail_after_start = True
    code, out, err = e.run(capsys, "release", "run", str(e.spec), *e.base(), "--ledger", e.url, "--publish",
                           "--no-gx-checks")
    assert code != 0
    total, runs = _status(e)
    assert math.isclose(total, TOTAL, rel_tol=1e-6)
    e.pipe.fail_after_start = False
    code, out, err = e.run(capsys, "release", "run", str(e.spec), *e.base(), "--ledger", e.url, "--publish",
                           "--no-gx-checks")
    assert code == 0, out + err
    total2, runs2 = _status(e)
    assert math.isclose(total2, TOTAL, rel_tol=1e-6)
    assert sorted(r for r, _, _ in runs2) == ["purchases_test", "purchases_test__estimate"]


def test_the_airflow_tasks_estimate_once_and_release_on_the_estimated_bounds(tmp_path, monkeypatch):
    """The DAG's tasks (dpops.orchestration steps, each re-running prepare): reserve runs the estimation,
    compute/validate/publish/record are served it (no second estimation, no second charge), and the
    published manifest names it."""
    from dpops import orchestration

    e = _option_env(tmp_path, monkeypatch)
    step = orchestration.Step(str(e.spec), "2024-01-02T00:00:00+00:00", "2024-01-03T00:00:00+00:00",
                              orchestration.Settings(ledger_url=e.url, key_path=str(e.key)), "test")
    # before reserve no task (nor a failure line) may start the estimation: nothing is charged
    from dpops.errors import LedgerError

    with pytest.raises(LedgerError, match="has not been committed"):
        orchestration.compute_step(step)
    assert orchestration.failure_outcome(step, RuntimeError("x")) is None and _status(e) == (0.0, [])
    assert orchestration.reserve_step(step).state == "reserved"
    after_reserve = _status(e)
    assert math.isclose(after_reserve[0], TOTAL, rel_tol=1e-6)  # both charges are in from here on
    run_id = orchestration.compute_step(step)["run_id"]
    assert orchestration.validate_step(step)["run_id"] == run_id
    assert orchestration.publish_step(step).state == "published"
    assert orchestration.record_step(step, charged=TOTAL * 2 / 3).state == "published"
    total, runs = _status(e)
    assert math.isclose(total, TOTAL, rel_tol=1e-6) and len(runs) == 2, runs
    req = e.pipe.requests[-1]
    assert req.estimated_from is not None and [c for c, _, _ in req.estimated_bounds] == ["amount"]
    # the pipeline's own guards: the spec it re-loads (with the request's bounds) has the prepared hashes
    assert req.spec_of().spec_hash == req.noise_label["spec_hash"]
    assert plan_release(req.spec_of()).plan_hash == req.expected_plan_hash
    assert orchestration.reserve_step(step).state == "already_published" and _status(e)[0] == total


def test_the_beam_pipeline_releases_on_the_estimated_bounds(tmp_path, monkeypatch, capsys):
    """One real Beam run (FnApiRunner): the pipeline re-loads the spec file (bounds: estimate), applies the
    request's estimated bounds, passes its spec-hash and plan-hash guards and publishes."""
    from dpops.release import computation

    real = computation._load_run_release
    e = _option_env(tmp_path, monkeypatch)
    monkeypatch.setattr(computation, "_load_run_release", real)
    code, out, err = e.json(capsys, "release", "run", str(e.spec), *e.base(), "--ledger", e.url, "--publish",
                            "--no-gx-checks", "--json")
    assert code == 0, err
    assert out["state"] == "published" and math.isclose(_status(e)[0], TOTAL, rel_tol=1e-6)
    assert e.pipe.calls == 0  # the stand-in was not used
    import pyarrow.parquet as pq

    data = next((tmp_path / "out").rglob("data.parquet"))
    assert pq.read_table(data).num_rows == 2 and "sum_amount" in pq.read_table(data).column_names


def test_os_randomness_and_spec_out_are_refused_before_anything_is_charged(tmp_path, monkeypatch, capsys):
    e = _option_env(tmp_path, monkeypatch)
    code, out, err = e.run(capsys, "release", "run", str(e.spec), *e.base(), "--ledger", e.url, "--publish",
                           "--no-gx-checks", "--randomness", "os")
    assert code != 0 and "keyed randomness" in err and _status(e) == (0.0, [])
    code, out, err = e.run(capsys, "estimate", str(e.spec), *e.base(), "--epsilon", "0.2", "--ledger", e.url,
                           "--spec-out", str(tmp_path / "x.yaml"))
    assert code != 0 and "--spec-out is refused" in err and _status(e) == (0.0, [])


def test_two_estimated_metrics_of_one_column_share_one_estimation(tmp_path, monkeypatch):
    """The estimation's epsilon is the sum of the metrics' shares; both metrics get the column's bounds."""
    from dpops.analysis.estimate import option_config
    from dpops.spec import load_spec

    e = _option_env(tmp_path, monkeypatch)
    _write(e, budget={"scope": "shop", "epsilon": 1.0, "delta": 0,
                      "split": {"count": 1, "sum_amount": 1, "mean_amount": 1, "sum_amount.bounds": 1,
                                "mean_amount.bounds": 1}},
           metrics=[{"type": "count"},
                    {"type": "sum", "column": "amount", "bounds": "estimate", "fallback_bounds": [0, 10]},
                    {"type": "mean", "column": "amount", "bounds": "estimate", "fallback_bounds": [0, 10]}])
    spec = load_spec(e.spec)
    assert math.isclose(spec.estimation_epsilon(), 0.4) and option_config(spec).columns == ("amount",)
    done = spec.with_estimated_bounds("a" * 32, {"amount": (0.0, 4.0)})
    assert [m.bounds for m in done.metrics[1:]] == [(0.0, 4.0), (0.0, 4.0)]
    assert math.isclose(done.budget.epsilon, 0.6) and done.estimated_from == "a" * 32
    assert not done.estimated_metric_keys and load_spec(e.spec).spec_hash == spec.spec_hash


@pytest.mark.parametrize("form", ["csv_header_only", "parquet_zero_rows"])
def test_an_empty_interval_estimates_and_publishes_like_its_one_unit_neighbour(tmp_path, monkeypatch, capsys, form):
    """Issue 25 item 3: n = 0 is data. An interval whose input has no data rows (a header-only CSV, a
    zero-row Parquet file) runs the estimation (a DP output on all-zero counts) and publishes, exactly
    like its neighbour with one unit; before the fix the empty one raised "no rows to estimate from"
    after ``ledger.start`` and stayed started, charged, never publishable. The real Beam job (FnApiRunner)
    computes both releases."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dpops.release import computation

    real = computation._load_run_release
    e = _option_env(tmp_path, monkeypatch, cap=5.0)
    monkeypatch.setattr(computation, "_load_run_release", real)
    data = tmp_path / "data"
    doc = yaml.safe_load(e.spec.read_text())
    if form == "csv_header_only":
        doc["input"] = {**doc["input"], "path": "data/{start:%Y-%m-%d}.csv", "format": "csv"}
        (data / "2024-01-01.csv").write_text("user_id,region,amount\n")  # no data row
        (data / "2024-01-02.csv").write_text("user_id,region,amount\nalice,north,3.5\n")  # one unit
    else:
        schema = pa.schema([("user_id", pa.string()), ("region", pa.string()), ("amount", pa.float64())])
        pq.write_table(pa.table({"user_id": [], "region": [], "amount": []}, schema=schema), data / "2024-01-01.parquet")
        pq.write_table(pa.table({"user_id": ["alice"], "region": ["north"], "amount": [3.5]}, schema=schema),
                       data / "2024-01-02.parquet")
    e.spec.write_text(yaml.safe_dump(doc))
    for day in ("2024-01-01", "2024-01-02"):  # the empty interval, then its one-unit neighbour
        code, out, err = e.json(capsys, "release", "run", str(e.spec), *e.base(day), "--ledger", e.url, "--publish",
                                "--no-gx-checks", "--json")
        assert code == 0, err
        assert out["state"] == "published", out
    total, runs = _status(e)
    assert sorted((r, st) for r, st, _ in runs) == [("purchases_test", "committed")] * 2 + [
        ("purchases_test__estimate", "committed")] * 2
    assert math.isclose(total, 2 * TOTAL, rel_tol=1e-6)


def test_a_test_mode_run_estimates_in_test_mode_and_is_never_published(tmp_path, monkeypatch, capsys):
    """Issue 25 item 4, the bounds: estimate side: a test-mode run's estimation is seeded too, so it is
    spent_unpublished (never committed), the release may use it (test mode to test mode) and is itself never
    published; no manifest is written under output.root."""
    from dpops.errors import StorageError
    from dpops.release import execute_release

    e = _option_env(tmp_path, monkeypatch)
    with open_ledger(e.url) as led, pytest.raises(StorageError, match="test-mode"):
        execute_release(e.spec, "2024-01-01", "2024-01-02", ledger=led, randomness="test", test_seed=3)
    total, runs = _status(e)
    assert sorted((r, st) for r, st, _ in runs) == [("purchases_test", "spent_unpublished"),
                                                     ("purchases_test__estimate", "spent_unpublished")]
    reviewer_facing = [tmp_path / "out" / "manifests", tmp_path / "out" / "estimates", tmp_path / "out" / "published"]
    assert [p for d in reviewer_facing if d.exists() for p in d.rglob("*") if p.is_file()] == []


def _estimation_committed_release_failed(tmp_path, monkeypatch, capsys):
    """A release whose bounds: estimate estimation committed and whose computation then failed (charged,
    started): the environment and the estimation's manifest file, for the serving tests."""
    e = _option_env(tmp_path, monkeypatch, cap=5.0)
    e.pipe.fail_after_start = True
    code, out, err = e.run(capsys, "release", "run", str(e.spec), *e.base("2024-01-01"), "--ledger", e.url,
                           "--publish", "--no-gx-checks")
    assert code != 0
    e.pipe.fail_after_start = False
    mdir = tmp_path / "out" / "manifests" / "purchases_test"
    return e, next(p for p in mdir.glob("*.json") if json.loads(p.read_text()).get("estimation") is not None)


def test_an_edited_estimation_manifest_is_never_served(tmp_path, monkeypatch, capsys):
    """Issue 25 item 7c: the committed estimation is served from its manifest only if the file's sha256 is the
    one the ledger's commit entry recorded. The release fails after the estimation committed; editing the
    estimation's bounds to [0, 1e6] then used to set the bounds of the retry's release. Now the retry and a
    restatement refuse (exit 7) and nothing more is charged."""
    e, path = _estimation_committed_release_failed(tmp_path, monkeypatch, capsys)
    doc = json.loads(path.read_text())
    doc["estimation"]["result"]["bounds"]["amount"] = [0.0, 1e6]
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    before = _status(e)
    for verb in ("run", "restate"):
        code, out, err = e.run(capsys, "release", verb, str(e.spec), *e.base("2024-01-01"), "--ledger", e.url,
                               *(["--publish"] if verb == "run" else []), "--no-gx-checks")
        assert code == 7 and "refusing to serve committed estimation" in err and "sha256" in err, out + err
    assert _status(e) == before
    assert all(r.estimated_bounds != [("amount", 0.0, 1e6)] for r in e.pipe.requests)


def test_an_estimation_manifest_swapped_after_its_digest_was_read_is_not_served(tmp_path, monkeypatch, capsys):
    """The served manifest is read once: its sha256 is compared with the ledger's commit entry and the SAME bytes
    are parsed. Here the file is replaced by an edited copy (bounds [0, 1e6]) right after its first read; code
    that hashed one read and parsed a second served the edited bounds as the retry's sensitivity."""
    from pathlib import Path

    e, path = _estimation_committed_release_failed(tmp_path, monkeypatch, capsys)
    doc = json.loads(path.read_text())
    declared = doc["estimation"]["result"]["bounds"]["amount"]
    doc["estimation"]["result"]["bounds"]["amount"] = [0.0, 1e6]
    edited = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
    real = Path.read_bytes
    swapped = []

    def read_then_swap(self):
        data = real(self)
        if self.resolve() == path.resolve() and not swapped:
            swapped.append(True)
            path.chmod(0o644)
            path.write_bytes(edited)  # the attacker's copy lands between the check's read and any second read
        return data

    monkeypatch.setattr(Path, "read_bytes", read_then_swap)
    code, out, err = e.run(capsys, "release", "run", str(e.spec), *e.base("2024-01-01"), "--ledger", e.url,
                           "--publish", "--no-gx-checks")
    assert swapped and code == 0, out + err
    assert list(e.pipe.requests[-1].estimated_bounds) == [("amount", *map(float, declared))]


def test_a_rerun_of_a_published_interval_whose_input_changed_is_refused_before_the_estimation(
        tmp_path, monkeypatch, capsys):
    """Issue 25 item 7d: after the interval published, its input changes and a plain ``release run`` used to
    charge a new estimation (0.6 -> 0.8), then refuse the release and say "charged ε=0". The changed input is
    now refused before any estimation is reserved (ledger unchanged); the explicit restatement still works
    and charges the estimation and the release once; and a failure line counts an estimation this
    invocation charged."""
    from test_runs import write_input

    e = _option_env(tmp_path, monkeypatch, cap=5.0)
    base = [*e.base("2024-01-01"), "--ledger", e.url, "--no-gx-checks"]
    code, out, err = e.run(capsys, "release", "run", str(e.spec), *base, "--publish")
    assert code == 0, err
    before = _status(e)
    assert math.isclose(before[0], TOTAL, rel_tol=1e-6)
    write_input(tmp_path, "2024-01-01", amounts=(1.0, 2.0, 3.0, 9.0))  # late data: the input changed
    code, out, err = e.run(capsys, "release", "run", str(e.spec), *base, "--publish")
    assert code == 6 and "already published" in err and "release restate" in err, out + err
    assert "input changed" in err
    assert _status(e) == before  # nothing reserved: no new estimation
    code, out, err = e.json(capsys, "release", "restate", str(e.spec), *base, "--json")
    assert code == 0, err
    assert out["state"] == "published" and out["restates"]
    total, runs = _status(e)
    assert math.isclose(total, 2 * TOTAL, rel_tol=1e-6) and len(runs) == 4, runs


def test_a_failure_line_counts_the_estimation_this_invocation_charged(tmp_path, monkeypatch, capsys):
    """Issue 25 item 7d, the message: when the estimation was charged and the release then failed, the
    failure line does not claim ε=0 for this invocation."""
    e = _option_env(tmp_path, monkeypatch, cap=5.0)
    e.pipe.fail_after_start = True
    code, out, err = e.json(capsys, "release", "run", str(e.spec), *e.base("2024-01-01"), "--ledger", e.url,
                            "--publish", "--no-gx-checks", "--json")
    assert code != 0
    assert math.isclose(out["epsilon_charged"] + out["estimation_charged"], TOTAL, rel_tol=1e-6), out
    assert "estimation" in out["budget"], out["budget"]


def test_plan_solve_counts_the_estimation_and_its_written_spec_runs_within_the_cap(tmp_path, monkeypatch, capsys):
    """Issue 25 item 7e through the CLI: ``plan --solve`` against the ledger's cap (1.2) on a bounds: estimate
    spec reported cost 0.831 while the spec it told one to write charged 1.418 and was refused. Its cost is
    now the interval's whole charge, and the written spec's run is admitted and charges that cost."""
    e = _option_env(tmp_path, monkeypatch, cap=1.2)
    doc = yaml.safe_load(e.spec.read_text())
    doc["accuracy"] = {"confidence": 0.95, "targets": [{"kind": "error", "metric": "count", "max_error": 5.0}]}
    e.spec.write_text(yaml.safe_dump(doc))
    code, out, err = e.json(capsys, "plan", str(e.spec), "--solve", "--ledger", e.url, "--accountants", "basic",
                            "--json")
    assert code == 0, err
    sol = out["solution"]
    assert sol["cost"] <= 1.2 and math.isclose(sol["cost"], sol["epsilon"], rel_tol=1e-8), sol
    doc["budget"].update(sol["spec_patch"]["budget"])
    e.spec.write_text(yaml.safe_dump(doc))
    code, out, err = e.run(capsys, "release", "run", str(e.spec), *e.base("2024-01-01"), "--ledger", e.url,
                           "--publish", "--no-gx-checks")
    assert code == 0, out + err
    # the spec declares the patch's split, rounded to PATCH_DIGITS (dpops.analysis.solver.rounded_split; down here,
    # where the cap limits the solve): the run charges that declared epsilon (basic: the interval's whole charge,
    # estimation included), within the cap and within a rounding of the exact solution's cost
    declared = float(sol["spec_patch"]["budget"]["epsilon"])
    charged = _status(e)[0]
    assert math.isclose(charged, declared, rel_tol=1e-6) and charged <= 1.2 * (1 + 1e-12), (charged, declared)
    assert math.isclose(charged, sol["cost"], rel_tol=1e-3), (sol["cost"], charged)


def test_the_release_estimation_reads_through_the_beam_pipeline(tmp_path, monkeypatch, capsys):
    """``bounds: estimate`` estimates on the Beam engine (issue 27 item 1): the driver's row reader is never
    called, and the committed bounds are those the driver engine recomputes over the same prepared context
    (the reference)."""
    from dpops.analysis.estimate import option_config
    from dpops.release import estimation as R
    from dpops.release.preparation import prepare
    from dpops.spec import load_spec

    e = _option_env(tmp_path, monkeypatch)
    real = R.read_rows

    def no_driver_read(*a, **k):
        raise AssertionError("the estimation read the rows into the driver")

    monkeypatch.setattr(R, "read_rows", no_driver_read)
    code, out, err = e.json(capsys, "release", "run", str(e.spec), *e.base(), "--ledger", e.url, "--publish",
                            "--no-gx-checks", "--json")
    assert code == 0, err
    monkeypatch.setattr(R, "read_rows", real)
    mdir = tmp_path / "out" / "manifests" / "purchases_test"
    est = next(m for m in (json.loads(p.read_text()) for p in mdir.glob("*.json")) if m.get("estimation"))
    config = option_config(load_spec(e.spec))
    ctx = prepare(e.spec, "2024-01-01", key_path=str(e.key), for_estimation=True)
    run = R.EstimationRun(ctx, R.run_key_of(ctx, config))
    assert run.key.run_id == est["run_id"]
    ref = R.compute_estimation(run, config, R.random_source(run.ctx, run.key), engine="driver")
    assert est["estimation"]["result"] == ref.result()


def test_the_deployments_estimation_staging_sends_the_tasks_estimation_to_the_release_runner(tmp_path, monkeypatch,
                                                                                             tmp_path_factory):
    """``$DPOPS_ESTIMATION_STAGING`` (set by whoever deploys the workers, as the runner is): the reserve task's
    estimation runs on the deployment's runner with its scratch under that location, checked apart from the
    roots; unset, in the task's process. Only the engine changes: the charge is the same."""
    import dataclasses

    from dpops import orchestration
    from dpops.release import estimation

    e = _option_env(tmp_path, monkeypatch)
    staging = tmp_path_factory.mktemp("private") / "scratch"  # apart from the data root (the spec's directory)
    monkeypatch.setenv("DPOPS_ESTIMATION_STAGING", str(staging))
    monkeypatch.setenv("DPOPS_BEAM_RUNNER", "FnApiRunner")
    monkeypatch.setenv("DPOPS_BEAM_OPTIONS", "--direct_num_workers=1")
    settings = orchestration.Settings.resolve()
    assert settings.estimation_staging == str(staging)
    engines = []
    real = estimation.run_estimation

    def spy(ctx, config, ledger, **kw):
        engines.append(kw.get("engine"))
        return real(ctx, config, ledger, **kw)

    monkeypatch.setattr(estimation, "run_estimation", spy)
    step = orchestration.Step(str(e.spec), "2024-01-02T00:00:00+00:00", "2024-01-03T00:00:00+00:00",
                              dataclasses.replace(settings, ledger_url=e.url, key_path=str(e.key)), "test")
    assert orchestration.reserve_step(step).state == "reserved"
    assert engines[0] == estimation.EstimationEngine("beam", "FnApiRunner", ("--direct_num_workers=1",), str(staging))
    assert staging.is_dir() and list(staging.iterdir()) == []  # made 0700 before the charge, each pass removed
    assert math.isclose(_status(e)[0], TOTAL, rel_tol=1e-6)
    monkeypatch.delenv("DPOPS_ESTIMATION_STAGING")
    assert orchestration.Settings.resolve().estimation_staging is None
    assert estimation.release_estimation_engine("PortableRunner", ("--job_endpoint=x",), None) == \
        estimation.EstimationEngine()  # no staging: in this process, whatever the release's runner
