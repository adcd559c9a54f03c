"""A pytest plugin (registered by tests/conftest.py): the suite keeps running when a library closes pytest's
own capture file, and says which test found it.

Why: a library that wraps or closes the stream pytest put on ``sys.stdout`` closes pytest's capture file (an
``io.TextIOWrapper`` around ``sys.stdout.buffer`` does it when garbage-collected: at any moment, in any thread).
Every later test of that process then errors in pytest's own setup with "I/O operation on closed file", which
names the victims, never the cause; CI saw 707 such errors after one in-process Airflow test. Before each
phase of each test, a closed global capture is replaced by a fresh one (what it held since the last phase is
lost), with a warning on that test and a line on the process's real stderr. Only a test during which the file
closes still fails. It reads pytest's capture manager, whose internals may change: when they are not what it
expects, it does nothing.
"""

from __future__ import annotations

import os

import pytest


def closed_capture_file(config: pytest.Config) -> str | None:
    """Which of pytest's own global capture files (fd 1 / fd 2) is closed, if any (None when pytest's
    internals are not what this expects)."""
    capman = config.pluginmanager.getplugin("capturemanager")
    multi = getattr(capman, "_global_capturing", None)
    for name in ("out", "err"):
        tmpfile = getattr(getattr(multi, name, None), "tmpfile", None)
        if getattr(tmpfile, "closed", False):
            return name
    return None


def restart_global_capture(item: pytest.Item, closed: str, phase: str) -> None:
    """Replace pytest's closed global capture with a fresh one, and say so (a warning on the test that
    found it): what was captured since the last phase is lost, the test and those after it run as usual."""
    capman = item.config.pluginmanager.getplugin("capturemanager")
    try:
        capman._global_capturing.stop_capturing()  # puts fd 1/2 and sys.std* back; closing twice is harmless
    except Exception:  # noqa: BLE001 - the closed file may make part of the teardown fail; start afresh anyway
        pass
    capman._global_capturing = None
    capman.start_global_capturing()
    capman.suspend_global_capture(in_=False)  # between phases pytest keeps it suspended
    message = (f"pytest's capture of std{closed} was found closed at the {phase} of {item.nodeid} and restarted: "
               "this or an earlier test of this process left a library holding pytest's stream")
    os.write(2, f"\ndpops tests: {message}\n".encode())
    item.warn(pytest.PytestWarning(message))


def _guard(item: pytest.Item, phase: str) -> None:
    if closed := closed_capture_file(item.config):
        restart_global_capture(item, closed, phase)


# tryfirst hookwrappers run outside pytest's own capture wrapper, so the file is replaced before pytest
# resumes it (CI saw it close between a test's setup and its call).
@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item):
    """Check pytest's capture before setup."""
    _guard(item, "setup")
    yield


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_call(item: pytest.Item):
    """Check pytest's capture before the test body."""
    _guard(item, "call")
    yield


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item):
    """Check pytest's capture before teardown."""
    _guard(item, "teardown")
    yield
