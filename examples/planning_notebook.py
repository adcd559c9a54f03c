"""Example notebook (percent format): plan, solve, simulate on a public sample, estimate bounds, and plot."""

# %% [markdown]
# # Plan before spending: predicted accuracy, targets solved into epsilon, simulated, the horizon
#
# Plan and solve are computed from a release spec alone: no data is read and nothing is charged. Simulate reads a
# public (here synthetic) sample and charges nothing; estimate reads the release's own input and is charged.
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
SPEC_DOC = {
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
}
spec = analysis.load(SPEC_DOC)

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
# ## Simulate the solved spec on a public sample
#
# `dpops simulate` (here its Python form): one test-mode pass of the release's read, checks and contribution
# bounding over a public sample gives the exact bounded aggregates per partition; 1,000 seeded draws of the
# release's own selection and noise path on them give observed std, coverage and keep rates to hold against the
# predictions. Only a sample under `$DPOPS_PUBLIC_ROOTS` is accepted (the notebook plays the operator and declares
# its synthetic sample's directory public); nothing is charged and nothing is publishable.

# %%
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import yaml  # noqa: E402

from dpops.analysis.tuning import apply_patch  # noqa: E402
from dpops.release import estimate_bounds, simulate, write_outputs  # noqa: E402


def synthetic(seed, sizes):
    """``sizes[r]`` customers in region r (a tenth of them in a second region too), 1-4 purchases per region of
    gamma-distributed amounts (some above the bound 100)."""
    rng = np.random.default_rng(seed)
    rows, uid = [], 0
    for r, n in enumerate(sizes):
        for _ in range(n):
            uid += 1
            regions = {r, int(rng.integers(len(sizes)))} if rng.random() < 0.1 else {r}
            for region in regions:
                rows += [(f"c{uid}", f"region{region}", float(rng.gamma(2.0, 20.0)))
                         for _ in range(int(rng.integers(1, 5)))]
    return pd.DataFrame(rows, columns=["user_id", "region", "amount"])


spec_dir, public = os.path.join(OUT, "spec"), os.path.join(OUT, "public")
os.makedirs(os.path.join(spec_dir, "data"), exist_ok=True)
os.makedirs(public, exist_ok=True)
os.environ["DPOPS_PUBLIC_ROOTS"] = public  # the operator's allow-list of public data
spec_path = os.path.join(spec_dir, "notebook_demo.yaml")
with open(spec_path, "w", encoding="utf-8") as fh:
    yaml.safe_dump(apply_patch(SPEC_DOC, sol.spec_patch()), fh, sort_keys=False)  # the solved split, declared
sizes = [60, 150, 400, 1500, 4000]
synthetic(1, sizes).to_csv(os.path.join(public, "sample.csv"), index=False)

sim = simulate(spec_path, os.path.join(public, "sample.csv"), draws=1000, seed=1)
print(sim.frame()[["metric", "bucket", "partitions", "predicted_std", "observed_std", "predicted_coverage",
                   "observed_coverage", "predicted_keep", "observed_keep", "bounding_bias"]].to_string(index=False))
print("bounding:", sim.bounding)
print("simulate:", "predictions hold" if sim.holds else "predictions do NOT hold",
      f"({len(sim.score.checks)} checks, false-failure rate {sim.score.alpha:g})")
assert sim.holds, sim.score.failed()
files = write_outputs(sim, os.path.join(OUT, "simulate"))
print("wrote", files["png"], files["html"])

# %% [markdown]
# ## Estimate the contribution and value bounds on the release's own data (charged)
#
# `dpops estimate` (here `estimate_bounds`): L0, Linf and the amount's bounds under differential privacy over one
# interval of the spec's input, charged to its scope in the ledger. The input here is synthetic too; test
# randomness keeps the notebook reproducible (a test-mode estimation is never published).

# %%
from dpops.ledger import ScopeDefinition, open_ledger  # noqa: E402

synthetic(2, sizes).to_csv(os.path.join(spec_dir, "data", "2024-01-01.csv"), index=False)
ledger_url = "sqlite:///" + os.path.join(OUT, "ledger.sqlite")
with open_ledger(ledger_url) as led:
    if "notebook" not in [s.name for s in led.scopes()]:
        led.create_scope(ScopeDefinition(name="notebook", unit="a customer", unit_column="user_id", epsilon=30.0,
                                         delta=1e-5, rho=None, accountant="basic/1", adjacency="add_remove"),
                         actor="notebook")
# quantile/1: the private partitions leave the error objective (error/1) no public list to weigh
est = estimate_bounds(spec_path, "2024-01-01", epsilon=0.5, ledger=ledger_url, randomness="test", test_seed=1,
                      method="quantile/1")
print("estimated:", est.result())
print(f"charged epsilon {est.epsilon_charged:.3g} to scope notebook")

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
