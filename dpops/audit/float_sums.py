"""Audit of the float-sum attack (issue 11 item 4): one unit must never move a sum's lattice
value by more than the charged sensitivity, whatever the other rows and their order.

The noise of a real-valued metric is calibrated for Δ + r·m (``dpops.noise.mechanisms``), which
assumes the per-partition sums are exact. A float64 running sum is not: with 2^22 rows of a
large term, one "carry" row, the target unit's row, then 2^22 rows of a term worth exactly half
a unit in the last place of the running sum, the tiny rows vanish (ties to even) in the
neighbour without the target and not in the one with it. The lattice values then differ by
1026 grid steps against a charge of 1025 (Casacuberta et al. 2022 class of attacks).

The experiment pushes both neighbouring datasets through the pipeline's own functions
(``Harness``: ``prepare_batch``, ``aggregate_bucket``, ``select_and_noise``) and measures the
realised lattice difference d of each sum vector:

- the sum metric: from the *published* column, with the same noise stream in both worlds
  (noise depends on the key, the run label and the partition, never on the data), so
  published(D') − published(D) = r·d exactly;
- a mean's normalised sum and a variance's centred squares (published only after
  post-processing): from the exact accumulators, rounded to the lattice by
  ``dpops.noise.mechanisms.lattice_of_fixed``, the function ``select_and_noise`` applies.

For discrete Laplace noise of lattice scale t, outputs of two inputs whose lattice values differ
by d have a privacy-loss ratio of exactly e^(d/t) at every output, so ε_pair = d/t is a lower
bound on the true ε that holds with certainty (``confidence`` = 1, one trial). The claim is the
vector's own ε = Δ_charged/t; the audit passes when d <= Δ_charged (in grid steps).

Attack rows per case (bounds, L0 = Linf = 1, each row its own unit; terms as
``pipelines.bounding.sum_term_bounds`` defines them):

- ``sum`` on [-1, 1]: 2^22 × 1.0, 0.5, target −1.0, 2^22 × −2^-31;
- ``mean`` on [0, 2] (normalised term x − 1): 2^22 × 2.0, 1.5, target 0.0, 2^22 × (1 − 2^-31);
- ``variance`` on [-1, 1] (centred square x² − 1/2): 2^22 × 1.0 (+1/2), 0.75 (+1/16),
  target 0.0 (−1/2), 2^22 × 0.7071067810219114 (exactly −2^-32).

Under ``replace`` the target row is replaced by a row at the other bound (same partition).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from dpops.audit.harness import Harness, Rows
from dpops.audit.runner import AuditResult

ATTACK_ROWS = 2**22


@dataclass(frozen=True)
class FloatSumCase:
    """One attack case: the metric, its bounds and the rows that make a float64 running sum drop a unit's term."""

    metric: str  # metric type
    bounds: tuple[float, float]
    big: float  # value of the 2^22 large rows
    carry: float  # one row that places the running sum just above a binade boundary
    target: float  # the target unit's value (D' only, or replaced under replace)
    replacement: float  # the replacing unit's value under replace
    tiny: float  # value of the 2^22 rows whose term is half an ulp of the running sum


CASES = {
    "sum": FloatSumCase("sum", (-1.0, 1.0), 1.0, 0.5, -1.0, 1.0, -(2.0**-31)),
    "mean": FloatSumCase("mean", (0.0, 2.0), 2.0, 1.5, 0.0, 2.0, 1.0 - 2.0**-31),
    "variance": FloatSumCase("variance", (-1.0, 1.0), 1.0, 0.75, 0.0, 1.0, 0.7071067810219114),
}


def attack_spec(case: str, adjacency: str = "add_remove"):
    """The release spec of one attack case: one metric, L0 = Linf = 1, one public partition, ε = 1, Laplace."""
    from dpops.spec import parse_spec

    c = CASES[case]
    doc = {
        "name": f"audit_float_sum_{case}",
        "description": "dpops audit: float-sum attack",
        "input": {"path": "unused.parquet", "format": "parquet",
                  "columns": {"user": "int", "region": "string", "amount": "float"}},
        "privacy_unit": {"column": "user", "description": "a synthetic user", "adjacency": adjacency},
        "budget": {"scope": "audit", "epsilon": 1.0, "delta": 0.0, "noise": "laplace"},
        "contribution": {"max_partitions_per_unit": 1, "max_rows_per_unit_per_partition": 1},
        "partitions": {"columns": ["region"], "public": ["p0"]},
        "metrics": [{"type": c.metric, "column": "amount", "bounds": list(c.bounds)}],
    }
    return parse_spec(doc, source=f"<audit float-sum attack: {case}>")


