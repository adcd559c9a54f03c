"""Worst-case neighbouring datasets and the statistic the auditor reads from a run.

Layout. A trial is a *group* of J partitions. The target privacy unit lives in the group:

- ``add_remove``: D has no target; D' adds unit u to partitions P = {0 .. L0-1};
  weights w = +1 on P.
- ``replace``: D holds unit u in A = {0 .. L0-1}; D' replaces it by u' in B = {L0 .. 2L0-1}
  (the general replace case: the newcomer touches other partitions); w = -1 on A, +1 on B.

The statistic of a trial is s = sum_j w_j · out_j, where out_j is the metric's released value
in partition j (0 for an unreleased partition), 1[partition kept] for partition selection,
1[rank-1 category is the target's category] for top_k. The unit sits at its bounds: Linf rows
per partition, values at the extreme of the clamp range (largest |contribution|).

Two scenarios per metric:

- ``at_bounds``: exactly L0 partitions, Linf rows, extreme values: the tight case.
- ``over_bounds``: the unit breaks every declared bound -- 2·L0 partitions, 4·Linf rows,
  values 10 ranges beyond the clamp, a NaN row first -- which correct bounding reduces to
  the tight case; a bounding bug (L0/Linf not enforced, clamp skipped, NaN kept) makes the
  unit's influence larger than the noise was calibrated for, or makes the run fail only when
  the unit is present (the failure itself is an event the auditor counts).

Base rows (other units, one row each) are added where the mechanism's output depends on them:
mid-range values under means/variances, a spread of values under quantiles, a competing
category under top_k, n0 units under partition selection (n0 chosen from the public keep
probabilities), and enough units to make partitions certain to be kept when partitions are
private and a metric is audited.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dpops.audit.harness import Harness, Rows, block

if TYPE_CHECKING:
    from dpops.noise.selection import PartitionSelection

UNIT_STRIDE = 1_000_000  # unit ids g * UNIT_STRIDE + k: target u = 0, u' = 1, base units from 2
MAX_BASE_ROWS_PER_PARTITION = 200
Z_PLAN = 2.6  # z-score used only to pick n0 for partition selection (not part of the bound)


@dataclass(frozen=True)
class Scenario:
    """One pair of neighbouring datasets, laid out as T independent groups of J partitions (one trial each)."""

    name: str
    n_parts: int  # J, partitions per group
    weights: np.ndarray  # (J,)
    build: Callable[[int, int], Rows]  # (world 0 = D / 1 = D', groups T) -> rows
    read: Callable[[dict, int], np.ndarray]  # (released columns, T) -> per-partition values (T*J,)

    def rows(self, world: int, groups: int) -> Rows:
        """The rows of ``groups`` trials on neighbour ``world`` (0 = D, 1 = D')."""
        return self.build(world, groups)

    def statistic(self, cols: dict, groups: int) -> np.ndarray:
        """(groups, 1 or 2): the weighted sum, and with J > 1 the smallest weighted coordinate.

        The sum suits Gaussian noise; the minimum makes {every coordinate moved} events, whose
        ratio reaches the full e^ε for Laplace-type noise on several coordinates (a replace moves
        one partition down and another up).
        """
        v = self.read(cols, groups).reshape(groups, self.n_parts)
        total = v @ self.weights
        if self.n_parts == 1:
            return total.reshape(-1, 1)
        return np.column_stack([total, (v * self.weights).min(axis=1)])


def _per_partition(cols: dict, groups: int, n_parts: int, column: str, transform=None) -> np.ndarray:
    out = np.zeros(groups * n_parts)
    idx = np.asarray(cols["_part"], np.int64)
    if idx.size:
        vals = cols[column]
        vals = np.asarray(transform(vals) if transform else vals, np.float64)
        out[idx] = vals
    return out


def _presence(cols: dict, groups: int, n_parts: int) -> np.ndarray:
    out = np.zeros(groups * n_parts)
    idx = np.asarray(cols["_part"], np.int64)
    out[idx] = 1.0
    return out


def _extreme(lo: float, hi: float) -> tuple[float, float]:
    """(value with the largest |contribution|, a value far beyond it on the same side)."""
    v = hi if abs(hi) >= abs(lo) else lo
    span = (hi - lo) or 1.0
    return v, v + math.copysign(10.0 * span + 1.0, v if v != 0 else 1.0)


class ScenarioBuilder:
    """Builds the neighbouring datasets that stress each metric of a plan at its contribution bounds.

    The target unit contributes the L0 partitions and Linf rows it is allowed (and, in the "over" scenarios,
    more than that, which bounding must drop), at the values that move each statistic most.
    """

    def __init__(self, h: Harness):
        self.h = h
        self.plan = h.plan
        self.l0 = int(h.plan.max_partitions_per_unit)
        self.linf = int(h.plan.max_rows_per_unit_per_partition)
        self.replace = h.plan.adjacency == "replace"
        if h.record_level:  # every row is a unit: one row, one partition
            self.l0 = self.linf = 1

    # -------------------------------------------------------------- target placement
    def _target(self, world: int, groups: int, over: bool, value: float, cat: int) -> Rows:
        n_p = 2 * self.l0 if over and not self.h.record_level else self.l0
        rows_per = 4 * self.linf if over and not self.h.record_level else self.linf
        if self.replace:
            offset, k = (n_p, 1) if world == 1 else (0, 0)
        else:
            if world == 0:
                return Rows.empty()
            offset, k = 0, 0
        J = self.n_parts(over)
        g = np.repeat(np.arange(groups), n_p * rows_per)
        j = np.tile(np.repeat(np.arange(n_p) + offset, rows_per), groups)
        units = g * UNIT_STRIDE + k
        if self.h.record_level:  # each row its own unit anyway; keep ids distinct for clarity
            units = units * 2 + world
        rows = block(units, g * J + j, value, cat)
        if over and not self.h.record_level:
            rows.value[::rows_per] = np.nan  # the first row of each partition: must be dropped
        return rows

    def n_parts(self, over: bool) -> int:
        """J: the partitions one trial group spans (the target's L0, doubled for "over" and again for replace)."""
        n_p = 2 * self.l0 if over and not self.h.record_level else self.l0
        return 2 * n_p if self.replace else n_p

    def _weights(self, over: bool) -> np.ndarray:
        J = self.n_parts(over)
        w = np.ones(J)
        if self.replace:
            w[: J // 2] = -1.0
        return w

    def _base(self, groups: int, J: int, per_part: int, values: np.ndarray | float, cat: int = -1,
              first_id: int = 2) -> Rows:
        """``per_part`` other units per partition, one row each (values cycled per partition)."""
        if per_part <= 0:
            return Rows.empty()
        vals = np.resize(np.asarray(values, np.float64), per_part)
        n = groups * J * per_part
        g = np.repeat(np.arange(groups), J * per_part)
        j = np.tile(np.repeat(np.arange(J), per_part), groups)
        k = np.tile(np.arange(per_part), groups * J) + first_id + j * per_part
        rows = block(g * UNIT_STRIDE + k, g * J + j, 0.0, cat)
        rows.value = np.tile(vals, groups * J)[:n]
        return rows

    def _presence_base(self, J: int) -> int:
        """Units per partition that make a private partition (almost) surely kept; 0 for public."""
        ps = self.plan.partition_selection
        if ps is None:
            return 0
        n = 1
        while ps.keep_probability(np.array([n]))[0] < 1.0 - 1e-9 and n < 100_000:
            n = n * 2 if n < 64 else n + 64
        return n

    # -------------------------------------------------------------- per metric
    def metric(self, key: str) -> list[Scenario]:
        """The scenarios for metric ``key``: within the bounds, and (unit-level plans) beyond them."""
        m = next((x for x in self.plan.metrics if x.key == key), None)
        if m is None:
            raise KeyError(key)
        out = []
        for over in (False, True):
            if over and self.h.record_level:
                continue
            out.append(self._metric_scenario(m, over))
        return out

    def _metric_scenario(self, m, over: bool) -> Scenario:
        J = self.n_parts(over)
        w = self._weights(over)
        presence = self._presence_base(J)
        base_units = presence
        base_vals: np.ndarray | float = 0.0
        cat_target, cat_base = -1, -1
        value, over_value = 0.0, 0.0
        if m.type in ("sum", "mean", "variance", "quantiles"):
            lo, hi = m.bounds
            if m.type == "sum":
                value, over_value = _extreme(lo, hi)
            else:
                value, over_value = hi, hi + 10.0 * ((hi - lo) or 1.0) + 1.0
            mid = (lo + hi) / 2.0
            base_vals = mid
            if m.type in ("mean", "variance"):
                src = m
                if getattr(m, "count_from", None):  # the count vector is another metric's
                    src = next(x for x in self.plan.metrics if x.key == m.count_from)
                std_c = max(float(v.params.std) for v in src.vectors if v.name == "count")
                base_units = max(base_units,
                                 min(MAX_BASE_ROWS_PER_PARTITION, max(4 * self.linf, math.ceil(10 * std_c))))
            if m.type == "quantiles":
                # Linf other rows at mid: on D every candidate ties; the unit's Linf rows at hi lift
                # the candidates in [mid, hi) above those below mid by the utility sensitivity.
                base_units = max(base_units, self.linf)
        if m.type == "top_k":
            cat_target, cat_base = 0, 1 if len(m.domain) > 1 else 0
        target_value = over_value if over else value

        def build(world: int, groups: int) -> Rows:
            parts = [self._base(groups, J, base_units, base_vals, cat=-1),
                     self._target(world, groups, over, target_value, cat_target)]
            if m.type == "top_k":  # a competitor: one base unit with Linf rows of category 1 per partition
                g = np.repeat(np.arange(groups), J * self.linf)
                j = np.tile(np.repeat(np.arange(J), self.linf), groups)
                uid = g * UNIT_STRIDE + UNIT_STRIDE - 1 - j
                parts.append(block(uid, g * J + j, 0.0, cat_base))
            return Rows.concat(parts)

        if m.type == "mean":
            read = self._mean_reader(m, J, base_units, value)
        elif m.vectors:
            col = m.key
            def read(cols, groups):
                return _per_partition(cols, groups, J, col)
        elif m.type == "quantiles":
            col = f"{m.key}_{m.quantile_suffixes[0]}"
            def read(cols, groups):
                return _per_partition(cols, groups, J, col)
        else:  # top_k
            col = f"{m.key}_rank1"
            target_name = m.domain[0]
            def read(cols, groups):
                return _per_partition(cols, groups, J, col,
                                      lambda v: np.array([x == target_name for x in v], np.float64))
        return Scenario("over_bounds" if over else "at_bounds", J, w, build, read)

    def _mean_reader(self, m, J: int, base: int, value: float):
        """Per partition: min(noisy normalised sum / its shift, (noisy count - base) / its shift).

        The released std of a mean is sqrt(sd_nsum² + (m1·sd_count)²)/count with m1 = mean - mid,
        so (with clamping off) the noisy count and normalised sum are both recoverable from the
        published columns -- post-processing of released values, not a leak. Requiring both to
        have moved ("min") makes an event whose ratio reaches e^ε for the two Laplace halves.
        """
        lo, hi = m.bounds
        mid = (lo + hi) / 2.0
        src = m
        if getattr(m, "count_from", None):
            src = next(x for x in self.plan.metrics if x.key == m.count_from)
        sd_c = next(float(v.params.std) for v in src.vectors if v.name == "count")
        sd_s = next(float(v.params.std) for v in m.vectors if v.name == "normalized_sum")
        shift_s = self.linf * abs(value - mid) or 1.0
        shift_c = float(self.linf)
        key = m.key

        def read(cols, groups):
            val = _per_partition(cols, groups, J, key)
            sd = _per_partition(cols, groups, J, f"{key}_std")
            m1 = val - mid
            with np.errstate(divide="ignore", invalid="ignore"):
                cnt = np.where(sd > 0, np.sqrt(sd_s**2 + (m1 * sd_c) ** 2) / sd, 0.0)
            return np.minimum(m1 * cnt / shift_s, (cnt - base) / shift_c)

        return read

    # -------------------------------------------------------------- partition selection
    def partition_selection(self, trials_hint: int) -> list[Scenario]:
        """Scenarios for private partition selection: n0 other units in the target's partitions (0 and a hard n0)."""
        ps = self.plan.partition_selection
        if ps is None:
            return []
        n_mid = self._best_n0(ps, max(2, trials_hint // 2))
        out = [self._ps_scenario("n0=0", 0, over=False)]
        out.append(self._ps_scenario(f"n0={n_mid}", n_mid, over=False))
        if not self.h.record_level:
            out.append(self._ps_scenario(f"n0={n_mid},over_bounds", n_mid, over=True))
        return out

    def _best_n0(self, ps: PartitionSelection, half: int) -> int:
        """n0 whose per-partition keep probabilities (public, from the parameters) separate best."""
        n = np.arange(0, 4096)
        p = ps.keep_probability(n)
        best, best_n = -math.inf, 1
        ps_event = self.plan.partition_selection_event
        assert ps_event is not None  # plan_release sets it together with partition_selection
        delta = float(ps_event.delta)
        for k in range(1, len(n) - 1):
            p0, p1 = p[k], p[k + 1]
            for a, b in ((p1, p0), (1 - p0, 1 - p1)):
                lo = a - Z_PLAN * math.sqrt(a * (1 - a) / half) - delta
                hi = b + Z_PLAN * math.sqrt(b * (1 - b) / half) + 1.0 / half
                if lo > 0 and math.log(lo / hi) > best:
                    best, best_n = math.log(lo / hi), k
            if p0 >= 1.0:
                break
        return best_n

    def _ps_scenario(self, name: str, n0: int, over: bool) -> Scenario:
        J = self.n_parts(over)
        w = self._weights(over)
        mid = 0.0
        for m in self.plan.metrics:
            if m.bounds is not None:
                mid = (m.bounds[0] + m.bounds[1]) / 2.0  # a valid value for every value column
                break

        def build(world: int, groups: int) -> Rows:
            return Rows.concat([self._base(groups, J, n0, mid), self._target(world, groups, over, mid, -1)])

        def read(cols, groups):
            return _presence(cols, groups, J)

        return Scenario(name, J, w, build, read)


__all__ = ["Scenario", "ScenarioBuilder"]
