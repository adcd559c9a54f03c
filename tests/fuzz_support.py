"""Hypothesis profiles: a fixed seed in CI, random seeds in the long fuzz run (``make fuzz``).

Why a fixed seed in CI: a submission must land or fail on its own code. A property test with a random
seed can fail on a change that did not touch what it tests (issue 25 item 6a was found that way, on a
fresh clone), and pass again on retry; the CI result would then say nothing about the change. So
``make test`` runs every property derandomized (the seed is a function of the test) with no example
database (a database on one machine would change what runs on another). Exploring is the job of
``make fuzz``: random seeds, each property's own example budget times ``FUZZ_EXAMPLES``, and
``print_blob`` so a failure prints the ``@reproduce_failure`` line. A find becomes an explicit
``@example(...)`` on the property (copy the "Falsifying example" arguments), which the fixed-seed CI
runs from then on (e.g. ``tests/test_spec_property.py``'s ``ISSUE_25_6A``).

``tests/conftest.py`` registers and loads the profiles; tests write ``@settings(max_examples=examples(N))``
and never set ``derandomize`` or ``database`` themselves (``tests/test_hypothesis_profile.py`` checks).
"""

from __future__ import annotations

import os

from hypothesis import settings

CI = "ci"
FUZZ = "fuzz"
DEFAULT_FUZZ_SCALE = 20  # make fuzz: each property runs 20 times its CI example budget unless FUZZ_EXAMPLES says


def active_profile() -> str:
    """The profile this process runs: ``HYPOTHESIS_PROFILE`` (``ci`` unless set to ``fuzz``)."""
    name = os.environ.get("HYPOTHESIS_PROFILE", CI)
    if name not in (CI, FUZZ):
        raise ValueError(f"HYPOTHESIS_PROFILE={name!r}: use {CI!r} (fixed seeds, the default) or {FUZZ!r}")
    return name


def fuzz_scale() -> int:
    """``FUZZ_EXAMPLES``: how many times its CI budget each property runs under the fuzz profile."""
    raw = os.environ.get("FUZZ_EXAMPLES", "") or str(DEFAULT_FUZZ_SCALE)
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"FUZZ_EXAMPLES={raw!r}: give a whole number >= 1 (the factor on each test's example budget)")
    return int(raw)


def examples(n: int) -> int:
    """A property's example budget: ``n`` under the ci profile, ``n * FUZZ_EXAMPLES`` under fuzz."""
    return n if active_profile() == CI else n * fuzz_scale()


def register_profiles() -> None:
    """Register ``ci`` and ``fuzz`` and load the active one (called once, by tests/conftest.py)."""
    settings.register_profile(CI, derandomize=True, database=None, deadline=None, print_blob=True)
    settings.register_profile(FUZZ, derandomize=False, database=None, deadline=None, print_blob=True,
                              max_examples=examples(100))  # 100: Hypothesis' own default budget
    settings.load_profile(active_profile())
