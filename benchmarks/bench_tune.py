"""Benchmark: ``dpops.analysis.tuning`` with 20 candidates vs one release over the same rows (issue 20: <= 2x).

Data and spec: those of ``bench_pipeline.py`` (synthetic power-law activity, 100k users, 1,000 partitions,
COUNT + SUM + MEAN of ``amount``, L0 = 5, Linf = 2, private partition selection), cached under
benchmarks/out/data/.

- release: ``pipelines.release_pipeline.run_release`` on the in-process Beam runner, test randomness
  (what ``dpops release run`` computes, without the ledger round trips);
- tune: 20 candidates (L0 in 2, 3, 5, 8, 10 x Linf in 1, 2 x amount bounds [0, 50], [0, 100]): one read,
  one ranking of the bounding's orders (``pipelines.bounding.contribution_ranks``), then per distinct
  (L0, Linf) a vectorised filter of the ranks, and each candidate's plan and predictions.

``--private``: instead of the release, the flagged private tune's two read paths over the same rows and grid
(issue 27 item 1): ``tune`` (before: the rows read into the driver, as a private tune did until the Beam path;
still the public path) against ``tune_private`` (after: ``dpops.release.tuning.private_statistics``, the Beam
pass ``pipelines.tuning`` on the in-process FnApiRunner with ``--buckets`` unit/partition buckets, then the
same scoring; the ledger entry is not timed). Both report the same result (checked here on the
recommendation; tests/test_tune_beam.py checks every statistic). On the in-process runner the workers share
the driver's process, so its peak RSS is the workers' too (about one bucket's rows each, not all rows).

Each case runs in its own subprocess (wall time of the call, after imports -- the release's pipeline
module and tune's reader and bounding modules alike; peak RSS from ``os.wait4``).
``--repeat N`` interleaves N (release, tune) pairs, so that load from other processes on a shared
machine hits both cases alike; the ratio reported is median(tune) / median(release), with each pair's
own ratio alongside.

    python benchmarks/bench_tune.py --sizes 1e6[,1e7] [--repeat 3] [--private [--buckets 64]]
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
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

GRID = {"l0": [2, 3, 5, 8, 10], "linf": [1, 2], "bounds": {"amount": [[0, 50], [0, 100]]}}


def child(case: str, n: int, buckets: int = 64) -> dict:
    """One measured case in this process: the release or the tuning of the same rows."""
    import bench_pipeline as bp

    work = bp.OUT / "tune" / f"n{n}"
    work.mkdir(parents=True, exist_ok=True)
    spec = work / "spec.yaml"
    spec.write_text(bp.spec_text(n, "pipelinedp"))
    data = bp.data_dir(n) / "2024-01-01.parquet"
    if case == "release":
        import shutil

        from dpops.release.pipeline_seam import ComputeRequest
        from pipelines.release_pipeline import run_release

        shutil.rmtree(work / "stage", ignore_errors=True)
        req = ComputeRequest(
            spec_path=str(spec), interval_start="2024-01-01T00:00:00+00:00",
            interval_end="2024-01-02T00:00:00+00:00", input_paths=(str(data),), noise_label={"release": "bench"},
            randomness="test", test_seed=1, staging_dir=str(work / "stage"))
        t = time.time()
        run_release(req)
        return {"case": case, "rows": n, "seconds": time.time() - t}
    import pipelines.bounding  # noqa: F401 - imported before timing, as the release case imports run_release
    import pipelines.io  # noqa: F401
    from dpops import analysis
    from dpops.analysis.tuning import grid_from_doc

    s = analysis.load(spec)
    grid = grid_from_doc(s, GRID)
    if case == "tune_private":
        import apache_beam  # noqa: F401 - imported before timing, as the other cases' modules

        import pipelines.tuning  # noqa: F401
        from dpops.analysis.tuning import prepare_tune, score
        from dpops.release.estimation import EstimationEngine
        from dpops.release.tuning import private_statistics

        t = time.time()
        setup = prepare_tune(s, grid=grid)
        res = score(setup, private_statistics(setup, str(data), 1, EstimationEngine(buckets=buckets)))
        return {"case": case, "rows": n, "seconds": time.time() - t, "candidates": len(grid),
                "boundings": res.boundings, "recommended": res.recommended.label}
    t = time.time()
    from dpops.analysis.sample_access import SampleAccess

    # synthetic rows: handed over as a vouched public sample (a path would be checked against the public roots)
    res = analysis.tune(s, SampleAccess(str(data), False, "benchmark"), grid=grid, seed=1)
    return {"case": case, "rows": n, "seconds": time.time() - t, "candidates": len(grid),
            "boundings": res.boundings, "recommended": res.recommended.label}


def run_child(case: str, n: int, buckets: int = 64) -> dict:
    """Run ``child`` in a subprocess; its JSON line plus peak RSS."""
    proc = subprocess.Popen([sys.executable, __file__, "--child", case, "--n", str(n), "--buckets", str(buckets)],
                            stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"{case} at n={n} failed (exit {code})")
    doc = json.loads(out.decode().strip().splitlines()[-1])
    doc["max_rss_mb"] = usage.ru_maxrss / 1024
    return doc


def main(argv: list[str] | None = None) -> int:
    """Benchmark each size; write benchmarks/out/bench_tune.json."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1e6")
    ap.add_argument("--child", default=None)
    ap.add_argument("--n", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--private", action="store_true", help="the private tune's driver read against its Beam read")
    ap.add_argument("--buckets", type=int, default=64)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.n, a.buckets)))
        return 0
    if a.private:
        return private_main([int(float(x)) for x in a.sizes.split(",")], max(1, a.repeat), a.buckets)
    import statistics

    import bench_pipeline as bp

    results = []
    for n in [int(float(x)) for x in a.sizes.split(",")]:
        bp.ensure_data(n)
        pairs = []
        for _ in range(max(1, a.repeat)):
            rel = run_child("release", n)
            tun = run_child("tune", n)
            pairs.append({"release": rel, "tune": tun, "ratio": tun["seconds"] / rel["seconds"]})
            print(f"n={n:,}: release {rel['seconds']:.1f}s ({rel['max_rss_mb']:.0f} MB), tune ({tun['candidates']} "
                  f"candidates, {tun['boundings']} ranking pass) {tun['seconds']:.1f}s ({tun['max_rss_mb']:.0f} MB), "
                  f"ratio {pairs[-1]['ratio']:.2f} (target <= 2)", flush=True)
        ratio = statistics.median(p["tune"]["seconds"] for p in pairs) / \
            statistics.median(p["release"]["seconds"] for p in pairs)
        print(f"n={n:,}: median tune / median release = {ratio:.2f} over {len(pairs)} interleaved pairs", flush=True)
        results.append({"rows": n, "pairs": pairs, "ratio": ratio})
    bp.OUT.mkdir(parents=True, exist_ok=True)
    (bp.OUT / "bench_tune.json").write_text(json.dumps(results, indent=2))
    return 0


