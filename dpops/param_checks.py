"""Checks on privacy parameters shared by every module, so each error reads the same."""

from __future__ import annotations

import math
import warnings

from dpops.errors import InvalidParameter


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_epsilon(epsilon: float, name: str = "epsilon") -> float:
    if not _is_number(epsilon) or math.isnan(epsilon) or not math.isfinite(epsilon) or epsilon <= 0:
        raise InvalidParameter(f"{name} must be a finite number > 0, got {epsilon!r}")
    return float(epsilon)


def check_delta(delta: float, name: str = "delta", allow_zero: bool = True) -> float:
    ok = _is_number(delta) and not math.isnan(delta) and (0 <= delta < 1)
    if ok and not allow_zero and delta == 0:
        ok = False
    if not ok:
        lo = "[0, 1)" if allow_zero else "(0, 1)"
        raise InvalidParameter(f"{name} must be in {lo}, got {delta!r}")
    return float(delta)


def check_delta_for_population(delta: float, population: int | None, name: str = "delta") -> float:
    """semantics.md section 1: refuse delta >= 1/n when n is declared; warn above 1e-5."""
    check_delta(delta, name)
    if population is not None:
        if not isinstance(population, int) or population < 1:
            raise InvalidParameter(f"declared population must be a positive integer, got {population!r}")
        if delta > 0 and delta >= 1.0 / population:
            raise InvalidParameter(
                f"{name}={delta!r} is not below 1/n = {1.0 / population:.3g} for the declared "
                f"population n={population}: choose delta well below 1/n (e.g. <= {0.01 / population:.3g})"
            )
    if delta > 1e-5:
        warnings.warn(f"{name}={delta!r} is above 1e-5; a delta this large is rarely justified", stacklevel=2)
    return float(delta)


def check_positive(x: float, name: str) -> float:
    if not _is_number(x) or not math.isfinite(x) or x <= 0:
        raise InvalidParameter(f"{name} must be a finite number > 0, got {x!r}")
    return float(x)


def check_nonnegative(x: float, name: str) -> float:
    if not _is_number(x) or not math.isfinite(x) or x < 0:
        raise InvalidParameter(f"{name} must be a finite number >= 0, got {x!r}")
    return float(x)


def check_positive_int(x: int, name: str) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or x < 1:
        raise InvalidParameter(f"{name} must be an integer >= 1, got {x!r}")
    return x


def check_bounds(lo: float, hi: float, name: str = "bounds") -> tuple[float, float]:
    for v, which in ((lo, "lower"), (hi, "upper")):
        if not _is_number(v) or not math.isfinite(v):
            raise InvalidParameter(f"{name}: {which} bound must be a finite number, got {v!r}")
    if lo > hi:
        raise InvalidParameter(f"{name}: lower bound {lo!r} is greater than upper bound {hi!r}")
    return float(lo), float(hi)
