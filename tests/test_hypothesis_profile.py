"""Issue 25, "deterministic CI, exploring fuzz": the fixed-seed profile is what pytest runs, and no test opts out.

A property with a random seed lets a submission fail (or pass) on luck instead of on its own code; the
ci profile (tests/fuzz_support.py, loaded by tests/conftest.py) fixes the seed, and ``make fuzz`` explores.
These checks keep it that way: the profile is active with derandomize on, and no test file sets
``derandomize``, ``database`` or a ``@seed`` of its own (which would silently override the profile).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from fuzz_support import CI, FUZZ, active_profile, examples
from hypothesis import given, settings
from hypothesis import strategies as st

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


@pytest.mark.skipif(active_profile() != CI, reason="make fuzz runs the fuzz profile on purpose")
def test_ci_profile_is_active_with_derandomize_on():
    assert settings.default.derandomize is True
    assert settings.default.database is None
    assert settings.default.deadline is None
    assert examples(7) == 7  # each test's own budget


SEEN: list[int] = []


@settings(max_examples=examples(5))
@given(st.integers(0, 2**64))
def _draws(x):
    SEEN.append(x)


@pytest.mark.skipif(active_profile() != CI, reason="make fuzz runs the fuzz profile on purpose")
def test_a_property_draws_the_same_examples_every_run():
    """Run the same property twice in this process: derandomized, it sees the same examples both times."""
    SEEN.clear()
    _draws()
    first = list(SEEN)
    SEEN.clear()
    _draws()
    assert first == SEEN and len(first) == 5


def _opt_outs(path: Path) -> list[str]:
    """``derandomize=`` / ``database=`` keywords or a ``seed`` decorator in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", getattr(node.func, "attr", ""))
            found += [f"{path.name}:{node.lineno}: {name}({kw.arg}=...)" for kw in node.keywords
                      if kw.arg in ("derandomize", "database") and name in ("settings", "register_profile")
                      and path.name != "fuzz_support.py"]
            if name == "seed" and path.name != "fuzz_support.py":
                found.append(f"{path.name}:{node.lineno}: @seed(...)")
    return found


def test_no_test_file_overrides_the_profile_seed():
    offenders = [o for p in sorted(TESTS.glob("*.py")) for o in _opt_outs(p)]
    assert not offenders, "let the profile (tests/fuzz_support.py) decide the seed:\n" + "\n".join(offenders)


def test_the_check_finds_an_opt_out(tmp_path):
    bad = tmp_path / "test_bad.py"
    bad.write_text("from hypothesis import settings, seed\nS = settings(derandomize=False)\n\n@seed(3)\ndef f(): pass\n")
    assert len(_opt_outs(bad)) == 2


def test_fuzz_profile_explores_with_a_scaled_budget():
    """Under HYPOTHESIS_PROFILE=fuzz (what ``make fuzz`` sets): random seeds, print_blob, FUZZ_EXAMPLES x budget."""
    code = ("import fuzz_support as f; f.register_profiles(); from hypothesis import settings as s; "
            "d = s.default; print(d.derandomize, d.print_blob, d.max_examples, f.examples(7))")
    env = {"HYPOTHESIS_PROFILE": FUZZ, "FUZZ_EXAMPLES": "3", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], cwd=TESTS, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "300", "21"]


def test_make_fuzz_runs_a_property_with_the_fuzz_profile(tmp_path):
    """The documented ``make fuzz`` (README, Development), on one small property: it passes with random seeds.
    A fresh stamp file stands in for the installed venv (newer than pyproject.toml, so make installs nothing:
    this interpreter already has everything)."""
    import os

    stamp = tmp_path / "installed"
    stamp.touch()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYPOTHESIS_PROFILE", None)
    out = subprocess.run(["make", "-s", "fuzz", f"PY={sys.executable}", f"STAMP={stamp}", "FUZZ_EXAMPLES=1",
                          "FUZZ_JOBS=0", "FUZZ_FILES=tests/test_sensitivity.py",
                          "PYTEST_ARGS=-k quantile_utility_bound -p no:cacheprovider"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "1 passed" in out.stdout
    dry = subprocess.run(["make", "-n", "fuzz", f"PY={sys.executable}", f"STAMP={stamp}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout
    assert "HYPOTHESIS_PROFILE=fuzz" in dry and "-m hypothesis" in dry and "tests/test_spec_property.py" in dry
    assert "pip install" not in dry  # nothing but the fuzz run
