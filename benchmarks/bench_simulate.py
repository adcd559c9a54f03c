"""Benchmark: ``dpops simulate`` (one pass + N draws) against one test-mode release of the same sample.

Why simulate is one pass plus draws on the aggregates rather than N runs of the Beam job: this measures both on
the same synthetic public sample (``--rows`` rows, ``--partitions`` regions of power-law sizes, 1-4 rows per
user, COUNT + SUM + MEAN of ``amount``, L0 = 2, Linf = 3, private partition selection).

- release: ``pipelines.release_pipeline.run_release`` on the in-process Beam runner, test randomness: the cost
  of ONE draw if simulate ran the whole job per draw;
- simulate: ``dpops.release.simulate(..., draws=N)``: the read and bounding once (``sample_truth``), the
  per-partition predictions (a mean's exact error distribution is evaluated per distinct partition size and
  offset: the part that grows with the number of partitions), and N draws
  through ``select_and_noise``.

Each case runs in its own subprocess after its imports (Beam included in both); wall time of the call.

    python benchmarks/bench_simulate.py --rows 200000 --partitions 20 --draws 1000 [--repeat 3]
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
OUT = HERE / "out" / "simulate"

SPEC = """\
name: bench_simulate
schedule: "0 0 * * *"
input: {{path: "data/{{start:%Y-%m-%d}}.parquet", format: parquet,
        columns: {{user_id: string, region: string, amount: float}}}}
privacy_unit: {{column: user_id, description: a user, adjacency: add_remove}}
budget: {{scope: bench, epsilon: 1.0, delta: 1.0e-7, noise: laplace}}
contribution: {{max_partitions_per_unit: 2, max_rows_per_unit_per_partition: 3}}
partitions: {{columns: [region], private: {{strategy: truncated_geometric}}}}
metrics: [{{type: count}}, {{type: sum, column: amount, bounds: [0, 100]}}, {{type: mean, column: amount, bounds: [0, 100]}}]
"""


def ensure_data(rows: int, partitions: int) -> tuple[Path, Path]:
    """The spec (its input: a copy in data/, what the release reads) and the public sample (the same rows)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    work = OUT / f"r{rows}-p{partitions}"
    spec, sample = work / "spec" / "spec.yaml", work / "public" / "sample.parquet"
    if sample.exists():
        return spec, sample
    (work / "spec" / "data").mkdir(parents=True, exist_ok=True)
    sample.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(SPEC.format())
    rng = np.random.default_rng(0)
    weights = 1.0 / np.arange(1, partitions + 1)
    region = rng.choice(partitions, size=rows, p=weights / weights.sum())
    user = rng.integers(0, max(1, rows // 2), size=rows)
    table = pa.table({"user_id": pa.array([f"u{u}" for u in user]), "region": pa.array([f"r{r}" for r in region]),
                      "amount": pa.array(rng.gamma(2.0, 20.0, size=rows))})
    pq.write_table(table, sample)
    # the same rows in other row groups: other bytes, so not the sample's twin (the sample must stay public)
    pq.write_table(table, work / "spec" / "data" / "2024-01-01.parquet", row_group_size=max(1, rows // 3))
    return spec, sample


def child(case: str, rows: int, partitions: int, draws: int) -> dict[str, object]:
    """One measured case in this process."""
    spec, sample = ensure_data(rows, partitions)
    import pipelines.release_pipeline  # noqa: F401 - Beam imported before timing, in both cases

    if case == "release":
        import shutil

        from dpops.release.pipeline_seam import ComputeRequest
        from pipelines.release_pipeline import run_release

        stage = spec.parent / "stage"
        shutil.rmtree(stage, ignore_errors=True)
        req = ComputeRequest(spec_path=str(spec), interval_start="2024-01-01T00:00:00+00:00",
                             interval_end="2024-01-02T00:00:00+00:00",
                             input_paths=(str(spec.parent / "data" / "2024-01-01.parquet"),),
                             noise_label={"release": "bench"}, randomness="test", test_seed=1, staging_dir=str(stage))
        t = time.time()
        run_release(req)
        return {"case": case, "seconds": time.time() - t}
    from dpops.release import simulate

    os.environ["DPOPS_PUBLIC_ROOTS"] = str(sample.parent)
    t = time.time()
    sim = simulate(spec, sample, draws=draws, seed=1)
    return {"case": case, "seconds": time.time() - t, "partitions": sim.partitions, "draws": draws,
            "holds": sim.holds, "checks": len(sim.score.checks)}


def run_child(case: str, a: argparse.Namespace) -> dict[str, object]:
    """``child`` in a subprocess: its JSON line."""
    out = subprocess.run([sys.executable, __file__, "--child", case, "--rows", str(a.rows), "--partitions",
                          str(a.partitions), "--draws", str(a.draws)], check=True, stdout=subprocess.PIPE,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    doc: dict[str, object] = json.loads(out.decode().strip().splitlines()[-1])
    return doc


def main(argv: list[str] | None = None) -> int:
    """Interleaved (release, simulate) pairs; writes benchmarks/out/bench_simulate.json."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--partitions", type=int, default=20)
    ap.add_argument("--draws", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--child", default=None)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.rows, a.partitions, a.draws)))
        return 0
    ensure_data(a.rows, a.partitions)
    pairs = []
    for _ in range(max(1, a.repeat)):
        rel, sim = run_child("release", a), run_child("simulate", a)
        r, s = float(rel["seconds"]), float(sim["seconds"])  # type: ignore[arg-type]
        pairs.append({"release": rel, "simulate": sim, "n_runs_estimate_seconds": r * a.draws})
        print(f"rows={a.rows:,} partitions={sim['partitions']}: one release {r:.1f}s; simulate {a.draws} draws "
              f"{s:.1f}s ({sim['checks']} checks, holds={sim['holds']}); {a.draws} releases would take about "
              f"{r * a.draws / 60:.0f} min", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (HERE / "out" / "bench_simulate.json").write_text(json.dumps(pairs, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
