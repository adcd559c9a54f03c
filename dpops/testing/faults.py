"""Named fault points, so tests can crash a release at a precise place in a real process.

A fault point is a no-op unless the environment variable ``DPOPS_FAULT`` names it::

    DPOPS_FAULT="<point>[@<n>][=<action>]"     e.g.  publish.after=kill   beam.noise@3=kill

- ``kill`` (default): SIGKILL this very process. No ``finally``, no atexit, no
  rollback in Python: exactly what an OOM killer or a lost worker does, so the
  state a retry finds is the state a real crash leaves.
- ``raise``: raise ``InjectedFault`` (not a ``DpopsError``: an unexpected crash).
- ``pause``: create ``$DPOPS_FAULT_DIR/<point>.reached`` and wait (up to 120 s) until
  ``$DPOPS_FAULT_DIR/<point>.go`` exists; the test breaks something meanwhile
  (terminates database connections, fills the disk) and lets the run go on.
- ``@n`` fires on the n-th time the point is reached in this process (default 1),
  e.g. inside a Beam DoFn after some shards were already written.

Only tests set ``DPOPS_FAULT``; the check costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

ENV = "DPOPS_FAULT"
DIR_ENV = "DPOPS_FAULT_DIR"
ACTIONS = ("kill", "raise", "pause")
PAUSE_LIMIT_S = 120.0

_hits: dict[str, int] = {}


class InjectedFault(RuntimeError):
    """Raised by a fault point whose action is ``raise``."""


def parse_fault(text: str) -> tuple[str, int, str]:
    """``"<point>[@<n>][=<action>]"`` -> (point, n, action)."""
    spec, _, action = text.partition("=")
    action = action or "kill"
    point, _, nth = spec.partition("@")
    if not point or action not in ACTIONS or (nth and not nth.isdigit()) or nth == "0":
        raise ValueError(f"{ENV}={text!r}: expected <point>[@<n>][=kill|raise|pause]")
    return point, int(nth or 1), action


def fault_point(name: str) -> None:
    """Crash, fail or pause here if ``DPOPS_FAULT`` names this point (see the module doc)."""
    text = os.environ.get(ENV)
    if not text:
        return
    point, nth, action = parse_fault(text)
    if point != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] != nth:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)  # the signal is asynchronous; never run on past the point
    if action == "raise":
        raise InjectedFault(f"injected fault at {name}")
    folder = Path(os.environ.get(DIR_ENV) or ".")
    (folder / f"{name}.reached").write_text(str(os.getpid()))
    deadline = time.monotonic() + PAUSE_LIMIT_S
    while not (folder / f"{name}.go").exists():
        if time.monotonic() > deadline:
            raise InjectedFault(f"fault point {name}: nobody said go within {PAUSE_LIMIT_S:.0f}s")
        time.sleep(0.05)


__all__ = ["ACTIONS", "ENV", "DIR_ENV", "InjectedFault", "fault_point", "parse_fault"]
