"""The ``dpops`` process's exit (``dpops.cli.main._leave_process``: ``gc.freeze()`` after the command returned).

Freezing the heap skips the interpreter's final collection; it must skip nothing else. A real ``release run
--publish`` (Beam's in-process runner, private rows on disk while it runs) in a child process whose temporary
directory is a fresh folder: the folder is empty afterwards, and the exit codes keep their classes (0 ok,
3 invalid spec, 5 budget refused). In-process callers (tests, click's runner) keep their own collector state.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpops.cli.main import main

ROOT = Path(__file__).resolve().parent.parent

SPEC = """
name: exit_check
input:
  path: "data/{{start:%Y-%m-%d}}.csv"
  format: csv
  columns: {{user_id: string, region: string, amount: float}}
privacy_unit: {{column: user_id, description: "a user-day", adjacency: add_remove}}
budget: {{scope: exit_scope, epsilon: {eps}, delta: 1.0e-6, noise: laplace}}
contribution: {{max_partitions_per_unit: 2, max_rows_per_unit_per_partition: 2}}
partitions: {{columns: [region], private: {{strategy: truncated_geometric}}}}
metrics:
  - {{type: count}}
  - {{type: sum, column: amount, bounds: [0, 100]}}
output: {{root: "out"}}
"""


def _dpops(tmp: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GX_ANALYTICS_ENABLED": "false", "SCARF_ANALYTICS": "false", "DO_NOT_TRACK": "true",
           "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp), "DPOPS_DATA_ROOTS": str(cwd / "data")}
    for k in ("DPOPS_LEDGER_URL", "DPOPS_MANIFESTS_DIR", "DPOPS_NOISE_KEY_FILE"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "dpops.cli.main", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_release_leaves_no_temporary_files_and_exits_with_its_code_class(tmp_path):
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    (work / "data").mkdir(parents=True)
    tmp.mkdir()
    lines = ["user_id,region,amount"] + [f"u{i % 300},r{i % 7},{(i * 37) % 120}" for i in range(3000)]
    for day in ("2024-01-01", "2024-01-02"):
        (work / "data" / f"{day}.csv").write_text("\n".join(lines) + "\n")
    (work / "spec.yaml").write_text(SPEC.format(eps=1.0))
    (work / "greedy.yaml").write_text(SPEC.format(eps=50.0))
    ledger = f"sqlite:///{work / 'ledger.db'}"
    assert _dpops(tmp, work, "key", "generate", str(work / "noise.key")).returncode == 0
    r = _dpops(tmp, work, "ledger", "--ledger", ledger, "scope", "create", "exit_scope", "--unit", "a user-day",
               "--unit-column", "user_id", "--epsilon", "10", "--delta", "1e-5", "--accountant", "basic",
               "--adjacency", "add_remove")
    assert r.returncode == 0, r.stderr
    run = ["--ledger", ledger, "--key-file", str(work / "noise.key"), "--no-gx-checks", "--json"]

    ok = _dpops(tmp, work, "release", "run", "spec.yaml", "--interval", "2024-01-01/2024-01-02", *run, "--publish")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert json.loads(ok.stdout)["state"] == "published"
    assert list(tmp.iterdir()) == []  # every temporary file of the run (private rows) is gone

    refused = _dpops(tmp, work, "release", "run", "greedy.yaml", "--interval", "2024-01-02/2024-01-03", *run)
    assert refused.returncode == 5, refused.stderr[-2000:]  # budget refused: the scope's cap is 10
    bad = _dpops(tmp, work, "release", "run", "missing.yaml", "--interval", "2024-01-02/2024-01-03", *run)
    assert bad.returncode in (2, 3), bad.stderr[-2000:]  # usage / invalid spec, never 0 or 1
    assert list(tmp.iterdir()) == []


def test_the_process_entry_freezes_the_heap_at_exit_and_keeps_the_exit_code(tmp_path):
    # atexit runs last-registered first: this probe, registered before main(), reports after main() returned.
    probe = ("import atexit, gc, sys\n"
             "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0, file=sys.stderr))\n"
             "from dpops.cli.main import main\n"
             "sys.argv = ['dpops', 'spec', 'check', 'missing.yaml']\n"
             "sys.exit(main())\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode in (2, 3), r.stderr
    assert "frozen True" in r.stderr


def test_an_in_process_call_leaves_the_callers_collector_alone(capsys):
    before = gc.get_freeze_count()
    assert main(["--version"]) == 0
    assert gc.get_freeze_count() == before


def test_the_process_entry_raises_the_young_generation_threshold_and_in_process_calls_do_not(tmp_path):
    from dpops.cli.main import GC_YOUNG_THRESHOLD

    probe = ("import gc, sys\n"
             "from dpops.cli import main as m\n"
             "seen = []\n"
             "real = m._main\n"
             "m._main = lambda args: (seen.append(gc.get_threshold()[0]), real(args))[1]\n"
             "sys.argv = ['dpops', '--version']\n"
             "rc = m.main()\n"
             "print('threshold', seen[0], file=sys.stderr)\n"
             "sys.exit(rc)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"threshold {GC_YOUNG_THRESHOLD}" in r.stderr
    before = gc.get_threshold()
    assert main(["--version"]) == 0
    assert gc.get_threshold() == before
