"""Benchmark: the release pipeline on Beam's portable runner with 1 vs 2 SDK workers.

Setup (tests/cluster_support.py, the harness of the cluster tests): a local Beam job service
(tests/beam_job_service.py, which honours ``--sdk_worker_parallelism`` as Flink and Spark do) and an
EXTERNAL SDK worker pool started per case; with ``--isolated`` (default) the pool runs under
``unshare -m`` with a tmpfs over the driver's work directory, as workers on other machines would.
``--no-isolated`` lets the workers share the driver's disk: needed by a pipeline that still stages
shard files on a driver-local path (the pipeline before issue 10's URI staging fails isolated with
``FileNotFoundError ... _parts/shard-*.parquet``, which this script reports).

Query and data as bench_pipeline.py: COUNT + SUM + MEAN of ``amount`` per ``region``, L0 = 5,
Linf = 2, private partition selection, epsilon 1, delta 1e-6; synthetic power-law data, 100k users,
1,000 partitions (``dpops.testing.synthetic.generate_events``, cached under benchmarks/out/data/). Test
randomness with a fixed seed, so the outputs of all cases must be identical (checked).

Reported per case: wall time of ``run_release`` (driver side: pipeline submission, the job on the
workers, the merge of the shards), rows/s, and the speed-up of 2 workers over 1. An in-process
FnApiRunner run of the same request is printed for reference. Machine: 2 cores shared with the
job service and the driver, so the speed-up is bounded well below 2.

    python benchmarks/bench_portable.py [--rows 1e6] [--parallelism 1,2] [--no-isolated] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = HERE / "out" / "portable"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))

from bench_pipeline import ensure_data, spec_text  # same query and data

START, END = "2024-01-01T00:00:00+00:00", "2024-01-02T00:00:00+00:00"


def _request(spec: Path, data: Path, stage: Path, runner: str, options: list[str]):
    from dpops.release.pipeline_seam import ComputeRequest

    return ComputeRequest(spec_path=str(spec), interval_start=START, interval_end=END, input_paths=(str(data),),
                          noise_label={"release": "bench"}, randomness="test", test_seed=1,
                          staging_dir=str(stage), runner=runner, runner_options=tuple(options))


def _run(req) -> tuple[float, bytes]:
    from pipelines.release_pipeline import run_release

    t = time.perf_counter()
    res = run_release(req)
    seconds = time.perf_counter() - t
    return seconds, Path(res.output_file).read_bytes()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=float, default=1e6)
    ap.add_argument("--parallelism", default="1,2", help="SDK worker counts to compare")
    ap.add_argument("--isolated", action=argparse.BooleanOptionalAction, default=True,
                    help="hide the driver's directories from the worker pool (unshare -m + tmpfs)")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    n = int(args.rows)
    counts = [int(x) for x in args.parallelism.split(",")]

    import cluster_support as cs

    data = ensure_data(n)
    shutil.rmtree(OUT, ignore_errors=True)
    driver = OUT / "driver"
    driver.mkdir(parents=True)
    spec = driver / "spec.yaml"
    spec.write_text(spec_text(n, "pipelinedp"))

    results: list[dict] = []
    ref_seconds, ref_bytes = _run(_request(spec, data, driver / "stage-fnapi", "FnApiRunner", []))
    print(f"FnApiRunner in-process: {n:,} rows {ref_seconds:.1f} s ({n / ref_seconds:,.0f} rows/s)", flush=True)
    results.append({"runner": "FnApiRunner", "workers": 1, "rows": n, "seconds": round(ref_seconds, 2)})

    for k in counts:
        logs = OUT / f"logs-p{k}"
        # the pool must not see the driver's stage/spec dir when isolated; the input stays visible (it is
        # the data a cluster would read from shared storage)
        hidden = [driver] if args.isolated else []
        job = cs.start_job_service(logs)
        pool = None
        try:
            pool = cs.start_worker_pool(logs, hide=hidden)
            for r in range(args.repeat):
                stage = driver / f"stage-p{k}-{r}"
                opts = cs.portable_options(job.port, pool.port, parallelism=k)
                try:
                    seconds, out = _run(_request(spec, data, stage, "PortableRunner", opts))
                except Exception as exc:  # noqa: BLE001 - report and go on: the failure is the measurement
                    print(f"PortableRunner x{k} ({'isolated' if args.isolated else 'shared disk'}): FAILED "
                          f"{type(exc).__name__}: {str(exc).splitlines()[-1][:300]}", flush=True)
                    results.append({"runner": "PortableRunner", "workers": k, "rows": n, "failed": type(exc).__name__,
                                    "isolated": args.isolated})
                    break
                started = pool.log_text(tail=10_000_000).count("Starting worker with command")
                same = out == ref_bytes
                print(f"PortableRunner x{k} ({'isolated' if args.isolated else 'shared disk'}): {seconds:.1f} s "
                      f"({n / seconds:,.0f} rows/s), SDK workers started so far {started}, output identical to "
                      f"in-process: {same}", flush=True)
                results.append({"runner": "PortableRunner", "workers": k, "rows": n, "seconds": round(seconds, 2),
                                "identical": same, "isolated": args.isolated})
        finally:
            if pool is not None:
                pool.stop()
            job.stop()

    best = {k: min((r["seconds"] for r in results if r["runner"] == "PortableRunner" and r["workers"] == k
                    and "seconds" in r), default=None) for k in counts}
    if len(counts) >= 2 and all(best[k] for k in counts[:2]):
        a, b = counts[:2]
        print(f"speed-up {b} vs {a} SDK workers: {best[a] / best[b]:.2f}x", flush=True)
    (OUT / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
