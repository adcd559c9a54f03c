"""Issue 27 item 3, "as fast as the SQL": ``dpops release run --publish`` against a hand-written DuckDB query.

Both read the same CSV file (``bench_scale.py``'s anchor input: 100k power-law users, 1,000 regions) and
compute COUNT + SUM (+ MEAN, dpops) of ``amount`` per ``region`` with the same contribution bounds:

- dpops: the whole release through the CLI as an operator runs it (``bench_scale.run_one``: spec check,
  keyed input fingerprint, ledger reserve/start/commit, keyed secure noise, private partition selection,
  manifest, publish), L0 = 5, Linf = 2, values in [0, 100], in-process FnApiRunner, GX checks off.
- DuckDB (``DUCKDB_QUERY``, what an engineer would write instead): ``read_csv_auto``, per (user, region)
  keep <= Linf rows by a hash priority (``row_number`` over a hash), per user keep <= L0 regions by a hash
  priority (``dense_rank`` over a hash), clamp to [0, 100], COUNT and SUM per region, ``threads = 2``;
  then Laplace noise from numpy on the ~1,000 results and a Parquet file (no ledger, no partition
  selection, no manifest: the bare query).

Each side runs as its own child process, paired and interleaved: A B, then B A, ... (the order alternates,
so drift of a shared machine falls on both). Reported per side: the median wall seconds with min-max, the
median CPU seconds (user + sys of the child and its descendants, ``wait4``), the peak RSS (the largest of
the child's ``ru_maxrss`` and the summed RSS of its process tree sampled every 50 ms), and the median of
the per-pair ratios dpops / DuckDB (the quantity issue 27 targets at <= 1.0).

    python benchmarks/bench_vs_duckdb.py --sizes 1e7 [--runs 5] [--out DIR] [--code-root OTHER_CHECKOUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_scale  # noqa: E402 - the benchmarks directory is not a package

L0, LINF, LO, HI = 5, 2, 0.0, 100.0

# {path}: the CSV file. The hash priorities are salted (SALT_ROWS, SALT_PAIRS) so that the bounding is a
# fresh random choice per run, as dpops' keyed priorities are.
DUCKDB_QUERY = """
WITH rows AS (
    SELECT user_id, region, amount FROM read_csv_auto('{path}')
    WHERE user_id IS NOT NULL AND region IS NOT NULL AND isfinite(amount)
), linf AS (
    SELECT user_id, region, amount,
           row_number() OVER (PARTITION BY user_id, region ORDER BY hash(user_id, region, amount, {salt_rows})) AS rn
    FROM rows
), l0 AS (
    SELECT region, amount,
           dense_rank() OVER (PARTITION BY user_id ORDER BY hash(user_id, region, {salt_pairs})) AS pr
    FROM linf WHERE rn <= {linf}
)
SELECT region, count(*) AS n, sum(least(greatest(amount, {lo}), {hi})) AS s
FROM l0 WHERE pr <= {l0} GROUP BY region ORDER BY region
"""


def duckdb_bounded(path: str, threads: int, salts: tuple[int, int]):
    """The bounded, clamped COUNT and SUM per region, without noise (a pyarrow Table: region, n, s)."""
    import duckdb

    con = duckdb.connect()
    con.execute(f"SET threads = {int(threads)}")
    query = DUCKDB_QUERY.format(path=path.replace("'", "''"), salt_rows=int(salts[0]), salt_pairs=int(salts[1]),
                                linf=LINF, l0=L0, lo=LO, hi=HI)
    return con.sql(query).to_arrow_table()


def duckdb_release(path: str, out: str, threads: int = 2, seed: int = 0) -> int:
    """The DuckDB side: the bounded query, then Laplace noise (eps 1/2 each) and a Parquet file. Returns rows."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    salts = (int(rng.integers(0, 1 << 31)), int(rng.integers(0, 1 << 31)))
    table = duckdb_bounded(path, threads, salts)
    n = np.asarray(table.column("n"), dtype=np.float64)
    s = np.asarray(table.column("s"), dtype=np.float64)
    eps = 0.5
    noisy = pa.table({"region": table.column("region"),
                      "count": n + rng.laplace(0, L0 * LINF / eps, len(n)),
                      "sum_amount": s + rng.laplace(0, L0 * LINF * HI / eps, len(s))})
    pq.write_table(noisy, out)
    return noisy.num_rows


def _timed_child(cmd: list[str], env: dict[str, str], cwd: str, log: Path) -> dict:
    """Run ``cmd``; wall seconds, CPU seconds of the child and its descendants, peak RSS (MB), exit code."""
    peak = [0]
    t0 = time.time()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], bench_scale.tree_rss_kb(proc.pid))
                done.wait(0.05)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.time() - t0
        done.set()
        th.join()
    return {"seconds": round(seconds, 2), "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
            "peak_mb": round(max(peak[0], usage.ru_maxrss) / 1024), "exit": os.waitstatus_to_exitcode(status)}


