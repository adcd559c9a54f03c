"""Benchmark: cost of the exact fixed-point sums (issue 11 item 4) against a float64 bincount.

Per-row CPU time (best of ``--repeat``, ``time.process_time``) of one sum accumulator over
clamped values: the old float64 running sum (``np.bincount(weights=...)``, order-dependent and
unsound) vs ``fixed_point_terms`` + ``exact_group_sum`` (snap once per row, exact integer sums).
Also the accuracy cost on the same rows: the largest |fixed-point sum - exact rational sum| per
partition, in units of the grid step and relative to the noise std of a sum at epsilon = 1.

    python benchmarks/bench_sums.py [--rows 2000000] [--partitions 1000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import time
from fractions import Fraction

import numpy as np


def main(argv: list[str] | None = None) -> int:
    from dpops.noise.mechanisms import laplace_mechanism
    from pipelines.bounding import exact_group_sum, fixed_point_terms, sum_unit

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--partitions", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    gen = np.random.default_rng(0)
    lo, hi, n, k = 0.0, 100.0, args.rows, args.partitions
    x = np.clip(gen.lognormal(2, 1, n), lo, hi)
    pidx = gen.integers(0, k, n)

    def best(f):
        b = float("inf")
        for _ in range(args.repeat):
            t = time.process_time()
            f()
            b = min(b, time.process_time() - t)
        return b

    for kind in ("sum", "nsum", "nsq"):
        mid, h = (lo + hi) / 2, (hi - lo) / 2
        w = {"sum": x, "nsum": x - mid, "nsq": (x - mid) ** 2 - h * h / 2}[kind]
        old = best(lambda: np.bincount(pidx, weights=w, minlength=k))
        new = best(lambda: exact_group_sum(pidx, fixed_point_terms(x, kind, lo, hi), k))
        g = sum_unit(kind, lo, hi)
        got = exact_group_sum(pidx, fixed_point_terms(x, kind, lo, hi), k)
        # exact rational reference of the float terms for the first 20 partitions
        err = 0.0
        for j in range(min(20, k)):
            exact = sum((Fraction(float(t)) for t in w[pidx == j]), Fraction(0))
            err = max(err, abs(float(Fraction(int(got[j])) * Fraction(g) - exact)))
        std = laplace_mechanism(1.0, 10 * (h if kind == "nsum" else h * h / 2 if kind == "nsq" else hi),
                                integer_valued=False).std  # L0*Linf = 10, as in bench_pipeline
        print(f"{kind:>4}: float bincount {old / n * 1e9:5.1f} ns/row, exact {new / n * 1e9:5.1f} ns/row "
              f"(+{(new - old) / n * 1e9:.1f}); max |error| {err:.3g} = {err / g:.0f} grid steps g={g:.3g}, "
              f"{err / std:.2e} noise std at eps 1")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
