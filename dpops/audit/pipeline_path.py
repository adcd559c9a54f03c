"""The same audit through the whole Beam release pipeline (``run_release``), end to end.

The fast audits call the pipeline's functions directly and skip Beam's shuffles. This one runs
the real ``pipelines.release_pipeline.run_release`` (loaded lazily through
``dpops.release.pipeline_seam.load_run_release``, like ``dpops.release``; ``dpops`` itself never imports Beam):
it writes the neighbours D and D' as Parquet files and a copy of the spec whose public partitions
are the trial groups, runs the pipeline once per neighbour in test-randomness mode, and bounds ε
from the published ``data.parquet``. One pipeline run yields T trials (one per group of
partitions), so a few seconds of Beam give thousands of trials. Public-partition specs only.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np

from dpops.audit.harness import Harness
from dpops.audit.runner import AuditResult
from dpops.audit.scenarios import ScenarioBuilder
from dpops.audit.stats import held_out_bound
from dpops.errors import SpecError


def audit_metric_via_pipeline(spec, metric: str, *, trials: int = 1000, confidence: float = 0.99,
                              seed: int = 0, runner: str = "FnApiRunner") -> AuditResult:
    """Audit one metric of a public-partition spec through ``run_release`` itself (see the module docstring).

    Slower than ``audit_plan`` but covers what the direct calls skip: Beam's shuffles, the file I/O and
    the driver's merge. ``runner`` is a Beam runner name.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    from dpops.release.pipeline_seam import ComputeRequest, load_run_release
    from dpops.release_plan import SAFETY, plan_release
    from dpops.spec import parse_spec

    if spec.partitions.private is not None:
        raise SpecError(f"{spec.source}: the end-to-end pipeline audit needs public partitions")
    t0 = time.time()
    plan = plan_release(spec)
    m = next((x for x in plan.metrics if x.key == metric), None)
    if m is None:
        raise SpecError(f"{spec.source}: no metric {metric!r}; metrics are {[x.key for x in plan.metrics]}")
    deps = {metric} | ({m.count_from} if getattr(m, "count_from", None) else set())
    only = tuple(x for x in plan.metrics if x.key in deps)
    h = Harness(spec, dataclasses.replace(plan, metrics=only))
    sc = ScenarioBuilder(h).metric(metric)[0]  # at bounds
    n_parts = trials * sc.n_parts
    run_release = load_run_release()
    stats = []
    with tempfile.TemporaryDirectory(prefix="dpops-audit-beam-") as tmp:
        doc = spec.model_dump(mode="json", exclude_none=True)
        values = h.partition_values(n_parts)
        doc["partitions"] = {"columns": list(h.part_cols),
                             "public": values[0] if len(values) == 1 else [list(t) for t in zip(*values, strict=True)]}
        doc["metrics"] = [x for x in doc["metrics"] if _key(x) in deps]
        doc["postprocess"] = {**doc.get("postprocess", {}), "non_negative": False, "clamp_means_to_bounds": False,
                              "suppress_below": None}
        # The copy keeps only the audited metric(s), with the budget they had in the full plan
        # (Gaussian metrics are re-calibrated from that (ε, δ) share alone: slightly more noise).
        doc["budget"]["epsilon"] = sum(float(x.epsilon) for x in only) / SAFETY
        if sum(float(x.delta) for x in only) > 0:
            doc["budget"]["delta"] = sum(float(x.delta) for x in only) / SAFETY
        if doc["budget"].get("split"):
            doc["budget"]["split"] = {k: v for k, v in doc["budget"]["split"].items() if k in deps} or None
            if doc["budget"]["split"] is None:
                del doc["budget"]["split"]
        doc["input"]["format"] = "parquet"
        spec_path = Path(tmp) / "audit_spec.yaml"
        spec_path.write_text(yaml.safe_dump(doc, sort_keys=False))
        for world in (0, 1):
            data = Path(tmp) / f"world{world}.parquet"
            pq.write_table(pa.Table.from_batches([h.to_batch(sc.rows(world, trials), n_parts)]), data)
            req = ComputeRequest(
                spec_path=str(spec_path), interval_start="2026-01-01T00:00:00+00:00",
                interval_end="2026-01-02T00:00:00+00:00", input_paths=(str(data),),
                noise_label={"release": spec.name, "audit": f"world{world}"}, randomness="test",
                test_seed=seed * 2 + world, staging_dir=str(Path(tmp) / f"stage{world}"), runner=runner)
            res = run_release(req)
            table = pq.read_table(res.output_file).to_pydict()
            cols = {k: np.asarray(v) if k not in h.part_cols else v for k, v in table.items()}
            cols["_part"] = h.partition_index(list(table[h.part_cols[0]]))
            stats.append(sc.statistic(cols, trials))
    sub_plan = plan_release(parse_spec(doc, source=f"{spec.source} (audit copy)"))
    claimed = sum(float(x.epsilon) for x in sub_plan.metrics)
    delta = sum(float(x.delta) for x in sub_plan.metrics)
    b = held_out_bound(stats[0], stats[1], delta, 1.0 - confidence)
    return AuditResult(target=metric, mechanism=f"{m.type} (Beam {runner})", claimed_epsilon=claimed, delta=delta,
                       epsilon_lb=b.epsilon_lb, trials=trials, confidence=confidence, scenario="at_bounds",
                       event=b.event, passed=b.epsilon_lb <= claimed, seconds=round(time.time() - t0, 2))


def _key(metric_doc: dict) -> str:
    if metric_doc.get("name"):
        return metric_doc["name"]
    col = metric_doc.get("column")
    return f"{metric_doc['type']}_{col}" if col else metric_doc["type"]


__all__ = ["audit_metric_via_pipeline"]
