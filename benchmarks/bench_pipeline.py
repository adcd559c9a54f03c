"""Benchmark: the dpops Beam release pipeline vs PipelineDP 0.3.1 on its Beam backend.

Query (both engines): COUNT + SUM + MEAN of ``amount`` per ``region``, L0 = 5, Linf = 2,
values in [0, 100], epsilon = 1, delta = 1e-6 in total for each engine, private partition
selection (truncated geometric), Laplace noise, in-process runner.

Budget split (``--split``):

- PipelineDP 0.3.1, NaiveBudgetAccountant with default weights (read from its
  ``budget_accounting.py``, ``dp_engine.py``, ``combiners.py`` and checked by printing the
  accountant's mechanism specs): COUNT+SUM+MEAN is ONE ``MeanCombiner`` requesting two Laplace
  mechanisms, ``MeanCount`` and ``MeanSum`` (normalised sum), weight 1 each; COUNT and SUM are
  post-processing of those two vectors. Private partition selection requests one more
  mechanism, weight 1, inside the same aggregation scope. Weights are normalised to the scope's
  ``budget_weight`` and epsilon is split by weight: count 1/3, normalised sum 1/3, partition
  selection 1/3. Laplace mechanisms use no delta, so partition selection gets all of delta.
- ``pipelinedp`` (default): dpops ``budget.split`` = count 2, sum_amount 1, mean_amount 1,
  partition_selection 2, i.e. epsilon count 1/3, partition selection 1/3 (and all of delta, as
  dpops gives delta only to Gaussian metrics and partition selection), sum 1/6, mean 1/6 (the
  mean reuses the count metric's noisy vector, so its share goes to its normalised sum alone).
  Count and partition selection get exactly PipelineDP's shares; dpops releases SUM from its own
  vector (a metric cannot have weight 0), so the remaining third is shared by sum and mean,
  each getting half of the epsilon PipelineDP's one normalised-sum vector gets.
- ``equal``: no ``budget.split`` (the spec default: 1/4 each for count, sum, mean and
  partition selection) -- the split of the earlier runs.

Data: synthetic power-law activity, 100k users, 1,000 partitions, lognormal values in [0, 100]
(``dpops.testing.synthetic.generate_events``), cached under benchmarks/out/data/.

Each case runs in its own subprocess; its peak RSS comes from ``os.wait4`` on that child.
Median absolute error: noisy counts vs the exact *bounded* counts of the dpops run (the
pipeline's noise-free reference path, same randomness); for PipelineDP the same reference is
used, which is approximate because PipelineDP samples its own contributions.

PipelineDP is not a project dependency: ``--with-pipelinedp`` creates
``benchmarks/.venv-pipelinedp`` (pip install pipeline-dp==0.3.1 apache-beam) and runs it there.

    python benchmarks/bench_pipeline.py --sizes 1e5,1e6 [--with-pipelinedp] [--pipelinedp-max 1e6] [--split equal]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = HERE / "out"
PDP_VENV = HERE / ".venv-pipelinedp"
N_USERS, N_PARTITIONS = 100_000, 1000
L0, LINF, EPS, DELTA = 5, 2, 1.0, 1e-6

SPEC = f"""
name: bench
input:
  path: "{{DATA}}/{{{{start:%Y-%m-%d}}}}.parquet"
  format: parquet
  columns: {{user_id: string, region: string, amount: float, category: string}}
privacy_unit: {{column: user_id, description: "a user-day", adjacency: add_remove}}
budget: {{scope: bench, epsilon: {EPS}, delta: {DELTA}, noise: laplace{{SPLIT}}}}
contribution: {{max_partitions_per_unit: {L0}, max_rows_per_unit_per_partition: {LINF}}}
partitions: {{columns: [region], private: {{strategy: truncated_geometric}}}}
metrics:
  - {{type: count}}
  - {{type: sum, column: amount, bounds: [0, 100]}}
  - {{type: mean, column: amount, bounds: [0, 100]}}
