"""tests/capture_guard.py: a library that closes pytest's capture file costs at most the test during which it
closed, never the rest of the process (CI once lost 707 tests to it), and the run says where it happened."""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent

CLOSER = '''
import gc, io, sys

KEEP = []

def test_wraps_pytests_stream():
    KEEP.append(io.TextIOWrapper(sys.stdout.buffer))  # closes pytest's file when collected

def test_drops_the_wrapper():
    KEEP.clear()
    gc.collect()  # pytest's capture file is closed here, in the middle of this test

def test_after_a_print():
    print("captured")
    assert sys.stdout.write("x") == 1

def test_after_with_capsys(capsys):
    print("hi")
    assert capsys.readouterr().out == "hi\\n"
'''


def _run(pytester, monkeypatch, *plugins: str):
    pytester.makepyfile(test_closer=CLOSER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    args = [a for p in plugins for a in ("-p", p)]
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", *args)


def test_without_the_guard_every_later_test_errors(pytester, monkeypatch):
    res = _run(pytester, monkeypatch)
    got = res.parseoutcomes()  # what CI saw: the two tests after it error in pytest's setup and teardown
    assert got.get("passed") == 1 and got.get("errors", 0) >= 4, got
    assert "I/O operation on closed file" in res.stdout.str()


def test_with_the_guard_only_the_test_during_which_it_closed_fails(pytester, monkeypatch):
    res = _run(pytester, monkeypatch, "capture_guard")
    res.assert_outcomes(passed=3, failed=1)
    res.stdout.fnmatch_lines(["*test_closer.py::test_drops_the_wrapper*ValueError*"])
    out = res.stdout.str() + res.stderr.str()
    assert "capture of stdout was found closed at the teardown of test_closer.py::test_drops_the_wrapper" in out
