"""tests/cpu_report.py: with DPOPS_TEST_CPU_REPORT=DIR each pytest process writes wall and CPU per test file, the
CPU of waited-for children included, and ``python tests/cpu_report.py DIR`` ranks the files by CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

BUSY = '''
import subprocess, sys

def test_spins_in_this_process():
    x = 0
    for i in range(3_000_000):
        x += i

def test_spins_in_a_child():
    subprocess.run([sys.executable, "-c", "x = sum(range(30_000_000))"], check=True)
'''

IDLE = '''
import time

def test_sleeps():
    time.sleep(0.3)
'''


def _run(pytester, monkeypatch, *env: tuple[str, str]):
    pytester.makepyfile(test_busy=BUSY, test_idle=IDLE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    for k, v in env:
        monkeypatch.setenv(k, v)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "cpu_report")


def test_each_file_gets_its_wall_and_its_cpu_with_its_childrens(pytester, monkeypatch, tmp_path):
    out = tmp_path / "cpu"
    result = _run(pytester, monkeypatch, ("DPOPS_TEST_CPU_REPORT", str(out)))
    result.assert_outcomes(passed=3)
    (report,) = out.glob("*.json")
    assert report.name == "main.json"  # not under xdist: one process
    files = json.loads(report.read_text())
    assert set(files) == {"test_busy.py", "test_idle.py"}
    busy_wall, busy_self, busy_kids = files["test_busy.py"]
    idle_wall, idle_self, idle_kids = files["test_idle.py"]
    assert busy_kids > 0.2 and busy_self > 0.05  # the child's sum and this process's loop both count
    assert idle_wall >= 0.3 and idle_self + idle_kids < idle_wall  # a sleep is wall, not CPU
    text = subprocess.run([sys.executable, str(TESTS / "cpu_report.py"), str(out)], capture_output=True, text=True,
                          check=True).stdout
    lines = text.splitlines()
    assert lines[1].startswith("test_busy.py") and lines[2].startswith("test_idle.py")  # most CPU first
    assert lines[3].startswith("total (2 files)")
    total_cpu = float(lines[3].split()[-3])
    assert abs(total_cpu - (busy_self + busy_kids + idle_self + idle_kids)) < 0.05


def test_without_the_variable_nothing_is_written(pytester, monkeypatch, tmp_path):
    monkeypatch.delenv("DPOPS_TEST_CPU_REPORT", raising=False)
    result = _run(pytester, monkeypatch)
    result.assert_outcomes(passed=3)
    assert not list(Path(pytester.path).rglob("*.json"))
