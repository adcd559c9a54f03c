"""Audit benchmark: runtime of the mechanism suite, power against planted 2x bugs, false failures.

    .venv/bin/python benchmarks/bench_audit.py [--seeds 20] [--profile ci] [--skip-suite]

Power = fraction of seeds on which the audit FAILS code whose true ε is twice the claim;
false-failure rate = fraction of seeds on which it fails the correct code (bounded by
1 - confidence per audit).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from contextlib import contextmanager
from unittest import mock


@contextmanager
def laplace_half_scale():
    from dpops.noise import mechanisms
    from dpops.noise.samplers import discrete_laplace_param

    real = mechanisms.laplace_mechanism

    def bug(*a, **kw):
        p = real(*a, **kw)
        return dataclasses.replace(p, lattice=discrete_laplace_param(p.lattice.scale / 2))

    with mock.patch.object(mechanisms, "laplace_mechanism", bug):
        yield


@contextmanager
def replace_with_add_remove_sensitivity():
    from dpops.noise import sensitivity

    real = sensitivity.count
    with mock.patch.object(sensitivity, "count", lambda b: real(dataclasses.replace(b, adjacency="add_remove"))):
        yield


@contextmanager
def nothing():
    yield


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--profile", default="ci")
    ap.add_argument("--skip-suite", action="store_true")
    args = ap.parse_args()

    from dpops.audit.runner import audit_plan
    from dpops.audit.suite import PROFILES, audit_mechanisms, audit_target, mechanism_spec

    if not args.skip_suite:
        t0 = time.time()
        res = audit_mechanisms(args.profile)
        print(f"suite profile={args.profile}: {time.time() - t0:.1f} s")
        for r in res:
            print(f"  {r.target:22s} claimed {r.claimed_epsilon:.3f}  audited >= {r.epsilon_lb:.3f}  "
                  f"trials {r.trials}  {r.seconds:.1f} s  {'PASS' if r.passed else 'FAIL'}")
    prof = PROFILES[args.profile]
    cases = [
        ("count, correct", "count", {}, nothing),
        ("count, Laplace scale / 2", "count", {}, laplace_half_scale),
        ("count replace, correct", "count", {"adjacency": "replace"}, nothing),
        ("count replace, add/remove sensitivity", "count", {"adjacency": "replace"}, replace_with_add_remove_sensitivity),
        ("sum, Laplace scale / 2", "sum", {}, laplace_half_scale),
    ]
    for label, name, kw, ctx in cases:
        fails, lbs, t0 = 0, [], time.time()
        for seed in range(args.seeds):
            with ctx():
                spec = mechanism_spec(name, **kw)
                (r,) = audit_plan(spec, metrics=[audit_target(name)], trials=prof.trials, confidence=prof.confidence,
                                  seed=1000 + seed)
            fails += not r.passed
            lbs.append(r.epsilon_lb)
        lbs.sort()
        print(f"{label:40s} fail rate {fails}/{args.seeds}  audited eps median {lbs[len(lbs) // 2]:.3f} "
              f"min {lbs[0]:.3f} max {lbs[-1]:.3f}  ({(time.time() - t0) / args.seeds:.1f} s/audit)")


if __name__ == "__main__":
    main()
