"""``dpops simulate``: N seeded test-mode releases of a spec on a public sample, predicted against observed.

How. One pass of the release's own read, checks and contribution bounding over the sample, in test mode
(``pipelines.release_pipeline.sample_truth`` through ``dpops.release.pipeline_seam``), gives the exact bounded
aggregates per partition -- the numbers the release noises -- and the unbounded ones. Then ``draws`` seeded draws
of the release's own selection, noise and post-processing path (``pipelines.aggregate.select_and_noise``, the
function every Beam shard calls, with the plan's mechanisms) run on those aggregates, in blocks of replicated
partitions; ``dpops.analysis.simulation`` tallies each draw's error against the bounded truth and scores it
against the predictions of ``dpops.analysis.accuracy``. Running the whole Beam job N times would give the same
draws' distribution (the bounding is a function of the rows and the seed; only the noise differs between runs)
at N times the read's cost.

Privacy. The exact aggregates are not differentially private: they exist only inside this path, and this path
cannot reach private data by construction:
- the sample must be public data: under ``$DPOPS_PUBLIC_ROOTS``, not under a data root, not a link or copy of the
  spec's input (``dpops.analysis.sample_access.check_public_sample``; checked here and again on the pipeline
  side). There is no private flag (a decision: tune's flag records a read whose output is a spec patch; a
  simulation's output is the sample's exact errors, and private data has the release itself for that);
- the randomness is the test seed, always: ``keyed`` and ``os`` are refused, so no key is read and nothing could
  pass for a release;
- no ledger is opened and nothing is charged: a public sample is not the scope's data;
- nothing is written under an output or public root (``check_out_dir``, ``write_outputs``), and every
  output carries ``dpops.analysis.simulation.MARKER`` ("not publishable").
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dpops.analysis.simulation import MARKER, SCORED_TYPES, MetricTruth, SimulationScore
from dpops.errors import InvalidParameter, SpecError
from dpops.spec import refuse_metric_contributions

if TYPE_CHECKING:
    import pandas as pd

    from dpops.analysis.sample_access import SampleAccess
    from dpops.release_plan import ReleasePlan
    from dpops.spec import ReleaseSpec

RANDOMNESS = "test"
BLOCK_ROWS = 100_000  # replicated partitions per select_and_noise call (draws x partitions per block)
DEFAULT_DRAWS = 1000
DEFAULT_ALPHA = 1e-3


@dataclass(frozen=True)
class Simulation:
    """The outcome of ``simulate``: the score (table and checks), the bounding's effect and what was run."""

    spec: ReleaseSpec
    sample: SampleAccess
    draws: int
    seed: int
    partitions: int
    score: SimulationScore
    bounding: dict[str, int]
    # per partition of the sample (same order): its column values and each scored metric's exact bounded and
    # unbounded values (a public sample's; kept on the object for a notebook, not written to simulation.json)
    names: list[tuple[object, ...]]
    truths: dict[str, MetricTruth]
    seconds: float  # wall time (not part of ``to_dict``: the same seed gives the same document)

    @property
    def holds(self) -> bool:
        """Every prediction held within its statistical band."""
        return self.score.holds

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (``simulation.json``), marked as a simulation, not publishable; no clock time in it, so
        the same spec, sample, draws and seed give the same document."""
        return {"marker": MARKER, "publishable": False, "simulation": True, "release": self.spec.name,
                "spec_hash": self.spec.spec_hash, "sample": self.sample.location,
                "randomness": RANDOMNESS, "seed": self.seed, "draws": self.draws, "partitions": self.partitions,
                "bounding": self.bounding, **self.score.to_dict()}

    def frame(self) -> pd.DataFrame:
        """The table as a DataFrame (one row per metric and partition-size bucket)."""
        import pandas as pd

        return pd.DataFrame(self.score.to_dict()["rows"])


def _check_args(draws: int, seed: int, randomness: str, alpha: float, confidence: float | None) -> None:
    if randomness != RANDOMNESS:
        raise InvalidParameter(
            f"dpops simulate runs with test randomness only (got {randomness!r}): its draws are seeded and never "
            "publishable; a keyed or OS randomness would make them look like a release's. Drop --randomness or "
            "pass --randomness test")
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise InvalidParameter(f"--draws must be an integer >= 1, got {draws!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise InvalidParameter(f"--seed must be an integer, got {seed!r}")
    if not (0.0 < alpha < 1.0):
        raise InvalidParameter(f"--alpha (the checks' false-failure rate) must be in (0, 1), got {alpha!r}")
    if confidence is not None and not (0.0 < confidence < 1.0):
        raise InvalidParameter(f"--confidence must be in (0, 1), got {confidence!r}")


def public_sample(spec: ReleaseSpec, sample: str | os.PathLike[str]) -> SampleAccess:
    """``sample`` checked as public data (``dpops.analysis.sample_access.classify_sample``), or the refusal.

    Privacy reason: a simulation prints the exact errors of the sample's aggregates, so a sample under a data root,
    or a link or copy of the spec's input under a public root, is refused; unlike tune there is no flag to allow it
    (``SpecError``, exit 3, naming the path and what to do, never the file's content)."""
    from dpops.analysis.sample_access import FIELD, PrivateSample, classify_sample

    checked = classify_sample(spec, sample)
    if not isinstance(checked, PrivateSample):
        return checked
    what = (f"is under a public root, but it is the spec's private input {checked.twin} (the same file, or the same "
            "bytes)" if checked.twin is not None else "resolves under a data root, where private inputs live")
    raise SpecError(f"{FIELD} ({checked.path}) {what}. dpops simulate prints exact functions of the rows it reads, so "
                    "it runs on public or synthetic data under $DPOPS_PUBLIC_ROOTS only and has no flag to read "
                    "private data: simulate on a public or synthetic sample (dpops spec synth writes one for a copy "
                    "of the spec placed under a public root); private data is released, charged, by dpops release "
                    "run")


def _format(path: str, spec: ReleaseSpec) -> str:
    return "csv" if path.endswith(".csv") else "parquet" if path.endswith(".parquet") else spec.input.format


def _as_float(v: object) -> np.ndarray:
    """A released column as floats, NaN where suppressed (a pyarrow array with nulls)."""
    import pyarrow as pa

    if isinstance(v, (pa.Array, pa.ChunkedArray)):
        return np.asarray(v.cast(pa.float64()).to_numpy(zero_copy_only=False), np.float64)
    return np.asarray(v, np.float64)


def simulate(spec: ReleaseSpec | str | os.PathLike[str] | Mapping[str, Any], sample: str | os.PathLike[str], *,
             draws: int = DEFAULT_DRAWS, seed: int = 0, randomness: str = RANDOMNESS,
             confidence: float | None = None, alpha: float = DEFAULT_ALPHA) -> Simulation:
    """``draws`` seeded test-mode releases of ``spec`` on the public ``sample`` (module docstring), scored.

    ``confidence``: of the predicted intervals (default the spec's ``accuracy.confidence``, else 0.95); ``alpha``:
    the family-wise false-failure rate of the checks (``dpops.analysis.simulation``). Same spec, sample, draws and
    seed: the same numbers. Refuses a sample that is not public data, and any randomness but ``test``."""
    from dpops.analysis.loading import load
    from dpops.analysis.simulation import RankTally, Tally, metric_truths, predict_partitions, predict_quantiles, score
    from dpops.release.pipeline_seam import SampleTruthRequest, load_sample_truth
    from dpops.release_plan import plan_release

    t0 = time.time()
    _check_args(draws, seed, randomness, alpha, confidence)
    s = load(spec)
    # Its truths and partition sizes are the release's bound set's; a metric bounded by its own set would be
    # scored against the wrong truth (a wrong answer, not a leak), so such specs are refused, as tune refuses them.
    refuse_metric_contributions(s, "dpops simulate", "simulate a copy without metrics[].contribution, one per bound "
                                "set")
    access = public_sample(s, sample)  # refused before a row is read: not public, or the input in disguise
    conf = float(confidence if confidence is not None else (s.accuracy.confidence if s.accuracy else 0.95))
    plan = plan_release(s)
    truth = load_sample_truth()(SampleTruthRequest(s, access.location, _format(access.location, s), int(seed)))
    bounded = truth.bounded
    P = len(truth.names)
    units = np.asarray(bounded["unit_count"], np.int64)
    rows = np.asarray(bounded["count"], np.int64)
    truths = metric_truths(plan, bounded, truth.unbounded)
    preds = predict_partitions(plan, truths, rows, conf)
    tally = Tally(P, [k for k in truths if truths[k].type in SCORED_TYPES])
    qpreds = predict_quantiles(plan, bounded)
    ranks = RankTally(P, list(qpreds))
    columns = [k for k in tally.keys] + [c for q in qpreds.values() for c in q.columns]

    def sink(reps: int, released: np.ndarray, values: dict[str, np.ndarray]) -> None:
        tally.add(reps, released, values, truths, preds)
        ranks.add(released, values, qpreds)

    _draw(plan, bounded, P, draws, int(seed), s.name, columns, sink)
    result = score(plan, truths, preds, tally, units, alpha=alpha, confidence=conf, ranks=(qpreds, ranks))
    st = truth.stats
    to_bounding = int(np.asarray(truth.unbounded["count"], np.int64).sum())
    bounding = {"rows_read": int(st.get("rows_read", 0)),
                "rows_dropped_by_checks": int(sum(v for k, v in st.items() if k.startswith("dropped_"))
                                              + st.get("rows_outside_public_partitions", 0)),
                "rows_to_bounding": to_bounding, "rows_kept": int(rows.sum()),
                "rows_dropped_l0": int(st.get("rows_dropped_l0", 0)),
                "rows_dropped_linf": int(st.get("rows_dropped_linf", 0)),
                "values_clamped": int(st.get("values_clamped", 0))}
    return Simulation(s, access, draws, int(seed), P, result, bounding, list(truth.names), truths, time.time() - t0)


def _draw(plan: ReleasePlan, bounded: Mapping[str, np.ndarray], P: int, draws: int, seed: int, name: str,
          columns: list[str], sink: Callable[[int, np.ndarray, dict[str, np.ndarray]], None]) -> None:
    """``draws`` releases of the ``P`` partitions through ``select_and_noise``, in blocks of replicated partitions
    (each replica its own partition hash, so its selection and noise are independent draws); ``sink(reps, released,
    values)`` gets each block's released partition indices and the released ``columns`` (scored values)."""
    from dpops.noise.randomness import test_random
    from pipelines.aggregate import select_and_noise

    cols = plan.partition_columns
    per_block = max(1, min(draws, BLOCK_ROWS // max(P, 1)))
    done, block = 0, 0
    while done < draws:
        reps = min(per_block, draws - done)
        parts = np.arange(1, P * reps + 1, dtype=np.uint64)
        index = (np.arange(P * reps) % P).astype(np.int64)
        names = {int(h): (int(i),) * len(cols) for h, i in zip(parts, index, strict=True)}
        acc = {k: np.tile(v, (reps,) + (1,) * (v.ndim - 1)) for k, v in bounded.items()}
        public = plan.public_partitions is not None
        rng = test_random(seed, ("simulate", name, f"block={block}"))
        out = select_and_noise(0, parts, acc, names, plan, parts if public else None, names if public else None, rng)
        released = np.asarray(out[cols[0]], np.int64)
        sink(reps, released, {k: _as_float(out[k]) for k in columns})
        done += reps
        block += 1


def check_out_dir(spec: ReleaseSpec, out_dir: str | os.PathLike[str]) -> None:
    """Refuse ``out_dir`` under the spec's ``output.root``, an operator output root or a public root (``SpecError``,
    ``dpops.dataroots.check_analysis_out``): a simulation is not publishable, so it writes nothing where releases
    are staged and published or where files are read as public data. The CLI calls it before the simulation runs."""
    from dpops.dataroots import check_analysis_out

    check_analysis_out(out_dir, "--out", source=spec.source, output_root=spec.output_root,
                       what="a simulation's test-mode outputs")


def write_outputs(sim: Simulation, out_dir: str | os.PathLike[str]) -> dict[str, str]:
    """``simulation.json``, ``simulation.png`` (predicted against observed) and ``simulation.html`` in ``out_dir``;
    refused under an output or public root (``check_out_dir``). Each carries the not-publishable marker."""
    from dpops.analysis.simulation_output import html_page, plot_png
    from dpops.dataroots import write_analysis_files

    check_out_dir(sim.spec, out_dir)
    doc = sim.to_dict()
    png = plot_png(doc)
    # checked again on the opened directory, each file renamed into place (never written through a planted link)
    written = write_analysis_files(
        out_dir, {"simulation.json": (json.dumps(doc, indent=2, sort_keys=True, allow_nan=False) + "\n").encode(),
                  "simulation.png": png, "simulation.html": html_page(doc, png).encode("utf-8")},
        "--out", source=sim.spec.source, output_root=sim.spec.output_root, what="a simulation's test-mode outputs")
    return {"json": written["simulation.json"], "png": written["simulation.png"], "html": written["simulation.html"]}


__all__ = ["BLOCK_ROWS", "DEFAULT_ALPHA", "DEFAULT_DRAWS", "RANDOMNESS", "Simulation", "check_out_dir", "public_sample",
           "simulate", "write_outputs"]
