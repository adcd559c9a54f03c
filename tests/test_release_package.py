"""``dpops.release``: the step functions are importable from the package, and no step function
shadows a module of the package (a test patching ``dpops.release.<module>.<name>`` must reach the module)."""

import importlib
import types

import dpops.release as release

MODULES = ("context", "preparation", "reservation", "computation", "pipeline_seam", "output_checks", "gx_checks",
           "manifests", "publication", "served", "estimation", "execute")


def test_package_exports_the_step_functions():
    from dpops.release import (RunContext, RunOutcome, abandon, compute, execute_release, execute_restatement,
                               prepare, publish, reserve, restate, status)

    for fn in (abandon, compute, execute_release, execute_restatement, prepare, publish, reserve, restate, status):
        assert callable(fn)
    assert RunContext.__module__ == "dpops.release.context" and RunOutcome.__module__ == "dpops.release.context"
    assert set(release.__all__) <= set(dir(release))


def test_no_name_shadows_a_module():
    for name in MODULES:
        mod = importlib.import_module(f"dpops.release.{name}")
        attr = getattr(release, name, mod)
        assert isinstance(attr, types.ModuleType) and attr is mod, name
