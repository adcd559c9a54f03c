"""Benchmark: ``dpops.analysis.tuning`` with 20 candidates vs one release over the same rows (issue 20: <= 2x).

Data and spec: those of ``bench_pipeline.py`` (synthetic power-law activity, 100k users, 1,000 partitions,
COUNT + SUM + MEAN of ``amount``, L0 = 5, Linf = 2, private partition selection), cached under
benchmarks/out/data/.

- release: ``pipelines.release_pipeline.run_release`` on the in-process Beam runner, test randomness
  (what ``dpops release run`` computes, without the ledger round trips);
- tune: 20 candidates (L0 in 2, 3, 5, 8, 10 x Linf in 1, 2 x amount bounds [0, 50], [0, 100]): one read,
  one ranking of the bounding's orders (``pipelines.bounding.contribution_ranks``), then per distinct
  (L0, Linf) a vectorised filter of the ranks, and each candidate's plan and predictions.

Each case runs in its own subprocess (wall time of the call, after imports -- the release's pipeline
module and tune's reader and bounding modules alike; peak RSS from ``os.wait4``).
``--repeat N`` interleaves N (release, tune) pairs, so that load from other processes on a shared
machine hits both cases alike; the ratio reported is median(tune) / median(release), with each pair's
own ratio alongside.

    python benchmarks/bench_tune.py --sizes 1e6[,1e7] [--repeat 3]
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


def child(case: str, n: int) -> dict:
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
    t = time.time()
    from dpops.analysis.sample_access import SampleAccess

    # synthetic rows: handed over as a vouched public sample (a path would be checked against the public roots)
    res = analysis.tune(s, SampleAccess(str(data), False, "benchmark"), grid=grid, seed=1)
    return {"case": case, "rows": n, "seconds": time.time() - t, "candidates": len(grid),
            "boundings": res.boundings, "recommended": res.recommended.label}


def run_child(case: str, n: int) -> dict:
    """Run ``child`` in a subprocess; its JSON line plus peak RSS."""
    proc = subprocess.Popen([sys.executable, __file__, "--child", case, "--n", str(n)], stdout=subprocess.PIPE,
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
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.n)))
        return 0
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


if __name__ == "__main__":
    sys.exit(main())
