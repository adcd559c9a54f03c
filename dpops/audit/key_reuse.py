"""Audit of noise-key reuse: a changed input must get fresh noise.

Noise is a deterministic function of (secret key, run label) (semantics.md section 3). If the
label did not change with the input, a restatement over corrected input would reuse the
original run's noise, and the difference of the two published tables would be the exact
difference of the true values: a unit's data revealed with no noise at all.

The experiment follows a restatement. The original run reads X; late data arrives and the
restatement reads X + v (+ u): v is a late unit that is always there (so the input always
changes), u is the target unit. The adversary sees both releases and computes, per trial group,
s = stat(restatement) - stat(original). World D: late data without u; world D': with u. Labels
are built by the real ``dpops.release.RunContext.noise_label`` from the real keyed
``dpops.inputs.input_fingerprint`` of the two input files, and the noise is drawn by
``keyed_random(key, label)`` exactly as the pipeline's ``RandomnessConfig.source`` does.
Both releases are charged, so the claim checked is twice the metric's ε. With fresh noise the
bound stays below it; with a reused key s is 0 in one world and exactly the unit's
contribution in the other, and the bound is as large as the trial count allows.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from dpops.audit.harness import Harness, Rows, block
from dpops.audit.runner import AuditResult
from dpops.audit.scenarios import UNIT_STRIDE, ScenarioBuilder
from dpops.audit.stats import held_out_bound

INTERVAL = ("2026-01-01T00:00:00+00:00", "2026-01-02T00:00:00+00:00")


def _noise_label(spec, fingerprint: str) -> dict:
    from dpops.release import RunContext

    ctx = SimpleNamespace(spec=spec, interval=SimpleNamespace(start_iso=INTERVAL[0], end_iso=INTERVAL[1]),
                          input_fingerprint=fingerprint, randomness="keyed", attempt=1)
    # the property's getter on a stand-in holding only what the label reads
    return RunContext.noise_label.fget(ctx)  # type: ignore[attr-defined]


def _fingerprint(h: Harness, rows: Rows, n_parts: int, path: Path) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dpops.inputs import TestFingerprintKey, input_fingerprint

    pq.write_table(pa.Table.from_batches([h.to_batch(rows, n_parts)]), path)
    return input_fingerprint([str(path)], TestFingerprintKey())


def audit_key_reuse(spec=None, *, trials: int = 2000, confidence: float = 0.99, seed: int = 0) -> AuditResult:
    """Two releases (original + restatement) per world; see the module docstring."""
    from dpops.noise.randomness import NoiseKey, keyed_random
    from dpops.release_plan import plan_release

    if spec is None:
        from dpops.audit.suite import mechanism_spec

        spec = mechanism_spec("count")
    t0 = time.time()
    plan = plan_release(spec)
    m = next((x for x in plan.metrics if x.vectors), None)
    if m is None:
        from dpops.errors import SpecError

        raise SpecError(f"{spec.source}: key-reuse audit needs a noised metric (count, sum, mean, ...)")
    h = Harness(spec, plan)
    sc = ScenarioBuilder(h).metric(m.key)[0]  # at bounds
    n_parts = trials * sc.n_parts + 1  # + the late unit v's partition
    late_v = block(np.array([trials * UNIT_STRIDE + 7]), np.array([n_parts - 1]), 0.0)
    stats = []
    with tempfile.TemporaryDirectory(prefix="dpops-audit-") as tmp:
        for world in (0, 1):
            key = NoiseKey(hashlib.sha256(f"dpops-audit/key-reuse/{seed}/{world}".encode()).digest())
            original = sc.rows(0, trials)
            restated = Rows.concat([sc.rows(world, trials), late_v])
            outs = []
            for i, rows in enumerate((original, restated)):
                fp = _fingerprint(h, rows, n_parts, Path(tmp) / f"w{world}-run{i}.parquet")
                rng = keyed_random(key, _noise_label(spec, fp))
                cols = h.run(rows, n_parts, rng)
                keep = np.asarray(cols["_part"]) < n_parts - 1  # drop v's partition
                sub = {k: (np.asarray(v)[keep] if len(v) == len(keep) else v) for k, v in cols.items()}
                outs.append(sc.statistic(sub, trials))
            stats.append(outs[1][:, 0] - outs[0][:, 0])  # difference of the weighted sums
    b = held_out_bound(stats[0], stats[1], 2 * float(m.delta), 1.0 - confidence)
    claimed = 2.0 * float(m.epsilon)
    return AuditResult(target=f"{m.key}/restatement", mechanism="key_reuse", claimed_epsilon=claimed,
                       delta=2 * float(m.delta), epsilon_lb=b.epsilon_lb, trials=trials, confidence=confidence,
                       scenario="original X, restatement X+v(+u)", event=b.event, passed=b.epsilon_lb <= claimed,
                       seconds=round(time.time() - t0, 2))


__all__ = ["audit_key_reuse"]