def attack_rows(case: str, world: int, adjacency: str = "add_remove", n: int = ATTACK_ROWS) -> Rows:
    """World 0 = D, 1 = D'. The target sits after the carry row and before the tiny rows."""
    c = CASES[case]
    if adjacency == "replace":
        middle = [c.target if world == 0 else c.replacement]
    else:
        middle = [c.target] if world == 1 else []
    values = np.concatenate([np.full(n, c.big), [c.carry], middle, np.full(n, c.tiny)])
    units = np.arange(values.size, dtype=np.int64) + 2
    if adjacency == "replace" and world == 1:
        units[n + 1] = 1  # u' replaces u (unit id 0 would be the target in D)
    elif middle:
        units[n + 1] = 0
    zeros = np.zeros(values.size, np.int64)
    return Rows(units, zeros, values, zeros - 1)


def audit_float_sums(cases: list[str] | None = None, *, adjacency: str = "add_remove", seed: int = 0,
                     rows: int = ATTACK_ROWS) -> list[AuditResult]:
    """One result per sum vector of each case (see the module docstring)."""
    from dpops.noise.mechanisms import lattice_of_fixed
    from dpops.noise.randomness import test_random
    from dpops.noise.samplers import DiscreteLaplaceParam
    from dpops.release_plan import plan_release
    from pipelines.bounding import SUM_KINDS, sum_unit

    out = []
    for case in cases or list(CASES):
        t0 = time.time()
        spec = attack_spec(case, adjacency)
        plan = plan_release(spec)
        m = plan.metrics[0]
        assert m.bounds is not None  # the attack specs are bounded sums/means with Laplace noise
        h = Harness(spec, plan)
        published, lattice = [], []
        for world in (0, 1):
            data = attack_rows(case, world, adjacency, rows)
            rng = test_random(seed, ("audit", "float_sum", case))  # the same noise in both worlds
            parts, acc, names, pub_h, pub_n = h.accumulate(data, 1, rng)
            vals = {}
            for v in m.vectors:
                kind = v.accumulator.split(":")[0]
                if kind in SUM_KINDS:
                    vals[v.name] = int(lattice_of_fixed(acc[v.accumulator], sum_unit(kind, *m.bounds), v.params)[0])
            lattice.append(vals)
            if m.type == "sum":
                from pipelines.aggregate import select_and_noise

                cols = select_and_noise(0, parts, acc, names, h.plan, pub_h, pub_n, rng)
                published.append(float(cols[m.key][0]))
        for v in m.vectors:
            if v.name not in lattice[0]:
                continue
            r = v.params.resolution
            if m.type == "sum":
                d = abs(Fraction(published[1]) - Fraction(published[0])) / Fraction(r)  # exact: both on the r-grid
            else:
                d = Fraction(abs(lattice[1][v.name] - lattice[0][v.name]))
            lat = v.params._lattice()
            assert isinstance(lat, DiscreteLaplaceParam) and v.params.l1_sensitivity is not None
            charged = Fraction(v.params.l1_sensitivity) / Fraction(r)
            scale = Fraction(lat.t, lat.s)  # discrete Laplace lattice scale t/s
            claimed = float(charged / scale)
            out.append(AuditResult(
                target=f"{m.key}/{v.name}", mechanism=f"float_sum_attack ({adjacency})", claimed_epsilon=claimed,
                delta=0.0, epsilon_lb=float(d / scale), trials=1, confidence=1.0,
                scenario=f"2x2^{rows.bit_length() - 1} rows + carry + target",
                event=f"lattice difference {d} vs charged {charged}", passed=d <= charged,
                seconds=round(time.time() - t0, 2)))
    return out


__all__ = ["CASES", "ATTACK_ROWS", "FloatSumCase", "attack_spec", "attack_rows", "audit_float_sums"]