"""


# --split: dpops budget.split weights (see the module docstring); "equal" = no split key (spec default).
SPLITS = {
    "pipelinedp": {"count": 2, "sum_amount": 1, "mean_amount": 1, "partition_selection": 2},
    "equal": None,
}


def spec_text(n: int, split: str) -> str:
    w = SPLITS[split]
    split_yaml = "" if w is None else ", split: {" + ", ".join(f"{k}: {v}" for k, v in w.items()) + "}"
    return SPEC.replace("{DATA}", str(data_dir(n))).replace("{SPLIT}", split_yaml)


def data_dir(n: int) -> Path:
    return OUT / "data" / f"n{n}"


def ensure_data(n: int) -> Path:
    d = data_dir(n)
    path = d / "2024-01-01.parquet"
    if not path.exists():
        sys.path.insert(0, str(ROOT))
        from dpops.testing.synthetic import generate_events

        t = time.time()
        generate_events(str(d / "{start:%Y-%m-%d}.parquet"), n, N_USERS, N_PARTITIONS, seed=n % 1000)
        print(f"  generated {n:,} rows in {time.time() - t:.1f}s", flush=True)
    return path


# --------------------------------------------------------------------------- children


def child_dpops(n: int, split: str) -> dict:
    import numpy as np
    import pyarrow.parquet as pq

    from dpops.release.pipeline_seam import ComputeRequest
    from pipelines.release_pipeline import bounded_truth, run_release

    work = OUT / "dpops" / f"n{n}"
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    spec = work / "spec.yaml"
    spec.write_text(spec_text(n, split))
    req = ComputeRequest(
        spec_path=str(spec), interval_start="2024-01-01T00:00:00+00:00", interval_end="2024-01-02T00:00:00+00:00",
        input_paths=(str(data_dir(n) / "2024-01-01.parquet"),), noise_label={"release": "bench"},
        randomness="test", test_seed=1, staging_dir=str(work / "stage"))
    t = time.time()
    res = run_release(req)
    seconds = time.time() - t
    out = pq.read_table(res.output_file).to_pandas()
    keys, acc = bounded_truth(req)
    truth = dict(zip((k[0] for k in keys), acc["count"]))
    err = [abs(int(c) - int(truth.get(r, 0))) for r, c in zip(out["region"], out["count"])]
    from dpops.spec import load_spec

    weights = load_spec(str(spec)).split_weights()
    eps_shares = {k: round(w / sum(weights.values()), 4) for k, w in weights.items()}
    return {"engine": "dpops", "rows": n, "seconds": seconds, "partitions": len(out),
            "mae_count": float(np.median(err)) if err else None, "split": split, "eps_shares": eps_shares}


def child_pipelinedp(n: int, truth_file: str | None) -> dict:
    """Runs inside benchmarks/.venv-pipelinedp: only pipeline_dp, apache_beam and pyarrow."""
    import statistics

    import apache_beam as beam
    import pipeline_dp
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner

    work = OUT / "pipelinedp" / f"n{n}"
    work.mkdir(parents=True, exist_ok=True)
    result_file = work / "result.jsonl"
    if result_file.exists():
        result_file.unlink()

    class Collect(beam.DoFn):
        def process(self, kv):
            part, m = kv
            with open(result_file, "a") as fh:
                fh.write(json.dumps({"region": part, "count": m.count, "sum": m.sum, "mean": m.mean}) + "\n")

    t = time.time()
    with beam.Pipeline(runner=FnApiRunner()) as p:
        rows = (p | beam.io.ReadFromParquet(str(data_dir(n) / "2024-01-01.parquet"), columns=["user_id", "region", "amount"])
                | beam.Map(lambda r: (r["user_id"], r["region"], r["amount"])))
        accountant = pipeline_dp.NaiveBudgetAccountant(total_epsilon=EPS, total_delta=DELTA)
        engine = pipeline_dp.DPEngine(accountant, pipeline_dp.BeamBackend())
        params = pipeline_dp.AggregateParams(
            noise_kind=pipeline_dp.NoiseKind.LAPLACE,
            metrics=[pipeline_dp.Metrics.COUNT, pipeline_dp.Metrics.SUM, pipeline_dp.Metrics.MEAN],
            max_partitions_contributed=L0, max_contributions_per_partition=LINF, min_value=0.0, max_value=100.0)
        extractors = pipeline_dp.DataExtractors(
            privacy_id_extractor=lambda r: r[0], partition_extractor=lambda r: r[1], value_extractor=lambda r: r[2])
        res = engine.aggregate(rows, params, extractors)
        accountant.compute_budgets()
        res | beam.ParDo(Collect())
    seconds = time.time() - t
    out = [json.loads(line) for line in result_file.read_text().splitlines()] if result_file.exists() else []
    mae = None
    if truth_file and Path(truth_file).exists():
        truth = json.loads(Path(truth_file).read_text())
        err = [abs(o["count"] - truth.get(o["region"], 0)) for o in out]
        mae = statistics.median(err) if err else None
    return {"engine": "pipelinedp", "rows": n, "seconds": seconds, "partitions": len(out), "mae_count": mae}


def write_truth(n: int) -> str:
    """The dpops bounded counts per region (JSON) for PipelineDP's error column."""
    from dpops.release.pipeline_seam import ComputeRequest
    from pipelines.release_pipeline import bounded_truth

    work = OUT / "dpops" / f"n{n}"
    req = ComputeRequest(
        spec_path=str(work / "spec.yaml"), interval_start="2024-01-01T00:00:00+00:00",
        interval_end="2024-01-02T00:00:00+00:00",
        input_paths=(str(data_dir(n) / "2024-01-01.parquet"),), noise_label={"release": "bench"},
        randomness="test", test_seed=1, staging_dir=str(work / "stage"))
    keys, acc = bounded_truth(req)
    path = work / "truth.json"
    path.write_text(json.dumps({k[0]: int(c) for k, c in zip(keys, acc["count"])}))
    return str(path)


# --------------------------------------------------------------------------- parent


