"""Micro-benchmark of the input reader alone: ``iter_record_batches`` + ``prepare_batch`` over one file.

The rows are ``benchmarks/bench_scale.py``'s (``dpops.testing.synthetic.generate_events``: 100k power-law users,
1,000 regions, written as CSV by pyarrow's ``CSVWriter``, i.e. every string quoted), read with the scale
benchmark's spec (``user_id`` string unit, ``region`` string partition, ``amount`` float metric).
Nothing else runs (no Beam, no bounding), so a change in the reader shows up undiluted.

    python benchmarks/bench_reader.py --rows 2e6 --repeat 3 [--format csv|parquet] [--code-root DIR ...]

Each ``--code-root`` runs in its own child process with that tree first on ``sys.path`` (an A/B against
another checkout, e.g. ``/work/main``), alternating roots ``--repeat`` times; prints every time and the
median per root.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = HERE / "out" / "reader"

CHILD = r"""
import json, sys, time
import numpy as np
from pipelines.io import ReadConfig, iter_record_batches, prepare_batch, work_items

path, fmt = sys.argv[1], sys.argv[2]


class Prio:
    def __init__(self):
        self.rng = np.random.default_rng(0)

    def uint64(self, n):
        return self.rng.integers(0, 2 ** 63, n, dtype=np.uint64)


cfg = ReadConfig(format=fmt, types={"user_id": "string", "region": "string", "amount": "float"},
                 unit_column="user_id", partition_columns=("region",), value_columns=("amount",))
t0, c0 = time.perf_counter(), time.process_time()
kept = read = 0
for item in work_items([path], fmt):
    for batch, offset in iter_record_batches(item, cfg, {}):
        rows, _names, stats = prepare_batch(batch, 0, offset, cfg, Prio(), pair_salt=(1, 2))
        kept += len(rows["u"])
        read += stats["rows_read"]
print(json.dumps({"seconds": time.perf_counter() - t0, "cpu": time.process_time() - c0, "rows_read": read,
                  "rows_kept": kept}))
"""


def ensure_data(n: int, fmt: str) -> Path:
    """The n-row input (cached under benchmarks/out/reader/), generated like bench_scale's."""
    d = OUT / f"n{n}"
    path = d / f"2024-01-01.{fmt}"
    if path.exists():
        return path
    sys.path.insert(0, str(ROOT))
    from dpops.testing.synthetic import generate_events

    pq_path = d / "2024-01-01.parquet"
    if not pq_path.exists():
        generate_events(str(d / "{start:%Y-%m-%d}.parquet"), n, 100_000, 1000, seed=n % 1000)
    if fmt == "csv":
        import pyarrow.csv as pcsv
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(pq_path)
        with pcsv.CSVWriter(str(path) + ".tmp", pf.schema_arrow) as w:
            for batch in pf.iter_batches(batch_size=1 << 20):
                w.write_batch(batch)
        os.replace(str(path) + ".tmp", path)
    return path


def main(argv: list[str] | None = None) -> int:
    """Time the reader over each --code-root, alternating, and print the medians."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="2e6")
    ap.add_argument("--format", choices=["csv", "parquet"], default="csv")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--code-root", action="append", default=[])
    args = ap.parse_args(argv)
    n = int(float(args.rows))
    path = ensure_data(n, args.format)
    roots = args.code_root or [str(ROOT)]
    times: dict[str, list[float]] = {r: [] for r in roots}
    cpus: dict[str, list[float]] = {r: [] for r in roots}
    for i in range(args.repeat):
        for root in roots:
            env = {**os.environ, "PYTHONPATH": root}
            out = subprocess.run([sys.executable, "-c", CHILD, str(path), args.format], env=env, check=True,
                                 capture_output=True, text=True, cwd=root).stdout
            res = json.loads(out.strip().splitlines()[-1])
            times[root].append(res["seconds"])
            cpus[root].append(res["cpu"])
            print(f"  run {i + 1} {root}: {res['seconds']:.2f}s (cpu {res['cpu']:.2f}s) read={res['rows_read']:,} "
                  f"kept={res['rows_kept']:,} load={os.getloadavg()[0]:.2f}", flush=True)
    for root, ts in times.items():
        med = statistics.median(ts)
        print(f"{root}: median {med:.2f}s wall, {statistics.median(cpus[root]):.2f}s cpu over {len(ts)} runs "
              f"({n / med / 1e6:.2f} M rows/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