def run_duckdb(n: int, out: Path, threads: int) -> dict:
    """One timed DuckDB child on the n-row CSV."""
    work = out / "runs" / f"duckdb-n{n}"
    work.mkdir(parents=True, exist_ok=True)
    csv = bench_scale.data_dir(n, "csv", out) / "2024-01-01.csv"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--duckdb-child", str(csv), str(work / "out.parquet"),
           "--threads", str(threads)]
    res = _timed_child(cmd, dict(os.environ), str(HERE.parent), work / "log")
    if res["exit"] != 0:
        res["error"] = (work / "log").read_text()[-1500:]
    return res


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def compare(n: int, runs: int, out: Path, threads: int, code_root: Path = bench_scale.ROOT) -> dict:
    """``runs`` interleaved pairs at n rows (dpops from the tree ``code_root``); the summary dict (also printed)."""
    bench_scale.ensure_data(n, "csv", out)
    pairs = []
    for i in range(runs):
        order = ("dpops", "duckdb") if i % 2 == 0 else ("duckdb", "dpops")
        got = {}
        for side in order:
            if side == "dpops":
                r = bench_scale.run_one(n, "csv", [], code_root=code_root, out=out)
                got["dpops"] = {"seconds": r["seconds"], "cpu_s": r["cpu_s"], "peak_mb": r["peak_tree_rss_mb"],
                                "exit": r["exit"], **({"error": r["error"]} if "error" in r else {})}
            else:
                got["duckdb"] = run_duckdb(n, out, threads)
        for side in ("dpops", "duckdb"):
            if got[side]["exit"] != 0:
                raise SystemExit(f"{side} run failed (exit {got[side]['exit']}): {got[side].get('error', '')}")
        got["ratio"] = round(got["dpops"]["seconds"] / got["duckdb"]["seconds"], 3)
        print(f"  pair {i + 1}: dpops {got['dpops']['seconds']:.2f} s ({got['dpops']['peak_mb']} MB), duckdb "
              f"{got['duckdb']['seconds']:.2f} s ({got['duckdb']['peak_mb']} MB), ratio {got['ratio']:.2f}", flush=True)
        pairs.append(got)
    summary = {"rows": n, "runs": runs, "threads": threads, "code": str(code_root),
               "loadavg": [round(x, 2) for x in os.getloadavg()]}
    for side in ("dpops", "duckdb"):
        summary[side] = {"seconds_median": statistics.median(p[side]["seconds"] for p in pairs),
                         "seconds_min": min(p[side]["seconds"] for p in pairs),
                         "seconds_max": max(p[side]["seconds"] for p in pairs),
                         "cpu_s_median": statistics.median(p[side]["cpu_s"] for p in pairs),
                         "peak_mb": max(p[side]["peak_mb"] for p in pairs)}
    ratios = [p["ratio"] for p in pairs]
    summary["ratio_median"], summary["ratio_min"], summary["ratio_max"] = (statistics.median(ratios), min(ratios),
                                                                           max(ratios))
    print(f"{n:,} rows, {runs} pairs: dpops {_fmt([p['dpops']['seconds'] for p in pairs])} s, "
          f"DuckDB {_fmt([p['duckdb']['seconds'] for p in pairs])} s (median [min-max]); "
          f"ratio dpops/DuckDB {_fmt(ratios)}; CPU s dpops {summary['dpops']['cpu_s_median']:.1f}, "
          f"DuckDB {summary['duckdb']['cpu_s_median']:.1f}; peak RSS dpops {summary['dpops']['peak_mb']:,} MB, "
          f"DuckDB {summary['duckdb']['peak_mb']:,} MB", flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    """Entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1e7")
    ap.add_argument("--runs", type=int, default=5, help="interleaved pairs per size")
    ap.add_argument("--threads", type=int, default=2, help="DuckDB threads (the machine's cores)")
    ap.add_argument("--out", default=str(bench_scale.OUT), help="data and run directory")
    ap.add_argument("--code-root", default=str(bench_scale.ROOT),
                    help="run dpops from the tree at this path (e.g. a checkout of the code before a change)")
    ap.add_argument("--duckdb-child", nargs=2, metavar=("CSV", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.duckdb_child:
        print(duckdb_release(args.duckdb_child[0], args.duckdb_child[1], args.threads))
        return 0
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = [compare(int(float(s)), args.runs, out, args.threads, Path(args.code_root))
               for s in args.sizes.split(",") if s.strip()]
    with open(out / "vs_duckdb.jsonl", "a") as fh:
        for r in results:
            fh.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