def run_child_measured(python: str, args: list[str]) -> dict:
    """Start the child and reap it with wait4 to get ITS peak RSS (not the max over all children)."""
    env = {**os.environ, "GX_ANALYTICS_ENABLED": "false", "SCARF_ANALYTICS": "false", "DO_NOT_TRACK": "true",
           "PYTHONPATH": str(ROOT)}
    log = OUT / "child.log"
    with open(log, "wb") as errfh, open(OUT / "child.out", "wb") as outfh:
        proc = subprocess.Popen([python, str(Path(__file__).resolve()), *args], stdout=outfh, stderr=errfh,
                                env=env, cwd=str(ROOT))
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        return {"error": log.read_text()[-2000:]}
    res = json.loads((OUT / "child.out").read_text().strip().splitlines()[-1])
    res["peak_rss_mb"] = usage.ru_maxrss / 1024.0
    res["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    return res


def setup_pipelinedp() -> str | None:
    py = PDP_VENV / "bin" / "python"
    # dp_accounting: PipelineDP's PLDBudgetAccountant (bench_vs_pipelinedp_analysis part 1b) imports it lazily
    if py.exists() and subprocess.run([str(py), "-c", "import pipeline_dp, apache_beam, dp_accounting"],
                                      capture_output=True).returncode == 0:
        return str(py)
    print(f"  creating {PDP_VENV} (pipeline-dp==0.3.1 + apache-beam)...", flush=True)
    r = subprocess.run([sys.executable, "-m", "venv", str(PDP_VENV)], capture_output=True, text=True)
    if r.returncode != 0:
        print("  cannot create the virtualenv:", r.stderr[-500:])
        return None
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "pipeline-dp==0.3.1", "apache-beam==2.77.0",
                        "pyarrow", "pandas<2.4", "dp-accounting"], capture_output=True, text=True)
    if r.returncode != 0:
        print("  pip install failed; PipelineDP cannot run here:\n", r.stderr[-2000:])
        (OUT / "pipelinedp_install_error.txt").write_text(r.stderr)
        return None
    return str(py)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1e5,1e6,1e7", help="comma-separated row counts, e.g. 1e5,1e6")
    ap.add_argument("--with-pipelinedp", action="store_true", help="also run PipelineDP 0.3.1 in its own venv")
    ap.add_argument("--pipelinedp-max", type=float, default=1e6, help="largest size PipelineDP is run on")
    ap.add_argument("--split", choices=sorted(SPLITS), default="pipelinedp",
                    help="dpops budget split: 'pipelinedp' (PipelineDP's count and partition-selection "
                         "shares, default) or 'equal' (the spec default, 1/4 each)")
    ap.add_argument("--child", choices=["dpops", "pipelinedp"], help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--truth", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child == "dpops":
        print(json.dumps(child_dpops(args.rows, args.split)))
        return 0
    if args.child == "pipelinedp":
        print(json.dumps(child_pipelinedp(args.rows, args.truth)))
        return 0

    OUT.mkdir(parents=True, exist_ok=True)
    sizes = [int(float(s)) for s in args.sizes.split(",") if s.strip()]
    pdp = setup_pipelinedp() if args.with_pipelinedp else None
    results = []
    for n in sizes:
        print(f"{n:,} rows", flush=True)
        ensure_data(n)
        r = run_child_measured(sys.executable, ["--child", "dpops", "--rows", str(n), "--split", args.split])
        results.append(r)
        print("  dpops:", r, flush=True)
        if pdp and n <= args.pipelinedp_max:
            sys.path.insert(0, str(ROOT))
            truth = write_truth(n)
            r2 = run_child_measured(pdp, ["--child", "pipelinedp", "--rows", str(n), "--truth", truth])
            results.append(r2)
            print("  pipelinedp:", r2, flush=True)

    print()
    print(f"dpops budget split: {args.split} {SPLITS[args.split] or '(spec default, equal weights)'}; "
          f"load average now {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} "
          f"on {os.cpu_count()} CPUs")
    print(f"{'engine':<11} {'rows':>11} {'seconds':>8} {'rows/s':>10} {'peak RSS MB':>11} {'partitions':>10} {'MAE count':>9}")
    for r in results:
        if "error" in r:
            print("error:", r["error"][-300:])
            continue
        print(f"{r['engine']:<11} {r['rows']:>11,} {r['seconds']:>8.1f} {r['rows'] / r['seconds']:>10,.0f} "
              f"{r['peak_rss_mb']:>11.0f} {r['partitions']:>10} "
              f"{'-' if r['mae_count'] is None else format(r['mae_count'], '.1f'):>9}")
    for n in sizes:
        a = [r for r in results if r.get("engine") == "dpops" and r["rows"] == n]
        b = [r for r in results if r.get("engine") == "pipelinedp" and r["rows"] == n]
        if a and b:
            print(f"speed-up at {n:,} rows: {b[0]['seconds'] / a[0]['seconds']:.1f}x")
    (OUT / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
