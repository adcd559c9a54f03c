"""Wall and CPU time per test file, for the suite's breakdown (README's suite-time row, conftest's SLOWEST_FIRST).

``make test`` is CPU-bound on a 2-core machine (three pytest processes), so what a file costs is its CPU time,
not its wall time (which other files' load inflates). With ``DPOPS_TEST_CPU_REPORT=DIR`` every pytest process
(each xdist worker) writes ``DIR/<worker>.json``: per test file, the wall seconds and the CPU seconds (user + sys)
of the process and of the children it waited for (``os.times``: subprocesses, and the Airflow stacks a module
fixture stops in the file's last teardown). ``python tests/cpu_report.py DIR`` adds the workers' files up and
prints the files by CPU, with the total. Not counted: each process's own start and collection (imports,
conftest), a few CPU-s per process, and the children a test left running. Off (nothing measured or written)
without the variable.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Iterator

import pytest

ENV = "DPOPS_TEST_CPU_REPORT"

_per_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # file -> [wall, cpu self, cpu children]


def _cpu() -> tuple[float, float]:
    t = os.times()
    return t.user + t.system, t.children_user + t.children_system


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Setup, call and teardown of ``item`` (a module fixture's teardown runs in its file's last item)."""
    if not os.environ.get(ENV):
        yield
        return
    wall0, (own0, kids0) = time.monotonic(), _cpu()
    yield
    own1, kids1 = _cpu()
    acc = _per_file[item.path.name]
    acc[0] += time.monotonic() - wall0
    acc[1] += own1 - own0
    acc[2] += kids1 - kids0


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get(ENV)
    if not out or not _per_file:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"{worker}.json").write_text(json.dumps({f: [round(v, 2) for v in a] for f, a in _per_file.items()}))


def summary(report_dir: Path) -> str:
    """The workers' files added up: one line per test file, most CPU first, then the total."""
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for path in sorted(report_dir.glob("*.json")):
        for name, values in json.loads(path.read_text()).items():
            files[name] = [a + b for a, b in zip(files[name], values)]
    rows = sorted(files.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))
    lines = [f"{'file':<48} {'wall s':>8} {'CPU s':>8} {'self':>8} {'children':>9}"]
    for name, (wall, own, kids) in rows:
        lines.append(f"{name:<48} {wall:8.1f} {own + kids:8.1f} {own:8.1f} {kids:9.1f}")
    wall, own, kids = (sum(v[i] for v in files.values()) for i in range(3))
    lines.append(f"{'total (' + str(len(files)) + ' files)':<48} {wall:8.1f} {own + kids:8.1f} {own:8.1f} {kids:9.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python {sys.argv[0]} DIR  (the DIR of a run with {ENV}=DIR)")
    print(summary(Path(sys.argv[1])))
