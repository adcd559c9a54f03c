"""A flagged private ``dpops tune``: the read on Beam workers, only the statistics back, the scoring pure.

``dpops tune --i-understand-this-reads-private-data --reason ...`` first records the access in the ledger
(``dpops.release.private_reads.open_sample``); this module then reads the private sample. Issue 27 item 1:
every private read is a Beam pipeline. The rows are read, checked, ranked by the release's bounding and
reduced to per-partition statistics on the workers (``pipelines.tuning``), with the driver path's reader,
streams and ``--seed`` semantics; only those statistics reach this process, where
``dpops.analysis.tuning.score`` (pure, the same function the public path uses) turns them into the
recommendation. The driver path's result for the same sample and seed is the same, bit for bit
(``tests/test_tune_beam.py``).

It lives with the release steps because it runs the pipeline over private data; ``dpops.analysis`` stays pure.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dpops.errors import InvalidParameter

if TYPE_CHECKING:
    from dpops.analysis.sample_access import SampleAccess
    from dpops.analysis.tuning import Candidate, TuneResult, TuneSetup, TuneStatistics
    from dpops.release.estimation import EstimationEngine
    from dpops.spec import ReleaseSpec


def tune_private(spec: ReleaseSpec | str | os.PathLike[str] | Mapping[str, Any], access: SampleAccess, *,
                 grid: Sequence[Candidate] | None = None, loss: str | None = None, confidence: float | None = None,
                 seed: int | None = None, engine: EstimationEngine | None = None,
                 setup: TuneSetup | None = None) -> TuneResult:
    """Tune on the private sample of ``access`` (recorded by ``open_sample(..., allow_private=True)``): the
    statistics computed by Beam (``private_statistics``), then scored by ``dpops.analysis.tuning.score``.

    ``engine``: where the read runs (``dpops.release.estimation.EstimationEngine``'s ``runner``,
    ``runner_options``, ``staging`` and ``buckets``, as for ``dpops estimate``); its name must be ``beam``.
    ``setup``: the run's ``prepare_tune`` when the caller made it already (the CLI does, before the ledger entry,
    so that a bad grid or loss costs no entry)."""
    from dpops.analysis.tuning import prepare_tune, score

    if not access.private or access.entry_id is None:
        raise InvalidParameter(f"tune_private: {access.location} is not a recorded private read; open it with "
                               "dpops.release.private_reads.open_sample(..., allow_private=True) (public samples: "
                               "dpops.analysis.tune)")
    setup = setup or prepare_tune(spec, grid=grid, loss=loss, confidence=confidence)
    stats = private_statistics(setup, access.location, seed, engine)
    check_sample_unchanged(access)
    return score(setup, stats)


def check_sample_unchanged(access: SampleAccess) -> None:
    """Refuse (``InputDataError``) statistics of a local sample that no longer shows the stat snapshot taken before
    its recorded fingerprint. Why: the Beam workers read the sample by name after the ledger entry; a file
    renamed over it or rewritten in between would be tuned on (and named in the patch's provenance) under the
    fingerprint of other bytes, so the entry would not say what was read. The access stays recorded (rows may
    have been read); the statistics are discarded, nothing is written. Local files and S3 objects have a snapshot
    (``dpops.inputs.input_stat_snapshot``); other object stores have none and are not checked."""
    from dpops.errors import InputDataError
    from dpops.inputs import input_stat_snapshot

    if access.stats is not None and input_stat_snapshot([access.location]) != access.stats:
        raise InputDataError(f"tune: {access.location} changed after its read was recorded (ledger entry "
                             f"{access.entry_id}); the statistics are discarded and nothing was written. Tune again "
                             "on a file that is no longer being written")


def check_private_engine(spec: ReleaseSpec, engine: EstimationEngine, key_path: str | None = None) -> None:
    """Refuse, before the private read is recorded, an engine a private tune cannot use: not ``beam``, or a
    ``staging`` that overlaps a data, public or output root or the key's directory (``check_scratch_location``:
    its scratch files are the sample's private rows), or a local one that cannot be created and written; without
    ``staging``, a ``$TMPDIR`` inside one of those places (``check_temp_scratch``)."""
    from dpops.dataroots import check_scratch_location, check_temp_scratch
    from dpops.release.estimation import prepare_local_staging

    if engine.name != "beam":
        raise InvalidParameter(f"a private tune reads on Beam workers only (issue 27 item 1); engine {engine.name!r} "
                               "is not allowed here; nothing was read")
    if engine.staging is not None:
        loc = check_scratch_location(engine.staging, "--staging", source=spec.source, spec_dir=spec.base_dir,
                                     output_root=spec.output_root, key_path=key_path)
        if loc.is_local:
            prepare_local_staging(str(loc.local_path), field="--staging")
    else:  # the pass's fresh scratch goes under $TMPDIR (``private_statistics``)
        check_temp_scratch("tune", source=spec.source, spec_dir=spec.base_dir, output_root=spec.output_root,
                           key_path=key_path)


def private_statistics(setup: TuneSetup, location: str, seed: int | None,
                       engine: EstimationEngine | None = None) -> TuneStatistics:
    """The statistics of the sample at ``location`` computed by the Beam pass ``pipelines.tuning`` under a private
    staging location: a fresh 0700 temporary directory, or a fresh prefix under ``engine.staging`` (workers on
    other machines reach it), removed afterwards whatever happens (the scratch files are exact rows)."""
    import dataclasses
    import shutil
    import tempfile
    import uuid

    from dpops.analysis.tuning import read_stream, sample_format
    from dpops.release.estimation import EstimationEngine
    from dpops.release.pipeline_seam import TuneStatisticsRequest, load_tune_statistics
    from pipelines.bounding import pair_salt

    eng = EstimationEngine.of(engine or EstimationEngine())
    check_private_engine(setup.spec, eng)  # again for API callers (the CLI checked before the ledger entry)
    read = dataclasses.replace(setup.read, format=sample_format(setup.spec, location))
    salt = pair_salt(read_stream(seed))  # the driver path's salt; shipped, so os randomness agrees on workers

    def request(staging: str) -> TuneStatisticsRequest:
        return TuneStatisticsRequest(read=read, sample_path=location, needs=setup.needs, seed=seed, salt=salt,
                                     staging_dir=staging, runner=eng.runner, runner_options=tuple(eng.runner_options),
                                     n_buckets=eng.buckets)

    if eng.staging is None:
        staging = tempfile.mkdtemp(prefix="dpops-tune-")  # 0700: the scratch files and statistics are exact
        try:
            return load_tune_statistics()(request(staging))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    from pipelines import fs

    staging = fs.join(eng.staging, f"dpops-tune-{uuid.uuid4().hex}")
    if fs.is_local(staging):
        os.makedirs(staging, mode=0o700)
    try:
        return load_tune_statistics()(request(staging))
    finally:
        fs.delete_everything_under(staging)


__all__ = ["check_private_engine", "check_sample_unchanged", "private_statistics", "tune_private"]