def private_main(sizes: list[int], repeat: int, buckets: int) -> int:
    """The private tune before (driver read) and after (Beam read): interleaved pairs, medians; writes
    benchmarks/out/bench_tune_private.json."""
    import statistics

    import bench_pipeline as bp

    results = []
    for n in sizes:
        bp.ensure_data(n)
        pairs = []
        for _ in range(repeat):
            before = run_child("tune", n)
            after = run_child("tune_private", n, buckets)
            if before["recommended"] != after["recommended"]:
                raise SystemExit(f"n={n}: the Beam read recommends {after['recommended']}, the driver read "
                                 f"{before['recommended']}")
            pairs.append({"driver": before, "beam": after})
            print(f"n={n:,}: private tune, driver read {before['seconds']:.1f}s ({before['max_rss_mb']:.0f} MB peak), "
                  f"Beam read ({buckets} buckets, FnApiRunner) {after['seconds']:.1f}s ({after['max_rss_mb']:.0f} MB "
                  "peak)", flush=True)
        med = {k: statistics.median(p[k]["seconds"] for p in pairs) for k in ("driver", "beam")}
        rss = {k: statistics.median(p[k]["max_rss_mb"] for p in pairs) for k in ("driver", "beam")}
        print(f"n={n:,}: median driver {med['driver']:.1f}s / {rss['driver']:.0f} MB, Beam {med['beam']:.1f}s / "
              f"{rss['beam']:.0f} MB over {len(pairs)} interleaved pairs", flush=True)
        results.append({"rows": n, "buckets": buckets, "pairs": pairs, "median_seconds": med, "median_rss_mb": rss})
    bp.OUT.mkdir(parents=True, exist_ok=True)
    (bp.OUT / "bench_tune_private.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
