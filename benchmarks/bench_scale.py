"""Scale benchmark: one release end to end through ``dpops release run`` at 1M .. 100M rows.

Query: COUNT + SUM + MEAN of ``amount`` per ``region`` (1,000 partitions, private partition selection,
truncated geometric), 100k users (power-law activity), L0 = 5, Linf = 2, values in [0, 100],
epsilon = 1, delta = 1e-6, Laplace noise, keyed randomness, in-process FnApiRunner, GX checks off
(they do not scale with the input), published (``--publish``: manifest, ledger commit, ``current``).

Input: ``dpops.testing.synthetic.generate_events`` (Parquet, cached under benchmarks/out/scale/), and for
``--format csv`` the same rows as one CSV file (the issue's baseline was CSV).

Each size runs ``python -m dpops.cli.main release run ...`` as a child process. Reported: wall
seconds, rows/s, and peak RSS of the whole process tree (the sum of the RSS of the child and all its
descendants, sampled every 50 ms from /proc; plus the child's own ``ru_maxrss`` from ``wait4``).

    python benchmarks/bench_scale.py --sizes 1e6,1e7,3e7 [--format csv|parquet] [--runner-option ...]
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
OUT = HERE / "out" / "scale"
N_USERS, N_PARTITIONS = 100_000, 1000

SPEC = """
name: scale
input:
  path: "{DATA}/{{start:%Y-%m-%d}}.{FMT}"
  format: {FMT}
  columns: {{user_id: string, region: string, amount: float, category: string}}
privacy_unit: {{column: user_id, description: "a user-day", adjacency: add_remove}}
budget: {{scope: scale, epsilon: 1.0, delta: 1.0e-6, noise: laplace}}
contribution: {{max_partitions_per_unit: 5, max_rows_per_unit_per_partition: 2}}
partitions: {{columns: [region], private: {{strategy: truncated_geometric}}}}
metrics:
  - {{type: count}}
  - {{type: sum, column: amount, bounds: [0, 100]}}
  - {{type: mean, column: amount, bounds: [0, 100]}}
