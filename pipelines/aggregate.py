"""Per partition shard: partition selection, noise, post-processing and 95% intervals.

Everything here runs on exactly the mechanisms in the release plan. Noise is drawn
from ``rng.child(<what>, <metric>, <vector>, shard)`` over partitions sorted by
their hash, so one key and one input give the same numbers on every runner and
with any parallelism.

Post-processing (free, semantics.md section 3) uses noisy values and public
parameters only:
- counts / unit counts: ``non_negative`` clamps at 0; intervals are
  noisy +- the mechanism's exact 95% half-width, clamped at 0 too (the truth is >= 0);
- sums: non-negative clamping only when the lower value bound is >= 0;
- mean = mid + nsum/max(count, 1), clamped to the bounds; std by the delta method
  from the two noise stds (an approximation, stated in the summary);
- variance = m2 - m1^2 from the centred vectors, clamped to [0, ((hi-lo)/2)^2];
- quantiles: exponential mechanism per partition and quantile over the public grid
  (no std/interval: the output is a selection, not additive noise); quantiles of a
  partition are sorted, which is post-processing;
- top_k: category names by rank;
- suppress_below: partitions whose first noisy count (a count / unit_count metric, else a
  mean's or variance's count vector) is below it get null metric values; without any count
  vector in the plan nothing is suppressed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipelines.bounding import SUM_KINDS, quantile_candidates, sum_unit

Z95 = 1.959963984540054


def _label(v: Any) -> Any:
    """The published partition label: floats normalised (-0.0 -> 0.0).

    -0.0 and 0.0 hash to one partition (``pipelines.io.hash_column``); its label is taken from the
    first row seen, so without this the sign bit of a private row's value would be published.
    """
    return v + 0.0 if isinstance(v, float) else v


def select_and_noise(
    shard: int,
    parts: np.ndarray,
    acc: dict[str, np.ndarray],
    names: dict[int, tuple[Any, ...]],
    plan,
    public_hashes: np.ndarray | None,
    public_names: dict[int, tuple[Any, ...]] | None,
    rng,
) -> dict[str, list | np.ndarray]:
    """Columns (partition columns first, then metrics) of one shard's released partitions."""
    from dpops.noise.mechanisms import add_noise, add_noise_fixed
    from dpops.noise.selection import exponential_mechanism, histogram_quantile_utility, top_k

    parts, acc = _align(parts, acc, public_hashes, plan)
    if plan.partition_selection is not None and len(parts):
        keep = np.asarray(plan.partition_selection.keep(acc["unit_count"], rng.child("partition_selection", shard)), bool)
        parts = parts[keep]
        acc = {k: v[keep] for k, v in acc.items()}
    lookup = public_names if public_names is not None else names
    cols: dict[str, Any] = {}
    for j, c in enumerate(plan.partition_columns):
        cols[c] = [_label(lookup[int(h)][j]) for h in parts]
    n = len(parts)
    suppress_basis = None

    # Noise every vector first: means/variances may reuse the count metric's noisy vector.
    noisy_by_metric: dict[str, tuple[dict, dict]] = {}
    for m in plan.metrics:
        noisy, std = {}, {}
        for v in m.vectors:
            true = acc[v.accumulator]
            kind = v.accumulator.split(":")[0]
            if not v.params.integer_valued and kind in SUM_KINDS:
                # exact fixed-point sum (pipelines.bounding): rounded to the noise grid in integers
                noisy[v.name] = add_noise_fixed(true, sum_unit(kind, *m.bounds), v.params,
                                                rng.child("noise", m.key, v.name, shard))
            else:
                true = true.astype(np.int64) if v.params.integer_valued else true.astype(np.float64)
                noisy[v.name] = np.asarray(add_noise(true, v.params, rng.child("noise", m.key, v.name, shard)))
            std[v.name] = float(v.params.std)
            noisy[v.name + "/hw"] = float(v.params.ci95_halfwidth())
        noisy_by_metric[m.key] = (noisy, std)

    for m in plan.metrics:
        if m.vectors:
            noisy, std = noisy_by_metric[m.key]
            if m.count_from:
                c_noisy, c_std = noisy_by_metric[m.count_from]
                noisy = {**noisy, "count": c_noisy["count"], "count/hw": c_noisy["count/hw"]}
                std = {**std, "count": c_std["count"]}
            _post_metric(cols, m, noisy, std, plan.postprocess, n)
            if suppress_basis is None:
                for name in ("count", "unit_count"):
                    if name in noisy:
                        suppress_basis = noisy[name].astype(np.float64)
                        break
        elif m.type == "quantiles":
            mrng = rng.child("quantile", m.key, shard)
            lo, hi = m.bounds
            cand = quantile_candidates(lo, hi, m.n_bins)
            hist = acc[f"hist:{m.key}{m.bound_suffix}"]
            out = np.empty((n, len(m.quantiles)))
            # integer utilities -|d rank - a n| with sensitivity d * Delta (histogram_quantile_utility, the
            # owner the prediction shares): the exact (integer) permute-and-flip path.
            for i in range(n):
                for jq, q in enumerate(m.quantiles):
                    util, d = histogram_quantile_utility(hist[i], q)
                    pick = exponential_mechanism(util, m.per_run_epsilon, m.utility_sensitivity * d, mrng)
                    out[i, jq] = cand[int(pick)]
            # Post-processing: the picks sorted, so the published quantiles never cross; the smallest value goes
            # to the smallest quantile whatever order the spec lists them in.
            out.sort(axis=1)
            for rank, jq in enumerate(np.argsort(np.asarray(m.quantiles, np.float64), kind="stable")):
                cols[f"{m.key}_{m.quantile_suffixes[int(jq)]}"] = out[:, rank]
        elif m.type == "top_k":
            mrng = rng.child("top_k", m.key, shard)
            cats = acc[f"cat:{m.key}{m.bound_suffix}"]
            ranks = [[None] * n for _ in range(m.k)]
            for i in range(n):
                picked = top_k(cats[i].astype(np.int64), m.k, m.per_run_epsilon, m.utility_sensitivity, mrng,
                               monotonic=m.monotonic)
                for r, idx in enumerate(picked):
                    ranks[r][i] = m.domain[int(idx)]
            for r in range(m.k):
                cols[f"{m.key}_rank{r + 1}"] = ranks[r]

    threshold = plan.postprocess.get("suppress_below")
    if threshold is not None and suppress_basis is not None and n:
        # Post-processing of a noisy count: blank (null) every metric value of such partitions.
        import pyarrow as pa

        blank = suppress_basis < float(threshold)
        for name in list(cols):
            if name in plan.partition_columns:
                continue
            v = cols[name]
            cols[name] = pa.array([None if b else x for x, b in zip(v, blank)]) if isinstance(v, list) \
                else pa.array(np.asarray(v), mask=blank)
    return cols


