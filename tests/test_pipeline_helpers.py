"""Small helpers shared by the pipeline tests: write a spec and an input, run a release."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import yaml

from dpops.release.pipeline_seam import ComputeRequest

START, END = "2024-01-01T00:00:00+00:00", "2024-01-02T00:00:00+00:00"
COLUMNS = {"user_id": "string", "region": "string", "amount": "float", "category": "string"}


def write_spec(dir_: Path, metrics, partitions, *, fmt="parquet", columns=None, adjacency="add_remove",
               l0=2, linf=2, epsilon=1.0, delta=1e-7, noise="laplace", name="t") -> Path:
    doc = {
        "name": name,
        "input": {"path": "in/{start:%Y-%m-%d}." + fmt, "format": fmt, "columns": columns or COLUMNS},
        "privacy_unit": {"column": "user_id", "description": "a user-day", "adjacency": adjacency},
        "budget": {"scope": "s", "epsilon": epsilon, "delta": delta, "noise": noise},
        "contribution": {"max_partitions_per_unit": l0, "max_rows_per_unit_per_partition": linf},
        "partitions": partitions,
        "metrics": metrics,
    }
    path = dir_ / "spec.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def write_input(dir_: Path, rows: dict, fmt="parquet", schema=None) -> Path:
    path = dir_ / "in" / f"2024-01-01.{fmt}"
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(rows, schema=schema)
    if fmt == "parquet":
        pq.write_table(table, path)
    else:
        pcsv.write_csv(table, path)
    return path


def request(spec: Path, inputs, staging: Path, *, randomness="test", seed=7, key_path=None, fingerprint="fp1",
            runner="FnApiRunner", runner_options=()) -> ComputeRequest:
    from dpops.spec import load_spec

    label = {"release": "t", "spec_hash": load_spec(spec).spec_hash, "interval_start": START,
             "interval_end": END, "input_fingerprint": fingerprint}
    return ComputeRequest(
        spec_path=str(spec), interval_start=START, interval_end=END, input_paths=tuple(str(p) for p in inputs),
        noise_label=label, randomness=randomness, key_ref=key_path, test_seed=seed if randomness == "test" else None,
        staging_dir=str(staging), runner=runner, runner_options=tuple(runner_options))


def run(req: ComputeRequest):
    from pipelines.release_pipeline import run_release

    res = run_release(req)
    df = pq.read_table(res.output_file).to_pandas()
    summary = json.loads(Path(res.summary_file).read_text())
    return df, summary, res
