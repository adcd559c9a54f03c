"""Parameter checks refuse bad input with a message that names the problem."""

from __future__ import annotations

import math
import warnings

import pytest

from dpops.errors import InvalidParameter
from dpops.param_checks import check_bounds, check_delta, check_delta_for_population, check_epsilon


@pytest.mark.parametrize("eps", [0, -1, math.nan, math.inf, "1", None, True])
def test_epsilon_refused(eps):
    with pytest.raises(InvalidParameter, match="epsilon"):
        check_epsilon(eps)


@pytest.mark.parametrize("delta", [-1e-9, 1.0, 2, math.nan, None])
def test_delta_refused(delta):
    with pytest.raises(InvalidParameter, match="delta"):
        check_delta(delta)


def test_delta_against_population():
    with pytest.raises(InvalidParameter, match="1/n"):
        check_delta_for_population(1e-6, 1_000_000)
    assert check_delta_for_population(1e-8, 1_000_000) == 1e-8
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_delta_for_population(1e-4, None)
    assert any("above 1e-5" in str(w.message) for w in caught)


@pytest.mark.parametrize("lo,hi,frag", [(1, 0, "greater than"), (math.nan, 1, "lower"), (0, math.inf, "upper")])
def test_bounds_refused(lo, hi, frag):
    with pytest.raises(InvalidParameter, match=frag):
        check_bounds(lo, hi)