def _align(parts, acc, public_hashes, plan):
    """Public partitions: every public partition of this shard appears (zeros where no data)."""
    if public_hashes is None:
        return parts, acc
    idx = np.searchsorted(public_hashes, parts)
    out = {}
    for k, v in acc.items():
        z = np.zeros((len(public_hashes),) + v.shape[1:], dtype=v.dtype)
        if len(parts):
            z[idx] = v
        out[k] = z
    return public_hashes, out


def _clamp_nonneg(x, on: bool):
    return np.maximum(x, 0) if on else x


def _post_metric(cols, m, noisy, std, post, n) -> None:
    key = m.key
    nonneg = bool(post.get("non_negative", True))
    if m.type in ("count", "unit_count"):
        raw = noisy[m.type]
        hw = noisy[m.type + "/hw"]
        val = _clamp_nonneg(raw, nonneg)
        if not post.get("integer_counts", True):
            val = val.astype(np.float64)
        cols[key] = val
        cols[f"{key}_std"] = np.full(n, std[m.type])
        cols[f"{key}_ci95_low"] = _clamp_nonneg(raw - hw, nonneg).astype(np.float64)
        cols[f"{key}_ci95_high"] = _clamp_nonneg(raw + hw, nonneg).astype(np.float64)
        return
    lo, hi = m.bounds
    mid, half = (lo + hi) / 2.0, (hi - lo) / 2.0
    if m.type == "sum":
        raw, hw = noisy["sum"], noisy["sum/hw"]
        on = nonneg and lo >= 0
        cols[key] = _clamp_nonneg(raw, on)
        cols[f"{key}_std"] = np.full(n, std["sum"])
        cols[f"{key}_ci95_low"] = _clamp_nonneg(raw - hw, on)
        cols[f"{key}_ci95_high"] = _clamp_nonneg(raw + hw, on)
        return
    cnt = np.maximum(noisy["count"].astype(np.float64), 1.0)
    s1 = noisy["normalized_sum"]
    clamp = bool(post.get("clamp_means_to_bounds", True))
    if m.type == "mean":
        m1 = s1 / cnt
        val = mid + m1
        sd = np.sqrt(std["normalized_sum"] ** 2 + (m1 * std["count"]) ** 2) / cnt
        low, high = val - Z95 * sd, val + Z95 * sd
        if clamp:
            val, low, high = (np.clip(a, lo, hi) for a in (val, low, high))
        cols[key], cols[f"{key}_std"], cols[f"{key}_ci95_low"], cols[f"{key}_ci95_high"] = val, sd, low, high
        return
    # variance
    s2 = noisy["normalized_sum_squares"] + cnt * half * half / 2.0  # undo the centring of the squares
    m1, m2 = s1 / cnt, s2 / cnt
    val = m2 - m1 * m1
    d_s2, d_s1, d_n = 1.0 / cnt, -2.0 * s1 / cnt**2, -s2 / cnt**2 + 2.0 * s1 * s1 / cnt**3
    sd_c = std["count"]
    sd = np.sqrt((d_s2 * std["normalized_sum_squares"]) ** 2 + (d_s1 * std["normalized_sum"]) ** 2 + (d_n * sd_c) ** 2)
    low, high = val - Z95 * sd, val + Z95 * sd
    vmax = half * half
    val, low, high = (np.clip(a, 0.0, vmax) for a in (val, low, high))
    cols[key], cols[f"{key}_std"], cols[f"{key}_ci95_low"], cols[f"{key}_ci95_high"] = val, sd, low, high
