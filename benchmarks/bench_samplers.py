"""Samples per second of the exact samplers, for keyed (AES-CTR) and OS randomness.

    .venv/bin/python benchmarks/bench_samplers.py [--sizes 100000 1000000] [--repeat 1]

Prints one row per (sampler, parameter, source, size): the best wall time over ``--repeat``
runs and samples/second. Also times add_noise on 1e6 real values (round to grid + noise).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dpops.noise.mechanisms import add_noise, gaussian_mechanism, laplace_mechanism
from dpops.noise.randomness import NoiseKey, keyed_random, os_random
from dpops.noise.samplers import bernoulli_exp, discrete_gaussian, discrete_laplace

KEY = NoiseKey(b"benchmark-only-key-not-secret-00")


def sources():
    return {"keyed": lambda: keyed_random(KEY, {"bench": "samplers"}), "os": os_random}


def timed(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()

    cases = [
        ("uint64 words", "-", lambda n, s: s.uint64(n)),
        ("bernoulli_exp", "gamma=3/2", lambda n, s: bernoulli_exp(np.full(n, 3), np.full(n, 2), s)),
        ("discrete_laplace", "scale=1", lambda n, s: discrete_laplace(1.0, n, s)),
        ("discrete_laplace", "scale=100", lambda n, s: discrete_laplace(100.0, n, s)),
        ("discrete_gaussian", "sigma=4.23", lambda n, s: discrete_gaussian(4.23, n, s)),
        ("discrete_gaussian", "sigma=1000", lambda n, s: discrete_gaussian(1000.0, n, s)),
    ]
    print(f"{'sampler':<20}{'parameter':<14}{'source':<8}{'n':>10}{'seconds':>10}{'samples/s':>14}")
    for name, param, fn in cases:
        for src_name, make in sources().items():
            for n in args.sizes:
                secs = timed(lambda: fn(n, make()), args.repeat)
                print(f"{name:<20}{param:<14}{src_name:<8}{n:>10}{secs:>10.3f}{n / secs:>14,.0f}")

    values = np.random.default_rng(0).uniform(0, 100, max(args.sizes))
    for label, params in (
        ("add_noise laplace", laplace_mechanism(1.0, 100.0, integer_valued=False, max_coords=5)),
        ("add_noise gaussian", gaussian_mechanism(1.0, 1e-6, 100.0, integer_valued=False, max_coords=5)),
    ):
        secs = timed(lambda: add_noise(values, params, keyed_random(KEY, {"bench": label})), args.repeat)
        print(f"{label:<20}{'real, m=5':<14}{'keyed':<8}{values.size:>10}{secs:>10.3f}{values.size / secs:>14,.0f}")


if __name__ == "__main__":
    main()
