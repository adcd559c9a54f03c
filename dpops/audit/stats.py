"""Statistics of the audit: Clopper–Pearson intervals and a held-out lower bound on epsilon.

A mechanism M is (ε, δ)-DP only if, for every pair of neighbours D, D' and every output event E,
P[M(D) ∈ E] <= e^ε · P[M(D') ∈ E] + δ (and the same with D, D' swapped). So any event with
p1 = P[M(D') ∈ E] and p0 = P[M(D) ∈ E] proves ε >= ln((p1 − δ) / p0). We only see frequencies,
so we replace p1 by a Clopper–Pearson LOWER confidence limit and p0 by an UPPER one, each at
level α/2: with probability >= 1 − α the bound is below the true ε of the mechanism
(Jagielski et al. 2020; Nasr et al. 2021). A bound above the claimed ε is therefore, up to
that α, proof of a bug.

The event is chosen from the data, which would invalidate the intervals if the same trials were
used twice. ``held_out_bound`` chooses the event (and its direction) on the first half of the
trials and evaluates that single event on the second half, so the evaluated intervals are the
ordinary ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import beta

from dpops.errors import InvalidParameter

MAX_THRESHOLDS = 160  # candidate thresholds per direction (quantiles of the pooled selection half)
MAX_CATEGORIES = 64  # a statistic with at most this many distinct values also gets {s == c} events


def cp_lower(k: int, n: int, alpha: float) -> float:
    """One-sided (1 − α) Clopper–Pearson lower limit of a binomial proportion."""
    _check_kn(k, n)
    return 0.0 if k == 0 else float(beta.ppf(alpha, k, n - k + 1))


def cp_upper(k: int, n: int, alpha: float) -> float:
    """One-sided (1 − α) Clopper–Pearson upper limit of a binomial proportion."""
    _check_kn(k, n)
    return 1.0 if k == n else float(beta.ppf(1.0 - alpha, k + 1, n - k))


def _check_kn(k: int, n: int) -> None:
    if n < 1 or not (0 <= k <= n):
        raise InvalidParameter(f"binomial counts must satisfy 0 <= k <= n, n >= 1; got k={k}, n={n}")


def epsilon_from_counts(k1: int, n1: int, k0: int, n0: int, delta: float, alpha: float) -> float:
    """ln((p1_lo − δ) / p0_hi) with both limits at α/2: a (1 − α) lower bound on ε (−inf if none)."""
    lo = cp_lower(k1, n1, alpha / 2)
    hi = cp_upper(k0, n0, alpha / 2)
    if lo <= delta:
        return -math.inf
    return math.log((lo - delta) / hi)


@dataclass(frozen=True)
class Event:
    """An output event on a scalar statistic s: s >= t, s <= t, s == t, or 'the run failed' (s is NaN)."""

    op: str  # ">=", "<=", "==", "error"
    threshold: float = 0.0
    column: int = 0  # which statistic, when a trial yields several (one row per trial)

    def indicator(self, s: np.ndarray) -> np.ndarray:
        """Per trial: did the event happen (a failed run counts only for the ``error`` event)?"""
        s = _as_2d(s)
        err = np.isnan(s).any(axis=1)
        if self.op == "error":
            return err
        s = s[:, self.column]
        with np.errstate(invalid="ignore"):
            if self.op == ">=":
                hit = s >= self.threshold
            elif self.op == "<=":
                hit = s <= self.threshold
            else:
                hit = s == self.threshold
        return hit & ~err

    def describe(self) -> str:
        """The event in words, for reports (e.g. ``s >= 3``)."""
        if self.op == "error":
            return "run failed"
        return f"{'s' if self.column == 0 else f's{self.column}'} {self.op} {self.threshold:.6g}"


def _as_2d(s: np.ndarray) -> np.ndarray:
    s = np.asarray(s, np.float64)
    return s.reshape(-1, 1) if s.ndim == 1 else s


def candidate_events(s0: np.ndarray, s1: np.ndarray) -> list[Event]:
    """Events from the pooled selection half only (never from the evaluation half)."""
    pooled = np.concatenate([_as_2d(s0), _as_2d(s1)])
    events: list[Event] = []
    bad = np.isnan(pooled).any(axis=1)
    if bad.any():
        events.append(Event("error"))
    ok = pooled[~bad]
    if ok.shape[0] == 0:
        return events
    for col in range(ok.shape[1]):
        finite = ok[:, col]
        uniq = np.unique(finite)
        if uniq.size <= MAX_CATEGORIES:
            events += [Event("==", float(u), col) for u in uniq]
            cuts = uniq
        else:
            cuts = np.unique(np.quantile(finite, np.linspace(0.0, 1.0, MAX_THRESHOLDS)))
        events += [Event(">=", float(t), col) for t in cuts] + [Event("<=", float(t), col) for t in cuts]
    return events


@dataclass(frozen=True)
class Bound:
    """An ε lower bound from the evaluation half, with the event that gave it and its two frequencies."""

    epsilon_lb: float  # max(0, bound): 0 means "no evidence of any privacy loss"
    event: str  # the chosen event, e.g. "s >= 3 on D' vs D"
    trials: int  # trials per neighbour (both halves)
    p1: float  # evaluation-half frequency of the event on the favoured neighbour
    p0: float  # ... and on the other one


def held_out_bound(s_d: np.ndarray, s_dp: np.ndarray, delta: float, alpha: float) -> Bound:
    """Choose (event, direction) on the first half, bound ε with the second half (confidence 1 − α).

    ``s_d`` / ``s_dp``: the statistic of each trial on D and on D' (NaN = the run raised an error);
    one row per trial and one column per statistic when a trial yields several.
    """
    s_d, s_dp = _as_2d(s_d), _as_2d(s_dp)
    n = min(s_d.shape[0], s_dp.shape[0])
    if n < 4:
        raise InvalidParameter(f"an audit needs at least 4 trials per neighbour, got {n}")
    h = n // 2
    sel0, sel1, ev0, ev1 = s_d[:h], s_dp[:h], s_d[h:n], s_dp[h:n]
    best = None
    for e in candidate_events(sel0, sel1):
        k0, k1 = int(e.indicator(sel0).sum()), int(e.indicator(sel1).sum())
        for name, ka, kb in (("D' vs D", k1, k0), ("D vs D'", k0, k1)):
            val = epsilon_from_counts(ka, h, kb, h, delta, alpha)
            if best is None or val > best[0]:
                best = (val, e, name)
    if best is None:  # pragma: no cover - candidate_events always returns something for n >= 4
        return Bound(0.0, "none", n, 0.0, 0.0)
    _, e, name = best
    m = n - h
    k0, k1 = int(e.indicator(ev0).sum()), int(e.indicator(ev1).sum())
    ka, kb = (k1, k0) if name == "D' vs D" else (k0, k1)
    val = epsilon_from_counts(ka, m, kb, m, delta, alpha)
    return Bound(max(0.0, val), f"{e.describe()} ({name})", n, ka / m, kb / m)


__all__ = ["cp_lower", "cp_upper", "epsilon_from_counts", "Event", "candidate_events", "Bound", "held_out_bound"]
