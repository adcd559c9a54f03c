"""Estimation benchmark: ``dpops estimate`` with the counts on the driver or on Beam workers, at 1M .. 100M rows.

The same input as ``bench_scale.py`` (``dpops.testing.synthetic.generate_events``: 100k users, 1,000
regions, Parquet, cached under benchmarks/out/scale/), the same spec (L0 = 5, Linf = 2, amount in
[0, 100]). The estimation asks for everything: L0, Linf and the value bounds of ``amount`` at epsilon 1,
keyed randomness, charged in a fresh SQLite ledger per run. Engines:

- ``driver``: every row of the interval read into the driver process (``read_rows``), then counted;
- ``beam`` (the default of ``dpops estimate``): the counts computed by ``pipelines.estimation`` on the
  in-process FnApiRunner (a ``pairs`` and a ``values`` pass; the rows cross between the read and the per-bucket
  count through private scratch files, not the runner's in-memory shuffle), only the public-grid counts returned.

``--release`` also runs ``dpops release run`` on the same file (``bench_scale.run_one``: the release the
estimation's memory bound is stated against, issue 27: estimation peak <= 1.5x the release's) and prints
each engine's peak as a multiple of the release's.

Each run is a child process (this file with ``--child``); reported: wall seconds and the peak RSS of the
child's whole process tree (``bench_scale.tree_rss_kb``, sampled every 50 ms), and whether both engines
chose the same bounds (they must: the same key, input and run key give the same keyed noise).

    python benchmarks/bench_estimate.py --sizes 1e7 [--engines driver,beam] [--release]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import bench_scale  # noqa: E402
from bench_scale import OUT, SPEC, data_dir, ensure_data, tree_rss_kb  # noqa: E402

RUNS = OUT / "estimate"


def child(engine: str, work: Path, contribution: bool = True) -> int:
    """Run one estimation in this process (the measured child) and write its result to ``work/result.json``."""
    from dpops.analysis.estimate import EstimateConfig
    from dpops.ledger import open_ledger
    from dpops.release.execute import estimate

    with open_ledger(f"sqlite:///{work / 'ledger.db'}") as led:
        t = time.time()
        config = EstimateConfig(epsilon=1.0, contribution=contribution)
        est = estimate(work / "spec.yaml", "2024-01-01", "2024-01-02", config=config, ledger=led,
                       key_path=str(work.parent / "noise.key"), engine=engine)
        (work / "result.json").write_text(json.dumps({"result": est.result(), "seconds": time.time() - t}))
    return 0


def run_one(n: int, engine: str, contribution: bool = True) -> dict:
    """One estimation of ``n`` rows on ``engine`` in a child process, its time and peak tree RSS."""
    work = RUNS / f"n{n}" / (engine if contribution else f"{engine}-values")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "spec.yaml").write_text(SPEC.format(DATA=data_dir(n, "parquet"), FMT="parquet", ROOT="out"))
    env = {**os.environ, "GX_ANALYTICS_ENABLED": "false", "SCARF_ANALYTICS": "false", "DO_NOT_TRACK": "true",
           "PYTHONPATH": str(ROOT), "DPOPS_DATA_ROOTS": str(OUT / "data")}
    key = work.parent / "noise.key"
    if not key.exists():  # one key per size: both engines draw the same keyed noise
        subprocess.run([sys.executable, "-m", "dpops.cli.main", "key", "generate", str(key)], env=env, check=True,
                       capture_output=True)
    subprocess.run([sys.executable, "-m", "dpops.cli.main", "ledger", "--ledger", f"sqlite:///{work / 'ledger.db'}",
                    "scope", "create", "scale", "--unit", "a user-day", "--unit-column", "user_id", "--epsilon", "100",
                    "--delta", "1e-5", "--accountant", "basic", "--adjacency", "add_remove"],
                   env=env, check=True, capture_output=True)
    peak = [0]
    t0 = time.time()
    with open(work / "stdout", "wb") as out, open(work / "stderr", "wb") as err:
        cmd = [sys.executable, __file__, "--child", engine, str(work)] + ([] if contribution else ["--no-contribution"])
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=str(work))
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], tree_rss_kb(proc.pid))
                done.wait(0.05)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.time() - t0
        done.set()
        th.join()
    res: dict = {"rows": n, "engine": engine, "contribution": contribution, "seconds": round(seconds, 1),
                 "peak_tree_rss_mb": round(max(peak[0], usage.ru_maxrss) / 1024),
                 "exit": os.waitstatus_to_exitcode(status), "loadavg": [round(x, 2) for x in os.getloadavg()]}
    if res["exit"] == 0:
        res["result"] = json.loads((work / "result.json").read_text())["result"]
    else:
        res["error"] = (work / "stderr").read_text()[-1500:]
    return res


def main(argv: list[str] | None = None) -> int:
    """Run the sizes and engines, print the table, append to benchmarks/out/scale/estimate/results.jsonl."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1e7")
    ap.add_argument("--engines", default="driver,beam")
    ap.add_argument("--no-contribution", action="store_true",
                    help="value bounds only at the spec's L0 and Linf (what a bounds: estimate metric runs)")
    ap.add_argument("--release", action="store_true",
                    help="also run dpops release run on the same file and report each peak against the release's")
    ap.add_argument("--child", nargs=2, metavar=("ENGINE", "WORKDIR"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child[0], Path(args.child[1]), not args.no_contribution)
    RUNS.mkdir(parents=True, exist_ok=True)
    results = []
    for n in (int(float(s)) for s in args.sizes.split(",") if s.strip()):
        print(f"{n:,} rows", flush=True)
        ensure_data(n, "parquet")
        for engine in args.engines.split(","):
            r = run_one(n, engine, not args.no_contribution)
            print("  ", r, flush=True)
            results.append(r)
        same = {json.dumps(r.get("result"), sort_keys=True) for r in results if r["rows"] == n}
        print(f"  same bounds on every engine: {len(same) == 1}", flush=True)
        if args.release:
            r = bench_scale.run_one(n, "parquet", [])
            r.update(engine="release", contribution=None)
            print("  ", r, flush=True)
            for e in results:
                if e["rows"] == n and r["exit"] == 0:
                    e["vs_release"] = round(e["peak_tree_rss_mb"] / max(r["peak_tree_rss_mb"], 1), 2)
            results.append(r)
    print(f"\n{'rows':>12} {'engine':>7} {'L0/Linf too':>11} {'seconds':>8} {'tree RSS MB':>11} {'x release':>9} "
          f"{'exit':>4}")
    for r in results:
        print(f"{r['rows']:>12,} {r['engine']:>7} {str(r['contribution']):>11} {r['seconds']:>8.1f} "
              f"{r['peak_tree_rss_mb']:>11,} {r.get('vs_release', ''):>9} {r['exit']:>4}")
    with open(RUNS / "results.jsonl", "a") as fh:
        for r in results:
            fh.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