output: {{root: "{ROOT}"}}
"""


def data_dir(n: int, fmt: str, out: Path | None = None) -> Path:
    """Where the n-row input of format ``fmt`` is cached under ``out`` (default: ``OUT``, read at call time)."""
    return (OUT if out is None else out) / "data" / f"n{n}-{fmt}"


def ensure_data(n: int, fmt: str, out: Path | None = None) -> Path:
    """The n-row input (generated once: Parquet first, the CSV from it)."""
    out = OUT if out is None else out
    d = data_dir(n, fmt, out)
    path = d / f"2024-01-01.{fmt}"
    if path.exists():
        return path
    sys.path.insert(0, str(ROOT))
    from dpops.testing.synthetic import generate_events

    t = time.time()
    pq_dir = data_dir(n, "parquet", out)
    pq_path = pq_dir / "2024-01-01.parquet"
    if not pq_path.exists():
        generate_events(str(pq_dir / "{start:%Y-%m-%d}.parquet"), n, N_USERS, N_PARTITIONS, seed=n % 1000)
    if fmt == "csv":
        import pyarrow.csv as pcsv
        import pyarrow.parquet as pq

        d.mkdir(parents=True, exist_ok=True)
        pf = pq.ParquetFile(pq_path)
        with pcsv.CSVWriter(str(path) + ".tmp", pf.schema_arrow) as w:
            for batch in pf.iter_batches(batch_size=1 << 20):
                w.write_batch(batch)
        os.replace(str(path) + ".tmp", path)
    print(f"  data: {n:,} rows ({fmt}) ready in {time.time() - t:.1f}s", flush=True)
    return path


def tree_rss_kb(pid: int) -> int:
    """Sum of VmRSS over ``pid`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as fh:
                ppid, kb = 0, 0
                for line in fh:
                    if line.startswith("PPid:"):
                        ppid = int(line.split()[1])
                    elif line.startswith("VmRSS:"):
                        kb = int(line.split()[1])
        except (OSError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
        rss[int(entry)] = kb
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo.extend(children.get(p, []))
    return total


def compile_code(code_root: Path) -> None:
    """Bytecode for ``code_root``'s packages, as an installed dpops has (pip compiles what it installs). Without
    it, a shell with PYTHONDONTWRITEBYTECODE set (this machine's) makes every timed run compile dpops anew, a
    cost the DuckDB side (a compiled wheel) never pays. Cheap once done: only changed files are compiled."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", *(str(code_root / d) for d in ("dpops", "pipelines"))],
                   check=True, capture_output=True)


def run_one(n: int, fmt: str, runner_options: list[str], code_root: Path = ROOT, out: Path | None = None) -> dict:
    """One timed ``dpops release run --publish`` of the n-row input, in a fresh key, ledger and output root."""
    out = OUT if out is None else out
    compile_code(code_root)
    work = out / "runs" / f"n{n}-{fmt}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    spec = work / "spec.yaml"
    spec.write_text(SPEC.format(DATA=data_dir(n, fmt, out), FMT=fmt, ROOT="out"))
    keydir = work / "keys"
    keydir.mkdir(mode=0o700)
    env = {**os.environ, "GX_ANALYTICS_ENABLED": "false", "SCARF_ANALYTICS": "false", "DO_NOT_TRACK": "true",
           "PYTHONPATH": str(code_root), "DPOPS_DATA_ROOTS": str(out / "data")}
    subprocess.run([sys.executable, "-m", "dpops.cli.main", "key", "generate", str(keydir / "noise.key")],
                   env=env, check=True, capture_output=True)
    ledger = f"sqlite:///{work / 'ledger.db'}"
    subprocess.run([sys.executable, "-m", "dpops.cli.main", "ledger", "--ledger", ledger, "scope", "create", "scale",
                    "--unit", "a user-day", "--unit-column", "user_id", "--epsilon", "100", "--delta", "1e-5",
                    "--accountant", "basic", "--adjacency", "add_remove"],
                   env=env, check=True, capture_output=True)
    cmd = [sys.executable, "-m", "dpops.cli.main", "release", "run", str(spec), "--interval",
           "2024-01-01/2024-01-02", "--ledger", f"sqlite:///{work / 'ledger.db'}", "--key-file",
           str(keydir / "noise.key"), "--no-gx-checks", "--publish", "--json"]
    for o in runner_options:
        cmd += ["--runner-option", o]
    peak = [0]
    t0 = time.time()
    with open(work / "stdout", "wb") as stdout, open(work / "stderr", "wb") as err:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=err, env=env, cwd=str(code_root))
        done = threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], tree_rss_kb(proc.pid))
                done.wait(0.05)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.time() - t0
        done.set()
        th.join()
    code = os.waitstatus_to_exitcode(status)
    res = {"rows": n, "format": fmt, "seconds": round(seconds, 2), "rows_per_s": round(n / seconds),
           "peak_tree_rss_mb": round(max(peak[0], usage.ru_maxrss) / 1024), "child_maxrss_mb": round(usage.ru_maxrss / 1024),
           "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
           "exit": code, "loadavg": [round(x, 2) for x in os.getloadavg()]}
    if code != 0:
        res["error"] = (work / "stderr").read_text()[-1500:]
    else:
        try:
            res["outcome"] = json.loads((work / "stdout").read_text()).get("state")
        except ValueError:
            pass
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1e6,1e7,3e7")
    ap.add_argument("--format", choices=["csv", "parquet"], default="csv")
    ap.add_argument("--runner-option", action="append", default=[])
    ap.add_argument("--code-root", action="append", default=[],
                    help="run the release with the dpops tree at this path (repeatable, e.g. an A/B against "
                         "another checkout); default: this repository")
    ap.add_argument("--data-only", action="store_true", help="only generate the inputs")
    args = ap.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    results = []
    for n in (int(float(s)) for s in args.sizes.split(",") if s.strip()):
        print(f"{n:,} rows ({args.format})", flush=True)
        ensure_data(n, args.format)
        if args.data_only:
            continue
        for root in args.code_root or [str(ROOT)]:
            r = run_one(n, args.format, args.runner_option, Path(root))
            r["code"] = root
            print("  ", r, flush=True)
            results.append(r)
    print(f"\n{'rows':>12} {'fmt':>7} {'seconds':>8} {'rows/s':>10} {'tree RSS MB':>11} {'exit':>4}  code")
    for r in results:
        print(f"{r['rows']:>12,} {r['format']:>7} {r['seconds']:>8.1f} {r['rows_per_s']:>10,} "
              f"{r['peak_tree_rss_mb']:>11,} {r['exit']:>4}  {r['code']}")
    with open(OUT / "results.jsonl", "a") as fh:
        for r in results:
            fh.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
