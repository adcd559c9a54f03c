"""Cost of one reservation check per accountant as the scope's history grows.

The ledger keeps each scope's running state, so a reservation is
``add_events(state, new)`` + ``state_epsilon(new_state, delta)``. This prints that
time for 10, 1,000 and 10,000 prior events (a daily release plan of a few
distinct events repeated), plus the one-off cost of building the state from the
whole history and the JSON size of the state. For pld the cost grows with the
number of *distinct* events, shown in a row after the table. basic/2 charges a
history like DAY (several Gaussian-type events) as basic/1 does; its exact profile
applies to ONE discrete Gaussian, whose uncached cost (the lattice sum is built
once per sigma) is the last rows, for a count (sigma 4.69 steps) and a sum on its
default grid (7,490 steps).

Usage: .venv/bin/python benchmarks/bench_accounting.py [--sizes 10,1000,10000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from dpops.accounting import get_accountant
from dpops.events import ApproxDP, DiscreteGaussian, DiscreteLaplace, Gaussian, Laplace, PureDP

# One day's release: a few mechanisms with fixed parameters (as a release spec produces).
DAY = [
    DiscreteGaussian(40.0, 2.0),
    Gaussian(60.0, 3.0),
    Laplace(50.0, 1.0),
    DiscreteLaplace(30.0, 1.0),
    ApproxDP(0.01, 1e-12, mechanism="partition_selection/truncated_geometric"),
    PureDP(0.005, mechanism="exponential"),
]
NEW = DAY[:3]
DELTA = 1e-6


def history(n: int) -> list:
    return [DAY[i % len(DAY)] for i in range(n)]


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10,1000,10000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--distinct", type=int, default=30, help="distinct events for the pld row (0 to skip)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"{'accountant':<10} {'prior':>7} {'reserve ms':>11} {'build ms':>10} {'state bytes':>12} {'eps':>10}")
    for name in ("basic", "basic/2", "zcdp", "rdp", "pld"):
        acc = get_accountant(name)
        for n in sizes:
            h = history(n)
            build = timed(lambda: acc.add_events(acc.empty_state(), h), 1)
            state = json.loads(json.dumps(acc.add_events(acc.empty_state(), h)))
            result = {}

            def reserve():
                new_state = acc.add_events(state, NEW)
                result["eps"] = acc.state_epsilon(new_state, DELTA)

            if acc.ref == "pld/1":  # every reservation gives a new multiset: measure the uncached cost
                from dpops.accounting import pld as pld_mod

                def reserve_uncached():
                    pld_mod._composed.cache_clear()
                    reserve()

                t = timed(reserve_uncached, args.repeat)
            else:
                t = timed(reserve, args.repeat)
            size = len(json.dumps(state))
            print(f"{acc.ref:<10} {n:>7} {t * 1e3:>11.2f} {build * 1e3:>10.2f} {size:>12} {result['eps']:>10.4f}")
    if args.distinct:
        acc = get_accountant("pld")
        h = [Gaussian(50.0 + i, 1.0) for i in range(args.distinct)]
        state = acc.add_events(acc.empty_state(), h)
        t = timed(lambda: acc.state_epsilon(acc.add_events(state, NEW), DELTA), 1)
        print(f"pld/1 with {args.distinct} distinct prior events: reserve {t * 1e3:.0f} ms")
    from dpops.accounting import gaussian_profiles

    acc = get_accountant("basic/2")
    for what, ev in (("count", DiscreteGaussian(4.6858, 1.0)),
                     ("sum [0,100]", DiscreteGaussian(468.158816, 100.0625, resolution=0.0625))):

        def first_reserve(ev=ev):
            gaussian_profiles.clear_lattice_cache()
            return acc.state_epsilon(acc.add_events(acc.empty_state(), [ev]), 1e-7)

        t = timed(first_reserve, args.repeat)
        print(f"basic/2 one discrete Gaussian {what}: reserve {t * 1e3:.1f} ms uncached, eps {first_reserve():.6f}")


if __name__ == "__main__":
    main()
