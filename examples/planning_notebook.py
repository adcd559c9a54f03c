"""Example notebook (percent format): plan, solve and plot a release from its spec alone."""

# %% [markdown]
# # Plan before spending: predicted accuracy, targets solved into epsilon, the horizon
#
# Everything below is computed from a release spec alone: no data is read and nothing is charged.
# Run it as a script (`python examples/planning_notebook.py`) or open it as a percent-format notebook
# (Jupyter/VS Code). The test suite executes it (`tests/test_analysis_notebook.py`).

# %%
import os
import tempfile

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402

from dpops import analysis  # noqa: E402

OUT = os.environ.get("DPOPS_NOTEBOOK_OUT") or tempfile.mkdtemp(prefix="dpops-plan-")

# %% [markdown]
# A spec as a dict (a YAML path works the same): daily counts and mean spend per region, private
# partitions, with accuracy targets.

# %%
spec = analysis.load({
    "name": "notebook_demo",
    "schedule": "0 0 * * *",
    "input": {"path": "data/{start:%Y-%m-%d}.csv", "format": "csv",
              "columns": {"user_id": "string", "region": "string", "amount": "float"}},
    "privacy_unit": {"column": "user_id", "description": "a customer", "adjacency": "add_remove"},
    "budget": {"scope": "notebook", "epsilon": 1.0, "delta": 1e-7, "noise": "laplace"},
    "contribution": {"max_partitions_per_unit": 2, "max_rows_per_unit_per_partition": 3},
    "partitions": {"columns": ["region"], "private": {"strategy": "truncated_geometric"}},
    "metrics": [{"type": "count"}, {"type": "mean", "column": "amount", "bounds": [0, 100]}],
    "accuracy": {"confidence": 0.95, "targets": [
        {"kind": "error", "metric": "count", "max_relative_error": 0.05, "at_units": 1000},
        {"kind": "error", "metric": "mean_amount", "max_error": 2.0, "at_units": 1000},
        {"kind": "keep", "at_units": 200, "min_probability": 0.95},
    ]},
})

# %% [markdown]
# ## Predicted accuracy at the declared budget

# %%
table = analysis.plan(spec, at_units=1000)
print(table[["metric", "quantity", "distribution", "std", "abs_error", "rel_error", "probability"]])
for t in analysis.check_targets(spec):
    print(("met     " if t.met else "NOT MET ") + t.description, f"(predicted {t.predicted:.4g})")

# %% [markdown]
# ## Solve the targets into an epsilon split

# %%
sol = analysis.solve(spec)
print("feasible:", sol.feasible, "epsilon per interval:", round(sol.epsilon, 4))
print("split:", {k: round(v, 4) for k, v in sol.split.items()})
assert sol.feasible and all(t.met for t in analysis.check_targets(sol.spec))
# what to declare: the shares rounded to 4 significant digits and checked again (dpops plan --solve --out writes it
# as a patch for dpops spec apply-patch)
print("declare:", sol.spec_patch()["budget"])
assert all(t.met for t in analysis.check_targets(sol.patched_spec()))

# %% [markdown]
# ## Error against partition size, and the keep curve

# %%
sizes = [100, 200, 500, 1000, 2000, 5000, 10000]
errors = [float(analysis.plan(sol.spec, at_units=n).set_index("metric").loc["mean_amount", "abs_error"])
          for n in sizes]
from dpops.release_plan import plan_release  # noqa: E402

curve = analysis.keep_curve(plan_release(sol.spec), range(1, 300))
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
ax1.loglog(sizes, errors, marker="o")
ax1.set_xlabel("units in the partition")
ax1.set_ylabel("95% error of mean_amount")
ax2.plot([n for n, _ in curve], [p for _, p in curve])
ax2.set_xlabel("units in the partition")
ax2.set_ylabel("P(partition is published)")
fig.tight_layout()
fig.savefig(os.path.join(OUT, "planning.png"))
print("wrote", os.path.join(OUT, "planning.png"))

# %% [markdown]
# ## How long does a daily release last on a scope capped at epsilon = 30, from 2024-01-01?

# %%
# an interval is named as the CLI names one: a START ("2024-01-01") is the spec's period starting there
h = analysis.horizon_of(sol.patched_spec(), cap=30.0, delta=1e-5, intervals=365, start="2024-01-01",
                        accountants=["basic", "zcdp", "rdp"])
assert h.start == "2024-01-01T00:00:00Z"
for r in h.rows:
    print(f"{r.accountant}: {r.intervals_fit} intervals fit, cap reached on {r.cap_reached_on}")

# %%
print("\n".join(analysis.explain(sol.spec)))
