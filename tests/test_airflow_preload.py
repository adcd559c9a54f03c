"""The deployment's Airflow local settings (deploy/airflow_config/airflow_local_settings.py), without Airflow.

The stack tests (tests/test_dags_airflow.py) check that a real scheduler preloads; these check which
processes preload and that a module that fails to import never stops the scheduler."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
SETTINGS = REPO / "deploy" / "airflow_config" / "airflow_local_settings.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dpops_test_local_settings", SETTINGS)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # argv here is pytest's: nothing is preloaded
    return mod


def test_only_the_airflow_scheduler_preloads() -> None:
    mod = _load()
    assert mod.is_scheduler(["/venv/bin/airflow", "scheduler"])
    assert mod.is_scheduler(["airflow", "scheduler", "--num-runs", "1"])
    for argv in (["airflow", "api-server"], ["airflow", "dag-processor"], ["airflow", "tasks", "run"],
                 ["airflow"], ["/venv/bin/python", "scheduler"], ["pytest", "scheduler"]):
        assert not mod.is_scheduler(argv), argv
    assert mod.__all__ == []  # Airflow takes the module's public names as cluster policies


def test_a_module_that_cannot_be_imported_is_named_not_raised() -> None:
    mod = _load()
    assert mod.preload(("json", "dpops_no_such_module_xyz")) == ["dpops_no_such_module_xyz"]


def test_every_preloaded_module_imports_and_the_switch_turns_it_off(tmp_path: Path) -> None:
    """In a fresh interpreter posing as ``airflow scheduler``: every module of the list is loaded after the
    settings module runs; with DPOPS_PRELOAD=0 none is."""
    probe = (  # not runpy.run_path: it replaces sys.argv[0] while the module runs
        "import sys, importlib.util\n"
        "sys.argv = ['airflow', 'scheduler']\n"
        f"spec = importlib.util.spec_from_file_location('airflow_local_settings', {str(SETTINGS)!r})\n"
        "mod = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(mod)\n"
        "print(','.join(m for m in mod.PRELOAD_MODULES if m not in sys.modules))\n"
    )
    import os

    env = {**os.environ, "PYTHONPATH": str(REPO), "GX_ANALYTICS_ENABLED": "false"}
    on = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=180)
    assert on.returncode == 0, on.stderr[-2000:]
    assert on.stdout.strip() == ""  # nothing missing
    off = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=180,
                         env={**env, "DPOPS_PRELOAD": "0"})
    assert off.returncode == 0, off.stderr[-2000:]
    assert "great_expectations" in off.stdout.strip().split(",")
